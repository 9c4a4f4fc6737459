-- Lanes: a class of mail with its own share of the delivery capacity ([lanes] in the settings).
-- A message's lane is chosen when it is received; its recipients carry a copy, so that the claim
-- reads the due rows of each (org, lane) group from one index without a join.
ALTER TABLE message ADD COLUMN lane text NOT NULL DEFAULT 'transactional';
ALTER TABLE recipient ADD COLUMN lane text NOT NULL DEFAULT 'transactional';
-- The lane of the mail an AUTH user sends (NULL: the listener's, else the default lane).
ALTER TABLE credential ADD COLUMN lane text;

-- The fair claim (store/leases.py) walks the (org, lane) groups that have queued rows and takes
-- each group's due rows oldest first: one index serves both, and it holds only queued rows. It
-- replaces recipient_due (next_attempt_at of queued rows): with both, the planner may take one
-- group's due rows from recipient_due, walking past every other group's backlog to find them, and
-- every state change of a recipient row would write one more index entry.
CREATE INDEX recipient_due_group ON recipient (org_id, lane, next_attempt_at)
    WHERE status = 'queued';
DROP INDEX recipient_due;
