"""A real Postfix uses the real `pigeon-mta serve` as its smarthost: SASL AUTH over STARTTLS.

sendmail -C DIR ──► Postfix (private instance) ──STARTTLS+AUTH──► pigeon submission 127.0.0.1:port
                                                                     │ PostgreSQL queue
                               aiosmtpd sink 127.0.0.2:port ◄──SMTP──┘ ([delivery] relayhost)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from tests.e2e.relay_serve import relay_serve
from tests.integration.submission_helpers import make_tls
from tests.peers.postfix import PostfixClient, start_postfix

PASSWORD = "postfix relay password"


async def test_postfix_relays_through_pigeon_with_sasl_auth_over_starttls(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    postfix: PostfixClient | None = None
    async with relay_serve(
        tmp_path, db_url, node_name="e2e-postfix", user=("app", PASSWORD), tls=tls
    ) as relay:
        state, serve, submission_port = relay.sink, relay.serve, relay.submission_port
        try:
            relayhost = f"[127.0.0.1]:{submission_port}"
            # The password map: texthash needs no postmap run. Postfix reads it (and the CA file)
            # before it drops privileges, so root-only files are fine.
            passwords = tmp_path / "sasl_passwd"
            passwords.write_text(f"{relayhost} app:{PASSWORD}\n")
            passwords.chmod(0o600)
            ca_file = tmp_path / "ca.pem"
            tls.ca.cert_pem.write_to_path(str(ca_file))
            postfix = await asyncio.to_thread(
                start_postfix,
                {
                    "relayhost": relayhost,
                    "smtp_sasl_auth_enable": "yes",
                    "smtp_sasl_password_maps": f"texthash:{passwords}",
                    # The default also forbids plaintext mechanisms; over TLS PLAIN/LOGIN are fine.
                    "smtp_sasl_security_options": "noanonymous",
                    "smtp_sasl_tls_security_options": "noanonymous",
                    "smtp_tls_security_level": "encrypt",
                    "smtp_tls_CAfile": str(ca_file),
                    "smtp_tls_loglevel": "1",
                },
            )
            message = (
                b"From: App <app@acme.example>\n"
                b"To: Bob <bob@example.net>\n"
                b"Subject: through postfix\n"
                b"\n"
                b"Relayed by Postfix, queued by pigeon.\n"
            )
            await asyncio.to_thread(
                postfix.sendmail, "app@acme.example", ["bob@example.net"], message
            )
            try:
                await state.wait_for(lambda: state.deliveries()["bob@example.net"] == 1, 90)
            except AssertionError:
                raise AssertionError(
                    f"not delivered.\npostfix log:\n{postfix.log()}\nserve:\n{serve.output}"
                ) from None
            postfix_log = postfix.log()
        finally:
            if postfix is not None:
                await asyncio.to_thread(postfix.stop)
    assert relay.exit_code == 0, serve.output

    # Postfix verified pigeon's certificate against the test CA and handed the message over.
    assert "Trusted TLS connection established to 127.0.0.1" in postfix_log, postfix_log
    assert f"relay=127.0.0.1[127.0.0.1]:{submission_port}" in postfix_log, postfix_log
    assert "status=sent (250 2.0.0 Ok: queued as" in postfix_log, postfix_log

    [received] = state.received_by("bob@example.net")
    assert received.mail_from == "app@acme.example"
    assert b"Relayed by Postfix, queued by pigeon." in received.data
    # pigeon's trace header: TLS (the S) and AUTH (the A), and the AUTH result with the user.
    assert b"with ESMTPSA id" in received.data
    assert b"smtp.auth=app" in received.data
    row = await pool.fetchrow("SELECT listener, auth_user, client_ip::text AS ip FROM message")
    assert row is not None
    assert (row["listener"], row["auth_user"]) == ("submission", "app")
    assert row["ip"].startswith("127.0.0.1")
    status = await pool.fetchval("SELECT status FROM recipient WHERE address = 'bob@example.net'")
    assert status == "delivered"
