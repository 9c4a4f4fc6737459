"""The claim beside mail an ordering key holds back: how long one claim of 100 takes when one
(org, key, address) has N due recipients waiting behind a deferred one (the send intent's
`order_key`, store/claims.py `_IN_ORDER`), beside 1,000 due recipients without a key. On a
scratch database it creates (and drops); each claim is rolled back, so every round sees the same
queue. Bounded in count; loopback only.

    .venv/bin/python bench/ordered_claim.py [--blocked 0,1000,10000] [--rounds 15]
        [--url postgresql://postgres@127.0.0.1/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pigeon_mta.store import claims
from pigeon_mta.store.migrate import migrate
from pigeon_mta.store.orgs import ensure_org

_QUEUE = """
WITH m AS (
    INSERT INTO message (id, org_id, sender, body, size, listener, received_at, order_key)
    SELECT gen_random_uuid(), $1, 'app@bench.test', 'x', 1, 'bench',
           now() - interval '1 hour' + n * interval '1 ms', CASE WHEN n <= $2 + 1 THEN 'k' END
    FROM generate_series(1, $2 + 1001) AS n
    RETURNING id, received_at, order_key)
INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at,
                       lane, order_key, order_at)
SELECT gen_random_uuid(), m.id, $1,
       CASE WHEN m.order_key IS NOT NULL THEN 'bob@dest.test' ELSE m.id || '@dest.test' END,
       'dest.test', m.received_at, m.received_at, 'transactional', m.order_key,
       CASE WHEN m.order_key IS NOT NULL THEN m.received_at END
FROM m
"""
# The key's first recipient was tried and waits an hour: every other one of the key waits on it.
_DEFER_HEAD = """
UPDATE recipient SET next_attempt_at = now() + interval '1 hour', attempts = 1
WHERE id = (SELECT id FROM recipient WHERE order_key = 'k' ORDER BY order_at LIMIT 1)
"""


async def one(url: str, blocked: int, rounds: int) -> tuple[float, int]:
    p = urlsplit(url)
    name = f"pigeon_ordered_claim_{os.getpid()}_{blocked}"
    admin = await asyncpg.connect(url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    conn = await asyncpg.connect(urlunsplit((p.scheme, p.netloc, "/" + name, p.query, "")))
    try:
        await migrate(conn)
        org = await ensure_org(conn, "bench")
        await conn.execute(_QUEUE, org, blocked)
        await conn.execute(_DEFER_HEAD)
        await conn.execute("ANALYZE")
        times = []
        claimed = 0
        for _ in range(rounds):
            tx = conn.transaction()
            await tx.start()
            began = time.perf_counter()
            claim = await claims.claim_due_recipients(
                conn, owner="bench", lease=60, batch=100, lane_weights={"transactional": 10.0}
            )
            times.append(time.perf_counter() - began)
            claimed = len(claim.rows)
            await tx.rollback()
        times.sort()
        return times[len(times) // 2], claimed
    finally:
        await conn.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--blocked", default="0,1000,10000")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for blocked in (int(b) for b in args.blocked.split(",")):
        median, claimed = await one(args.url, blocked, args.rounds)
        print(
            f"| {blocked:>6} held back | claim of 100: median {median * 1000:.1f} ms "
            f"({claimed} claimed) |"
        )


if __name__ == "__main__":
    asyncio.run(main())
