"""The site controller (pigeon_mta/site_control.py): state in, state out, at a given time."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from pigeon_mta import site_control
from pigeon_mta.site_control import Report, SiteControl

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
QUIET = 30.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def throttled(c: SiteControl, holder: str, rate: float, sessions: int, t: float) -> SiteControl:
    report = Report(holder, rate, sessions, "421 4.7.0 slow down")
    return site_control.throttled(c, report, at(t), factor=0.5, hold=1.0)


def recovered(c: SiteControl, t: float, *, waiting: bool = False) -> SiteControl:
    return site_control.recovered(c, at(t), step=0.25, quiet=QUIET, waiting=waiting)


def test_an_unconfigured_site_decreases_from_what_the_cluster_sent_and_is_capped_there() -> None:
    c = throttled(SiteControl(), "n1", 80, 12, 0)
    c = throttled(c, "n2", 40, 4, 0.5)  # within the hold: adds its own once
    c = throttled(c, "n2", 40, 4, 0.6)
    assert (c.effective_rate, c.effective_concurrency, c.backoff) == (60, 8, True)
    assert (c.recover_rate, c.recover_concurrency) == (120, 16)
    assert recovered(c, 20) == c  # not a quiet period yet
    c = recovered(c, 0.6 + 2 * QUIET + 1)  # two periods: +2 x 25% of the target
    assert (c.effective_rate, c.effective_concurrency, c.backoff) == (120, 16, False)
    assert c.capped  # never "unlimited" again


def test_a_configured_site_recovers_to_its_configuration() -> None:
    c = SiteControl(rate=50, concurrency=10, effective_rate=50, effective_concurrency=10)
    c = throttled(c, "n1", 200, 30, 0)  # in force: 50/s, so from 50, whatever was reported
    assert (c.effective_rate, c.effective_concurrency) == (25, 5)
    c = recovered(c, 4 * QUIET + 1)
    assert (c.effective_rate, c.effective_concurrency, c.backoff, c.capped) == (
        50,
        10,
        False,
        False,
    )


def test_the_capped_probe_goes_up_only_while_mail_waits() -> None:
    c = SiteControl(
        effective_rate=40,
        effective_concurrency=4,
        recover_rate=40,
        recover_concurrency=4,
        capped=True,
        changed_at=T0,
    )
    assert recovered(c, 2 * QUIET + 1) == c
    probed = recovered(c, 2 * QUIET + 1, waiting=True)
    assert (probed.effective_rate, probed.effective_concurrency) == (50, 5)
    assert (probed.recover_rate, probed.recover_concurrency) == (50, 5)
    assert recovered(probed, 2 * QUIET + 2, waiting=True) == probed  # not before two periods


def test_under_a_rules_limit_reports_never_raise_and_the_limit_is_not_the_target() -> None:
    capped = SiteControl(
        effective_rate=80,
        effective_concurrency=12,
        recover_rate=80,
        recover_concurrency=12,
        capped=True,
        changed_at=T0,
    )
    c = site_control.limited(capped, 1, 1, 600, "rule", at(1))
    assert (c.effective_rate, c.effective_concurrency, c.backoff) == (1, 1, True)
    c = throttled(c, "n1", 1, 1, 2)
    c = throttled(c, "n2", 50, 9, 2.5)  # within the hold: adds, but never above the limit
    assert (c.effective_rate, c.effective_concurrency) == (1, 1)
    assert (c.recover_rate, c.recover_concurrency) == (80, 12)
    assert recovered(c, 500) == c  # the limit lasts
    c = recovered(c, 601 + 4 * QUIET + 1)
    assert (c.effective_rate, c.effective_concurrency, c.backoff) == (80, 12, False)
    # A site that never throttled us ends without limits.
    fresh = site_control.limited(SiteControl(), 5, 2, 60, "rule", T0)
    fresh = throttled(fresh, "n1", 5, 2, 1)
    fresh = recovered(fresh, 61 + 4 * QUIET + 1)
    assert (fresh.effective_rate, fresh.effective_concurrency) == (0, 0)
    assert not fresh.backoff and not fresh.capped


def test_a_report_after_the_hold_is_a_new_decrease_from_the_rate_in_force() -> None:
    c = throttled(SiteControl(), "n1", 80, 12, 0)  # 40
    c = recovered(c, QUIET + 1)  # one step: 40 + 20 = 60, still in backoff
    assert c.backoff and c.effective_rate == 60
    c = throttled(c, "n2", 60, 9, QUIET + 1.5)
    assert c.effective_rate == 30 and c.reporters == ("n2",)


def test_whatever_arrives_the_values_stay_sane() -> None:
    """Random reports, limits and recoveries over an hour: never a negative or fractional
    session count, never a rate below 1 in backoff, never above the configuration."""
    rng = random.Random(7)
    configured_site = SiteControl(
        rate=100, concurrency=20, effective_rate=100, effective_concurrency=20
    )
    for configured in (SiteControl(), configured_site):
        c = configured
        t = 0.0
        for _ in range(2000):
            t += rng.choice((0.01, 0.3, 5.0, 40.0))
            pick = rng.random()
            if pick < 0.4:
                c = throttled(c, f"n{rng.randrange(3)}", rng.uniform(0, 300), rng.randrange(40), t)
            elif pick < 0.5:
                c = site_control.limited(c, rng.choice((0, 2)), rng.choice((0, 1)), 60, "r", at(t))
            else:
                c = recovered(c, t, waiting=rng.random() < 0.5)
            assert c.effective_concurrency >= 0 and isinstance(c.effective_concurrency, int)
            if c.backoff:
                assert c.effective_rate >= 1 or c.effective_rate == 0
            if configured.rate:
                assert 0 < c.effective_rate <= configured.rate
                assert 0 < c.effective_concurrency <= configured.concurrency
