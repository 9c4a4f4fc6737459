"""The addresses `serve` shares between its worker processes: a start is refused while another
process already listens on one.

Every worker process binds each `[[listener]]` and `[api] listen` with SO_REUSEPORT, so that the
kernel spreads connections over them. The same option lets any other process of the same user bind
the same address, and the kernel then splits the clients between it and this node without a word
to either: a second `serve` with a copy of the config (another data_dir, another database) would be
such a process. So before any worker binds, the supervisor binds each address once WITHOUT
SO_REUSEPORT, which the kernel refuses (EADDRINUSE) while any socket listens there, whatever its
options, and closes it again. It sets SO_REUSEADDR as the workers do, so that the connections of a
stopped run waiting in TIME_WAIT do not hold a restart back, and binds IPv6 addresses IPv6-only as
asyncio's `create_server` does. Port 0 is not probed: each process binds a port of its own there.

Only "in use" refuses the start. Any other error (an address not on this host, a port that needs
privileges, a host name that does not resolve) is the workers' to report when they bind, as usual.
The probe is not a lock: two starts in the same instant may both pass it before either binds.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from pigeon_mta.config import HostPort, Settings
from pigeon_mta.node import ServeRefused


@dataclass(frozen=True)
class SharedAddress:
    address: HostPort
    # The refusal's start, naming the setting as the workers' own bind errors do.
    refusal: str


def shared_addresses(settings: Settings) -> list[SharedAddress]:
    """The addresses every worker process binds with SO_REUSEPORT. (The metrics listener is bound
    once, by the supervisor, without it: another holder makes that bind fail on its own.)"""
    shared = [
        SharedAddress(lsn.address, f"listener '{lsn.name}' cannot bind {lsn.address}")
        for lsn in settings.listener
    ]
    api = settings.api.listen
    if api is not None:
        shared.append(SharedAddress(api, f"the HTTP API cannot bind 'api.listen' {api}"))
    return shared


def refuse_if_taken(settings: Settings) -> None:
    """Raise ServeRefused naming the first shared address another process listens on."""
    for shared in shared_addresses(settings):
        if shared.address.port != 0 and in_use(shared.address):
            raise ServeRefused(
                f"{shared.refusal}: the address is in use by another process "
                f"(another pigeon-mta serve?)"
            )


def in_use(address: HostPort) -> bool:
    """Whether a socket of another process listens on `address` (on any of the addresses its
    host resolves to, as `create_server` binds them all)."""
    try:
        found = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return False
    for family, kind, proto, _name, sockaddr in dict.fromkeys(found):
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host does not have: the workers skip it too
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False
