"""A relay to PostgreSQL on loopback that can lose the answer to a commit: the commit is durable,
and its client hears only that the connection broke.

    asyncpg ──► CommitCutter 127.0.0.1:<port> ──► PostgreSQL

It reads what the server sends as protocol messages (a type byte, then a length that counts
itself), so its clients must not ask for TLS (sslmode=disable). Once `cut_next_commit()` arms it,
it relays the server's messages until a command has completed ('C', CommandComplete) and the
server is ready for the next ('Z', ReadyForQuery); a statement outside a transaction block is
committed by then (the Sync that precedes ReadyForQuery commits it). That ReadyForQuery is not
relayed: the relay closes both connections instead.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Coroutine
from typing import Any


class CommitCutter:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut = asyncio.Event()  # set once the answer to a commit has been dropped
        self._armed = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen on 127.0.0.1; returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def cut_next_commit(self) -> None:
        self.cut.clear()
        self._armed = True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        both = (client_w, server_w)
        self._writers.update(both)
        for relay in (self._upstream(client_r, server_w), self._downstream(server_r, client_w)):
            task = asyncio.ensure_future(self._closing(relay, both))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _closing(
        self, relay: Coroutine[Any, Any, None], both: tuple[asyncio.StreamWriter, ...]
    ) -> None:
        """Run one direction; when it ends, for whatever reason, close both connections."""
        try:
            await relay
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in both:
                writer.close()
                self._writers.discard(writer)

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        completed = False  # a command completed since the relay was armed
        while True:
            head = await reader.readexactly(5)
            (length,) = struct.unpack("!I", head[1:])
            message = head + await reader.readexactly(length - 4)
            if self._armed:
                if head[:1] == b"C":
                    completed = True
                elif head[:1] == b"Z" and completed:
                    self._armed = False
                    self.cut.set()
                    return
            writer.write(message)
            await writer.drain()
