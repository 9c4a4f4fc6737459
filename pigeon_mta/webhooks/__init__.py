"""Webhooks: events about an org's mail, POSTed to its endpoints, signed as Standard Webhooks says."""
