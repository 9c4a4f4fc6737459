"""Every Prometheus metric pigeon-mta exports, in one place (names are part of the interface contract).

Labels never carry a domain or an address: their cardinality would follow the traffic.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

# ---------------------------------------------------------------- submission
MESSAGES_ACCEPTED = Counter(
    "pigeon_messages_accepted", "Messages accepted and queued", ["listener"]
)
SMTP_REJECTIONS = Counter(
    "pigeon_smtp_rejections", "SMTP commands or messages refused", ["listener", "reason"]
)
AUTH_FAILURES = Counter("pigeon_auth_failures", "Failed SMTP AUTH attempts", ["listener"])
DUPLICATE_RECIPIENTS = Counter(
    "pigeon_duplicate_recipients",
    "Recipients not queued again: their org queued them under the same Message-ID within "
    "limits.duplicate_window",
    ["listener"],
)

# ---------------------------------------------------------------- HTTP API
# `route` is a route's pattern ("/v1/messages/{queue_id}") or "other" (a path no route has), and
# `method` one of HTTP's or "other": bounded sets, whatever clients send.
API_REQUESTS = Counter(
    "pigeon_api_requests", "HTTP API requests answered", ["route", "method", "status"]
)
API_REQUEST_SECONDS = Histogram(
    "pigeon_api_request_seconds",
    "Time from an HTTP API request's head to its answer",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# ---------------------------------------------------------------- queue (set by the stats query)
# `lane` is a lane of [lanes], or one that queued mail still carries after the settings dropped
# it: a bounded set the operator chooses.
QUEUE_RECIPIENTS = Gauge(
    "pigeon_queue_recipients",
    "Recipients in the queue by status and lane",
    ["status", "lane"],
    multiprocess_mode="mostrecent",
)
QUEUE_OLDEST_AGE = Gauge(
    "pigeon_queue_oldest_age_seconds",
    "How long the longest-waiting due recipient of the lane has waited",
    ["lane"],
    multiprocess_mode="mostrecent",
)

# ---------------------------------------------------------------- delivery
DELIVERIES = Counter(
    "pigeon_deliveries",
    "Recipient outcomes (delivered, deferred, bounced, expired, suppressed)",
    ["outcome"],
)
DELIVERY_ATTEMPT_SECONDS = Histogram(
    "pigeon_delivery_attempt_seconds",
    "Time of one SMTP delivery transaction",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
ACCEPT_TO_DELIVERY_SECONDS = Histogram(
    "pigeon_accept_to_delivery_seconds",
    "Time from the 250 to the client until the recipient's server accepted the message",
    buckets=(
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
        300,
        900,
        3600,
        14400,
        86400,
    ),
)
OUTBOUND_CONNECTIONS_OPEN = Gauge(
    "pigeon_outbound_connections_open",
    "Open outbound SMTP connections",
    multiprocess_mode="livesum",
)
OUTBOUND_CONNECTION_REUSES = Counter(
    "pigeon_outbound_connection_reuses", "Outbound transactions that reused an open connection"
)
# Budgets (outbound/budgets.py). `budget` and `destination` carry a configured destination's key
# ("destination:pattern:*.google.com"), else "destination" / "other"; "lane", "org": bounded.
BUDGET_POSTPONED = Counter(
    "pigeon_budget_postponed",
    "Deliveries handed back unattempted for want of budget (reason: rate, concurrency, backoff, "
    "unavailable)",
    ["budget", "reason"],
)
DESTINATION_THROTTLING = Counter(
    "pigeon_destination_throttling_replies",
    "Throttling replies (rate-limited) from destinations, each lowering their budget",
    ["destination"],
)
BUDGETS_BACKING_OFF = Gauge(
    "pigeon_budgets_backing_off",
    "Destinations backing off after throttling replies, cluster-wide",
    multiprocess_mode="mostrecent",
)
DKIM_SIGNATURES = Counter("pigeon_dkim_signatures", "DKIM signatures made", ["algorithm"])
DKIM_UNSIGNED = Counter(
    "pigeon_dkim_unsigned",
    "Messages sent without a DKIM signature (no_key, no_from_domain, malformed)",
    ["reason"],
)

# ---------------------------------------------------------------- queue, continued
QUEUE_DUE_RECIPIENTS = Gauge(
    "pigeon_queue_due_recipients",
    "Queued recipients whose next attempt is due now (work no engine has claimed yet)",
    multiprocess_mode="mostrecent",
)

# ---------------------------------------------------------------- feedback
FEEDBACK = Counter(
    "pigeon_feedback",
    "Feedback messages read (feedback listener): kind (bounce, delay, complaint, unknown) by what "
    "became of them (applied, unmatched, not-understood)",
    ["kind", "outcome"],
)

OUTBOX_ROWS = Counter(
    "pigeon_outbox_rows",
    "Rows of an outbox in an application's database, by what the relay did with them: queued, "
    "repeat (queued before, answered again with its queue id), refused (its error written)",
    ["outbox", "outcome"],
)
# Set by each worker's relay of the outbox, read from the application's database every few
# seconds; the node's value is the freshest live process's.
OUTBOX_BACKLOG = Gauge(
    "pigeon_outbox_backlog",
    "Rows of an outbox waiting to be relayed (refused rows not counted)",
    ["outbox"],
    multiprocess_mode="livemostrecent",
)
OUTBOX_OLDEST_AGE = Gauge(
    "pigeon_outbox_oldest_age_seconds",
    "Age of the oldest row of an outbox waiting to be relayed (0 when none waits)",
    ["outbox"],
    multiprocess_mode="livemostrecent",
)
OUTBOX_REFUSED = Gauge(
    "pigeon_outbox_refused",
    "Rows of an outbox the intake refused, their error written, waiting for the application",
    ["outbox"],
    multiprocess_mode="livemostrecent",
)
OUTBOX_REACHABLE = Gauge(
    "pigeon_outbox_reachable",
    "Worker processes whose relay of the outbox is connected to the application's database",
    ["outbox"],
    multiprocess_mode="livesum",
)

ORG_BOUNCE_RATE = Gauge(
    "pigeon_org_bounce_rate",
    "An org's hard bounces (at once or reported later) per recipient sent over [reputation] window",
    ["org"],
    multiprocess_mode="mostrecent",
)
ORG_COMPLAINT_RATE = Gauge(
    "pigeon_org_complaint_rate",
    "An org's complaints per recipient sent over [reputation] window",
    ["org"],
    multiprocess_mode="mostrecent",
)

# ---------------------------------------------------------------- webhooks
WEBHOOK_DELIVERIES = Counter(
    "pigeon_webhook_deliveries",
    "Webhook requests by what became of their event: delivered (2xx), retried (no 2xx, tried "
    "again later), failed (no 2xx within webhooks.max_age: given up)",
    ["outcome"],
)
WEBHOOK_BACKLOG = Gauge(
    "pigeon_webhook_backlog",
    "Webhook events waiting to be sent, cluster-wide",
    multiprocess_mode="mostrecent",
)

# ---------------------------------------------------------------- the engine's record
RECORD_FAILURES = Counter(
    "pigeon_record_failures",
    "Delivery results that could not be recorded at the first try (step: database, the batch "
    "kept for a retry while the database is away; isolated, a result that failed its batch and "
    "was recorded plain, alone; without_notices, recorded without its DSN and suppression entry; "
    "dropped, not recorded at all: its lease runs out and it is tried again)",
    ["step"],
)
DSN_FAILURES = Counter(
    "pigeon_dsn_failures",
    "DSNs that could not be made at the first try (step: plain, built again from the replies' "
    "plain text; skipped, not built at all; refused, built but refused by the database): a "
    "skipped or refused DSN leaves its sender untold, with an error in the log",
    ["step"],
)
MAINTENANCE_FAILURES = Counter(
    "pigeon_maintenance_failures",
    "Queue maintenance tasks that failed for another reason than the database being away "
    "(task: requeue_lost_leases, expire, warn_delayed, purge); the round went on without them",
    ["task"],
)
RECORDER_PENDING = Gauge(
    "pigeon_recorder_pending_results",
    "Delivery results waiting to be recorded, over the live worker processes",
    multiprocess_mode="livesum",
)
RECORDERS_STALLED = Gauge(
    "pigeon_recorders_stalled",
    "Worker processes whose results have waited longer than the recorder's stall time "
    "without any being recorded (the node is then not ready)",
    multiprocess_mode="livesum",
)

# ---------------------------------------------------------------- processes and readiness
# Each worker sets its own value; the node's value is the sum over live processes.
LISTENERS_BOUND = Gauge(
    "pigeon_listeners_bound",
    "Worker processes that have this listener's socket bound and are accepting on it",
    ["listener"],
    multiprocess_mode="livesum",
)
WORKERS_READY = Gauge(
    "pigeon_workers_ready",
    "Worker processes whose services have all started",
    multiprocess_mode="livesum",
)
WORKER_STARTS = Counter(
    "pigeon_worker_starts", "Worker processes that started all their services (restarts count)"
)
DELIVERY_LOG_ERRORS = Counter(
    "pigeon_delivery_log_errors", "Delivery log records that could not be written"
)


# ---------------------------------------------------------------- series that exist from the start
# Label values known before any traffic. Their series are created at 0 when `serve` starts, so that
# a dashboard shows 0 rather than "no data", and rate() and increase() count the first event (a
# series that appears with its first increment starts at 1, and that 1 is never seen as a rise).
DELIVERY_OUTCOMES = ("delivered", "deferred", "bounced", "expired", "suppressed")
DKIM_ALGORITHMS = ("rsa", "ed25519")
WEBHOOK_OUTCOMES = ("delivered", "retried", "failed")
DKIM_UNSIGNED_REASONS = ("no_key", "no_from_domain", "malformed")
RECORD_FAILURE_STEPS = ("database", "isolated", "without_notices", "dropped")
DSN_FAILURE_STEPS = ("plain", "skipped", "refused")
MAINTENANCE_TASKS = ("requeue_lost_leases", "expire", "warn_delayed", "purge", "reputation")


def start_at_zero(listeners: Iterable[str]) -> None:
    """Create the labelled series whose label values are known at start (the configured listener
    names and the fixed vocabularies above), each at 0."""
    for name in listeners:
        MESSAGES_ACCEPTED.labels(listener=name)
        AUTH_FAILURES.labels(listener=name)
        DUPLICATE_RECIPIENTS.labels(listener=name)
        LISTENERS_BOUND.labels(listener=name)
    for metric, label, values in (
        (DELIVERIES, "outcome", DELIVERY_OUTCOMES),
        (WEBHOOK_DELIVERIES, "outcome", WEBHOOK_OUTCOMES),
        (DKIM_SIGNATURES, "algorithm", DKIM_ALGORITHMS),
        (DKIM_UNSIGNED, "reason", DKIM_UNSIGNED_REASONS),
        (RECORD_FAILURES, "step", RECORD_FAILURE_STEPS),
        (DSN_FAILURES, "step", DSN_FAILURE_STEPS),
        (MAINTENANCE_FAILURES, "task", MAINTENANCE_TASKS),
    ):
        for value in values:
            metric.labels(**{label: value})
