"""deploy/: the alert rules, the scrape config and the dashboard are valid and use only our metrics."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from pigeon_mta.observability.exposition import MetricsExposition
from tests.conftest import REPO
from tests.observe_helpers import promtool

PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "pigeon-mta.json"


def run_promtool(*args: str) -> None:
    result = subprocess.run(
        [promtool(), *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_are_valid_and_fire_when_they_should() -> None:
    run_promtool("check", "rules", "alerts.yml")
    run_promtool("test", "rules", "alerts_test.yml")


def test_the_scrape_config_is_valid() -> None:
    run_promtool("check", "config", "prometheus.yml")


def exported_series_names() -> set[str]:
    text = MetricsExposition(None).render().decode()
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}_{suffix}" for suffix in ("bucket", "sum", "count"))
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:pigeon|process)_[a-z_]+)\b", expr))


def dashboard_exprs() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def alert_rules_text() -> str:
    """The rules file without comments (promtool parses the expressions themselves)."""
    text = (PROMETHEUS / "alerts.yml").read_text()
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_dashboard_and_alerts_use_only_metrics_pigeon_exports() -> None:
    exported = exported_series_names()
    for expr in [*dashboard_exprs(), alert_rules_text()]:
        unknown = metric_names(expr) - exported
        assert not unknown, f"{expr!r} uses metrics nobody exports: {unknown}"
    used = {n for e in dashboard_exprs() for n in metric_names(e)}
    for contract in ("pigeon_messages_accepted_total", "pigeon_deliveries_total",
                     "pigeon_queue_recipients", "pigeon_queue_oldest_age_seconds",
                     "pigeon_delivery_attempt_seconds_bucket",
                     "pigeon_accept_to_delivery_seconds_bucket",
                     "pigeon_outbound_connections_open"):  # fmt: skip
        assert contract in used, f"the dashboard does not show {contract}"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel query (Grafana's variables replaced by plain values)."""
    exprs = dashboard_exprs()
    assert exprs
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": _plain(expr)}
                    for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    (tmp_path / "dashboard-rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(
        [promtool(), "check", "rules", str(tmp_path / "dashboard-rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _plain(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$job", ".*").replace("$instance", ".*")
