"""Evaluation figures in metrics, telemetry (bounded history, validation, Prometheus) and the
monitor's curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgpack
import pytest
from oakemu_services import monitor
from rich.console import Console

from oakemu_core.run.metrics import (
    EVAL_EPISODIC_LENGTH,
    EVAL_EPISODIC_RETURN,
    EVAL_EPISODIC_RETURN_STD,
    MetricsLogger,
    evaluation_scalars,
)
from oakemu_core.run.prometheus import PrometheusExporter
from oakemu_core.run.telemetry import TelemetryRejected, decode_snapshot, encode_snapshot
from oakemu_core.run.telemetry_history import (
    HISTORY_MAX_POINTS,
    TelemetryHistory,
    TelemetryHistoryData,
)
from oakemu_core.run.tester import EvaluationReport
from tests.services.test_monitor import make_snapshot, publishing


def report(
    version: int, mean: float, *, step: int | None = None, std: float = 2.0
) -> EvaluationReport:
    return EvaluationReport(
        policy_version=version,
        global_step=1000 * version if step is None else step,
        episodes=3,
        return_mean=mean,
        return_std=std,
        length_mean=mean + 1,
        returns=(mean - 1, mean, mean + 1),
        lengths=(1, 2, 3),
        greedy=True,
        wall_seconds=0.5,
        finished_at=1_700_000_000.0 + version,
    )


def filled_history(updates: int = 300, every: int = 10) -> TelemetryHistory:
    """A run of ``updates`` updates: rising training return, an evaluation every ``every`` updates."""
    history = TelemetryHistory()
    for update in range(1, updates + 1):
        history.record_update(
            update * 512, 10.0 + update, 400.0 + (update % 7), time_s=1_700_000_000.0 + update
        )
        if update % every == 0:
            history.record_evaluation(report(update, 20.0 + update, step=update * 512))
    return history


# --------------------------------------------------------------------------------------- metrics
def test_evaluation_scalars_names_and_values_in_metrics_jsonl(tmp_path: Path) -> None:
    scalars = evaluation_scalars(report(7, 123.5, std=4.25))
    assert scalars == {
        EVAL_EPISODIC_RETURN: 123.5,
        EVAL_EPISODIC_RETURN_STD: 4.25,
        EVAL_EPISODIC_LENGTH: 124.5,
        "eval/policy_version": 7.0,
        "eval/weights_global_step": 7000.0,
    }
    assert (EVAL_EPISODIC_RETURN, EVAL_EPISODIC_RETURN_STD, EVAL_EPISODIC_LENGTH) == (
        "eval/episodic_return",
        "eval/episodic_return_std",
        "eval/episodic_length",
    )
    with MetricsLogger(tmp_path) as logger:
        logger.log(9000, scalars)  # the learner's current step, later than the evaluated one
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["global_step"] == 9000 and record["eval/episodic_return"] == 123.5
    assert record["eval/weights_global_step"] == 7000


# --------------------------------------------------------------------------------------- history
def test_history_round_trips_through_the_telemetry_wire() -> None:
    history = filled_history(40, every=10)
    snapshot = make_snapshot(40 * 512, **history.snapshot_fields())
    decoded = decode_snapshot(encode_snapshot(snapshot))
    assert decoded == snapshot
    assert [p.global_step for p in decoded.history.evaluations] == [5120, 10240, 15360, 20480]
    assert decoded.history.training[-1].episodic_return == 50.0
    assert (decoded.eval_return_mean, decoded.eval_return_std, decoded.eval_length_mean) == (
        60.0,
        2.0,
        61.0,
    )
    assert decoded.eval_policy_version == 40 and decoded.best_eval_return == 60.0
    # A snapshot without any of it (an update before the first evaluation) is still valid.
    plain = decode_snapshot(encode_snapshot(make_snapshot(10)))
    assert plain.history == TelemetryHistoryData() and plain.eval_return_mean is None


def test_history_stays_bounded_and_keeps_the_whole_curve() -> None:
    history = TelemetryHistory(max_points=64)
    for update in range(10_000):
        history.record_update(update * 100, float(update), 100.0)
        if update % 3 == 0:
            history.record_evaluation(report(update, float(update), step=update * 100))
        data = history.data()
        assert len(data.training) <= 64 and len(data.evaluations) <= 64
    steps = [p.global_step for p in data.training]
    assert steps[0] == 0 and steps[-1] == 999_900  # first and newest kept
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    gaps = [
        b - a for a, b in zip(steps[:-2], steps[1:-1])
    ]  # even spacing (the newest may sit between)
    assert len(set(gaps)) == 1 and len(steps) >= 32
    assert data.evaluations[0].global_step == 0 and data.evaluations[-1].global_step == 9999 * 100
    # The default bound and the message size: 512 points per series, well under the 16 MiB cap.
    big = filled_history(3000, every=1)
    fields = big.snapshot_fields()
    assert len(fields["history"].training) <= HISTORY_MAX_POINTS == 512
    assert len(encode_snapshot(make_snapshot(1, **fields))) < 200_000


def test_history_validation_rejects_oversized_or_malformed_histories() -> None:
    payload = make_snapshot(1).model_dump(mode="python")
    point = {"global_step": 1, "time": 1.0, "episodic_return": 1.0, "sps": 1.0}
    too_long = payload | {
        "history": {"training": [point] * (HISTORY_MAX_POINTS + 1), "evaluations": []}
    }
    with pytest.raises(TelemetryRejected, match="history.training"):
        decode_snapshot(msgpack.packb(too_long))
    negative = payload | {"history": {"training": [point | {"global_step": -5}], "evaluations": []}}
    with pytest.raises(TelemetryRejected, match="global_step"):
        decode_snapshot(msgpack.packb(negative))
    unknown = payload | {"history": {"training": [point | {"extra": 1}], "evaluations": []}}
    with pytest.raises(TelemetryRejected, match="extra"):
        decode_snapshot(msgpack.packb(unknown))
    with pytest.raises(ValueError, match="max_points"):
        TelemetryHistory(max_points=HISTORY_MAX_POINTS + 1)


def test_history_best_nan_and_state_round_trip() -> None:
    history = TelemetryHistory(max_points=8)
    history.record_update(100, math.nan, math.inf)  # no episode yet: stored as missing, not NaN
    assert (
        history.data().training[0].episodic_return is None
        and history.data().training[0].sps is None
    )
    for version, mean in enumerate([5.0, 9.0, 3.0, math.nan], start=1):
        history.record_evaluation(report(version, mean))
    assert history.best_eval_return == 9.0
    for update in range(2, 40):
        history.record_update(update * 100, float(update), 50.0)
    restored = TelemetryHistory(max_points=8)
    restored.load_state_dict(json.loads(json.dumps(history.state_dict(), allow_nan=True)))
    assert restored.data() == history.data() and restored.best_eval_return == 9.0
    # The resumed history goes on downsampling where it left off.
    for target in (history, restored):
        for update in range(40, 100):
            target.record_update(update * 100, float(update), 50.0, time_s=float(update))
    assert restored.data() == history.data()
    with pytest.raises(ValueError, match="history"):
        TelemetryHistory().load_state_dict({"training": [{"global_step": "x"}]})


def test_prometheus_exposes_the_evaluation_gauges() -> None:
    history = filled_history(20, every=10)
    with PrometheusExporter(0, addr="127.0.0.1") as exporter:
        assert (
            exporter.registry.get_sample_value("oakemu_eval_return_mean") is None
        )  # nothing before a snapshot
        exporter.update(make_snapshot(20 * 512, **history.snapshot_fields()))
        value = exporter.registry.get_sample_value
        assert value("oakemu_eval_return_mean") == 40.0 and value("oakemu_eval_return_std") == 2.0
        assert (
            value("oakemu_eval_length_mean") == 41.0 and value("oakemu_eval_policy_version") == 20.0
        )
        assert value("oakemu_best_eval_return") == 40.0


# --------------------------------------------------------------------------------------- monitor
def test_sparkline_levels_and_gaps() -> None:
    assert monitor.sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == "▁▂▃▄▅▆▇█"
    assert monitor.sparkline([None, 1.0, math.nan, 3.0]) == " ▁ █"
    assert monitor.sparkline([2.0, 2.0]) == "▄▄" and monitor.sparkline([None, None]) == "  "
    assert monitor.resample([(0, 1.0), (50, 2.0), (100, 3.0)], 0, 100, 4) == [1.0, 2.0, 2.0, 3.0]
    assert monitor.resample([(60, 5.0)], 0, 100, 4) == [None, None, 5.0, 5.0]


def test_monitor_draws_training_and_evaluation_curves_from_the_history() -> None:
    history = filled_history(300, every=10)
    snapshot = make_snapshot(300 * 512, **history.snapshot_fields())
    console = Console(record=True, width=200, color_system=None)
    console.print(monitor.render_snapshot(snapshot, address="tcp://x:5558", age_s=0.0))
    text = console.export_text()
    lines = {
        line.split()[0] + " " + line.split()[1]: line
        for line in text.splitlines()
        if len(line.split()) > 2
    }
    train, evaluation = lines["train return"], lines["eval return"]
    spark = [line for line in text.splitlines() if line.lstrip().startswith("SPS ")]
    assert spark, text
    # Rising returns: the sparkline climbs from the lowest to the highest block.
    train_blocks = "".join(ch for ch in train if ch in monitor.SPARK_BLOCKS)
    eval_blocks = "".join(ch for ch in evaluation if ch in monitor.SPARK_BLOCKS)
    assert (
        len(train_blocks) == monitor.CURVE_WIDTH
        and train_blocks[0] == "▁"
        and train_blocks[-1] == "█"
    )
    assert list(train_blocks) == sorted(train_blocks, key=monitor.SPARK_BLOCKS.index)
    assert eval_blocks[0] == "▁" and eval_blocks[-1] == "█"
    assert "310.0" in train and "320.0" in evaluation  # last values
    assert "30 points" in evaluation and "eval return" in text and "320.00 ± 2.00 (v300)" in text
    assert "best eval" in text and "153,600" in text  # the env-step axis ends at the last step


def test_monitor_without_history_says_so() -> None:
    console = Console(record=True, width=200, color_system=None)
    console.print(monitor.render_snapshot(make_snapshot(100), address="tcp://x:5558", age_s=0.0))
    text = console.export_text()
    assert "no history yet" in text and "Curves" in text


def test_a_late_monitor_gets_the_whole_history_in_json_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = filled_history(100, every=10)
    snapshot = make_snapshot(100 * 512, is_update=True, **history.snapshot_fields())
    with publishing(lambda i: snapshot) as address:
        assert monitor.main(address, json_output=True, once=True, timeout_s=10.0) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert len(data["history"]["training"]) == 100 and len(data["history"]["evaluations"]) == 10
    assert data["history"]["training"][0] == {
        "global_step": 512,
        "time": 1_700_000_001.0,
        "episodic_return": 11.0,
        "sps": 401.0,
    }
    assert data["eval_return_mean"] == 120.0 and data["best_eval_return"] == 120.0
