"""The learner's training step: :class:`PPOLearner` (one rollout prepared and trained on, its
counters and checkpoint state) and the lock-holding model container :class:`ThreadSafeModel`.

:meth:`PPOLearner.prepare` drops rows whose policy lag is too large, re-evaluates rows of older
versions, scales rewards and computes GAE on the CPU; :meth:`PPOLearner.update` runs one PPO update
on the device (:class:`~oakemu_core.algo.ppo.PPOUpdater`) and updates the observation statistics.
:meth:`PPOLearner.step` is the same update on the buffer given at construction, and
:meth:`PPOLearner.run` the trainer thread's loop; :class:`RuntimeContext` carries the settings
(:data:`PPOExperimentConfiguration`, another name of :class:`~oakemu_core.algo.settings.PPOSettings`)
and the collaborators the learner shares with the process around it.
Behaviour-cloning pre-training on demonstrations (``bc_sampler``) runs as replay-only rollouts of
one epoch each. The trainer thread that drives it over published rollouts is
:func:`oakemu_core.algo.trainer_thread.run_trainer`; the service (``oakemu_services.learner``) only
wires these pieces to sockets and loggers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

from oakemu_core.algo.evaluations import EvaluationSchedule
from oakemu_core.algo.lag import SgdStepLedger, drop_stale_rows
from oakemu_core.algo.normalization import RewardScaler
from oakemu_core.algo.ppo import EmptyRolloutError, PPOUpdater
from oakemu_core.algo.reevaluation import RolloutEvaluation
from oakemu_core.algo.schedules import Schedule
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.algo.trainer_thread import run_trainer
from oakemu_core.algo.update_stats import PPOUpdateStats
from oakemu_core.policy.models import load_optimizer_state, weights_to_arrays
from oakemu_core.storage.buffer_ring import FullRollout
from oakemu_core.storage.rollout_buffer import RolloutBuffer

if TYPE_CHECKING:
    from oakemu_core.algo.handshake import RolloutHandshake
    from oakemu_core.algo.health import CheckpointPolicy

__all__ = [
    "PPOExperimentConfiguration",
    "PPOLearner",
    "PPOLearnerRuntimeState",
    "PreparedRollout",
    "RuntimeContext",
    "ThreadSafeModel",
]

PPOExperimentConfiguration = PPOSettings
"""The learner's hyperparameters under the name the learner's API uses: the same class as
:class:`~oakemu_core.algo.settings.PPOSettings` (build it with :meth:`PPOSettings.from_config`)."""

C = TypeVar("C", bound=PPOSettings)


@dataclass(frozen=True)
class RuntimeContext(Generic[C]):
    """What the learner shares with the process around it: its settings and collaborators.

    Attributes:
        config: the hyperparameters (:data:`PPOExperimentConfiguration`).
        device: where updates run (``"cpu"``, ``"cuda"``, a :class:`torch.device`).
        tester: periodic evaluation (:class:`oakemu_core.run.tester.Tester`-like: ``submit(version,
            weights, global_step, keep=)``, ``poll()``, ``drain(timeout_s=)``, ``alive``), or None.
        eval_every_updates: submit the weights to the tester every this many updates (0: never).
    """

    config: C
    device: str | torch.device = "cpu"
    tester: Any = None
    eval_every_updates: int = 0


log = logging.getLogger("oakemu.learner")


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
    trained_env_steps: int | None = None
    """Env steps of the rollouts PPO trained on (rows of each rollout less its stale rows); None in
    checkpoints that predate the count."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> PPOLearnerRuntimeState:
        """Inverse of :meth:`to_dict` (missing newer keys take their defaults); raises ValueError
        naming a missing counter."""
        for key in ("iterations", "rollouts_collected", "policy_version"):
            if key not in state:
                raise ValueError(
                    f"PPOLearnerRuntimeState: missing {key!r}, got keys {sorted(state)}"
                )
        known = {k: state[k] for k in cls.__dataclass_fields__ if k in state}
        return cls(**known)


@dataclass(frozen=True)
class PreparedRollout:
    """A rollout ready for :meth:`PPOLearner.step` (:meth:`PPOLearner.prepare`'s result).

    Attributes:
        buffer: the rollout's buffer, stale rows marked untrainable, GAE computed.
        stale_rows: rows dropped for policy lag.
        lag: lag ``min`` / ``mean`` / ``max`` / ``newest_version`` in versions, and ``sgd_min`` /
            ``sgd_mean`` / ``sgd_max`` in SGD steps.
        proximal: the rows evaluated by the weights before the update (the decoupled objective's
            proximal policy), or None (plain PPO).
        columns_used: ``(N,)`` bool, the columns that hold rows, or None: every column (see
            :attr:`oakemu_core.storage.assembler.FullRollout.columns_used`).
        num_minibatches: minibatches per epoch: ``num_minibatches`` scaled by the columns used over
            the rollout's planned columns (the minibatch size stays), at least 1; None: ``num_minibatches``.
    """

    buffer: RolloutBuffer
    stale_rows: int = 0
    lag: dict[str, float] = field(default_factory=dict)
    proximal: RolloutEvaluation | None = None
    columns_used: np.ndarray | None = None
    num_minibatches: int | None = None


