"""The figures a learner reports, kept between its updates: the episode window, the step rates,
the last update's statistics and lag, the history for the monitor's charts; and the builders of
its per-update metrics record and of its :class:`~oakemu_core.run.telemetry.TelemetrySnapshot`.

No sockets: the service publishes what :meth:`LearnerTelemetry.snapshot` returns.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from oakemu_core.run.metrics import EpisodeWindow, RunStepRates
from oakemu_core.run.metrics_table import record, snapshot_values
from oakemu_core.run.telemetry import ActorTelemetry, TelemetrySnapshot
from oakemu_core.run.telemetry_history import TelemetryHistory
from oakemu_core.transport.auth import public_tag

if TYPE_CHECKING:
    from oakemu_core.algo.handshake import TrainResult
    from oakemu_core.algo.update_stats import PPOUpdateStats
    from oakemu_core.storage.assembler import RolloutAssembler

__all__ = ["LearnerTelemetry"]

log = logging.getLogger("oakemu.learner")

EPISODE_WINDOW = 100
"""Finished episodes the return and length figures average over (CleanRL / SB3 log the last 100)."""


class LearnerTelemetry:
    """What the learner's metrics records and telemetry snapshots report.

    Args:
        run_name, env_id: the run folder's name and the env id, as snapshots carry them.
        started: monotonic time (s) the learner started. start_steps: env steps done before (a
            resumed run's steps are not this learner's work).

    Attributes:
        window: the last :data:`EPISODE_WINDOW` finished episodes (raw return, length).
        rates: env steps per second since ``started`` and over the last seconds.
        history: the run's training and evaluation curves.
        last_stats: the newest update's statistics (None before one with trainable rows).
        last_lag: policy lag ``min`` / ``mean`` / ``max`` (versions) of the newest update's rows.
        trainable_share: trainable rows / rows of the newest update's rollout.
        columns: ``(columns that held rows, planned columns)`` of the newest update's rollout.
    """

    def __init__(self, run_name: str, env_id: str, *, started: float, start_steps: int) -> None:
        self.run_name = run_name
        self.env_id = env_id
        self.window = EpisodeWindow(maxlen=EPISODE_WINDOW)
        self.rates = RunStepRates(started, start_steps)
        self.history = TelemetryHistory()
        self.last_stats: PPOUpdateStats | None = None
        self.last_lag: dict[str, float] = {}
        self.trainable_share = 1.0
        self.columns: tuple[int, int] | None = None

    def sps(self) -> float:
        """Env steps per second since the learner started (wall clock, start-up included), as of
        the last sample of :attr:`rates`."""
        return self.rates.overall()

    def record_update(
        self, result: TrainResult, global_step: int, now: float, *, actors: int
    ) -> dict[str, float]:
        """Take in one PPO update's result at ``global_step`` env steps (monotonic time ``now``, s)
        with ``actors`` connected; returns its metrics record: ``charts/*`` (update number, SPS,
        actors, policy version and lag in versions and in SGD steps, stale rows, trainable share,
        rollbacks, episode window), and CleanRL's ``losses/*`` when rows were trained."""
        self.rates.sample(now, global_step)
        self.last_lag = result.lag
        self.trainable_share = result.trainable_share
        self.columns = (result.columns, result.planned_columns)
        if result.stats is not None:
            self.last_stats = result.stats
        learner = {"sps": self.sps(), "sps_recent": self.rates.recent(), "actors": actors}
        scalars = record(
            {
                "result": result,
                "lag": result.lag,
                "stats": result.stats,
                "window": self.window if self.window.count else None,
                "learner": learner,
            }
        )
        episodic_return = self.window.mean if self.window.count else None
        self.history.record_update(global_step, episodic_return, self.sps())
        return scalars

    def log_update(
        self, result: TrainResult, global_step: int, *, episodes: int, actors: int
    ) -> None:
        """The update's log line (update number, env steps, SPS, episodes, mean return, losses,
        actors), after a warning when minibatches were skipped for a non-finite gradient."""
        stats = result.stats
        if stats is not None and stats.nonfinite_minibatches:
            log.warning(
                "update %d: %d minibatches had a non-finite gradient and were skipped",
                result.iterations,
                stats.nonfinite_minibatches,
            )
        ret = f"{self.window.mean:8.2f}" if self.window.count else "     n/a"
        loss = (
            (
                f"pg {stats.policy_loss:+.3f} v {stats.value_loss:.3f} ent {stats.entropy:.3f} "
                f"kl {stats.approx_kl:.4f}"
            )
            if stats
            else "no trainable rows"
        )
        fewer = (
            f" | {result.columns} of {result.planned_columns} columns"
            if result.columns and result.columns != result.planned_columns
            else ""
        )
        log.info(
            "update %5d | steps %9d | SPS %6.0f (recent %6.0f) | episodes %6d | return %s | %s | actors %d%s",
            result.iterations,
            global_step,
            self.sps(),
            self.rates.recent(),
            episodes,
            ret,
            loss,
            actors,
            fewer,
        )

    def snapshot(
        self,
        assembler: RolloutAssembler,
        *,
        policy_version: int,
        iterations: int,
        episodes: int,
        learning_rate: float,
        checkpoint_failures: int,
        log_write_failures: int,
        is_update: bool,
        trained_env_steps: int = 0,
    ) -> TelemetrySnapshot:
        """The learner's state now: these figures, the assembler's counters, buffer fill and actors
        (each actor's row lag since the last snapshot, else its heartbeat's), and the given values
        (``learning_rate``: the schedule's, reported until an update reports its own)."""
        now = time.monotonic()
        counters = assembler.counters
        figures = {
            "global_step": max(0, counters.env_steps),
            "policy_version": policy_version,
            "iterations": iterations,
            "trained_env_steps": trained_env_steps,
            "episodes": episodes,
            "learning_rate": learning_rate,
            "buffer_fill": min(1.0, assembler.buffer_fill()),
            "checkpoint_failures": checkpoint_failures,
            "log_write_failures": log_write_failures,
            "trainable_share": self.trainable_share,
            "rollout_columns": self.columns[0] if self.columns else None,
            "planned_columns": self.columns[1] if self.columns else None,
            **self.history.snapshot_fields(),
        }
        # The table's figures of the newest update's statistics and lag, the episode window and
        # the step rates; an update's own learning rate replaces the schedule's.
        figures |= snapshot_values(
            {
                "stats": self.last_stats,
                "lag": self.last_lag,
                "window": self.window if self.window.count else None,
                "learner": {"sps": self.sps(), "sps_recent": self.rates.recent()},
            }
        )
        return TelemetrySnapshot(
            time=time.time(),
            run_name=self.run_name,
            env_id=self.env_id,
            rejected_messages=dict(counters.rejected),
            dropped=dict(counters.dropped),
            messages_received=dict(counters.received),
            messages_accepted=dict(counters.accepted),
            actors=[
                ActorTelemetry(
                    actor_id=r.actor_id,
                    incarnation=public_tag(r.incarnation),
                    num_envs=r.spec.num_envs,
                    sps=r.env_steps_per_second,
                    last_heard_s=max(0.0, now - r.last_heard),
                    policy_lag=lag[1] if lag else r.policy_lag,
                    policy_lag_min=lag[0] if lag else None,
                    policy_lag_max=lag[2] if lag else None,
                )
                for r in assembler.actors.values()
                for lag in (r.take_lag(),)
            ],
            is_update=is_update,
            **figures,
        )
