-- Delay warnings (bounces.delay_warning_after): when the sender was told that this recipient is
-- still being retried, so that it is told once. No index: the warning round reads the deferred
-- rows through recipient_deferred (queued after at least one attempt), the size of the trouble.
-- Setting it changes no indexed column, so the update can stay on its page (HOT).
ALTER TABLE recipient ADD COLUMN delay_warned_at timestamptz;
