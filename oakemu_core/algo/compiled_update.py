"""The loss of one PPO minibatch as one function of tensors, run eagerly or through ``torch.compile``
(the ``compile_update`` setting).

:func:`loss_terms` turns a policy and its values into the PPO loss terms
(:func:`~oakemu_core.algo.losses.ppo_losses`), the exact KL where the action distribution stores its
parameters, and the total loss. :class:`MinibatchLoss` runs a feed-forward model's forward pass and
:func:`loss_terms` for one minibatch, compiled when asked. The backward pass of a compiled forward
pass is compiled with it (AOTAutograd); the gradient clip and the optimizer step (one fused kernel
over :class:`~oakemu_core.algo.flat_parameters.FlatAdam`'s flat tensor) stay eager.

Modes (``torch.compile``'s, :data:`COMPILE_MODES`):

- ``"none"``: eager (the default).
- ``"default"``: inductor's generated kernels (C++ on a CPU, Triton on a GPU): fewer, fused ops.
- ``"reduce-overhead"``: the same, and on a GPU CUDA graphs: a minibatch's forward and backward
  replay recorded kernel launches (a small model's GPU update is bound by launches, not arithmetic).
  On a CPU the same as ``"default"``.

Shapes: compiled code is specialised to the minibatch's row count (dynamo makes it dynamic after a
first change) and to whether the rows carry action masks and the decoupled objective's proximal
figures. Each such signature, up to :data:`MAX_COMPILED_SIGNATURES`, runs compiled; later ones run
eagerly, said once in the log. A compile that fails is logged once and the update runs eagerly from
then on. The compiled update computes the same function as the eager one: the results agree to
float32 rounding (operations fused in another order), not bit for bit.

Costs and figures: ``docs/benchmarks.md``, "The learner on a device".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from oakemu_core.algo.losses import ppo_losses

if TYPE_CHECKING:
    from oakemu_core.policy.distributions import Policy

__all__ = [
    "COMPILE_MODES",
    "MAX_COMPILED_SIGNATURES",
    "LossBatch",
    "LossConstants",
    "MinibatchLoss",
    "loss_terms",
]

log = logging.getLogger("oakemu.learner")

COMPILE_MODES = ("none", "default", "reduce-overhead")
"""The values of ``compile_update``: eager, or a ``torch.compile`` mode."""

MAX_COMPILED_SIGNATURES = 6
"""Minibatch signatures (row count, masked, decoupled) that run compiled; later ones run eagerly.
At most one compile each, below dynamo's own recompile limit (8 per function), so that limit is
never what stops compiling. A run has 1-4 (a minibatch size, the last one's, each plain and
decoupled) unless its trainable rows change from update to update."""


class LossConstants(NamedTuple):
    """The loss's hyperparameters (:class:`~oakemu_core.algo.settings.PPOSettings`' names):
    ``clip_value_range`` is resolved (a range in value units, or None for plain MSE)."""

    clip_coef: float
    clip_value_range: float | None
    ent_coef: float
    vf_coef: float
    importance_weight_cap: float


class LossBatch(NamedTuple):
    """A minibatch's per-row tensors the loss reads besides the observations, all ``(B, ...)`` on
    the update's device.

    Attributes:
        actions: the stored actions. advantages: normalised as the update wants them.
        old_log_probs: ``(B,)`` the log-probs the ratio is taken against: the behaviour policy's
            (plain PPO) or the proximal policy's (decoupled objective).
        behaviour_log_probs: ``(B,)`` the behaviour policy's log-probs when ``old_log_probs`` are
            the proximal ones (each row then weighted by ``min(cap, pi_prox / mu)``); None: plain PPO.
        old_values: ``(B,)`` stored (or re-evaluated) values. returns: ``(B,)`` GAE returns.
        kl_reference: the stored distribution parameters the exact KL is measured from
            (``{"action_mean": ..., "action_std": ...}`` for a Gaussian); empty: the k3 estimate.
    """

    actions: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    behaviour_log_probs: torch.Tensor | None
    old_values: torch.Tensor
    returns: torch.Tensor
    kl_reference: dict[str, torch.Tensor]


def loss_terms(
    policy: Policy, new_values: torch.Tensor, batch: LossBatch, constants: LossConstants
) -> dict[str, torch.Tensor]:
    """The PPO loss terms of one minibatch from the current ``policy`` and ``new_values`` ``(B,)``.

    Returns :func:`~oakemu_core.algo.losses.ppo_losses`' dict (its ``approx_kl`` replaced by the
    exact KL from ``batch.kl_reference`` when that is not empty), plus ``loss`` (Schulman et al.
    2017, eq. 9, negated: ``policy_loss + vf_coef * value_loss - ent_coef * entropy``, a 0-dim
    tensor with gradients), ``new_log_probs`` ``(B,)`` and, with the decoupled objective, ``weights``
    ``(B,)`` (the truncated ``pi_prox / mu``, without gradients). With ``ent_coef`` 0 the entropy is
    computed without gradients (weighted 0 it would only cost backward ops)."""
    with torch.set_grad_enabled(bool(constants.ent_coef)):
        entropy = policy.entropy()
    new_log_probs = policy.log_prob(batch.actions)
    weights = None
    if batch.behaviour_log_probs is not None:
        weights = (
            (batch.old_log_probs - batch.behaviour_log_probs)
            .clamp(max=math.log(constants.importance_weight_cap))
            .exp()
        )
    losses = ppo_losses(
        new_log_probs,
        batch.old_log_probs,
        batch.advantages,
        new_values,
        batch.old_values,
        batch.returns,
        entropy,
        clip_coef=constants.clip_coef,
        clip_value_range=constants.clip_value_range,
        importance_weights=weights,
    )
    if batch.kl_reference:  # the exact KL from the stored parameters
        with torch.no_grad():
            losses["approx_kl"] = policy.kl_from(batch.kl_reference).mean()
    loss = losses["policy_loss"] + constants.vf_coef * losses["value_loss"]
    if constants.ent_coef:
        loss = loss - constants.ent_coef * losses["entropy"]
    losses["loss"] = loss
    losses["new_log_probs"] = new_log_probs
    if weights is not None:
        losses["weights"] = weights
    return losses


class MinibatchLoss:
    """A feed-forward model's forward pass and :func:`loss_terms` for one minibatch, eager or
    compiled (``mode``, one of :data:`COMPILE_MODES`).

    Args:
        model: the actor-critic (``policy_and_values(observations, masks)``), on its device.
        constants: the loss's hyperparameters.
        autocast_dtype: the forward pass's autocast dtype (``torch.bfloat16`` for mixed precision),
            or None for float32.
        mode: ``"none"`` (eager), ``"default"`` or ``"reduce-overhead"``.

    Raises:
        ValueError: ``mode`` is not one of :data:`COMPILE_MODES`.
    """

    def __init__(
        self,
        model: nn.Module,
        constants: LossConstants,
        *,
        autocast_dtype: torch.dtype | None = None,
        mode: str = "none",
    ) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile_update: expected one of {COMPILE_MODES}, received {mode!r}")
        self.model = model
        self.constants = constants
        self.mode = mode
        self._autocast_dtype = autocast_dtype
        self._device_type = next(model.parameters()).device.type
        self._compiled: Callable[..., dict[str, torch.Tensor]] | None = None
        if mode != "none":
            self._compiled = torch.compile(self._terms, mode=mode)
            log.info(
                "compile_update %s: each minibatch's forward pass and loss run through "
                "torch.compile (the first minibatches of each shape compile: seconds to a minute)",
                mode,
            )
        self._cuda_graphs = mode == "reduce-overhead" and self._device_type == "cuda"
        self.signatures: set[tuple[int, bool, bool]] = set()
        """The minibatch signatures (rows, masked, decoupled) run compiled so far."""
        self.eager_signatures = 0
        """Minibatches run eagerly because :data:`MAX_COMPILED_SIGNATURES` were taken."""

    @property
    def compiled(self) -> bool:
        """Whether minibatches still run through ``torch.compile`` (False: eager, asked for or after a
        failed compile)."""
        return self._compiled is not None

    def __call__(
        self, observations: Any, masks: torch.Tensor | None, batch: LossBatch
    ) -> dict[str, torch.Tensor]:
        """:func:`loss_terms` of ``model``'s policy and values on ``observations`` ``(B, *shape)`` (or
        a dict of them) with the rows' action ``masks`` ``(B, width)`` bool (or None)."""
        if self._compiled is not None and self._admits(observations, masks, batch):
            try:
                if self._cuda_graphs:  # each minibatch is a new step of the recorded graphs
                    torch.compiler.cudagraph_mark_step_begin()
                return self._compiled(observations, masks, batch)
            except Exception as error:  # noqa: BLE001 - any compiler failure: eager, said once
                log.warning(
                    "compile_update %s: torch.compile failed (%s: %s); the update runs eagerly",
                    self.mode,
                    type(error).__name__,
                    str(error).strip().splitlines()[0] if str(error).strip() else "",
                )
                self._compiled = None
        return self._terms(observations, masks, batch)

    def _admits(self, observations: Any, masks: torch.Tensor | None, batch: LossBatch) -> bool:
        """Whether this minibatch's signature runs compiled: one seen before, or a new one while
        fewer than :data:`MAX_COMPILED_SIGNATURES` were (the first refused one is logged)."""
        signature = (
            int(batch.actions.shape[0]),
            masks is not None,
            batch.behaviour_log_probs is not None,
        )
        if signature in self.signatures:
            return True
        if len(self.signatures) < MAX_COMPILED_SIGNATURES:
            self.signatures.add(signature)
            return True
        if not self.eager_signatures:
            log.warning(
                "compile_update %s: minibatches of %d rows make more than %d shapes; shapes not "
                "compiled yet run eagerly from now on",
                self.mode,
                signature[0],
                MAX_COMPILED_SIGNATURES,
            )
        self.eager_signatures += 1
        return False

    def _terms(
        self, observations: Any, masks: torch.Tensor | None, batch: LossBatch
    ) -> dict[str, torch.Tensor]:
        context = (
            torch.autocast(self._device_type, dtype=self._autocast_dtype)
            if self._autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with context:
            policy, new_values = self.model.policy_and_values(observations, masks)
        return loss_terms(policy, new_values, batch, self.constants)
