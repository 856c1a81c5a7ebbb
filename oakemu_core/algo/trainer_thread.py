"""The trainer thread of ``oakemu learner``: :func:`run_trainer` drives a
:class:`~oakemu_core.algo.learner.PPOLearner` over the rollouts the ingest thread publishes.

It waits for a full rollout (:class:`~oakemu_core.algo.handshake.RolloutHandshake`), prepares it
and runs one PPO update (:meth:`PPOLearner.prepare`, :meth:`PPOLearner.update`), lets the
:class:`~oakemu_core.algo.health.CheckpointPolicy` checkpoint and judge the run's health (rolling
back to the last good checkpoint on a collapse), notifies the tester
(:class:`~oakemu_core.algo.evaluations.EvaluationSchedule`), and hands the new weights back with
the trainer's counters. Behaviour-cloning pre-training runs first. When it stops, it evaluates
the final weights and writes the final checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oakemu_core.algo.handshake import RolloutHandshake, TrainResult

if TYPE_CHECKING:
    from oakemu_core.algo.health import CheckpointPolicy
    from oakemu_core.algo.learner import PPOLearner
    from oakemu_core.algo.update_stats import PPOUpdateStats

__all__ = ["run_trainer"]


def run_trainer(
    learner: PPOLearner,
    stop_event: threading.Event,
    current_step: Callable[[], int],
    handshake: RolloutHandshake,
    policy: CheckpointPolicy,
) -> None:
    """The trainer thread's loop: wait for a published rollout, run a PPO update, notify the tester,
    feed automatic rollback monitoring, and manage periodic and final checkpointing; hand each
    result back through ``handshake``.

    Args:
        learner: the learner it trains.
        stop_event: set by the ingest thread to stop training.
        current_step: the run's env steps now (the tester's global step).
        handshake: the hand-over with the ingest thread.
        policy: checkpoints, health checks and rollbacks.

    Once ``stop_event`` is set it evaluates the final weights (:meth:`EvaluationSchedule.final`,
    keeping ``best.pt``), writes the final checkpoint (``policy.final``: the checkpoint state
    reads the run's counters the ingest thread reported last) and hands back a last
    :class:`TrainResult` (no slot) with the evaluations and notes; then it returns. An exception
    (for example :class:`~oakemu_core.algo.health.RunCollapsedError`) is handed back through the
    handshake and ends the training; the final evaluation and checkpoint still follow, once
    ``stop_event`` is set. Every result carries the trainer's counters
    (:class:`~oakemu_core.algo.handshake.TrainerCounters`).
    """
    try:
        _train(learner, stop_event, current_step, handshake, policy)
    except BaseException as error:  # surfaced in the ingest thread, which stops the run
        handshake.complete(error)
        stop_event.wait()
    version, weights = learner.learner_model.snapshot()
    evaluations, notes = learner.evaluations.final(
        version, weights, global_step=current_step(), policy=policy, learner=learner
    )
    policy.final(learner)
    handshake.complete(_result(learner, policy, evaluations=evaluations, events=notes))


def _train(
    learner: PPOLearner,
    stop_event: threading.Event,
    current_step: Callable[[], int],
    handshake: RolloutHandshake,
    policy: CheckpointPolicy,
) -> None:
    done = learner.behaviour_cloning_phase()
    if done:
        events = [f"behaviour cloning: {done} replay-only updates"]
        handshake.complete(_result(learner, policy, events=events))
        learner.submit_to_tester(current_step(), force=True)
    while not stop_event.is_set():
        published = handshake.wait_for_rollout(stop_event)
        if published is None:
            return
        prepared = learner.prepare(published.rollout, reevaluate=published.reevaluate)
        stats = learner.update(prepared)
        buffer, used = prepared.buffer, prepared.columns_used
        columns = buffer.num_envs if used is None else int(used.sum())
        learner.trained_env_steps += max(0, columns * buffer.rollout_length - prepared.stale_rows)
        events = policy.after_update(learner, stats)
        evaluations, notes = learner.evaluations.poll(policy, learner)
        learner.submit_to_tester(current_step())
        handshake.complete(
            _result(
                learner,
                policy,
                slot=published.rollout.slot,
                stats=stats,
                stale_rows=prepared.stale_rows,
                lag=prepared.lag,
                evaluations=evaluations,
                events=events + notes,
                trainable_share=buffer.trainable_size / max(1, columns * buffer.rollout_length),
                rollbacks=policy.rollbacks,
                columns=columns,
                planned_columns=published.rollout.planned_columns or buffer.num_envs,
                trained_env_steps=learner.trained_env_steps,
            )
        )


def _result(
    learner: PPOLearner,
    policy: CheckpointPolicy,
    *,
    slot: int | None = None,
    stats: PPOUpdateStats | None = None,
    **fields: Any,
) -> TrainResult:
    """A :class:`TrainResult` of the learner's current weights, with the trainer's counters."""
    version, weights = learner.learner_model.snapshot()
    return TrainResult(
        slot,
        version,
        weights,
        stats,
        iterations=learner.iterations,
        learning_rate=learner.learning_rate,
        checkpoint_failures=policy.checkpoint_failures,
        **fields,
    )
