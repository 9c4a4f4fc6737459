"""After real traffic through the real `pigeon-mta serve`, a plain HTTP client scrapes /metrics and
the counters equal the traffic: accepted, delivered, deferred, bounced (with one and two processes).

smtplib ──SMTP──► relay listener 127.0.0.1:port ── pigeon-mta serve ── PostgreSQL
                                                      │ [delivery] relayhost
urllib ──HTTP──► /metrics              aiosmtpd sink 127.0.0.2:port (behaviour per local part)
"""

from __future__ import annotations

import asyncio
import re
import smtplib
import subprocess
import time
from email.message import EmailMessage
from pathlib import Path

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.observe_helpers import http, promtool
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

# The traffic. Every recipient is at sink.test, and every delivery goes through the relayhost to
# the sink, whose behaviour each local part chooses (tests/peers/smtp_sink.py).
#   (envelope sender, recipients)
TRAFFIC: list[tuple[str, list[str]]] = [
    *[("app@sink.test", [f"ok+{i}@sink.test"]) for i in range(6)],
    # 451 at the first RCPT, accepted on the retry.
    *[("app@sink.test", [f"tempfail+{i}@sink.test"]) for i in range(3)],
    # 550 5.1.1: a bounce, and a DSN to the sender, which is at the sink and is delivered.
    *[(f"bouncer+{i}@sink.test", [f"reject-rcpt+{i}@sink.test"]) for i in range(2)],
    # A bounce of mail from the null sender: no DSN (no bounce loops).
    ("", ["reject-rcpt+null@sink.test"]),
    # All three in one message: one transaction; one DSN naming the one bounced recipient.
    (
        "mixed@sink.test",
        ["ok+mixed@sink.test", "tempfail+mixed@sink.test", "reject-rcpt+mixed@sink.test"],
    ),
]

ACCEPTED = len(TRAFFIC)  # 13 messages, all over the relay listener (DSNs are not "accepted")
# deferred: each tempfail recipient once = 3 + 1 (mixed)
DEFERRED = 4
# bounced: each reject-rcpt recipient = 2 + 1 (null sender) + 1 (mixed)
BOUNCED = 4
DSNS = 3  # one per message with a bounce and a non-null sender: bouncer+0, bouncer+1, mixed
# delivered: 6 ok + 3 tempfail retries + 1 ok+mixed + 1 tempfail+mixed retry + the 3 DSNs
DELIVERED = 6 + 3 + 1 + 1 + DSNS
assert DELIVERED == 14


def message(sender: str, recipients: list[str], n: int) -> bytes:
    mail = EmailMessage()
    mail["From"] = sender or "daemon@sink.test"
    mail["To"] = ", ".join(recipients)
    mail["Subject"] = f"traffic {n}"
    mail.set_content(f"message {n}\n")
    return mail.as_bytes()


