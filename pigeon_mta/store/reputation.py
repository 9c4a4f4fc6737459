"""A tenant's reputation in numbers: recipients sent, hard bounces and complaints per org, lane and
hour (table reputation_count, migration 0029), and the pauses they lead to (reputation.py
decides: per org, the lanes together).

`count` adds what was recorded since the last count: attempts (delivered and bounced recipients;
hard bounces are those whose category suppresses) found through a block-range index of their
recording time, and feedback events (hard bounces reported later, complaints). It counts up to
`LAG` seconds ago, since a transaction's rows carry its start time and may become visible later
than younger ones; the mark row's lock keeps two nodes from counting one range. `rates` sums the
hours of the window.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pigeon_mta.store.executor import Executor, transaction
from pigeon_mta.store.suspensions import ACTIVE, ORG
from pigeon_mta.store.webhooks import org_event


def window_text(seconds: float) -> str:
    """A window as `org show` and a pause's reason word it: 24h, 90m."""
    hours = seconds / 3600
    return f"{hours:g}h" if hours >= 1 else f"{seconds / 60:g}m"


# Seconds behind now that counting stops: a record's transaction commits well within this.
LAG = 60.0

_COUNT = """
WITH mark AS (SELECT counted_to FROM reputation_mark FOR UPDATE),
upto AS (SELECT greatest(now() - make_interval(secs => $1), (SELECT counted_to FROM mark)) AS t),
a AS (
    SELECT a.org_id, COALESCE(r.lane, 'transactional') AS lane,
           date_trunc('hour', a.recorded_at) AS hour,
           count(*) FILTER (WHERE a.outcome IN ('delivered', 'bounced')) AS sent,
           count(*) FILTER (WHERE a.outcome = 'bounced' AND a.category = ANY ($2::text[]))
               AS bounced,
           0::bigint AS complained
    FROM attempt a LEFT JOIN recipient r ON r.id = a.recipient_id
    WHERE a.recorded_at > (SELECT counted_to FROM mark)
      AND a.recorded_at <= (SELECT t FROM upto) AND a.applied
    GROUP BY 1, 2, 3
), f AS (
    SELECT org_id, lane, date_trunc('hour', recorded_at) AS hour, 0::bigint AS sent,
           count(*) FILTER (WHERE kind = 'bounce' AND hard) AS bounced,
           count(*) FILTER (WHERE kind = 'complaint') AS complained
    FROM feedback_event
    WHERE recorded_at > (SELECT counted_to FROM mark) AND recorded_at <= (SELECT t FROM upto)
    GROUP BY 1, 2, 3
), n AS (
    SELECT org_id, lane, hour, sum(sent) AS sent, sum(bounced) AS bounced,
           sum(complained) AS complained
    FROM (SELECT * FROM a UNION ALL SELECT * FROM f) x
    WHERE EXISTS (SELECT FROM org o WHERE o.id = x.org_id)
    GROUP BY 1, 2, 3
), added AS (
    INSERT INTO reputation_count AS c (org_id, lane, hour, sent, bounced, complained)
    SELECT org_id, lane, hour, sent, bounced, complained FROM n
    ON CONFLICT (org_id, lane, hour) DO UPDATE
    SET sent = c.sent + EXCLUDED.sent, bounced = c.bounced + EXCLUDED.bounced,
        complained = c.complained + EXCLUDED.complained
    RETURNING 1
)
UPDATE reputation_mark SET counted_to = (SELECT t FROM upto)
RETURNING (SELECT count(*) FROM added) AS hours
"""


async def count(db: Executor, *, hard_categories: Sequence[str], lag: float = LAG) -> int:
    """Count what was recorded since the last count (up to `lag` seconds ago); returns the
    (org, hour) rows it added to. Old hours are deleted by `prune`."""
    async with transaction(db) as conn:
        # The lock first, in a statement of its own: the count then reads with a snapshot taken
        # once the lock is held, so it sees everything committed before the node that held it
        # let go (a statement waiting on the lock would read with its older snapshot and move
        # the mark past rows it never saw).
        await conn.execute("SELECT FROM reputation_mark FOR UPDATE")
        row = await conn.fetchrow(_COUNT, float(lag), list(hard_categories))
    return int(row["hours"]) if row is not None else 0


