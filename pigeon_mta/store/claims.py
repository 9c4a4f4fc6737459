"""The queue's outbound claim: due recipients taken under a lease, fairly between orgs and lanes
and within each destination site's room.

Workers claim due recipients with FOR UPDATE SKIP LOCKED under a lease; the claim increments
`attempts`, which then serves as a fencing token: an outcome is applied only while the row is still
`delivering` with the attempt number of that claim (store/outcomes.py records them), so a worker
whose lease ran out cannot overwrite the work of the claim that replaced it. Renewing, releasing
and sweeping leases is store/leases.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import asyncpg

from pigeon_mta.model import (
    ClaimedRecipient,
    ClaimedRow,
    Reply,
)
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.suppression import SUPPRESSION_ACTIVE

# Cross-tenant by design: the claim serves every org's queue, fairly. Due recipients fall into
# (org, lane) groups. Each lane with due mail gets a share of the batch by its weight (one place at
# least), and a lane's share is split evenly between its orgs; with more orgs than places, the
# orgs that get one are picked at random, so lane weights hold however many orgs a lane has (500
# bulk orgs do not crowd out one transactional org). Ordered by age or by org id, old backlogs or
# old tenants would come first at every claim. What the shares leave unused (a group with fewer
# due rows than its share) goes to further due rows of the groups, taken in random order, so a
# lone backlog gets the whole batch (the claim is work-conserving) and the leftover never falls
# to the same tenant. One org's backlog of any size thus delays another org's due mail by at
# most one claim.
#
# A recipient of a message with an ordering key (the send intent's `order_key`) is taken only
# when no recipient of an earlier message of its org, with the same key and address, is still
# queued or being delivered (index recipient_order, migration 0031): mail of one key reaches each
# recipient in the order it was received (`order_at`), and mail without a key is never held by
# it. Only these two claims need the rule: a keyed recipient enters a site's queue or the retry
# queue only after a claim took it (store/leases.py `_JOIN_SITE` moves no keyed row), and a
# keyed message is never handed off at its commit (store/group_commit.py).
_IN_ORDER = """(recipient.order_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM recipient e
            WHERE e.org_id = recipient.org_id AND e.order_key = recipient.order_key
              AND lower(e.address) = lower(recipient.address)
              AND (e.order_at, e.message_id) < (recipient.order_at, recipient.message_id)
              AND e.status IN ('queued', 'delivering')))"""

# `groups` walks the partial index recipient_due_group (org_id, lane, next_attempt_at) of queued
# rows one (org, lane) at a time (a skip scan: one index descent per group, whatever the rows per
# group, landing on the group's oldest row); `due` keeps those whose oldest row is due; `lanes`
# and `shares` weigh them. `fair` takes each group's share oldest first, `rest` fills the batch; both lock
# with SKIP LOCKED, so claims of several workers pass each other. ARRAY(...) makes each locking
# subquery run once. One row per recipient, grouped in Python (outbound/claims.py): grouping in
# SQL (array_agg ... ORDER BY per column and group) cost PostgreSQL about a seventh of the claim
# (bench/README.md "Queue").
_CLAIM = f"""
WITH RECURSIVE groups AS (
    (SELECT org_id, lane, next_attempt_at AS oldest FROM recipient
     WHERE status = 'queued' AND site IS NULL
     ORDER BY org_id, lane, next_attempt_at LIMIT 1)
    UNION ALL
    SELECT n.* FROM groups g CROSS JOIN LATERAL (
        SELECT org_id, lane, next_attempt_at FROM recipient
        WHERE status = 'queued' AND site IS NULL AND (org_id, lane) > (g.org_id, g.lane)
        ORDER BY org_id, lane, next_attempt_at LIMIT 1) n
), due AS (
    SELECT g.org_id, g.lane, COALESCE(w.weight, 1.0) AS weight,
           count(*) OVER (PARTITION BY g.lane) AS orgs,
           row_number() OVER (PARTITION BY g.lane ORDER BY random()) AS pick
    FROM groups g
    LEFT JOIN unnest($4::text[], $5::float8[]) AS w (lane, weight) ON w.lane = g.lane
    WHERE g.oldest <= now() AND NOT suspended(g.org_id, g.lane)
      AND g.org_id <> ALL ($7::uuid[])
), by_site AS MATERIALIZED (
    -- Half the batch at most while due mail without a site waits, so neither starves; of an
    -- org, no more than the engine's room for it.
    SELECT * FROM site_pick(
        CASE WHEN EXISTS (SELECT 1 FROM due) THEN ($3::int + 1) / 2 ELSE $3::int END,
        $4::text[], $5::float8[], $6::float8, 60, $9::uuid[], $10::int[], $8::int)
), site_taken AS (
    SELECT org_id, count(*)::int AS n FROM by_site WHERE id IS NOT NULL GROUP BY org_id
), batch AS (
    SELECT $3::int - (SELECT count(*) FROM by_site WHERE id IS NOT NULL)::int AS n
), lanes AS (
    SELECT lane, greatest(1, floor((SELECT n FROM batch) * weight / sum(weight) OVER ()))::int
               AS share
    FROM (SELECT DISTINCT lane, weight FROM due) l
), shares AS (
    -- `room`: what the engine has room for of the org ($9, $10; $8 for an org it holds none of),
    -- less what the site queues gave of it; when it is less than this claim's part of the batch,
    -- split between the org's lanes (the heavier first for what does not divide), so that no
    -- group takes what another group of its org needs (the engine claims again at once when a
    -- lane left its part unused, outbound/engine.py).
    SELECT s.org_id, s.lane, s.turn, s.share,
           CASE WHEN s.org_room >= (SELECT n FROM batch) THEN s.org_room
                ELSE s.org_room / s.org_lanes
                     + CASE WHEN s.lane_pick <= s.org_room % s.org_lanes THEN 1 ELSE 0 END
           END::int AS room
    FROM (
        SELECT d.org_id, d.lane, random() AS turn,
               (l.share / d.orgs + CASE WHEN d.pick <= l.share % d.orgs THEN 1 ELSE 0 END)::int
                   AS share,
               greatest(0, coalesce(a.room, $8::int) - coalesce(st.n, 0)) AS org_room,
               count(*) OVER (PARTITION BY d.org_id) AS org_lanes,
               row_number() OVER (PARTITION BY d.org_id ORDER BY d.weight DESC, d.lane)
                   AS lane_pick
        FROM due d JOIN lanes l USING (lane)
        LEFT JOIN unnest($9::uuid[], $10::int[]) AS a (org_id, room) ON a.org_id = d.org_id
        LEFT JOIN site_taken st ON st.org_id = d.org_id
    ) s
), fair AS (
    SELECT x.id, s.org_id, s.lane FROM (SELECT * FROM shares WHERE share > 0 ORDER BY turn) s
    CROSS JOIN LATERAL (
        SELECT id FROM recipient
        WHERE status = 'queued' AND org_id = s.org_id AND lane = s.lane
          AND site IS NULL AND next_attempt_at <= now() AND {_IN_ORDER}
        ORDER BY next_attempt_at LIMIT least(s.share, s.room)
        FOR UPDATE SKIP LOCKED) x
    LIMIT (SELECT n FROM batch)
), fair_taken AS (
    SELECT org_id, lane, count(*)::int AS n FROM fair GROUP BY org_id, lane
), rest AS (
    SELECT x.id FROM (
        SELECT s.*, coalesce(t.n, 0) AS taken FROM shares s
        LEFT JOIN fair_taken t USING (org_id, lane) ORDER BY s.turn) s
    CROSS JOIN LATERAL (
        SELECT id FROM recipient
        WHERE status = 'queued' AND org_id = s.org_id AND lane = s.lane
          AND site IS NULL AND next_attempt_at <= now() AND {_IN_ORDER}
          AND id <> ALL (ARRAY (SELECT id FROM fair))
        -- The group's room less its fair rows: every row taken is kept, so the batch fills.
        ORDER BY next_attempt_at
        LIMIT greatest(0, least($3::int, s.room - s.taken))
        FOR UPDATE SKIP LOCKED) x
    LIMIT greatest(0, (SELECT n FROM batch) - (SELECT count(*) FROM fair))
), wake AS (
    -- Deferred recipients whose next attempt is due leave the retry queue (migration 0024): the
    -- next claim finds them (this one reads the table as it was when it began).
    UPDATE recipient r SET site = NULL
    WHERE r.id = ANY (ARRAY (
        SELECT id FROM recipient
        WHERE status = 'queued' AND site = 'later' AND next_attempt_at <= now()
        ORDER BY next_attempt_at LIMIT 10 * $3::int
        FOR UPDATE SKIP LOCKED))
), c AS (
    UPDATE recipient r
    SET status = 'delivering',
        lease_until = now() + make_interval(secs => $1),
        lease_owner = $2,
        attempts = r.attempts + 1,
        updated_at = now()
    WHERE r.id = ANY (ARRAY (SELECT id FROM fair UNION ALL SELECT id FROM rest
                             UNION ALL SELECT id FROM by_site WHERE id IS NOT NULL))
    RETURNING r.id, r.message_id, r.domain, r.address, r.attempts, r.created_at, r.last_code,
              r.last_enhanced_code, r.last_response, r.lane, r.site
)
SELECT m.id AS queue_id, m.org_id, m.sender, m.header_message_id, m.received_at, c.domain,
       c.lane,
       c.id, c.address, c.attempts, c.created_at, c.last_code, c.last_enhanced_code,
       c.last_response,
       -- Each body once, on one row of its message, however many recipients and destination
       -- domains it has (a large message to a hundred recipients is read and sent once).
       CASE WHEN row_number() OVER (PARTITION BY m.id) = 1 THEN m.body END AS body,
       -- The org's suppression list, read by the claim itself (one statement less per round;
       -- if it cannot be read, nothing is claimed). Addresses compare as the list stores them.
       s.reason AS suppressed,
       c.site, p.delay AS site_delay, m.expires_at
