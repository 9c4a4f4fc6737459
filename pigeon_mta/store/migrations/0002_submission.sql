-- Submission: failed SMTP AUTH attempts (for throttling by client IP, across processes and nodes)
-- and an index that counts a credential's recent messages (for its message rate limit).

-- Not tenant data: a failed attempt has no org. Rows older than the throttling window are pruned
-- whenever a new failure is recorded.
CREATE TABLE auth_failure (
    id          uuid PRIMARY KEY,
    client_ip   inet NOT NULL,
    username    text,                    -- as the client sent it (may name no credential)
    listener    text NOT NULL,
    failed_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX auth_failure_ip ON auth_failure (client_ip, failed_at);
CREATE INDEX auth_failure_time ON auth_failure (failed_at);

-- Only authenticated mail has a credential: trusted-network mail pays nothing for this index.
CREATE INDEX message_credential_received ON message (credential_id, received_at)
    WHERE credential_id IS NOT NULL;
