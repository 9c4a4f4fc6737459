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
from tests.e2e.shared import pigeon_ok as pigeon
from tests.e2e.test_budgets import node_config, queue_to, sinks, start_node, stop
from tests.peers.smtp_sink import SinkState

__all__ = ["sinks"]  # the fixture, used by name

COUNT = 20


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
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=1), 1)
        for n in ("node-a", "node-b")
    ]
    try:
        # Set once the nodes run (their start on a loaded host must not eat its time), and long
        # enough for the checks below to come well before it ends.
        await asyncio.to_thread(
            pigeon, db_url, "queue", "suspend", "--domain", "B.test", "--for", "15s",
            "--reason", "move",
        )  # fmt: skip
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
        await b_sink.wait_for(lambda: len(b_sink.messages) >= COUNT, timeout=45)
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
    for args in ((), ("--org", "x", "--lane", "bulk"), ("--site", "relayhost", "--domain", "a.t")):
        refused = run_pigeon("queue", "suspend", *args, env=env)
        assert refused.returncode == 1 and "name one of --site" in refused.stderr, refused.stderr
    resumed = run_pigeon("queue", "resume", "--site", "mx1.example.net,mx2.example.net", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(run_pigeon("queue", "--json", env=env).stdout)["suspensions"] == []
    # One org's mail to one site: the key a stated retry delay holds, ended early by resume.
    assert run_pigeon("org", "add", "holdco", env=env).returncode == 0
    pair = ("--site", "relayhost", "--org", "holdco")
    done = run_pigeon("queue", "suspend", *pair, "--for", "1h", "--json", env=env)
    assert done.returncode == 0, done.stderr
    key = json.loads(done.stdout)["suspended"]
    assert key.startswith("destination:relayhost|org:"), key
    shown = json.loads(run_pigeon("queue", "--json", env=env).stdout)["suspensions"]
    assert [s["key"] for s in shown] == [key]
    assert run_pigeon("queue", "resume", *pair, env=env).returncode == 0
    assert json.loads(run_pigeon("queue", "--json", env=env).stdout)["suspensions"] == []


async def test_a_suspended_site_waits_on_both_nodes_and_other_sites_flow(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """`queue suspend --site` as `queue` names a static route's site: neither node attempts its
    mail, for any org, while mail to another site flows; resumed, each message arrives once."""
    for state, _ in sinks.values():
        state.slow_seconds = 0
    other = await ensure_org(pool, "other")
    site = f"route:127.0.0.2:{sinks['a.test'][1]}"
    await asyncio.to_thread(
        pigeon, db_url, "queue", "suspend", "--site", site, "--reason", "provider incident"
    )
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=1), 1)
        for n in ("node-a", "node-b")
    ]
    try:
        await queue_to(pool, org_id, "a.test", COUNT)
        await queue_to(pool, other, "a.test", COUNT, lane="bulk")
        await queue_to(pool, org_id, "c.test", COUNT)
        a_sink, c_sink = sinks["a.test"][0], sinks["c.test"][0]
        await c_sink.wait_for(lambda: len(c_sink.messages) >= COUNT, timeout=30)
        await asyncio.sleep(2)
        assert not a_sink.messages and not a_sink.connections
        attempted = await pool.fetchval(
            "SELECT count(*) FROM attempt a JOIN recipient r ON r.id = a.recipient_id"
            " WHERE r.domain = 'a.test'"
        )
        assert attempted == 0
        shown = json.loads(await asyncio.to_thread(pigeon, db_url, "queue", "--json"))
        [held] = shown["suspensions"]
        assert held["key"] == f"destination:{site}" and held["waiting"] == 2 * COUNT, held
        message = await pool.fetchval(
            "SELECT message_id FROM recipient WHERE org_id = $1 AND domain = 'a.test'", other
        )
        story = await asyncio.to_thread(pigeon, db_url, "log", str(message))
        assert "suspended by an operator: provider incident" in story, story
        await asyncio.to_thread(pigeon, db_url, "queue", "resume", "--site", site)
        await a_sink.wait_for(lambda: len(a_sink.messages) >= 2 * COUNT, timeout=30)
    finally:
        codes = [await stop(node) for node in nodes]
    assert codes == [0, 0], [node.output[-2000:] for node in nodes]
    rcpts = [tuple(m.rcpt_tos) for m in sinks["a.test"][0].messages]
    assert len(rcpts) == len(set(rcpts)) == 2 * COUNT


async def test_a_stated_retry_delay_holds_the_site_for_the_org_that_got_it_only(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """A 421 that says "try again in 12 seconds" to one org's mail holds that org's mail to the
    site for 12 s, on both nodes; another org's mail to the same site is delivered meanwhile.
    `queue` lists the hold, `log` says why, and when it ends each message arrives once."""
    a_sink = sinks["a.test"][0]
    a_sink.slow_seconds, a_sink.stated_delay = 0, 12
    noisy = await ensure_org(pool, "noisy")
    extra = '[delivery.destination."a.test"]\nrate = 50\n'
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=1, extra=extra), 1)
        for n in ("node-a", "node-b")
    ]
    try:
        await queue_to(pool, noisy, "a.test", 1, local="slow-down")
        held_at = None
        for _ in range(200):
            key = await pool.fetchval(
                "SELECT key FROM suspension WHERE kind = 'reply' AND key LIKE '%|org:' || $1",
                str(noisy),
            )
            if key is not None:
                held_at = asyncio.get_running_loop().time()
                break
            await asyncio.sleep(0.05)
        assert held_at is not None, "no hold was written"
        await queue_to(pool, noisy, "a.test", COUNT)
        await queue_to(pool, org_id, "a.test", COUNT)
        await a_sink.wait_for(lambda: len(a_sink.messages) >= COUNT, timeout=10)
        await asyncio.sleep(1)
        assert asyncio.get_running_loop().time() - held_at < 11  # the hold is not over yet
        others = await pool.fetch("SELECT address FROM recipient WHERE org_id = $1", org_id)
        assert sorted(m.rcpt_tos[0] for m in a_sink.messages) == sorted(
            r["address"] for r in others
        )
        noisy_attempts = await pool.fetchval(
            "SELECT count(*) FROM attempt a JOIN recipient r ON r.id = a.recipient_id"
            " WHERE r.org_id = $1",
            noisy,
        )
        assert noisy_attempts == 1  # the one that got the 421
        delivered_others = await pool.fetchval(
            "SELECT count(*) FROM recipient WHERE org_id = $1 AND status = 'delivered'", org_id
        )
        assert delivered_others == COUNT
        shown = json.loads(await asyncio.to_thread(pigeon, db_url, "queue", "--json"))
        [hold] = shown["suspensions"]
        assert hold["key"] == key and hold["kind"] == "reply", hold
        assert "try again in 12 seconds" in hold["reason"], hold
        message = await pool.fetchval(
            "SELECT message_id FROM recipient WHERE org_id = $1 AND address LIKE 'user+%'", noisy
        )
        story = await asyncio.to_thread(pigeon, db_url, "log", str(message))
        assert "held for its org: the destination asked to retry in 12 s" in story, story
        # The hold ends by itself: the org's mail flows, the 421'd one included.
        await a_sink.wait_for(lambda: len(a_sink.messages) >= 2 * COUNT + 1, timeout=40)
    finally:
        codes = [await stop(node) for node in nodes]
    assert codes == [0, 0], [node.output[-2000:] for node in nodes]
    rcpts = [tuple(m.rcpt_tos) for m in a_sink.messages]
    assert len(rcpts) == len(set(rcpts)) == 2 * COUNT + 1
