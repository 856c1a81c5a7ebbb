"""The learner's training life (seed page 002): ``PPOLearner.step`` / ``run``, the rollout hand-off,
the checkpoint / rollback seam, and the lock-holding model container.

``PPOLearner.run`` is the trainer thread of ``oakemu learner``: it waits for a full rollout
published by the ingest thread (:class:`RolloutHandshake`), prepares it (drops rows whose policy
lag is too large, scales rewards, computes GAE on the CPU), runs one PPO update on the device
(:meth:`PPOLearner.step`), updates the observation statistics, notifies the tester, lets the
:class:`CheckpointPolicy` checkpoint and judge the run's health (rolling back to the last good
checkpoint on a collapse), and hands the new weights back. Behaviour-cloning pre-training on
demonstrations (``bc_sampler``) runs first, as replay-only rollouts of one epoch each.

The service (``services/learner.py``) only wires these pieces to sockets and loggers.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from oakemu_core.storage.assembler import FullRollout, drop_stale_rows
from oakemu_core.policy.models import load_optimizer_state, weights_to_arrays
from oakemu_core.algo.normalization import RewardScaler
from oakemu_core.algo.ppo import PRECISIONS, EmptyRolloutError, PPOUpdater, PPOUpdateStats, RolloutEvaluation
from oakemu_core.storage.rollout_buffer import RolloutBuffer

__all__ = [
    "CheckpointPolicy",
    "HealthMonitor",
    "PPOExperimentConfiguration",
    "PPOLearner",
    "PPOLearnerRuntimeState",
    "RolloutHandshake",
    "RunCollapsedError",
    "RuntimeContext",
    "Schedule",
    "ThreadSafeModel",
    "TrainResult",
    "WeightsRevision",
]

log = logging.getLogger("oakemu.learner")
C = TypeVar("C")


# ---------------------------------------------------------------------------------------------
# Configuration, context, schedule, model container
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PPOExperimentConfiguration:
    """The hyperparameters :class:`PPOLearner` reads (CleanRL ``ppo_atari.py`` defaults).

    Build from the service configuration with :meth:`from_config`; every field has the meaning
    of the :class:`oakemu_core.config.OakEmuConfig` field of the same name.

    Raises:
        ValueError: ``off_policy_correction`` is not ``"decoupled"`` or ``"none"``.
    """

    ppo_epochs: int = 4
    num_minibatches: int = 4
    clip_coef: float = 0.1
    clip_value_range: float | None = None
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    normalize_advantages: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    max_policy_lag: int = 2
    off_policy_correction: str = "decoupled"
    importance_weight_cap: float = 1.0
    normalize_rewards: bool = False
    seed: int = 1
    bc_pretrain_updates: int = 0
    bc_batch_size: int = 256
    bc_coef: float = 0.0
    bc_coef_decay: float = 1.0
    learner_precision: str = "float32"

    def __post_init__(self) -> None:
        if self.off_policy_correction not in ("decoupled", "none"):
            raise ValueError(f"off_policy_correction: expected 'decoupled' or 'none', "
                             f"received {self.off_policy_correction!r}")
        if self.learner_precision not in PRECISIONS:
            raise ValueError(f"learner_precision: expected one of {list(PRECISIONS)}, "
                             f"received {self.learner_precision!r}")

    @classmethod
    def from_config(cls, config: Any) -> PPOExperimentConfiguration:
        """Pick the fields above from an :class:`~oakemu_core.config.OakEmuConfig` (or anything with
        those attributes; ``clip_value_range`` is taken resolved)."""
        values = {}
        for name in cls.__dataclass_fields__:
            if name == "clip_value_range":
                values[name] = getattr(config, "resolved_clip_value_range", None)
            elif hasattr(config, name):
                values[name] = getattr(config, name)
        return cls(**values)


class Schedule(Protocol):
    """A value per update (e.g. :class:`oakemu_core.algo.ppo.LinearSchedule`)."""

    def value(self) -> float: ...

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RuntimeContext(Generic[C]):
    """What the learner shares with the process around it.

    Attributes:
        config: the experiment configuration (:class:`PPOExperimentConfiguration`).
        device: where updates run.
        tester: periodic evaluation (:class:`oakemu_core.run.tester.Tester`-like: ``submit(version,
            weights, global_step)`` and ``poll()``), or None.
        eval_every_updates: submit the weights to the tester every this many updates (0: never).
    """

    config: C
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tester: Any = None
    eval_every_updates: int = 0


class ThreadSafeModel:
    """The learner's model behind a lock: the trainer holds it while updating, readers take weight
    snapshots between updates, and a monotonic :attr:`version` says which weights these are.

    Args:
        model: the actor-critic (moved by the caller to the learner device).
        version: policy version of the current weights.
    """

    def __init__(self, model: torch.nn.Module, version: int = 0) -> None:
        self.model = model
        self.version = int(version)
        self._lock = threading.RLock()

    @contextmanager
    def locked(self) -> Iterator[torch.nn.Module]:
        """Hold the lock for a block (the update, a restore); yields the model."""
        with self._lock:
            yield self.model

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(version, weights as float32 numpy arrays)``, consistent under the lock."""
        with self._lock:
            return self.version, weights_to_arrays(self.model)


