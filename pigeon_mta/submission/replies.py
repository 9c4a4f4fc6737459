"""Every SMTP reply the submission side sends, as named constants, with enhanced status codes.

We advertise ENHANCEDSTATUSCODES, and RFC 2034 then asks for an enhanced code on every reply but
the greeting and the HELO/EHLO replies; aiosmtpd's own replies lack them, so `with_enhanced_code`
adds them on the way out.
"""

from __future__ import annotations

import re

from pigeon_mta.header_bounds import FieldProblem

QUEUED = "250 2.0.0 Ok: queued as {queue_id}"
SENDER_OK = "250 2.1.0 Ok"
RECIPIENT_OK = "250 2.1.5 Ok"
AUTH_OK = "235 2.7.0 Authentication successful"

AUTH_INVALID = "535 5.7.8 Authentication credentials invalid"
AUTH_THROTTLED = "454 4.7.0 Too many failed authentication attempts, try again later"
AUTH_UNAVAILABLE = "454 4.7.0 Temporary authentication failure, try again later"
AUTH_REQUIRED = "530 5.7.0 Authentication required"
AUTH_BAD_AUTHZID = "535 5.7.8 Authorization identity must be empty or equal to the login"
ALREADY_AUTHENTICATED = "503 5.5.1 Already authenticated"

RELAY_DENIED = "554 5.7.1 Relay access denied"
SENDER_NOT_OWNED = "553 5.7.1 Sender address rejected: not owned by the authenticated user"
# The originator fields (RFC 5322 3.6.2, 3.6.6) by their lower-case names: the sender policy
# checks each of them, and every client's From: is measured (header_bounds.py).
_ORIGINATORS = {
    "from": "From",
    "sender": "Sender",
    "resent-from": "Resent-From",
    "resent-sender": "Resent-Sender",
}
FIELD_NOT_OWNED = {
    name: f"553 5.7.1 {title}: header address rejected: not owned by the authenticated user"
    for name, title in _ORIGINATORS.items()
}
FIELD_UNREADABLE = {
    (name, problem): f"550 5.6.0 {title}: header {problem.value}"
    for name, title in _ORIGINATORS.items()
    for problem in FieldProblem
}
NO_FROM = "550 5.7.1 Message has no From: header address (RFC 5322 3.6.2)"
BAD_SENDER = "553 5.1.7 Bad sender address syntax"
BAD_RECIPIENT = "553 5.1.3 Bad recipient address syntax"
LITERAL_RECIPIENT = "553 5.1.3 Address literals are not accepted, use a domain name"
NEEDS_SMTPUTF8 = "553 5.6.7 Non-ASCII address requires the SMTPUTF8 parameter"
TOO_MANY_RECIPIENTS = "452 4.5.3 Too many recipients"
MESSAGE_TOO_BIG = "552 5.3.4 Message size exceeds fixed maximum message size"
HEADER_TOO_BIG = "552 5.3.4 Message header exceeds fixed maximum header size"
LINE_TOO_LONG = "500 5.5.2 Line too long (RFC 5321 4.5.3.1.6)"
RATE_LIMITED = "450 4.7.1 Message rate limit exceeded for this user, try again later"
TOO_MANY_HOPS = "554 5.4.6 Too many hops"  # RFC 3463 X.4.6: routing loop detected
# The X-Pigeon-Lane field names a lane the server does not have (intake/lanes.py): refused, so
# that a typo never moves mail into another lane. {lane} is the name as written, made printable.
UNKNOWN_LANE = "550 5.7.0 X-Pigeon-Lane: no such lane: {lane}"
LANES_DIFFER = "550 5.7.0 X-Pigeon-Lane fields name different lanes: {lanes}"
# An X-Pigeon-* field of the send intent that is unknown or has a bad value (intake/intent.py).
BAD_INTENT = "550 5.6.0 {field}: {problem}"

DATABASE_TROUBLE = "451 4.3.0 Temporary failure queueing the message, try again later"
LOCAL_ERROR = "451 4.3.0 Local error in processing, try again later"

# Protocol: commands out of sequence or malformed.
AUTH_IN_TRANSACTION = "503 5.5.1 AUTH is not permitted during a mail transaction"  # RFC 4954 4
AUTH_BAD_BASE64 = "501 5.5.2 Cannot decode base64"
AUTH_LINE_TOO_LONG = "500 5.5.6 Authentication exchange line is too long"
TLS_FAILED = "454 4.7.0 TLS not available due to temporary reason"
TLS_ALREADY_ACTIVE = "503 5.5.1 TLS already active"
NEED_RCPT = "503 5.5.1 Error: need RCPT command"
DATA_SYNTAX = "501 5.5.4 Syntax: DATA"
BAD_AUTH_PARAM = "501 5.5.4 Malformed AUTH= parameter (RFC 4954 section 5)"
EHLO_SYNTAX = "501 5.5.4 Syntax: EHLO hostname"
HELO_SYNTAX = "501 5.5.4 Syntax: HELO hostname"
START_DATA = "354 End data with <CR><LF>.<CR><LF>"

