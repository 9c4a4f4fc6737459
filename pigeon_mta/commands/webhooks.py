"""`webhook add|list|remove|test`: an org's HTTP endpoints for events about its mail.

The events and their signing are described in pigeon_mta/webhooks/; the sender runs in `serve`.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    jsonable,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.ids import new_id
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import webhooks as store_webhooks


def register(sub: Any) -> None:
    webhook = sub.add_parser(
        "webhook", help="HTTP endpoints told about an org's mail"
    ).add_subparsers(dest="webhook_command", required=True)
    p = webhook.add_parser("add", help="add an endpoint (prints its signing secret once)")
    add_common(p)
    p.add_argument("org", metavar="ORG")
    p.add_argument("url", metavar="URL", help="http:// or https:// URL the events are POSTed to")
    p.add_argument(
        "--events",
        metavar="TYPES",
        default=",".join(store_webhooks.EVENT_TYPES),
        help=f"comma-separated event types (default: {','.join(store_webhooks.EVENT_TYPES)})",
    )
    p.set_defaults(handler=cmd_add)

    p = webhook.add_parser("list", help="list endpoints with their last reply and backlog")
    add_common(p)
    p.add_argument("org", nargs="?", metavar="ORG", help="only this org (default: every org)")
    p.set_defaults(handler=cmd_list)

    p = webhook.add_parser("remove", help="remove an endpoint and its unsent events")
    add_common(p)
    p.add_argument("id", metavar="ID")
    p.set_defaults(handler=cmd_remove)

    p = webhook.add_parser("test", help="send a signed ping event now and print the reply status")
    add_common(p)
    p.add_argument("id", metavar="ID")
    p.set_defaults(handler=cmd_test)


def checked_url(text: str) -> str:
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port that is not a number
    except ValueError:
        raise CliError(f"'{text}' is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"'{text}' is not an http:// or https:// URL with a host")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise CliError(f"the URL {text!r} contains white space or control characters")
    del port
    return text


def checked_events(text: str) -> list[str]:
    events = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in events if e not in store_webhooks.EVENT_TYPES]
    if unknown or not events:
        raise CliError(
            f"unknown event type(s) {', '.join(unknown) or '(none given)'}: choose from "
            f"{', '.join(store_webhooks.EVENT_TYPES)}"
        )
    return list(dict.fromkeys(events))


def checked_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise CliError(f"'{text}' is not a webhook id (see pigeon-mta webhook list)") from None


async def cmd_add(args: argparse.Namespace) -> int:
    from pigeon_mta.webhooks.signing import new_secret

    url = checked_url(args.url)
    events = checked_events(args.events)
    async with open_database(args) as (_settings, conn):
        org = await store_orgs.find_org(conn, args.org)
        if org is None:
            raise CliError(f"there is no org named '{args.org}' (see pigeon-mta org list)")
        hook = await store_webhooks.add_webhook(conn, org.id, url, events, new_secret())
    if args.json:
        print(json.dumps({"id": str(hook.id), "secret": hook.secret}))
        return 0
    shown = {"id": hook.id, "org": org.name, "url": hook.url, "events": ",".join(hook.events)}
    print_object(args, {**shown, "secret": hook.secret})
    print("(the secret is shown only this once: store it now)", file=sys.stderr)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        org_id = None
        if args.org:
            org = await store_orgs.find_org(conn, args.org)
            if org is None:
                raise CliError(f"there is no org named '{args.org}' (see pigeon-mta org list)")
            org_id = org.id
        names = {o.id: o.name for o in await store_orgs.list_orgs(conn)}
        summaries = await store_webhooks.list_webhooks(conn, org_id)
    rows = [
        {
            "id": s.webhook.id,
            "org": names.get(s.webhook.org_id, str(s.webhook.org_id)),
            "url": s.webhook.url,
            "events": ",".join(s.webhook.events),
            "last_status": s.webhook.last_status,
            "last_attempt_at": s.webhook.last_attempt_at,
            "last_error": s.webhook.last_error,
            "backlog": s.backlog,
            "failed": s.failed,
        }
        for s in summaries
    ]
    print_rows(
        args,
        rows,
        ["id", "org", "url", "events", "last_status", "last_attempt_at", "backlog", "failed"],
    )
    return 0


async def cmd_remove(args: argparse.Namespace) -> int:
    webhook_id = checked_id(args.id)
    async with open_database(args) as (_settings, conn):
        if not await store_webhooks.remove_webhook(conn, webhook_id):
            raise CliError(f"there is no webhook {webhook_id} (see pigeon-mta webhook list)")
    print_object(args, {"id": webhook_id, "removed": True})
    return 0


async def cmd_test(args: argparse.Namespace) -> int:
    from pigeon_mta.webhooks.sender import new_session, post_event

    webhook_id = checked_id(args.id)
    async with open_database(args) as (settings, conn):
        hook = await store_webhooks.find_webhook(conn, webhook_id)
        if hook is None:
            raise CliError(f"there is no webhook {webhook_id} (see pigeon-mta webhook list)")
        event_id = new_id()
        body = json.dumps(
            {
                "type": "ping",
                "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
                "data": {"webhook_id": str(hook.id), "event_id": str(event_id)},
            }
        ).encode()
        async with new_session(settings.webhooks) as session:
            reply = await post_event(session, hook.url, hook.secret, str(event_id), body)
        await store_webhooks.note_reply(conn, hook.id, reply.status, reply.error)
    result = {"id": hook.id, "url": hook.url, "status": reply.status, "error": reply.error}
    if args.json:
        print(json.dumps(jsonable(result)))
    else:
        print(f"{hook.url} answered {reply.status}" if reply.status else f"{hook.url}: no reply")
    if not reply.accepted:
        raise CliError(f"the ping was not accepted: {reply.error}")
    return 0
