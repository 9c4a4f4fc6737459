"""The harness of the fault tests: a serve node's config, a load client that records every reply,
and the checks on what the sink received and what the database holds."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import signal
import smtplib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.peers.smtp_sink import SinkState

QUEUED = re.compile(r"queued as (\S+)")
RECEIVED_ID = re.compile(rb"\(pigeon-mta\) with \S+ id ([^\s;]+)")
SENDER = "app@host.internal"


@dataclass
class Node:
    config: Path
    relay_port: int


def node_config(
    directory: Path,
    db_url: str,
    sink_port: int,
    *,
    processes: int = 1,
    database: str = "",
    delivery: str = "",
    limits: str = "",
) -> Node:
    relay_port = free_port()
    config = write_config(
        directory,
        f"""
[server]
node_name = "faults"
hostname = "faults.test"
data_dir = "{directory}"
processes = {processes}
shutdown_timeout = "3s"
[database]
url = "{db_url}"
{database}
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.0/8"]
[limits]
{limits}
[metrics]
listen = "127.0.0.1:{free_port()}"
[log]
delivery_log = ""
[delivery]
relayhost = "127.0.0.2:{sink_port}"
relayhost_tls = "none"
lease = "5s"
sweep_interval = "1s"
poll_interval = "200ms"
retry_initial = "1s"
retry_max = "2s"
{delivery}
""",
    )
    return Node(config, relay_port)


async def start_serve(node: Node, listeners: int = 1) -> ServeProcess:
    serve = ServeProcess("--config", str(node.config))

    def ready() -> None:
        deadline = time.monotonic() + 60
        while serve.output.count("listener relay bound on") < listeners:
            if time.monotonic() > deadline or serve.proc.poll() is not None:
                raise AssertionError(f"serve did not start:\n{serve.output}")
            time.sleep(0.05)

    await asyncio.to_thread(ready)
    return serve


async def stop_serve(serve: ServeProcess) -> int:
    return await asyncio.to_thread(serve.stop, signal.SIGTERM, 60)


# ---------------------------------------------------------------- the client


@dataclass
class Reply:
    code: int  # 0: no SMTP reply (connection refused or cut, timeout)
    text: str

    @property
    def queue_id(self) -> str | None:
        match = QUEUED.search(self.text) if self.code == 250 else None
        return match.group(1) if match else None


def body(recipient: str, subject: str) -> bytes:
    return (
        f"From: <{SENDER}>\r\nTo: <{recipient}>\r\nSubject: {subject}\r\n\r\nbody of {subject}\r\n"
    ).encode()


def send(port: int, recipient: str, subject: str, source: str | None = None) -> Reply:
    """One message in one session; the reply that ended it (never an exception)."""
    client = smtplib.SMTP(timeout=30, source_address=(source, 0) if source else None)
    try:
        code, text = client.connect("127.0.0.1", port)
        if code != 220:
            return Reply(code, text.decode(errors="replace"))
        for code, text in (client.ehlo(), client.mail(SENDER), client.rcpt(recipient)):
            if code not in (250, 251):
                return Reply(code, text.decode(errors="replace"))
        code, text = client.data(body(recipient, subject))
        return Reply(code, text.decode(errors="replace"))
    except (smtplib.SMTPException, OSError) as exc:
        code = getattr(exc, "smtp_code", 0)
        return Reply(code if isinstance(code, int) else 0, repr(exc))
    finally:
        with contextlib.suppress(smtplib.SMTPException, OSError):
            client.quit()
        client.close()


class LoadClient:
    """A thread that sends one message after another until stopped, keeping every reply."""

    def __init__(self, port: int, local: str) -> None:
        self.port, self.local = port, local
        self.replies: list[Reply] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            reply = send(self.port, f"{self.local}+{n}@dest.test", f"load {n}")
            with self._lock:
                self.replies.append(reply)
            if reply.code != 250:
                time.sleep(0.05)  # a refusal comes back at once; don't spin

    def __enter__(self) -> LoadClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def snapshot(self) -> list[Reply]:
        with self._lock:
            return list(self.replies)

    @property
    def accepted(self) -> list[str]:
        return [r.queue_id for r in self.snapshot() if r.queue_id]


def delivered_ids(state: SinkState) -> collections.Counter[str]:
    """Queue id (from the Received header pigeon added) -> times the sink answered 250 for it."""
    counts: collections.Counter[str] = collections.Counter()
    for message in state.messages:
        match = RECEIVED_ID.search(message.data)
        if message.replied and match:
            counts[match.group(1).decode()] += 1
    return counts


async def wait_delivered(
    state: SinkState, queue_ids: list[str], serve: ServeProcess, timeout: float = 90
) -> None:
    def done() -> bool:
        got = delivered_ids(state)
        return all(got[q] >= 1 for q in queue_ids)

    try:
        await state.wait_for(done, timeout)
    except AssertionError:
        missing = [q for q in queue_ids if delivered_ids(state)[q] == 0]
        raise AssertionError(
            f"{len(missing)} accepted message(s) never delivered: {missing[:10]}\n{serve.output}"
        ) from None


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll predicate (in a thread: it may block) until true."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- processes and the database


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def database_name(db_url: str) -> str:
    return urlsplit(db_url).path.lstrip("/")


async def admin_execute(admin_url: str, *statements: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def terminate_backends(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
    finally:
        await conn.close()


async def fetch(db_url: str, query: str) -> list[asyncpg.Record]:
    """A fresh connection per query: the test's own pool would hold terminated sessions."""
    conn = await asyncpg.connect(db_url)
    try:
        return list(await conn.fetch(query))
    finally:
        await conn.close()


async def status_counts(db_url: str) -> dict[str, int]:
    rows = await fetch(db_url, "SELECT status, count(*) AS n FROM recipient GROUP BY status")
    return {r["status"]: r["n"] for r in rows}


def assert_no_crash(serve: ServeProcess) -> None:
    assert serve.proc.poll() is None, serve.output
    # asyncpg's pool logs a WARNING with a traceback each time it cannot reconnect while the
    # database is away; that is expected here. Any other traceback is a crash.
    crashes = [
        line for line in serve.lines if "Traceback" in line and "WARNING asyncpg.pool[" not in line
    ]
    assert not crashes, serve.output
    assert "exited with" not in serve.output, serve.output  # no worker died
