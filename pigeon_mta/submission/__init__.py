"""The SMTP front door: listeners, TLS, AUTH, relay and sender policy, limits, and the enqueue."""

from pigeon_mta.submission.service import SubmissionService

__all__ = ["SubmissionService"]
