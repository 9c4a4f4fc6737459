-- Node identity: which run of `pigeon-mta serve` holds each server.node_name, and when it last said
-- it is alive. A run (one start of serve: its supervisor and the worker processes that die with
-- it) writes `<name>/<run_id>` as the owner of the leases it takes. A starting node takes the name
-- over only from a run that stopped cleanly or whose heartbeat is stale, and then frees the leases
-- of the runs before it (store/nodes.py, store/leases.py: free_leases_of_gone_runs).
CREATE TABLE node (
    name          text PRIMARY KEY,
    run_id        text NOT NULL,
    host          text NOT NULL,
    pid           integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    -- Set by a clean stop: the name is free at once.
    stopped_at    timestamptz
);
