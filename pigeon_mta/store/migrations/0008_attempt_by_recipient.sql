-- The attempt log is reached through its recipients only: attempt_message goes.
--
-- Recording an outcome inserts one attempt row per recipient, and every index of `attempt` is one
-- more insert into a B-tree for it; PostgreSQL spends a third of the claim + record cycle's CPU
-- inserting index entries (perf, bench/README.md "Queue"). The readers that went by message id
-- (`pigeon-mta log`, the purge) now go message -> recipient_message -> attempt_recipient, which
-- is as direct: every attempt belongs to one recipient of its message. Measured: claim + record
-- 4-7% more recipients/s without it, A/B on one machine.
DROP INDEX attempt_message;
