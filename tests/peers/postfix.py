"""A private Postfix instance (Debian package `postfix`) used as a smarthost client in tests.

    sendmail -C DIR ──► pickup ─► cleanup ─► qmgr ─► smtp ──STARTTLS+AUTH──► relayhost

Everything lives in one directory made for the test: main.cf and master.cf (`postfix -c DIR`), the
queue and data directories, the SASL password map and the mail log. Postfix listens on no network
port (no smtpd in master.cf: mail comes in through `sendmail`), so instances of several tests never
meet, and the system's own Postfix (if any) is not touched. Daemons run unchrooted, because the
chroot would need copies of the CA file and the map inside the queue directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Only the services a relaying client needs, none listening on the network; chroot "n" everywhere.
MASTER_CF = """\
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
tlsmgr    unix  -       -       n       1000?   1       tlsmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""


def postfix_tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install postfix (scripts/test does)")
    return path


@dataclass
class PostfixClient:
    """A running private Postfix; `config_dir` is what `-c`/`-C` take."""

    root: Path
    config_dir: Path
    queue_dir: Path
    log_file: Path

    def sendmail(self, sender: str, recipients: list[str], message: bytes) -> None:
        """Inject a message the way a local program does (Postfix's sendmail, -f sets the sender)."""
        result = subprocess.run(
            [postfix_tool("sendmail"), "-C", str(self.config_dir), "-i", "-f", sender, *recipients],
            input=message,
            capture_output=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr.decode(errors="replace")

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def master_pid(self) -> int | None:
        try:
            return int((self.queue_dir / "pid" / "master.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        pid = self.master_pid()
        subprocess.run(
            [postfix_tool("postfix"), "-c", str(self.config_dir), "stop"],
            capture_output=True,
            timeout=60,
        )
        if pid is not None:
            # `postfix stop` signals the master and returns; wait for it, kill it if it lingers.
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours would still answer; the master is not our child (postfix daemonizes).
    return True


def start_postfix(settings: dict[str, str], *, smtpd: str | None = None) -> PostfixClient:
    """Write main.cf (Postfix defaults plus `settings`) and master.cf into a fresh directory and
    start the instance. Needs root (the daemons drop to the `postfix` user). `smtpd`: an address
    ("127.0.0.1:2526") Postfix's SMTP server listens on, for an instance that plays a
    destination's MX (`start_postfix_mx`); none by default."""
    # Not under pytest's tmp_path: that is 0700 root, and the unprivileged daemons must reach
    # their queue. mkdtemp gives a private name; the tree is opened to the `postfix` user only.
    root = Path(tempfile.mkdtemp(prefix="pigeon-postfix-"))
    root.chmod(0o755)
    config_dir, queue_dir, data_dir = root / "etc", root / "queue", root / "data"
    for directory in (config_dir, queue_dir, data_dir):
        directory.mkdir(mode=0o755)
    shutil.chown(data_dir, "postfix", "postfix")  # postfix keeps its TLS session cache here
    log_file = root / "postfix.log"
    main = {
        "compatibility_level": "3.6",
        "queue_directory": str(queue_dir),
        "data_directory": str(data_dir),
        # Logging to a file needs the postlog service and an allowed prefix; there is no syslog.
        "maillog_file": str(log_file),
        "maillog_file_prefixes": str(root),
        "myhostname": "client.test",
        "mydomain": "test",
        "myorigin": "$myhostname",
        "inet_interfaces": "loopback-only",
        "inet_protocols": "ipv4",
        "mydestination": "",
        "local_recipient_maps": "",
        "local_transport": "error:no local delivery",
        "alias_maps": "",
        "alias_database": "",
        # One instance of many on this machine: no shared state with the system's own Postfix.
        "multi_instance_enable": "no",
        **settings,
    }
    (config_dir / "main.cf").write_text("".join(f"{k} = {v}\n" for k, v in main.items()))
    master = MASTER_CF
    if smtpd is not None:
        master += f"{smtpd}  inet  n       -       n       -       -       smtpd\n"
        master += "local     unix  -       n       n       -       -       local\n"
    (config_dir / "master.cf").write_text(master)
    client = PostfixClient(root, config_dir, queue_dir, log_file)
    result = subprocess.run(
        [postfix_tool("postfix"), "-c", str(config_dir), "start"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        # A fatal error before the log service runs goes only to syslog (or a terminal).
        log = client.log()
        client.stop()
        raise AssertionError(f"postfix did not start:\n{result.stdout}{result.stderr}{log}")
    return client


def start_postfix_mx(
    address: str, *, domain: str, known: list[str], bounces_to: str
) -> PostfixClient:
    """A Postfix that plays `domain`'s MX as corporate gateways do: it takes every recipient of
    the domain at RCPT (no recipient check: empty local_recipient_maps), delivers the `known`
    ones (discarded), and hands the others to local(8), which finds no such user (no alias, no
    account: pick names this machine has no account of) and bounces them, with a DSN of its own
    (RFC 3464) sent to the message's envelope sender through `bounces_to` ("[127.0.0.1]:port")."""
    known_map = ", ".join(f"{a}=discard:" for a in known)
    return start_postfix(
        {
            "myhostname": f"mx.{domain}",
            "mydomain": domain,
            "myorigin": "$myhostname",
            "mydestination": domain,
            "mynetworks": "127.0.0.0/8",
            "local_recipient_maps": "",
            "transport_maps": f"inline:{{{known_map}}}" if known else "",
            "local_transport": "local",
            "alias_maps": "",
            "alias_database": "",
            "mailbox_command": "",
            "relayhost": bounces_to,
            "smtputf8_enable": "no",
            "smtpd_tls_security_level": "none",
            "smtp_tls_security_level": "none",
        },
        smtpd=address,
    )
