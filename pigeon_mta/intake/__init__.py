"""The one way mail enters the queue, whichever door it came through (an SMTP listener, the HTTP
API): `accept.Intake`. The doors hand it a `submission.Submission` and word its `refusal.Refusal`s
in their protocol; nothing here knows SMTP replies or HTTP problems.
"""
