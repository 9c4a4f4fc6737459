"""Clients for the observability tests: Prometheus's `promtool` and a plain HTTP client."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request

import pytest


def promtool() -> str:
    """The path of promtool (Debian package `prometheus`, installed by scripts/test)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (scripts/test does)")
    return path


def http(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One request to 127.0.0.1:port (never through a proxy): status, headers, body."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()
