"""Packaging: the systemd unit verifies, the Containerfile's inputs exist and its entrypoint works.

No container engine runs on this machine, so the image is checked the way it is built: every path
it copies exists, and the command it runs works from a fresh virtual environment installed the way
the build stage installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO

CONTAINERFILE = REPO / "Containerfile"


def containerfile_copies() -> list[str]:
    sources: list[str] = []
    for line in CONTAINERFILE.read_text().splitlines():
        match = re.match(r"^\s*COPY\s+(?!--from)(.+)$", line)
        if match:
            parts = match.group(1).split()
            sources.extend(parts[:-1])
    return sources


def test_every_path_the_containerfile_copies_exists() -> None:
    sources = containerfile_copies()
    assert "pigeon_mta" in " ".join(sources)
    for source in sources:
        assert (REPO / source).exists(), f"Containerfile copies {source}, which does not exist"


def test_containerfile_is_non_root_with_healthcheck_and_ports() -> None:
    text = CONTAINERFILE.read_text()
    assert re.search(r"^USER pigeon-mta$", text, re.M)
    assert "HEALTHCHECK" in text and "/healthz" in text
    exposed = set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    assert {"25", "465", "587", "9187"} <= exposed
    assert text.count("FROM ") >= 2, "multi-stage build"


@pytest.mark.slow
def test_entrypoint_works_from_a_fresh_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO)]
    result = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    command = env_dir / "bin" / "pigeon-mta"
    assert command.exists()
    version = subprocess.run(
        [str(command), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and "pigeon-mta" in version.stdout
    check = subprocess.run(
        [str(command), "check-config", str(REPO / "deploy" / "pigeon.container.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PIGEON_")},
    )
    assert check.returncode == 0, check.stderr


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    assert shutil.which("systemd-analyze"), (
        "systemd-analyze is missing (scripts/test installs systemd)"
    )
    # The unit names the installed command (/opt/pigeon-mta/bin/pigeon-mta); verify checks that
    # executables exist, so point a copy at this interpreter and leave everything else as shipped.
    unit = (REPO / "systemd" / "pigeon-mta.service").read_text()
    assert "/opt/pigeon-mta/bin/pigeon-mta" in unit
    copy = tmp_path / "pigeon-mta.service"
    copy.write_text(unit.replace("/opt/pigeon-mta/bin/pigeon-mta", sys.executable))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for needed in (
        "User=pigeon-mta",
        "ExecStartPre=",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "RestrictAddressFamilies=",
        "SystemCallFilter=",
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP",
    ):
        assert needed in unit, needed


def test_sysusers_and_tmpfiles_snippets() -> None:
    sysusers = (REPO / "systemd" / "pigeon-mta.sysusers.conf").read_text()
    assert re.search(r"^u pigeon-mta ", sysusers, re.M)
    tmpfiles = (REPO / "systemd" / "pigeon-mta.tmpfiles.conf").read_text()
    assert re.search(r"^d /var/lib/pigeon-mta\s+0750 pigeon-mta", tmpfiles, re.M)
