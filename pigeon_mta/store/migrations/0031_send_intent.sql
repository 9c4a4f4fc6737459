-- The send intent (intake/intent.py): a deadline after which no attempt starts, a schedule before
-- which none does (the recipients' created_at and first next_attempt_at are then the schedule's),
-- an ordering key (copied to each recipient with its place, order_at: the claim passes over a
-- recipient while an earlier one of the same org, key and address is not final), and the
-- application's metadata.
ALTER TABLE message
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN send_at timestamptz,
    ADD COLUMN order_key text,
    ADD COLUMN metadata jsonb;
-- A keyed recipient's place in its key's order: when its message was received (the message id,
-- a UUIDv7 whose bits after the millisecond are random, breaks ties only).
ALTER TABLE recipient ADD COLUMN order_key text, ADD COLUMN order_at timestamptz;

-- The claim's ordering rule (store/claims.py `_IN_ORDER`): the live recipients of keyed mail,
-- by org, key, address and the order they were received in.
CREATE INDEX recipient_order ON recipient (org_id, order_key, lower(address), order_at, message_id)
    WHERE order_key IS NOT NULL AND status IN ('queued', 'delivering');

-- GET /v1/messages?metadata.NAME=value (store/message_pages.py): the messages with metadata.
CREATE INDEX message_metadata ON message USING gin (metadata jsonb_path_ops)
    WHERE metadata IS NOT NULL;

-- The sweeper's deadline expiry (store/upkeep.py `expire_past_deadline`): messages by deadline.
CREATE INDEX message_deadline ON message (expires_at) WHERE expires_at IS NOT NULL;
