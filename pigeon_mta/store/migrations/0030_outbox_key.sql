-- The idempotency keys of the outboxes in applications' databases (outbox/, store/outbox_keys.py):
-- the queue id each key was given before its message was committed, so that a relay that dies
-- between its commit here and the write-back there answers the row again with the same message.
CREATE TABLE outbox_key (
    org_id      uuid NOT NULL REFERENCES org (id) ON DELETE CASCADE,
    outbox      text NOT NULL,
    key         text NOT NULL,
    queue_id    uuid NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, outbox, key)
);
CREATE INDEX outbox_key_created ON outbox_key (created_at);
