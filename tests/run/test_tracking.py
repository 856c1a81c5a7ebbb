"""Experiment tracking (oakemu_core/run/tracking.py), offline: MLflow's local file store and a
W&B offline run. Whatever MetricsLogger writes to TensorBoard reaches the tracker under the same
names, with the config, the evaluation video and the final checkpoint.

Each test skips, saying which extra is missing, where the tracker's package is not installed
(``pip install 'oakemu-rl[mlflow]'`` / ``'oakemu-rl[wandb]'``; the dev extra has both).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from oakemu_core.config import load_config
from oakemu_core.errors import ConfigError
from oakemu_core.run import tracking
from oakemu_core.run.metrics import MetricsLogger
from oakemu_core.run.tracking import Tracker, check_tracker_available, tracker_from_config

SCALARS = [
    (512, {"charts/episodic_return": 21.5, "losses/approx_kl": 0.01, "charts/SPS": float("nan")}),
    (1024, {"charts/episodic_return": 35.0, "losses/approx_kl": 0.02, "charts/SPS": 900.0}),
]


def fake_run(tmp_path: Path) -> Path:
    """A run folder with a final checkpoint and one evaluation video (the files are only uploaded)."""
    run_dir = tmp_path / "runs" / "CartPole-v1__1__test"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint_00000002.pt").write_bytes(b"final weights")
    (run_dir / "videos").mkdir()
    (run_dir / "videos" / "update_2.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    return run_dir


def log_a_run(tracker: Tracker, run_dir: Path) -> None:
    with MetricsLogger(run_dir, tracker=tracker) as metrics:
        for step, scalars in SCALARS:
            metrics.log(step, scalars)
        metrics.log_video(1024, "eval/video", run_dir / "videos" / "update_2.mp4")
    # Closing the logger closed the tracker (idempotent): the final checkpoint is uploaded, the run ended.
    tracker.close()
    assert tracker.dropped == 0


def test_mlflow_file_store_has_params_metrics_video_and_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="needs the mlflow extra: pip install 'oakemu-rl[mlflow]'")
    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # for this test's own client (the tracker sets it)
    from mlflow.tracking import MlflowClient

    run_dir = fake_run(tmp_path)
    store = (tmp_path / "mlruns").as_uri()
    config = load_config(
        ["--env", "CartPole-v1", "--seed", "7", "--track", "mlflow", "--track-uri", store]
    )
    log_a_run(tracker_from_config(config, run_dir), run_dir)

    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([client.get_experiment_by_name("oakemu").experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["seed"] == "7" and run.data.params["env_id"] == "CartPole-v1"
    history = client.get_metric_history(run.info.run_id, "charts/episodic_return")
    assert [(m.step, m.value) for m in history] == [(512, 21.5), (1024, 35.0)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "charts/SPS")] == [
        1024
    ]  # NaN left out
    assert [a.path for a in client.list_artifacts(run.info.run_id, "videos")] == [
        "videos/update_2.mp4"
    ]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == [
        "checkpoints/checkpoint_00000002.pt"
    ]

    # A resumed run continues the same MLflow run.
    resumed = Tracker("mlflow", run_dir, config.model_dump(mode="json"), uri=store)
    resumed.log_scalars(2048, {"charts/episodic_return": 50.0})
    resumed.close()
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "charts/episodic_return")) == 3


def wandb_records(path: Path) -> list:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then LevelDB's log
    format (32 KiB blocks of chunks: crc32 u32, length u16, type u8 = full 1 / first 2 / middle 3 /
    last 4), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, records, pending = path.read_bytes(), 32768, 7, [], b""
    assert data.startswith(b":W&B")
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_files_hold_the_scalars_config_and_video(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="needs the wandb extra: pip install 'oakemu-rl[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = fake_run(tmp_path)
    config = load_config(["--env", "CartPole-v1", "--seed", "7", "--track", "wandb"])
    log_a_run(tracker_from_config(config, run_dir), run_dir)

    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = (
        time.monotonic() + 30.0
    )  # wandb's own service writes the file; its last record is "exit"
    while "exit" not in [r.WhichOneof("record_type") for r in wandb_records(run_file)]:
        assert time.monotonic() < deadline, "the W&B run file has no exit record"
        time.sleep(0.2)
    records = wandb_records(run_file)
    history = [
        {
            item.key or ".".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    returns = [
        (h["_step"], h["charts/episodic_return"]) for h in history if "charts/episodic_return" in h
    ]
    assert returns == [(512, 21.5), (1024, 35.0)], [r.WhichOneof("record_type") for r in records]
    assert all("charts/SPS" not in h for h in history if h["_step"] == 512)  # NaN left out
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_items["seed"] == 7 and config_items["env_id"] == "CartPole-v1"
    assert [h["eval/video._type"] for h in history if "eval/video._type" in h] == ["video-file"]
    assert list(run_file.parent.glob("files/media/videos/eval/video_1024_*.mp4"))
    assert any(
        r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model" for r in records
    )


def test_a_missing_tracker_package_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    for kind in ("mlflow", "wandb"):
        with pytest.raises(ConfigError, match=rf"pip install 'oakemu-rl\[{kind}\]'"):
            check_tracker_available(kind)
    check_tracker_available("none")
    assert tracker_from_config(load_config(["--env", "CartPole-v1"]), Path("unused")) is None


def test_a_failing_tracker_never_raises_into_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "check_tracker_available", lambda kind: None)

    def broken(self: Tracker, options: dict) -> None:
        raise RuntimeError("tracking server unreachable")

    monkeypatch.setattr(Tracker, "_start", broken)
    tracker = Tracker("mlflow", tmp_path, {})
    with MetricsLogger(tmp_path, tracker=tracker) as metrics:
        metrics.log(1, {"charts/episodic_return": 1.0})
    assert tracker.dropped >= 2  # the start, then every call after it
