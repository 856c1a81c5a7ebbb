"""PPO: the learner update over a :class:`RolloutBuffer` (:class:`PPOUpdater`).

The update follows CleanRL ``ppo_atari.py`` top to bottom (the caller sets the learning rate
before it): epochs x shuffled minibatches -> ratio -> clipped surrogate, value loss, entropy
(:func:`oakemu_core.algo.losses.ppo_losses`) -> one loss -> gradient clip -> optimizer step ->
optional target-KL early stop -> statistics (:class:`oakemu_core.algo.update_stats.PPOUpdateStats`).
GAE has already been computed into the buffer by the caller.

A feed-forward policy trains on shuffled rows (:class:`~oakemu_core.storage.batches.FlatBatch`). A
recurrent policy (``model.recurrent``) trains on shuffled sequences
(:class:`~oakemu_core.storage.sequences.SequenceBatch`, ``sequence_length`` rows each, whole rollout
columns by default): each minibatch's forward pass runs its sequences from their stored states with
the state zeroed at episode starts, and the loss terms, advantage normalisation included, are taken
on its trainable rows only, as CleanRL's ``ppo_atari_lstm.py`` does over whole env columns.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from oakemu_core.algo.compiled_update import LossBatch, LossConstants, MinibatchLoss, loss_terms
from oakemu_core.algo.flat_parameters import FlatAdam, FlatGradients
from oakemu_core.algo.losses import normalize_advantages
from oakemu_core.algo.reevaluation import RolloutEvaluation, evaluate_rollout
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.algo.update_stats import PPOUpdateStats, UpdateTally

if TYPE_CHECKING:
    from oakemu_core.policy.distributions import Policy
    from oakemu_core.storage.batches import FlatBatch, RolloutMinibatch
    from oakemu_core.storage.rollout_buffer import RolloutBuffer
    from oakemu_core.storage.sequences import SequenceBatch, SequenceMinibatch

__all__ = ["EmptyRolloutError", "PPOUpdater", "cpu_has_native_bfloat16"]

log = logging.getLogger("oakemu.learner")


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


class EmptyRolloutError(ValueError):
    """The rollout buffer has no trainable row (for example every row was dropped for policy lag),
    so no PPO update can run on it."""


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
            minibatch-shuffling generator), ``learner_precision``, ``compile_update`` (a
            feed-forward model's minibatch forward pass and loss through ``torch.compile``:
            :mod:`oakemu_core.algo.compiled_update`) and, for a recurrent model, ``sequence_length``.
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
        self.recurrent = bool(getattr(self.model, "recurrent", False))
        """The model carries a state per env: it trains on sequences."""
        self.action_mask = None if action_mask is None else action_mask.to(self.device, torch.bool)
        self._iterations = 0
        compile_mode = self.settings.compile_update
        if self.recurrent and compile_mode != "none":
            log.warning(
                "compile_update %s: a recurrent policy's update runs eagerly (its sequences are "
                "not compiled)",
                compile_mode,
            )
            compile_mode = "none"
        self.minibatch_loss = MinibatchLoss(
            self.model,
            LossConstants(
                clip_coef=self.settings.clip_coef,
                clip_value_range=self.settings.value_clip,
                ent_coef=self.settings.ent_coef,
                vf_coef=self.settings.vf_coef,
                importance_weight_cap=self.settings.importance_weight_cap,
            ),
            autocast_dtype=torch.bfloat16
            if self.settings.learner_precision == "bfloat16"
            else None,
            mode=compile_mode,
        )
        """A minibatch's forward pass and loss, compiled as ``compile_update`` asks
        (:class:`~oakemu_core.algo.compiled_update.MinibatchLoss`); a recurrent model's sequences
        run eagerly."""

    @property
    def iterations(self) -> int:
        """PPO updates completed."""
        return self._iterations

    # ------------------------------------------------------------------ update
    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate_rollout(
        self, rollout_buffer: RolloutBuffer, *, chunk_rows: int = 256
    ) -> RolloutEvaluation:
        """Every stored row evaluated by the current weights through this update's forward pass
        (:func:`oakemu_core.algo.reevaluation.evaluate_rollout`; a recurrent model's over the
        sequences the update trains on, ``sequence_length``)."""
        return evaluate_rollout(
            self.model,
            rollout_buffer,
            self.forward,
            self.device,
            chunk_rows=chunk_rows,
            sequence_length=self.settings.sequence_length if self.recurrent else None,
        )

    def forward(
        self,
        observations: Any,
        masks: torch.Tensor | None,
        *,
        state: torch.Tensor | None = None,
        resets: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """``model.policy_and_values`` as every forward pass of the update runs it: in the update's
        precision (:meth:`_forward_precision`), each row's mask ANDed with the learner-wide
        ``action_mask``; a recurrent model's rows are time-major sequences from ``state`` with
        ``resets`` (:meth:`oakemu_core.policy.models.ActorCritic.forward`). Returns
        ``(policy, values)``."""
        with self._forward_precision():
            return self.model.policy_and_values(
                observations, self._row_masks(masks), state=state, resets=resets
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

        Returns :class:`PPOUpdateStats`; with fewer trainable rows (a recurrent model: sequences
        holding one) than ``num_minibatches``, each epoch used one per minibatch. Raises
        EmptyRolloutError: the buffer has no trainable row.
        """
        trainable_rows = int(rollout_buffer.trainable_size)
        if trainable_rows == 0:
            raise EmptyRolloutError("rollout_buffer: 0 trainable rows, expected at least 1")
        settings = self.settings
        tally = UpdateTally(self.device, learning_rate=float(self.optimizer.param_groups[0]["lr"]))
        self.model.train()
        flat, kl_reference = self._upload(rollout_buffer, proximal)
        # Fewer rows (sequences) than minibatches, e.g. most rows dropped as stale: one per minibatch.
        units = flat.sequences if self.recurrent else trainable_rows
        num_minibatches = min(num_minibatches or settings.num_minibatches, units)
        # One minibatch: every row in stored order (shuffling it would only cost copies), its
        # advantages normalised once for every epoch.
        whole = self._normalised(flat.whole()) if num_minibatches == 1 else None
        for epoch in range(settings.ppo_epochs):
            epoch_start = time.perf_counter()
            minibatches = (
                [whole]
                if whole is not None
                else [
                    self._normalised(minibatch)
                    for minibatch in flat.minibatches(num_minibatches, self._shuffle_rng)
                ]
            )
            epoch_kl = self._epoch(
                minibatches, tally, kl_reference, bc_term, current_policy_version
            )
            self._synchronize()
            tally.epoch_seconds.append(time.perf_counter() - epoch_start)
            if settings.target_kl is None and after_epoch is None:
                continue
            # One device sync per epoch, when needed.
            epoch_approx_kl = epoch_kl.item() / len(minibatches)
            if settings.target_kl is not None and epoch_approx_kl > settings.target_kl:
                tally.early_stopped = epoch + 1 < settings.ppo_epochs
                break
            if after_epoch is not None and epoch + 1 < settings.ppo_epochs:
                after_epoch(
                    epoch + 1, epoch_approx_kl, tally.nonfinite_minibatches, tally.minibatches
                )

        self._iterations += 1
        return tally.stats(flat, decoupled=proximal is not None)

    def _epoch(
        self,
        minibatches: list[RolloutMinibatch] | list[SequenceMinibatch],
        tally: UpdateTally,
        kl_reference: str,
        bc_term: tuple[float, Any, int] | None,
        current_policy_version: int,
    ) -> torch.Tensor:
        """One SGD step per minibatch, tallied; returns the sum of their ``approx_kl`` (a 0-dim
        tensor on the device). The first minibatch of the update (before any gradient step) also
        measures the actor/learner log-prob agreement on rows of ``current_policy_version``."""
        epoch_kl = torch.zeros((), device=self.device)
        for minibatch in minibatches:
            losses = self._minibatch_losses(minibatch, kl_reference)
            if "weights" in losses:
                tally.weight_total += losses["weights"].mean()
            if tally.minibatches == 0:  # before any gradient step: actor and learner should agree
                behaviour_ratio = (losses["new_log_probs"].detach() - minibatch.log_probs).exp()
                tally.first_minibatch_ratio_max_abs_dev = _ratio_deviation(
                    behaviour_ratio, minibatch.fields["policy_versions"], current_policy_version
                )
            tally.nonfinite += self._sgd_step(losses, bc_term)
            tally.add(losses)
            epoch_kl += losses["approx_kl"]
        return epoch_kl

    def _upload(
        self, rollout_buffer: RolloutBuffer, proximal: RolloutEvaluation | None
    ) -> tuple[FlatBatch | SequenceBatch, str]:
        """The trainable rows (a recurrent model: the sequences holding them) uploaded once (every
        epoch only reshuffles and indexes them), with the proximal policy's figures as extra fields
        when given; and the prefix of the stored parameters the exact KL is measured from (``""``:
        the acting policy's)."""
        batch = (
            rollout_buffer.sequence_batch(self.device, self.settings.sequence_length)
            if self.recurrent
            else rollout_buffer.flat_batch(self.device)
        )
        if proximal is None:
            return batch, ""
        # The cached batch stays as it is: a new one holds the extra fields.
        arrays = {"log_probs": proximal.log_probs, **proximal.distribution_fields}
        batch = batch.with_fields({PROXIMAL + name: array for name, array in arrays.items()})
        return batch, PROXIMAL  # the trust region is around the proximal policy

    def _normalised(self, minibatch: RolloutMinibatch) -> RolloutMinibatch:
        """``minibatch`` with its advantages normalised when the settings ask
        (:func:`~oakemu_core.algo.losses.normalize_advantages`), else as it is."""
        if not self.settings.normalize_advantages:
            return minibatch
        return minibatch._replace(advantages=normalize_advantages(minibatch.advantages))

    def _minibatch_losses(self, minibatch: Any, kl_reference: str) -> dict[str, torch.Tensor]:
        """One minibatch's forward pass and loss terms
        (:func:`~oakemu_core.algo.compiled_update.loss_terms`: ``loss``, ``new_log_probs`` and, with
        the decoupled objective, ``weights`` among them). With the proximal figures the ratio is
        taken against them and each row weighted by ``min(importance_weight_cap, pi_prox / mu)``;
        families with stored parameters get the exact KL from those ``kl_reference`` prefixes.
        ``minibatch``'s advantages are used as they are (:meth:`_normalised` first). A feed-forward
        model's pass goes through :attr:`minibatch_loss` (compiled when asked)."""
        fields = minibatch.fields
        proximal = fields.get(PROXIMAL + "log_probs")
        batch = LossBatch(
            actions=minibatch.actions,
            advantages=minibatch.advantages,
            old_log_probs=minibatch.log_probs if proximal is None else proximal,
            behaviour_log_probs=None if proximal is None else minibatch.log_probs,
            old_values=minibatch.values,
            returns=minibatch.returns,
            kl_reference={name: fields[kl_reference + name] for name in self._stored_parameters},
        )
        if self.recurrent:
            policy, new_values = self._sequence_forward(minibatch)
            return loss_terms(policy, new_values, batch, self.minibatch_loss.constants)
        return self.minibatch_loss(
            minibatch.observations, self._row_masks(fields.get("action_mask")), batch
        )

    def _sequence_forward(self, minibatch: SequenceMinibatch) -> tuple[Policy, torch.Tensor]:
        """A recurrent model's forward pass over a minibatch's sequences (every row, from the stored
        states, with the resets), then the policy and values of its trainable rows only
        (``trained_rows``): the rows the minibatch's per-row fields hold. In the update's precision,
        the rows' masks ANDed with the learner-wide ``action_mask``."""
        with self._forward_precision():
            head, values, _ = self.model(minibatch.observations, minibatch.state, minibatch.resets)
            rows = minibatch.trained_rows
            policy = self.model.distribution.policy(
                head.index_select(0, rows), self._row_masks(minibatch.fields.get("action_mask"))
            )
            return policy, values.index_select(0, rows)

    def _sgd_step(
        self, losses: dict[str, torch.Tensor], bc_term: tuple[float, Any, int] | None
    ) -> torch.Tensor:
        """Backward pass and optimizer step on the total loss (Schulman et al. 2017, eq. 9, negated:
        policy - c2 * entropy + c1 * value, plus the behaviour-cloning term). Returns a 0-dim bool
        tensor on the device, True when the gradient was not finite and the step was skipped (it
        would turn every weight into NaN)."""
        settings = self.settings
        loss = losses["loss"]
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
        policy, _ = self.forward(batch.observations, batch.action_mask)
        return bc_loss(policy, batch.actions)

    def _forward_precision(self) -> contextlib.AbstractContextManager[Any]:
        """The context of every forward pass of the update: bfloat16 autocast, or none for float32
        (a disabled autocast still costs its entry and exit on every minibatch)."""
        if self.settings.learner_precision == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def _ratio_deviation(
    ratio: torch.Tensor, versions: torch.Tensor, current_policy_version: int
) -> float:
    """max |ratio - 1| over the minibatch rows acted by ``current_policy_version`` (NaN if none)."""
    is_current = versions == int(current_policy_version)
    if not bool(is_current.any()):
        return math.nan
    return float((ratio[is_current] - 1.0).abs().max().item())