def _columns(observations: Any, used: np.ndarray) -> Any:
    """``(T, k, ...)`` rows of the columns ``used`` (``(N,)`` bool) of ``(T, N, ...)`` observations
    (an array or a dict of arrays)."""
    if isinstance(observations, dict):
        return {key: value[:, used] for key, value in observations.items()}
    return observations[:, used]


class PPOLearner:
    """PPO learner that performs clipped policy-gradient updates on completed rollouts.

    Args:
        context: the settings, device and tester (:class:`RuntimeContext`).
        learner_model: the model container (with lock); its model is moved to the device.
        rollout_buffer: the buffer :meth:`step` trains on, or None when every update is given its
            rollout (:meth:`update`, as the trainer thread does with its double-buffered rollouts).
        optimizer: optimizer over the model's parameters (CleanRL: Adam, eps 1e-5).
        lr_schedule: learning rate per update (a :class:`~oakemu_core.algo.schedules.Schedule`);
            None keeps the optimizer's.
        action_mask: optional ``(mask width,)`` bool tensor on the learner device, ANDed with
            every row's mask (e.g. actions a game never allows).
        bc_sampler: optional behaviour-cloning data source
            (:class:`oakemu_core.algo.demonstrations.DemonstrationSampler`); not with a recurrent
            model (demonstrations hold no policy states).
        revision_sink: ``(policy_version, revision, weights) -> None``: receives the weights after
            each epoch but the last of an update (``publish_every_epoch``), or None.
        revision_max_approx_kl: weights of an epoch whose mean approx KL is above this are not
            handed to the sink (the health check's threshold: the update may be rolled back);
            None: no limit.
        revision_min_sgd_steps: an epoch's weights go to the sink only when at least this many SGD
            steps were taken since the weights last published (a version or a revision).

    Raises:
        ValueError: a behaviour-cloning sampler with a recurrent model.
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
        *,
        revision_sink: Callable[[int, int, dict[str, np.ndarray]], None] | None = None,
        revision_max_approx_kl: float | None = None,
        revision_min_sgd_steps: int = 1,
    ) -> None:
        settings = context.config
        if bc_sampler is not None and getattr(learner_model.model, "recurrent", False):
            raise ValueError(
                "bc_dataset: behaviour cloning is not available for a recurrent policy "
                "(demonstrations hold no policy states); leave bc_dataset unset or use recurrent=none"
            )
        self.settings = settings
        self.learner_model = learner_model
        self.rollout_buffer = rollout_buffer
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.bc_sampler = bc_sampler
        self.device = torch.device(context.device)
        self.evaluations = EvaluationSchedule(context.tester, context.eval_every_updates)
        self.updater = PPOUpdater(
            learner_model.model, optimizer, settings, device=self.device, action_mask=action_mask
        )
        self.revision_sink = revision_sink
        self.revision_max_approx_kl = revision_max_approx_kl
        self.revision_min_sgd_steps = int(revision_min_sgd_steps)
        self.corrections_skipped = 0
        """Updates whose re-evaluation gave non-finite figures (a diverged critic or policy): they
        trained without the off-policy correction, and the health checks judge the update."""
        self.reward_scaler = RewardScaler(settings.gamma) if settings.normalize_rewards else None
        self.lr_scale = 1.0
        self.bc_updates_done = 0
        self._rollouts_collected = 0
        self.trained_env_steps = 0
        """Env steps of the rollouts trained on: each rollout's rows less its stale rows (the run's
        budget)."""
        self.sgd_ledger = SgdStepLedger()

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

    @property
    def sgd_steps(self) -> int:
        """SGD steps taken by this learner process."""
        return self.sgd_ledger.sgd_steps

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update: the schedule's value (else the optimizer's) times
        :attr:`lr_scale` (lowered by rollbacks)."""
        base = (
            self.lr_schedule.value()
            if self.lr_schedule is not None
            else self.optimizer.param_groups[0]["lr"]
        )
        return float(base) * self.lr_scale

    def state(self) -> PPOLearnerRuntimeState:
        """Counters and generator state for a checkpoint."""
        return PPOLearnerRuntimeState(
            iterations=self.iterations,
            rollouts_collected=self._rollouts_collected,
            policy_version=self.policy_version,
            shuffle_rng_state=self.updater.shuffle_rng_state(),
            lr_scale=self.lr_scale,
            bc_updates_done=self.bc_updates_done,
            reward_scaler=None if self.reward_scaler is None else self.reward_scaler.state_dict(),
            trained_env_steps=self.trained_env_steps,
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
        if state.trained_env_steps is not None:
            self.trained_env_steps = int(state.trained_env_steps)
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
        self.sgd_ledger.note(self.policy_version, 0, self.sgd_steps)

    def lag_in_sgd_steps(
        self, policy_versions: np.ndarray, policy_revisions: np.ndarray | None = None
    ) -> dict[str, float]:
        """Policy lag of rows measured in SGD steps instead of versions (:meth:`SgdStepLedger.lag`;
        one version is a whole update: ``ppo_epochs x num_minibatches`` SGD steps, fewer when
        ``target_kl`` stops early, and counts that many for weights published before a resume)."""
        return self.sgd_ledger.lag(
            policy_versions,
            policy_revisions,
            current_version=self.policy_version,
            sgd_steps_per_version=self.settings.ppo_epochs * self.settings.num_minibatches,
        )

    # ------------------------------------------------------------------ one update
    def prepare(self, rollout: FullRollout, *, reevaluate: bool = False) -> PreparedRollout:
        """Make a published rollout ready for :meth:`step` (its :class:`PreparedRollout`): drop rows
        too stale for PPO, re-evaluate rows acted by older versions
        (``off_policy_correction="decoupled"``), scale the rewards (if on), compute GAE on the CPU.

        Re-evaluation: when any row was acted by an older version than the learner's, or
        ``reevaluate`` (actors with bfloat16 forward passes, in either mode), every row is
        evaluated with the current weights. The current critic's V(s_t) replace the stored values
        before GAE (the bootstrap values after the segment's last row and at truncations stay the
        actors'), and the current policy becomes the proximal policy of the update (decoupled
        objective, :func:`oakemu_core.algo.losses.ppo_losses`). A rollout whose rows are all of the
        current version (every rollout in sync mode) is left as it is unless ``reevaluate``. A
        re-evaluation with non-finite figures is not used (:attr:`corrections_skipped`)."""
        buffer = rollout.buffer
        used = rollout.columns_used  # sealed columns (no rows) count for no statistic
        stale_rows, lag = drop_stale_rows(
            buffer,
            current_policy_version=self.policy_version,
            max_policy_lag=self.settings.max_policy_lag,
            columns=used,
        )
        versions, revisions = buffer.policy_versions, buffer.policy_revisions
        if used is not None:
            versions, revisions = versions[:, used], revisions[:, used]
        lag.update(self.lag_in_sgd_steps(versions, revisions))
        proximal = None
        if self.settings.off_policy_correction == "decoupled" and (
            reevaluate or bool((versions != self.policy_version).any())
        ):
            with self.learner_model.locked():
                evaluation = self.updater.evaluate_rollout(buffer)
            if evaluation.finite_on(buffer.trainable):
                buffer.replace_values(evaluation.values)
                proximal = evaluation
            else:
                self.corrections_skipped += 1
                log.warning(
                    "update %d: the current weights give non-finite values or log-probs on this "
                    "rollout; it trains without the off-policy correction",
                    self.iterations + 1,
                )
        if self.reward_scaler is not None:
            rewards, dones = buffer.rewards, buffer.dones
            if used is not None:
                rewards, dones = rewards[:, used], dones[:, used]
            buffer.scale_rewards(self.reward_scaler.update(rewards, dones))
        buffer.compute_gae(
            rollout.last_values, rollout.last_dones, self.settings.gamma, self.settings.gae_lambda
        )
        num_minibatches = None
        if used is not None:
            planned = rollout.planned_columns or buffer.num_envs
            num_minibatches = max(
                1, round(self.settings.num_minibatches * int(used.sum()) / planned)
            )
        return PreparedRollout(buffer, stale_rows, lag, proximal, used, num_minibatches)

    def step(self, actor_steps: int) -> PPOUpdateStats | None:
        """Perform a full PPO update on the constructor's ``rollout_buffer`` (GAE computed by the
        caller): :meth:`update` on it, every column, plain PPO.

        Args:
            actor_steps: the current actor step count (logged).

        Returns:
            The update's statistics, or None when the buffer has no trainable row.

        Raises:
            ValueError: the learner was built without a rollout buffer.
            StaleAdvantagesError: GAE not computed since the last write.
        """
        if self.rollout_buffer is None:
            raise ValueError("PPOLearner.step: built without a rollout buffer (use update())")
        stats = self.update(PreparedRollout(self.rollout_buffer))
        log.debug("update %d at %d actor steps", self.iterations, actor_steps)
        return stats

    def run(
        self,
        stop_event: threading.Event,
        current_step: Callable[[], int],
        rollout_handshake: RolloutHandshake,
        policy: CheckpointPolicy,
    ) -> None:
        """The learner loop: wait for a published rollout, run a PPO update, notify the tester,
        feed automatic rollback monitoring and manage periodic and final checkpointing
        (:func:`~oakemu_core.algo.trainer_thread.run_trainer`, which documents it whole)."""
        run_trainer(self, stop_event, current_step, rollout_handshake, policy)

    def update(self, rollout: PreparedRollout) -> PPOUpdateStats | None:
        """Perform a full PPO update on ``rollout`` (:meth:`prepare`'s result).

        Runs ``ppo_epochs`` epochs on the trainable rows; with a BC sampler and ``bc_coef`` > 0 a
        behaviour-cloning term (decaying by ``bc_coef_decay`` per update) joins the loss. The
        observation statistics are updated afterwards, so the rows were judged with the
        statistics they were acted with.

        Returns:
            The update's statistics, or None when the buffer has no trainable row.

        Raises:
            StaleAdvantagesError: GAE not computed since the last write.
        """
        buffer = rollout.buffer
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        bc_term = None
        if self.bc_sampler is not None and self.settings.bc_coef > 0:
            coef = self.settings.bc_coef * self.settings.bc_coef_decay**self.iterations
            bc_term = (coef, self.bc_sampler, self.settings.bc_batch_size)
        stats = None
        with self.learner_model.locked() as model:
            try:
                stats = self.updater.step(
                    buffer,
                    current_policy_version=self.policy_version,
                    bc_term=bc_term,
                    proximal=rollout.proximal,
                    num_minibatches=rollout.num_minibatches,
                    after_epoch=None if self.revision_sink is None else self.publish_revision,
                )
            except EmptyRolloutError:
                stats = None
            used = rollout.columns_used
            model.update_observation_statistics(
                buffer.observations if used is None else _columns(buffer.observations, used)
            )
            self.learner_model.version += 1
        self.sgd_ledger.sgd_steps += stats.minibatches if stats is not None else 0
        self.sgd_ledger.note(self.policy_version, 0, self.sgd_steps)
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        self._rollouts_collected += 1
        log.debug("update %d", self.iterations)
        return stats

    def publish_revision(
        self, epochs_done: int, approx_kl: float, nonfinite_minibatches: int, update_sgd_steps: int
    ) -> None:
        """Hand the weights an epoch left (revision ``epochs_done`` of the version in training) to
        the revision sink; the updater's ``after_epoch`` callback, called with the model lock held.
        Kept back, for the health check to judge at the end of the update: weights after a skipped
        non-finite gradient, after an epoch whose approx KL passed ``revision_max_approx_kl``, or
        that are not finite. Skipped while fewer than ``revision_min_sgd_steps`` SGD steps passed
        since the last published weights."""
        assert self.revision_sink is not None
        sgd_steps = self.sgd_steps + update_sgd_steps
        if sgd_steps - self.sgd_ledger.last_published < self.revision_min_sgd_steps:
            return
        if (
            nonfinite_minibatches
            or not math.isfinite(approx_kl)
            or (self.revision_max_approx_kl is not None and approx_kl > self.revision_max_approx_kl)
        ):
            return
        weights = weights_to_arrays(self.model)
        if all(np.isfinite(array).all() for array in weights.values()):
            self.sgd_ledger.note(self.policy_version, epochs_done, sgd_steps)
            self.revision_sink(self.policy_version, epochs_done, weights)

    def behaviour_cloning_phase(self) -> int:
        """Pre-train on demonstrations: ``bc_pretrain_updates`` replay-only rollouts of one epoch
        each (not multiplied by ``ppo_epochs``), skipping those done before a resume. Returns the
        number of BC updates run now."""
        remaining = self.settings.bc_pretrain_updates - self.bc_updates_done
        if self.bc_sampler is None or remaining <= 0:
            return 0
        from oakemu_core.algo.behaviour_cloning import behaviour_cloning_update

        with self.learner_model.locked() as model:
            for _ in range(remaining):
                behaviour_cloning_update(
                    model,
                    self.optimizer,
                    self.bc_sampler,
                    batch_size=self.settings.bc_batch_size,
                    device=self.device,
                    max_grad_norm=self.settings.max_grad_norm,
                )
                self.bc_updates_done += 1
                self._rollouts_collected += 1
            self.learner_model.version += 1
        self.sgd_ledger.note(self.policy_version, 0, self.sgd_steps)
        return remaining

    def submit_to_tester(self, global_step: int, *, force: bool = False) -> None:
        """Submit the current weights to the tester every ``eval_every_updates`` updates; ``force``:
        now, and kept (:meth:`EvaluationSchedule.submit`)."""
        self.evaluations.submit(
            self.learner_model.snapshot,
            iterations=self.iterations,
            global_step=global_step,
            force=force,
        )
