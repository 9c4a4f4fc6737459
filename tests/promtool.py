"""Prometheus's own checker, `promtool` (Debian package `prometheus`, installed by .ci/run)."""

from __future__ import annotations

import shutil

import pytest


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    return path
