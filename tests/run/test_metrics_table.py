"""The metrics table (oakemu_core.run.metrics_table): every sink keeps the names users see, a row
added to the table shows in every sink, and the table's own rules (unique names, formats)."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest

from oakemu_core.run import metrics_table
from oakemu_core.run.metrics_table import (
    FAMILIES,
    METRICS,
    SECTIONS,
    Metric,
    MonitorLine,
    format_line,
    record,
    snapshot_values,
)
from tests.run import metric_sinks


def test_every_sink_keeps_the_names_it_showed_before_the_table() -> None:
    """TensorBoard / metrics.jsonl / tracker keys, snapshot fields (the monitor's --json keys),
    Prometheus names, HELP and types, and the monitor's view, as recorded from the writers that
    existed before the table (tests/run/metric_names.json)."""
    golden = json.loads(metric_sinks.GOLDEN.read_text())
    now = json.loads(json.dumps(metric_sinks.capture()))
    assert set(now) == set(golden)
    for sink, expected in golden.items():
        assert now[sink] == expected, sink


ADDED_ROW = """
import json
from oakemu_core.run import metrics_table as table

table.METRICS = (
    *table.METRICS,
    table.Metric(
        "stats.grad_norm",
        "Gradient norm of the last update",
        tag="losses/grad_norm",
        snapshot="grad_norm",
        prometheus="oakemu_grad_norm",
        monitor=table.MonitorLine(table.LAST_UPDATE, "grad norm", "{grad_norm:.3f}"),
    ),
)
from oakemu_core.run.telemetry import TelemetrySnapshot, decode_snapshot, encode_snapshot
from tests.run import metric_sinks

stats = metric_sinks.stats
metric_sinks.stats = lambda **overrides: stats(grad_norm=1.5, **overrides)
sinks = metric_sinks.capture()
snapshot = TelemetrySnapshot(time=0.0, **sinks["snapshot"])
sinks["decoded"] = decode_snapshot(encode_snapshot(snapshot)).grad_norm
print(json.dumps(sinks))
"""


def test_a_row_added_to_the_table_appears_in_every_sink(run_python) -> None:
    """One new row (an update statistic) reaches the update record (TensorBoard, metrics.jsonl,
    tracker), the telemetry snapshot and its wire format, Prometheus and the monitor."""
    child = run_python(ADDED_ROW, timeout=120)
    assert child.returncode == 0, child.stderr
    sinks = json.loads(child.stdout.splitlines()[-1])
    assert sinks["update_record"]["losses/grad_norm"] == 1.5
    assert "losses/grad_norm" not in sinks["update_record_without_stats"]
    assert "losses/grad_norm" in sinks["metrics_jsonl_keys"][0]
    assert "losses/grad_norm" in sinks["tracker_keys"]
    assert sinks["snapshot"]["grad_norm"] == 1.5 and sinks["decoded"] == 1.5
    assert sinks["snapshot_before_update"]["grad_norm"] is None
    assert "# HELP oakemu_grad_norm Gradient norm of the last update" in sinks["prometheus"]
    assert "# TYPE oakemu_grad_norm gauge" in sinks["prometheus"]
    assert "oakemu_grad_norm" in sinks["prometheus"]  # its sample
    assert "oakemu_grad_norm" not in sinks["prometheus_before_update"]  # no sample while None
    assert any(line.split() == ["grad", "norm", "1.500"] for line in _column(sinks["monitor"]))
    assert any(
        line.split() == ["grad", "norm", "-"] for line in _column(sinks["monitor_before_update"])
    )


def _column(lines: list[str]) -> list[str]:
    """The "Last update" column of the monitor's figure tables (between its two neighbours)."""
    start = lines[1].index("Last update")
    end = lines[1].index("Rejected / dropped")
    return [line[start:end] for line in lines[2:]]


SOURCES = {"stats", "result", "lag", "window", "learner", "report", "snapshot"}
"""The source objects the table's docstring names."""


def test_names_are_unique_and_every_row_shows_somewhere() -> None:
    tags = Counter(row.tag for row in METRICS if row.tag)
    assert [tag for tag, n in tags.items() if n > 1] == []
    snapshots = Counter(row.snapshot for row in METRICS if row.snapshot)
    assert [name for name, n in snapshots.items() if n > 1] == []
    samples = Counter((row.prometheus, row.label) for row in METRICS if row.prometheus)
    assert [name for name, n in samples.items() if n > 1] == []
    for row in METRICS:
        assert row.tag or row.snapshot, row
        assert row.source_object in SOURCES, row
        if row.prometheus:
            assert row.snapshot, f"{row.prometheus}: Prometheus reads the snapshot field"
            assert (row.label is None) == (row.prometheus not in FAMILIES), row
        if row.monitor:
            assert row.snapshot and row.monitor.section in SECTIONS, row


def test_record_reads_the_given_sources_only_and_fills_missing_objects() -> None:
    stats = SimpleNamespace(trainable_rows=64, policy_loss=0.5)
    assert record({"stats": stats}) == {"charts/rollout_rows": 64.0, "losses/policy_loss": 0.5}
    # A source object that is None gives the rows' ``missing`` values; absent fields give nothing.
    assert record({"stats": None}) == {"charts/rollout_rows": 0.0}
    assert record({"lag": {"min": 1.0}}) == {"charts/policy_lag_min": 1.0}
    assert record({}) == {}


def test_snapshot_values_turn_a_non_finite_explained_variance_into_none() -> None:
    stats = SimpleNamespace(explained_variance=math.nan, value_loss=math.nan)
    values = snapshot_values({"stats": stats})
    assert values["explained_variance"] is None
    assert math.isnan(values["value_loss"])  # other figures go as they are


def test_monitor_line_formats() -> None:
    row = Metric(
        "snapshot.share",
        "a share",
        snapshot="share",
        monitor=MonitorLine(SECTIONS[0], "share", "{share:.1f%} of {total:,}"),
    )
    snapshot = SimpleNamespace(share=0.25, total=12345)
    assert format_line(row, snapshot) == "25.0 % of 12,345"
    assert format_line(row, SimpleNamespace(share=None, total=1)) == "- of 1"
    assert format_line(row, SimpleNamespace(share=math.inf, total=1)) == "inf of 1"
    hidden = Metric(
        "snapshot.share",
        "a share",
        snapshot="share",
        monitor=MonitorLine(SECTIONS[0], "share", "{share}", hide_without=True),
    )
    assert format_line(hidden, SimpleNamespace(share=None)) is None
    blank = Metric(
        "snapshot.share",
        "a share",
        snapshot="share",
        monitor=MonitorLine(SECTIONS[0], "share", "{share} ({total})", blank_without=True),
    )
    assert format_line(blank, SimpleNamespace(share=None, total=3)) == "-"
    with pytest.raises(ValueError, match="no monitor line"):
        format_line(Metric("stats.x", "x", tag="x"), snapshot)


def test_the_snapshot_has_a_field_per_row_with_a_snapshot_name() -> None:
    from oakemu_core.run.telemetry import TelemetrySnapshot

    names = {row.snapshot for row in METRICS if row.snapshot}
    assert names <= set(TelemetrySnapshot.model_fields)
    assert metrics_table.snapshot_fields().keys() == names