FROM c JOIN message m ON m.id = c.message_id
LEFT JOIN suppression s ON s.org_id = m.org_id AND s.address = lower(c.address)
                       AND {SUPPRESSION_ACTIVE}
LEFT JOIN by_site p ON p.id = c.id
UNION ALL
-- When the claim should come back for the sites it could not serve: one row without a
-- recipient, if any.
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, min(delay), NULL
FROM by_site WHERE id IS NULL HAVING count(*) > 0
"""


# How far ahead the site claim takes a site's tokens: the rows wait in the engine (at most this
# long) for their token, so that the site sends at its rate between two claims.
SITE_AHEAD = 0.25


@dataclass(frozen=True)
class Claim:
    """What one claim took: rows (one per recipient, in no particular order; each message's body
    on one of them), and `come_back`: the seconds after which a site the claim could not serve
    (its room used up or its budget held) should have room again, None when there is none."""

    rows: list[ClaimedRow]
    come_back: float | None


async def claim_due_recipients(
    db: Executor,
    *,
    owner: str,
    lease: float,
    batch: int,
    lane_weights: Mapping[str, float] | None = None,
    ahead: float = SITE_AHEAD,
    org_cap: int | None = None,
    org_room: Mapping[uuid.UUID, int] | None = None,
) -> Claim:
    """Claim up to `batch` due recipients, shared fairly between (org, lane) groups by
    `lane_weights` (a lane missing from it weighs 1), from the site queues as far as their
    budgets have room (`ahead` seconds of tokens) and from the rest of the queue: at most
    `org_room[org]` of an org there (none of one whose room is 0) and `org_cap` of any other.
    `group_deliveries` (outbound/claims.py) makes the deliveries."""
    weights = dict(lane_weights or {})
    room = dict(org_room or {})
    rows = []
    come_back = None
    for row in await db.fetch(
        _CLAIM,
        float(lease),
        owner,
        batch,
        list(weights),
        [float(w) for w in weights.values()],
        float(ahead),
        [org for org, n in room.items() if n <= 0],
        batch if org_cap is None else max(0, org_cap),
        list(room),
        [max(0, n) for n in room.values()],
    ):
        if row["id"] is None:
            come_back = max(0.0, row["site_delay"])
            continue
        rows.append(
            ClaimedRow(
                queue_id=row["queue_id"],
                org_id=row["org_id"],
                sender=row["sender"],
                header_message_id=row["header_message_id"],
                received_at=row["received_at"],
                domain=row["domain"],
                body=row["body"],
                lane=row["lane"],
                site=row["site"],
                site_delay=row["site_delay"] or 0.0,
                expires_at=row["expires_at"],
                recipient=ClaimedRecipient(
                    id=row["id"],
                    address=row["address"],
                    attempts=row["attempts"],
                    queued_at=row["created_at"],
                    suppressed=row["suppressed"],
                    last_reply=_last_reply(row),
                ),
            )
        )
    return Claim(rows, come_back)


def _last_reply(row: asyncpg.Record) -> Reply | None:
    """The reply a recipient's previous attempt recorded (a local failure's code 0 is NULL)."""
    if row["last_response"] is None:
        return None
    return Reply(row["last_code"] or 0, row["last_enhanced_code"], row["last_response"])
