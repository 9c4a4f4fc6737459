"""`pigeon-mta queue`: the queue's summary (store/queue_summary.py), each lane's live queue, the
destinations with the most deferred mail, the cluster's budgets and suspensions."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pigeon_mta.commands import suspend
from pigeon_mta.commands.common import format_age, jsonable, open_database, print_rows, text_cell
from pigeon_mta.store import budgets as store_budgets
from pigeon_mta.store import reputation as store_reputation
from pigeon_mta.store import suspensions
from pigeon_mta.store.queue_summary import QueueSummary, queue_summary

REPLY_WIDTH = 60  # table cells; --json gives the whole reply


async def cmd_summary(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        summary = await queue_summary(conn, top=args.top, exact=args.exact)
        budgets = await store_budgets.list_budgets(conn)
        suspended = await suspensions.list_suspensions(conn)
        orgs = await store_reputation.rates(conn, window=settings.reputation.window)
    lanes = lane_rows(summary, settings.lanes)
    reputation = [reputation_row(r) for r in orgs if r.sent or r.paused]
    if args.json:
        data = {**summary_object(summary), "lanes": lanes}
        data["budgets"] = [dataclasses.asdict(b) for b in budgets]
        data["suspensions"] = [dataclasses.asdict(s) for s in suspended]
        data["reputation"] = reputation
        print(json.dumps(jsonable(data), indent=2))
        return 0
    print_rows(args, summary_rows(summary), ["status", "recipients"])
    print()
    if summary.due:
        print(f"oldest due recipient has waited {format_age(summary.oldest_due_age)}")
    else:
        print("nothing is due")
    if summary.estimated:
        print("(~ marks estimates from table statistics; --exact counts them)")
    print()
    print_rows(
        args,
        [{**lane, "oldest_due": format_age(lane["oldest_due_age_seconds"])} for lane in lanes],
        ["lane", "queued", "due", "deferred", "scheduled", "delivering", "oldest_due"],
    )
    print()
    print_rows(
        args,
        [
            {
                "destination": d.domain,
                "deferred": d.deferred,
                "latest_reply": short_reply(
                    reply_text(d.last_code, d.last_enhanced_code, d.last_response)
                ),
                "at": d.last_at,
            }
            for d in summary.top_deferred
        ],
        ["destination", "deferred", "latest_reply", "at"],
    )
    if budgets:
        print()
        print_rows(args, [budget_row(b) for b in budgets], BUDGET_COLUMNS)
    if suspended:
        print()
        suspend.print_suspensions(args, suspended)
    if reputation:
        print()
        window = store_reputation.window_text(settings.reputation.window)
        print(f"reputation over {window}:")
        print_rows(args, reputation, REPUTATION_COLUMNS)
    return 0


REPUTATION_COLUMNS = ["org", "sent", "bounce_rate", "complaint_rate", "paused"]


def reputation_row(r: store_reputation.OrgRates) -> dict[str, Any]:
    """An org's rates over the window (reputation.py), as `queue` shows them."""
    return {
        "org": r.org,
        "sent": r.sent,
        "hard_bounces": r.bounced,
        "complaints": r.complained,
        "bounce_rate": round(r.bounce_rate, 6),
        "complaint_rate": round(r.complaint_rate, 6),
        "paused": r.paused,
    }


BUDGET_COLUMNS = [
    "budget",
    "rate",
    "effective_rate",
    "concurrency",
    "effective",
    "sessions",
    "waiting",
    "state",
    "throttling_reply",
]


def budget_row(b: store_budgets.BudgetState) -> dict[str, Any]:
    """A limited destination, lane or org: configured and effective limits, backoff state."""
    kind = b.key.split(":", 1)[0]
    name = b.name
    source = store_budgets.DEFAULT_SOURCE
    if b.key.startswith(store_budgets.DESTINATION):
        # A destination's key names a pattern entry, a site (its MX hosts) or a route, as seen
        # from an egress source.
        source, name = store_budgets.source_and_site(b.key)
        if name.startswith("site:"):
            kind = "site"
    name = name.removeprefix("pattern:").removeprefix("mx:").removeprefix("site:")
    if source != store_budgets.DEFAULT_SOURCE:
        name += f" from {source}"
    state = "ok"
    if b.parked_until is not None:
        state = f"parked, probe at {_clock(b.parked_until)}: {short_reply(b.parked_reason or '')}"
    elif b.capped and not b.backoff:
        state = "capped where it throttled us (no limits configured)"
    elif b.backoff:
        state = f"backing off since {_clock(b.throttled_at)}"
        if b.held_until is not None and b.held_until > datetime.now(UTC):
            state += f", held until {_clock(b.held_until)}"
    return {
        "budget": f"{kind} {name}",
        "rate": _limit(b.rate),
        "effective_rate": _limit(b.effective_rate),
        "concurrency": _limit(b.concurrency),
        "effective": _limit(b.effective_concurrency),
        "sessions": b.sessions,
        "waiting": b.waiting,
        "state": state,
        "throttling_reply": short_reply(b.last_reply) if b.backoff and b.last_reply else "-",
    }


def _limit(value: float) -> str:
    return f"{value:g}" if value > 0 else "-"


def _clock(when: datetime | None) -> str:
    return when.astimezone(UTC).strftime("%H:%M:%S") if when else "?"


def summary_rows(summary: QueueSummary) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for status, count in summary.counts.items():
        shown = f"~{count}" if status in summary.estimated else str(count)
        rows.append({"status": status, "recipients": shown})
        if status == "queued":
            rows.append({"status": "  due now", "recipients": str(summary.due)})
            rows.append({"status": "  deferred", "recipients": str(summary.deferred)})
            rows.append({"status": "  scheduled", "recipients": str(summary.scheduled)})
    return rows


def lane_rows(summary: QueueSummary, configured: Iterable[str]) -> list[dict[str, Any]]:
    """The live queue of each lane: the configured lanes (with no mail, zeros) and any lane that
    queued mail still carries after the settings dropped it. "queued" counts the deferred too."""
    by_lane = {lane.lane: lane for lane in summary.lanes}
    return [
        {
            "lane": name,
            "queued": lane.queued if lane else 0,
            "due": lane.due if lane else 0,
            "deferred": lane.deferred if lane else 0,
            "scheduled": lane.scheduled if lane else 0,
            "delivering": lane.delivering if lane else 0,
            "oldest_due_age_seconds": round(lane.oldest_due_age, 3) if lane else 0.0,
        }
        for name in sorted({*configured, *by_lane})
        for lane in [by_lane.get(name)]
    ]


def summary_object(summary: QueueSummary) -> dict[str, Any]:
    return {
        "counts": summary.counts,
        "estimated": sorted(summary.estimated),
        "due": summary.due,
        "deferred": summary.deferred,
        "scheduled": summary.scheduled,
        "oldest_due_age_seconds": round(summary.oldest_due_age, 3),
        "top_deferred_destinations": [
            {
                "domain": d.domain,
                "deferred": d.deferred,
                "latest_reply": reply_text(d.last_code, d.last_enhanced_code, d.last_response),
                "code": d.last_code,
                "enhanced_code": d.last_enhanced_code,
                "response": d.last_response,
                "at": d.last_at,
            }
            for d in summary.top_deferred
        ],
    }


def reply_text(code: int | None, enhanced: str | None, text: str | None) -> str | None:
    return " ".join(str(p) for p in (code, enhanced, text) if p) or None


def short_reply(text: str | None) -> str:
    cell = text_cell(text)
    return cell if len(cell) <= REPLY_WIDTH else cell[: REPLY_WIDTH - 1] + "…"
