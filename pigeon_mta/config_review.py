"""Settings that load but deserve a word: warnings, one sentence each, and the routing in effect.

`check-config` prints them and `serve` logs them once when it starts (not once per worker). A
warning never stops either: each describes a setting that works but is probably not what the
operator wants on a server that talks to the internet.
"""

from __future__ import annotations

import ipaddress

from pigeon_mta.config import ListenerSettings, Settings
from pigeon_mta.submission.tls import self_signed_path

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Address space that is not routed on the internet: a trusted network inside these is only as open
# as the site's own network (RFC 1918, RFC 6598 shared space, loopback, link-local, RFC 4193 ULA).
_PRIVATE: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
    )
)

# Networks that container runtimes give their bridges by default. A runtime that forwards a
# published port from user space (Docker's userland proxy, rootless Podman's port forwarder,
# slirp4netns) hands the container connections from anywhere with the bridge's gateway as their
# source address: trusting such a network can trust the whole internet.
_CONTAINER_BRIDGES: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(n), what)
    for n, what in (
        ("172.16.0.0/12", "Docker's bridge networks"),
        ("10.88.0.0/16", "Podman's default network"),
        ("10.89.0.0/16", "Podman's other networks"),
        ("10.0.2.0/24", "slirp4netns's network"),
    )
)

# How many static routes the routing summary names before it only counts the rest.
_ROUTES_SHOWN = 10


def config_warnings(settings: Settings) -> list[str]:
    """What an operator should hear about these settings, one sentence each."""
    return [
        *_hostname_warnings(settings),
        *_trusted_network_warnings(settings),
        *_self_signed_warnings(settings),
        *_relayhost_warnings(settings),
        *_plain_api_warnings(settings),
    ]


def routing_summary(settings: Settings) -> str:
    """Where mail goes, in one line: routes first, then the relayhost, else MX."""
    delivery = settings.delivery
    if not delivery.enabled:
        return "off on this node (delivery.enabled = false)"
    parts = []
    if delivery.routes:
        shown = [f"{domain} -> {target}" for domain, target in delivery.routes.items()]
        more = len(shown) - _ROUTES_SHOWN
        listed = ", ".join(shown[:_ROUTES_SHOWN]) + (f" and {more} more" if more > 0 else "")
        parts.append(f"static routes {listed}")
    everything = "everything else" if delivery.routes else "everything"
    if delivery.relayhost:
        auth = f", AUTH as {delivery.relayhost_username}" if delivery.relayhost_username else ""
        parts.append(
            f"{everything} through relayhost {delivery.relayhost} "
            f"(TLS {delivery.relayhost_tls}{auth})"
        )
    else:
        parts.append(f"{everything} to the recipient domains' MX hosts on port {delivery.port}")
    return "; ".join(parts)


def _relayhost_warnings(settings: Settings) -> list[str]:
    delivery = settings.delivery
    if (
        delivery.relayhost_username
        and delivery.relayhost_tls != "verify"
        and delivery.relayhost_auth_insecure
    ):
        return [
            f"the relayhost password goes to any certificate ('delivery.relayhost_tls' is "
            f"{delivery.relayhost_tls}, 'delivery.relayhost_auth_insecure' is true): whoever "
            "sits between this node and the relayhost can collect it; use verify"
        ]
    return []


def _hostname_warnings(settings: Settings) -> list[str]:
    name = settings.server.hostname.lower()
    uses = (
        "remote servers see it in EHLO, and Message-IDs and bounces "
        f"(MAILER-DAEMON@{settings.server.hostname}) carry it"
    )
    if name == "localhost" or name.startswith("localhost.") or name.endswith(".localhost"):
        problem = f"is {settings.server.hostname}"
    elif "." not in name:
        problem = f"{settings.server.hostname!r} has no dot"
    else:
        return []
    return [
        f"'server.hostname' {problem}: {uses}; set it to this host's DNS name "
        "(the name its PTR record gives)"
    ]


def _trusted_network_warnings(settings: Settings) -> list[str]:
    exposed = [lsn for lsn in settings.listener if lsn.mode == "relay" and not _loopback(lsn)]
    if not exposed:
        return []
    where = ", ".join(f"'{lsn.name}' ({lsn.address})" for lsn in exposed)
    warnings = []
    for text in settings.relay.trusted_networks:
        network = ipaddress.ip_network(text)
        if not any(_within(network, private) for private in _PRIVATE):
            warnings.append(
                f"'relay.trusted_networks' includes {network}, which covers public addresses: "
                f"clients there relay through listener {where} without AUTH"
            )
            continue
        for bridge, what in _CONTAINER_BRIDGES:
            if network.version == bridge.version and network.overlaps(bridge):
                warnings.append(
                    f"'relay.trusted_networks' includes {network}, which overlaps {what} ({bridge}): "
                    f"where a container runtime forwards the port of listener {where}, "
                    "connections from anywhere can come from such an address and relay without AUTH"
                )
                break
    return warnings


def _self_signed_warnings(settings: Settings) -> list[str]:
    without = [lsn.name for lsn in settings.listener if not lsn.tls_cert]
    if not without:
        return []
    which, have, use = (
        ("listener", "has", "uses") if len(without) == 1 else ("listeners", "have", "use")
    )
    return [
        f"{which} {', '.join(without)} {have} no tls_cert/tls_key and {use} the self-signed "
        f"certificate {self_signed_path(settings)} (clients that verify certificates refuse it "
        "unless told to trust it; configure a real one)"
    ]


def _plain_api_warnings(settings: Settings) -> list[str]:
    api = settings.api
    if api.listen is None or api.tls_cert or _loopback_host(api.listen.host):
        return []
    return [
        f"the HTTP API on {api.listen} speaks plain HTTP: API keys and messages cross the "
        "network unencrypted (set api.tls_cert and api.tls_key, or let a TLS proxy in front "
        "reach it on loopback)"
    ]


def _loopback(listener: ListenerSettings) -> bool:
    return _loopback_host(listener.address.host)


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address


def _within(network: IPNetwork, outer: IPNetwork) -> bool:
    return network.version == outer.version and network.subnet_of(outer)  # type: ignore[arg-type]
