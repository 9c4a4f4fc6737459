-- The AUTH failure count of each client IP (limits.max_auth_failures), one row per IP. A failure
-- adds one with a single INSERT ... ON CONFLICT DO UPDATE that returns the new count: the row lock
-- orders concurrent failures of one IP, so each gets its own count and the one past the limit is
-- known to the statement that makes it. The count starts over once its window has passed.
-- auth_failure stays the record of each failure (username, listener).
CREATE TABLE auth_throttle (
    client_ip     inet PRIMARY KEY,
    failures      integer NOT NULL,
    window_start  timestamptz NOT NULL     -- the first failure of the current window
);
-- Rows whose window has passed are pruned by the failures of other IPs.
CREATE INDEX auth_throttle_window ON auth_throttle (window_start);
