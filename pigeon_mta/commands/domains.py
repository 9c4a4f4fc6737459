"""`domain add ORG DOMAIN`, `domain list`, `domain show DOMAIN`, `domain set DOMAIN --return-path
RP`, `domain remove DOMAIN`: the sender domains an org may use, and where their bounces return."""

from __future__ import annotations

import argparse
from typing import Any

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.domains import normalize_domain
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import return_path as store_return_path


def register(sub: Any) -> None:
    domain = sub.add_parser("domain", help="sender domains an org may use").add_subparsers(
        dest="domain_command", required=True
    )
    p = domain.add_parser("add", help="let an org send as a domain")
    add_common(p)
    p.add_argument("org")
    p.add_argument("domain")
    p.set_defaults(handler=cmd_add)
    p = domain.add_parser("list", help="list sender domains")
    add_common(p)
    p.set_defaults(handler=cmd_list)
    p = domain.add_parser("show", help="a domain, its return path and the DNS records to publish")
    add_common(p)
    p.add_argument("domain")
    p.set_defaults(handler=cmd_show)
    p = domain.add_parser("set", help="change a domain's settings")
    add_common(p)
    p.add_argument("domain")
    p.add_argument(
        "--return-path",
        required=True,
        metavar="DOMAIN",
        help="the domain its mail leaves with as envelope sender (b-TOKEN@DOMAIN), so that "
        'bounces and complaints come back to a feedback listener; "" for [bounces] '
        "return_path_domain again",
    )
    p.set_defaults(handler=cmd_set)
    p = domain.add_parser(
        "remove", help="stop an org sending as a domain; deletes the domain's DKIM keys"
    )
    add_common(p)
    p.add_argument("domain")
    p.set_defaults(handler=cmd_remove)


async def cmd_add(args: argparse.Namespace) -> int:
    domain = normalize_domain(args.domain.strip())
    if domain is None:
        raise CliError(f"'{args.domain}' is not a domain name")
    async with open_database(args) as (_settings, conn):
        org = await store_orgs.find_org(conn, args.org)
        if org is None:
            raise CliError(
                f"there is no org '{args.org}' (create it with: pigeon-mta org add NAME)"
            )
        try:
            added = await store_domains.add_sender_domain(conn, org.id, domain)
        except store_domains.DomainTaken as exc:
            raise CliError(str(exc)) from None
    print_object(
        args,
        {"domain": added.domain, "org": added.org, "id": added.id, "created_at": added.created_at},
    )
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        found = await store_domains.list_sender_domains(conn)
    print_rows(args, [vars(d) for d in found], ["domain", "org", "created_at", "id"])
    return 0


async def cmd_set(args: argparse.Namespace) -> int:
    domain = _domain(args.domain)
    async with open_database(args) as (_settings, conn):
        try:
            found = await store_return_path.set_return_path(conn, domain, args.return_path or None)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if not found:
        raise CliError(f"no org has added the domain '{domain}'")
    return await cmd_show(args)


async def cmd_show(args: argparse.Namespace) -> int:
    domain = _domain(args.domain)
    async with open_database(args) as (settings, conn):
        found = await store_domains.find_sender_domain(conn, domain)
    if found is None:
        raise CliError(f"no org has added the domain '{domain}'")
    configured = found.return_path
    default = normalize_domain(settings.bounces.return_path_domain or "") or None
    return_path = configured or default
    records = []
    if return_path:
        host = settings.server.hostname
        records = [
            f"{return_path}. IN MX 10 {host}.",
            f'{return_path}. IN TXT "v=spf1 a:{host} mx -all"',
        ]
    data = {
        "domain": found.domain,
        "org": found.org,
        "return_path": return_path,
        "return_path_from": "domain"
        if configured
        else ("bounces.return_path_domain" if default else None),
        "dns_records": records,
        "created_at": found.created_at,
        "id": found.id,
    }
    if args.json:
        print_object(args, data)
        return 0
    print_object(args, {k: v for k, v in data.items() if k != "dns_records"})
    if records:
        print()
        print(
            "Publish these, so that bounces and complaints reach a feedback listener on "
            f"{settings.server.hostname} and SPF passes for the envelope sender:"
        )
        for record in records:
            print(f"  {record}")
    return 0


def _domain(text: str) -> str:
    domain = normalize_domain(text.strip())
    if domain is None:
        raise CliError(f"'{text}' is not a domain name")
    return domain


async def cmd_remove(args: argparse.Namespace) -> int:
    domain = normalize_domain(args.domain.strip())
    if domain is None:
        raise CliError(f"'{args.domain}' is not a domain name")
    async with open_database(args) as (_settings, conn):
        removed = await store_domains.remove_sender_domain(conn, domain)
    if removed is None:
        raise CliError(f"no org has added the domain '{domain}'")
    print_object(
        args,
        {
            "domain": removed.domain.domain,
            "org": removed.domain.org,
            "dkim_keys_deleted": removed.dkim_selectors
            if args.json
            else ", ".join(removed.dkim_selectors) or None,
        },
    )
    if removed.dkim_selectors and not args.json:
        eprint(
            "its DKIM keys are deleted; remove their DNS records once mail signed with them "
            f"has been delivered: {', '.join(removed.dkim_selectors)}"
        )
    return 0
