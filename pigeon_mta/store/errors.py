"""What a database call's error says: the database is away, or it refused the values it was given.

Callers decide by these what to do with work that failed: keep it and try again as it is (the
database will come back), or look for the item at fault (it will fail again for ever).
"""

from __future__ import annotations

import asyncpg

# What a database call raises when the server is down, restarting, read-only or slow: callers
# answer 451, retry or wait, never crash. InternalClientError too: asyncpg raises it ("cannot switch
# to state ...") when the server cuts a session in the middle of an operation, as a restart does.
DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)

# SQLSTATE classes of a server that is away, restarting, overloaded, failing over, or that will not
# let us in (a password rotated, the database renamed): the same call may succeed later, and
# fails now for everyone's values alike.
_OUTAGE_CLASSES = frozenset({"08", "28", "3D", "40", "53", "55", "57", "58", "XX", "HV"})
_READ_ONLY = "25006"  # read_only_sql_transaction: a primary that became a standby


def is_outage(exc: BaseException) -> bool:
    """Whether a database call failed because the database cannot serve it now (down,
    restarting, read-only, refusing our connections): what every call would meet."""
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        return state == _READ_ONLY or state[:2] in _OUTAGE_CLASSES
    return isinstance(exc, DB_ERRORS)


def is_bad_input(exc: BaseException) -> bool:
    """Whether a database call failed on the values it was given (SQLSTATE class 22, asyncpg's
    DataError for a value it could not even send, class 54 for a row its index cannot hold): the
    caller's input, never an outage."""
    return isinstance(exc, asyncpg.DataError | asyncpg.ProgramLimitExceededError)


def is_about_the_values(exc: BaseException) -> bool:
    """Whether work that raised `exc` failed for something in it, so that the same work fails
    again for ever while the rest of a batch would go through: an error of ours in Python (a
    reply no DSN could carry) or a value or row the database refuses (class 22, 23, 54). Every
    other database error (an outage, a privilege revoked, a function missing during an upgrade)
    fails every item alike: the work is kept and tried again, never split and dropped."""
    if not isinstance(exc, DB_ERRORS):
        return True
    return is_bad_input(exc) or isinstance(exc, asyncpg.IntegrityConstraintViolationError)
