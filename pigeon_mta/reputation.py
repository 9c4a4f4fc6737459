"""A tenant's reputation: its rolling hard-bounce and complaint rates, and the pause that keeps
one org's bad list from costing every other org its standing with the mailbox providers (the
tenant reputation policy of hosted sending services, kept here).

Each maintenance round counts what was recorded since the last (store/reputation.py, per org and
lane), reads every org's rates over `[reputation] window` (its lanes together) and pauses an org that sent at least `min_volume`
recipients in it and whose rate reached `pause_bounce_rate` or `pause_complaint_rate`: a
suspension of the org (kind 'reputation'), so its mail stays queued and is not attempted, `queue`
lists the pause with the mail it holds and `log` says why on each of its recipients. `pigeon-mta
org resume ORG` ends it; the rates that paused it do not pause it again before a window has
passed since. Other orgs are untouched. The rates are metrics too
(`pigeon_org_bounce_rate{org}`, `pigeon_org_complaint_rate{org}`).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from pigeon_mta.config import ReputationSettings, Settings
from pigeon_mta.metrics import ORG_BOUNCE_RATE, ORG_COMPLAINT_RATE
from pigeon_mta.outbound.categories import SUPPRESSING_CATEGORIES
from pigeon_mta.store import reputation as store
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.reputation import OrgRates, window_text

log = logging.getLogger("pigeon_mta.serve")


def pause_reason(rates: OrgRates, settings: ReputationSettings, now: datetime) -> str | None:
    """Why the org is to be paused now; None when it is not."""
    if rates.paused is not None or rates.sent < max(1, settings.min_volume):
        return None
    if rates.resumed_at is not None and rates.resumed_at > now - timedelta(seconds=settings.window):
        return None
    over = window_text(settings.window)
    if settings.pause_complaint_rate > 0 and rates.complaint_rate >= settings.pause_complaint_rate:
        return (
            f"complaint rate {rates.complaint_rate:.2%} over {over} ({rates.complained} of "
            f"{rates.sent}; [reputation] pause_complaint_rate {settings.pause_complaint_rate:.2%})"
        )
    if settings.pause_bounce_rate > 0 and rates.bounce_rate >= settings.pause_bounce_rate:
        return (
            f"hard-bounce rate {rates.bounce_rate:.2%} over {over} ({rates.bounced} of "
            f"{rates.sent}; [reputation] pause_bounce_rate {settings.pause_bounce_rate:.2%})"
        )
    return None


async def evaluate(db: Executor, settings: Settings) -> list[str]:
    """One round: count, read the rates, pause whom they say; the names of the orgs paused."""
    reputation = settings.reputation
    await store.count(db, hard_categories=sorted(SUPPRESSING_CATEGORIES))
    await store.prune(db, keep=reputation.window + 7200)
    now = datetime.now(UTC)
    paused = []
    for rates in await store.rates(db, window=reputation.window):
        ORG_BOUNCE_RATE.labels(org=rates.org).set(rates.bounce_rate)
        ORG_COMPLAINT_RATE.labels(org=rates.org).set(rates.complaint_rate)
        reason = pause_reason(rates, reputation, now)
        if reason is not None and await store.pause(db, rates, reason, window=reputation.window):
            log.warning(
                "org %s paused: %s; `pigeon-mta org resume %s` ends it",
                rates.org,
                reason,
                rates.org,
            )
            paused.append(rates.org)
    return paused
