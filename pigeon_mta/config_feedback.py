"""`[bounces]` and `[reputation]`: what pigeon-mta tells senders of mail that failed, where
failures that arrive later come back to (return paths, the feedback listener, feedback/), and
when an org's bounces and complaints pause it (reputation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pigeon_mta.config_values import Duration


@dataclass(frozen=True)
class BounceSettings:
    # Send the sender a warning (a DSN with Action: delayed) once a recipient has waited this long
    # without being delivered; 0 sends none.
    delay_warning_after: Duration = Duration(0)
    # How long a hard bounce (invalid recipient, bad domain) keeps an address on its org's
    # suppression list; 0 keeps it until removed with `pigeon-mta suppress remove`.
    suppress_for: Duration = Duration(0)
    # The return-path domain of every sender domain that names none (`domain set DOMAIN
    # --return-path`): mail leaves with the envelope sender b-TOKEN@THIS, one per recipient, so
    # that bounces arriving later and complaints come back to a `feedback` listener. "": the
    # sender's own address.
    return_path_domain: str = ""
    # Addresses a `feedback` listener takes complaint reports (ARF) for, besides the return-path
    # domains: the addresses registered with the providers' feedback loops.
    complaint_addresses: tuple[str, ...] = ()
    # How long a retired VERP key still verifies the tokens it signed (`feedback rotate-key`):
    # reports arrive days after the mail, complaints weeks.
    feedback_max_age: Duration = Duration(30 * 86400)
    # Tell the original envelope sender of a recipient that a report bounced after delivery,
    # with a DSN of pigeon's own (RFC 3464), as for a synchronous bounce: for applications that
    # read DSNs rather than webhooks. Off: the `bounced` webhook event and the log tell.
    forward_to_sender: bool = False


@dataclass(frozen=True)
class ReputationSettings:
    # The rolling window the rates are taken over (counted per hour: up to an hour more).
    window: Duration = Duration(86400)
    # An org whose hard bounces (at once or reported later) reach this share of its sent mail
    # over the window is paused: its mail stays queued, not attempted, until `org resume`.
    # 0 never pauses for bounces.
    pause_bounce_rate: float = 0.10
    # The same for complaints (feedback-loop reports); the providers' published limit is 0.3%
    # to 0.5%. 0 never pauses for complaints.
    pause_complaint_rate: float = 0.005
    # Fewer recipients sent over the window never pause an org (a few bounces of little mail
    # say nothing).
    min_volume: int = 200
