-- Operator decisions join the attempt log: `pigeon-mta queue cancel` and `queue retry` write one
-- row per recipient they touch (outcome 'cancelled' or 'retried', the response says who and how),
-- so that `pigeon-mta log` can say why a recipient stopped, or was tried again early.
ALTER TABLE attempt DROP CONSTRAINT attempt_outcome_check;
ALTER TABLE attempt ADD CONSTRAINT attempt_outcome_check CHECK (outcome IN
    ('delivered', 'deferred', 'bounced', 'expired', 'suppressed', 'cancelled', 'retried'));
