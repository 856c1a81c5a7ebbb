"""Grafana and Prometheus for the learner's metrics (deploy/grafana/, deploy/prometheus/, the compose
profile ``observability``): the dashboard asks only for metrics and labels that the learner's
exporter really serves, and the provisioning files, the Prometheus scrape target and the compose
services agree with each other.

The Prometheus and Grafana images cannot be pulled on the test machines (no registry access), so
these tests check the files themselves against a real exporter; ``docker compose --profile
observability config`` runs in tests/deploy/test_compose.py where a compose client exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from oakemu_core.run.prometheus import PrometheusExporter
from tests.deploy.test_compose import container_port, load_compose
from tests.run.test_telemetry import make_snapshot, scrape

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "oakemu.json"
DATASOURCES = REPO_ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = (
    REPO_ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "oakemu.yml"
)
PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"

PROMQL_WORDS = {
    "rate",
    "irate",
    "increase",
    "sum",
    "avg",
    "min",
    "max",
    "by",
    "without",
    "on",
    "ignoring",
}
SELECTOR = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(?P<labels>[^}]*)\})?")
REQUIRED = {  # what the dashboard is for
    "SPS": "oakemu_sps_recent",
    "returns": "oakemu_episodic_return_mean",
    "evaluation": "oakemu_eval_return_mean",
    "lag": "oakemu_policy_lag",
    "actors": "oakemu_actors",
    "rejections": "oakemu_rejected_messages_total",
    "memory": "process_resident_memory_bytes",
}


@pytest.fixture(scope="module")
def served() -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it is served with, from a real exporter holding a full snapshot."""
    with PrometheusExporter(0, addr="127.0.0.1") as exporter:
        exporter.update(
            make_snapshot(
                eval_return_mean=30.0,
                eval_return_std=2.0,
                eval_length_mean=31.0,
                eval_policy_version=6,
                best_eval_return=35.0,
                trainable_share=1.0,
            )
        )
        families = scrape(exporter.port)
    samples: dict[str, list[dict[str, str]]] = {}
    for family in families.values():
        for name, labels in family:
            samples.setdefault(name, []).append(dict(labels))
    return samples


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The metric selectors of a PromQL expression: ``(name, {label: value})``; ranges, numbers and
    PromQL's own words are skipped."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations: [1m]
    found = []
    for match in SELECTOR.finditer(expr):
        name = match.group("name")
        if name in PROMQL_WORDS or expr[match.end() :].lstrip().startswith("("):
            continue
        labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', match.group("labels") or ""))
        found.append((name, labels))
    return found


def test_every_panel_asks_for_metrics_and_labels_the_exporter_serves(dashboard, served) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used: set[str] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["type"] in ("timeseries", "stat") and panel["targets"], panel["title"]
        for target in panel["targets"]:
            found = selectors(target["expr"])
            assert found, f"{panel['title']}: no metric in {target['expr']!r}"
            for name, labels in found:
                assert name in served, (
                    f"{panel['title']}: {name} is not served (expr {target['expr']!r})"
                )
                assert any(
                    labels.items() <= served_labels.items() for served_labels in served[name]
                ), f"{panel['title']}: {name}{labels} matches no served sample"
                for placeholder in re.findall(
                    r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")
                ):
                    assert any(placeholder in served_labels for served_labels in served[name]), (
                        f"{panel['title']}: legend {{{{{placeholder}}}}} is no label of {name}"
                    )
                used.add(name)
    missing = {topic: name for topic, name in REQUIRED.items() if name not in used}
    assert not missing, f"the dashboard shows nothing of {missing}"


def test_the_check_catches_a_metric_the_exporter_does_not_serve(served) -> None:
    assert [
        name for name, _ in selectors('rate(oakemu_sps_total[1m]) + oakemu_policy_lag{stat="p99"}')
    ] == ["oakemu_sps_total", "oakemu_policy_lag"]
    assert "oakemu_sps_total" not in served  # a gauge has no _total sample
    assert not any(
        {"stat": "p99"}.items() <= labels.items() for labels in served["oakemu_policy_lag"]
    )


def test_provisioning_prometheus_and_compose_agree(dashboard) -> None:
    compose = load_compose()
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["observability"]
    assert "build" not in prometheus and "build" not in grafana  # stock images, pinned by tag
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])

    mounts = {
        volume.split(":")[1]: volume.split(":")[0]
        for volume in [*prometheus["volumes"], *grafana["volumes"]]
    }
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert mounts[prometheus["command"][0].split("=", 1)[1]] == "./deploy/prometheus/prometheus.yml"
    [job] = config["scrape_configs"]
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "learner" and int(port) == 9100 in {
        container_port(p) for p in services["learner"]["ports"]
    }
    assert job.get("metrics_path", "/metrics") == "/metrics"

    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    datasources = yaml.safe_load(DATASOURCES.read_text())
    [source] = datasources["datasources"]
    assert datasources["apiVersion"] == 1 and source["type"] == "prometheus"
    assert source["url"] == f"http://prometheus:{container_port(prometheus['ports'][0])}"
    panel_sources = {json.dumps(p["datasource"], sort_keys=True) for p in dashboard["panels"]}
    panel_sources |= {
        json.dumps(t["datasource"], sort_keys=True)
        for p in dashboard["panels"]
        for t in p["targets"]
    }
    assert panel_sources == {
        json.dumps({"type": "prometheus", "uid": source["uid"]}, sort_keys=True)
    }

    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())
    [provider] = providers["providers"]
    assert providers["apiVersion"] == 1 and provider["type"] == "file"
    dashboards_dir = provider["options"]["path"]
    assert mounts[dashboards_dir] == "./deploy/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"
    for source_path in mounts.values():
        if source_path.startswith("./"):
            assert (REPO_ROOT / source_path).exists(), source_path
