"""An async bounce from a real Postfix: the destination's MX accepts every recipient, delivers the
one it knows and bounces the other minutes later with a DSN of its own, which comes back to
pigeon's feedback listener at the VERP address the message left with.

smtplib ─► pigeon relay 127.0.0.1 ─MAIL FROM:<b-TOKEN@bounces.acme.example>─► Postfix MX (dest.test)
                                                                               │ error: User unknown
           pigeon feedback 127.0.0.1 ◄──────────── DSN to b-TOKEN@... ◄────────┘ (relayhost)
"""

from __future__ import annotations

import asyncio
import re
import smtplib
from pathlib import Path

import asyncpg

from tests.conftest import free_port
from tests.e2e.relay_serve import pigeon_with, relay_serve
from tests.e2e.shared import pigeon_json
from tests.integration.outbound_helpers import wait_until
from tests.peers.postfix import PostfixClient, start_postfix_mx

RETURN_PATH = "bounces.acme.example"


def send(port: int, *recipients: str, subject: str) -> None:
    """A message through the relay listener (127.0.0.1 is a trusted network, of org acme)."""
    message = (
        f"From: App <app@acme.example>\r\nTo: {', '.join(recipients)}\r\n"
        f"Subject: {subject}\r\nMessage-ID: <{subject.replace(' ', '-')}@acme.example>\r\n\r\n"
        "Thank you for your order.\r\n"
    )
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.sendmail("app@acme.example", list(recipients), message)


async def statuses(pool: asyncpg.Pool) -> dict[str, str]:
    rows = await pool.fetch(
        "SELECT r.address, r.status, m.header_message_id FROM recipient r"
        " JOIN message m ON m.id = r.message_id ORDER BY m.received_at, r.address"
    )
    return {f"{r['header_message_id']} {r['address']}": r["status"] for r in rows}


async def test_a_postfix_mx_bounces_later_and_pigeon_suppresses_the_address(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    relay_port, feedback_port, mx_port = free_port(), free_port(), free_port()
    postfix: PostfixClient = await asyncio.to_thread(
        start_postfix_mx,
        f"127.0.0.1:{mx_port}",
        domain="dest.test",
        known=["ann@dest.test"],
        bounces_to=f"[127.0.0.1]:{feedback_port}",
    )
    try:
        async with relay_serve(
            tmp_path,
            db_url,
            node_name="e2e-feedback",
            submission=False,
            listeners=[
                {"name": "relay", "address": f"127.0.0.1:{relay_port}", "mode": "relay"},
                {"name": "feedback", "address": f"127.0.0.1:{feedback_port}", "mode": "feedback"},
            ],
            tables={
                "relay": {"trusted_org": "acme"},
                "bounces": {"return_path_domain": RETURN_PATH},
                "delivery": {"poll_interval": "250ms"},
                "delivery.routes": {"dest.test": f"127.0.0.1:{mx_port}"},
            },
        ) as relay:
            await asyncio.to_thread(
                send, relay_port, "ann@dest.test", "gone@dest.test", subject="order 1"
            )

            async def bounced() -> bool:
                return (await statuses(pool)).get("order-1@acme.example gone@dest.test") == (
                    "bounced"
                )

            try:
                await wait_until(bounced, 90, "the async bounce applied")
            except AssertionError:
                raise AssertionError(
                    f"{await statuses(pool)}\npostfix:\n{postfix.log()}\nserve:\n"
                    f"{relay.serve.output}"
                ) from None
            # The next message to the address is not attempted: suppressed at its claim.
            await asyncio.to_thread(send, relay_port, "gone@dest.test", subject="order 2")

            async def suppressed() -> bool:
                state = await statuses(pool)
                return state.get("order-2@acme.example gone@dest.test") == "suppressed"

            await wait_until(suppressed, 30, "the next message suppressed")
            postfix_log = postfix.log()
            queue_id = await pool.fetchval(
                "SELECT id FROM message WHERE header_message_id = 'order-1@acme.example'"
            )
            story = await pigeon_with(relay.config, "log", str(queue_id))
            feedback = pigeon_json(db_url, "feedback", "list")
    finally:
        await asyncio.to_thread(postfix.stop)
    assert relay.exit_code == 0, relay.serve.output

    state = await statuses(pool)
    assert state == {
        "order-1@acme.example ann@dest.test": "delivered",
        "order-1@acme.example gone@dest.test": "bounced",
        "order-2@acme.example gone@dest.test": "suppressed",
    }
    # Postfix took both recipients of the first message, each in a transaction of its own from
    # its own VERP address, and sent its DSN to the one that bounced.
    senders = re.findall(r"from=<(b-[a-z2-7]{40}@bounces\.acme\.example)>", postfix_log)
    assert len(set(senders)) == 2, postfix_log
    assert re.search(r"to=<gone@dest\.test>.*status=bounced \(unknown user", postfix_log), (
        postfix_log
    )
    assert re.search(r"to=<b-[a-z2-7]{40}@bounces\.acme\.example>.*status=sent", postfix_log)
    # The story: delivered, then bounced later, by the feedback the DSN was kept as.
    [kept] = feedback
    assert (kept["status"], kept["kind"]) == ("applied", "bounce")
    assert "Bounce (async)" in story and "5.1.1" in story, story
    assert kept["id"] in story, story
    entry = await pool.fetchrow(
        "SELECT source, feedback_event_id FROM suppression WHERE address = 'gone@dest.test'"
    )
    assert entry is not None and entry["source"] == "bounce" and entry["feedback_event_id"]
