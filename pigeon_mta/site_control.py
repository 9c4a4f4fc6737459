"""The site controller: how a site's cluster-wide rate and sessions follow what its servers say.
Pure: a budget's state in, its next state out, at a time the caller gives (the database's, read
once the budget's row is locked: store/controls.py reads and writes the state under that
lock, so every engine of every node drives the same controller). Beside it, each process's
adaptive concurrency (outbound/adaptive.py) applies slow start and latency feedback within the
sessions this controller allows.

- `throttled`: a throttling reply (a 421, or a 5xx about our rate) lowers the rate and sessions
  multiplicatively, at most once per `hold` seconds: the replies of one overload arrive together
  and are one signal. It starts from the limits in force, or, for a site without any, from what
  the engines were sending: each engine that reports within the hold adds its own rate and
  sessions once. Under a reply rule's limit a report never raises either.
- `limited`: a reply rule's limit (`[[shaping.rule]]` action rate or sessions) holds the rate or
  sessions at most at its value for its time, in backoff.
- `recovered`: after `quiet` seconds without a throttling reply (and after a rule's limit ends),
  each quiet period adds `step` of the target, up to the configured values, or for a site with
  none, to the rate its last decrease started from (`recover_*`), where it is then capped (a
  server that throttled us at that rate is not sent more: no 421 sawtooth; never "unlimited").
  A site that never throttled us but was limited by a rule ends without limits. A capped site
  whose mail waits in its queue probes upward: each two quiet periods without a throttling
  reply add `step` of its rate (at least 1/s) and one session, target included; the next
  throttling reply finds the server's limit again, from just above it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True)
class SiteControl:
    """A site budget's controller state (columns of table `budget`). Rates are messages a
    second, sessions a count; 0 is "no limit" for the configured and effective values."""

    rate: float = 0.0  # configured
    concurrency: int = 0  # configured
    effective_rate: float = 0.0
    effective_concurrency: int = 0
    backoff: bool = False
    capped: bool = False  # no configured limits: held where it throttled us
    recover_rate: float = 0.0  # the target of recovery for a site without configured limits
    recover_concurrency: int = 0
    base_rate: float = 0.0  # what the current decrease started from (0: from the reports)
    base_concurrency: int = 0
    reporters: tuple[str, ...] = ()  # engines counted in the current decrease
    reported_rate: float = 0.0  # what they were sending, together
    reported_concurrency: int = 0
    tokens: float = 0.0
    changed_at: datetime | None = None  # the last decrease, limit, recovery step or probe
    decreased_at: datetime | None = None
    throttled_at: datetime | None = None
    limited_until: datetime | None = None
    last_reply: str | None = None

    @property
    def configured(self) -> bool:
        return self.rate > 0 or self.concurrency > 0


COLUMNS = tuple(f.name for f in dataclasses.fields(SiteControl))


@dataclass(frozen=True)
class Report:
    """A throttling reply one engine saw, with what it was sending to the site."""

    holder: str  # the engine (`<node>/<run>#<pid>`)
    rate: float
    sessions: int
    reply: str


def _limited(c: SiteControl, now: datetime) -> bool:
    return c.limited_until is not None and c.limited_until > now


def throttled(
    c: SiteControl, report: Report, now: datetime, *, factor: float, hold: float
) -> SiteControl:
    """The state after a throttling reply (see the module's doc)."""
    limited = _limited(c, now)
    within = (
        c.backoff and c.decreased_at is not None and c.decreased_at > now - timedelta(seconds=hold)
    )
    rate, sessions = max(1.0, report.rate), max(1, report.sessions)
    if not within:
        c = dataclasses.replace(
            c,
            base_rate=max(0.0, c.effective_rate),
            base_concurrency=max(0, c.effective_concurrency),
            reporters=(report.holder,),
            reported_rate=rate,
            reported_concurrency=sessions,
            tokens=min(c.tokens, 0.0),
            changed_at=now,
            decreased_at=now,
        )
    elif report.holder not in c.reporters:
        c = dataclasses.replace(
            c,
            reporters=(*c.reporters, report.holder),
            reported_rate=c.reported_rate + rate,
            reported_concurrency=c.reported_concurrency + sessions,
        )
    from_rate = c.base_rate if c.base_rate > 0 else c.reported_rate
    from_sessions = c.base_concurrency if c.base_concurrency > 0 else c.reported_concurrency
    new_rate = max(1.0, from_rate * factor)
    new_sessions = max(1, math.floor(from_sessions * factor))
    if limited:
        # Under a rule's limit: never above it, and the limit is not the recovery target.
        if c.effective_rate > 0:
            new_rate = min(c.effective_rate, new_rate)
        if c.effective_concurrency > 0:
            new_sessions = min(c.effective_concurrency, new_sessions)
        target_rate = max(c.recover_rate, from_rate) if c.recover_rate > 0 else 0.0
        target_sessions = (
            max(c.recover_concurrency, from_sessions) if c.recover_concurrency > 0 else 0
        )
    else:
        target_rate, target_sessions = from_rate, from_sessions
    return dataclasses.replace(
        c,
        effective_rate=new_rate,
        effective_concurrency=new_sessions,
        recover_rate=target_rate,
        recover_concurrency=target_sessions,
        backoff=True,
        capped=False,
        throttled_at=now,
        last_reply=report.reply,
    )


def limited(
    c: SiteControl, rate: float, sessions: int, seconds: float, reply: str, now: datetime
) -> SiteControl:
    """The state under a reply rule's limit: at most `rate` (0: unchanged) and `sessions` (0:
    unchanged) for `seconds`."""
    effective_rate = c.effective_rate
    if rate > 0:
        effective_rate = min(effective_rate, rate) if effective_rate > 0 else rate
    effective_sessions = c.effective_concurrency
    if sessions > 0:
        effective_sessions = (
            min(effective_sessions, sessions) if effective_sessions > 0 else sessions
        )
    until = now + timedelta(seconds=seconds)
    return dataclasses.replace(
        c,
        effective_rate=effective_rate,
        effective_concurrency=effective_sessions,
        tokens=min(c.tokens, 1.0),
        backoff=True,
        capped=False,
        limited_until=max(c.limited_until, until) if c.limited_until else until,
        changed_at=now,
        last_reply=reply,
    )


def _latest(*stamps: datetime | None) -> datetime | None:
    known = [s for s in stamps if s is not None]
    return max(known) if known else None


def recovered(
    c: SiteControl, now: datetime, *, step: float, quiet: float, waiting: bool
) -> SiteControl:
    """The state after the quiet periods that passed since the last signal: recovery steps, or
    for a capped site with mail `waiting` in its queue, the upward probe. Unchanged when
    nothing is due."""
    if c.backoff:
        since = _latest(c.changed_at, c.throttled_at, c.limited_until)
        if since is None:
            return c
        periods = math.floor((now - since).total_seconds() / quiet)
        if periods < 1:
            return c
        to_rate = c.rate if c.rate > 0 else c.recover_rate
        to_sessions = c.concurrency if c.concurrency > 0 else c.recover_concurrency
        new_rate = min(to_rate, c.effective_rate + periods * step * to_rate)
        new_sessions = min(
            to_sessions, c.effective_concurrency + max(1, math.ceil(periods * step * to_sessions))
        )
        done = new_rate >= to_rate and new_sessions >= to_sessions
        if done:
            new_rate = c.rate if c.configured else to_rate
            new_sessions = c.concurrency if c.configured else to_sessions
        c = dataclasses.replace(
            c,
            backoff=not done,
            capped=not c.configured and done and (to_rate > 0 or to_sessions > 0),
            effective_rate=new_rate,
            effective_concurrency=new_sessions,
            changed_at=since + timedelta(seconds=periods * quiet),
        )
    if not (c.capped and not c.backoff and not c.configured and waiting):
        return c
    since = _latest(c.changed_at, c.throttled_at)
    if since is None or since > now - timedelta(seconds=2 * quiet):
        return c
    rate, sessions = c.effective_rate, c.effective_concurrency
    if rate > 0:
        rate += max(1.0, step * rate)
    if sessions > 0:
        sessions += 1
    return dataclasses.replace(
        c,
        effective_rate=rate,
        effective_concurrency=sessions,
        recover_rate=rate if rate > 0 else c.recover_rate,
        recover_concurrency=sessions if sessions > 0 else c.recover_concurrency,
        changed_at=now,
    )
