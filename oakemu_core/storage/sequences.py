"""What PPO reads from a rollout for a recurrent policy: sequences of rows and their minibatches.

A recurrent policy's output at row ``t`` depends on the rows before it, so the update cannot shuffle
rows as the feed-forward :class:`~oakemu_core.storage.batches.FlatBatch` does: it replays whole
sequences. A :class:`SequenceBatch` cuts every column of a full rollout (``T`` consecutive steps of
one env) into chunks of ``L`` rows (``sequence_length``; None: ``L = T``, one chunk per column; a
last shorter chunk is padded), and starts each chunk from the state stored with its first row
(``policy_state``: the acting policy's state before that row). Inside a chunk the state is zeroed
before a row whose previous row ended an episode (``resets[t] = dones[t - 1]``; at a chunk's first
row the stored state already is zeros after an episode's end). Epochs shuffle and split CHUNKS, never
rows; the loss is taken on the trainable rows only (``trainable`` and not padding), the others only
carry the state forward.

Why this choice: fixed-length chunks from stored states are the "stored state" strategy of R2D2
(Kapturowski et al. 2019) and what sb3-contrib's ``RecurrentPPO`` does with the hidden states it
stores per step; whole columns, the default, are CleanRL's ``ppo_atari_lstm.py`` (each env's rollout
replayed from the state at its start, with the state zeroed at episode starts). Whole columns give
the truest states (one stored state per column, the rest recomputed by the weights being trained) but
few, long sequences: with ``N`` columns at most ``N`` minibatches. Shorter chunks give more, shorter
sequences for more minibatches (and a shorter backpropagation through time), at the cost of starting
from states the acting policy computed. Chunks are cut at fixed rows, not at episode starts, so every
chunk has ``L`` rows and one tensor holds them all (no packed sequences).

Layout: every field is TIME-MAJOR, ``(L, C, *shape)`` for ``C`` chunks, so that a minibatch's
``(L, C', ...)`` fields flattened give the model's ``(L * C', ...)`` row order (row ``t * C' + c`` is
step ``t`` of chunk ``c``, :meth:`oakemu_core.policy.models.ActorCritic.forward`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from oakemu_core.step_schema import StepSchema

if TYPE_CHECKING:  # torch is imported lazily: actors and tools can use the buffer without it
    import torch

__all__ = ["POLICY_STATE", "SequenceBatch", "SequenceLayout", "SequenceMinibatch"]

POLICY_STATE = "policy_state"
"""The stored field a sequence starts from (:func:`oakemu_core.step_schema.standard.policy_state_field`)."""


@dataclass(frozen=True)
class SequenceLayout:
    """Where the rows of ``C`` sequences of ``L`` rows lie in a ``(T, N)`` rollout.

    Attributes:
        times: ``(L, C)`` int64, the rollout row ``t`` of each sequence row; on padding the
            column's last row (valid inputs that the mask leaves out).
        columns: ``(C,)`` int64, the column of each sequence.
        valid: ``(L, C)`` bool, False on padding (rows past the column's end).
    """

    times: np.ndarray
    columns: np.ndarray
    valid: np.ndarray

    @classmethod
    def of(cls, rollout_length: int, num_envs: int, sequence_length: int | None) -> SequenceLayout:
        """Every column cut into chunks of ``L = min(sequence_length, T)`` rows (None: ``L = T``),
        column by column, each column's chunks in time order; the last chunk of a column is padded
        when ``L`` does not divide ``T``.

        Raises:
            ValueError: ``sequence_length`` not None or a positive int.
        """
        if sequence_length is not None and (
            isinstance(sequence_length, bool)
            or not isinstance(sequence_length, (int, np.integer))
            or sequence_length <= 0
        ):
            raise ValueError(
                f"sequence_length: expected None or a positive int, received {sequence_length!r}"
            )
        length = (
            rollout_length if sequence_length is None else min(int(sequence_length), rollout_length)
        )
        per_column = math.ceil(rollout_length / length)
        starts = np.tile(np.arange(per_column, dtype=np.int64) * length, num_envs)
        columns = np.repeat(np.arange(num_envs, dtype=np.int64), per_column)
        times = starts[None, :] + np.arange(length, dtype=np.int64)[:, None]
        valid = times < rollout_length
        return cls(np.minimum(times, rollout_length - 1), columns, valid)

    @property
    def length(self) -> int:
        """Rows per sequence ``L``."""
        return int(self.times.shape[0])

    @property
    def count(self) -> int:
        """Sequences ``C``."""
        return int(self.columns.size)

    def select(self, sequences: np.ndarray) -> SequenceLayout:
        """The layout of some of the sequences (``(C',)`` indices or a ``(C,)`` bool mask)."""
        return SequenceLayout(
            self.times[:, sequences], self.columns[sequences], self.valid[:, sequences]
        )

    def gather(self, array: np.ndarray) -> np.ndarray:
        """``(L, C, *shape)``: the rows of a ``(T, N, *shape)`` array (a copy)."""
        return array[self.times, self.columns]

    def initial_states(self, policy_state: np.ndarray) -> np.ndarray:
        """``(C, S)``: the state stored with each sequence's first row, from ``(T, N, S)``."""
        return policy_state[self.times[0], self.columns]

    def resets(self, dones: np.ndarray) -> np.ndarray:
        """``(L, C)`` bool: zero the state before this row, because the row before it in the same
        sequence ended its episode (``dones[t - 1]``); False at a sequence's first row and on padding."""
        resets = np.zeros(self.times.shape, dtype=bool)
        resets[1:] = dones[self.times[:-1], self.columns] & self.valid[1:]
        return resets

    def scatter(self, values: np.ndarray, out: np.ndarray) -> None:
        """Write ``(L, C, *shape)`` per-row ``values`` into ``out`` ``(T, N, *shape)`` at their rows
        (padding left out)."""
        columns = np.broadcast_to(self.columns, self.times.shape)
        out[self.times[self.valid], columns[self.valid]] = values[self.valid]


class SequenceMinibatch(NamedTuple):
    """One PPO minibatch of ``C'`` sequences of ``L`` rows, on the update's device.

    The model reads the first four (every row, time-major); the loss reads the rest, which hold the
    ``M'`` trainable rows only, in the order of ``trained_rows``.

    Attributes:
        observations: ``(L * C', *obs_shape)`` time-major rows in the stored dtype, or for dict
            observations a dict key -> tensor.
        state: ``(C', S)`` float32, the state before each sequence's first row.
        resets: ``(L, C')`` bool, zero the state before that row.
        trained_rows: ``(M',)`` int64, the positions among the ``L * C'`` rows of the trainable ones
            (neither marked untrainable nor padding): index the model's per-row outputs with it.
        actions: ``(M', *action_shape)``. log_probs, values, advantages, returns: ``(M',)`` float32.
        fields: every minibatch field of the schema but the observations, by name, for the trainable
            rows (``action_mask``, ``policy_versions``, ``action_mean``, ``proximal_log_probs``, ...).
    """

    observations: Any
    state: torch.Tensor
    resets: torch.Tensor
    trained_rows: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    fields: dict[str, torch.Tensor]


@dataclass
class SequenceBatch:
    """The sequences of a rollout that hold at least one trainable row, on a device (see the module
    docstring). Built once per update (:meth:`gather`, through ``RolloutBuffer.sequence_batch``);
    epochs then only shuffle and index chunks.

    Attributes:
        schema: the buffer's schema.
        layout: where the ``C`` sequences lie in the rollout (CPU).
        fields: every minibatch field, ``(L, C, *shape)`` tensors.
        state: ``(C, S)`` float32, each sequence's stored initial state.
        resets: ``(L, C)`` bool.
        trainable: ``(L, C)`` bool numpy, the rows the loss reads (trainable and not padding).
    """

    schema: StepSchema
    layout: SequenceLayout
    fields: dict[str, torch.Tensor]
    state: torch.Tensor
    resets: torch.Tensor
    trainable: np.ndarray

    @classmethod
    def gather(
        cls,
        schema: StepSchema,
        arrays: Mapping[str, np.ndarray],
        trainable: np.ndarray,
        sequence_length: int | None,
        device: torch.device,
    ) -> SequenceBatch:
        """Cut the rollout into sequences (:meth:`SequenceLayout.of`), keep those with a trainable
        row, gather every minibatch field, the initial states and the resets on the CPU and upload
        each once.

        Args:
            schema: the step schema of ``arrays``; it must have the ``policy_state`` field.
            arrays: field name -> ``(T, N, *shape)`` array, for every minibatch field, ``dones`` and
                ``policy_state``.
            trainable: ``(T, N)`` bool, the rows to train on (a private copy).
            sequence_length: rows per sequence; None: whole columns.
            device: torch device for the tensors.

        Returns:
            The batch; ``size`` 0 and no sequence when no row is trainable.

        Raises:
            ValueError: the schema has no ``policy_state`` (a feed-forward policy's rollout), or a bad
                ``sequence_length``.
        """
        import torch

        if POLICY_STATE not in schema:
            raise ValueError(
                "sequence_batch: this rollout has no policy_state field (a feed-forward policy's "
                "schema); a recurrent policy's rollout stores the state before every row"
            )
        full = SequenceLayout.of(*trainable.shape, sequence_length)
        rows = full.gather(trainable) & full.valid
        kept = rows.any(axis=0)
        layout, rows = full.select(kept), rows[:, kept]
        tensors = {
            item.name: torch.from_numpy(layout.gather(arrays[item.name])).to(device)
            for item in schema.minibatch
        }
        state = torch.from_numpy(layout.initial_states(arrays[POLICY_STATE])).to(device)
        resets = torch.from_numpy(layout.resets(arrays["dones"])).to(device)
        return cls(schema, layout, tensors, state, resets, rows)

    @property
    def size(self) -> int:
        """Trainable rows ``M`` (the loss's rows)."""
        return int(np.count_nonzero(self.trainable))

    @property
    def sequences(self) -> int:
        """Sequences ``C``."""
        return self.layout.count

    @property
    def length(self) -> int:
        """Rows per sequence ``L``."""
        return self.layout.length

    def with_fields(self, arrays: Mapping[str, np.ndarray]) -> SequenceBatch:
        """A batch with more per-row fields: each ``(T, N, *shape)`` array gathered at the
        sequences' rows and uploaded (the decoupled objective's proximal figures). This batch is
        left as it is."""
        import torch

        device = self.state.device
        extra = {
            name: torch.from_numpy(np.ascontiguousarray(self.layout.gather(array))).to(device)
            for name, array in arrays.items()
        }
        return replace(self, fields={**self.fields, **extra})

    def trainable_rows(self, name: str) -> torch.Tensor:
        """``(M, *shape)``: field ``name`` at the trainable rows, in time-major order."""
        import torch

        tensor = self.fields[name]
        positions = np.flatnonzero(self.trainable.reshape(-1))
        flat = tensor.reshape(-1, *tensor.shape[2:])
        return flat.index_select(0, torch.from_numpy(positions).to(tensor.device))

    def minibatches(
        self, num_minibatches: int, generator: np.random.Generator
    ) -> list[SequenceMinibatch]:
        """Shuffle the sequences and split them into ``min(num_minibatches, sequences)``
        minibatches (counts differ by at most one; every sequence appears once).

        Raises:
            ValueError: ``num_minibatches`` not a positive int, or no sequence.
        """
        if (
            isinstance(num_minibatches, bool)
            or not isinstance(num_minibatches, (int, np.integer))
            or num_minibatches <= 0
        ):
            raise ValueError(
                f"num_minibatches: expected a positive int, received {num_minibatches!r}"
            )
        if self.sequences == 0:
            raise ValueError("minibatches: no sequence holds a trainable row")
        order = generator.permutation(self.sequences)
        return [
            self._minibatch(chunk)
            for chunk in np.array_split(order, min(int(num_minibatches), self.sequences))
        ]

    def whole(self) -> SequenceMinibatch:
        """Every sequence as one minibatch, in stored order (column by column, each in time order)."""
        return self._minibatch(None)

    def _minibatch(self, sequences: np.ndarray | None) -> SequenceMinibatch:
        import torch

        device = self.state.device
        if sequences is None:
            picked, state, resets, trainable = self.fields, self.state, self.resets, self.trainable
        else:
            index = torch.from_numpy(sequences).to(device)
            picked = {name: tensor.index_select(1, index) for name, tensor in self.fields.items()}
            state, resets = self.state.index_select(0, index), self.resets.index_select(1, index)
            trainable = self.trainable[:, sequences]
        rows = torch.from_numpy(np.flatnonzero(trainable.reshape(-1))).to(device)
        flat = {name: tensor.reshape(-1, *tensor.shape[2:]) for name, tensor in picked.items()}
        observation_names = set(self.schema.observation_names)
        per_row = {
            name: tensor.index_select(0, rows)
            for name, tensor in flat.items()
            if name not in observation_names
        }
        return SequenceMinibatch(
            observations=self.schema.join_observations(flat),
            state=state,
            resets=resets,
            trained_rows=rows,
            actions=per_row["actions"],
            log_probs=per_row["log_probs"],
            values=per_row["values"],
            advantages=per_row["advantages"],
            returns=per_row["returns"],
            fields=per_row,
        )
