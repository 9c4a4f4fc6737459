"""What `/metrics` says: the metrics of every process of this node, added up, plus process metrics.

With one process, everything is in that process's registry. With several, each worker process
writes its values to files in a directory private to this `serve` run: prometheus_client's
multiprocess mode, which it chooses from PROMETHEUS_MULTIPROC_DIR when it is imported. The workers
are spawned (fresh interpreters), so they import it after the supervisor has set the variable; the
supervisor itself imported it before, and keeps its own values in memory. A scrape reads the
workers' files (counters and histograms summed over every worker that ever ran in this run, live
gauges over the live ones) and adds the supervisor's values, except for the queue gauges, which
only the supervisor sets.

Process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`, ...) carry a
`process` label ("supervisor", "worker-0", ...) when there are several processes, so that `sum()`
gives the node's total.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import prometheus_client
from prometheus_client import values as prometheus_values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.process_collector import ProcessCollector

from pigeon_mta import metrics
from pigeon_mta.plain import is_digits

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

# A `_created` sample per series doubles the output and means nothing once processes are summed.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def family_name(collector: Any) -> str:
    """The family name a metric object is exported under ("pigeon_deliveries" for a counter)."""
    return str(collector.describe()[0].name)


# Set by the supervisor from its queue stats query; the workers' copies are never set.
SUPERVISOR_OWNED = frozenset(
    family_name(m)
    for m in (
        metrics.QUEUE_RECIPIENTS,
        metrics.QUEUE_OLDEST_AGE,
        metrics.QUEUE_DUE_RECIPIENTS,
        metrics.WEBHOOK_BACKLOG,
    )
)


class MultiprocessSetupError(Exception):
    """The environment already chose a multiprocess directory; we need our own."""


DIR_PREFIX = "pigeon-mta-metrics-"


def remove_stale_directories(parent: Path | None = None) -> list[Path]:
    """Remove the metrics directories of supervisors that are gone without cleaning up (killed,
    out of memory): each is named after its supervisor's PID. Only this user's, and only where
    no process has that PID now; returns what it removed."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(f"{DIR_PREFIX}*-*"):
        pid_text = path.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if not is_digits(pid_text) or not path.is_dir():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue  # alive under another user, or unreadable: not ours to judge
    return removed


class MetricsExposition:
    """The node's metrics as one Prometheus exposition; knows the worker processes."""

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        self._processes: dict[int, tuple[str, ProcessCollector]] = {}
        if multiprocess_dir is not None:
            self._processes[os.getpid()] = ("supervisor", _process_collector(os.getpid()))

    @classmethod
    def for_processes(cls, count: int) -> MetricsExposition:
        """Set up for `count` worker processes; call before the first worker is started."""
        if count <= 1:
            return cls(None)
        if prometheus_values.ValueClass is not prometheus_values.MutexValue:
            # This process would write its own values into files too, and be counted twice.
            raise MultiprocessSetupError(
                f"unset {ENV_MULTIPROC_DIR}: pigeon-mta makes its own multiprocess metrics "
                "directory for each run"
            )
        remove_stale_directories()
        path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        os.environ[ENV_MULTIPROC_DIR] = str(path)
        return cls(path)

    def close(self) -> None:
        if self.multiprocess_dir is not None:
            os.environ.pop(ENV_MULTIPROC_DIR, None)
            shutil.rmtree(self.multiprocess_dir, ignore_errors=True)

    # ------------------------------------------------------------ worker processes

    def worker_started(self, index: int, pid: int) -> None:
        if self.multiprocess_dir is not None:
            self._processes[pid] = (f"worker-{index}", _process_collector(pid))

    def worker_exited(self, pid: int) -> None:
        """A worker is gone: its live gauges stop counting (its counters keep counting)."""
        if self.multiprocess_dir is not None:
            mark_process_dead(pid, str(self.multiprocess_dir))  # type: ignore[no-untyped-call]
            self._processes.pop(pid, None)

    # ------------------------------------------------------------ output

    def collect(self) -> list[Metric]:
        """Every metric family of the node, added up over its processes."""
        if self.multiprocess_dir is None:
            return list(prometheus_client.REGISTRY.collect())
        collector = MultiProcessCollector(None, path=str(self.multiprocess_dir))  # type: ignore[no-untyped-call]
        workers = {f.name: f for f in collector.collect()}  # type: ignore[no-untyped-call]
        families: list[Metric] = []
        for family in prometheus_client.REGISTRY.collect():
            if family.name.startswith("process_"):
                continue  # replaced by the per-process families below
            theirs = workers.pop(family.name, None)
            if theirs is None or family.name in SUPERVISOR_OWNED:
                families.append(family)
            else:
                families.append(_added(theirs, family))
        families.extend(workers.values())
        families.extend(self._process_families())
        return families

    def render(self) -> bytes:
        """The text exposition format (version 0.0.4)."""
        return bytes(prometheus_client.generate_latest(_Snapshot(self.collect())))

    def sample_values(self, *names: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """The samples of the families `names`, keyed by their sorted labels (for health checks)."""
        return {
            family.name: {tuple(sorted(s.labels.items())): float(s.value) for s in family.samples}
            for family in self.collect()
            if family.name in names
        }

    def _process_families(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for label, collector in list(self._processes.values()):
            for family in collector.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type
                    )
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "process": label}, sample.value)
        return list(merged.values())


class _Snapshot:
    """A collected list of families, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _process_collector(pid: int) -> ProcessCollector:
    return ProcessCollector(pid=lambda: pid, registry=None)


def _added(workers: Metric, supervisor: Metric) -> Metric:
    """The workers' family with the supervisor's samples added (counters, histograms, sums)."""
    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in [*workers.samples, *supervisor.samples]:
        if sample.name.endswith("_created"):
            continue
        key = (sample.name, tuple(sorted(sample.labels.items())))
        total[key] = total.get(key, 0.0) + float(sample.value)
    out = Metric(workers.name, workers.documentation or supervisor.documentation, workers.type)
    for (name, labels), value in total.items():
        out.add_sample(name, dict(labels), value)
    return out
