"""Delivery log records: contract fields, one whole JSON line per event, safe with several writers."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client import REGISTRY

from pigeon_mta import delivery_log
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.delivery_records import EVENT_FIELDS, attempt_records, reception_records
from pigeon_mta.model import AttemptResult, ClaimedRecipient, Delivery, Envelope, Outcome, Reply
from tests.conftest import REPO

ORG = uuid.UUID("01900000-0000-7000-8000-000000000001")
QUEUE_ID = uuid.UUID("01900000-0000-7000-8000-0000000000aa")
WHEN = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def envelope() -> Envelope:
    return Envelope(
        org_id=ORG,
        sender="alice@example.com",
        recipients=("bob@example.net", "carol@example.org"),
        body=b"Subject: hi\r\n\r\nhello\r\n",
        listener="submission",
        header_message_id="m1@example.com",
        client_ip="192.0.2.7",
        client_helo="client.example",
        auth_user="alice",
    )


def delivery() -> Delivery:
    return Delivery(
        queue_id=QUEUE_ID,
        org_id=ORG,
        sender="alice@example.com",
        domain="example.net",
        header_message_id="m1@example.com",
        received_at=WHEN,
        body=b"",
        recipients=(
            ClaimedRecipient(
                id=uuid.UUID(int=1),
                address="bob@example.net",
                attempts=2,
                queued_at=datetime(2026, 1, 1, tzinfo=UTC),
            ),
        ),
    )


def result(outcome: Outcome, reply: Reply, **kw: object) -> AttemptResult:
    return AttemptResult(
        recipient_id=uuid.UUID(int=1),
        queue_id=QUEUE_ID,
        org_id=ORG,
        attempt=2,
        outcome=outcome,
        reply=reply,
        started_at=WHEN,
        duration=0.5,
        **kw,  # type: ignore[arg-type]
    )


def test_a_reception_is_one_record_per_recipient_with_the_contract_fields_first() -> None:
    records = reception_records(QUEUE_ID, envelope(), received_at=WHEN)
    assert [r["recipient"] for r in records] == ["bob@example.net", "carol@example.org"]
    for record in records:
        assert tuple(record)[: len(EVENT_FIELDS)] == EVENT_FIELDS
        assert record["type"] == "Reception"
        assert record["timestamp"] == "2025-01-02T03:04:05.678901Z"
        assert record["queue_id"] == str(QUEUE_ID)
        assert record["message_id"] == "m1@example.com"
        assert record["org"] == str(ORG)
        assert record["ip"] == "192.0.2.7"
        assert (record["code"], record["enhanced_code"]) == (250, "2.0.0")
        assert record["response"] == f"Ok: queued as {QUEUE_ID}"
        assert record["attempt"] is None and record["mx"] is None and record["tls"] is None
        assert record["listener"] == "submission" and record["auth_user"] == "alice"
        assert record["size"] == len(envelope().body)
        assert record["lane"] == "transactional"


def test_reception_and_attempt_records_carry_the_lane() -> None:
    bulk = dataclasses.replace(envelope(), lane="bulk")
    assert {r["lane"] for r in reception_records(QUEUE_ID, bulk, received_at=WHEN)} == {"bulk"}
    (record,) = attempt_records(
        dataclasses.replace(delivery(), lane="bulk"),
        [result(Outcome.DELIVERED, Reply(250, "2.0.0", "Ok"))],
    )
    assert record["lane"] == "bulk"


def test_each_outcome_has_its_event_type_and_the_reply() -> None:
    later = WHEN + timedelta(minutes=5)
    cases = [
        (Outcome.DELIVERED, Reply(250, "2.0.0", "Ok"), "Delivery"),
        (Outcome.DEFERRED, Reply(451, "4.7.1", "Greylisted"), "TransientFailure"),
        (Outcome.BOUNCED, Reply(550, "5.1.1", "No such user"), "Bounce"),
        (Outcome.EXPIRED, Reply(451, "4.4.7", "Too old"), "Expiration"),
        (Outcome.SUPPRESSED, Reply(0, None, "address is suppressed"), "Suppressed"),
    ]
    for outcome, reply, event in cases:
        (record,) = attempt_records(
            delivery(),
            [
                result(
                    outcome,
                    reply,
                    mx_host="mx.example.net",
                    ip="198.51.100.5",
                    port=25,
                    tls_version="TLSv1.3",
                    tls_cipher="TLS_AES_128_GCM_SHA256",
                    next_attempt_at=later if outcome == Outcome.DEFERRED else None,
                )
            ],
        )
        assert tuple(record)[: len(EVENT_FIELDS)] == EVENT_FIELDS
        assert record["type"] == event
        assert record["timestamp"] == "2025-01-02T03:04:06.178901Z"  # when the outcome was known
        assert record["recipient"] == "bob@example.net"
        assert (record["mx"], record["ip"], record["port"]) == (
            "mx.example.net",
            "198.51.100.5",
            25,
        )
        assert record["code"] == (reply.code or None)
        assert (record["enhanced_code"], record["response"]) == (reply.enhanced_code, reply.text)
        assert record["tls"] == {"version": "TLSv1.3", "cipher": "TLS_AES_128_GCM_SHA256"}
        assert record["attempt"] == 2
        assert record.get("next_attempt_at") == (
            "2025-01-02T03:09:05.678901Z" if outcome == Outcome.DEFERRED else None
        )


def test_records_go_to_a_file_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "delivery.log"
    log = DeliveryLog.open(str(path))
    log.reception(QUEUE_ID, envelope())
    log.attempts(delivery(), [result(Outcome.DELIVERED, Reply(250, "2.0.0", "Ok\nsecond line"))])
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["Reception", "Reception", "Delivery"]
    assert json.loads(lines[2])["response"] == "Ok\nsecond line"


def test_an_empty_target_turns_the_log_off_and_a_dash_is_stdout() -> None:
    assert DeliveryLog.open("").description == "off"
    DeliveryLog.open("").reception(QUEUE_ID, envelope())
    code = "from pigeon_mta.delivery_log import DeliveryLog; print('start', flush=True); " + (
        "import tests.unit.test_delivery_log as t; "
        "DeliveryLog.open('-').reception(t.QUEUE_ID, t.envelope())"
    )
    out = _python(code)
    lines = out.splitlines()
    assert lines[0] == "start"
    assert [json.loads(line)["recipient"] for line in lines[1:]] == [
        "bob@example.net",
        "carol@example.org",
    ]


WRITER = textwrap.dedent(
    """
    import sys, uuid
    from datetime import UTC, datetime
    from pigeon_mta.delivery_log import DeliveryLog
    from pigeon_mta.delivery_records import event_record
    log = DeliveryLog.open(sys.argv[1])
    who = sys.argv[2]
    for batch in range(60):
        records = [
            event_record("Delivery", timestamp=datetime.now(UTC), queue_id=uuid.uuid4(),
                         message_id=None, org=uuid.uuid4(), sender="a@example.com",
                         recipient=f"{who}-{batch}-{i}@example.net",
                         # some records longer than PIPE_BUF, most short
                         response=("x" * 5000) if i == 3 else "ok", attempt=1)
            for i in range(1 + batch % 7)
        ]
        log.write(records)
    log.close()
    """
)
PER_WRITER = sum(1 + batch % 7 for batch in range(60))


def test_several_processes_append_to_one_file_without_mixing_lines(tmp_path: Path) -> None:
    path = tmp_path / "delivery.log"
    procs = [_spawn(WRITER, str(path), f"w{i}") for i in range(3)]
    for proc in procs:
        assert proc.wait(60) == 0
    _assert_whole_lines(path.read_text(), writers=3)


def test_several_processes_share_stdout_without_mixing_lines(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    shell = " & ".join(f"{sys.executable} {script} - w{i}" for i in range(3)) + " & wait"
    out = subprocess.run(
        ["sh", "-c", shell], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    _assert_whole_lines(out.stdout, writers=3)
    # On a pipe only PIPE_BUF bytes are written whole: the 5,000-octet replies were shortened.
    lines = out.stdout.encode().splitlines(keepends=True)
    assert max(len(line) for line in lines) <= select.PIPE_BUF
    cut = [json.loads(line)["response"] for line in lines if b"[truncated]" in line]
    assert len(cut) == 3 * sum(1 for batch in range(60) if 1 + batch % 7 > 3)
    assert all(r.startswith("xxxx") and r.endswith("[truncated]") for r in cut)


def test_a_record_too_long_for_a_pipe_keeps_its_fields_and_is_valid_json() -> None:
    record = {
        "type": "Delivery",
        "queue_id": "0" * 36,
        "message_id": "m" * 300,
        "recipient": "b@example.net",
        "response": 'é"' * 3000,  # 2 bytes and an escaped quote each: JSON is longer than text
    }
    line = delivery_log._line(record, 4096)
    assert 4096 - 4 <= len(line) <= 4096 and line.endswith(b"\n")  # as much kept as fits
    parsed = json.loads(line)
    assert list(parsed) == list(record)
    assert {k: parsed[k] for k in ("type", "queue_id", "message_id", "recipient")} == {
        k: record[k] for k in ("type", "queue_id", "message_id", "recipient")
    }
    assert parsed["response"].startswith('é"é') and parsed["response"].endswith("[truncated]")
    # The longest free text is cut first; identifiers and addresses never are.
    other = dict(record, response="a short reply", message_id="y" * 6000)
    parsed = json.loads(delivery_log._line(other, 4096))
    assert parsed["response"] == "a short reply" and parsed["message_id"].endswith("[truncated]")
    assert (
        delivery_log._line(record, None)
        == (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    )


def _assert_whole_lines(text: str, writers: int) -> None:
    lines = text.splitlines()
    assert len(lines) == writers * PER_WRITER
    seen = {json.loads(line)["recipient"] for line in lines}
    assert len(seen) == writers * PER_WRITER


def test_a_rotated_file_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "delivery.log"
    log = DeliveryLog.open(str(path))
    log.reception(QUEUE_ID, envelope())
    path.rename(tmp_path / "delivery.log.1")
    time.sleep(1.2)  # the writer looks for a rotation at most once a second
    log.reception(QUEUE_ID, envelope())
    log.close()
    assert len((tmp_path / "delivery.log.1").read_text().splitlines()) == 2
    assert len(path.read_text().splitlines()) == 2


def test_a_failing_write_is_counted_not_raised() -> None:
    before = REGISTRY.get_sample_value("pigeon_delivery_log_errors_total") or 0.0
    log = DeliveryLog.open("/dev/full")  # every write fails with ENOSPC
    log.reception(QUEUE_ID, envelope())
    log.close()
    after = REGISTRY.get_sample_value("pigeon_delivery_log_errors_total")
    assert after == before + 2


# ---------------------------------------------------------------- the process's own log


def test_process_log_lines_are_one_event_each_in_text_and_json() -> None:
    code = (
        "import logging; from pigeon_mta.logs import setup_logging; setup_logging('info', '{fmt}')\n"
        "log = logging.getLogger('pigeon_mta.test')\n"
        "log.debug('hidden')\n"
        "log.info('two\\nlines')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('failed')\n"
    )
    text = _python(code.format(fmt="text"), stderr=True).splitlines()
    assert len(text) == 2
    assert " INFO pigeon_mta.test[" in text[0] and text[0].endswith("two | lines")
    assert "ERROR" in text[1] and "ZeroDivisionError" in text[1]
    events = [
        json.loads(line)
        for line in _python(code.format(fmt="json"), stderr=True).split("\n")
        if line
    ]
    assert [e["level"] for e in events] == ["info", "error"]
    assert events[0]["message"] == "two\nlines" and events[0]["logger"] == "pigeon_mta.test"
    assert "ZeroDivisionError" in events[1]["error"]
    assert events[0]["time"].endswith("Z") and isinstance(events[0]["pid"], int)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, env=_env())


def _python(code: str, *args: str, stderr: bool = False, stdout_closed: bool = False) -> str:
    command = [sys.executable, "-c", code, *args]
    if stdout_closed:
        command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
    out = subprocess.run(
        command,
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr if stderr else out.stdout


def test_a_closed_stdout_writes_nowhere_and_says_so(tmp_path: Path) -> None:
    """With descriptor 1 closed, "-" must not write to whatever file or socket takes it next."""
    code = textwrap.dedent(
        """
        import os, sys
        from pigeon_mta.delivery_log import DeliveryLog
        log = DeliveryLog.open("-")
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)  # takes descriptor 1
        log.write([{"type": "Reception", "recipient": "b@example.net"}])
        print(fd, log.description, file=sys.stderr)
        """
    )
    taken = tmp_path / "taken"
    err = _python(code, str(taken), stderr=True, stdout_closed=True)
    assert err.split("\n")[-2] == "1 off (stdout is closed)", err
    assert "stdout is closed" in err
    assert taken.read_bytes() == b""


def test_a_reply_with_line_breaks_or_lone_surrogates_stays_one_valid_line(tmp_path: Path) -> None:
    """NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR are escaped (Python's splitlines and older
    JavaScript end a line there), and a lone surrogate is written as JSON's \\udcxx: every
    record one line of valid UTF-8 for any reader."""
    path = tmp_path / "delivery.log"
    log = DeliveryLog.open(str(path))
    texts = ["a\x85b", "c\u2028d\u2029e", "caf\udce9"]
    for text in texts:
        log.attempts(delivery(), [result(Outcome.DEFERRED, Reply(450, "4.0.0", text))])
    log.close()
    data = path.read_bytes()
    lines = data.decode("utf-8").splitlines()  # strict UTF-8; splitlines ends lines at NEL too
    assert [json.loads(line)["response"] for line in lines] == texts
