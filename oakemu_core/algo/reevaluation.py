"""The rollout's rows evaluated by the learner's current weights: the proximal policy of the
decoupled objective and the critic's fresh values (rows acted by older policy versions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

__all__ = ["RolloutEvaluation", "evaluate_rollout"]


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


@torch.inference_mode()
def evaluate_rollout(
    model: nn.Module,
    rollout_buffer: RolloutBuffer,
    forward: Callable[[Any, torch.Tensor | None], tuple[Any, torch.Tensor]],
    device: torch.device,
    *,
    chunk_rows: int = 256,
) -> RolloutEvaluation:
    """Re-evaluate every stored row with the current weights: the proximal policy's log-probs
    of the stored actions and its stored parameters, and the current critic's values
    (asynchronous mode: the rows were acted by older versions).

    Args:
        model: the actor-critic (``distribution.stored_fields()``; put in eval mode meanwhile).
        rollout_buffer: a full buffer (observations, actions and masks written).
        forward: ``(observations, row masks) -> (policy, values)``, the update's forward pass
            (:meth:`oakemu_core.algo.ppo.PPOUpdater.forward`: precision, learner-wide mask).
        device: where ``model`` is.
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
    flat = {name: rollout_buffer.field(name).reshape(total, *schema[name].shape) for name in names}
    log_probs = np.empty(total, dtype=np.float32)
    values = np.empty(total, dtype=np.float32)
    stored = {
        name: np.empty((total, *shape), dtype=np.float32)
        for name, (shape, _) in model.distribution.stored_fields().items()
    }
    was_training = model.training
    model.eval()
    try:
        for start in range(0, total, chunk_rows):
            chunk = {
                name: torch.from_numpy(array[start : start + chunk_rows].copy()).to(device)
                for name, array in flat.items()
            }
            policy, chunk_values = forward(
                schema.join_observations(chunk), chunk.get("action_mask")
            )
            end = start + len(chunk["actions"])
            log_probs[start:end] = policy.log_prob(chunk["actions"]).float().cpu().numpy()
            values[start:end] = chunk_values.float().cpu().numpy()
            for name, tensor in policy.stored().items():
                stored[name][start:end] = tensor.float().cpu().numpy()
    finally:
        model.train(was_training)
    lead = (rollout_buffer.rollout_length, rollout_buffer.num_envs)
    return RolloutEvaluation(
        log_probs.reshape(lead),
        values.reshape(lead),
        {name: array.reshape(*lead, *array.shape[1:]) for name, array in stored.items()},
    )
