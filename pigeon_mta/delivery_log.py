"""Writing delivery log records: to stdout or a file every process appends to, whole lines only.

The records are built in delivery_records.py. The submission side calls `reception()` after the
commit and before the `250`; the engine calls `attempts()` after `record_attempts`. Writes are
synchronous `os.write` calls of whole lines: with O_APPEND each write lands at the end of the file
whatever other processes write. On stdout (a pipe or socket to journald or a container runtime)
only a write of at most PIPE_BUF bytes is whole, so no write is longer: a record that would be (a
long remote reply, say) has its longest text values shortened, marked "[truncated]", to fit; the
database keeps them whole (`pigeon-mta log`). So lines from several processes never interleave.
"""

from __future__ import annotations

import json
import logging
import os
import select
import stat
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Protocol

from pigeon_mta.config import Settings
from pigeon_mta.delivery_records import (
    RECEPTION,
    Record,
    attempt_records,
    duplicate_records,
    reception_records,
    story_records,
    to_json_line,
)
from pigeon_mta.model import AttemptResult, Delivery, Envelope
from pigeon_mta.store.duplicates import Duplicates
from pigeon_mta.store.events import MessageStory

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- sinks


class _Sink(Protocol):
    max_line: int | None  # the longest write that lands whole, None: any

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class _NoSink:
    max_line: int | None = None

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class _FdSink:
    """An inherited descriptor (stdout); not closed by us. OSError when it is not open."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        # A regular file opened for appending takes a write whole; a pipe or socket only up to
        # PIPE_BUF bytes.
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.max_line: int | None = None if regular else select.PIPE_BUF

    def write(self, data: bytes) -> None:
        _write_all(self.fd, data)

    def close(self) -> None:
        pass


class _FileSink:
    """A file opened for appending; reopened when it was renamed away (log rotation)."""

    REOPEN_CHECK_INTERVAL = 1.0
    max_line: int | None = None  # an O_APPEND write to a regular file lands whole

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = self._open()
        self._checked_at = time.monotonic()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def write(self, data: bytes) -> None:
        now = time.monotonic()
        if now - self._checked_at >= self.REOPEN_CHECK_INTERVAL:
            self._checked_at = now
            self._reopen_if_rotated()
        _write_all(self.fd, data)

    def _reopen_if_rotated(self) -> None:
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(self.fd)
        if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
            fd = self._open()
            os.close(self.fd)
            self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


TRUNCATED = "[truncated]"
# The free-text fields a record may be shortened in; identifiers, addresses and times never are.
SHORTENED_FIELDS = ("response", "message_id", "helo")


def _line(record: Record, limit: int | None) -> bytes:
    """The record as a line of at most `limit` bytes: its longest free-text field (then the next)
    cut to the longest prefix that fits and marked TRUNCATED, until the line fits or no free text
    is left to cut."""
    line = _json_line(record)
    if limit is None or len(line) <= limit:
        return line
    fields = dict(record)
    texts = sorted(
        (k for k in SHORTENED_FIELDS if isinstance(fields.get(k), str)),
        key=lambda k: len(fields[k].encode()),
        reverse=True,
    )
    for key in texts:
        encoded = fields[key].encode()

        def cut(keep: int, key: str = key, encoded: bytes = encoded) -> bytes:
            fields[key] = encoded[:keep].decode(errors="ignore") + TRUNCATED
            return _json_line(fields)

        # The longest prefix (in bytes) with which the line fits; a few encodings of one record.
        low, high = 0, len(encoded) - 1
        if len(cut(low)) > limit:
            continue  # even empty it does not fit: cut the next field too
        while low < high:
            middle = (low + high + 1) // 2
            if len(cut(middle)) <= limit:
                low = middle
            else:
                high = middle - 1
        return cut(low)
    return _json_line(fields)


def _json_line(record: Record) -> bytes:
    line = to_json_line(record) + "\n"
    try:
        return line.encode()
    except UnicodeEncodeError:
        # A lone surrogate (undecodable bytes of a peer, kept as aiosmtplib gives them): JSON's
        # \\udcxx escape keeps the line valid UTF-8 and the record whole.
        return (_ASCII_ENCODER.encode(record) + "\n").encode()


_ASCII_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def _chunks(lines: Sequence[bytes], limit: int = select.PIPE_BUF) -> Iterable[bytes]:
    """Whole lines grouped into writes of at most `limit` bytes (a longer line goes alone)."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if chunk and size + len(line) > limit:
            yield b"".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += len(line)
    if chunk:
        yield b"".join(chunk)


# ---------------------------------------------------------------- the log


class DeliveryLog:
    """Where this process writes delivery log records (`[log] delivery_log`)."""

    def __init__(self, sink: _Sink, description: str) -> None:
        self._sink = sink
        self.description = description
        self._failing = False

    @classmethod
    def open(cls, target: str) -> DeliveryLog:
        """ "-" is stdout, "" writes nothing, anything else is a file path (created, appended)."""
        if target == "":
            return cls(_NoSink(), "off")
        if target == "-":
            try:
                return cls(_FdSink(1), "stdout")
            except OSError:
                # Writing to descriptor 1 could reach whatever file or socket takes it next.
                log.warning("stdout is closed: the delivery log is written nowhere")
                return cls(_NoSink(), "off (stdout is closed)")
        return cls(_FileSink(os.path.expanduser(target)), target)

    @classmethod
    def from_settings(cls, settings: Settings) -> DeliveryLog:
        return cls.open(settings.log.delivery_log)

    def reception(self, queue_id: uuid.UUID, envelope: Envelope) -> None:
        """A message was queued (call after the commit): one Reception record per recipient,
        stamped with the envelope's `received_at`, the instant the message row holds too."""
        received_at = envelope.received_at or datetime.now(UTC)
        self.write(reception_records(queue_id, envelope, received_at=received_at))

    def duplicates(self, envelope: Envelope, duplicates: Duplicates) -> None:
        """Recipients of a submission not queued again (call after the commit): one Duplicate
        record each."""
        received_at = envelope.received_at or datetime.now(UTC)
        self.write(duplicate_records(envelope, duplicates, received_at=received_at))

    def attempts(self, delivery: Delivery, results: Sequence[AttemptResult]) -> None:
        """Outcomes of one delivery (call after `record_attempts`): one record per result."""
        self.write(attempt_records(delivery, results))

    def stories(self, stories: Iterable[MessageStory]) -> None:
        """Events read back from the database (the supervisor logs expiries this way)."""
        self.write([r for story in stories for r in story_records(story) if r["type"] != RECEPTION])

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        lines = [_line(r, self._sink.max_line) for r in records]
        try:
            for chunk in _chunks(lines):
                self._sink.write(chunk)
        except OSError as exc:
            # Imported here: importing this module does not load prometheus_client, which would be
            # a third of a light command's start-up (tests/e2e/test_cli_startup.py).
            from pigeon_mta import metrics

            metrics.DELIVERY_LOG_ERRORS.inc(len(records))
            if not self._failing:
                log.error("cannot write the delivery log (%s): %s", self.description, exc)
            self._failing = True
            return
        if self._failing:
            log.info("writing the delivery log (%s) again", self.description)
            self._failing = False

    def close(self) -> None:
        self._sink.close()
