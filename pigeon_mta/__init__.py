"""pigeon-mta: an SMTP relay that queues in PostgreSQL and never loses an accepted message."""

__version__ = "0.1.0"
