"""The SMTP door: listeners, TLS, AUTH, relay, the limits of a connection, and the hand-over of
each message to the intake (pigeon_mta/intake/).

The service lives in `pigeon_mta.submission.service` (not imported here, so that admin commands
that only need the reply texts do not load aiosmtpd).
"""