def send(port: int, sender: str, recipients: list[str], n: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        refused = client.sendmail(sender, recipients, message(sender, recipients, n))
        assert refused == {}


PID = re.compile(r"\[(\d+)\]: queued ")


def accepting_pids(serve: ServeProcess) -> set[str]:
    """Worker processes that logged an accepted message."""
    return {m.group(1) for line in serve.lines for m in [PID.search(line)] if m}


def send_traffic(port: int, serve: ServeProcess, processes: int) -> int:
    """TRAFFIC, then (so that every process has counted something) plain messages until every
    worker process has accepted one; returns how many of those extra messages were sent."""
    for n, (sender, recipients) in enumerate(TRAFFIC):
        send(port, sender, recipients, n)
    extra = 0
    while len(accepting_pids(serve)) < processes:
        assert extra < 200, serve.output
        send(port, "app@sink.test", [f"extra+{extra}@sink.test"], len(TRAFFIC) + extra)
        extra += 1
    return extra


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[str, Samples]:
    status, _, body = http(port, "/metrics")  # urllib, no proxy
    assert status == 200
    text = body.decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, got


def value(got: Samples, name: str, **labels: str) -> float:
    return got.get((name, tuple(sorted(labels.items()))), 0.0)


def counters(got: Samples) -> dict[str, float]:
    return {
        "accepted": value(got, "pigeon_messages_accepted_total", listener="relay"),
        "delivered": value(got, "pigeon_deliveries_total", outcome="delivered"),
        "deferred": value(got, "pigeon_deliveries_total", outcome="deferred"),
        "bounced": value(got, "pigeon_deliveries_total", outcome="bounced"),
        "accept_to_delivery_count": value(got, "pigeon_accept_to_delivery_seconds_count"),
    }


def expected(extra: int) -> dict[str, float]:
    """The traffic's numbers, plus `extra` plain messages (one delivered recipient each)."""
    return {
        "accepted": ACCEPTED + extra,
        "delivered": DELIVERED + extra,
        "deferred": DEFERRED,
        "bounced": BOUNCED,
        # Observed once per delivered recipient (DSNs included).
        "accept_to_delivery_count": DELIVERED + extra,
    }


async def queue_settled(pool: asyncpg.Pool, extra: int, timeout: float = 120) -> None:
    """Every message is in (those accepted and the 3 DSNs) and no recipient is still live."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = await pool.fetchval("SELECT count(*) FROM message")
        live = await pool.fetchval(
            "SELECT count(*) FROM recipient WHERE status IN ('queued', 'delivering')"
        )
        if messages == ACCEPTED + extra + DSNS and live == 0:
            return
        await asyncio.sleep(0.2)
    rows = await pool.fetch("SELECT address, status, attempts FROM recipient ORDER BY address")
    raise AssertionError(f"queue did not settle: {[tuple(r) for r in rows]}")


@pytest.mark.parametrize("processes", [1, 2])
async def test_metrics_equal_the_traffic(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, processes: int
) -> None:
    state = SinkState()
    sink = await start_sink(state, "127.0.0.2", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    relay_port, metrics_port = free_port(), free_port()
    config = write_config(
        tmp_path,
        f"""
[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e-metrics"
shutdown_timeout = "5s"
[database]
url = "{db_url}"
pool_size = 4
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.1/32"]
[metrics]
listen = "127.0.0.1:{metrics_port}"
[delivery]
relayhost = "127.0.0.2:{sink_port}"
retry_initial = "1s"   # the tempfail recipients are retried soon
retry_max = "2s"
poll_interval = "250ms"
[log]
delivery_log = ""
""",
    )
    serve = ServeProcess("--config", str(config), "--processes", str(processes))
    try:
        await asyncio.to_thread(serve.wait_for, "listener relay bound on")
        # Every worker process listening, so the traffic is spread over all of them.
        deadline = time.monotonic() + 60
        while (
            value(
                (await asyncio.to_thread(scrape, metrics_port))[1],
                "pigeon_listeners_bound",
                listener="relay",
            )
            < processes
        ):
            assert time.monotonic() < deadline, serve.output
            await asyncio.sleep(0.2)
        extra = await asyncio.to_thread(send_traffic, relay_port, serve, processes)
        await queue_settled(pool, extra)
        await state.wait_for(lambda: sum(state.deliveries().values()) == DELIVERED + extra, 60)

        # The counters are bumped right after each outcome's commit: poll briefly until they
        # have caught up with the database, then they must equal the traffic exactly.
        deadline = time.monotonic() + 30
        while True:
            text, got = await asyncio.to_thread(scrape, metrics_port)
            if counters(got) == expected(extra) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    finally:
        exit_code = await asyncio.to_thread(serve.stop)
        await stop_servers([sink])
    assert exit_code == 0, serve.output
    assert counters(got) == expected(extra), serve.output
    assert len(accepting_pids(serve)) == processes

    # What the sink saw agrees: each address once, the DSNs to the senders that had a bounce.
    deliveries = state.deliveries()
    assert sum(deliveries.values()) == DELIVERED + extra
    assert all(deliveries[f"ok+{i}@sink.test"] == 1 for i in range(6))
    assert all(deliveries[f"tempfail+{i}@sink.test"] == 1 for i in range(3))
    assert deliveries["bouncer+0@sink.test"] == deliveries["bouncer+1@sink.test"] == 1
    assert deliveries["mixed@sink.test"] == 1
    assert not any(address.startswith("reject-rcpt") for address in deliveries)
    dsns = [m for m in state.messages if m.rcpt_tos[0].startswith(("bouncer+", "mixed@"))]
    assert len(dsns) == DSNS and {m.mail_from for m in dsns} == {"<>"}  # the null sender
    # The exposition is valid for Prometheus's own checker.
    check = await asyncio.to_thread(
        subprocess.run,
        [promtool(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
