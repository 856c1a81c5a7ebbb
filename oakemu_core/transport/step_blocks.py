"""An actor's block of K consecutive vector steps, sent as one step message (``steps_per_message``).

Small envs (CartPole: ~40 bytes per env step) pay far more for a message than for its data: the
encode, the syscalls, the learner's decode, validation and buffer write cost the same for 300 bytes
as for 30 KB. A :class:`StepBlock` gathers K vector steps of one actor into preallocated
``(K, n, *shape)`` arrays (one per sent field of the step schema), then the actor sends them as one
:class:`~oakemu_core.transport.steps.StepMessage`; the learner validates the block whole and writes its K rows
with one copy per field (:meth:`oakemu_core.storage.rollout_buffer.RolloutBuffer.write` with
``validated=True``, ``rows=K``).

A block of one step (K = 1) copies nothing: it keeps the recorded step's own ``(n, *shape)`` arrays,
so an actor sends every message through a block whatever its K.

The message's ``(policy_version, revision)`` is that of the OLDEST weights that acted on any of the
K steps (the actor loads new weights only between blocks, so normally all K agree; after a rejoin
in the middle of a block they may not, and the oldest keeps the learner's lag check conservative).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from oakemu_core.step_schema import StepSchema
from oakemu_core.transport.steps import StepMessage

__all__ = ["StepBlock"]


class StepBlock:
    """Preallocated ``(K, n, *shape)`` arrays for every sent field of ``schema``; for K = 1, the
    recorded step's own ``(n, *shape)`` arrays (no copy: valid while the caller keeps them unchanged).

    Args:
        schema: the step schema (its *sent* fields are stored).
        num_envs: n, the actor's envs.
        steps: K >= 1, vector steps per block.

    Raises:
        ValueError: ``num_envs`` or ``steps`` below 1.
    """

    def __init__(self, schema: StepSchema, num_envs: int, steps: int) -> None:
        if num_envs < 1 or steps < 1:
            raise ValueError(
                f"StepBlock: expected num_envs >= 1 and steps >= 1, received {num_envs}, {steps}"
            )
        self.schema = schema
        self.num_envs = int(num_envs)
        self.steps = int(steps)
        self.arrays: dict[str, np.ndarray] = (
            {
                f.name: np.zeros((self.steps, self.num_envs, *f.shape), dtype=f.dtype)
                for f in schema.sent
            }
            if self.steps > 1
            else {}
        )
        self._items = tuple(self.arrays.items())
        self.count = 0
        self.policy_version = 0
        self.revision = 0
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []

    @property
    def full(self) -> bool:
        """All K steps recorded."""
        return self.count == self.steps

    def clear(self) -> None:
        """Start a new block (the arrays are overwritten, not zeroed)."""
        self.count = 0
        self.episode_returns = []
        self.episode_lengths = []

    def record(
        self,
        fields: Mapping[str, np.ndarray],
        policy_version: int,
        episode_returns: Sequence[float] = (),
        episode_lengths: Sequence[int] = (),
        *,
        revision: int = 0,
    ) -> None:
        """Copy one vector step (every sent field, ``(n, *shape)``), acted by revision ``revision``
        of ``policy_version``, into the next row of the block (K = 1: keep its arrays).

        Raises:
            OverflowError: the block is already full (call :meth:`clear`).
            KeyError: a sent field is missing from ``fields`` (K > 1).
            ValueError: a field does not broadcast to ``(n, *shape)`` (numpy's message; K > 1).
        """
        index = self.count
        if index >= self.steps:
            raise OverflowError(f"StepBlock.record: the block of {self.steps} steps is full")
        if self.steps == 1:
            self.arrays = dict(fields)
        for name, array in self._items:
            array[index] = fields[name]
        acted_by = (int(policy_version), int(revision))
        if index == 0 or acted_by < (self.policy_version, self.revision):
            self.policy_version, self.revision = acted_by
        if episode_returns:
            self.episode_returns.extend(episode_returns)
            self.episode_lengths.extend(episode_lengths)
        self.count = index + 1

    def message(self, actor_id: str, incarnation: str, seq: int) -> StepMessage:
        """The full block as one step message (arrays are the block's own, not copies: send it
        before the next :meth:`record`; its encoded frames are views of them).

        Raises:
            ValueError: the block is not full.
        """
        if not self.full:
            raise ValueError(f"StepBlock.message: {self.count} of {self.steps} steps recorded")
        return StepMessage(
            actor_id=actor_id,
            incarnation=incarnation,
            seq=seq,
            policy_version=self.policy_version,
            fields=self.arrays,
            episode_returns=list(self.episode_returns),
            episode_lengths=list(self.episode_lengths),
            revision=self.revision,
        )
