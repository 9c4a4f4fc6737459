"""Every member of aiosmtpd, aiosmtplib, aiohttp, asyncio and the email package that pigeon-mta uses without it being their
documented API: each must still exist, as the same kind of thing, with the same parameters.

pyproject.toml pins both SMTP libraries below their next minor version; this test is what to run
when that pin is raised. A failure names the member and the module of ours that relies on it.
(`grep -rn "\\._[a-z]" pigeon_mta/` finds the private names; the table below also holds the public
but undocumented ones the outbound transport takeover relies on.)
"""

from __future__ import annotations

import asyncio
import email.policy
import inspect
import re
from dataclasses import dataclass
from typing import Literal

import aiosmtplib
import aiosmtplib.protocol
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiosmtpd.smtp import SMTP, Session

Kind = Literal["method", "coroutine method", "property", "attribute"]


@dataclass(frozen=True)
class Seam:
    owner: type
    name: str
    kind: Kind
    used_by: str  # where and why we use it
    parameters: tuple[str, ...] | None = None  # a method's parameters, self included


SEAMS = [
    # aiosmtpd's server protocol, subclassed by submission/protocol.py
    Seam(SMTP, "_call_handler_hook", "coroutine method", "protocol.smtp_DATA runs the DATA hook",
         ("self", "command", "args")),
    Seam(SMTP, "_set_post_data_state", "method", "protocol.smtp_DATA ends the transaction",
         ("self",)),
    Seam(SMTP, "_set_rset_state", "method", "protocol: HELO/EHLO and a failed hook reset it",
         ("self",)),
    Seam(SMTP, "_reset_timeout", "method", "protocol: data_timeout for DATA, timer restarts",
         ("self", "duration")),
    Seam(SMTP, "_timeout_cb", "method", "protocol overrides it: a 421 and a count first",
         ("self",)),
    Seam(SMTP, "_create_session", "method", "protocol overrides it (_QuietSession)", ("self",)),
    Seam(SMTP, "_create_envelope", "method", "protocol overrides it (TransactionEnvelope)",
         ("self",)),
    Seam(SMTP, "_getaddr", "method", "protocol overrides it with addresses.split_path",
         ("self", "arg")),
    Seam(SMTP, "_reader", "attribute", "protocol.smtp_DATA reads the message itself"),
    Seam(SMTP, "_tls_protocol", "attribute", "protocol: STARTTLS once; EHLO lists STARTTLS"),
    Seam(SMTP, "_auth_require_tls", "attribute", "protocol._ehlo: whether to list AUTH"),
    Seam(SMTP, "_auth_methods", "attribute", "protocol._ehlo: the AUTH mechanisms listed"),
    Seam(Session, "_login_data", "attribute", "protocol._QuietSession stores login_data there"),
    Seam(Session, "login_data", "property", "protocol._QuietSession overrides it"),
    # asyncio's stream reader under aiosmtpd: its line limit, raised while DATA is read
    Seam(asyncio.StreamReader, "_limit", "attribute", "protocol.smtp_DATA (DATA_READ_LIMIT)"),
    # aiosmtplib's client: outbound/connect.py hands its transport to outbound/wire.py
    Seam(aiosmtplib.SMTP, "protocol", "attribute", "connect.SmtpConnection.take_over"),
    Seam(aiosmtplib.protocol.SMTPProtocol, "transport", "attribute", "connect.take_over"),
    Seam(aiosmtplib.protocol.SMTPProtocol, "connection_lost", "method",
         "wire.Wire.connection_lost tells aiosmtplib the connection ended", ("self", "exc")),
    # aiohttp's server: web.py answers what its HTTP parser refuses with the API's problem+json
    Seam(web.AppRunner, "_make_server", "coroutine method", "web._Runner swaps in web._Server",
         ("self",)),
    Seam(web.Server, "_loop", "attribute", "web._Server makes its handlers as aiohttp does"),
    Seam(web.Server, "_kwargs", "attribute", "web._Server makes its handlers as aiohttp does"),
    Seam(RequestHandler, "_manager", "attribute", "web._Handler finds its server's answer"),
    Seam(RequestHandler, "handle_error", "method", "web._Handler.handle_error overrides it",
         ("self", "request", "status", "exc", "message")),
    # the standard library's compat32 policy: api/mime.py writes short fields without a Header
    Seam(email.policy.Compat32, "_fold", "method", "mime._Write._fold skips the Header",
         ("self", "name", "value", "sanitize")),
]  # fmt: skip


def kind_of(owner: type, name: str) -> Kind | None:
    """What `name` is on `owner`: looked up on the class, else an attribute its own code sets."""
    static = inspect.getattr_static(owner, name, None)
    if isinstance(static, property):
        return "property"
    if inspect.iscoroutinefunction(static):
        return "coroutine method"
    if inspect.isfunction(static):
        return "method"
    if static is not None:
        return "attribute"
    source = "".join(inspect.getsource(cls) for cls in owner.__mro__ if _has_source(cls))
    if re.search(rf"\bself\.{re.escape(name)}\s*[:=]", source):
        return "attribute"
    return None


def _has_source(cls: type) -> bool:
    try:
        inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return cls is not object


@pytest.mark.parametrize("seam", SEAMS, ids=lambda s: f"{s.owner.__name__}.{s.name}")
def test_each_library_member_we_rely_on_is_still_there_as_the_same_kind(seam: Seam) -> None:
    found = kind_of(seam.owner, seam.name)
    assert found == seam.kind, (
        f"{seam.owner.__module__}.{seam.owner.__name__}.{seam.name} is {found or 'gone'}, "
        f"not a {seam.kind}; used by {seam.used_by}"
    )
    if seam.parameters is not None:
        function = inspect.getattr_static(seam.owner, seam.name)
        assert tuple(inspect.signature(function).parameters) == seam.parameters, seam.used_by


def test_aiosmtpd_finds_commands_and_auth_mechanisms_through_dir() -> None:
    # protocol.SMTPSession.__dir__ lists only smtp_* and auth_* names, to make aiosmtpd's
    # per-connection inspect.getmembers cheap; that is safe only while those are all it looks for.
    source = inspect.getsource(SMTP.__init__)
    looked_up = set(re.findall(r'startswith\("(\w+)"\)', source))
    assert looked_up <= {"smtp_", "auth_", "handle_"}, looked_up
    assert "getmembers(obj)" in source


async def test_the_stream_reader_keeps_its_limit_in_limit() -> None:
    assert asyncio.StreamReader(limit=1234)._limit == 1234


def test_a_client_has_no_protocol_until_it_connects() -> None:
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=25)
    assert client.protocol is None


@pytest.mark.parametrize(
    "name",
    ["_counted", "_refused", "_in_junk_command", "_admit", "_greet", "_ehlo", "_helo", "_junk"],
)
def test_the_names_our_smtp_subclass_adds_are_not_aiosmtpds(name: str) -> None:
    # protocol.SMTPSession keeps state and helpers of its own under these names: a release of
    # aiosmtpd that used one of them would have both read the other's value.
    assert kind_of(SMTP, name) is None
