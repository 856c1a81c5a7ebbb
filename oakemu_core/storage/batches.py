"""What PPO reads from a rollout: the flat batch of trainable rows and its minibatches.

A :class:`FlatBatch` holds every minibatch field of the step schema
(:attr:`~oakemu_core.step_schema.StepSchema.minibatch`) for the trainable rows of one rollout,
flattened in row-major ``(t, env)`` order and uploaded to a device once
(:meth:`~oakemu_core.storage.rollout_buffer.RolloutBuffer.flat_batch` builds and caches it); every
epoch then only shuffles and indexes it (:meth:`FlatBatch.minibatches`), as CleanRL indexes its
``b_obs``, ``b_logprobs``, ... Minibatches are small named tuples (:class:`RolloutMinibatch`), as in
Stable-Baselines3, with every field also reachable by schema name. Advantages are served as GAE
computed them: the PPO update normalises each minibatch's (:func:`oakemu_core.algo.losses.normalize_advantages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from oakemu_core.step_schema import StepSchema

if TYPE_CHECKING:  # torch is imported lazily: actors and tools can use the buffer without it
    import torch

__all__ = [
    "FlatBatch",
    "RolloutBufferTrainableDiagnostics",
    "RolloutMinibatch",
    "StaleAdvantagesError",
]


class StaleAdvantagesError(RuntimeError):
    """Minibatches were requested while the advantages do not describe the stored rows."""


class RolloutMinibatch(NamedTuple):
    """One PPO minibatch, every tensor on the requested device, first dimension = batch B.

    Attributes:
        observations: ``(B, *obs_shape)`` in the stored dtype (uint8 frames stay uint8), or for
            dict observations a dict key -> tensor.
        actions: ``(B, *action_shape)``. log_probs, values, advantages, returns: ``(B,)`` float32.
        fields: every minibatch field of the schema by name (the ones above included, plus e.g.
            ``action_mask``, ``action_mean``, ``action_std``, ``policy_versions``).
    """

    observations: Any
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    fields: dict[str, torch.Tensor]


@dataclass
class FlatBatch:
    """The trainable rows of a rollout, flattened in row-major ``(t, env)`` order, on a device.

    Built once per update (:meth:`gather`, through ``RolloutBuffer.flat_batch``); epochs then only
    index it.

    Attributes:
        schema: the buffer's schema.
        fields: every minibatch field, ``(M, *shape)`` tensors.
        rows: ``(M,)`` int64 flat row indices ``t * num_envs + env`` of the trainable rows.
    """

    schema: StepSchema
    fields: dict[str, torch.Tensor]
    rows: np.ndarray

    @classmethod
    def gather(
        cls,
        schema: StepSchema,
        arrays: Mapping[str, np.ndarray],
        trainable: np.ndarray,
        device: torch.device,
    ) -> FlatBatch:
        """Gather the trainable rows of every minibatch field on the CPU and upload each field once.

        Args:
            schema: the step schema of ``arrays``.
            arrays: field name -> ``(T, N, *shape)`` array, for every minibatch field.
            trainable: ``(T, N)`` bool, the rows to serve (a private copy: it is read twice).
            device: torch device for the tensors.

        Returns:
            The flat batch; ``size`` 0 (empty tensors) when no row is trainable. The arrays are
            never modified.
        """
        import torch

        rows = np.flatnonzero(trainable.reshape(-1))
        tensors: dict[str, torch.Tensor] = {}
        for item in schema.minibatch:
            flat = arrays[item.name].reshape((trainable.size, *item.shape))
            tensors[item.name] = torch.from_numpy(flat[rows]).to(device)
        return cls(schema, tensors, rows)

    @property
    def size(self) -> int:
        """Trainable rows ``M``."""
        return int(self.rows.size)

    def with_fields(self, arrays: Mapping[str, np.ndarray]) -> FlatBatch:
        """A batch with more per-row fields: each ``(T, N, *shape)`` array's trainable rows,
        uploaded (the decoupled objective's proximal figures). This batch is left as it is."""
        import torch

        device = next(iter(self.fields.values())).device
        extra = {
            name: torch.from_numpy(array.reshape(-1, *array.shape[2:])[self.rows]).to(device)
            for name, array in arrays.items()
        }
        return replace(self, fields={**self.fields, **extra})

    def trainable_rows(self, name: str) -> torch.Tensor:
        """``(M, *shape)``: field ``name`` at the trainable rows (every row of this batch)."""
        return self.fields[name]

    def minibatches(
        self, num_minibatches: int, generator: np.random.Generator
    ) -> list[RolloutMinibatch]:
        """Shuffle the rows and split them into ``num_minibatches`` minibatches (sizes differ by at
        most one; every row appears once; no row dropped, no small tail).

        Raises:
            ValueError: ``num_minibatches`` not an int in ``[1, size]``.
        """
        import torch

        if (
            isinstance(num_minibatches, bool)
            or not isinstance(num_minibatches, (int, np.integer))
            or num_minibatches <= 0
        ):
            raise ValueError(
                f"num_minibatches: expected a positive int, received {num_minibatches!r}"
            )
        if num_minibatches > self.size:
            raise ValueError(
                f"num_minibatches: expected at most the {self.size} trainable rows, received {num_minibatches}"
            )
        device = next(iter(self.fields.values())).device
        order = torch.from_numpy(generator.permutation(self.size)).to(device)
        return [
            self._minibatch(
                {name: tensor.index_select(0, positions) for name, tensor in self.fields.items()}
            )
            for positions in torch.tensor_split(order, num_minibatches)
        ]

    def whole(self) -> RolloutMinibatch:
        """Every row as one minibatch, in stored order, without a copy: for an update with one
        minibatch, whose gradient does not depend on the row order (no shuffle to pay for)."""
        return self._minibatch(dict(self.fields))

    def _minibatch(self, picked: dict[str, Any]) -> RolloutMinibatch:
        return RolloutMinibatch(
            observations=self.schema.join_observations(picked),
            actions=picked["actions"],
            log_probs=picked["log_probs"],
            values=picked["values"],
            advantages=picked["advantages"],
            returns=picked["returns"],
            fields=picked,
        )


@dataclass(frozen=True)
class RolloutBufferTrainableDiagnostics:
    """The trainable rows of a rollout, flattened in row-major ``(t, env)`` order, for learner logging.

    Attributes:
        values: ``(M,)`` float32, V(s_t) as stored (the acting policy's, or the learner's after re-evaluation).
        returns: ``(M,)`` float32, GAE returns.
        advantages: ``(M,)`` float32, unnormalised GAE advantages.
    """

    values: np.ndarray
    returns: np.ndarray
    advantages: np.ndarray