@dataclass
class WeightsRevision:
    """Weights an epoch left within an update (``publish_every_epoch``), for the ingest thread to
    publish: revision ``revision`` of ``policy_version`` (the version in training)."""

    policy_version: int
    revision: int
    weights: dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Hand-off between ingest and training
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What the trainer hands back after a rollout (or a behaviour-cloning phase).

    Attributes:
        slot: the rollout buffer's slot (to release), or None for a BC phase.
        policy_version: version of ``weights``. weights: the new weights.
        stats: the update's statistics (None when no row was trainable).
        stale_rows: rows dropped for policy lag. lag: lag ``min``/``mean``/``max``/``newest_version``.
        iterations: PPO updates so far. evaluations: tester reports that arrived meanwhile.
        events: human-readable notes (rollbacks, BC phases) to log.
        trainable_share: trainable rows / rows of the rollout.
    """

    slot: int | None
    policy_version: int
    weights: dict[str, np.ndarray]
    stats: PPOUpdateStats | None
    stale_rows: int = 0
    lag: dict[str, float] = field(default_factory=dict)
    iterations: int = 0
    evaluations: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    trainable_share: float = 1.0
    rollbacks: int = 0


class RolloutHandshake:
    """Synchronises the hand-off of full rollouts from the ingest thread to the trainer.

    At most one rollout is in training at a time: :attr:`busy` is True from :meth:`publish` until
    the ingest thread collects its result with :meth:`results`.

    :attr:`wake_fd` becomes readable when a result is handed back: the ingest thread polls it next
    to its sockets, so it collects a result (and releases its buffer, publishes its weights) at
    once instead of at its next poll timeout, when no step message would wake it. :meth:`close`
    releases it.
    """

    def __init__(self) -> None:
        self._inbox: queue.Queue[FullRollout] = queue.Queue(maxsize=1)
        self._outbox: queue.Queue[TrainResult | WeightsRevision | BaseException] = queue.Queue()
        self._busy = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    @property
    def wake_fd(self) -> int:
        """A file descriptor that is readable while a handed-back result waits (for a poller)."""
        return self._wake_read

    def close(self) -> None:
        """Release :attr:`wake_fd` (idempotent)."""
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_read = self._wake_write = -1

    @property
    def busy(self) -> bool:
        """A rollout was published and its result not collected yet."""
        return self._busy

    def publish(self, rollout: FullRollout) -> None:
        """Ingest thread: hand a full rollout to training. Raises RuntimeError when busy."""
        if self._busy:
            raise RuntimeError("RolloutHandshake.publish: the previous rollout is still in training")
        self._busy = True
        self._inbox.put(rollout)

    def wait_for_rollout(self, stop_event: threading.Event, timeout_s: float = 0.1) -> FullRollout | None:
        """Trainer: the next published rollout, or None once ``stop_event`` is set (polls every
        ``timeout_s`` seconds)."""
        while not stop_event.is_set():
            try:
                return self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                continue
        return None

    def complete(self, result: TrainResult | WeightsRevision | BaseException) -> None:
        """Trainer: hand back a result (a rollout's, an unsolicited one such as BC pre-training or
        weights within an update, or the exception that ended training)."""
        self._outbox.put(result)
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # full: already readable; closed: nobody polls any more
            pass

    def results(self) -> list[TrainResult | WeightsRevision]:
        """Ingest thread: every result ready now (non-blocking), in order; a rollout's result clears
        :attr:`busy`. Re-raises an exception the trainer handed back."""
        try:  # drained before the queue is read: a result handed back meanwhile wakes the next poll
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        ready = []
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return ready
            if isinstance(item, BaseException):
                raise RuntimeError("trainer thread failed") from item
            if isinstance(item, TrainResult) and item.slot is not None:
                self._busy = False
            ready.append(item)


# ---------------------------------------------------------------------------------------------
# Health, checkpoints and rollback
# ---------------------------------------------------------------------------------------------
class RunCollapsedError(RuntimeError):
    """The run kept collapsing after the configured number of rollbacks: training stops."""


@dataclass
class HealthMonitor:
    """Judges an update (and the evaluations) for signs of a collapsed run.

    A collapse is: a non-finite loss or weight; an approximate KL above ``max_approx_kl``; or the
    evaluation return below ``eval_fraction`` of the best evaluation (measured from the worst
    return seen, so negative-return games work) for ``eval_patience`` evaluations in a row.

    Args:
        max_approx_kl: KL threshold (None: not checked).
        eval_fraction: in (0, 1); None disables the evaluation check.
        eval_patience: consecutive low evaluations that make a collapse.
    """

    max_approx_kl: float | None = 1.0
    eval_fraction: float | None = 0.5
    eval_patience: int = 3
    best_eval: float = -math.inf
    worst_eval: float = math.inf
    low_evaluations: int = 0

    def check_update(self, stats: PPOUpdateStats | None, model: torch.nn.Module) -> str | None:
        """Why this update collapsed the run, or None."""
        if stats is not None:
            for name in ("policy_loss", "value_loss", "entropy", "approx_kl"):
                if not math.isfinite(getattr(stats, name)):
                    return f"non-finite {name} ({getattr(stats, name)})"
            if self.max_approx_kl is not None and stats.approx_kl > self.max_approx_kl:
                return f"approx_kl {stats.approx_kl:.3g} > {self.max_approx_kl:g}"
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"non-finite weights in {name}"
        return None

    def check_evaluation(self, mean_return: float) -> str | None:
        """Record an evaluation; why the run collapsed, or None."""
        self.worst_eval = min(self.worst_eval, mean_return)
        improved = mean_return > self.best_eval
        self.best_eval = max(self.best_eval, mean_return)
        if self.eval_fraction is None or improved or not math.isfinite(self.worst_eval):
            self.low_evaluations = 0
            return None
        floor = self.worst_eval + self.eval_fraction * (self.best_eval - self.worst_eval)
        self.low_evaluations = self.low_evaluations + 1 if mean_return < floor else 0
        if self.low_evaluations >= self.eval_patience:
            self.low_evaluations = 0
            return (f"evaluation return {mean_return:.2f} below {self.eval_fraction:g} of the best "
                    f"({self.best_eval:.2f}) for {self.eval_patience} evaluations")
        return None


class CheckpointPolicy:
    """When and where the learner checkpoints, and how it recovers from a collapse.

    Periodic checkpoints every ``every_updates`` updates and/or ``every_seconds`` of wall time,
    a final one, ``best.pt`` for the best evaluation, the newest ``keep_last`` numbered files
    kept. On a collapse (:class:`HealthMonitor`) the learner is restored from ``best.pt`` (or
    the latest checkpoint), its learning rate multiplied by ``lr_factor``, and its weights
    published under a new policy version; after ``max_rollbacks`` rollbacks
    :class:`RunCollapsedError` stops training.

    Args:
        run_dir: the run folder (``checkpoints/`` inside).
        state_fn: returns the complete checkpoint state (learner state plus the service's counters).
        save_fn: ``(run_dir, update, state) -> Path | None``: writes one numbered checkpoint and
            points ``latest.pt`` at it (None when the write failed and was reported).
        health: the collapse detector, None: no rollback.
        every_updates, every_seconds: periodic checkpoints (0: off).
        lr_factor: learning-rate multiplier per rollback, in (0, 1].
        max_rollbacks: rollbacks before giving up.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        state_fn: Callable[[], dict[str, Any]],
        save_fn: Callable[[Path, int, dict[str, Any]], Path | None],
        health: HealthMonitor | None = None,
        every_updates: int = 50,
        every_seconds: float = 0.0,
        lr_factor: float = 0.5,
        max_rollbacks: int = 3,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.state_fn = state_fn
        self.save_fn = save_fn
        self.health = health
        self.every_updates = int(every_updates)
        self.every_seconds = float(every_seconds)
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = int(max_rollbacks)
        self.rollbacks = 0
        self._last_save = time.monotonic()
        from oakemu_core.run.tester import BestCheckpointTracker

        self.best = BestCheckpointTracker(self.run_dir)

    @property
    def best_path(self) -> Path:
        return self.best.path

    def save(self, update: int) -> Path | None:
        """Write a numbered checkpoint of the current state now."""
        self._last_save = time.monotonic()
        return self.save_fn(self.run_dir, update, self.state_fn())

    def after_update(self, learner: PPOLearner, stats: PPOUpdateStats | None) -> list[str]:
        """Judge the update, roll back if it collapsed, checkpoint when due; returns notes to log.

        Raises:
            RunCollapsedError: a collapse after ``max_rollbacks`` rollbacks.
        """
        reason = self.health.check_update(stats, learner.model) if self.health is not None else None
        if reason is not None:
            return [self.roll_back(learner, reason)]
        due_updates = self.every_updates and learner.iterations % self.every_updates == 0
        due_time = self.every_seconds and time.monotonic() - self._last_save >= self.every_seconds
        if stats is not None and (due_updates or due_time):
            self.save(learner.iterations)
        return []

    def after_evaluation(self, learner: PPOLearner, report: Any) -> list[str]:
        """Record a tester report (:class:`oakemu_core.run.tester.EvaluationReport`): keep ``best.pt``
        (the evaluated weights) when it is the best so far, roll back on an evaluation collapse."""
        mean = float(report.return_mean)
        if self.health is not None and (reason := self.health.check_evaluation(mean)) is not None:
            return [self.roll_back(learner, reason)]
        try:
            if self.best.consider(report, self.state_fn):
                return [f"best.pt: evaluation return {mean:.2f} (policy version {report.policy_version})"]
        except OSError as error:
            return [f"could not write {self.best.path}: {error}"]
        return []

    def roll_back(self, learner: PPOLearner, reason: str) -> str:
        """Restore the last good checkpoint, lower the learning rate, bump the policy version.

        Raises:
            RunCollapsedError: after ``max_rollbacks`` rollbacks, or with no checkpoint to go back to.
        """
        from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint

        if self.rollbacks >= self.max_rollbacks:
            raise RunCollapsedError(f"the run collapsed again ({reason}) after {self.rollbacks} rollbacks: stopping; "
                                    f"lower the learning rate or check the env's rewards")
        path = self.best_path if self.best_path.is_file() else latest_checkpoint(self.run_dir)
        if path is None:
            raise RunCollapsedError(f"the run collapsed ({reason}) before any checkpoint was written: stopping")
        learner.restore_weights(load_checkpoint(path, map_location=learner.device), lr_factor=self.lr_factor)
        self.rollbacks += 1
        if self.health is not None:
            self.health.low_evaluations = 0
        return (f"rollback {self.rollbacks}/{self.max_rollbacks}: {reason}; restored {path.name}, learning rate "
                f"x{learner.lr_scale:g}, policy version {learner.policy_version}")

    def final(self, learner: PPOLearner) -> Path | None:
        """The final checkpoint (at exit)."""
        return self.save(learner.iterations)


# ---------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------
@dataclass
class PPOLearnerRuntimeState:
    """Learner counters for checkpoints: PPO updates, rollouts consumed, policy version, the
    shuffle generator's state, the learning-rate scale left by rollbacks, and BC progress."""

    iterations: int = 0
    rollouts_collected: int = 0
    policy_version: int = 0
    shuffle_rng_state: dict[str, Any] | None = None
    lr_scale: float = 1.0
    bc_updates_done: int = 0
    reward_scaler: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> PPOLearnerRuntimeState:
        """Inverse of :meth:`to_dict` (missing newer keys take their defaults); raises ValueError
        naming a missing counter."""
        for key in ("iterations", "rollouts_collected", "policy_version"):
            if key not in state:
                raise ValueError(f"PPOLearnerRuntimeState: missing {key!r}, got keys {sorted(state)}")
        known = {k: state[k] for k in cls.__dataclass_fields__ if k in state}
        return cls(**known)


class PPOLearner:
    """PPO learner that performs clipped policy-gradient updates on completed rollouts.

    Args:
        context: the runtime context (configuration, device, tester).
        learner_model: the model container (with lock); its model is moved to the device.
        rollout_buffer: the rollout buffer :meth:`step` consumes (``run`` points it at each
            published rollout in turn).
        optimizer: optimizer over the model's parameters (CleanRL: Adam, eps 1e-5).
        lr_schedule: learning rate per update (a :class:`Schedule`).
        action_mask: optional ``(mask width,)`` bool tensor on the learner device, ANDed with
            every row's mask (e.g. actions a game never allows).
        bc_sampler: optional behaviour-cloning data source
            (:class:`oakemu_core.algo.demonstrations.DemonstrationSampler`).
    """

    def __init__(
        self,
        context: RuntimeContext[PPOExperimentConfiguration],
        learner_model: ThreadSafeModel,
        rollout_buffer: RolloutBuffer | None,
        optimizer: torch.optim.Optimizer,
        lr_schedule: Schedule | None,
        action_mask: torch.Tensor | None = None,
        bc_sampler: Any = None,
    ) -> None:
        config = context.config
        self.context = context
        self.config = config
        self.learner_model = learner_model
        self.rollout_buffer = rollout_buffer
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.action_mask = action_mask
        self.bc_sampler = bc_sampler
        self.device = torch.device(context.device)
        self.updater = PPOUpdater(
            learner_model.model, optimizer, device=self.device, ppo_epochs=config.ppo_epochs,
            num_minibatches=config.num_minibatches, clip_coef=config.clip_coef,
            clip_value_range=config.clip_value_range, ent_coef=config.ent_coef, vf_coef=config.vf_coef,
            max_grad_norm=config.max_grad_norm, target_kl=config.target_kl,
            normalize_advantages=config.normalize_advantages, lr_schedule=None, seed=config.seed,
            action_mask=action_mask, importance_weight_cap=config.importance_weight_cap,
            precision=config.learner_precision,
        )
        self._proximal: tuple[RolloutBuffer, RolloutEvaluation] | None = None
        self.corrections_skipped = 0
        """Updates whose re-evaluation gave non-finite figures (a diverged critic or policy): they
        trained without the off-policy correction, and the health checks judge the update."""
        self.reevaluate_every_rollout = False
        """True once an actor acts with rounded weights (a bfloat16 forward): every rollout is then
        re-evaluated in float32, not only those with rows of older versions (decoupled objective)."""
        self.reward_scaler = RewardScaler(config.gamma) if config.normalize_rewards else None
        self.lr_scale = 1.0
        self.bc_updates_done = 0
        self._rollouts_collected = 0
        self.sgd_steps = 0
        """SGD (minibatch gradient) steps taken by this learner process (not checkpointed)."""
        self._sgd_steps_at: dict[tuple[int, int], int] = {}  # (version, revision) -> SGD steps when published
        self.revision_sink: Callable[[int, int, dict[str, np.ndarray]], None] | None = None
        """``(policy_version, revision, weights)`` -> None: receives the weights after each epoch but
        the last of an update (``publish_every_epoch``; the service sets it in asynchronous mode)."""
        self.revision_max_approx_kl: float | None = None
        """Weights of an epoch whose mean approx KL is above this are not handed to the sink (the
        health check's threshold: the update may be rolled back); None: no limit."""
        self.revision_min_sgd_steps = 1
        """An epoch's weights go to the sink only when at least this many SGD steps were taken since
        the weights last published (a version or a revision); 1: after every epoch."""

    # ------------------------------------------------------------------ counters and state
    @property
    def model(self) -> torch.nn.Module:
        return self.learner_model.model

    @property
    def iterations(self) -> int:
        """PPO updates completed (behaviour-cloning updates included)."""
        return self.updater.iterations

    @property
    def rollouts_collected(self) -> int:
        """Rollouts consumed (actor rollouts and replay-only BC rollouts)."""
        return self._rollouts_collected

    @property
    def policy_version(self) -> int:
        """Version of the learner's current weights (monotonic, also across rollbacks)."""
        return self.learner_model.version

    def state(self) -> PPOLearnerRuntimeState:
        """Counters and generator state for a checkpoint."""
        return PPOLearnerRuntimeState(
            iterations=self.iterations, rollouts_collected=self._rollouts_collected,
            policy_version=self.policy_version, shuffle_rng_state=self.updater.shuffle_rng_state(),
            lr_scale=self.lr_scale, bc_updates_done=self.bc_updates_done,
            reward_scaler=None if self.reward_scaler is None else self.reward_scaler.state_dict(),
        )

    def restore_state(self, state: PPOLearnerRuntimeState) -> None:
        """Restore checkpointed learner counters (model, optimizer and schedule are restored by
        their own ``load_state_dict``). Raises ValueError for negative counters."""
        if min(state.iterations, state.rollouts_collected, state.policy_version) < 0:
            raise ValueError(f"PPOLearnerRuntimeState: counters must be >= 0, got {state}")
        self.updater.restore_counters(state.iterations, state.shuffle_rng_state)
        self._rollouts_collected = int(state.rollouts_collected)
        self.learner_model.version = int(state.policy_version)
        self.lr_scale = float(state.lr_scale)
        self.bc_updates_done = int(state.bc_updates_done)
        if self.reward_scaler is not None and state.reward_scaler:
            self.reward_scaler.load_state_dict(state.reward_scaler)

    def checkpoint_state(self) -> dict[str, Any]:
        """Model, optimizer, schedule and counters as plain values for a checkpoint."""
        with self.learner_model.locked() as model:
            return {
                "model": model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_schedule": None if self.lr_schedule is None else self.lr_schedule.state_dict(),
                "ppo": self.state().to_dict(),
            }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`checkpoint_state` (resume)."""
        with self.learner_model.locked() as model:
            model.load_state_dict(state["model"])
            load_optimizer_state(self.optimizer, state["optimizer"])
            if self.lr_schedule is not None and state.get("lr_schedule"):
                self.lr_schedule.load_state_dict(state["lr_schedule"])
            self.restore_state(PPOLearnerRuntimeState.from_dict(state["ppo"]))

    def restore_weights(self, state: dict[str, Any], *, lr_factor: float) -> None:
        """Rollback: model and optimizer from ``state``, learning rate scaled by ``lr_factor``,
        and a NEW policy version (versions never go back, so actors and lag checks stay sane)."""
        with self.learner_model.locked() as model:
            model.load_state_dict(state["model"])
            load_optimizer_state(self.optimizer, state["optimizer"])
            self.lr_scale *= float(lr_factor)
            self.learner_model.version += 1
        self._note_sgd_steps(self.policy_version, 0, self.sgd_steps)

    # ------------------------------------------------------------------ one update
    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update: the schedule's value (else the optimizer's) times
        :attr:`lr_scale` (lowered by rollbacks)."""
        base = self.lr_schedule.value() if self.lr_schedule is not None else self.optimizer.param_groups[0]["lr"]
        return float(base) * self.lr_scale

    def _note_sgd_steps(self, version: int, revision: int, sgd_steps: int) -> None:
        """Remember how many SGD steps had been taken when revision ``revision`` of ``version``
        was published (the entries of the newest 256 versions are kept)."""
        self._sgd_steps_at[(version, revision)] = sgd_steps
        # Keys arrive in increasing order (a dict keeps it): the oldest are at the front.
        while (oldest := next(iter(self._sgd_steps_at)))[0] < version - 255:
            del self._sgd_steps_at[oldest]

    def lag_in_sgd_steps(self, policy_versions: np.ndarray,
                         policy_revisions: np.ndarray | None = None) -> dict[str, float]:
        """Policy lag of rows measured in SGD steps instead of versions (one version is a whole
        update: ``ppo_epochs x num_minibatches`` SGD steps, fewer when ``target_kl`` stops early).

        A row acted by revision ``r`` of version ``v`` lags ``sgd_steps(now) - sgd_steps(when
        (v, r) was published)``: a revision published within an update counts the SGD steps the
        update had taken by then, a version made by a rollback or behaviour cloning none. Weights
        this process never published (before a resume) count ``(current version - v) * ppo_epochs
        * num_minibatches``.

        Args:
            policy_versions: the rows' versions (any shape, int).
            policy_revisions: their revisions, the same shape; None: all 0.

        Returns:
            ``{"sgd_min", "sgd_mean", "sgd_max"}`` in SGD steps.
        """
        if policy_versions.size == 0:
            return {"sgd_min": 0.0, "sgd_mean": 0.0, "sgd_max": 0.0}
        if policy_revisions is None:
            policy_revisions = np.zeros_like(policy_versions)
        nominal = self.config.ppo_epochs * self.config.num_minibatches
        pairs, counts = np.unique(np.stack([np.ravel(policy_versions), np.ravel(policy_revisions)], axis=1),
                                  axis=0, return_counts=True)
        current = self.policy_version
        lags = np.array([
            self.sgd_steps - self._sgd_steps_at[(v, r)] if (v, r) in self._sgd_steps_at
            else max(0, current - v) * nominal
            for v, r in pairs.tolist()
        ], dtype=np.float64)
        return {"sgd_min": float(lags.min()), "sgd_mean": float((lags * counts).sum() / counts.sum()),
                "sgd_max": float(lags.max())}

    def prepare(self, rollout: FullRollout) -> tuple[int, dict[str, float]]:
        """Make a published rollout the current buffer: drop rows too stale for PPO, re-evaluate
        rows acted by older versions (``off_policy_correction="decoupled"``), scale the rewards
        (if on), compute GAE on the CPU. Returns ``(stale rows, lag statistics)``.

        Re-evaluation (asynchronous mode): when any row was acted by an older version than the
        learner's, or :attr:`reevaluate_every_rollout` (actors with bfloat16 forward passes, in either
        mode), every row is evaluated with the current weights. The current critic's V(s_t)
        replace the stored values before GAE (the bootstrap values after the segment's last row
        and at truncations stay the actors'), and the current policy becomes the proximal policy
        of the next :meth:`step` (decoupled objective, :func:`oakemu_core.algo.ppo.ppo_losses`). A
        rollout whose rows are all of the current version (every rollout in sync mode) is left
        as it is unless :attr:`reevaluate_every_rollout`. A re-evaluation with non-finite figures
        is not used (:attr:`corrections_skipped`)."""
        buffer = rollout.buffer
        self.rollout_buffer = buffer
        stale_rows, lag = drop_stale_rows(buffer, current_policy_version=self.policy_version,
                                          max_policy_lag=self.config.max_policy_lag)
        lag.update(self.lag_in_sgd_steps(buffer.policy_versions, buffer.policy_revisions))
        self._proximal = None
        if self.config.off_policy_correction == "decoupled" and (
                self.reevaluate_every_rollout or bool((buffer.policy_versions != self.policy_version).any())):
            with self.learner_model.locked():
                evaluation = self.updater.evaluate_rollout(buffer)
            if evaluation.finite_on(buffer.trainable):
                buffer.replace_values(evaluation.values)
                self._proximal = (buffer, evaluation)
            else:
                self.corrections_skipped += 1
                log.warning("update %d: the current weights give non-finite values or log-probs on this "
                            "rollout; it trains without the off-policy correction", self.iterations + 1)
        if self.reward_scaler is not None:
            buffer.scale_rewards(self.reward_scaler.update(buffer.rewards, buffer.dones))
        buffer.compute_gae(rollout.last_values, rollout.last_dones, self.config.gamma, self.config.gae_lambda)
        return stale_rows, lag

    def step(self, actor_steps: int) -> PPOUpdateStats | None:
        """Perform a full PPO update on the current rollout buffer contents (GAE computed).

        Runs ``ppo_epochs`` epochs on the trainable rows; with a BC sampler and ``bc_coef`` > 0 a
        behaviour-cloning term (decaying by ``bc_coef_decay`` per update) joins the loss. The
        observation statistics are updated afterwards, so the rows were judged with the
        statistics they were acted with.

        Args:
            actor_steps: the current actor step count (for logging).

        Returns:
            The update's statistics, or None when the buffer has no trainable row.

        Raises:
            ValueError: no rollout buffer. StaleAdvantagesError: GAE not computed since the last write.
        """
        if self.rollout_buffer is None:
            raise ValueError("PPOLearner.step: no rollout buffer")
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        bc_term = None
        if self.bc_sampler is not None and self.config.bc_coef > 0:
            coef = self.config.bc_coef * self.config.bc_coef_decay ** self.iterations
            bc_term = (coef, self.bc_sampler, self.config.bc_batch_size)
        stats = None
        # The proximal policy describes the buffer prepare() evaluated, under the weights before this update.
        proximal, self._proximal = self._proximal, None
        evaluation = proximal[1] if proximal is not None and proximal[0] is self.rollout_buffer else None
        with self.learner_model.locked() as model:
            try:
                stats = self.updater.step(self.rollout_buffer, current_policy_version=self.policy_version,
                                          bc_term=bc_term, proximal=evaluation,
                                          after_epoch=None if self.revision_sink is None else self._publish_revision)
            except EmptyRolloutError:
                stats = None
            model.update_observation_statistics(self.rollout_buffer.observations)
            self.learner_model.version += 1
        self.sgd_steps += stats.minibatches if stats is not None else 0
        self._note_sgd_steps(self.policy_version, 0, self.sgd_steps)
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        self._rollouts_collected += 1
        log.debug("update %d at %d actor steps", self.iterations, actor_steps)
        return stats

    def _publish_revision(self, epochs_done: int, approx_kl: float, nonfinite_minibatches: int,
                          update_sgd_steps: int) -> None:
        """Hand the weights an epoch left (revision ``epochs_done`` of the version in training) to
        :attr:`revision_sink`; called by the updater, with the model lock held. Kept back, for the
        health check to judge at the end of the update: weights after a skipped non-finite
        gradient, after an epoch whose approx KL passed :attr:`revision_max_approx_kl`, or that
        are not finite. Skipped while fewer than :attr:`revision_min_sgd_steps` SGD steps passed
        since the last published weights."""
        assert self.revision_sink is not None
        sgd_steps = self.sgd_steps + update_sgd_steps
        last_published = next(reversed(self._sgd_steps_at.values()), 0)  # entries are kept in publishing order
        if sgd_steps - last_published < self.revision_min_sgd_steps:
            return
        if nonfinite_minibatches or not math.isfinite(approx_kl) or (
                self.revision_max_approx_kl is not None and approx_kl > self.revision_max_approx_kl):
            return
        weights = weights_to_arrays(self.model)
        if all(np.isfinite(array).all() for array in weights.values()):
            self._note_sgd_steps(self.policy_version, epochs_done, sgd_steps)
            self.revision_sink(self.policy_version, epochs_done, weights)

    def behaviour_cloning_phase(self) -> int:
        """Pre-train on demonstrations: ``bc_pretrain_updates`` replay-only rollouts of one epoch
        each (not multiplied by ``ppo_epochs``), skipping those done before a resume. Returns the
        number of BC updates run now."""
        remaining = self.config.bc_pretrain_updates - self.bc_updates_done
        if self.bc_sampler is None or remaining <= 0:
            return 0
        from oakemu_core.algo.demonstrations import behaviour_cloning_update

        with self.learner_model.locked() as model:
            for _ in range(remaining):
                behaviour_cloning_update(
                    model, self.optimizer, self.bc_sampler, batch_size=self.config.bc_batch_size,
                    device=self.device, max_grad_norm=self.config.max_grad_norm,
                )
                self.bc_updates_done += 1
                self._rollouts_collected += 1
            self.learner_model.version += 1
        self._note_sgd_steps(self.policy_version, 0, self.sgd_steps)
        return remaining

    # ------------------------------------------------------------------ the loop
    def run(
        self,
        stop_event: threading.Event,
        current_step: Callable[[], int],
        rollout_handshake: RolloutHandshake,
        policy: CheckpointPolicy,
    ) -> None:
        """Main learner loop: wait for a published rollout, run a PPO update, notify the tester,
        feed automatic rollback monitoring, and manage periodic checkpointing; hand each result
        back through ``rollout_handshake``. Returns when ``stop_event`` is set (the service then
        writes the final checkpoint with ``policy.final``). An exception (for example
        :class:`RunCollapsedError`) is handed back through the handshake and ends the loop."""
        try:
            self._run(stop_event, current_step, rollout_handshake, policy)
        except BaseException as error:  # surfaced in the ingest thread, which stops the run
            rollout_handshake.complete(error)

    def _run(self, stop_event: threading.Event, current_step: Callable[[], int],
             handshake: RolloutHandshake, policy: CheckpointPolicy) -> None:
        done = self.behaviour_cloning_phase()
        if done:
            version, weights = self.learner_model.snapshot()
            handshake.complete(TrainResult(None, version, weights, None, iterations=self.iterations,
                                           events=[f"behaviour cloning: {done} replay-only updates"]))
            self._submit_to_tester(current_step(), force=True)
        while not stop_event.is_set():
            rollout = handshake.wait_for_rollout(stop_event)
            if rollout is None:
                return
            stale_rows, lag = self.prepare(rollout)
            trainable = self.rollout_buffer.trainable_size
            stats = self.step(current_step())
            events = policy.after_update(self, stats)
            evaluations, notes = self._poll_tester(policy)
            events += notes
            self._submit_to_tester(current_step())
            version, weights = self.learner_model.snapshot()
            handshake.complete(TrainResult(
                rollout.slot, version, weights, stats, stale_rows, lag, self.iterations, evaluations, events,
                trainable_share=trainable / max(1, self.rollout_buffer.total_size), rollbacks=policy.rollbacks,
            ))

    def _submit_to_tester(self, global_step: int, *, force: bool = False) -> None:
        """Submit the weights every ``eval_every_updates`` updates; ``force``: now, and kept (the
        behaviour-cloned weights are evaluated whatever follows)."""
        tester, every = self.context.tester, self.context.eval_every_updates
        if tester is None or not (force or (every and self.iterations % every == 0)):
            return
        version, weights = self.learner_model.snapshot()
        tester.submit(version, weights, global_step, keep=force)

    def _poll_tester(self, policy: CheckpointPolicy) -> tuple[list[Any], list[str]]:
        tester = self.context.tester
        if tester is None:
            return [], []
        reports, notes = tester.poll(), []
        for report in reports:
            notes += policy.after_evaluation(self, report)
        return reports, notes