# Sent just before the server closes the connection.
TOO_MANY_CONNECTIONS = "421 4.7.0 {hostname} Too many connections from your address"
TIMEOUT = "421 4.4.2 {hostname} Error: timeout exceeded"
SHUTTING_DOWN = "421 4.3.2 {hostname} Service shutting down, try again later"
TOO_MANY_JUNK_COMMANDS = "421 4.7.0 {hostname} Too many junk commands"

# aiosmtpd's replies that say something we want said differently.
_STOCK = {
    "250 OK": "250 2.0.0 Ok",
    "221 Bye": "221 2.0.0 Bye",
    "220 Ready to start TLS": "220 2.0.0 Ready to start TLS",
    "552 Error: message size exceeds fixed maximum message size": MESSAGE_TOO_BIG,
    "552 Error: Too much mail data": MESSAGE_TOO_BIG,
    "500 Line too long (see RFC5321 4.5.3.1.6)": LINE_TOO_LONG,
    "530 Must issue a STARTTLS command first": "530 5.7.0 Must issue a STARTTLS command first",
    "503 Already authenticated": ALREADY_AUTHENTICATED,
}
# The enhanced code for a reply code when aiosmtpd gave none (RFC 3463 classes).
_DEFAULT_DETAIL = {
    "221": "2.0.0",
    "250": "2.0.0",
    "252": "2.5.0",
    "454": "4.7.0",
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "538": "5.7.11",
    "552": "5.3.4",
    "553": "5.1.3",
    "554": "5.7.0",
    "555": "5.5.4",
}
_HAS_DETAIL = re.compile(r"[0-9]{3}[ -][245]\.[0-9]{1,3}\.[0-9]{1,3}(?: |$)", re.ASCII)


def with_enhanced_code(reply: str) -> str:
    stock = _STOCK.get(reply)
    if stock is not None:
        return stock
    if len(reply) < 4 or reply[3] not in " -" or _HAS_DETAIL.match(reply):
        return reply
    detail = _DEFAULT_DETAIL.get(reply[:3])
    if detail is None:
        return reply
    return f"{reply[:4]}{detail} {reply[4:]}"


# Label values of pigeon_smtp_rejections_total{reason} (a fixed set: labels never carry input).
_REASONS = {
    replies_key: reason
    for reason, keys in {
        "auth_required": (AUTH_REQUIRED, "530 5.7.0 Must issue a STARTTLS command first"),
        "auth_failed": (AUTH_INVALID, AUTH_BAD_AUTHZID),
        "auth_throttled": (AUTH_THROTTLED,),
        "relay_denied": (RELAY_DENIED,),
        "sender_policy": (SENDER_NOT_OWNED, NO_FROM, *FIELD_NOT_OWNED.values()),
        "bad_header": tuple(FIELD_UNREADABLE.values()),
        "bad_address": (BAD_SENDER, BAD_RECIPIENT, LITERAL_RECIPIENT, NEEDS_SMTPUTF8),
        "too_many_recipients": (TOO_MANY_RECIPIENTS,),
        "size": (MESSAGE_TOO_BIG, HEADER_TOO_BIG),
        "rate_limit": (RATE_LIMITED,),
        "too_many_hops": (TOO_MANY_HOPS,),
        "database": (DATABASE_TROUBLE, AUTH_UNAVAILABLE),
        "local_error": (LOCAL_ERROR,),
    }.items()
    for replies_key in keys
}


# Replies that carry the client's text, known by their start.
_REASON_PREFIXES = (
    (UNKNOWN_LANE.partition("{")[0], "bad_lane"),
    (LANES_DIFFER.partition("{")[0], "bad_lane"),
)


def rejection_reason(reply: str) -> str:
    """The metric label for a 4xx/5xx reply; "protocol" for syntax and sequence errors."""
    reason = _REASONS.get(reply)
    if reason is not None:
        return reason
    for prefix, reason in _REASON_PREFIXES:
        if reply.startswith(prefix):
            return reason
    return "protocol"


# Refusals that count as junk commands (limits.max_junk_commands): those of how the client speaks
# (syntax, sequence, unknown commands) or who it is (AUTH, relaying). Refusals of what it sends
# (an address, a size, a rate, a loop) and local trouble do not count: a legitimate bulk sender
# meets those, and other limits bound them.
JUNK_REASONS = frozenset(
    {"protocol", "auth_required", "auth_failed", "auth_throttled", "relay_denied"}
)
