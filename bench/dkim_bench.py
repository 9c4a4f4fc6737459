"""DKIM signing speed on a 5 KB text message, one core, and what signing does to the event loop.

    python bench/dkim_bench.py [--seconds 3] [--cpu 0]

Part 1, signatures/s in one thread (pinned to one CPU with --cpu): RSA-2048 by stock dkimpy
(pure-Python RSA), RSA-2048 by pigeon_mta.dkim.sign (its own canonicalization, OpenSSL through `cryptography`),
OpenSSL's bare RSA-2048 signature (the ceiling for the fast path), Ed25519, and RSA + Ed25519
together (a domain with both keys).

Part 2, event-loop stall: a timer task on the loop asks to wake every millisecond while bursts of
50 RSA-2048 signatures are made: all on the loop at once; on the loop one per iteration (what
DkimSigner does); on a thread pool of one and two threads (what it did before: `cryptography`
keeps the GIL while it signs, so threads add no throughput). It reports how late the timer woke (p50/p99/max), i.e. how long every other connection of
that process would have waited, and the signatures/s of each mode.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dkim as dkimpy
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

from pigeon_mta import dkim
from pigeon_mta.signer import DkimSigner

T = 1_764_428_400


def text_message(size: int = 5 * 1024) -> bytes:
    """A realistic text message of about `size` bytes."""
    header = (
        b"Received: from app1.example.com (app1.example.com [192.0.2.10])\r\n"
        b"\tby mta.example.com with ESMTPSA; Sun, 29 Nov 2026 15:00:00 +0000\r\n"
        b"From: Example Billing <billing@example.com>\r\n"
        b"To: Bob Customer <bob@example.net>\r\n"
        b"Subject: Your monthly statement is ready\r\n"
        b"Date: Sun, 29 Nov 2026 15:00:00 +0000\r\n"
        b"Message-ID: <20261129150000.4711@example.com>\r\n"
        b"MIME-Version: 1.0\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"List-Unsubscribe: <https://example.com/u/0123456789abcdef>\r\n"
        b"\r\n"
    )
    line = b"Dear customer, your statement for November is ready to view online.\r\n"
    return header + line * max(1, (size - len(header)) // len(line))


def rate(fn: Callable[[], object], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(5):
            fn()
        count += 5
        now = time.perf_counter()
        if now >= deadline:
            return count / (now - start)


def interleaved_rates(
    rows: list[tuple[str, Callable[[], object]]], seconds: float, rounds: int = 5
) -> dict[str, list[float]]:
    """Each candidate for seconds/rounds at a time, in turn, `rounds` times: on a shared machine
    the load drifts, and interleaving spreads the drift over all candidates alike."""
    for _name, fn in rows:
        fn()  # warm up
    rates: dict[str, list[float]] = {name: [] for name, _fn in rows}
    for _ in range(rounds):
        for name, fn in rows:
            rates[name].append(rate(fn, seconds / rounds))
    return rates


def signing_rates(message: bytes, seconds: float) -> None:
    rsa_gen = dkim.generate_key("rsa", 2048)
    rsa_key = dkim.load_signing_key("example.com", "s1", "rsa", rsa_gen.private_pem)
    ed_gen = dkim.generate_key("ed25519")
    ed_key = dkim.load_signing_key("example.com", "e1", "ed25519", ed_gen.private_pem)
    include = dkim.headers_to_sign(name for name, _v in dkimpy.rfc822_parse(message)[0])
    dkimpy.time = types.SimpleNamespace(time=lambda: T)  # this process only: a fixed t=

    def stock_rsa() -> bytes:
        return bytes(
            dkimpy.sign(
                message,
                b"s1",
                b"example.com",
                rsa_gen.private_pem.encode(),
                canonicalize=(b"relaxed", b"relaxed"),
                include_headers=include,
            )
        )

    assert stock_rsa() == dkim.sign(message, [rsa_key], timestamp=T), "fast path differs"
    assert isinstance(rsa_key.private_key, rsa.RSAPrivateKey)
    private = rsa_key.private_key
    digest = hashlib.sha256(message).digest()
    pkcs1, prehashed = padding.PKCS1v15(), utils.Prehashed(hashes.SHA256())

    print(f"message: {len(message)} bytes; {seconds:g} s per candidate, in 5 interleaved rounds")
    print(f"  {'':45s} {'best':>8s} {'median':>8s}  (signatures/s)")
    stock = rate(stock_rsa, min(seconds, 2.0))
    print(f"  {'RSA-2048, stock dkimpy':45s} {stock:8.0f} {'':8s}")
    rows: list[tuple[str, Callable[[], object]]] = [
        ("RSA-2048, pigeon fast path", lambda: dkim.sign(message, [rsa_key], timestamp=T)),
        ("RSA-2048, bare OpenSSL sign (ceiling)", lambda: private.sign(digest, pkcs1, prehashed)),
        ("Ed25519, pigeon", lambda: dkim.sign(message, [ed_key], timestamp=T)),
        (
            "RSA-2048 + Ed25519 (two signatures), pigeon",
            lambda: dkim.sign(message, [rsa_key, ed_key], timestamp=T),
        ),
    ]
    for name, rates in interleaved_rates(rows, seconds).items():
        print(f"  {name:45s} {max(rates):8.0f} {statistics.median(rates):8.0f}")


async def loop_stall(
    message: bytes, seconds: float, executor: concurrent.futures.Executor | str | None
) -> tuple[list[float], float]:
    gen = dkim.generate_key("rsa", 2048)
    key = dkim.load_signing_key("example.com", "s1", "rsa", gen.private_pem)
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def timer() -> None:
        while not stop.is_set():
            start = loop.time()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, loop.time() - start - 0.001))

    in_turn = DkimSigner(None, clock=lambda: T)  # type: ignore[arg-type]  # no key lookups here

    async def sign_one() -> bytes:
        if executor is None:
            return dkim.sign(message, [key], timestamp=T)
        if executor == "in-turn":
            # What the service does: one signature per loop iteration (pigeon_mta/signer.py).
            return await in_turn._sign_in_turn(message, (key,))
        assert isinstance(executor, concurrent.futures.Executor)
        return await loop.run_in_executor(executor, lambda: dkim.sign(message, [key], timestamp=T))

    ticker = asyncio.create_task(timer())
    signed, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await asyncio.gather(*(sign_one() for _ in range(50)))
        signed += 50
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - start
    stop.set()
    await ticker
    return lags, signed / elapsed


def report_stall(name: str, lags: list[float], per_second: float) -> None:
    ordered = sorted(lags)
    p99 = ordered[int(len(ordered) * 0.99)] if ordered else 0.0
    print(
        f"  {name:30s} timer late p50 {statistics.median(ordered) * 1000:6.2f} ms  "
        f"p99 {p99 * 1000:6.2f} ms  max {ordered[-1] * 1000:6.2f} ms   {per_second:6.0f} sig/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement (default 3)")
    parser.add_argument("--cpu", type=int, help="pin the signing-rate part to this CPU")
    parser.add_argument("--size", type=int, default=5 * 1024, help="message size (default 5 KB)")
    args = parser.parse_args()
    message = text_message(args.size)
    all_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()

    print(
        "Signatures/s, one thread" + (f", pinned to CPU {args.cpu}" if args.cpu is not None else "")
    )
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    signing_rates(message, args.seconds)
    if args.cpu is not None:
        os.sched_setaffinity(0, all_cpus)

    print("Event loop while signing bursts of 50 RSA-2048 signatures")
    lags, per_second = asyncio.run(loop_stall(message, args.seconds, None))
    report_stall("on the event loop", lags, per_second)
    lags, per_second = asyncio.run(loop_stall(message, args.seconds, "in-turn"))
    report_stall("on the loop, one per iteration", lags, per_second)
    for threads in (1, 2):
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            lags, per_second = asyncio.run(loop_stall(message, args.seconds, pool))
        report_stall(f"thread pool, {threads} thread(s)", lags, per_second)


if __name__ == "__main__":
    main()
