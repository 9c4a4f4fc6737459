-- Duplicate submissions (limits.duplicate_window). An application that retries after a lost 250
-- sends the same message again, under the same Message-ID. Each recipient queued under a
-- Message-ID its client supplied has an entry here until its window ends; the enqueue statement
-- (store/duplicates.py) writes the entry, and a recipient whose entry is still in force is not
-- queued again. The primary key decides between two identical submissions in parallel: the
-- second waits for the first one's commit, then finds its entry.
CREATE TABLE submission_dedup (
    org_id       uuid NOT NULL,
    message_key  uuid NOT NULL,              -- BLAKE2b-128 of the Message-ID: any length fits
    address      text NOT NULL,              -- lower(), as the suppression list keys addresses
    queue_id     uuid NOT NULL,              -- the message that queued this recipient
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (org_id, message_key, address)
);
-- The maintenance sweep deletes entries whose window has ended. They are written in expiry order
-- (one window for all), which a BRIN index serves at almost no cost to the enqueue.
CREATE INDEX submission_dedup_expiry ON submission_dedup USING brin (expires_at);

-- A recipient that a retried submission named again and that was not queued again: the event
-- `pigeon-mta log` shows as Duplicate, beside the Reception of the message that did queue it.
-- One row per recipient; the retention sweep deletes them with the messages of their age.
CREATE TABLE duplicate_reception (
    id                 uuid PRIMARY KEY,     -- UUIDv7, made by the application
    org_id             uuid NOT NULL,
    -- No foreign keys: the original may be purged first, and a duplicate is only a record.
    original_id        uuid NOT NULL,        -- the message that queued this recipient
    reply_id           uuid NOT NULL,        -- the queue id in the 250 the client got
    header_message_id  text NOT NULL,
    sender             text NOT NULL,        -- '' is the null sender
    address            text NOT NULL,        -- as the client wrote it
    received_at        timestamptz NOT NULL,
    listener           text NOT NULL,
    client_ip          inet,
    client_helo        text,
    auth_user          text,
    size               integer NOT NULL,
    tls_version        text,
    tls_cipher         text
);
CREATE INDEX duplicate_reception_original ON duplicate_reception (original_id);
