"""The outbound side: claim queued recipients and deliver them over SMTP (see engine.py)."""
