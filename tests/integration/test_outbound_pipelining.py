"""Outbound PIPELINING (RFC 2920) against a scripted peer that shows what arrives on the wire.

engine --SMTP (relayhost)--> ScriptedPeer 127.0.0.8:<port>: records every read, answers a
                              pipelined group with all its replies in ONE write

aiosmtplib's own reader keeps one reply per read; a pipelining server answers MAIL, RCPT and DATA
in one segment, so these tests also prove that no reply is lost when several arrive together.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from tests.integration.outbound_helpers import attempts, running_engine, send, wait_final
from tests.peers.world import World, mail_world

HOST = "127.0.0.8"


@dataclass
class ScriptedPeer:
    """`answer(group)` gives the replies (one write) to a pipelined group of command lines."""

    answer: Callable[[list[bytes]], bytes]
    reads: list[bytes] = field(default_factory=list)  # what each read() returned, after EHLO
    bodies: list[bytes] = field(default_factory=list)
    empty_messages: int = 0
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            writer.write(b"220 scripted ESMTP\r\n")
            await reader.readline()  # EHLO
            writer.write(b"250-scripted\r\n250-PIPELINING\r\n250 8BITMIME\r\n")
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                self.reads.append(chunk)
                lines = chunk.split(b"\r\n")[:-1]
                if lines[0] in (b"QUIT", b"RSET"):
                    writer.write(b"221 bye\r\n" if lines[0] == b"QUIT" else b"250 reset\r\n")
                    continue
                replies = self.answer(lines)
                writer.write(replies)
                if replies.rstrip().endswith(b"go ahead"):
                    body = b""
                    while (line := await reader.readline()) != b".\r\n":
                        body += line
                    if body:
                        self.bodies.append(body)
                        writer.write(b"250 2.0.0 queued\r\n")
                    else:  # a lone dot: the empty message after an unwanted 354
                        self.empty_messages += 1
                        writer.write(b"554 5.5.1 no valid recipients\r\n")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def scripted(
    answer: Callable[[list[bytes]], bytes],
) -> AsyncIterator[tuple[ScriptedPeer, int]]:
    peer = ScriptedPeer(answer)
    server = await asyncio.start_server(peer.handle, HOST, 0)
    try:
        yield peer, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


def per_line(
    lines: list[bytes], *, mail: bytes = b"250 2.1.0 ok", data: bytes = b"354 go ahead"
) -> bytes:
    """MAIL's reply, then a two-line 550 for RCPT to reject*, 250 for the others, then DATA's
    reply."""
    out = []
    for line in lines:
        if line.startswith(b"MAIL"):
            out.append(mail)
        elif line.startswith(b"RCPT"):
            # A multi-line refusal: the reader must take both lines as one reply.
            refusal = b"550-5.1.1 no such user\r\n550 5.1.1 see https://help.test/550"
            out.append(refusal if b"<reject" in line else b"250 2.1.5 ok")
        elif line == b"DATA":
            out.append(data)
    return b"".join(o + b"\r\n" for o in out)


def messages(peer: ScriptedPeer) -> list[bytes]:
    """The bodies the peer received, without the DSNs sent back to the sender."""
    return [b for b in peer.bodies if b"Mail Delivery System" not in b]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with mail_world(tmp_path) as w:
        yield w


async def test_mail_rcpt_and_data_go_out_in_one_write_and_every_reply_counts(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with scripted(per_line) as (peer, port):
        settings = world.settings(db_url, relayhost=f"{HOST}:{port}")
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "a@order.test", "reject@order.test", "b@order.test")
            final = await wait_final(pool, qid)
    assert final == {
        "a@order.test": "delivered",
        "reject@order.test": "bounced",
        "b@order.test": "delivered",
    }
    group = peer.reads[0].split(b"\r\n")[:-1]
    assert [line.split(b":")[0] for line in group] == [
        b"MAIL FROM",
        b"RCPT TO",
        b"RCPT TO",
        b"RCPT TO",
        b"DATA",
    ]
    assert len(messages(peer)) == 1  # (and a DSN for the refused recipient)
    rows = {r["address"]: r for r in await attempts(pool, qid)}
    assert (rows["reject@order.test"]["code"], rows["reject@order.test"]["enhanced_code"]) == (
        550,
        "5.1.1",
    )
    assert "help.test/550" in rows["reject@order.test"]["response"]
    assert (rows["a@order.test"]["code"], rows["a@order.test"]["enhanced_code"]) == (250, "2.0.0")


async def test_a_refused_mail_from_answers_for_every_recipient(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """The server refuses MAIL; its 503s to the pipelined RCPTs and DATA mean nothing: every
    recipient gets MAIL's reply, and the connection (still in step) carries the next message."""

    def refuse_sender(lines: list[bytes]) -> bytes:
        if b"<blocked@" in lines[0]:
            return b"550 5.7.1 sender refused\r\n" + b"503 5.5.1 need MAIL\r\n" * (len(lines) - 1)
        return per_line(lines)

    async with scripted(refuse_sender) as (peer, port):
        settings = world.settings(db_url, relayhost=f"{HOST}:{port}")
        async with running_engine(settings, pool, db_url):
            refused = await send(
                pool, org_id, "a@order.test", "b@order.test", sender="blocked@x.test"
            )
            assert await wait_final(pool, refused) == {
                "a@order.test": "bounced",
                "b@order.test": "bounced",
            }
            fine = await send(pool, org_id, "c@order.test")
            assert await wait_final(pool, fine) == {"c@order.test": "delivered"}
    rows = {r["address"]: (r["code"], r["enhanced_code"]) for r in await attempts(pool, refused)}
    assert rows == {"a@order.test": (550, "5.7.1"), "b@order.test": (550, "5.7.1")}
    assert len(messages(peer)) == 1


