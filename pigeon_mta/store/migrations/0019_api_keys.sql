-- API keys: what an application presents to the HTTP API ("Authorization: Bearer KEY"). A key
-- belongs to one org and sends only for it. Only the SHA-256 of the key is stored: the key is a
-- high-entropy random string (store/apikeys.py), so a fast hash leaves nothing to guess, and the
-- key itself is shown once, by `pigeon-mta apikey add`.
CREATE TABLE api_key (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES org (id) ON DELETE CASCADE,
    name          text NOT NULL DEFAULT '',
    lane          text,                      -- the lane of its mail unless a request names one
    key_hash      bytea NOT NULL UNIQUE,     -- sha256(key)
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    last_used_at  timestamptz
);
CREATE INDEX api_key_org ON api_key (org_id);

-- The messages of one API key in a time window (limits.credential_rate_limit holds for a key as
-- for an SMTP user): API mail is stored with listener 'api' and auth_user 'apikey:<id>'.
CREATE INDEX message_api_key_received ON message (auth_user, received_at)
    WHERE listener = 'api';