async def prune(db: Executor, *, keep: float) -> int:
    result = await db.execute(
        "DELETE FROM reputation_count WHERE hour < now() - make_interval(secs => $1)", float(keep)
    )
    return int(result.split()[-1])


@dataclass(frozen=True)
class OrgRates:
    org_id: uuid.UUID
    org: str
    sent: int
    bounced: int
    complained: int
    paused: str | None  # the reason of the suspension of the org in force, if any
    resumed_at: datetime | None

    @property
    def bounce_rate(self) -> float:
        return self.bounced / self.sent if self.sent else 0.0

    @property
    def complaint_rate(self) -> float:
        return self.complained / self.sent if self.sent else 0.0


_RATES = f"""
SELECT o.id, o.name, o.resumed_at,
       COALESCE(sum(c.sent), 0)::bigint AS sent, COALESCE(sum(c.bounced), 0)::bigint AS bounced,
       COALESCE(sum(c.complained), 0)::bigint AS complained,
       (SELECT x.reason FROM suspension x WHERE x.key = '{ORG}' || o.id AND {ACTIVE}) AS paused
FROM org o
LEFT JOIN reputation_count c ON c.org_id = o.id AND c.hour > now() - make_interval(secs => $1)
WHERE $2::uuid IS NULL OR o.id = $2
GROUP BY o.id
ORDER BY o.name
"""


async def rates(db: Executor, *, window: float, org_id: uuid.UUID | None = None) -> list[OrgRates]:
    """Every org's counts over the last `window` seconds (whole hours), or one org's."""
    rows = await db.fetch(_RATES, float(window), org_id)
    return [
        OrgRates(
            r["id"],
            r["name"],
            r["sent"],
            r["bounced"],
            r["complained"],
            r["paused"],
            r["resumed_at"],
        )
        for r in rows
    ]


@dataclass(frozen=True)
class LaneRates:
    lane: str
    sent: int
    bounced: int
    complained: int

    @property
    def bounce_rate(self) -> float:
        return self.bounced / self.sent if self.sent else 0.0

    @property
    def complaint_rate(self) -> float:
        return self.complained / self.sent if self.sent else 0.0


async def lane_rates(db: Executor, org_id: uuid.UUID, *, window: float) -> list[LaneRates]:
    """One org's counts over the window, per lane it sent in."""
    rows = await db.fetch(
        """SELECT lane, sum(sent)::bigint AS sent, sum(bounced)::bigint AS bounced,
                  sum(complained)::bigint AS complained
           FROM reputation_count
           WHERE org_id = $1 AND hour > now() - make_interval(secs => $2)
           GROUP BY lane ORDER BY lane""",
        org_id,
        float(window),
    )
    return [LaneRates(r["lane"], r["sent"], r["bounced"], r["complained"]) for r in rows]


_PAUSE = f"""
WITH p AS (
    INSERT INTO suspension AS x (key, until, reason, kind)
    VALUES ('{ORG}' || $1::uuid::text, NULL, $4, 'reputation')
    ON CONFLICT (key) DO UPDATE
    SET until = NULL, reason = EXCLUDED.reason, kind = 'reputation', created_at = now()
    WHERE NOT {ACTIVE}
    RETURNING 1
), e AS ({org_event("AND EXISTS (SELECT FROM p)")})
SELECT count(*) FROM p
"""


async def pause(db: Executor, rates: OrgRates, reason: str, *, window: float) -> bool:
    """Suspend the org's mail (kind 'reputation') with its `paused` webhook event, unless a
    suspension of it is in force; whether it was paused now."""
    data = {
        "reason": reason,
        "by": "reputation",
        "window_seconds": window,
        "sent": rates.sent,
        "hard_bounces": rates.bounced,
        "complaints": rates.complained,
        "bounce_rate": round(rates.bounce_rate, 6),
        "complaint_rate": round(rates.complaint_rate, 6),
    }
    paused = await db.fetchval(_PAUSE, rates.org_id, "paused", json.dumps(data), reason)
    return bool(paused)


async def mark_resumed(db: Executor, org_id: uuid.UUID) -> None:
    await db.execute("UPDATE org SET resumed_at = now() WHERE id = $1", org_id)