async def test_a_354_after_every_recipient_was_refused_ends_an_empty_message(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """RFC 2920 3.1: a server may take DATA although no RCPT succeeded; the client then sends a
    lone dot. Nothing is delivered, each recipient keeps its own refusal, and that connection
    is not trusted with more mail."""
    async with scripted(per_line) as (peer, port):
        settings = world.settings(db_url, relayhost=f"{HOST}:{port}")
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "reject-1@order.test", "reject-2@order.test")
            assert await wait_final(pool, qid) == {
                "reject-1@order.test": "bounced",
                "reject-2@order.test": "bounced",
            }
            later = await send(pool, org_id, "ok@order.test")
            assert await wait_final(pool, later) == {"ok@order.test": "delivered"}
    assert peer.empty_messages == 1
    assert len(messages(peer)) == 1  # only the later message
    assert peer.connections >= 2  # the one that took the unwanted DATA was closed


async def test_a_peer_that_does_not_speak_smtp_is_deferred_and_dropped(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with scripted(lambda lines: b"HTTP/1.1 400 Bad Request\r\n\r\n") as (_peer, port):
        settings = world.settings(
            db_url, relayhost=f"{HOST}:{port}", retry_initial=60, retry_max=60
        )
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "a@order.test")
            for _ in range(200):
                rows = await attempts(pool, qid)
                if rows:
                    break
                await asyncio.sleep(0.05)
    [row] = rows
    assert row["outcome"] == "deferred"
    assert "not an SMTP reply" in row["response"]


async def test_replies_split_anywhere_across_segments_are_put_together(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """The peer sends its replies to a pipelined group one byte per segment (TCP may cut a
    reply anywhere): each multi-line reply is still read whole, in order."""

    class Trickle(ScriptedPeer):
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            real_write = writer.write

            async def drained(data: bytes) -> None:
                for i in range(len(data)):
                    real_write(data[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(0)

            pending: list[asyncio.Task[None]] = []

            def trickle(data: bytes) -> None:
                pending.append(asyncio.ensure_future(drained(data)))

            writer.write = trickle  # type: ignore[method-assign]
            await super().handle(reader, writer)
            await asyncio.gather(*pending, return_exceptions=True)

    peer = Trickle(per_line)
    server = await asyncio.start_server(peer.handle, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        settings = world.settings(db_url, relayhost=f"{HOST}:{port}")
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "a@order.test", "reject@order.test")
            final = await wait_final(pool, qid)
    finally:
        server.close()
    assert final == {"a@order.test": "delivered", "reject@order.test": "bounced"}
    rows = {r["address"]: r for r in await attempts(pool, qid)}
    assert "help.test/550" in rows["reject@order.test"]["response"]


async def test_a_pooled_connection_the_peer_closed_is_replaced_without_costing_an_attempt(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """The peer hangs up after each message, and the next message comes within the two seconds
    in which a pooled connection is reused without an RSET probe: the dead connection is found
    (by the pool, or at MAIL), and the message goes over a new connection in the same attempt."""

    class OneMessagePerConnection(ScriptedPeer):
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            real_write = writer.write

            def write_then_hang_up(data: bytes) -> None:
                real_write(data)
                if data.startswith(b"250 2.0.0 queued"):
                    writer.close()

            writer.write = write_then_hang_up  # type: ignore[method-assign]
            await super().handle(reader, writer)

    peer = OneMessagePerConnection(per_line)
    server = await asyncio.start_server(peer.handle, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        settings = world.settings(db_url, relayhost=f"{HOST}:{port}", max_connections_per_host=1)
        async with running_engine(settings, pool, db_url):
            first = await send(pool, org_id, "a@order.test")
            assert await wait_final(pool, first) == {"a@order.test": "delivered"}
            second = await send(pool, org_id, "b@order.test")
            assert await wait_final(pool, second) == {"b@order.test": "delivered"}
    finally:
        server.close()
    [row] = await attempts(pool, second)
    assert (row["outcome"], row["attempt"]) == ("delivered", 1)
    assert peer.connections == 2
    assert len(messages(peer)) == 2
