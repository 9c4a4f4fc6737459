"""The SASL exchanges of SMTP AUTH (RFC 4954): the throttle check before one starts, the PLAIN
(RFC 4616) and LOGIN mechanisms, and the AUTH log lines and failure counter.

Whether a login is right, and whether a client has failed too often, is decided by
`auth.Authenticator`; this module only reads the client's answers off the connection and turns
the verdict into aiosmtpd's `AuthResult`, whose message is a reply constant from `replies`.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from aiosmtpd.smtp import MISSING, AuthResult

from pigeon_mta.metrics import AUTH_FAILURES
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.submission import replies
from pigeon_mta.submission.auth import Verdict
from pigeon_mta.submission.context import ListenerContext, conversation

log = logging.getLogger("pigeon_mta.submission")


class SaslExchange:
    """One per listener. `server` is the connection (a `protocol.SMTPSession`)."""

    def __init__(self, ctx: ListenerContext) -> None:
        self.ctx = ctx

    async def refusal_to_start(self, server: Any) -> str | None:
        """The reply that refuses AUTH before the client sends any credentials, or None."""
        conv = conversation(server)
        try:
            throttled = await self.ctx.authenticator.is_throttled(conv.client_ip)
        except DB_ERRORS as exc:
            log.warning("AUTH from [%s]: cannot check throttling: %s", conv.client_ip, exc)
            return replies.AUTH_UNAVAILABLE
        if throttled:
            log.warning("AUTH from [%s] refused: too many recent failures", conv.client_ip)
            return replies.AUTH_THROTTLED
        return None

    async def plain(self, server: Any, args: list[str]) -> AuthResult:
        """RFC 4616: [authzid] NUL authcid NUL passwd, as initial response or after a 334."""
        blob = await self._response(server, args[1] if len(args) > 1 else None, "")
        if blob is None:
            return AuthResult(success=False)
        parts = blob.split(b"\0")
        if len(parts) != 3:
            return await self._refuse(server, None, "malformed PLAIN response")
        authzid, login, password = parts
        if authzid and authzid != login:
            return await self._refuse(
                server, _text(login), "authzid differs", replies.AUTH_BAD_AUTHZID
            )
        return await self._check(server, login, password)

    async def login(self, server: Any, args: list[str]) -> AuthResult:
        """LOGIN: the username and the password, each after its own 334 challenge."""
        login = await self._response(server, args[1] if len(args) > 1 else None, "Username:")
        if login is None:
            return AuthResult(success=False)
        password = await self._response(server, None, "Password:")
        if password is None:
            return AuthResult(success=False)
        return await self._check(server, login, password)

    async def _response(self, server: Any, initial: str | None, challenge: str) -> bytes | None:
        """The client's decoded answer; None when the exchange ended (a reply was already sent)."""
        if initial is not None:
            if initial == "=":
                return b""  # RFC 4954 4: "=" is an empty initial response
            try:
                return base64.b64decode(initial, validate=True)
            except ValueError:
                await server.push(replies.AUTH_BAD_BASE64)
                return None
        try:
            answer = await server.challenge_auth(challenge)
        except ValueError:  # the line was longer than the stream limit
            await server.push(replies.AUTH_LINE_TOO_LONG)
            return None
        return None if answer is MISSING else bytes(answer)

    async def _check(self, server: Any, login_bytes: bytes, password_bytes: bytes) -> AuthResult:
        conv = conversation(server)
        try:
            username = login_bytes.decode("utf-8")
            password = password_bytes.decode("utf-8")
        except UnicodeDecodeError:
            return await self._refuse(server, _text(login_bytes), "credentials are not UTF-8")
        if not username:
            return await self._refuse(server, None, "empty username")
        try:
            checked = await self.ctx.authenticator.check(
                username, password, client_ip=conv.client_ip
            )
        except DB_ERRORS as exc:
            log.warning("AUTH from [%s]: cannot check credentials: %s", conv.client_ip, exc)
            return AuthResult(success=False, handled=False, message=replies.AUTH_UNAVAILABLE)
        if checked.verdict is Verdict.THROTTLED:
            log.warning("AUTH from [%s] refused: too many recent failures", conv.client_ip)
            return AuthResult(success=False, handled=False, message=replies.AUTH_THROTTLED)
        if checked.verdict is not Verdict.OK or checked.login is None:
            return await self._refuse(server, username, checked.reason)
        conv.login = checked.login
        log.info(
            "AUTH ok: user=%s client=[%s] listener=%s",
            checked.login.username,
            conv.client_ip,
            self.ctx.name,
        )
        return AuthResult(success=True, auth_data=checked.login, message=replies.AUTH_OK)

    async def _refuse(
        self, server: Any, username: str | None, why: str, reply: str = replies.AUTH_INVALID
    ) -> AuthResult:
        conv = conversation(server)
        AUTH_FAILURES.labels(listener=self.ctx.name).inc()
        log.warning(
            "AUTH failed: user=%s client=[%s] listener=%s: %s",
            username if username is not None else "-",
            conv.client_ip,
            self.ctx.name,
            why,
        )
        try:
            over_limit = await self.ctx.authenticator.record_failure(
                client_ip=conv.client_ip, username=username, listener=self.ctx.name
            )
        except DB_ERRORS as exc:
            log.warning("cannot record the AUTH failure of [%s]: %s", conv.client_ip, exc)
            over_limit = False
        if over_limit:
            # Failures of parallel attempts reached the limit before this one was counted.
            return AuthResult(success=False, handled=False, message=replies.AUTH_THROTTLED)
        return AuthResult(success=False, handled=False, message=reply)


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")
