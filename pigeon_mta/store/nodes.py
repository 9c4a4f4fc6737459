"""Node runs: which run of `serve` holds each node name, its heartbeat, and its clean stop.

One row per node name. A starting run takes the row over only when the run holding it is gone:
it stopped cleanly, its heartbeat is older than `stale_after` seconds, or it is the run that the
starter knows to be dead (the one that last held the same data_dir lock, pigeon_mta/node.py). The
take-over is one statement, so two runs starting together cannot both get the name. Times are the
database's clock, the one every node shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class NodeHolder:
    """The run that holds a node name, as a refused starter reports it."""

    name: str
    run_id: str
    host: str
    pid: int
    started_at: datetime
    heartbeat_age: float  # seconds since its last heartbeat


_TAKE_NAME = """
INSERT INTO node AS n (name, run_id, host, pid) VALUES ($1, $2, $3, $4)
ON CONFLICT (name) DO UPDATE
SET run_id = EXCLUDED.run_id, host = EXCLUDED.host, pid = EXCLUDED.pid,
    started_at = now(), heartbeat_at = now(), stopped_at = NULL
WHERE n.stopped_at IS NOT NULL
   OR n.heartbeat_at < now() - make_interval(secs => $5)
   OR n.run_id = $6
RETURNING run_id
"""

_HOLDER = """
SELECT name, run_id, host, pid, started_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM node WHERE name = $1
"""


async def take_node_name(
    db: Executor,
    *,
    name: str,
    run_id: str,
    host: str,
    pid: int,
    stale_after: float,
    known_dead_run: str = "",
) -> NodeHolder | None:
    """Make `run_id` the live run of `name`. Returns None when it is, else the live run that holds
    the name (and nothing is written)."""
    row = None
    # A second round only if the holder's row went between the two statements (nothing in pigeon
    # deletes one; an operator might).
    for _ in range(2):
        taken = await db.fetchval(
            _TAKE_NAME, name, run_id, host, pid, float(stale_after), known_dead_run or None
        )
        if taken is not None:
            return None
        row = await db.fetchrow(_HOLDER, name)
        if row is not None:
            break
    if row is None:
        raise RuntimeError(f"node name {name!r} can be neither taken nor read")
    return NodeHolder(**dict(row))


# Only while the row is still this run's: a run that finds it taken over was judged dead.
_BEAT = """
UPDATE node SET heartbeat_at = now()
WHERE name = $1 AND run_id = $2 AND stopped_at IS NULL
"""


async def beat(db: Executor, *, name: str, run_id: str) -> bool:
    """Refresh the run's heartbeat. False: another run has taken the name over."""
    return await db.execute(_BEAT, name, run_id) == "UPDATE 1"


_STOPPED = "UPDATE node SET stopped_at = now() WHERE name = $1 AND run_id = $2"


async def mark_stopped(db: Executor, *, name: str, run_id: str) -> None:
    """A clean stop: the name is free at once for the node's next start."""
    await db.execute(_STOPPED, name, run_id)
