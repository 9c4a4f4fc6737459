"""`pigeon-mta queue suspend|resume` with two real nodes: suspended mail is not attempted by
either node, shows in `queue` and `log`, and flows again when resumed or when its time ends.

test --CLI--> PostgreSQL <--claim / record-- serve node-a, node-b
                                                \\--SMTP--> sinks: a.test, b.test, c.test
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import asyncpg

from pigeon_mta.store.orgs import ensure_org
from tests.conftest import run_pigeon
from tests.e2e.test_budgets import node_config, queue_to, sinks, start_node, stop
from tests.peers.smtp_sink import SinkState

__all__ = ["sinks"]  # the fixture, used by name

COUNT = 20


def pigeon(db_url: str, *args: str) -> str:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


async def test_suspended_mail_waits_on_both_nodes_until_resumed_or_its_time_ends(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    for state, _ in sinks.values():
        state.slow_seconds = 0
    acme = await ensure_org(pool, "suspect")  # org_id is another org's, "acme"
    await asyncio.to_thread(
        pigeon, db_url, "queue", "suspend", "--org", "suspect", "--reason", "abuse review"
    )
    await asyncio.to_thread(
        pigeon, db_url, "queue", "suspend", "--domain", "B.test", "--for", "6s", "--reason", "move"
    )
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=1), 1)
        for n in ("node-a", "node-b")
    ]
    try:
        await queue_to(pool, acme, "a.test", COUNT)  # the suspended org's
        await queue_to(pool, org_id, "b.test", COUNT)  # to the suspended domain
        await queue_to(pool, org_id, "c.test", COUNT)  # neither
        c_sink, b_sink, a_sink = sinks["c.test"][0], sinks["b.test"][0], sinks["a.test"][0]
        await c_sink.wait_for(lambda: len(c_sink.messages) >= COUNT, timeout=30)
        await asyncio.sleep(2)
        assert not a_sink.messages and not b_sink.messages
        attempted = await pool.fetchval(
            "SELECT count(*) FROM attempt a JOIN recipient r ON r.id = a.recipient_id"
            " WHERE r.domain IN ('a.test', 'b.test')"
        )
        assert attempted == 0
        shown = json.loads(await asyncio.to_thread(pigeon, db_url, "queue", "--json"))
        held = {s["key"]: s for s in shown["suspensions"]}
        assert held[f"org:{acme}"]["waiting"] == COUNT, held
        assert held["domain:b.test"]["waiting"] == COUNT and held["domain:b.test"]["until"], held
        message = await pool.fetchval("SELECT message_id FROM recipient WHERE org_id = $1", acme)
        story = await asyncio.to_thread(pigeon, db_url, "log", str(message))
        assert "suspended by an operator: abuse review" in story, story

        # The domain's suspension ends by itself; the org's when it is resumed.
        await b_sink.wait_for(lambda: len(b_sink.messages) >= COUNT, timeout=30)
        assert not a_sink.messages
        resumed = await asyncio.to_thread(pigeon, db_url, "queue", "resume", "--org", "suspect")
        assert "resumed" in resumed
        await a_sink.wait_for(lambda: len(a_sink.messages) >= COUNT, timeout=30)
    finally:
        codes = [await stop(node) for node in nodes]
    assert codes == [0, 0], [node.output[-2000:] for node in nodes]
    for domain in ("a.test", "b.test", "c.test"):
        rcpts = [tuple(m.rcpt_tos) for m in sinks[domain][0].messages]
        assert len(rcpts) == len(set(rcpts)) == COUNT, domain
    assert (
        "is not suspended"
        in run_pigeon(
            "queue", "resume", "--org", "suspect", env={"PIGEON_DATABASE_URL": db_url}
        ).stderr
    )


def test_suspend_names_a_site_as_queue_lists_it_and_refuses_bad_input(db_url: str) -> None:
    env = {"PIGEON_DATABASE_URL": db_url}
    done = run_pigeon(
        "queue", "suspend", "--site", " MX2.Example.net, mx1.example.net", "--json", env=env
    )
    assert done.returncode == 0, done.stderr
    # The MX host names in any order and case: the site's key as the engines make it.
    assert (
        json.loads(done.stdout)["suspended"] == "destination:site:mx1.example.net,mx2.example.net"
    )
    shown = json.loads(run_pigeon("queue", "--json", env=env).stdout)["suspensions"]
    assert [s["key"] for s in shown] == ["destination:site:mx1.example.net,mx2.example.net"]
    for args, says in (
        (("--site", "pattern:*.google.com", "--for", "0s"), "--for must be longer than zero"),
        (("--site", "relayhost", "--for", "soon"), "--for:"),
        (("--lane", "nope"), "there is no lane 'nope'"),
        (("--org", "nobody"), "there is no org named 'nobody'"),
        (("--domain", "bad..domain"), "--domain:"),
    ):
        refused = run_pigeon("queue", "suspend", *args, env=env)
        assert refused.returncode == 1 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr
    assert run_pigeon("queue", "suspend", env=env).returncode == 2  # which one: required
    resumed = run_pigeon("queue", "resume", "--site", "mx1.example.net,mx2.example.net", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(run_pigeon("queue", "--json", env=env).stdout)["suspensions"] == []
