"""What every metric sink shows for one synthetic run state: the names users see.

:func:`capture` drives the real writers (the learner's per-update record, the evaluation record, the
telemetry snapshot, the Prometheus exporter, the monitor's view, the tracker's keys) on fixed inputs
and returns what they produce, as plain JSON values. ``tests/run/metric_names.json`` holds its
output from before the metrics table existed; ``tests/run/test_metrics_table.py`` compares.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

GOLDEN = Path(__file__).with_name("metric_names.json")
"""The names and texts of :func:`capture`, recorded once."""


def stats(**overrides: Any) -> SimpleNamespace:
    """A PPO update's statistics (the fields of ``PPOUpdateStats``)."""
    fields = dict(
        policy_loss=-0.0125,
        value_loss=0.5,
        entropy=1.25,
        approx_kl=0.002,
        clip_fraction=0.125,
        explained_variance=0.25,
        learning_rate=2.5e-4,
        epochs_completed=4,
        minibatches=16,
        early_stopped=False,
        first_minibatch_ratio_max_abs_dev=1e-7,
        update_seconds=0.75,
        epoch_seconds=[0.2, 0.2],
        trainable_rows=512,
        nonfinite_minibatches=1,
        importance_weight_mean=0.875,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def train_result(with_stats: bool = True) -> SimpleNamespace:
    """A trainer's result (the fields of ``TrainResult`` the metrics read)."""
    return SimpleNamespace(
        slot=0,
        policy_version=9,
        weights={},
        stats=stats() if with_stats else None,
        stale_rows=3,
        lag={
            "min": 0.0,
            "mean": 0.5,
            "max": 2.0,
            "sgd_min": 0.0,
            "sgd_mean": 4.0,
            "sgd_max": 16.0,
            "newest_version": 8.0,
        },
        iterations=7,
        evaluations=[],
        events=[],
        trainable_share=0.75,
        rollbacks=1,
        trained_env_steps=3072,
        columns=4,
        planned_columns=6,
    )


def assembler() -> SimpleNamespace:
    """The assembler fields a telemetry snapshot reads."""
    record = SimpleNamespace(
        actor_id="a1",
        incarnation="inc-1",
        spec=SimpleNamespace(num_envs=4),
        env_steps_per_second=250.0,
        last_heard=math.inf,  # heard "now": last_heard_s 0.0
        policy_lag=0.5,
        take_lag=lambda: (0.0, 0.5, 1.0),
    )
    counters = SimpleNamespace(
        env_steps=4096,
        rejected={"bad_dtype": 2},
        dropped={"stale_rows": 3},
        received={"data": 40, "control": 5},
        accepted={"step": 40, "join": 1},
    )
    return SimpleNamespace(counters=counters, buffer_fill=lambda: 0.5, actors={"a1": record})


def evaluation_report() -> Any:
    from oakemu_core.run.tester import EvaluationReport

    return EvaluationReport(
        policy_version=6,
        global_step=3000,
        episodes=3,
        return_mean=120.5,
        return_std=4.25,
        length_mean=121.5,
        returns=(116.0, 120.5, 125.0),
        lengths=(120, 121, 123),
        greedy=True,
        wall_seconds=0.5,
        finished_at=1_700_000_100.0,
    )


def _telemetry() -> Any:
    from oakemu_core.run.learner_telemetry import LearnerTelemetry

    telemetry = LearnerTelemetry("run-a", "CartPole-v1", started=0.0, start_steps=0)
    telemetry.window.add([10.0, 30.0], [100, 300])
    return telemetry


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {
        name: (round(value, 9) if isinstance(value, float) and math.isfinite(value) else value)
        for name, value in values.items()
    }


def _prometheus(snapshot: Any) -> list[str]:
    """The exposition's ``# HELP`` / ``# TYPE`` lines and sample names with labels (no values), of
    the learner's own metrics (``process_*`` left out)."""
    from prometheus_client import generate_latest

    from oakemu_core.run.prometheus import PrometheusExporter

    with PrometheusExporter(0) as exporter:
        exporter.update(snapshot)
        text = generate_latest(exporter.registry).decode()
    lines = []
    for line in text.splitlines():
        if "process_" in line or "python_" in line:
            continue
        lines.append(line if line.startswith("#") else line.rsplit(" ", 1)[0])
    return sorted(lines)


def _monitor(snapshot: Any) -> list[str]:
    from oakemu_services.monitor import render_snapshot
    from rich.console import Console

    console = Console(width=200, file=io.StringIO(), record=True, color_system=None)
    console.print(render_snapshot(snapshot, address="tcp://127.0.0.1:5558", age_s=1.0))
    return [line.rstrip() for line in console.export_text().splitlines()]


def capture() -> dict[str, Any]:
    """Names (and texts) each sink produces for the synthetic state above."""
    from oakemu_core.run.metrics import MetricsLogger, evaluation_scalars

    telemetry = _telemetry()
    update = telemetry.record_update(train_result(), 4096, 2.0, actors=2)
    no_stats = _telemetry().record_update(train_result(with_stats=False), 4096, 2.0, actors=2)
    evaluation = evaluation_scalars(evaluation_report())
    telemetry.history.record_evaluation(evaluation_report())
    snapshot = telemetry.snapshot(
        assembler(),
        policy_version=9,
        iterations=7,
        episodes=2,
        learning_rate=3e-4,
        checkpoint_failures=1,
        log_write_failures=2,
        is_update=True,
        trained_env_steps=3072,
    )
    before_update = _telemetry().snapshot(
        assembler(),
        policy_version=0,
        iterations=0,
        episodes=0,
        learning_rate=3e-4,
        checkpoint_failures=0,
        log_write_failures=0,
        is_update=False,
    )
    dumped = snapshot.model_dump(mode="json")
    dumped.pop("time")

    class Tracker:
        keys: list[str] = []

        def log_scalars(self, step: int, values: dict[str, float]) -> None:
            self.keys.extend(values)

        def close(self) -> None:
            pass

    import tempfile

    tracker = Tracker()
    with tempfile.TemporaryDirectory() as folder:
        with MetricsLogger(Path(folder), tracker=tracker) as logger:
            logger.log(4096, update)
            logger.log(4096, evaluation)
        jsonl = [
            sorted(set(json.loads(line)) - {"wall_time"})
            for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()
        ]
    return {
        "update_record": _rounded(update),
        "update_record_without_stats": _rounded(no_stats),
        "evaluation_record": _rounded(evaluation),
        "metrics_jsonl_keys": jsonl,
        "tracker_keys": sorted(tracker.keys),
        "snapshot": {k: v for k, v in dumped.items() if k not in ("history",)},
        "snapshot_before_update": {
            k: v
            for k, v in before_update.model_dump(mode="json").items()
            if k not in ("history", "time")
        },
        "prometheus": _prometheus(snapshot),
        "prometheus_before_update": _prometheus(before_update),
        "monitor": _monitor(snapshot),
        "monitor_before_update": _monitor(before_update),
    }


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(capture(), indent=1, sort_keys=False) + "\n")
    print(f"wrote {GOLDEN}")
