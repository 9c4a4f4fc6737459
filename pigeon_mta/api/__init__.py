"""The HTTP API: applications send mail over HTTP with an API key of their org.

server.py serves it (every worker process, `[api] listen`); auth.py finds the key; compose.py
reads what a request asks to send (mime.py builds the JSON form's message); send.py takes it the way SMTP mail goes (policy.py: sender
policy and rate; envelope.py: what is queued; idempotency.py: the Idempotency-Key); problems.py
words every refusal; openapi.py describes it.
"""
