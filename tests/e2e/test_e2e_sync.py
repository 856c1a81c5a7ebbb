"""End to end: ``oakemu train --mode sync`` reproduces a seed exactly, trains every row with
policy lag 0, and its console, ``metrics.jsonl``, telemetry and final checkpoint agree on the update
count and ``global_step``; the asynchronous mode's counters agree as well.

Each run: CartPole-v1, 2 actors x 4 envs, 32 steps per rollout, 2,048 env steps = 8 updates.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint
from oakemu_core.run.telemetry import TelemetrySnapshot, TelemetrySubscriber
from tests.e2e_helpers import E2EProcesses, Ports, new_ports, read_jsonl, update_records

ROLLOUT_LENGTH = 32
NUM_ACTORS = 2
ENVS_PER_ACTOR = 4
BATCH = ROLLOUT_LENGTH * NUM_ACTORS * ENVS_PER_ACTOR
UPDATES = 8
BUDGET = UPDATES * BATCH
UPDATE_LINE = re.compile(r"update\s+(\d+) \| steps\s+(\d+) \| SPS\s+(\d+) \(recent\s+(\d+)\)")
COMPARED = (
    "losses/value_loss",
    "losses/entropy",
    "losses/clipfrac",
    "losses/explained_variance",
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/update",
    "charts/policy_version",
)
RATIO_LOSSES = ("losses/policy_loss", "losses/approx_kl")
"""Compared to 1e-6 relative, not exactly: the actors' float32 log-probs enter only the PPO ratio,
and their last bits may differ between two runs (2e-7 relative seen; see docs/benchmarks.md).
Everything discrete (episodes, steps, versions) and the other losses are compared exactly."""


class TelemetryLog:
    """Collects every snapshot the learner publishes while a run goes on (a thread of its own)."""

    def __init__(self, ports: Ports) -> None:
        self.subscriber = TelemetrySubscriber(ports.telemetry_address)
        self.snapshots: list[TelemetrySnapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            snapshot = self.subscriber.receive(timeout_s=0.2)
            if snapshot is not None:
                self.snapshots.append(snapshot)

    def close(self) -> list[TelemetrySnapshot]:
        self._stop.set()
        self._thread.join(5.0)
        self.subscriber.close()
        return self.snapshots


def train(
    e2e: E2EProcesses, tmp_path: Path, name: str, mode: str, seed: int = 5, *extra: str
) -> dict[str, Any]:
    """One short ``oakemu train`` run (``extra``: more flags); returns its run folder, console text and telemetry."""
    ports = new_ports()
    telemetry = TelemetryLog(ports)
    try:
        run = e2e.train(
            [
                "--env",
                "CartPole-v1",
                "--mode",
                mode,
                "--seed",
                str(seed),
                "--num-actors",
                str(NUM_ACTORS),
                "--envs-per-actor",
                str(ENVS_PER_ACTOR),
                "--rollout-length",
                str(ROLLOUT_LENGTH),
                "--total-env-steps",
                str(BUDGET),
                "--ppo-epochs",
                "4",
                "--num-minibatches",
                "4",
                "--learning-rate",
                "1e-3",
                "--checkpoint-every-updates",
                "0",
                "--eval-every-updates",
                "0",
                *extra,
            ],
            name=name,
            timeout_s=180,
            ports=ports,
            runs_dir=tmp_path / name,
        )
    finally:
        snapshots = telemetry.close()
    return {
        "run_dir": run.run_dir,
        "console": run.process.stdout() + run.process.stderr(),
        "telemetry": snapshots,
        "learner_log": run.learner_log,
    }


def check_counters_agree(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Console, metrics.jsonl, telemetry and the final checkpoint tell the same update count and
    global_step; SPS is positive from the first update on. Returns the update records."""
    records = update_records(run["run_dir"])
    assert records, "no update was recorded"
    assert [r["charts/update"] for r in records] == list(range(1, len(records) + 1))
    last = records[-1]
    state = load_checkpoint(run["run_dir"] / "checkpoints" / "latest.pt")
    assert state["ppo"]["iterations"] == len(records), "the learner's update count"
    assert state["global_step"] == last["global_step"], (
        "the learner's env-step count vs the last record"
    )
    assert last["global_step"] >= BUDGET

    console_lines = UPDATE_LINE.findall(run["console"])
    assert console_lines, run["console"][-2000:]
    update, steps, _, _ = console_lines[-1]
    assert (int(update), int(steps)) == (len(records), last["global_step"]), run["console"][-2000:]

    updates = {s.iterations: s for s in run["telemetry"] if s.is_update}
    assert updates, "no update telemetry was received"
    assert max(updates) == len(records)
    by_update = {int(r["charts/update"]): r for r in records}
    for iterations, snapshot in updates.items():
        assert snapshot.global_step == by_update[iterations]["global_step"], iterations
        assert snapshot.sps > 0 and snapshot.sps_recent > 0, snapshot
    for record in records:
        assert record["charts/SPS"] > 0 and record["charts/SPS_recent"] > 0, record
    assert last["charts/actors"] == NUM_ACTORS, (
        "the last update is logged before the actors are told to stop"
    )
    return records


