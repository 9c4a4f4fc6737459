"""Lanes as an operator meets them in the real command: `user add/set --lane`, `user list`,
`queue` (the lanes' summary), `queue list --lane`, `queue show` and `log`.

pigeon-mta (a process per command) ──► PostgreSQL ◄── the test, which seeds the queue
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from tests.conftest import run_pigeon
from tests.integration.queue_helpers import bulk_queue


def pigeon(db_url: str, *args: str, config: Path | None = None) -> tuple[int, str, str]:
    options = ["--config", str(config)] if config else []
    result = run_pigeon(*args, *options, env={"PIGEON_DATABASE_URL": db_url})
    return result.returncode, result.stdout, result.stderr


def pigeon_json(db_url: str, *args: str, config: Path | None = None) -> Any:
    code, out, err = pigeon(db_url, *args, "--json", config=config)
    assert code == 0, err
    return json.loads(out)


def notify_config(tmp_path: Path) -> Path:
    """A config file that declares the lane "notify" beside the built-in ones."""
    path = tmp_path / "pigeon.toml"
    path.write_text('[lanes.notify]\nweight = 5\nmax_age = "1h"\n')
    return path


async def test_users_get_set_and_show_their_lane(tmp_path: Path, db_url: str) -> None:
    config = notify_config(tmp_path)
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    added = pigeon_json(db_url, "user", "add", "acme", "newsletter", "--lane", "bulk")
    assert added["lane"] == "bulk"
    assert pigeon_json(db_url, "user", "add", "acme", "app")["lane"] is None
    # A lane the config file declares.
    changed = pigeon_json(db_url, "user", "set", "app", "--lane", "notify", config=config)
    assert changed == {"username": "app", "org": "acme", "lane": "notify"}
    users = pigeon_json(db_url, "user", "list")
    assert {u["username"]: u["lane"] for u in users} == {"app": "notify", "newsletter": "bulk"}
    code, out, _ = pigeon(db_url, "user", "list")
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert header.split()[-1] == "LANE"
    assert sorted((r.split()[0], r.split()[-1]) for r in rows) == [
        ("app", "notify"),
        ("newsletter", "bulk"),
    ]

    cleared = pigeon_json(db_url, "user", "set", "newsletter", "--no-lane")
    assert cleared["lane"] is None


async def test_an_unknown_lane_is_one_sentence_and_changes_nothing(
    db_url: str, pool: asyncpg.Pool
) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    assert pigeon(db_url, "user", "add", "acme", "app", "--lane", "bulk")[0] == 0
    # "notify" is declared only in a config file this command was not given.
    for args in (
        ("user", "set", "app", "--lane", "notify"),
        ("user", "add", "acme", "other", "--lane", "notify"),
        ("user", "set", "app", "--lane", ""),
    ):
        code, out, err = pigeon(db_url, *args)
        assert code == 1 and out == "", (args, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "lanes: bulk, transactional" in err
    assert (
        "there is no lane 'notify'" in pigeon(db_url, "user", "set", "app", "--lane", "notify")[2]
    )
    assert await pool.fetchval("SELECT lane FROM credential WHERE username = 'app'") == "bulk"
    assert await pool.fetchval("SELECT count(*) FROM credential") == 1
    code, _out, err = pigeon(db_url, "user", "set", "nobody", "--lane", "bulk")
    assert code == 1 and "there is no user 'nobody'" in err


async def test_queue_and_log_show_the_lanes(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=6, due_in=-300, age=300, lane="bulk")
    await bulk_queue(pool, org_id, messages=2, due_in=-20, age=20, domain="app.example")
    await bulk_queue(pool, org_id, messages=1, status="delivering", lane="bulk")

    summary = pigeon_json(db_url, "queue", config=notify_config(tmp_path))
    lanes = {lane["lane"]: lane for lane in summary["lanes"]}
    assert set(lanes) == {"bulk", "notify", "transactional"}  # a configured lane with no mail too
    assert (lanes["bulk"]["queued"], lanes["bulk"]["due"], lanes["bulk"]["delivering"]) == (6, 6, 1)
    assert 300 <= lanes["bulk"]["oldest_due_age_seconds"] < 600
    assert (lanes["transactional"]["queued"], lanes["notify"]["queued"]) == (2, 0)
    assert 20 <= lanes["transactional"]["oldest_due_age_seconds"] < 300
    code, out, err = pigeon(db_url, "queue")
    assert code == 0, err
    bulk_line = next(line for line in out.splitlines() if line.startswith("bulk "))
    assert bulk_line.split()[1:6] == ["6", "6", "0", "0", "1"] and "5m" in bulk_line

    listed = pigeon_json(db_url, "queue", "list", "--lane", "bulk")
    assert len(listed) == 7 and {r["lane"] for r in listed} == {"bulk"}
    assert {r["address"].split("@")[1] for r in listed} == {"example.net"}
    assert len(pigeon_json(db_url, "queue", "list", "--lane", "transactional")) == 2
    assert pigeon_json(db_url, "queue", "list", "--lane", "notify") == []
    dry = pigeon_json(db_url, "queue", "cancel", "--lane", "bulk", "--dry-run")
    assert (dry["count"], dry["delivering_left_alone"]) == (6, 1)

    queue_id = listed[0]["queue_id"]
    shown = pigeon_json(db_url, "queue", "show", queue_id)
    assert shown["lane"] == "bulk"
    code, out, err = pigeon(db_url, "queue", "show", queue_id)
    assert code == 0 and any(line.split() == ["lane", "bulk"] for line in out.splitlines())

    code, out, err = pigeon(db_url, "log", queue_id)
    assert code == 0, err
    received = next(line for line in out.splitlines() if line.strip().startswith("received"))
    assert received.rstrip().endswith("lane=bulk")
    records = pigeon(db_url, "log", queue_id, "--json")[1].splitlines()
    [reception] = [json.loads(line) for line in records]
    assert reception["type"] == "Reception" and reception["lane"] == "bulk"
