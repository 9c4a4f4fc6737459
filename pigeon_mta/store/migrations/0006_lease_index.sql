-- recipient_leased becomes a partial index on lease_until IS NOT NULL (it was status = 'delivering').
--
-- Every statement that fences an outcome on its claim (record, renew, release: "... AND status =
-- 'delivering' AND attempts = $n") matched the old predicate, and with statistics taken while few
-- rows were in flight the planner scanned that whole index (every in-flight row) and hash-joined
-- it, instead of looking the batch's ids up in the primary key: with 10,000 recipients in flight,
-- recording 100 outcomes took 120 ms instead of 2, which is how a backlog of slow destinations
-- would have stalled the whole engine. lease_until is set exactly while a row is 'delivering' (the
-- claim sets it; record, release, the sweeper, expiry and cancel clear it), so the index still
-- serves the sweeper (lease_until < now() implies lease_until IS NOT NULL) and the in-flight count,
-- while the fenced statements, which never say lease_until IS NOT NULL, go by primary key.
DROP INDEX recipient_leased;
CREATE INDEX recipient_leased ON recipient (lease_until) WHERE lease_until IS NOT NULL;
