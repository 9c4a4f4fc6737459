"""The suspensions in force as this process knows them: an operator's (`queue suspend`) and those
replies asked for (a stated retry delay holds a site for one org; a reply rule suspends a site
for one org or for all, outbound/shaping.py). Read from the database with the budgets every
second (outbound/budgets.py); one this process asks for holds here at once, before that read."""

from __future__ import annotations

from pigeon_mta.model import Delivery
from pigeon_mta.outbound.limits import DestinationPolicy
from pigeon_mta.outbound.throttling import ThrottlingReports
from pigeon_mta.store.suspensions import DOMAIN, LANE, ORG, hold_key


class Suspended:
    def __init__(self, throttling: ThrottlingReports) -> None:
        self.throttling = throttling
        self.notes: dict[str, str] = {}  # key: what the mail it holds says (its log)

    def find(self, delivery: Delivery, policy: DestinationPolicy) -> tuple[str | None, str] | None:
        """The suspension that holds this delivery, if any: the queue it waits in (a site's, a
        domain's or a hold's; None: its own, which the claims pass over while the suspension
        lasts) and its note."""
        if not self.notes:
            return None
        site = policy.budget_key
        hold = hold_key(site, delivery.org_id)
        for key, queue in (
            (site, site),
            (DOMAIN + delivery.domain.lower(), DOMAIN + delivery.domain.lower()),
            (ORG + str(delivery.org_id), None),
            (LANE + delivery.lane, None),
            (hold, hold),
        ):
            note = self.notes.get(key)
            if note is not None:
                return queue, note
        return None

    def hold(self, key: str, seconds: float, reason: str) -> None:
        """Suspend `key` for the cluster for `seconds` (kind 'reply'), and in this process at
        once."""
        self.throttling.hold(key, seconds, reason)
        if key not in self.notes:
            kind = "held for its org" if "|" in key else "suspended after a reply"
            note = f"{kind}: {reason}"
            self.notes = self.notes | {key: note + "; not attempted meanwhile"}
