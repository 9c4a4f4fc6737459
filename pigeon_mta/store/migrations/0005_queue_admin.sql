-- Queue administration: the `pigeon-mta queue` summary lists the destinations with the most deferred
-- recipients and the latest reply from each. This partial index holds only deferred rows (queued
-- after at least one attempt), so it follows the size of the trouble, not of the history: the count
-- per domain is an index-only scan and the latest reply of a domain one backward step. A claim
-- moves a row out of the predicate, so fresh mail that is delivered at once never touches it.
CREATE INDEX recipient_deferred ON recipient (domain, updated_at)
    WHERE status = 'queued' AND attempts > 0;
