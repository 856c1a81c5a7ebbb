"""Experiment trackers: a run's configuration, every scalar under TensorBoard's names, the evaluation
videos and the final checkpoint, sent to MLflow or Weights & Biases as well.

* ``--track mlflow`` (extra ``mlflow``: the mlflow-skinny client): the run goes to ``--track-uri``
  (an ``http(s)://`` tracking server, ``databricks``, or any URI MLflow accepts), else to
  ``MLFLOW_TRACKING_URI``, else to MLflow's usual local file store ``./mlruns`` (``mlflow ui
  --backend-store-uri ./mlruns`` shows it).
  MLflow 3 keeps the file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE``
  is true, which this module sets for the file store it opens. Experiment: ``--track-project``;
  run name: the run folder's name. Params: the configuration (one per setting, as strings);
  metrics: every scalar at ``global_step``; artifacts: the evaluation videos (``videos/best.mp4``, ...) and
  ``checkpoints/<final checkpoint>``.
* ``--track wandb`` (extra ``wandb``): project ``--track-project``, run name and files under the run
  folder (``run_dir/wandb/``); config: the configuration; ``run.log`` of every scalar at
  ``global_step``, ``eval/video`` as a ``wandb.Video``; the final checkpoint as a ``model``
  artifact. ``WANDB_MODE=offline`` writes the run to ``run_dir/wandb/offline-run-*`` without a
  network (``wandb sync`` uploads it later); online needs ``WANDB_API_KEY`` or ``wandb login``.

The scalars are those of :class:`~oakemu_core.run.metrics.MetricsLogger`: the tags of the rows of
:data:`oakemu_core.run.metrics_table.METRICS` (and nothing declared here).

A resumed run continues the same tracker run: its id is kept in ``run_dir/tracking.json``.

Every tracker call runs in one background thread: the learner only queues (a slow tracking server
never stalls training). A full queue drops the item; a failing tracker logs its first error and
drops what follows; both are counted (:attr:`Tracker.dropped`). Non-finite scalars (an empty
episode window) are left out.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oakemu_core.errors import ConfigError
from oakemu_core.run.run_folder import write_text_atomic

__all__ = ["TRACKERS", "Tracker", "check_tracker_available", "tracker_from_config"]

log = logging.getLogger("oakemu.tracking")

TRACKERS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
"""``--track`` value -> (module to import, the extra that installs it)."""
STATE_FILE_NAME = "tracking.json"
QUEUE_SIZE = 10_000
"""Tracker calls waiting at most; more are dropped (and counted)."""
CLOSE_TIMEOUT_S = 120.0
"""How long closing waits for queued calls (the final checkpoint's upload) before giving up."""


def check_tracker_available(kind: str) -> None:
    """Raise :class:`ConfigError` naming the install command unless ``--track kind`` can work."""
    if kind == "none":
        return
    if kind not in TRACKERS:
        raise ConfigError(f"track: expected none, {', '.join(TRACKERS)}, received {kind!r}")
    module, extra = TRACKERS[kind]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"track: --track {kind} needs the {module} package: pip install 'oakemu-rl[{extra}]'"
        )


def _flat_config(config: Mapping[str, Any]) -> dict[str, str]:
    """Settings as MLflow params: values as strings (JSON for lists and dicts), at most 6,000 chars."""
    return {
        key: (value if isinstance(value, str) else json.dumps(value))[:6000]
        for key, value in config.items()
    }


