"""A test certificate authority (trustme): server contexts for sinks, a CA file for clients."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass
class TestCA:
    ca: trustme.CA
    ca_file: Path  # PEM, for `delivery.tls_ca_file`

    def server_context(self, *names: str) -> ssl.SSLContext:
        """A server context with a certificate for `names` (host names or IP addresses)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*names).configure_cert(context)
        return context


def make_ca(directory: Path) -> TestCA:
    ca = trustme.CA()
    path = directory / "test-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return TestCA(ca, path)
