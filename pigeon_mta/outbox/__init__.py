"""Outboxes: tables in applications' databases that pigeon-mta relays into its queue."""