class _Mlflow:
    """MLflow through its client (no global active run)."""

    def __init__(
        self,
        *,
        uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None,
        config: Mapping[str, Any],
    ) -> None:
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # module docstring
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self._client.create_experiment(experiment)
            )
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(key, value) for key, value in _flat_config(config).items()]
            for start in range(0, len(params), 100):  # MLflow's limit per batch
                self._client.log_batch(run_id, params=params[start : start + 100])
        self.run_id = run_id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()]
        )

    def video(self, step: int, tag: str, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path="videos")

    def checkpoint(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")

    def finish(self) -> None:
        self._client.set_terminated(self.run_id)


class _Wandb:
    """Weights & Biases: one run, files under the run folder."""

    def __init__(
        self,
        *,
        run_dir: Path,
        project: str,
        run_name: str,
        run_id: str | None,
        config: Mapping[str, Any],
    ) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=str(run_dir),
            config=dict(config),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run_id = self._run.id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def video(self, step: int, tag: str, path: Path) -> None:
        self._run.log({tag: self._wandb.Video(str(path), format="mp4")}, step=step)

    def checkpoint(self, path: Path) -> None:
        artifact = self._wandb.Artifact(
            f"{self._run.name or self.run_id}-checkpoint".replace("/", "-"), type="model"
        )
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def finish(self) -> None:
        self._run.finish()


class Tracker:
    """One run in an experiment tracker, fed from a background thread (module docstring).

    Args:
        kind: ``"mlflow"`` or ``"wandb"``.
        run_dir: the run folder (its name is the run's name; ``tracking.json`` keeps the run id).
        config: the run's configuration as plain values (``OakEmuConfig.model_dump(mode="json")``).
        uri: MLflow tracking URI (None: ``MLFLOW_TRACKING_URI``, else the file store ``./mlruns``);
            ignored by wandb.
        project: MLflow experiment / W&B project.

    Raises:
        ConfigError: the tracker's package is not installed.
    """

    def __init__(
        self,
        kind: str,
        run_dir: Path,
        config: Mapping[str, Any],
        *,
        uri: str | None = None,
        project: str = "oakemu",
    ) -> None:
        check_tracker_available(kind)
        self.kind, self.run_dir = kind, Path(run_dir)
        self.dropped = 0
        """Calls dropped: queue full, or the tracker failed (its first error is logged)."""
        self._failed = False
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(QUEUE_SIZE)
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or Path("mlruns").resolve().as_uri()
        options = {"uri": uri, "project": project, "config": dict(config)}
        self._thread = threading.Thread(
            target=self._work, args=(options,), name=f"oakemu-{kind}", daemon=True
        )
        self._thread.start()

    # -- learner-facing calls (queue only) -------------------------------------------------------
    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log the finite ``scalars`` at ``step`` (env steps), under their TensorBoard names."""
        values = {name: float(value) for name, value in scalars.items() if math.isfinite(value)}
        if values:
            self._put("scalars", int(step), values)

    def log_video(self, step: int, tag: str, path: Path) -> None:
        """Log the MP4 at ``path`` (an evaluation video) at ``step`` under ``tag``."""
        self._put("video", int(step), tag, Path(path))

    def close(self, final_checkpoint: Path | None = None) -> None:
        """Upload ``final_checkpoint`` (None: the run folder's latest), end the run and wait for the
        queued calls (at most :data:`CLOSE_TIMEOUT_S`). Idempotent."""
        if self._thread is None:
            return
        if final_checkpoint is None:
            from oakemu_core.run.checkpoint import latest_checkpoint

            final_checkpoint = latest_checkpoint(self.run_dir)
        if final_checkpoint is not None:
            self._put("checkpoint", Path(final_checkpoint).resolve())
        self._put("finish")
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(
                "%s: queued calls not done after %.0f s; giving up on them",
                self.kind,
                CLOSE_TIMEOUT_S,
            )
        self._thread = None

    # -- worker thread -------------------------------------------------------------------------
    def _put(self, method: str, *args: Any) -> None:
        if self._failed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1

    def _work(self, options: dict[str, Any]) -> None:
        backend = None
        try:
            backend = self._start(options)
        except Exception as error:  # noqa: BLE001 - a tracker never stops training
            self._fail("cannot start the run", error)
        while (item := self._queue.get()) is not None:
            if backend is None or self._failed:
                self.dropped += 1
                continue
            method, args = item
            try:
                getattr(backend, method)(*args)
            except Exception as error:  # noqa: BLE001
                self._fail(f"{method} failed", error)

    def _start(self, options: dict[str, Any]) -> Any:
        state_file = self.run_dir / STATE_FILE_NAME
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        run_id = state.get("run_id") if state.get("tracker") == self.kind else None
        common = {"run_name": self.run_dir.name, "run_id": run_id, "config": options["config"]}
        if self.kind == "mlflow":
            backend: Any = _Mlflow(uri=options["uri"], experiment=options["project"], **common)
        else:
            backend = _Wandb(run_dir=self.run_dir, project=options["project"], **common)
        if backend.run_id != run_id:
            write_text_atomic(
                state_file, json.dumps({"tracker": self.kind, "run_id": backend.run_id}) + "\n"
            )
        log.info("tracking with %s: run %s", self.kind, backend.run_id)
        return backend

    def _fail(self, what: str, error: BaseException) -> None:
        self._failed = True
        self.dropped += 1
        log.error(
            "%s: %s (%s: %s); tracking stops, training goes on",
            self.kind,
            what,
            type(error).__name__,
            error,
        )


def tracker_from_config(config: Any, run_dir: Path) -> Tracker | None:
    """The run's tracker from an :class:`oakemu_core.config.OakEmuConfig` (``track``, ``track_uri``,
    ``track_project``), or None with ``track = "none"``.

    Raises:
        ConfigError: the tracker's package is not installed.
    """
    if config.track == "none":
        return None
    return Tracker(
        config.track,
        run_dir,
        config.model_dump(mode="json"),
        uri=config.track_uri,
        project=config.track_project,
    )
