"""Database connection strings fit for logs and error messages: every password replaced by ***.

A PostgreSQL URL can carry its password in the user info (`postgresql://user:secret@host/db`, one
user info for all hosts of a multi-host URL) or as a query parameter (`?password=secret`,
`&sslpassword=secret` for the client key), and a key/value string as `password=secret`. Every
place that prints a connection string or an error that may quote one passes it through `redact`.
"""

from __future__ import annotations

import re

_URL = re.compile(r"postgres(?:ql)?://[^\s'\"<>]+", re.IGNORECASE)
# A password parameter in a URL's query or a key/value string; its value runs to the next & or
# space, or is a quoted string (libpq's key/value syntax: single quotes, backslash escapes).
_PASSWORD_PARAM = re.compile(
    r"(?<![A-Za-z0-9_])((?:ssl)?password)(\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&]*)", re.IGNORECASE
)

MASK = "***"


def redact(text: str) -> str:
    """`text` with the password of every connection string in it replaced by ***."""
    text = _URL.sub(lambda m: _redact_user_info(m.group()), text)
    return _PASSWORD_PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def _redact_user_info(url: str) -> str:
    scheme, rest = url.split("://", 1)
    # The user info ends at the last @ before the query: a password with a raw @ in it is still
    # hidden whole. (A raw ? in a password is not a valid URL; drivers do not read it either.)
    query = rest.find("?")
    at = rest.rfind("@", 0, query if query >= 0 else len(rest))
    if at < 0:
        return url
    user, colon, _password = rest[:at].partition(":")
    return f"{scheme}://{user}{':' + MASK if colon else ''}{rest[at:]}"
