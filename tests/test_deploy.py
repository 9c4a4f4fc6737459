"""deploy/: the alert rules, the scrape config and the dashboard are valid and use only our metrics;
the compose deployment trusts no bridge network and publishes nothing unauthenticated."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from pigeon_mta.config_loader import load_settings
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
                     "pigeon_outbound_connections_open", "pigeon_dkim_unsigned_total"):  # fmt: skip
        assert contract in used, f"the dashboard does not show {contract}"


def test_an_alert_fires_on_unsigned_mail() -> None:
    """Mail that leaves unsigned is otherwise only a counter (alerts_test.yml says when)."""
    assert "pigeon_dkim_unsigned_total" in metric_names(alert_rules_text())
    assert "alertname: PigeonMTAUnsignedMail" in (PROMETHEUS / "alerts_test.yml").read_text()


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


# ---------------------------------------------------------------- the compose deployment

COMPOSE = REPO / "deploy" / "compose.yaml"
CONTAINER_CONFIG = REPO / "deploy" / "pigeon.container.toml"
# Ports that answer without a password: published on the host's loopback, if at all.
UNAUTHENTICATED_PORTS = {"9187": "pigeon metrics", "9090": "Prometheus"}


def compose_services() -> dict[str, list[str]]:
    """Each service of compose.yaml with the lines of its block (the file is ours and plainly
    indented: services at two spaces, their keys at four)."""
    services: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_services = False
    for line in COMPOSE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            in_services = line.startswith("services:")
            current = None
        elif in_services and re.match(r"^  [a-z][\w-]*:\s*$", line):
            current = services.setdefault(line.strip().rstrip(":"), [])
        elif in_services and current is not None:
            current.append(line)
    return services


def published_ports(service: str) -> list[str]:
    lines = compose_services()[service]
    ports: list[str] = []
    collecting = False
    for line in lines:
        if re.match(r"^    \S", line):
            collecting = line.strip() == "ports:"
        elif collecting:
            ports.append(line.strip().lstrip("-").strip().strip("\"'"))
    return ports


def test_the_container_config_trusts_only_loopback() -> None:
    """Published ports reach the container from a bridge address (rootless podman's forwarder,
    Docker's userland proxy): a trusted bridge network would make every Internet client trusted."""
    settings = load_settings(CONTAINER_CONFIG, env={})
    networks = [ipaddress.ip_network(n) for n in settings.relay.trusted_networks]
    assert networks and all(n.is_loopback for n in networks), networks


def test_prometheus_in_compose_scrapes_the_pigeon_service() -> None:
    """Inside the Prometheus container 127.0.0.1 is Prometheus itself."""
    text = (PROMETHEUS / "prometheus.yml").read_text()
    targets = re.findall(r"^\s*-\s*([\w.-]+:\d+)\s*$", text, re.M)
    metrics_port = load_settings(CONTAINER_CONFIG, env={}).metrics.listen.port
    assert targets == [f"pigeon:{metrics_port}"]
    assert "pigeon" in compose_services()


def test_grafana_in_compose_takes_its_admin_password_from_the_environment() -> None:
    lines = "\n".join(compose_services()["grafana"])
    match = re.search(r"GF_SECURITY_ADMIN_PASSWORD:\s*(.+)$", lines, re.M)
    assert match, "Grafana would start with admin/admin"
    # ${VAR:?message}: compose refuses to start without it; ${VAR:-x} would be a default.
    assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", match.group(1).strip()), match.group(1)


def test_compose_publishes_ports_without_a_password_on_loopback_only() -> None:
    for service in compose_services():
        for port in published_ports(service):
            container_port = port.rsplit(":", 1)[-1]
            if container_port in UNAUTHENTICATED_PORTS:
                assert port.startswith("127.0.0.1:"), (
                    f"{UNAUTHENTICATED_PORTS[container_port]} ({service}) is published as {port}"
                )
    assert any(p.endswith(":9187") for p in published_ports("pigeon"))
