"""High availability: the primary database dies, a synchronous standby is promoted, and serve
carries on with nothing lost.

    smtplib (test) --SMTP--> relay listener (pigeon-mta serve, 1 process)
        serve --SQL, multi-host URL, target_session_attrs=read-write--> primary | standby
        primary --synchronous WAL--> standby
        serve --SMTP (relayhost)--> sink 127.0.0.2 (in the test)

With `synchronous_standby_names` set, a commit returns only once the standby has the WAL, so the
`250` of a message accepted before the failover is a promise the promoted standby keeps.
"""

from __future__ import annotations

import asyncio
import smtplib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.e2e.faults_helpers import QUEUED, node_config, start_serve, stop_serve, wait_delivered
from tests.peers.pg_cluster import Cluster
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkState, int]]:
    state = SinkState(slow_seconds=0)
    server = await start_sink(state, "127.0.0.2")
    try:
        yield state, server.sockets[0].getsockname()[1]
    finally:
        await stop_servers([server])


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    cluster = Cluster()
    try:
        await asyncio.to_thread(cluster.start)
        admin = await asyncpg.connect(cluster.server_url(cluster.primary))
        try:
            await admin.execute("CREATE DATABASE pigeon")
        finally:
            await admin.close()
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def send(port: int, subject: str) -> tuple[int, str]:
    """One message over a new connection: (reply code, reply text); (0, why) if it could not."""
    message = f"From: app@host.internal\r\nTo: bob@dest.test\r\nSubject: {subject}\r\n\r\nbody\r\n"
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as smtp:
            smtp.ehlo("client.test")
            smtp.mail("app@host.internal")
            smtp.rcpt("bob@dest.test")
            code, text = smtp.data(message.encode())
            return code, text.decode()
    except (OSError, smtplib.SMTPException) as exc:
        return 0, str(exc)


async def test_a_promoted_synchronous_standby_keeps_every_250_and_serve_carries_on(
    tmp_path: Path, cluster: Cluster, sink: tuple[SinkState, int]
) -> None:
    state, sink_port = sink
    node = node_config(tmp_path, cluster.url("pigeon"), sink_port)
    serve = await start_serve(node)
    try:
        code, text = await asyncio.to_thread(send, node.relay_port, "before")
        assert code == 250, text
        before = QUEUED.search(text)
        assert before is not None

        await asyncio.to_thread(cluster.kill_primary)
        await asyncio.to_thread(cluster.promote_standby)

        # Until serve has a connection to the new primary it answers 451 (never a lost 250).
        replies: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            replies.append(await asyncio.to_thread(send, node.relay_port, "after"))
            if replies[-1][0] == 250:
                break
            await asyncio.sleep(0.2)
        assert replies[-1][0] == 250, f"no 250 after the failover: {replies}\n{serve.output}"
        assert all(code in (250, 451, 0) for code, _ in replies), replies
        after = QUEUED.search(replies[-1][1])
        assert after is not None

        await wait_delivered(state, [before.group(1), after.group(1)], serve)
        promoted = await asyncpg.connect(cluster.server_url(cluster.standby, "pigeon"))
        try:
            assert not await promoted.fetchval("SELECT pg_is_in_recovery()")
            stored = await promoted.fetchval(
                "SELECT count(*) FROM message WHERE id = ANY($1::uuid[])",
                [before.group(1), after.group(1)],
            )
        finally:
            await promoted.close()
        assert stored == 2
    finally:
        code = await stop_serve(serve)
    assert code == 0, serve.output
