"""The classification table (outbound/classify.py) on hostile replies: CPU time per reply.

Each kind of reply is 64 KB (twice what aiosmtplib reads of one reply, so the worst a peer can
send), run through `classify_reply` and `stated_retry_delay` as `judge` runs them for every
failed recipient, on the event loop. Beside it, the one rule whose cost grew with the square of
the text, `exceeded .*(rate|sending)`, run alone on the whole text as the table ran it before it
read a bounded prefix.

    .venv/bin/python bench/classify_bench.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from pigeon_mta.model import Reply
from pigeon_mta.outbound.classify import classify_reply, stated_retry_delay

SIZE = 64 * 1024

REPLIES = {
    "typical (Gmail 5.1.1)": (
        "5.1.1 The email account that you tried to reach does not exist. Please try double-"
        "checking the recipient's email address for typos or unnecessary spaces. For more "
        "information, go to https://support.google.com/mail/?p=NoSuchUser"
    ),
    "exceeded": "exceeded " * (SIZE // 9),
    "exceeded, lines": "\n".join(["5.7.1 " + "exceeded " * 110] * (SIZE // 1000)),
    "user unknown, lines": "\n".join(["5.1.1 user unknown"] * (SIZE // 19)),
    "try again in": "try again in " * (SIZE // 13),
    "unicode digits": "\u0661" * SIZE,
    "controls": "\x00\x1b[31m" * (SIZE // 6),
    "one long word": "x" * SIZE,
}
OLD_RULE = re.compile(r"exceeded .*(rate|sending)")


def _time(work: object, repeat: int) -> float:
    """The median of `repeat` runs, in milliseconds."""
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()  # type: ignore[operator]
        runs.append((time.perf_counter() - started) * 1000)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs per reply (median)")
    args = parser.parse_args()
    print(f"{'reply (64 KB)':<22} {'table ms':>9} {'old rule alone, whole text ms':>30}")
    for name, text in REPLIES.items():
        reply = Reply(550, None, text)

        def table(reply: Reply = reply) -> None:
            classify_reply(reply)
            stated_retry_delay(reply.text)

        def old(text: str = text) -> None:
            OLD_RULE.search(" ".join(text.split()).lower())

        old_ms = _time(old, max(1, min(args.repeat, 3)))
        print(f"{name:<24} {_time(table, args.repeat):>9.3f} {old_ms:>30.1f}")


if __name__ == "__main__":
    main()
