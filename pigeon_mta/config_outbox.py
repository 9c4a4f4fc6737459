"""`[[outbox]]`: a table in an application's own database that the application writes its mail
to, in the transaction of the change that caused it, and that pigeon-mta relays (outbox/)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pigeon_mta.config_values import Duration


@dataclass(frozen=True)
class OutboxSettings:
    # What `outbox install|list` and the metrics (`outbox` label) call it.
    name: str
    # The application's database (a PostgreSQL URL): where the table is.
    database: str
    # Whose mail it is: the org its rows are sent as, its sender domains and rate.
    org: str
    # The table, optionally with its schema (SCHEMA.TABLE).
    table: str = "pigeon_outbox"
    # How long a relayed row stays in the table (its queue_id written back) before it is deleted.
    retention: Duration = Duration(7 * 86400)
    # Rows claimed and relayed in one transaction of the application's database.
    batch: int = 200
    # How often the table is read without a notification (one lost with a connection).
    poll_interval: Duration = Duration(2)


# An outbox's name, as the metrics' `outbox` label and the CLI carry it.
OUTBOX_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# A table name, optionally with its schema: plain identifiers only, since they are written into
# the statements (and the DDL `outbox install` prints) as they are.
TABLE_NAME = re.compile(r"([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,50}")
MAX_BATCH = 1000


def check_outboxes(outboxes: tuple[OutboxSettings, ...]) -> str | None:
    """What is wrong with the [[outbox]] entries, as one sentence; None when nothing is."""
    names = [o.name for o in outboxes]
    for i, outbox in enumerate(outboxes):
        where = f"outbox[{i}]"
        if not OUTBOX_NAME.fullmatch(outbox.name):
            return (
                f"bad '{where}.name' {outbox.name!r}: use lower-case letters, digits, '_' and "
                "'-' (at most 63, starting with a letter or digit)"
            )
        if names.count(outbox.name) > 1:
            return f"outbox name '{outbox.name}' is used twice"
        if not outbox.database.startswith(("postgresql://", "postgres://")):
            return f"'{where}.database' must be a postgresql:// URL (the application's database)"
        if not outbox.org.strip():
            return f"'{where}.org' must name the org whose mail it is"
        if not TABLE_NAME.fullmatch(outbox.table):
            return (
                f"bad '{where}.table' {outbox.table!r}: a lower-case identifier, optionally "
                "with its schema (schema.table)"
            )
        if not 1 <= outbox.batch <= MAX_BATCH:
            return f"'{where}.batch' must be 1 to {MAX_BATCH}"
        if outbox.poll_interval <= 0 or outbox.retention <= 0:
            return f"'{where}.poll_interval' and '{where}.retention' must be more than zero"
    return None
