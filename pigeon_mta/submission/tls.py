"""Listener TLS: server contexts from the configured files, reloading, and a self-signed fallback.

A reload (SIGHUP) builds a new context from the files and swaps it in for new connections;
connections already open keep the one they started with. Implicit-TLS servers are created with
a fixed "front" context whose SNI callback (called for every handshake, with or without SNI)
hands each connection the current one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import logging
import os
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pigeon_mta.config import ListenerSettings, Settings

log = logging.getLogger(__name__)

SELF_SIGNED_NAME = "selfsigned.pem"  # key and certificate in one file: replaced atomically
# From notBefore to notAfter: 397 days, the most that browsers and many TLS clients accept for a
# server certificate (CA/Browser Forum Baseline Requirements 6.3.2, 398 days); one that is expired
# or within _RENEW_BEFORE of expiring is made again when a worker starts.
_SELF_SIGNED_VALIDITY = dt.timedelta(days=397)
_BACKDATE = dt.timedelta(days=1)  # for clocks running a little behind
_RENEW_BEFORE = dt.timedelta(days=30)


def server_context(cert_file: str, key_file: str | None) -> ssl.SSLContext:
    """A server context: TLS 1.2 or later, no client certificates asked."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


class ListenerTLS:
    """The certificate of one listener, reloadable."""

    def __init__(self, listener: str, cert_file: str, key_file: str | None) -> None:
        self.listener = listener
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = server_context(cert_file, key_file)
        self._front: ssl.SSLContext | None = None

    def reload(self) -> bool:
        """Load the files again; on failure keep the current certificate and say why."""
        try:
            self.context = server_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            log.error(
                "listener %s: cannot reload TLS certificate %s: %s; keeping the current one",
                self.listener,
                self.cert_file,
                exc,
            )
            return False
        log.info("listener %s: TLS certificate reloaded from %s", self.listener, self.cert_file)
        return True

    def front_context(self) -> ssl.SSLContext:
        """The context to create an implicit-TLS server with; it serves the current certificate."""
        if self._front is None:
            front = server_context(self.cert_file, self.key_file)

            def use_current(sslobj: ssl.SSLObject, _name: str | None, _ctx: object) -> None:
                sslobj.context = self.context

            front.sni_callback = use_current
            self._front = front
        return self._front


def listener_tls(settings: Settings, listener: ListenerSettings) -> ListenerTLS:
    """The listener's configured certificate, else the node's self-signed one. (`serve` warns
    about the listeners without a certificate once, at start: config_review.)"""
    if listener.tls_cert:
        return ListenerTLS(listener.name, listener.tls_cert, listener.tls_key or None)
    return ListenerTLS(listener.name, str(ensure_self_signed(settings)), None)


def self_signed_path(settings: Settings) -> Path:
    return Path(settings.server.data_dir).expanduser() / "tls" / SELF_SIGNED_NAME


def ensure_self_signed(settings: Settings) -> Path:
    """The self-signed certificate in data_dir/tls, made (or renewed) if needed.

    Safe when several processes start at once: they take turns under a file lock, and the file
    is replaced atomically, so nobody reads a half-written one.
    """
    path = self_signed_path(settings)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    hostname = settings.server.hostname
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _still_good(path, hostname):
                _write_atomically(path, _make_self_signed(hostname))
                log.warning("generated a self-signed TLS certificate for %s in %s", hostname, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _still_good(path: Path, hostname: str) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    if cert.not_valid_after_utc - _RENEW_BEFORE < dt.datetime.now(dt.UTC):
        return False
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return hostname.lower() in (n.lower() for n in names.get_values_for_type(x509.DNSName))


def _make_self_signed(hostname: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname[:64])])
    now = dt.datetime.now(dt.UTC)
    alt_names: list[x509.GeneralName] = [x509.DNSName(hostname)]
    if hostname != "localhost":
        alt_names.append(x509.DNSName("localhost"))
    alt_names += [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now - _BACKDATE + _SELF_SIGNED_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem + cert.public_bytes(serialization.Encoding.PEM)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, temp = tempfile.mkstemp(prefix=".selfsigned-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)  # it holds the private key
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
