"""The rollout's rows evaluated by the learner's current weights: the proximal policy of the
decoupled objective and the critic's fresh values (rows acted by older policy versions).

A recurrent policy's rows are evaluated over the sequences the update trains on
(:class:`~oakemu_core.storage.sequences.SequenceLayout`: ``sequence_length`` rows, whole columns by
default), each from the state stored with its first row and with the state zeroed after an episode's
end: the proximal policy is then exactly the update's first forward pass, so the ratio to it starts
at 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from oakemu_core.storage.sequences import POLICY_STATE, SequenceLayout

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
    sequence_length: int | None = None,
) -> RolloutEvaluation:
    """Re-evaluate every stored row with the current weights: the proximal policy's log-probs
    of the stored actions and its stored parameters, and the current critic's values
    (asynchronous mode: the rows were acted by older versions).

    Args:
        model: the actor-critic (``distribution.stored_fields()``; put in eval mode meanwhile).
        rollout_buffer: a full buffer (observations, actions and masks written).
        forward: ``(observations, row masks, *, state=, resets=) -> (policy, values)``, the
            update's forward pass (:meth:`oakemu_core.algo.ppo.PPOUpdater.forward`: precision,
            learner-wide mask; ``state`` and ``resets`` for a recurrent model only).
        device: where ``model`` is.
        chunk_rows: rows per forward pass (small chunks keep a CNN's activations in the caches); a
            recurrent model's passes hold whole sequences, at least one.
        sequence_length: a recurrent model's rows per sequence (None: whole columns); unused for a
            feed-forward model.

    Returns:
        A :class:`RolloutEvaluation`. A row whose stored action the current masks forbid gets
        a very negative log-prob (only non-trainable rows can have one).

    Raises:
        ValueError: a recurrent model on a rollout without stored states (``policy_state``).
    """
    if getattr(model, "recurrent", False):
        return _evaluate_sequences(
            model, rollout_buffer, forward, device, chunk_rows, sequence_length
        )
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


def _evaluate_sequences(
    model: nn.Module,
    rollout_buffer: RolloutBuffer,
    forward: Callable[..., tuple[Any, torch.Tensor]],
    device: torch.device,
    chunk_rows: int,
    sequence_length: int | None,
) -> RolloutEvaluation:
    """:func:`evaluate_rollout` of a recurrent model: whole sequences per forward pass, each from
    its stored first state with the resets, ``max(1, chunk_rows // L)`` sequences at a time."""
    schema = rollout_buffer.schema
    if POLICY_STATE not in schema:
        raise ValueError(
            "evaluate_rollout: a recurrent model needs the rollout's policy_state field; this "
            "rollout's schema has none (a feed-forward policy's)"
        )
    lead = (rollout_buffer.rollout_length, rollout_buffer.num_envs)
    layout = SequenceLayout.of(*lead, sequence_length)
    names = [
        *schema.observation_names,
        "actions",
        *(["action_mask"] if "action_mask" in schema else []),
    ]
    arrays = {name: rollout_buffer.field(name) for name in names}
    states, dones = rollout_buffer.field(POLICY_STATE), rollout_buffer.dones
    log_probs = np.empty(lead, dtype=np.float32)
    values = np.empty(lead, dtype=np.float32)
    stored = {
        name: np.empty((*lead, *shape), dtype=np.float32)
        for name, (shape, _) in model.distribution.stored_fields().items()
    }
    per_pass = max(1, chunk_rows // layout.length)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, layout.count, per_pass):
            part = layout.select(np.arange(start, min(start + per_pass, layout.count)))
            rows = {
                name: torch.from_numpy(part.gather(array)).reshape(-1, *array.shape[2:]).to(device)
                for name, array in arrays.items()
            }
            policy, part_values = forward(
                schema.join_observations(rows),
                rows.get("action_mask"),
                state=torch.from_numpy(part.initial_states(states)).to(device),
                resets=torch.from_numpy(part.resets(dones)).to(device),
            )
            outputs = {
                "log_probs": (policy.log_prob(rows["actions"]), log_probs),
                "values": (part_values, values),
                **{name: (tensor, stored[name]) for name, tensor in policy.stored().items()},
            }
            for tensor, out in outputs.values():
                per_row = tensor.float().cpu().numpy()
                part.scatter(per_row.reshape(part.length, part.count, *per_row.shape[1:]), out)
    finally:
        model.train(was_training)
    return RolloutEvaluation(log_probs, values, stored)
