-- GET /v1/messages?status=bounced (or expired, cancelled, suppressed): an org's messages with a
-- recipient that ended so, newest first. Such recipients are few among the delivered ones, and
-- walking the org's messages newest first to find a page of them read the org's whole history
-- when they were rare. This index holds only those rows, in page order, so a page reads a page
-- (store/message_pages.py). A row enters it once, when it fails; the claim and the delivered
-- record, which change every other row, never touch it.
-- IF NOT EXISTS: on a large queue an operator may build it beforehand with CREATE INDEX
-- CONCURRENTLY, under this name and definition (deploy/README.md, "Upgrades and large queues").
CREATE INDEX IF NOT EXISTS recipient_failed ON recipient (org_id, status, created_at, message_id)
    WHERE status IN ('bounced', 'expired', 'cancelled', 'suppressed');
