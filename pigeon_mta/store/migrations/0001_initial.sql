-- pigeon-mta schema, version 1: tenants, credentials, sender domains and DKIM keys, the queue
-- (message + recipient), the append-only attempt log and the suppression list.
-- Ids are UUIDv7 made by the application (time-ordered); every timestamp is timestamptz.

CREATE TABLE org (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE CHECK (name <> ''),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE credential (
    id             uuid PRIMARY KEY,
    org_id         uuid NOT NULL REFERENCES org (id),
    username       text NOT NULL UNIQUE CHECK (username <> ''),
    password_hash  text NOT NULL,            -- scrypt, "scrypt$n$r$p$salt$hash"; never plain
    disabled       boolean NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL DEFAULT now(),
    disabled_at    timestamptz
);
CREATE INDEX credential_org ON credential (org_id);

-- A domain belongs to one org: that org's users may send as it, and its DKIM keys sign for it.
CREATE TABLE sender_domain (
    id          uuid PRIMARY KEY,
    org_id      uuid NOT NULL REFERENCES org (id),
    domain      text NOT NULL UNIQUE CHECK (domain = lower(domain) AND domain <> ''),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sender_domain_org ON sender_domain (org_id);

CREATE TABLE dkim_key (
    id           uuid PRIMARY KEY,
    org_id       uuid NOT NULL REFERENCES org (id),
    domain_id    uuid NOT NULL REFERENCES sender_domain (id),
    selector     text NOT NULL CHECK (selector ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$'),
    algorithm    text NOT NULL CHECK (algorithm IN ('rsa', 'ed25519')),
    key_bits     integer,
    private_key  text NOT NULL,              -- PEM (PKCS#8); readable only by the service's role
    public_key   text NOT NULL,              -- base64, the p= of the DNS record
    active       boolean NOT NULL DEFAULT true,
    created_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (domain_id, selector)
);

CREATE TABLE message (
    id              uuid PRIMARY KEY,        -- the queue id answered in "250 ... queued as <id>"
    org_id          uuid NOT NULL REFERENCES org (id),
    sender          text NOT NULL,           -- '' is the null sender
    header_message_id text,                  -- Message-ID header, without angle brackets
    size            integer NOT NULL,
    body            bytea NOT NULL,          -- stored once, whatever the recipient count
    received_at     timestamptz NOT NULL DEFAULT now(),
    listener        text NOT NULL,
    client_ip       inet,
    client_helo     text,
    credential_id   uuid REFERENCES credential (id),
    auth_user       text
);
ALTER TABLE message ALTER COLUMN body SET STORAGE EXTERNAL;  -- bodies are already compact text; skip TOAST compression CPU
CREATE INDEX message_header_id ON message (header_message_id);
CREATE INDEX message_org_received ON message (org_id, received_at);

-- The queue row: one per envelope recipient.
CREATE TABLE recipient (
    id                  uuid PRIMARY KEY,
    message_id          uuid NOT NULL REFERENCES message (id) ON DELETE CASCADE,
    org_id              uuid NOT NULL,
    address             text NOT NULL,
    domain              text NOT NULL,       -- lower-case, as routed
    status              text NOT NULL DEFAULT 'queued' CHECK (status IN
                          ('queued', 'delivering', 'delivered', 'bounced', 'expired',
                           'cancelled', 'suppressed')),
    attempts            integer NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL,
    next_attempt_at     timestamptz NOT NULL,
    lease_until         timestamptz,
    lease_owner         text,
    last_code           integer,
    last_enhanced_code  text,
    last_response       text,
    updated_at          timestamptz NOT NULL DEFAULT now()
);
-- The claim reads due rows in next_attempt_at order; the partial index holds only queued rows,
-- so its size follows the live queue, not the history.
CREATE INDEX recipient_due ON recipient (next_attempt_at) WHERE status = 'queued';
-- The lease sweeper reads only rows being delivered.
CREATE INDEX recipient_leased ON recipient (lease_until) WHERE status = 'delivering';
CREATE INDEX recipient_message ON recipient (message_id);
CREATE INDEX recipient_address ON recipient (address, created_at);

-- Append-only: one row per delivery try (or final decision) per recipient.
CREATE TABLE attempt (
    id              uuid PRIMARY KEY,
    -- No foreign key: its check trigger cost a fifth of the batched record statement, and the
    -- log must outlive nothing but its recipient (purges delete both together).
    recipient_id    uuid NOT NULL,
    message_id      uuid NOT NULL,
    org_id          uuid NOT NULL,
    attempt         integer NOT NULL,        -- the recipient's attempt number
    started_at      timestamptz NOT NULL,
    duration_ms     double precision NOT NULL DEFAULT 0,
    mx_host         text,
    ip              text,
    port            integer,
    tls_version     text,
    tls_cipher      text,
    code            integer,
    enhanced_code   text,
    response        text,
    outcome         text NOT NULL CHECK (outcome IN
                      ('delivered', 'deferred', 'bounced', 'expired', 'suppressed')),
    category        text,                    -- bounce classification (invalid-recipient, ...)
    rule            text,                    -- the classification rule that matched
    next_attempt_at timestamptz,
    -- false when the recipient row had moved on (its lease ran out and another claim took it)
    applied         boolean NOT NULL DEFAULT true,
    recorded_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX attempt_recipient ON attempt (recipient_id, started_at);
CREATE INDEX attempt_message ON attempt (message_id);

CREATE TABLE suppression (
    id          uuid PRIMARY KEY,
    org_id      uuid NOT NULL REFERENCES org (id),
    address     text NOT NULL CHECK (address = lower(address)),
    reason      text NOT NULL,
    source      text NOT NULL CHECK (source IN ('bounce', 'manual')),
    attempt_id  uuid REFERENCES attempt (id) ON DELETE SET NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    UNIQUE (org_id, address)
);
