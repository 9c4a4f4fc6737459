"""The settings schema: every option as a frozen dataclass field, with its default beside it.

Options are typed with the value types of config_values.py (`Duration`, `HostPort`, `Network`),
each of which parses its own config text. config_loader.py fills these dataclasses from the TOML file and the
environment by walking their fields, so adding an option is adding a field here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Literal

# The value types, here where the options are typed with them (and where callers find them).
from pigeon_mta.config_feedback import BounceSettings as BounceSettings
from pigeon_mta.config_feedback import ReputationSettings as ReputationSettings
from pigeon_mta.config_outbox import OutboxSettings as OutboxSettings
from pigeon_mta.config_shaping import ShapingSettings
from pigeon_mta.config_values import Duration as Duration
from pigeon_mta.config_values import HostPort as HostPort
from pigeon_mta.config_values import Network as Network


def _default_data_dir() -> str:
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return "/var/lib/pigeon-mta"
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "pigeon-mta")


def _default_hostname() -> str:
    return socket.getfqdn() or "localhost"


@dataclass(frozen=True)
class ServerSettings:
    hostname: str = field(default_factory=_default_hostname)
    data_dir: str = field(default_factory=_default_data_dir)
    # This node's name, distinct per node and stable across restarts (default: the hostname). Each run of `serve` writes "<node_name>/<run id>" into the leases it takes; a
    # second live node with the same name is refused (pigeon_mta/node.py).
    node_name: str = field(default_factory=socket.gethostname)
    # Accepting/delivering processes that `serve` runs; 0 means one per CPU core.
    processes: int = 0
    # How long `serve` waits on SIGTERM for in-flight work before releasing what is left.
    shutdown_timeout: Duration = Duration(30)


@dataclass(frozen=True)
class DatabaseSettings:
    # Empty: an embedded PostgreSQL is started in data_dir/postgres.
    url: str = ""
    pool_size: int = 10
    connect_timeout: Duration = Duration(5)
    # A statement that runs longer than this is cancelled (the client then gets 451).
    statement_timeout: Duration = Duration(10)


ListenerMode = Literal["submission", "submissions", "relay", "feedback"]


@dataclass(frozen=True)
class ListenerSettings:
    name: str
    address: HostPort
    mode: ListenerMode = "relay"
    tls_cert: str = ""
    tls_key: str = ""
    # Allow AUTH without TLS. Honoured only when the listener address is loopback.
    allow_plaintext_auth: bool = False
    # The lane of mail queued through this listener, unless its header or its AUTH user names
    # one ("" = the default lane, "transactional"). Must be a lane of [lanes].
    lane: str = ""


@dataclass(frozen=True)
class RelaySettings:
    trusted_networks: tuple[Network, ...] = (Network("127.0.0.0/8"), Network("::1/128"))
    trusted_org: str = "internal"
    # Sign mail of trusted_org whose From: domain belongs to another org with that org's active
    # DKIM key (else it goes out unsigned: each org's keys sign only its own mail). Any host in
    # trusted_networks can then send mail signed for every org's domains: it is their smarthost.
    sign_with_owner_key: bool = False
    # Which sender addresses an authenticated user may use (clients from trusted networks are not
    # checked): "strict" = the envelope sender and every From:, Sender:, Resent-From: and
    # Resent-Sender: address must be in one of the user's org's sender domains, and a message
    # must name a From: address (else 550 5.7.1); "envelope" = only the envelope sender is
    # checked; "off" = no check. A refused sender gets 553 5.7.1.
    sender_policy: Literal["strict", "envelope", "off"] = "strict"


@dataclass(frozen=True)
class LimitsSettings:
    # Advertised as SIZE; a larger message gets 552 5.3.4. 0 = no limit.
    max_message_size: int = 26214400
    # The header section (every field up to the blank line); a larger one gets 552 5.3.4 after
    # DATA and nothing is queued (as Exim's header_maxsize). It bounds the work done on a
    # message's header before it is queued and when it is signed. 0 = no limit.
    max_header_size: int = 1048576
    # Recipients per message; one more gets 452 4.5.3 (the client sends the rest in another).
    max_recipients: int = 100
    # Addresses in one From: field, and characters in its unfolded value (one address, with its
    # display name and comments, at most 512; comments nested at most 8 deep). A From: beyond
    # them is not parsed (see header_bounds.py): 550 5.6.0 after DATA, from any client, and
    # nothing is queued. They bound Sender:, Resent-From: and Resent-Sender: alike where the
    # sender policy reads them.
    max_from_addresses: int = 100
    max_from_length: int = 8192
    # Open connections from one client IP, counted per worker process; one more gets 421 4.7.0.
    # 0 = no limit.
    max_connections_per_ip: int = 50
    # A client silent this long between commands is disconnected (421 4.4.2).
    command_timeout: Duration = Duration(300)
    # The whole DATA phase must finish within this time, or the client is disconnected.
    data_timeout: Duration = Duration(600)
    # Failed AUTH attempts one client IP may make within auth_failure_window (counted across all
    # processes and nodes, in the database, from the IP's first failure; the count starts over
    # when the window has passed); beyond that its AUTH gets 454 4.7.0, even with the right
    # password, also when the attempts run in parallel. 0 turns throttling off.
    max_auth_failures: int = 5
    auth_failure_window: Duration = Duration(600)
    # Messages one SMTP AUTH credential may submit within credential_rate_window (counted in the
    # database, so across processes and nodes); beyond that MAIL gets 450 4.7.1. 0 = no limit.
    credential_rate_limit: int = 0
    credential_rate_window: Duration = Duration(3600)
    # A message line over RFC 5321's 998 octets: "fold" breaks it before the message is queued
    # (before its last space or tab within the limit, else at the limit with a space starting the
    # next part, as Postfix does when it relays); "refuse" answers the DATA with 500 5.5.2.
    long_lines: Literal["fold", "refuse"] = "fold"
    # Received: fields a message may carry, ours included (as Postfix's hopcount_limit): a message
    # that arrives with this many gets 554 5.4.6 after its DATA and is not queued, so that a
    # routing loop ends instead of circulating until delivery.max_age. 0 = no limit.
    max_hops: int = 50
    # Junk commands one connection may send between messages it gets queued (as Postfix's
    # smtpd_junk_command_limit); the next one gets 421 4.7.0 and the connection is closed. Junk:
    # NOOP, RSET, VRFY, EXPN, HELP, HELO, EHLO, and any command refused for its syntax or sequence
    # (unknown commands included), for want of AUTH or TLS, a failed AUTH or a relay refusal.
    # 0 = no limit.
    max_junk_commands: int = 100
    # An application that retries after a lost 250 sends the same message again. Within this
    # window a recipient that its org queued already under the same Message-ID (one the client
    # supplied; a message without its own has none) is not queued again: a transaction all of
    # whose recipients are such is answered with the queue id of the message queued first, one
    # with new recipients is queued for those only. Addresses compare case-insensitively, as the
    # suppression list does. "0" turns the check off.
    duplicate_window: Duration = Duration(3600)


# TLS policy towards a destination (see DeliverySettings.tls).
TlsPolicy = Literal["none", "opportunistic", "required", "verify"]
IpPreference = Literal["ipv4", "ipv6", "ipv4-only", "ipv6-only"]


@dataclass(frozen=True)
class DestinationSettings:
    """One [delivery.destination."PATTERN"] entry; a zero or empty value means "the default"."""

    # TLS policy for this destination ("" uses delivery.tls).
    tls: Literal["", "none", "opportunistic", "required", "verify"] = ""
    # SMTP sessions open at once to this destination, pooled idle ones included, for the whole
    # cluster: every process on every node together (0: delivery.destination_concurrency, which
    # holds per process).
    concurrency: int = 0
    # Messages per second to this destination for the whole cluster, as a token bucket shared
    # in the database (0: no limit).
    rate: float = 0.0
    # Messages the cluster's bucket lets through at once after a quiet spell (0: one second's
    # worth).
    burst: int = 0
    # Messages per connection (0: delivery.max_messages_per_connection).
    max_messages_per_connection: int = 0


@dataclass(frozen=True)
class DeliverySettings:
    # false: this node accepts and queues but delivers nothing (an accept-only node in a
    # scaled-out setup, or a pause during maintenance); other nodes deliver what it queues.
    enabled: bool = True
    port: int = 25
    retry_initial: Duration = Duration(300)
    retry_max: Duration = Duration(3600)
    max_age: Duration = Duration(5 * 86400)
    lease: Duration = Duration(300)
    relayhost: str = ""
    routes: dict[str, str] = field(default_factory=dict)
    # Recipients claimed per query; the claim is grouped per (message, domain) afterwards.
    batch_size: int = 100
    # How often an idle engine looks for due mail when no NOTIFY arrives.
    poll_interval: Duration = Duration(1)
    # After a wake-up, how long an idle engine lets new mail gather before it claims, and how
    # long the recorder lets results gather before it writes a small batch: fewer, larger
    # statements under load, for at most this much added delay.
    claim_wait: Duration = Duration(0.02)
    record_wait: Duration = Duration(0.02)
    # How often the lease sweeper and expiry run.
    sweep_interval: Duration = Duration(10)
    # SMTP transactions one worker process has in flight at once, across all destinations.
    # An asyncio engine holds thousands of sessions cheaply; far-away destinations need many in
    # flight to reach the CPU (bench/latency.py: 50 destinations at 200 ms round trip take about
    # 1,000 at once to deliver 1,000 msgs/s; 100 held it under 400).
    concurrency: int = 1000
    # The most of those one org's mail may hold (0-1; 1: no limit): the rest stays free for other
    # orgs' mail, so that a tenant whose destinations answer slowly cannot make the others wait.
    max_org_share: float = 0.75
    # Transactions one process runs at once to one destination (a recipient domain, the relayhost,
    # or what a [delivery.destination] pattern groups) that has no cluster-wide concurrency of its
    # own: the ceiling of its adaptive limit (adaptive_concurrency).
    destination_concurrency: int = 100
    # Each destination's limit per process follows its replies (as Postfix's adaptive
    # concurrency, with TCP's arithmetic): it starts at destination_concurrency_initial, grows
    # while replies come back fast and healthy (doubling per round at first), and is halved by a
    # throttling reply (rate-limited: 421 4.7.0, 4.7.28, ...) or a failed or broken connection,
    # within [1, destination_concurrency]. false: a fixed destination_concurrency.
    adaptive_concurrency: bool = True
    destination_concurrency_initial: int = 20
    # Open connections one process keeps to one MX host address (host, IP, port and TLS mode):
    # with one MX address, a destination's concurrency cannot go beyond it.
    max_connections_per_host: int = 100
    # Messages sent over one connection before it is closed and a fresh one opened.
    max_messages_per_connection: int = 100
    # A pooled connection idle this long is closed (with QUIT).
    idle_timeout: Duration = Duration(30)
    # TCP connect plus the server's greeting.
    connect_timeout: Duration = Duration(30)
    # Each reply to EHLO, STARTTLS, AUTH, MAIL, RCPT, RSET and DATA (RFC 5321 4.5.3.2: 5 minutes).
    command_timeout: Duration = Duration(300)
    # The reply to the final dot (RFC 5321 4.5.3.2.6: 10 minutes).
    data_timeout: Duration = Duration(600)
    # TLS to MX hosts: none (never STARTTLS) | opportunistic (STARTTLS when offered; if the
    # handshake fails, a new plaintext connection) | required (STARTTLS or no delivery, any
    # certificate) | verify (STARTTLS with a certificate valid for the MX host name).
    tls: TlsPolicy = "opportunistic"
    # CA bundle (PEM) that `verify` trusts; empty means the system's trust store.
    tls_ca_file: str = ""
    # Address family order for MX hosts: ipv4 | ipv6 (that family first, then the other) |
    # ipv4-only | ipv6-only.
    ip_preference: IpPreference = "ipv4"
    # SMTP AUTH at the relayhost (both or neither). The password goes only to a relayhost whose
    # certificate verifies: it needs relayhost_tls = "verify" (or relayhost_auth_insecure).
    relayhost_username: str = ""
    relayhost_password: str = ""
    # TLS policy for the relayhost (same choices as `tls`).
    relayhost_tls: TlsPolicy = "opportunistic"
    # true: send the relayhost password over relayhost_tls = "required", which takes any
    # certificate, so whoever sits between this node and the relayhost can collect it. Warned
    # about at start and by check-config. Never over plaintext.
    relayhost_auth_insecure: bool = False
    # A delivery that would wait longer than this for its destination's per-process concurrency
    # (destination_concurrency) goes back to the queue until the destination has room (not
    # counted as an attempt). Mail held by a cluster budget (a destination's rate or concurrency,
    # a lane's or an org's rate) never waits: it goes back at once, due when the budget has room.
    throttle_wait: Duration = Duration(5)
    # A throttling reply from a destination (classified rate-limited, e.g. 421 4.7.0, Gmail's
    # 4.7.28, Microsoft's 4.7.650) multiplies its effective rate and concurrency by this, for the
    # whole cluster (at least 1 message/s and 1 session; one decrease per second at most).
    backoff_factor: float = 0.5
    # After this long without a throttling reply, the effective rate and concurrency go up by
    # backoff_step times their configured values (for a destination without any, what was being
    # sent when the throttling began), each quiet period again until they are back.
    backoff_quiet: Duration = Duration(30)
    backoff_step: float = 0.1
    # A site whose connections fail (refused, timed out, broken before a reply) this many times
    # in a row, cluster-wide, with none healthy between, is parked: its mail waits in the site's
    # queue, unattempted and unwritten, while one probe delivery is tried after park_for, then
    # after twice as long each failed probe, up to park_max (0: never parked).
    park_after: int = 5
    park_for: Duration = Duration(30)
    park_max: Duration = Duration(600)
    # Per-destination policy, keyed by a recipient domain or a shell-style pattern matched against
    # the recipient domain and the names of its MX hosts ("*.google.com" groups every domain that
    # Google hosts). See DestinationSettings.
    destination: dict[str, DestinationSettings] = field(default_factory=dict)


@dataclass(frozen=True)
class DnsSettings:
    nameservers: tuple[str, ...] = ()
    # How long one lookup may take (every nameserver, retries included) before it counts as a
    # temporary failure.
    timeout: Duration = Duration(10)
    # Answers kept in the TTL cache (least recently used are dropped first).
    cache_size: int = 10000


@dataclass(frozen=True)
class MetricsSettings:
    listen: HostPort = HostPort("127.0.0.1", 9187)
    # Queue gauges are refreshed from one query this often.
    stats_interval: Duration = Duration(5)


# The listener name HTTP API mail is stored and counted under (message.listener, the metrics'
# `listener` label); no [[listener]] may take it.
API_LISTENER = "api"
# The same for mail relayed from an outbox ([[outbox]]); its auth_user is "outbox:<name>".
OUTBOX_LISTENER = "outbox"
OUTBOX_USER_PREFIX = "outbox:"
# How a message sent with an API key names it as its auth_user: "apikey:<id>" (never a login).
API_KEY_USER_PREFIX = "apikey:"


@dataclass(frozen=True)
class ApiSettings:
    # The HTTP API (POST /v1/messages, ...), served by every worker process on this address; ""
    # (None here) serves no API.
    listen: HostPort | None = HostPort("127.0.0.1", 8025)
    # HTTPS with this certificate chain and key (PEM; both or neither). Without them the API
    # speaks plain HTTP: keep it on loopback, or behind a proxy that adds TLS.
    tls_cert: str = ""
    tls_key: str = ""
    # A client must send a request's line and header fields within this long of connecting (or of
    # the previous answer on a kept-alive connection), and then its body within this long: one
    # that trickles bytes (slowloris) is cut off instead of holding a connection for ever. An idle
    # kept-alive connection is closed after it too.
    read_timeout: Duration = Duration(30)
    # Each process remembers a valid API key, and that a sender domain is its org's, for this long
    # instead of asking the database at every request: a revoked key or a removed domain is
    # refused at the latest this long after. "0" asks at every request.
    auth_cache: Duration = Duration(1)
    # The bytes of request bodies one process holds at once (their Content-Length; a body without
    # one counts as the largest the API reads): a request beyond it waits for room for up to
    # read_timeout, then is answered 503 with Retry-After. Never less than the largest body
    # (twice limits.max_message_size and a MiB: base64 in JSON), which is then read alone.
    max_body_memory: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class RetentionSettings:
    # Finished messages (every recipient delivered, bounced, expired, cancelled or suppressed) are
    # deleted with their recipients and attempt log this long after they were received, and the
    # records of duplicate submissions (limits.duplicate_window) with them. "0" keeps them forever
    # (the tables then grow without bound).
    messages: Duration = Duration(30 * 86400)


@dataclass(frozen=True)
class WebhookSettings:
    # An event is retried (with backoff and jitter) until it is this old; then it is marked
    # failed, and `pigeon-mta webhook list` counts it.
    max_age: Duration = Duration(86400)
    # Requests each worker process has in flight to one endpoint at most: a stalled endpoint
    # holds this many, and no more, while the others are served as usual.
    concurrency_per_endpoint: int = 8
    # A request that has no complete reply after this long counts as failed and is retried.
    timeout: Duration = Duration(10)
    # The delay before the first retry; each retry doubles it, up to retry_max.
    retry_initial: Duration = Duration(10)
    retry_max: Duration = Duration(3600)
    # How often a sender looks in the outbox for due events (retries, events written by other
    # processes or beyond its room) at least; the events of its own process's outcomes are
    # handed to it by the record that writes them.
    poll_interval: Duration = Duration(1)


LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class LogSettings:
    # The process's own log (stderr); $PIGEON_LOG_LEVEL overrides it.
    level: LogLevel = "info"
    # "text": `time level logger[pid]: message`; "json": one JSON object per line.
    format: Literal["text", "json"] = "text"
    # Delivery log records (one JSON object per line per event): "-" is stdout, "" turns them
    # off, anything else is a file that every process appends to.
    delivery_log: str = "-"


# The lane every message is in unless it names another; and the lane for campaigns.
DEFAULT_LANE = "transactional"
BULK_LANE = "bulk"


@dataclass(frozen=True)
class LaneSettings:
    """One [lanes.NAME] entry: a class of mail with its own share of the delivery capacity."""

    # Share of delivery capacity while several lanes have due mail (within a lane, every org
    # with due mail gets an even part of the lane's share).
    weight: float = 1.0
    # Messages per second for the whole lane, across every process and node (0: no limit).
    rate: float = 0.0
    # How long a recipient in this lane is retried before it expires ("0": delivery.max_age).
    max_age: Duration = Duration(0)


# `[lanes] header`: how far a message's X-Pigeon-Lane field (the API's `lane`) may move it from
# the lane the operator set (intake/lanes.py).
LaneHeader = Literal["any", "lower", "off"]
LANE_HEADER_POLICIES: tuple[LaneHeader, ...] = ("any", "lower", "off")


def default_lanes() -> dict[str, LaneSettings]:
    """The built-in lanes; [lanes.NAME] entries add lanes or change these."""
    return {DEFAULT_LANE: LaneSettings(weight=10.0), BULK_LANE: LaneSettings(weight=1.0)}


def _default_listeners() -> tuple[ListenerSettings, ...]:
    return (
        ListenerSettings(name="relay", address=HostPort("127.0.0.1", 2525), mode="relay"),
        ListenerSettings(name="submission", address=HostPort("127.0.0.1", 2587), mode="submission"),
    )


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    listener: tuple[ListenerSettings, ...] = field(default_factory=_default_listeners)
    relay: RelaySettings = field(default_factory=RelaySettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    dns: DnsSettings = field(default_factory=DnsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    bounces: BounceSettings = field(default_factory=BounceSettings)
    reputation: ReputationSettings = field(default_factory=ReputationSettings)
    log: LogSettings = field(default_factory=LogSettings)
    webhooks: WebhookSettings = field(default_factory=WebhookSettings)
    # Tables in applications' databases that pigeon-mta relays ([[outbox]], config_outbox.py).
    outbox: tuple[OutboxSettings, ...] = ()
    # Reply rules ([[shaping.rule]], config_shaping.py).
    shaping: ShapingSettings = field(default_factory=ShapingSettings)
    # Lanes by name: always "transactional" and "bulk", and those [lanes.NAME] declares.
    lanes: dict[str, LaneSettings] = field(default_factory=default_lanes)
    # `[lanes] header` (config_loader.py reads it from the [lanes] table): "lower" lets the
    # X-Pigeon-Lane field only move mail to a lane that weighs no more than the operator's.
    lane_header: LaneHeader = "lower"
    # Where the settings came from, for messages ("built-in defaults" or a path).
    source: str = "built-in defaults"

    def max_age_of(self, lane: str) -> float:
        """Seconds a recipient of `lane` is retried before it expires: the lane's max_age, else
        delivery.max_age (also for a lane the settings do not have)."""
        settings = self.lanes.get(lane)
        if settings is not None and settings.max_age > 0:
            return float(settings.max_age)
        return float(self.delivery.max_age)
