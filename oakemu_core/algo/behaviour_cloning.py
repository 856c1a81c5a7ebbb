"""Behaviour cloning: the loss of demonstrated actions and one replay-only pre-training update.

:func:`bc_loss` is the negative log-likelihood of the demonstrated actions under a
:class:`~oakemu_core.policy.distributions.Policy`; :func:`behaviour_cloning_update` is one
replay-only rollout of pre-training on a :class:`~oakemu_core.algo.demonstrations.DemonstrationSampler`
(one epoch, as the seed says: "replay-only BC rollouts use a single epoch so the replay bootstrap
phase is not multiplied by the PPO epoch count").
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from oakemu_core.algo.demonstrations import (
    DemonstrationBatch,
    DemonstrationSampler,
    batch_to_device,
)

__all__ = ["bc_loss", "behaviour_cloning_update"]


def bc_loss(policy: Any, actions: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the demonstrated ``actions`` under ``policy``.

    Args:
        policy: an :class:`oakemu_core.policy.distributions.Policy` for ``B`` observations (with gradients).
        actions: ``(B, *action_shape)`` tensor of the distribution's dtype, on the policy's device.

    Returns:
        A scalar float32 tensor, ``-mean(policy.log_prob(actions))``.
    """
    return -policy.log_prob(actions).mean()


def behaviour_cloning_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: DemonstrationSampler,
    *,
    batch_size: int,
    rows: int | None = None,
    epochs: int = 1,
    steps: int | None = None,
    device: torch.device | str = "cpu",
    max_grad_norm: float = 0.5,
    rng: np.random.Generator | None = None,
    update_observation_statistics: bool = True,
) -> dict[str, float]:
    """One behaviour-cloning pre-training update: a replay-only rollout trained for one epoch.

    The rollout is ``sampler.replay_rollout(rows)`` (default: as many rows as the dataset holds,
    i.e. one shuffled pass); it is cut into minibatches of ``batch_size`` rows and each minibatch
    takes one gradient step on :func:`bc_loss` (gradient norm clipped to ``max_grad_norm``; a
    non-finite gradient skips its step). Replay-only rollouts use a single epoch (the seed), so
    ``epochs`` defaults to 1; ``steps`` caps the gradient steps.

    Args:
        model: an :class:`~oakemu_core.policy.models.ActorCritic` on ``device``
            (``policy_and_values(observations, action_mask) -> (Policy, values)``).
        optimizer: optimizer over ``model``'s parameters (the learner's).
        sampler: the demonstrations.
        batch_size: rows per gradient step (>= 1).
        rows: rows of the replay-only rollout (default ``len(sampler)``).
        epochs: passes over the rollout (default 1).
        steps: at most this many gradient steps (None: no cap).
        device: where the update runs.
        max_grad_norm: global gradient-norm clip (> 0).
        rng: generator for the minibatch shuffle and the replay order (default: the sampler's).
        update_observation_statistics: merge the rollout's observations into the model's running
            observation statistics first (no-op without observation normalisation).

    Returns:
        ``{"bc_loss": mean loss, "bc_accuracy": share of rows whose greedy action equals the
        demonstrated one (NaN for continuous actions), "bc_steps": gradient steps, "bc_rows": rows,
        "bc_nonfinite_steps": skipped steps, "bc_seconds": wall time}`` (floats).

    Raises:
        ValueError: ``batch_size``, ``epochs`` or ``rows`` < 1, ``max_grad_norm`` <= 0.
    """
    start = time.perf_counter()
    if (
        int(batch_size) < 1
        or int(epochs) < 1
        or (rows is not None and int(rows) < 1)
        or not max_grad_norm > 0
    ):
        raise ValueError(
            f"behaviour_cloning_update: expected batch_size >= 1, epochs >= 1, rows >= 1 or None and "
            f"max_grad_norm > 0, received {batch_size!r}, {epochs!r}, {rows!r}, {max_grad_norm!r}"
        )
    rng = sampler._rng if rng is None else rng
    rollout = sampler.replay_rollout(len(sampler) if rows is None else int(rows), rng)
    if update_observation_statistics and hasattr(model, "update_observation_statistics"):
        model.update_observation_statistics(rollout.observations)
    batch = batch_to_device(rollout, device)
    total_rows = len(rollout)
    totals = _Totals(discrete=sampler.spec.action_kind != "box")
    model.train()
    for _ in range(int(epochs)):
        order = torch.from_numpy(rng.permutation(total_rows)).to(device)
        for begin in range(0, total_rows, int(batch_size)):
            if steps is not None and totals.steps >= int(steps):
                break
            _bc_step(
                model,
                optimizer,
                _minibatch(batch, order[begin : begin + int(batch_size)]),
                max_grad_norm,
                totals,
            )
    return totals.metrics(total_rows, time.perf_counter() - start)


class _Totals:
    """Running sums of a behaviour-cloning update, for its metrics."""

    def __init__(self, *, discrete: bool) -> None:
        self.discrete = discrete
        self.loss_sum = 0.0
        self.correct = 0.0
        self.counted = 0
        self.steps = 0
        self.skipped = 0

    def metrics(self, rows: int, seconds: float) -> dict[str, float]:
        """The metrics :func:`behaviour_cloning_update` returns."""
        counted = self.counted
        return {
            "bc_loss": self.loss_sum / counted if counted else math.nan,
            "bc_accuracy": (self.correct / counted if counted else math.nan)
            if self.discrete
            else math.nan,
            "bc_steps": float(self.steps),
            "bc_rows": float(rows),
            "bc_nonfinite_steps": float(self.skipped),
            "bc_seconds": seconds,
        }


def _minibatch(batch: DemonstrationBatch, index: torch.Tensor) -> DemonstrationBatch:
    """The rows ``index`` of a batch of tensors."""
    observations = (
        {key: value[index] for key, value in batch.observations.items()}
        if isinstance(batch.observations, dict)
        else batch.observations[index]
    )
    mask = None if batch.action_mask is None else batch.action_mask[index]
    return DemonstrationBatch(observations, batch.actions[index], mask)


def _bc_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    minibatch: DemonstrationBatch,
    max_grad_norm: float,
    totals: _Totals,
) -> None:
    """One gradient step on :func:`bc_loss` of ``minibatch`` (skipped when the clipped gradient
    norm is not finite), counted into ``totals``."""
    policy, _ = model.policy_and_values(minibatch.observations, minibatch.action_mask)
    actions = minibatch.actions
    loss = bc_loss(policy, actions)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        totals.skipped += 1
    with torch.no_grad():
        rows = int(actions.shape[0])
        totals.loss_sum += float(loss.item()) * rows
        totals.counted += rows
        if totals.discrete:
            same = policy.mode() == actions
            if same.dim() > 1:
                same = same.all(dim=-1)
            totals.correct += float(same.float().sum().item())
    totals.steps += 1
