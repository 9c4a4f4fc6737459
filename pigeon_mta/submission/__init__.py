"""The SMTP front door: listeners, TLS, AUTH, relay and sender policy, limits, and the enqueue.

The service lives in `pigeon_mta.submission.service` (not imported here, so that admin commands
that only need the address rules do not load aiosmtpd).
"""
