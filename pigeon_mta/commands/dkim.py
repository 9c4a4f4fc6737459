"""`dkim keygen`, `dkim list`, `dkim activate`, `dkim deactivate`: DKIM keys and their records.

Private keys are stored in the database and never printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from pigeon_mta import dkim
from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    jsonable,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.domains import ascii_domain
from pigeon_mta.store import dkim_keys as store_dkim_keys
from pigeon_mta.store.executor import Executor

_SELECTOR_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


def register(sub: Any) -> None:
    group = sub.add_parser("dkim", help="DKIM signing keys").add_subparsers(
        dest="dkim_command", required=True
    )
    p = group.add_parser(
        "keygen", help="create a signing key for a sender domain and print its DNS record"
    )
    add_common(p)
    p.add_argument("domain", help="a sender domain an org has added")
    p.add_argument(
        "--selector",
        help="DNS label of the key (default: <algorithm>-<yyyymmdd>, e.g. rsa-20260101)",
    )
    p.add_argument("--algorithm", choices=dkim.ALGORITHMS, default="rsa")
    p.add_argument(
        "--bits",
        type=int,
        help=f"RSA key size, {dkim.RSA_BITS_MIN}-{dkim.RSA_BITS_MAX} (default {dkim.RSA_BITS_DEFAULT})",
    )
    p.set_defaults(handler=cmd_keygen)

    p = group.add_parser("list", help="keys, their state and their DNS records")
    add_common(p)
    p.add_argument("--domain", help="only this domain's keys")
    p.set_defaults(handler=cmd_list)

    for name, handler, text in (
        (
            "activate",
            cmd_activate,
            "sign with this key (retires the domain's other key of its algorithm)",
        ),
        ("deactivate", cmd_deactivate, "stop signing with this key"),
    ):
        p = group.add_parser(name, help=text)
        add_common(p)
        p.add_argument("domain")
        p.add_argument("selector")
        p.set_defaults(handler=handler)


async def cmd_keygen(args: argparse.Namespace) -> int:
    selector = args.selector or f"{args.algorithm}-{dt.datetime.now(dt.UTC):%Y%m%d}"
    _check_selector(selector)
    try:
        generated = dkim.generate_key(args.algorithm, args.bits)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    async with open_database(args) as (_settings, conn):
        domain = await _sender_domain(conn, args.domain)
        try:
            key = await store_dkim_keys.add_key(
                conn,
                domain,
                selector=selector,
                algorithm=generated.algorithm,
                key_bits=generated.bits,
                private_key=generated.private_pem,
                public_key=generated.public_key,
            )
        except store_dkim_keys.SelectorExists as exc:
            raise CliError(f"{exc}; choose another with --selector") from None
    record = _record(key)
    if args.json:
        print(json.dumps(jsonable(record), indent=2))
    else:
        print(record["zone_file_line"])
    if not key.active:
        eprint(
            f"note: {key.domain} already signs with another {key.algorithm} key; publish this "
            f"record, then run: pigeon-mta dkim activate {key.domain} {key.selector}"
        )
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        keys = await store_dkim_keys.list_keys(conn)
    if args.domain:
        wanted = _spelled_as_stored(args.domain)
        keys = [k for k in keys if k.domain == wanted]
    rows = [_record(k) for k in keys]
    print_rows(
        args,
        rows,
        ["domain", "selector", "algorithm", "bits", "created_at", "active", "value"],
    )
    return 0


async def cmd_activate(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        domain = await _sender_domain(conn, args.domain)
        result = await store_dkim_keys.activate_key(conn, domain.id, args.selector)
    if result is None:
        raise CliError(f"{domain.domain} has no key with selector '{args.selector}'")
    key, replaced = result
    print_object(args, {**_summary(key), "replaced": ", ".join(replaced) or None})
    return 0


async def cmd_deactivate(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        domain = await _sender_domain(conn, args.domain)
        key = await store_dkim_keys.deactivate_key(conn, domain.id, args.selector)
    if key is None:
        raise CliError(f"{domain.domain} has no key with selector '{args.selector}'")
    print_object(args, _summary(key))
    return 0


def _spelled_as_stored(name: str) -> str:
    """The domain as sender domains are stored (pigeon_mta/domains.py), or a CliError."""
    try:
        return ascii_domain(name)
    except ValueError:
        raise CliError(f"'{name}' is not a valid domain name") from None


async def _sender_domain(db: Executor, name: str) -> store_dkim_keys.SenderDomain:
    domain = await store_dkim_keys.find_sender_domain(db, _spelled_as_stored(name))
    if domain is None:
        raise CliError(
            f"no org has added the domain {name}; add it first with: "
            f"pigeon-mta domain add ORG {name}"
        )
    return domain


def _check_selector(selector: str) -> None:
    # RFC 6376 3.1: a selector is one or more DNS labels (letters, digits, hyphens) joined by dots.
    labels = selector.split(".")
    if not all(
        label and set(label) <= _SELECTOR_CHARS and not label.startswith("-") for label in labels
    ):
        raise CliError(f"'{selector}' is not a valid selector (DNS labels: letters, digits, '-')")


def _record(key: store_dkim_keys.DkimKey) -> dict[str, Any]:
    value = dkim.txt_record_value("rsa" if key.algorithm == "rsa" else "ed25519", key.public_key)
    return {
        "name": dkim.record_name(key.selector, key.domain),
        "value": value,
        "zone_file_line": dkim.zone_file_line(key.selector, key.domain, value),
        "org": key.org_name,
        "domain": key.domain,
        "selector": key.selector,
        "algorithm": key.algorithm,
        "bits": key.key_bits,
        "active": key.active,
        "created_at": key.created_at,
    }


def _summary(key: store_dkim_keys.DkimKey) -> dict[str, Any]:
    return {
        "domain": key.domain,
        "selector": key.selector,
        "algorithm": key.algorithm,
        "active": key.active,
        "name": dkim.record_name(key.selector, key.domain),
    }
