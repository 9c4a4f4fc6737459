"""Run the real `pigeon-mta serve` as a child process, watch its log, stop it by its PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.conftest import REPO, free_port, pigeon_command

# Every serve started by a test, so that the session can kill what a test left behind (a test
# that hit its timeout may never reach its own cleanup).
STARTED: list[ServeProcess] = []


def kill_leftovers() -> int:
    """Kill every serve process a test started and did not stop; returns how many."""
    killed = 0
    for serve in STARTED:
        if serve.proc.poll() is None:
            serve.kill()
            killed += 1
    STARTED.clear()
    return killed


class ServeProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()
    ) -> None:
        full_env = {**os.environ, **(env or {})}
        for name in drop_env:
            full_env.pop(name, None)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("PIGEON_LOG_LEVEL", "info")
        self.proc = subprocess.Popen(
            pigeon_command("serve", *args),
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        STARTED.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for line in self.lines:
                    if text in line:
                        return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} did not appear; serve output:\n{self.output}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise AssertionError(f"serve did not stop within {timeout}s:\n{self.output}") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        """SIGKILL the supervisor and its worker processes (which would outlive it otherwise)."""
        if self.proc.poll() is None:
            tree = descendants(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (from /proc/<pid>/task/*/children)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with (
                    contextlib.suppress(OSError),
                    open(f"/proc/{current}/task/{task}/children") as handle,
                ):
                    for child in handle.read().split():
                        found.append(int(child))
                        todo.append(int(child))
    return found


def write_config(directory: Path, text: str) -> Path:
    """`text` as `directory`/pigeon.toml. A config without an [api] table gets an API port of its
    own: the default 127.0.0.1:8025 is one port for every serve on the host, and a serve whose
    port another process listens on is refused (pigeon_mta/ports.py)."""
    if "[api]" not in text:
        # A dotted key first: the text's last table stays last, for tests that append to it.
        text = f'api.listen = "127.0.0.1:{free_port()}"\n' + text
    path = directory / "pigeon.toml"
    path.write_text(text)
    return path
