-- Delay warnings (bounces.delay_warning_after): when the sender was told that this recipient is
-- still being retried, so that it is told once.
ALTER TABLE recipient ADD COLUMN delay_warned_at timestamptz;
-- The warning round reads the deferred rows not warned yet, oldest first. This index holds only
-- those (a deferral puts a row in, a claim or the mark takes it out), so a round with nothing to
-- warn reads nothing, however many rows are queued or were warned before.
CREATE INDEX recipient_warn_due ON recipient (created_at)
    WHERE status = 'queued' AND attempts > 0 AND delay_warned_at IS NULL;
