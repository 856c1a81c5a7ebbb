"""What one PPO update did: :class:`PPOUpdateStats`, the tally an update keeps on the device while
it runs (:class:`UpdateTally`), and the critic's :func:`explained_variance`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oakemu_core.storage.batches import FlatBatch
    from oakemu_core.storage.sequences import SequenceBatch

__all__ = ["PPOUpdateStats", "UpdateTally", "explained_variance"]


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """``1 - Var(targets - predictions) / Var(targets)`` (as CleanRL/SB3) of two ``(M,)`` tensors on
    one device, computed there in float64 (float32 on MPS, which has no float64) with population
    variances; one device sync. NaN when Var(targets) is 0 or the tensors are empty. 1 is a perfect
    value function, 0 no better than a constant."""
    if targets.numel() == 0:
        return math.nan
    dtype = torch.float32 if targets.device.type == "mps" else torch.float64
    predictions, targets = predictions.to(dtype), targets.to(dtype)
    variance = targets.var(correction=0)
    ratio = (targets - predictions).var(correction=0) / variance
    return float(torch.where(variance == 0, math.nan, 1.0 - ratio).item())


@dataclass
class PPOUpdateStats:
    """What one :meth:`oakemu_core.algo.ppo.PPOUpdater.step` did.

    Losses, entropy, approx_kl and clip_fraction are means over every minibatch that was trained
    on. ``explained_variance`` compares the stored values (the actor's, or the learner's after a
    re-evaluation) with the GAE returns over the trainable rows.
    ``first_minibatch_ratio_max_abs_dev`` is max |ratio - 1| on the first minibatch before any
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


class UpdateTally:
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

    def stats(self, batch: FlatBatch | SequenceBatch, *, decoupled: bool) -> PPOUpdateStats:
        """The update's :class:`PPOUpdateStats`; ``batch``: the rows it trained on (the values and
        returns of its trainable rows, on the device, give the explained variance)."""
        values, returns = batch.trainable_rows("values"), batch.trainable_rows("returns")
        means = {key: value.item() / self.minibatches for key, value in self.totals.items()}
        return PPOUpdateStats(
            **means,
            explained_variance=explained_variance(values, returns),
            learning_rate=self.learning_rate,
            epochs_completed=len(self.epoch_seconds),
            minibatches=self.minibatches,
            early_stopped=self.early_stopped,
            first_minibatch_ratio_max_abs_dev=self.first_minibatch_ratio_max_abs_dev,
            update_seconds=time.perf_counter() - self.start_time,
            epoch_seconds=self.epoch_seconds,
            trainable_rows=batch.size,
            nonfinite_minibatches=self.nonfinite_minibatches,
            importance_weight_mean=self.weight_total.item() / self.minibatches
            if decoupled
            else math.nan,
        )
