-- Feedback: return-path domains and their VERP tokens, the reports that come back to them (async
-- bounces, complaint reports), and what each report was found to say about a recipient.

-- The domain a sender domain's mail leaves with as its envelope sender (b-TOKEN@return_path);
-- NULL: [bounces] return_path_domain, else the sender's own address.
ALTER TABLE sender_domain
    ADD COLUMN return_path text CHECK (return_path = lower(return_path) AND return_path <> '');

-- The keys that sign VERP tokens. The newest unretired key signs; a retired key still verifies
-- tokens for [bounces] feedback_max_age after its retirement. `id` is the token's key byte.
CREATE TABLE return_path_key (
    id          smallint PRIMARY KEY CHECK (id BETWEEN 0 AND 255),
    secret      bytea NOT NULL CHECK (length(secret) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    retired_at  timestamptz
);

-- Every message the feedback listener accepted, as it came, once: `report_key` is its
-- Message-ID, or a hash of its body when it has none, so a repeat changes nothing.
CREATE TABLE feedback (
    id            uuid PRIMARY KEY,
    received_at   timestamptz NOT NULL DEFAULT now(),
    report_key    text NOT NULL UNIQUE,
    listener      text NOT NULL,
    client_ip     inet,
    helo          text,
    mail_from     text NOT NULL,
    rcpt_to       text[] NOT NULL,
    body          bytea NOT NULL,
    -- new: not read yet; applied: events recorded; unmatched: understood, but naming no
    -- recipient pigeon sent to; not-understood: kept for an operator (`pigeon-mta feedback`).
    status        text NOT NULL DEFAULT 'new'
                  CHECK (status IN ('new', 'applied', 'unmatched', 'not-understood')),
    kind          text CHECK (kind IN ('bounce', 'delay', 'complaint')),
    detail        text,
    processed_at  timestamptz,
    -- When an unread message is read next: at once, or later when the recipient it is about
    -- was still being delivered (the report came before the outcome was recorded).
    read_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX feedback_new ON feedback (read_at) WHERE status = 'new';
CREATE INDEX feedback_received ON feedback (received_at);

-- What a report said of one recipient pigeon sent to: an asynchronous bounce (hard or soft), a
-- delay or a complaint. Recipient rows may be pruned before these: no foreign key to them.
CREATE TABLE feedback_event (
    id             uuid PRIMARY KEY,
    feedback_id    uuid NOT NULL REFERENCES feedback (id) ON DELETE CASCADE,
    recipient_id   uuid NOT NULL,
    message_id     uuid NOT NULL,
    org_id         uuid NOT NULL REFERENCES org (id),
    lane           text NOT NULL,
    address        text NOT NULL,
    kind           text NOT NULL CHECK (kind IN ('bounce', 'delay', 'complaint')),
    hard           boolean NOT NULL,
    code           int,
    enhanced_code  text,
    response       text,
    category       text,
    feedback_type  text,
    -- Whether it moved the recipient (delivered -> bounced).
    changed_state  boolean NOT NULL DEFAULT false,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    -- Feedback repeats: one event per recipient and kind, whichever report came first.
    UNIQUE (recipient_id, kind)
);
CREATE INDEX feedback_event_org ON feedback_event (org_id, recorded_at);

-- A complaint suppresses too; an entry made by a report points at its event.
ALTER TABLE suppression DROP CONSTRAINT suppression_source_check;
ALTER TABLE suppression ADD CONSTRAINT suppression_source_check
    CHECK (source IN ('bounce', 'manual', 'complaint'));
ALTER TABLE suppression
    ADD COLUMN feedback_event_id uuid REFERENCES feedback_event (id) ON DELETE SET NULL;
