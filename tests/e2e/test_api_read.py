"""Reading mail back through the HTTP API of the real `pigeon-mta serve`: a message sent over HTTP
arrives DKIM-signed (a key from `pigeon-mta dkim keygen`, verified by dkimpy), and
`pigeon-mta log --json` and `GET /v1/messages/{id}` tell the same story; README's curl examples
for timelines, listings and suppressions run as written.

aiohttp client, curl ──HTTP──► [api] 127.0.0.1:port ── pigeon-mta serve ── PostgreSQL
pigeon-mta dkim keygen / apikey add / log             │ [delivery] relayhost
                                           aiosmtpd sink 127.0.0.2:port ──► dkimpy (TXT from keygen)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from tests.e2e.relay_serve import relay_serve
from tests.e2e.shared import pigeon_ok as pigeon
from tests.e2e.shared import readme_block, settled
from tests.peers.dkim_verify import dkim_zone, dkimpy_verify


def json_documents(text: str) -> list[Any]:
    """The JSON documents curl printed one after another."""
    decoder = json.JSONDecoder()
    documents, at = [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
    return documents


async def test_api_mail_is_signed_and_its_timeline_is_the_log_and_readme_curl_works(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-api-read",
        submission=False,
        api=True,
        tables={"database": {"pool_size": 4}, "delivery": {"poll_interval": "250ms"}},
        setup=[("dkim", "keygen", "acme.example", "--json"), ("apikey", "add", "acme", "--json")],
    ) as relay:
        state, serve, api_port, url = relay.sink, relay.serve, relay.api_port, relay.api_url
        record = json.loads(relay.prepared[0])
        key = json.loads(relay.prepared[1])["key"]
        auth = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(headers=auth) as session:
            order = {
                "from": "Shop <shop@acme.example>",
                "to": ["ann@sink.test", "bob@sink.test"],
                "subject": "Your order",
                "text": "Thank you for your order.",
            }
            async with session.post(url + "/v1/messages", json=order) as answer:
                assert answer.status == 202, await answer.text()
                queue_id = (await answer.json())["queue_id"]
            await state.wait_for(lambda: len(state.messages) == 1)
            for _ in range(300):  # bounded: the queue settles within a minute
                if await settled(pool):
                    break
                await asyncio.sleep(0.2)
            assert await settled(pool)

            # Signed with the key `dkim keygen` made, as its DNS record says.
            data = state.messages[0].data
            assert data.count(b"DKIM-Signature:") == 1 and b"d=acme.example" in data
            with dkim_zone({record["name"].rstrip("."): record["value"]}) as zone:
                assert dkimpy_verify(data, zone) == [True]

            async with session.get(f"{url}/v1/messages/{queue_id}") as answer:
                assert answer.status == 200
                timeline = await answer.json()

        # The same story: the API's events are the lines of `pigeon-mta log --json`.
        logged = [
            json.loads(line) for line in pigeon(db_url, "log", queue_id, "--json").splitlines()
        ]
        assert timeline["events"] == logged
        assert sorted((e["type"], e["recipient"]) for e in logged) == [
            ("Delivery", "ann@sink.test"),
            ("Delivery", "bob@sink.test"),
            ("Reception", "ann@sink.test"),
            ("Reception", "bob@sink.test"),
        ]
        assert all(e["dkim"].startswith("signed d=acme.example") for e in logged[2:])
        assert {(r["address"], r["status"]) for r in timeline["recipients"]} == {
            ("ann@sink.test", "delivered"),
            ("bob@sink.test", "delivered"),
        }

        # README's curl examples, with this node's port and the test's addresses.
        script = readme_block("sh", "/v1/suppressions")
        for placeholder, value in (
            ("127.0.0.1:8025", f"127.0.0.1:{api_port}"),
            ("ann@example.net", "ann@sink.test"),
        ):
            assert placeholder in script
            script = script.replace(placeholder, value)
        ran = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-e", "-c", script],
            env={**os.environ, "PIGEON_API_KEY": key, "QUEUE_ID": queue_id},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        shown, listed, added, suppressions = json_documents(ran.stdout)
        assert shown == timeline
        assert [m["queue_id"] for m in listed["messages"]] == [queue_id]
        assert added["address"] == "ann@sink.test" and added["reason"] == "asked to stop"
        assert [e["address"] for e in suppressions["suppressions"]] == ["ann@sink.test"]
        # The last example removed the entry again.
        assert await pool.fetchval("SELECT count(*) FROM suppression") == 0
        assert serve.stop(signal.SIGTERM) == 0, serve.output
        assert "Traceback" not in serve.output
