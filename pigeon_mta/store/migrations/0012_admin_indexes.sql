-- Indexes for the retention purge and the admin commands on a large database (measured with
-- bench/admin_bench.py: 1.09M recipients, 1.8M attempts, 55k suppression entries).
-- IF NOT EXISTS: on a large queue an operator may build them beforehand with CREATE INDEX
-- CONCURRENTLY, under these names and definitions (deploy/README.md, "Upgrades and large queues").

-- Deleting an attempt makes PostgreSQL set suppression.attempt_id to NULL where it pointed at it
-- (suppression_attempt_id_fkey, ON DELETE SET NULL): one lookup per deleted attempt. Without an
-- index each lookup read the whole suppression list, and one purge batch of 1,000 messages ran
-- into the 10 s statement_timeout. Only entries made by a bounce point at an attempt; the lookup's
-- "attempt_id = $1" implies the predicate, so it uses this index.
CREATE INDEX IF NOT EXISTS suppression_attempt ON suppression (attempt_id)
    WHERE attempt_id IS NOT NULL;

-- `suppress list` shows the newest entries first (ORDER BY created_at DESC, address LIMIT n):
-- read in this order instead of sorting the whole list.
CREATE INDEX IF NOT EXISTS suppression_created ON suppression (created_at DESC, address);

-- `queue list` shows live recipients oldest first (ORDER BY created_at, id LIMIT n). This index
-- holds only the live rows, in that order, so the listing reads its first n entries instead of
-- scanning and sorting the history. domain is the last key column so that `--domain` is checked
-- on the index entries, before the table is read. Every status a listing of live rows asks for
-- (queued, delivering, deferred = queued with attempts) implies the predicate.
CREATE INDEX IF NOT EXISTS recipient_live ON recipient (created_at, id, domain)
    WHERE status IN ('queued', 'delivering');
