"""Real peers that tests run on loopback: an authoritative DNS server, SMTP sinks, a test CA."""
