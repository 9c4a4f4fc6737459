"""A test certificate authority (trustme): server contexts for sinks, a CA file for clients."""

from __future__ import annotations

import ssl
import warnings
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

    def legacy_server_context(self, version: ssl.TLSVersion, *names: str) -> ssl.SSLContext:
        """A server context that speaks only `version` (TLS 1.0 or 1.1), as old MX hosts do.
        This OpenSSL serves them only at security level 0 (their suites use SHA-1)."""
        context = self.server_context(*names)
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            context.minimum_version = version
            context.maximum_version = version
        return context


def make_ca(directory: Path) -> TestCA:
    ca = trustme.CA()
    path = directory / "test-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return TestCA(ca, path)
