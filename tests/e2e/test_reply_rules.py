"""`[[shaping.rule]]` with the real `pigeon-mta serve`: a rule that suspends a site for every org
after a block-list reply, on both nodes, keeps the mail and says so in `queue` and `log`.

test --SQL--> PostgreSQL <--claim / record-- serve node-a, node-b
                                                \\--SMTP--> sinks: a.test (replies S3150 once), c.test
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import asyncpg

from pigeon_mta.store.orgs import ensure_org
from tests.e2e.test_budgets import node_config, queue_to, sinks, start_node, stop
from tests.e2e.test_suspensions import pigeon
from tests.peers.smtp_sink import SinkState

__all__ = ["sinks"]  # the fixture, used by name

COUNT = 10
RULE = """
[[shaping.rule]]
name = "test-blocklist"
match = '5\\.7\\.1 .{0,100}block list'
site = "127.0.0.2"
action = "suspend"
scope = "all"
duration = "8s"
"""


async def test_a_suspend_rule_holds_the_site_for_every_org_and_keeps_the_mail(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    for state, _ in sinks.values():
        state.slow_seconds = 0
    a_sink, c_sink = sinks["a.test"][0], sinks["c.test"][0]
    other = await ensure_org(pool, "other")
    site = f"destination:route:127.0.0.2:{sinks['a.test'][1]}"
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=1, extra=RULE), 1)
        for n in ("node-a", "node-b")
    ]
    try:
        await queue_to(pool, org_id, "a.test", 1, local="blocked")
        for _ in range(200):
            if await pool.fetchval("SELECT kind FROM suspension WHERE key = $1", site):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the rule suspended nothing")
        suspended_at = asyncio.get_running_loop().time()
        await queue_to(pool, org_id, "a.test", COUNT)
        await queue_to(pool, other, "a.test", COUNT)
        await queue_to(pool, other, "c.test", COUNT)
        await c_sink.wait_for(lambda: len(c_sink.messages) >= COUNT, timeout=10)
        await asyncio.sleep(1)
        assert asyncio.get_running_loop().time() - suspended_at < 7  # not over yet
        assert not a_sink.messages
        attempts = await pool.fetchval(
            "SELECT count(*) FROM attempt a JOIN recipient r ON r.id = a.recipient_id"
            " WHERE r.domain = 'a.test'"
        )
        assert attempts == 1  # the one the 550 answered
        # The 550 was about our network, not the mailbox: deferred, not bounced.
        blocked = await pool.fetchrow(
            "SELECT status, message_id FROM recipient WHERE address LIKE 'blocked+%'"
        )
        assert blocked["status"] == "queued"
        shown = json.loads(await asyncio.to_thread(pigeon, db_url, "queue", "--json"))
        [held] = shown["suspensions"]
        assert held["key"] == site and held["kind"] == "reply", held
        assert held["reason"].startswith("rule test-blocklist (suspend all for 8s): 550 5.7.1")
        story = await asyncio.to_thread(pigeon, db_url, "log", str(blocked["message_id"]))
        assert "reply rule test-blocklist: suspend all for 8s" in story, story
        message = await pool.fetchval(
            "SELECT message_id FROM recipient WHERE org_id = $1 AND domain = 'a.test'", other
        )
        story = await asyncio.to_thread(pigeon, db_url, "log", str(message))
        assert "suspended after a reply: rule test-blocklist" in story, story
        # It ends by itself; then every message arrives once, the blocked one included.
        await a_sink.wait_for(lambda: len(a_sink.messages) >= 2 * COUNT + 1, timeout=40)
    finally:
        codes = [await stop(node) for node in nodes]
    assert codes == [0, 0], [node.output[-2000:] for node in nodes]
    rcpts = [tuple(m.rcpt_tos) for m in a_sink.messages]
    assert len(rcpts) == len(set(rcpts)) == 2 * COUNT + 1
