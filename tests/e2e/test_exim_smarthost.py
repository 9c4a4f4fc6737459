"""A real Exim (Debian's exim4, configured as README's smarthost section says) relays through the
real `pigeon-mta serve`: AUTH PLAIN over STARTTLS, MAIL's AUTH= parameter, and the local senders
(root, Exim's own bounces) rewritten to the org's domain so that the `strict` sender policy passes.

exim -odi (private instance) ──STARTTLS+AUTH──► pigeon submission 127.0.0.1:port
                                                   │ PostgreSQL queue
                  aiosmtpd sink 127.0.0.2:port ◄───┘ ([delivery] relayhost)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from tests.e2e.relay_serve import relay_serve
from tests.integration.submission_helpers import make_tls
from tests.peers.exim import HOSTNAME, EximClient, start_exim

PASSWORD = "exim relay password"
REFUSED = "x" * 130 + "@example.net"

# update-exim4.conf.conf: Debian's defaults, with the two settings README names.
DEBIAN_SETTINGS = {
    "dc_eximconfig_configtype": "smarthost",
    "dc_other_hostnames": "",
    # Debian's default is '127.0.0.1 ; ::1'. Exim freezes mail whose smarthost is one of its own
    # interfaces ("remote host address is the local host"); the smarthost of this test is pigeon
    # on this host's 127.0.0.1, so Exim is told it listens elsewhere (it listens nowhere here).
    "dc_local_interfaces": "127.0.0.3",
    "dc_readhost": "",
    "dc_relay_domains": "",
    "dc_minimaldns": "false",
    "dc_relay_nets": "",
    "CFILEMODE": "644",
    "dc_use_split_config": "false",
    "dc_hide_mailname": "",
    "dc_mailname_in_oh": "true",
    "dc_localdelivery": "mail_spool",
}


async def test_exim_relays_through_pigeon_with_auth_and_rewritten_local_senders(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    exim: EximClient | None = None
    async with relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-exim",
        user=("app", PASSWORD),
        tls=tls,
        tables={"relay": {"sender_policy": "strict"}},
    ) as relay:
        state, serve, submission_port = relay.sink, relay.serve, relay.submission_port
        try:
            exim = await asyncio.to_thread(
                start_exim,
                update_exim4_conf={
                    **DEBIAN_SETTINGS,
                    "dc_smarthost": f"127.0.0.1::{submission_port}",
                },
                # README: /etc/exim4/passwd.client, /etc/email-addresses, exim4.conf.localmacros.
                passwd_client=f"127.0.0.1:app:{PASSWORD}\n",
                email_addresses="root: ops@acme.example\nMailer-Daemon: mailer-daemon@acme.example\n",
                localmacros=(
                    "REMOTE_SMTP_SMARTHOST_HOSTS_REQUIRE_TLS = *\n"
                    "REMOTE_SMTP_SMARTHOST_TLS_VERIFY_HOSTS = *\n"
                ),
                ca_pem=tls.ca.cert_pem.bytes(),
            )
            # A cron job's mail: from root, to a good recipient and to one pigeon refuses (a local
            # part over its 128 octets), so that Exim makes a bounce of its own and relays it too.
            message = (
                f"From: root@{HOSTNAME} (Cron Daemon)\n"
                "To: bob@example.net\n"
                "Subject: cron output\n"
                "\n"
                "Relayed by Exim, queued by pigeon.\n"
            ).encode()
            await asyncio.to_thread(
                exim.submit,
                "root",
                ["bob@example.net", REFUSED],
                message,
                authenticated_sender=f"root@{HOSTNAME}",
            )
            try:
                await state.wait_for(
                    lambda: (
                        state.deliveries()["bob@example.net"] == 1
                        and state.deliveries()["ops@acme.example"] == 1
                    ),
                    90,
                )
            except AssertionError:
                raise AssertionError(
                    f"not delivered.\nexim:\n{exim.log()}\nserve:\n{serve.output}"
                ) from None
            # Nothing left: no frozen bounce, no deferred message.
            await asyncio.to_thread(exim.queue_run)
            exim_queue = await asyncio.to_thread(exim.queue)
            exim_log = exim.log()
        finally:
            if exim is not None:
                exim.close()
    assert relay.exit_code == 0, serve.output
    assert exim_queue == "", exim_queue + exim_log
    assert "frozen" not in exim_log, exim_log

    # Exim verified pigeon's certificate, authenticated, and pigeon took its AUTH= parameter.
    delivered = [line for line in exim_log.splitlines() if " => " in line]
    assert len(delivered) == 2, exim_log
    for line in delivered:
        assert "H=127.0.0.1 [127.0.0.1] X=TLS" in line and " CV=yes " in line, line
        assert " A=plain " in line and ' C="250 2.0.0 Ok: queued as ' in line, line
    queued = [line for line in serve.output.splitlines() if " queued " in line]
    # Exim sent MAIL FROM:<ops@acme.example> ... AUTH=root@client.test (its bounce has none).
    assert len(queued) == 2, serve.output
    assert queued[0].endswith(f" auth=<root@{HOSTNAME}>"), serve.output

    [cron] = state.received_by("bob@example.net")
    assert cron.mail_from == "ops@acme.example"
    assert b"From: ops@acme.example" in cron.data
    assert b"Relayed by Exim, queued by pigeon." in cron.data
    assert b"with ESMTPSA id" in cron.data and b"smtp.auth=app" in cron.data

    [bounce] = state.received_by("ops@acme.example")
    assert bounce.mail_from == "<>"  # the null sender
    assert b"mailer-daemon@acme.example" in bounce.data
    assert REFUSED.encode() in bounce.data
    rows = await pool.fetch("SELECT sender, auth_user FROM message ORDER BY received_at")
    assert [(r["sender"], r["auth_user"]) for r in rows] == [
        ("ops@acme.example", "app"),
        ("", "app"),
    ]
