"""PPO: the clipped loss and the learner update over a :class:`RolloutBuffer`.

The update follows CleanRL ``ppo_atari.py`` top to bottom (the caller sets the learning rate
before it): epochs x shuffled minibatches -> ratio -> clipped surrogate, value loss, entropy -> one loss ->
gradient clip -> optimizer step -> optional target-KL early stop -> statistics. GAE has already
been computed into the buffer by the caller.

References:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate, eq. 7;
    total objective with value and entropy terms, eq. 9).
    Huang et al. 2022, "The 37 Implementation Details of Proximal Policy Optimization" and CleanRL
    (value clipping as in OpenAI baselines, approximate KL ``mean((ratio - 1) - log ratio)``,
    the k3 estimator of http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from oakemu_core.algo.flat_parameters import FlatAdam, FlatGradients
from oakemu_core.algo.settings import PPOSettings

if TYPE_CHECKING:
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

__all__ = [
    "EmptyRolloutError",
    "RolloutEvaluation",
    "LinearSchedule",
    "PPOUpdater",
    "PPOUpdateStats",
    "cpu_has_native_bfloat16",
    "explained_variance",
    "ppo_losses",
]


def cpu_has_native_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bfloat16 natively (the ``avx512_bf16`` or ``amx_bf16`` flag of
    Linux's ``/proc/cpuinfo``); None where that file cannot be read (another OS). Without them
    oneDNN emulates bfloat16, and a ``"bfloat16"`` update is slower than a float32 one."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as file:
            flags = next(
                (line.split(":", 1)[1].split() for line in file if line.startswith("flags")), None
            )
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


PROXIMAL = "proximal_"
"""Prefix of the flat-batch fields holding the proximal policy's figures (decoupled objective):
``proximal_log_probs`` and e.g. ``proximal_action_mean``."""


@dataclass(frozen=True)
class RolloutEvaluation:
    """A rollout's stored rows evaluated by the learner's current weights
    (:meth:`PPOUpdater.evaluate_rollout`); all arrays on the CPU, ``(T, N, ...)``.

    Attributes:
        log_probs: ``(T, N)`` float32, log pi(a_t | s_t) of the stored actions.
        values: ``(T, N)`` float32, V(s_t) of the current critic.
        distribution_fields: the distribution's stored parameters (e.g. ``action_mean``,
            ``action_std``: ``(T, N, *action_shape)`` float32); empty for categorical families.
    """

    log_probs: np.ndarray
    values: np.ndarray
    distribution_fields: dict[str, np.ndarray] = field(default_factory=dict)

    def finite_on(self, rows: np.ndarray) -> bool:
        """Whether every value, and the log-probs and parameters of ``rows`` (``(T, N)`` bool),
        are finite (a critic or policy that diverged gives NaN or inf)."""
        return bool(
            np.isfinite(self.values).all()
            and np.isfinite(self.log_probs[rows]).all()
            and all(np.isfinite(array[rows]).all() for array in self.distribution_fields.values())
        )


class EmptyRolloutError(ValueError):
    """The rollout buffer has no trainable row (for example every row was dropped for policy lag),
    so no PPO update can run on it."""


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------------------------
class LinearSchedule:
    """A value that moves linearly from ``start`` to ``end`` over ``total_updates`` updates, then
    stays at ``end``.

    ``value()`` at update ``k`` (``k`` = number of :meth:`step` calls so far) is
    ``start + (end - start) * min(k, total_updates) / total_updates``. CleanRL anneals the learning
    rate the same way (``frac = 1 - (iteration - 1) / num_iterations``) with ``end = 0``.

    Raises:
        ValueError: ``total_updates`` < 1.
    """

    def __init__(self, start: float, end: float, total_updates: int) -> None:
        if int(total_updates) < 1:
            raise ValueError(f"total_updates: expected >= 1, got {total_updates}")
        self.start = float(start)
        self.end = float(end)
        self.total_updates = int(total_updates)
        self.updates = 0

    def value(self) -> float:
        """The value for the next update."""
        fraction = min(self.updates, self.total_updates) / self.total_updates
        return self.start + (self.end - self.start) * fraction

    def step(self) -> None:
        """Advance by one update."""
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain-value state for a checkpoint."""
        return {
            "start": self.start,
            "end": self.end,
            "total_updates": self.total_updates,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raises ValueError naming a missing or invalid entry."""
        for key in ("start", "end", "total_updates", "updates"):
            if key not in state:
                raise ValueError(f"LinearSchedule state: missing {key!r}, got keys {sorted(state)}")
        if int(state["total_updates"]) < 1 or int(state["updates"]) < 0:
            raise ValueError(
                f"LinearSchedule state: expected total_updates >= 1 and updates >= 0, got "
                f"{state['total_updates']} and {state['updates']}"
            )
        self.start = float(state["start"])
        self.end = float(state["end"])
        self.total_updates = int(state["total_updates"])
        self.updates = int(state["updates"])


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------
def ppo_losses(
    new_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    *,
    clip_coef: float,
    clip_value_range: float | None,
    importance_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The PPO loss terms for one minibatch. All inputs are ``(B,)`` float tensors.

    Args:
        new_log_probs: log pi_theta(a|s) under the policy being trained (with gradients).
        old_log_probs: log pi_theta_old(a|s): recorded by the actor, or with the decoupled
            objective the proximal policy's (the learner's weights before the update).
        advantages: advantage estimates (already normalised if wanted).
        new_values: V_theta(s) (with gradients). old_values: V recorded by the actor, or
            re-evaluated by the learner before the update (decoupled objective).
        returns: value targets (GAE advantages + old values).
        entropy: per-row entropy of the current policy.
        clip_coef: epsilon of the clipped surrogate; also the value clip range.
        clip_value_range: clip the value change to ``[-c, c]`` around the actor's value, in value
            units (OpenAI baselines / CleanRL use the policy's clip coefficient); None: plain
            MSE (SB3's default). A range tiny next to the returns freezes the critic on the
            clipped rows, so it is its own setting, not ``clip_coef``.
        importance_weights: ``(B,)`` weights ``pi_prox(a|s) / mu(a|s)`` (proximal over behaviour
            policy), without gradients, multiplying each row's clipped surrogate: the decoupled
            PPO objective of Hilton, Cobbe and Schulman 2022, "Batch size-invariance for policy
            optimization" (the clip keeps the update near the proximal policy; the weights correct
            for the behaviour policy). The caller may truncate them (V-trace's rho-bar). None:
            every weight 1 (plain PPO).

    Returns:
        A dict of scalar tensors ``policy_loss`` (to minimise: minus eq. 7 of Schulman et al.
        2017, ``mean(max(-A r, -A clip(r, 1-eps, 1+eps)))``), ``value_loss``
        (``0.5 * mean((V - R)^2)``, or with clipping
        ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2))``), ``entropy``
        (mean), and without gradients ``approx_kl`` (``mean((r - 1) - log r)``), ``clip_fraction``
        (share of rows with ``|r - 1| > eps``); plus ``ratio``, the ``(B,)`` ratios ``r``.
    """
    log_ratio = new_log_probs - old_log_probs
    ratio = log_ratio.exp()

    # Clipped surrogate objective (Schulman et al. 2017, eq. 7), negated to be minimised.
    policy_loss_unclipped = -advantages * ratio
    policy_loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    policy_loss_rows = torch.max(policy_loss_unclipped, policy_loss_clipped)
    if importance_weights is not None:
        policy_loss_rows = importance_weights * policy_loss_rows
    policy_loss = policy_loss_rows.mean()

    # Value loss, optionally clipped around the actor's value estimate.
    value_loss_unclipped = (new_values - returns) ** 2
    if clip_value_range is not None:
        values_clipped = old_values + torch.clamp(
            new_values - old_values, -clip_value_range, clip_value_range
        )
        value_loss_clipped = (values_clipped - returns) ** 2
        value_loss = 0.5 * torch.max(value_loss_unclipped, value_loss_clipped).mean()
    else:
        value_loss = 0.5 * value_loss_unclipped.mean()

    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()
        clip_fraction = ((ratio - 1.0).abs() > clip_coef).float().mean()

    return {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy.mean(),
        "approx_kl": approx_kl,
        "clip_fraction": clip_fraction,
        "ratio": ratio.detach(),
    }


def explained_variance(predictions: np.ndarray, targets: np.ndarray) -> float:
    """``1 - Var(targets - predictions) / Var(targets)`` (as CleanRL/SB3), NaN if Var(targets) is 0
    or the arrays are empty. 1 is a perfect value function, 0 no better than a constant."""
    predictions = np.asarray(predictions, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.float64)
    if targets.size == 0:
        return math.nan
    variance = np.var(targets)
    if variance == 0:
        return math.nan
    return float(1.0 - np.var(targets - predictions) / variance)


# ---------------------------------------------------------------------------------------------
# Learner
# ---------------------------------------------------------------------------------------------
@dataclass
class PPOUpdateStats:
    """What one :meth:`PPOUpdater.step` did.

    Losses, entropy, approx_kl and clip_fraction are means over every minibatch that was trained
    on. ``explained_variance`` compares the actor's values with the GAE returns over the trainable
    rows. ``first_minibatch_ratio_max_abs_dev`` is max |ratio - 1| on the first minibatch before any
    gradient step, over its rows produced by the learner's current policy version (NaN if none):
    it should be ~0 when actor and learner agree on log-probs. Times are wall-clock seconds.
    """

    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    clip_fraction: float
    explained_variance: float
    learning_rate: float
    epochs_completed: int
    minibatches: int
    early_stopped: bool
    first_minibatch_ratio_max_abs_dev: float
    update_seconds: float
    epoch_seconds: list[float] = field(default_factory=list)
    trainable_rows: int = 0
    nonfinite_minibatches: int = 0
    """Minibatches whose gradient was not finite; their optimizer step was skipped."""
    importance_weight_mean: float = math.nan
    """Mean truncated weight ``min(cap, pi_prox / mu)`` over the trained rows with the decoupled
    objective (NaN without it): 1 when the behaviour policy is the proximal one."""


class _UpdateTally:
    """What one update accumulates for its :class:`PPOUpdateStats` (sums stay on the device until
    the end: one sync per update)."""

    REPORTED = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")

    def __init__(self, device: torch.device, *, learning_rate: float) -> None:
        self.start_time = time.perf_counter()
        self.learning_rate = learning_rate
        self.totals = {key: torch.zeros((), device=device) for key in self.REPORTED}
        self.weight_total = torch.zeros((), device=device)
        self.minibatches = 0
        self.nonfinite = torch.zeros(
            (), dtype=torch.int64, device=device
        )  # minibatches whose step was skipped
        self.first_minibatch_ratio_max_abs_dev = math.nan
        self.epoch_seconds: list[float] = []
        self.early_stopped = False

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        """One trained minibatch's loss terms."""
        for key in self.totals:
            self.totals[key] += losses[key].detach()
        self.minibatches += 1

    @property
    def nonfinite_minibatches(self) -> int:
        """Minibatches so far whose gradient was not finite (one device sync)."""
        return int(self.nonfinite.item())

    def stats(
        self, rollout_buffer: RolloutBuffer, trainable_rows: int, *, decoupled: bool
    ) -> PPOUpdateStats:
        diagnostics = rollout_buffer.trainable_diagnostics()
        means = {key: value.item() / self.minibatches for key, value in self.totals.items()}
        return PPOUpdateStats(
            **means,
            explained_variance=(
                math.nan
                if diagnostics is None
                else explained_variance(diagnostics.values, diagnostics.returns)
            ),
            learning_rate=self.learning_rate,
            epochs_completed=len(self.epoch_seconds),
            minibatches=self.minibatches,
            early_stopped=self.early_stopped,
            first_minibatch_ratio_max_abs_dev=self.first_minibatch_ratio_max_abs_dev,
            update_seconds=time.perf_counter() - self.start_time,
            epoch_seconds=self.epoch_seconds,
            trainable_rows=trainable_rows,
            nonfinite_minibatches=self.nonfinite_minibatches,
            importance_weight_mean=self.weight_total.item() / self.minibatches
            if decoupled
            else math.nan,
        )


class PPOUpdater:
    """Runs PPO updates of ``model`` on full rollout buffers.

    Args:
        model: an :class:`oakemu_core.policy.models.ActorCritic` (``policy_and_values(observations,
            action_mask) -> (Policy, values)`` and a ``distribution``); moved to ``device``.
        optimizer: optimizer over ``model``'s parameters (CleanRL: Adam, eps=1e-5); its learning
            rate is the caller's to set before each update.
        settings: the hyperparameters (:class:`~oakemu_core.algo.settings.PPOSettings`, or anything
            :meth:`PPOSettings.from_config` reads, e.g. the whole configuration); None: the defaults.
            Those the update reads: ``ppo_epochs``, ``num_minibatches``, ``clip_coef``,
            ``clip_value_range``, ``ent_coef``, ``vf_coef``, ``max_grad_norm``, ``target_kl``,
            ``normalize_advantages``, ``importance_weight_cap`` (the truncation of the decoupled
            objective's weights ``pi_prox / mu``: V-trace's rho-bar, Espeholt et al. 2018,
            "IMPALA"; used only when :meth:`step` gets a proximal policy), ``seed`` (of the
            minibatch-shuffling generator) and ``learner_precision``.
        device: where the update runs (``"cuda"`` or ``"cpu"``). On CUDA, TF32 matmuls and
            convolutions are switched off process-wide so that learner log-probs match the actor's
            float32 CPU log-probs (the ratio check).
        action_mask: optional ``(mask width,)`` bool tensor ANDed with every row's mask.
        **overrides: settings fields by name, replacing those of ``settings``.

    Advantages are normalised per minibatch (``normalize_advantages``: mean 0, population std +
    1e-8, over the minibatch's rows, all trainable), as SB3 and CleanRL do. The gradients of the
    trained parameters share one buffer (:class:`~oakemu_core.algo.flat_parameters.FlatGradients`;
    with a :class:`~oakemu_core.algo.flat_parameters.FlatAdam` optimizer, its own, and their values another):
    every parameter takes an optimizer step each minibatch, with a zero gradient where the loss
    does not depend on it.

    ``learner_precision="bfloat16"`` is mixed precision: the model's forward passes (and so their
    backward: the proximal re-evaluation, the minibatches, behaviour cloning) run under
    ``torch.autocast`` with bfloat16, so the torso's convolutions and matmuls compute in bfloat16
    while the heads (``ActorCritic`` opts them out), weights, gradients, optimizer state, policy
    distribution and losses stay float32. CPUs without AVX512-BF16 or AMX emulate bfloat16 (slower
    than float32). The learner's log-probs then differ a little from the actors' float32 ones
    (``first_minibatch_ratio_max_abs_dev``).

    Raises:
        pydantic.ValidationError (a ValueError): a hyperparameter out of range (names it, with the
            received value).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: Any = None,
        *,
        device: str | torch.device,
        action_mask: torch.Tensor | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = PPOSettings.from_config(
            settings if settings is not None else PPOSettings(), **overrides
        )
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.model = model.to(self.device)
        self.optimizer = optimizer
        # The optimizer holds these same tensors; restores load into them in place (load_state_dict).
        # Their gradients live in one buffer: zeroing and clipping them are one op each.
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        if isinstance(optimizer, FlatAdam):  # its buffers already hold the parameters and gradients
            if [id(parameter) for parameter in optimizer.flat.parameters] != [
                id(parameter) for parameter in trained
            ]:
                raise ValueError(
                    "PPOUpdater: the FlatAdam optimizer is not over the model's trained parameters"
                )
            self._gradients: FlatGradients = optimizer.flat
        else:
            self._gradients = FlatGradients(trained)
        # On an accelerator a fused optimizer (torch.optim.Adam(fused=True)) skips a step on the device
        # when told through ``found_inf``, the hook torch.amp.GradScaler uses: no host sync per minibatch
        # to test the gradient. On the CPU that test costs nothing, and the hook costs two ops a step.
        self._skips_on_device = self.device.type != "cpu" and bool(
            getattr(optimizer, "_step_supports_amp_scaling", False)
        )
        self._stored_parameters = tuple(
            self.model.distribution.stored_fields()
        )  # parameters for the exact KL
        self._shuffle_rng = np.random.default_rng(self.settings.seed)
        self.action_mask = None if action_mask is None else action_mask.to(self.device, torch.bool)
        self._iterations = 0

    @property
    def iterations(self) -> int:
        """PPO updates completed."""
        return self._iterations

    # ------------------------------------------------------------------ update
    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def evaluate_rollout(
        self, rollout_buffer: RolloutBuffer, *, chunk_rows: int = 256
    ) -> RolloutEvaluation:
        """Re-evaluate every stored row with the current weights: the proximal policy's log-probs
        of the stored actions and its stored parameters, and the current critic's values
        (asynchronous mode: the rows were acted by older versions).

        Args:
            rollout_buffer: a full buffer (observations, actions and masks written).
            chunk_rows: rows per forward pass (small chunks keep a CNN's activations in the caches).

        Returns:
            A :class:`RolloutEvaluation`. A row whose stored action the current masks forbid gets
            a very negative log-prob (only non-trainable rows can have one).
        """
        schema = rollout_buffer.schema
        total = rollout_buffer.total_size
        names = [
            *schema.observation_names,
            "actions",
            *(["action_mask"] if "action_mask" in schema else []),
        ]
        flat = {
            name: rollout_buffer.field(name).reshape(total, *schema[name].shape) for name in names
        }
        log_probs = np.empty(total, dtype=np.float32)
        values = np.empty(total, dtype=np.float32)
        stored = {
            name: np.empty((total, *shape), dtype=np.float32)
            for name, (shape, _) in self.model.distribution.stored_fields().items()
        }
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, total, chunk_rows):
                chunk = {
                    name: torch.from_numpy(array[start : start + chunk_rows].copy()).to(self.device)
                    for name, array in flat.items()
                }
                with self._forward_precision():
                    policy, chunk_values = self.model.policy_and_values(
                        schema.join_observations(chunk), self._row_masks(chunk.get("action_mask"))
                    )
                end = start + len(chunk["actions"])
                log_probs[start:end] = policy.log_prob(chunk["actions"]).float().cpu().numpy()
                values[start:end] = chunk_values.float().cpu().numpy()
                for name, tensor in policy.stored().items():
                    stored[name][start:end] = tensor.float().cpu().numpy()
        finally:
            self.model.train(was_training)
        lead = (rollout_buffer.rollout_length, rollout_buffer.num_envs)
        return RolloutEvaluation(
            log_probs.reshape(lead),
            values.reshape(lead),
            {name: array.reshape(*lead, *array.shape[1:]) for name, array in stored.items()},
        )

    def step(
        self,
        rollout_buffer: RolloutBuffer,
        *,
        current_policy_version: int,
        bc_term: tuple[float, Any, int] | None = None,
        proximal: RolloutEvaluation | None = None,
        after_epoch: Callable[[int, float, int, int], None] | None = None,
        num_minibatches: int | None = None,
    ) -> PPOUpdateStats:
        """One PPO update on the trainable rows of a full buffer whose GAE is computed.

        Args:
            rollout_buffer: the buffer to train on (``compute_gae`` already called).
            current_policy_version: version of the weights ``model`` holds now (the caller owns the
                version and counts the update). Rows recorded with this version are used for the
                ratio check.
            bc_term: ``(coefficient, demonstration sampler, batch size)``: add ``coefficient *``
                the demonstrations' negative log-likelihood to every minibatch's loss
                (:func:`oakemu_core.algo.behaviour_cloning.bc_loss`), or None.
            proximal: the buffer evaluated by the weights ``model`` holds now
                (:meth:`evaluate_rollout`), or None. Given, the update uses the decoupled
                objective (:func:`ppo_losses`): the ratio is taken against the proximal log-probs,
                each row is weighted by ``min(importance_weight_cap, pi_prox / mu)``, and
                ``approx_kl`` is measured from the proximal policy (exactly, for families with
                stored parameters; else the ratio-based estimate over the stored rows).
            after_epoch: called as ``after_epoch(epochs_done, approx_kl, nonfinite_minibatches,
                sgd_steps)`` after every epoch but the last (and not after an early stop), with the
                weights as that epoch left them (the learner publishes them to the actors), that
                epoch's mean ``approx_kl``, the minibatches skipped so far for a non-finite gradient
                and the SGD steps (minibatches) this update has taken so far; or None.
            num_minibatches: minibatches per epoch; None: the settings' ``num_minibatches``.

        Returns:
            :class:`PPOUpdateStats`.

        Raises:
            EmptyRolloutError: the buffer has no trainable row. With fewer trainable rows than
                ``num_minibatches``, each epoch uses one minibatch per row instead.
        """
        trainable_rows = int(rollout_buffer.trainable_size)
        if trainable_rows == 0:
            raise EmptyRolloutError("rollout_buffer: 0 trainable rows, expected at least 1")
        # A rollout left with fewer rows than minibatches (most rows dropped as stale) still trains,
        # with one row per minibatch.
        settings = self.settings
        num_minibatches = min(num_minibatches or settings.num_minibatches, trainable_rows)
        tally = _UpdateTally(self.device, learning_rate=float(self.optimizer.param_groups[0]["lr"]))
        self.model.train()
        flat, kl_reference = self._upload(rollout_buffer, proximal)
        # One minibatch: every row in stored order (shuffling it would only cost copies), its
        # advantages normalised once for every epoch.
        whole = self._normalised(flat.whole()) if num_minibatches == 1 else None
        for epoch in range(settings.ppo_epochs):
            epoch_start = time.perf_counter()
            epoch_kl = torch.zeros((), device=self.device)
            minibatches = (
                [whole]
                if whole is not None
                else [
                    self._normalised(minibatch)
                    for minibatch in flat.minibatches(num_minibatches, self._shuffle_rng)
                ]
            )
            for minibatch in minibatches:
                losses, new_log_probs, weights = self._minibatch_losses(minibatch, kl_reference)
                if weights is not None:
                    tally.weight_total += weights.mean()
                if (
                    tally.minibatches == 0
                ):  # before any gradient step: actor and learner should agree
                    behaviour_ratio = (new_log_probs.detach() - minibatch.log_probs).exp()
                    tally.first_minibatch_ratio_max_abs_dev = self._ratio_deviation(
                        behaviour_ratio, minibatch.fields["policy_versions"], current_policy_version
                    )
                tally.nonfinite += self._sgd_step(losses, bc_term)
                tally.add(losses)
                epoch_kl += losses["approx_kl"]

            self._synchronize()
            tally.epoch_seconds.append(time.perf_counter() - epoch_start)
            if settings.target_kl is None and after_epoch is None:
                continue
            epoch_approx_kl = epoch_kl.item() / len(
                minibatches
            )  # one device sync per epoch, when needed
            if settings.target_kl is not None and epoch_approx_kl > settings.target_kl:
                tally.early_stopped = epoch + 1 < settings.ppo_epochs
                break
            if after_epoch is not None and epoch + 1 < settings.ppo_epochs:
                after_epoch(
                    epoch + 1, epoch_approx_kl, tally.nonfinite_minibatches, tally.minibatches
                )

        self._iterations += 1
        return tally.stats(rollout_buffer, trainable_rows, decoupled=proximal is not None)

    def _upload(
        self, rollout_buffer: RolloutBuffer, proximal: RolloutEvaluation | None
    ) -> tuple[Any, str]:
        """The trainable rows flattened and uploaded once (every epoch only reshuffles and indexes
        them), with the proximal policy's figures as extra fields when given; and the prefix of the
        stored parameters the exact KL is measured from (``""``: the acting policy's)."""
        flat = rollout_buffer.flat_batch(self.device)
        if proximal is None:
            return flat, ""
        # The cached flat batch stays as it is: a new one holds the extra fields.
        arrays = {"log_probs": proximal.log_probs, **proximal.distribution_fields}
        flat = replace(
            flat,
            fields={
                **flat.fields,
                **{
                    PROXIMAL + name: torch.from_numpy(
                        array.reshape(-1, *array.shape[2:])[flat.rows]
                    ).to(self.device)
                    for name, array in arrays.items()
                },
            },
        )
        return flat, PROXIMAL  # the trust region is around the proximal policy

    def _normalised(self, minibatch: Any) -> Any:
        """``minibatch`` with its advantages normalised when the settings ask (per minibatch, as SB3
        and CleanRL: ``(A - mean) / (population std + 1e-8)``), else as it is."""
        if not self.settings.normalize_advantages:
            return minibatch
        advantages = minibatch.advantages
        return minibatch._replace(
            advantages=(advantages - advantages.mean()) / (advantages.std(correction=0) + 1e-8)
        )

    def _minibatch_losses(
        self, minibatch: Any, kl_reference: str
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """One minibatch's forward pass and loss terms (:func:`ppo_losses`); with the proximal
        figures (decoupled objective) the ratio is taken against them and each row weighted by
        ``min(importance_weight_cap, pi_prox / mu)``; families with stored parameters get the exact
        KL. ``minibatch``'s advantages are used as they are (:meth:`_normalised` first). Returns the
        losses, the new log-probs and the weights (None: plain PPO)."""
        settings = self.settings
        with self._forward_precision():
            policy, new_values = self.model.policy_and_values(
                minibatch.observations, self._row_masks(minibatch.fields.get("action_mask"))
            )
        advantages = minibatch.advantages
        with torch.set_grad_enabled(
            bool(settings.ent_coef)
        ):  # weighted 0 it would only cost backward ops
            entropy = policy.entropy()
        new_log_probs = policy.log_prob(minibatch.actions)
        old_log_probs, weights = minibatch.log_probs, None
        if PROXIMAL + "log_probs" in minibatch.fields:
            old_log_probs = minibatch.fields[PROXIMAL + "log_probs"]
            weights = (
                (old_log_probs - minibatch.log_probs)
                .clamp(max=math.log(settings.importance_weight_cap))
                .exp()
            )
        losses = ppo_losses(
            new_log_probs,
            old_log_probs,
            advantages,
            new_values,
            minibatch.values,
            minibatch.returns,
            entropy,
            clip_coef=settings.clip_coef,
            clip_value_range=settings.value_clip,
            importance_weights=weights,
        )
        if self._stored_parameters:  # the exact KL from the stored parameters
            with torch.no_grad():
                kl = policy.kl_from(
                    {
                        name: minibatch.fields[kl_reference + name]
                        for name in self._stored_parameters
                    }
                )
                losses["approx_kl"] = kl.mean()
        return losses, new_log_probs, weights

    def _sgd_step(
        self, losses: dict[str, torch.Tensor], bc_term: tuple[float, Any, int] | None
    ) -> torch.Tensor:
        """Backward pass and optimizer step on the total loss (Schulman et al. 2017, eq. 9, negated:
        policy - c2 * entropy + c1 * value, plus the behaviour-cloning term). Returns a 0-dim bool
        tensor on the device, True when the gradient was not finite and the step was skipped (it
        would turn every weight into NaN)."""
        settings = self.settings
        loss = losses["policy_loss"] + settings.vf_coef * losses["value_loss"]
        if settings.ent_coef:
            loss = loss - settings.ent_coef * losses["entropy"]
        if bc_term is not None:  # behaviour cloning on demonstrations, next to the PPO loss
            bc_coef, sampler, bc_batch = bc_term
            loss = loss + bc_coef * self._bc_loss(sampler, bc_batch)
        self._gradients.zero()
        loss.backward()
        grad_norm = self._gradients.clip_norm_(settings.max_grad_norm)
        nonfinite = ~torch.isfinite(grad_norm)
        if (
            self._skips_on_device
        ):  # parameters, moments and step count stay as they were where found_inf is 1
            self.optimizer.found_inf = nonfinite.float()
            try:
                self.optimizer.step()
            finally:  # read by every later step(), as GradScaler's is: it must not outlive this one
                del self.optimizer.found_inf
        elif not nonfinite:
            self.optimizer.step()
        return nonfinite

    # ------------------------------------------------------------------ ratio check
    def shuffle_rng_state(self) -> dict[str, Any]:
        """State of the minibatch-shuffling generator (plain values)."""
        return self._shuffle_rng.bit_generator.state

    def restore_counters(self, iterations: int, shuffle_rng_state: dict[str, Any] | None) -> None:
        """Restore the update count and the shuffling generator (resume)."""
        self._iterations = int(iterations)
        if shuffle_rng_state is not None:
            self._shuffle_rng.bit_generator.state = shuffle_rng_state

    def _row_masks(self, masks: torch.Tensor | None) -> torch.Tensor | None:
        """Each row's action mask ANDed with the learner-wide ``action_mask`` (either may be None)."""
        if self.action_mask is None:
            return masks
        return (
            self.action_mask.expand(masks.shape) & masks
            if masks is not None
            else self.action_mask.unsqueeze(0)
        )

    def _bc_loss(self, sampler: Any, batch_size: int) -> torch.Tensor:
        from oakemu_core.algo.behaviour_cloning import bc_loss
        from oakemu_core.algo.demonstrations import batch_to_device

        batch = batch_to_device(sampler.sample(batch_size, self._shuffle_rng), self.device)
        with self._forward_precision():
            policy, _ = self.model.policy_and_values(
                batch.observations, self._row_masks(batch.action_mask)
            )
        return bc_loss(policy, batch.actions)

    def _forward_precision(self) -> contextlib.AbstractContextManager[Any]:
        """The context of every forward pass of the update: bfloat16 autocast, or none for float32
        (a disabled autocast still costs its entry and exit on every minibatch)."""
        if self.settings.learner_precision == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @staticmethod
    def _ratio_deviation(
        ratio: torch.Tensor, versions: torch.Tensor, current_policy_version: int
    ) -> float:
        """max |ratio - 1| over the minibatch rows acted by ``current_policy_version`` (NaN if none)."""
        is_current = versions == int(current_policy_version)
        if not bool(is_current.any()):
            return math.nan
        return float((ratio[is_current] - 1.0).abs().max().item())
