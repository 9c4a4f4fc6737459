"""The HTTP API of the real `pigeon-mta serve` (two worker processes sharing `[api] listen`): a
message sent over HTTP is delivered to a sink and `pigeon-mta log` tells its story; an
Idempotency-Key repeated five times queues and delivers it once; README's Python example works.
With `[api] listen = ""` no API port is bound and SMTP mail flows as usual.

aiohttp client ──HTTP──► [api] listen 127.0.0.1:port ── pigeon-mta serve (2 workers) ── PostgreSQL
pigeon-mta apikey add / log                                │ [delivery] relayhost
                                                 aiosmtpd sink 127.0.0.2:port
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import aiosmtplib
import asyncpg

from tests.conftest import free_port, run_pigeon
from tests.e2e.relay_serve import relay_serve
from tests.e2e.serve_process import ServeProcess, descendants, write_config
from tests.e2e.shared import readme_block, settled
from tests.e2e.tcp_table import LISTEN, socket_inodes, tcp_sockets
from tests.e2e.test_observability import answered, eventually
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers


async def send(
    session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any], **headers: str
) -> tuple[int, bytes]:
    sent = {"Authorization": f"Bearer {key}", **headers}
    async with session.post(url + "/v1/messages", json=body, headers=sent) as answer:
        return answer.status, await answer.read()


async def test_a_message_sent_over_http_is_delivered_and_logged_and_repeats_are_sent_once(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-api",
        submission=False,
        api=True,
        processes=2,
        tables={
            "database": {"pool_size": 4},
            "delivery": {"poll_interval": "250ms"},
            "log": {"delivery_log": f"{tmp_path}/delivery.log"},
        },
        setup=[("apikey", "add", "acme", "--name", "shop", "--json")],
    ) as relay:
        state, serve, api_port, url = relay.sink, relay.serve, relay.api_port, relay.api_url
        added = json.loads(relay.prepared[0])
        key = added["key"]
        assert serve.output.count(f"HTTP API on http://127.0.0.1:{api_port}") == 2

        async with aiohttp.ClientSession() as session:
            status, body = await send(
                session,
                url,
                key,
                {
                    "from": "Shop <shop@acme.example>",
                    "to": ["ann@sink.test", "bob@sink.test"],
                    "subject": "Your order",
                    "text": "Thank you for your order.",
                    "html": "<p>Thank you for your order.</p>",
                },
            )
            assert status == 202, body
            answer = json.loads(body)
            queue_id = answer["queue_id"]
            await state.wait_for(lambda: len(state.messages) == 1)
            delivered = state.messages[0]
            assert sorted(delivered.rcpt_tos) == ["ann@sink.test", "bob@sink.test"]
            assert delivered.mail_from == "shop@acme.example"
            head = delivered.data.split(b"\r\n\r\n", 1)[0].decode()
            assert f"id {queue_id};" in head and str(added["id"]) not in head
            assert f"Message-ID: <{answer['message_id']}>" in head
            assert "Subject: Your order" in head and "multipart/alternative" in head

            # Five repeats of one request with one Idempotency-Key, on new connections (spread
            # over both worker processes): five identical answers, one message.
            order = {"from": "shop@acme.example", "to": "cat@sink.test", "text": "once"}
            answers = []
            for _ in range(5):
                async with aiohttp.ClientSession() as fresh:
                    answers.append(await send(fresh, url, key, order, **{"Idempotency-Key": "o-7"}))
            assert len(set(answers)) == 1 and answers[0][0] == 202
            status, body = await send(
                session, url, key, {**order, "text": "twice"}, **{"Idempotency-Key": "o-7"}
            )
            assert status == 422, body

        await state.wait_for(lambda: len(state.messages) == 2)
        for _ in range(300):  # bounded: the queue settles within a minute
            if await settled(pool):
                break
            await asyncio.sleep(0.2)
        assert await settled(pool)
        assert state.deliveries() == {"ann@sink.test": 1, "bob@sink.test": 1, "cat@sink.test": 1}
        assert await pool.fetchval("SELECT count(*) FROM message") == 2

        # README's Python example, with this node's port and the test's domains.
        readme = readme_block("python", "PIGEON_API_KEY")
        for placeholder, value in (
            ("127.0.0.1:8025", f"127.0.0.1:{api_port}"),
            ("shop@example.com", "shop@acme.example"),
            ("ann@example.net", "dan@sink.test"),
        ):
            assert placeholder in readme
            readme = readme.replace(placeholder, value)
        example = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", readme],
            env={**os.environ, "PIGEON_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert example.returncode == 0, example.stderr
        example_id = uuid.UUID(example.stdout.strip())
        assert await pool.fetchval("SELECT sender FROM message WHERE id = $1", example_id) == (
            "shop@acme.example"
        )

        story = run_pigeon("log", queue_id, "--json", env={"PIGEON_DATABASE_URL": db_url})
        assert story.returncode == 0, story.stderr
        events = [json.loads(line) for line in story.stdout.splitlines() if line.strip()]
        assert {e["queue_id"] for e in events} == {queue_id}
        kinds = sorted((e["type"], e.get("recipient") or "") for e in events)
        assert ("Delivery", "ann@sink.test") in kinds and ("Delivery", "bob@sink.test") in kinds
        assert any(kind == "Reception" for kind, _r in kinds)
        assert f"queued {queue_id} listener=api" in serve.output
        assert f"user=apikey:{added['id']}" in serve.output
        records = (tmp_path / "delivery.log").read_text()
        assert queue_id in records and '"Reception"' in records
        assert serve.stop(signal.SIGTERM) == 0, serve.output
        assert "Traceback" not in serve.output


def test_serve_exits_non_zero_when_the_api_cannot_bind(tmp_path: Path, db_url: str) -> None:
    """Another program holds the API's port: serve says so and exits 1 (systemd restarts it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path,
            f'listener = []\n[server]\nnode_name = "api-bind"\ndata_dir = "{tmp_path}"\n'
            f'[database]\nurl = "{db_url}"\n[api]\nlisten = "127.0.0.1:{port}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n',
        )
        serve = ServeProcess("--config", str(config), "--processes", "1")
        try:
            code = serve.proc.wait(60)
        finally:
            serve.kill()
    assert code == 1, serve.output
    assert f"the HTTP API cannot bind 'api.listen' 127.0.0.1:{port}" in serve.output
    assert "Traceback" not in serve.output


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports these processes listen on."""
    inodes = socket_inodes(pids)
    return {s.local_port for s in tcp_sockets() if s.state == LISTEN and s.inode in inodes}


async def test_an_empty_api_listen_binds_no_api_port_and_smtp_mail_is_delivered(
    tmp_path: Path, db_url: str
) -> None:
    state = SinkState()
    sink = await start_sink(state, "127.0.0.2", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    smtp_port, metrics_port = free_port(), free_port()
    config = write_config(
        tmp_path,
        f"""[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e-no-api"
shutdown_timeout = "5s"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{smtp_port}"
[api]
listen = ""
[metrics]
listen = "127.0.0.1:{metrics_port}"
[delivery]
relayhost = "127.0.0.2:{sink_port}"
poll_interval = "250ms"
[log]
delivery_log = ""
""",
    )
    checked = run_pigeon("check-config", str(config), "--json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["api"] == "off"

    serve = ServeProcess("--config", str(config), "--processes", "2")
    try:
        for worker in (0, 1):
            await asyncio.to_thread(serve.wait_for, f"worker {worker} ready")
        assert "HTTP API off ('api.listen' is empty)" in serve.output
        assert "HTTP API on" not in serve.output
        pids = [serve.proc.pid, *descendants(serve.proc.pid)]
        assert listening_ports(pids) == {smtp_port, metrics_port}
        ready = await asyncio.to_thread(
            eventually, lambda: answered(metrics_port, "/readyz", 200), "ready"
        )
        assert "listener relay: ok" in ready[2].decode()
        assert "api" not in ready[2].decode()  # no API listener to wait for

        await aiosmtplib.send(
            b"From: app@internal.test\r\nTo: ann@sink.test\r\nSubject: hi\r\n\r\nno API\r\n",
            sender="app@internal.test",
            recipients=["ann@sink.test"],
            hostname="127.0.0.1",
            port=smtp_port,
            start_tls=False,
            timeout=30,
        )
        await state.wait_for(lambda: state.deliveries() == {"ann@sink.test": 1})
        assert serve.stop(signal.SIGTERM) == 0, serve.output
        assert "Traceback" not in serve.output
    finally:
        serve.kill()
        await stop_servers([sink])
