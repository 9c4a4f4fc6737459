-- Idempotency-Key of the HTTP API: a request repeated with the same key by the same org within
-- 24 hours gets the answer of the first and queues nothing. The row is written before the
-- message is queued and names the queue id the message is queued under: the message's primary
-- key then keeps a repeat that runs while the first is under way from queueing it twice, and a
-- repeat after a crash between the commit and the stored answer finds the message by that id.
CREATE TABLE idempotency_key (
    org_id        uuid NOT NULL REFERENCES org (id) ON DELETE CASCADE,
    key           text NOT NULL,
    request_hash  bytea NOT NULL,             -- sha256 of the method, path, query and body
    queue_id      uuid NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    status        integer,                    -- the answer, once given
    response      bytea,
    PRIMARY KEY (org_id, key)
);
-- Expired rows are pruned by the claims of new keys.
CREATE INDEX idempotency_key_created ON idempotency_key (created_at);