def episodes_by_actor(run_dir: Path) -> dict[str, list[float]]:
    """episodes.jsonl returns per actor, in the order that actor finished them."""
    found: dict[str, list[float]] = {}
    for episode in read_jsonl(run_dir / "episodes.jsonl"):
        found.setdefault(episode["actor_id"], []).append(float(episode["episodic_return"]))
    return found


def check_mlflow_run(store: str, run_dir: Path, records: list[dict[str, Any]]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    [tracked] = client.search_runs([client.get_experiment_by_name("oakemu").experiment_id])
    assert tracked.info.run_name == run_dir.name and tracked.info.status == "FINISHED"
    assert tracked.data.params["mode"] == "async" and tracked.data.params["seed"] == "5"
    for name in ("charts/episodic_return", "losses/approx_kl", "charts/SPS"):
        logged = [(r["global_step"], r[name]) for r in records if r.get(name) is not None]
        history = client.get_metric_history(tracked.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == sorted(logged), name
    final = latest_checkpoint(run_dir)
    assert [a.path for a in client.list_artifacts(tracked.info.run_id, "checkpoints")] == [
        f"checkpoints/{final.name}"
    ]


@pytest.mark.slow
def test_sync_mode_reproduces_a_seed_with_policy_lag_zero_and_counters_that_agree(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    runs = [train(e2e, tmp_path, f"sync-{i}", "sync") for i in range(2)]
    records = [check_counters_agree(run) for run in runs]
    for run_records in records:
        assert len(run_records) == UPDATES
        assert [r["global_step"] for r in run_records] == [BATCH * (i + 1) for i in range(UPDATES)]
        for record in run_records:  # every row acted by the policy it is trained against
            assert record["charts/policy_lag_max"] == 0 and record["charts/stale_rows"] == 0, record
    for first, second in zip(*records):
        assert {k: first.get(k) for k in COMPARED} == {k: second.get(k) for k in COMPARED}
        for key in RATIO_LOSSES:
            assert math.isclose(first[key], second[key], rel_tol=1e-6, abs_tol=1e-12), (
                key,
                first[key],
                second[key],
            )
    episodes = [episodes_by_actor(run["run_dir"]) for run in runs]
    assert set(episodes[0]) == {"actor-0", "actor-1"}
    assert episodes[0] == episodes[1]


@pytest.mark.slow
def test_async_mode_counters_agree(
    e2e: E2EProcesses, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # MLflow 3 reads its file store only when allowed
    tracked = importlib.util.find_spec("mlflow") is not None  # the mlflow extra (in dev)
    store = (tmp_path / "mlruns").as_uri()
    run = train(
        e2e,
        tmp_path,
        "async",
        "async",
        5,
        *(["--track", "mlflow", "--track-uri", store] if tracked else []),
    )
    records = check_counters_agree(run)
    if tracked:  # the learner sent every scalar and the final checkpoint to MLflow's file store
        check_mlflow_run(store, run["run_dir"], records)
    # The budget counts env steps trained on (each rollout's rows less its stale rows): the run stops
    # right after the update that brings them to BUDGET, as SB3 stops after the rollout that does.
    trained = np.cumsum([BATCH - r["charts/stale_rows"] for r in records])
    assert trained[-1] >= BUDGET and (len(trained) == 1 or trained[-2] < BUDGET), trained
    # Rows written but not trained sit in the buffers when the run stopped (in async mode the other
    # buffer may be partly filled, or full): none is in training.
    log = (run["run_dir"] / "logs" / "learner.log").read_text()
    buffers = log.split("ingest: ")[1].split("buffers: ")[1].splitlines()[0]
    assert "training" not in buffers, buffers
    written = int(log.split("ingest: ")[1].split(" env steps written")[0])
    untrained = sum(int(part.split()[1]) for part in buffers.split(", "))
    dropped = ast.literal_eval(log.split("ingest: ")[1].split("dropped ")[1].split("; buffers")[0])
    discarded = dropped.get(
        "discarded_segment_rows", 0
    )  # written, then thrown away with their segment
    assert written - untrained - discarded == len(records) * BATCH, (
        written,
        untrained,
        discarded,
        len(records),
    )
