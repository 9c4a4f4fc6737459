"""The kernel's TCP sockets as /proc/net/tcp and /proc/net/tcp6 list them, for tests that check
which ports a process listens on or which connections wait in TIME_WAIT."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"
TIME_WAIT = "06"


@dataclass(frozen=True)
class TcpSocket:
    local_port: int
    state: str  # the kernel's hex code: LISTEN, TIME_WAIT, ...
    inode: str


def tcp_sockets() -> list[TcpSocket]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            found.append(TcpSocket(port, fields[3], fields[9]))
    return found


def socket_inodes(pids: list[int]) -> set[str]:
    """The inodes of the sockets these processes hold open."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes
