-- Webhooks: an org's HTTP endpoints that are told what happened to its mail, and the outbox of
-- events waiting to be sent to them (pigeon_mta/webhooks/). An event row is written in the same
-- transaction that records the outcome it reports (store/leases.py _RECORD, store/upkeep.py
-- _EXPIRE), so a crash neither loses an event nor invents one.

CREATE TABLE webhook (
    id               uuid PRIMARY KEY,
    org_id           uuid NOT NULL REFERENCES org (id),
    url              text NOT NULL CHECK (url ~ '^https?://'),
    -- The event types the endpoint is sent (delivered, deferred, bounced, expired, suppressed).
    events           text[] NOT NULL,
    -- Standard Webhooks signing secret, "whsec_<base64>". Kept as it is, not hashed: every
    -- request is signed with it.
    secret           text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- The last request sent to the endpoint: its HTTP status (NULL: no reply), when, and why it
    -- failed (NULL after a 2xx).
    last_status      integer,
    last_attempt_at  timestamptz,
    last_error       text
);
-- The record statement looks up the webhooks of each outcome's org.
CREATE INDEX webhook_org ON webhook (org_id);

-- The outbox. No foreign key to webhook: each insert would lock the webhook row (FOR KEY SHARE),
-- and every transaction recording outcomes of one org would share that lock. Removing a webhook
-- deletes its events in the same transaction (store/webhooks.py).
CREATE TABLE webhook_event (
    id               uuid PRIMARY KEY,            -- the `webhook-id` header: receivers drop repeats
    webhook_id       uuid NOT NULL,
    type             text NOT NULL,
    payload          jsonb NOT NULL,              -- {"type", "timestamp", "data"}: the request body
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- When it is due; a sender's claim moves it one lease ahead, so that an event whose sender
    -- died is due again once the lease has passed.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- Requests made; the claim increments it, and an outcome is recorded only for the claim
    -- with that number (a fencing token, as recipient.attempts is).
    attempts         integer NOT NULL DEFAULT 0,
    state            text NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'delivered', 'failed')),
    last_status      integer,
    last_error       text,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
-- The sender's claim takes each webhook's due events oldest first; the backlog gauge counts them.
CREATE INDEX webhook_event_due ON webhook_event (webhook_id, next_attempt_at)
    WHERE state = 'pending';
-- Retention deletes finished events by age; `webhook list` counts failed ones.
CREATE INDEX webhook_event_finished ON webhook_event (created_at) WHERE state <> 'pending';

-- A UUIDv7 (RFC 9562) made in SQL, for event ids: time-ordered, like the ids the application
-- makes (pigeon_mta/ids.py), so the primary key grows at one end.
CREATE FUNCTION pigeon_uuid7() RETURNS uuid LANGUAGE sql VOLATILE AS $$
SELECT encode(
    set_bit(set_bit(
        overlay(uuid_send(gen_random_uuid())
                PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                                  FROM 3)
                FROM 1 FOR 6),
        52, 1), 53, 1),
    'hex')::uuid
$$;
