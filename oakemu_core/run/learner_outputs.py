"""What the learner writes and serves about its run: ``metrics.jsonl`` and the trackers, one line
per finished episode in ``episodes.jsonl``, telemetry for ``oakemu monitor`` and Prometheus.

:class:`LearnerOutputs` holds the writers and publishers; the learner service calls it once per
update, per evaluation report, per batch of finished episodes and per telemetry period. Every write
is whole or not at all, and a failed write is counted (:attr:`LearnerOutputs.write_failures`),
never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oakemu_core.run.learner_telemetry import LearnerTelemetry
from oakemu_core.run.metrics import JsonLinesWriter, MetricsLogger, evaluation_scalars
from oakemu_core.run.prometheus import PrometheusExporter
from oakemu_core.run.telemetry import TelemetryPublisher, TelemetrySnapshot
from oakemu_core.run.tracking import tracker_from_config

if TYPE_CHECKING:
    import zmq

    from oakemu_core.algo.handshake import TrainResult
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.run.tester import EvaluationReport
    from oakemu_core.storage.episodes import FinishedEpisode

__all__ = ["LearnerOutputs"]

log = logging.getLogger("oakemu.learner")


class LearnerOutputs:
    """The learner's metrics, episodes log, telemetry and Prometheus endpoint.

    Args:
        config: the run's configuration (env id, ports, bind host, trackers, Prometheus).
        run_dir: the run folder (``metrics.jsonl``, ``episodes.jsonl``, TensorBoard events).
        context: the ZeroMQ context of the telemetry publisher.
        security: the monitor role's CURVE settings for the telemetry socket, or None.
        start_steps: the run's env steps when this process started (the SPS baseline).
        undo: closes what is opened here when the learner closes (or fails to start).
    """

    def __init__(
        self,
        config: OakEmuConfig,
        run_dir: Path,
        *,
        context: zmq.Context,
        security: Any,
        start_steps: int,
        undo: contextlib.ExitStack,
    ) -> None:
        self.telemetry = LearnerTelemetry(
            run_dir.name, config.env_id, started=time.monotonic(), start_steps=start_steps
        )
        # --track: MLflow, W&B
        self.metrics = MetricsLogger(run_dir, tracker=tracker_from_config(config, run_dir))
        undo.callback(self.metrics.close)
        # One line per finished episode (raw game score), as CleanRL logs charts/episodic_return.
        self.episodes_log = JsonLinesWriter(run_dir / "episodes.jsonl")
        undo.callback(self.episodes_log.close)
        self.publisher = TelemetryPublisher(
            config.bind_address(config.telemetry_port), context=context, security=security
        )
        undo.callback(self.publisher.close)
        # Where the learner binds, not 0.0.0.0.
        metrics_host = (config.metrics_host or config.bind_host).strip("[]")
        self.prometheus = (
            PrometheusExporter(config.metrics_port, addr=metrics_host)
            if config.metrics_enabled
            else None
        )
        if self.prometheus is not None:
            undo.callback(self.prometheus.close)

    @property
    def write_failures(self) -> int:
        """Records of metrics.jsonl and episodes.jsonl that could not be written."""
        return self.metrics.write_failures + self.episodes_log.failures

    def log_episodes(self, episodes: list[FinishedEpisode], global_step: int) -> None:
        """Finished episodes into episodes.jsonl (at ``global_step``) and the telemetry window."""
        if not episodes:
            return
        for episode in episodes:
            self.episodes_log.write(
                {
                    "global_step": global_step,
                    "actor_id": episode.actor_id,
                    "policy_version": episode.policy_version,
                    "episodic_return": episode.episodic_return,
                    "episodic_length": episode.episodic_length,
                }
            )
        self.telemetry.window.add(
            [e.episodic_return for e in episodes], [e.episodic_length for e in episodes]
        )

    def log_update(
        self, result: TrainResult, global_step: int, *, actors: int, episodes: int
    ) -> None:
        """One metrics record and one log line per PPO update (with its evaluation reports), with
        the update number (``charts/update``), ``global_step`` and SPS of the telemetry."""
        record = self.telemetry.record_update(result, global_step, time.monotonic(), actors=actors)
        self.metrics.log(global_step, record)
        for report in result.evaluations:
            self.log_evaluation(report, global_step)
        self.telemetry.log_update(result, global_step, episodes=episodes, actors=actors)

    def log_evaluation(self, report: EvaluationReport, global_step: int) -> None:
        """A tester report into metrics (at ``global_step``: it never goes back), the telemetry
        history and the log."""
        self.metrics.log(global_step, evaluation_scalars(report))
        self.metrics.log_video(global_step, "eval/video", report.video_path, report.video_preview)
        self.telemetry.history.record_evaluation(report)
        log.info(
            "evaluation of policy version %d: return %.2f +- %.2f over %d episodes (%s)",
            report.policy_version,
            report.return_mean,
            report.return_std,
            report.episodes,
            "greedy" if report.greedy else "sampled",
        )

    def publish(self, snapshot: TelemetrySnapshot) -> None:
        """Serve a telemetry snapshot: to Prometheus first (a client that saw this record scrapes
        figures as new), then to the monitors."""
        if self.prometheus is not None:
            self.prometheus.update(snapshot)
        self.publisher.publish(snapshot)
