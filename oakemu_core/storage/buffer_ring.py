"""The learner's ring of rollout buffers: which one fills or trains, and who owns each column.

The learner owns ``len(buffers)`` rollout buffers (two by default) of shape ``(T, N)``. A buffer is
*filling* while actors stream steps into it, *full* when every column holds ``T`` rows, and
*training* while the PPO update reads it; a trained buffer is released, emptied, behind the other
filling buffers. Buffers fill and train in *generation* order (a lower generation first), so
rollouts complete one at a time. A column is free, part of one actor's unfinished
:class:`Segment`, or complete; a complete column keeps the bootstrap data of its last row for GAE.

:class:`~oakemu_core.storage.assembler.RolloutAssembler` decides which actor gets columns and
which rows go in; this module keeps the books of buffers and columns. Plain Python + numpy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.storage.row_checks import column_index

__all__ = ["COMPLETE", "FREE", "BufferRing", "FullRollout", "Segment", "SlotState"]

FREE = -1
"""Column owner marker: the column holds no rows and belongs to no segment."""
COMPLETE = -2
"""Column owner marker: the column holds a finished segment of ``T`` rows."""


class SlotState(enum.Enum):
    """Life cycle of one rollout buffer: filling -> full -> training -> filling."""

    FILLING = "filling"
    FULL = "full"
    TRAINING = "training"


@dataclass
class Segment:
    """Columns of one buffer that one actor is filling, and how many rows it has written."""

    slot: int
    columns: np.ndarray  # (k,) int64 buffer columns; the actor's env i writes column columns[i]
    rows_written: int = 0
    index: slice | np.ndarray = field(init=False)
    """How the buffer indexes ``columns`` (:func:`~oakemu_core.storage.row_checks.column_index`)."""

    def __post_init__(self) -> None:
        self.index = column_index(self.columns)


@dataclass
class FullRollout:
    """A full buffer handed to training, with its bootstrap data for GAE."""

    slot: int
    buffer: RolloutBuffer
    last_values: np.ndarray  # (N,) float32: V(s_T) of each column's last step
    last_dones: np.ndarray  # (N,) bool: dones of each column's last row (== buffer.dones[-1])
    columns_used: np.ndarray | None = None
    """``(N,)`` bool: the columns that hold rows (synchronous mode; the others are sealed, with no
    trainable row), or None: every column."""
    planned_columns: int = 0
    """Columns a rollout holds when the run's planned actors fill it (the minibatch size is the
    planned rows over ``num_minibatches``); 0: ``N``."""


class BufferRing:
    """The rollout buffers, their states, generations and column owners.

    Args:
        buffers: the rollout buffers, all with the same ``(T, N)`` shape and step schema.
        planned_columns: see :attr:`FullRollout.planned_columns`.

    Raises:
        ValueError: if ``buffers`` is empty or the buffers disagree in shape or schema.
    """

    def __init__(self, buffers: list[RolloutBuffer], planned_columns: int = 0) -> None:
        if not buffers:
            raise ValueError("RolloutAssembler needs at least one rollout buffer, got none")
        if len({(b.rollout_length, b.num_envs, b.schema) for b in buffers}) != 1:
            raise ValueError("rollout buffers must share T, N and the step schema")
        self.buffers = buffers
        self.rollout_length = buffers[0].rollout_length
        self.num_columns = buffers[0].num_envs
        self.states = [SlotState.FILLING for _ in buffers]
        self._owners = [np.full(self.num_columns, FREE, dtype=np.int64) for _ in buffers]
        self._last_values = [np.zeros(self.num_columns, np.float32) for _ in buffers]
        self._last_dones = [np.zeros(self.num_columns, bool) for _ in buffers]
        self._generation = list(range(len(buffers)))
        self._next_generation = len(buffers)
        self.planned_columns = int(planned_columns)

    def _filling(self) -> list[int]:
        """The filling buffers' slots, oldest generation first."""
        filling = [s for s, state in enumerate(self.states) if state is SlotState.FILLING]
        return sorted(filling, key=lambda s: self._generation[s])

    def owners(self, slot: int) -> np.ndarray:
        """``(N,)`` int64 owner of each column of buffer ``slot``: an actor index, :data:`FREE` or
        :data:`COMPLETE` (read-only)."""
        view = self._owners[slot].view()
        view.flags.writeable = False
        return view

    def claim(
        self, owner: int, num_envs: int, *, block: np.ndarray | None = None
    ) -> Segment | None:
        """Give ``owner`` (an actor index) up to ``num_envs`` free columns of the oldest filling
        buffer that has any, or None. ``block`` (synchronous mode): exactly these ``(k,)`` int64
        columns, in the oldest buffer where they are free."""
        if block is not None:
            for slot in self._filling():
                if np.all(self._owners[slot][block] == FREE):
                    self._owners[slot][block] = owner
                    return Segment(slot=slot, columns=block)
            return None
        for slot in self._filling():
            free = np.flatnonzero(self._owners[slot] == FREE)
            if free.size:
                columns = free[:num_envs].astype(np.int64)
                self._owners[slot][columns] = owner
                return Segment(slot=slot, columns=columns)
        return None

    def unclaim(self, segment: Segment) -> None:
        """Free the columns of a segment that wrote no row."""
        self._owners[segment.slot][segment.columns] = FREE

    def discard(self, segment: Segment) -> None:
        """Empty the columns of an unfinished segment (:meth:`RolloutBuffer.reset_columns`) and free them."""
        assert self.states[segment.slot] is SlotState.FILLING, (
            segment.slot,
            self.states[segment.slot],
        )
        self.buffers[segment.slot].reset_columns(segment.columns)
        self._owners[segment.slot][segment.columns] = FREE

    def complete(
        self,
        segment: Segment,
        last_values: np.ndarray,
        last_dones: np.ndarray,
        *,
        full_when_all: bool = True,
    ) -> bool:
        """Mark a segment's columns complete with the ``(k,)`` bootstrap data of their last row
        (V(s_T), dones); returns True when this made its buffer full (every column complete;
        ``full_when_all=False``: never, the caller decides with :meth:`mark_full`)."""
        self._last_values[segment.slot][segment.columns] = last_values
        self._last_dones[segment.slot][segment.columns] = last_dones
        self._owners[segment.slot][segment.columns] = COMPLETE
        if full_when_all and np.all(self._owners[segment.slot] == COMPLETE):
            self.states[segment.slot] = SlotState.FULL
            return True
        return False

    def mark_full(self, slot: int) -> None:
        """A filling buffer is full with the columns it has complete (the others are sealed when
        it is taken for training, :meth:`take_full_rollout`)."""
        assert self.states[slot] is SlotState.FILLING, (slot, self.states[slot])
        self.states[slot] = SlotState.FULL

    def take_full_rollout(self) -> FullRollout | None:
        """Hand the oldest buffer to training if it is full (its state becomes TRAINING), or None.

        Buffers train in generation order: a newer full buffer waits while an older one is still
        filling. Otherwise an actor that stalls in the middle of its segment (descheduled, slow
        network) would pin that buffer while the other buffer filled and trained again and again
        with the other actors' steps, and the pinned rows would reach training many policy
        versions old (far beyond ``max_policy_lag``). In order, the policy version advances by one
        per rollout, so a row's lag stays bounded by the buffers in the ring plus the steps in flight.
        """
        waiting = [s for s, state in enumerate(self.states) if state is not SlotState.TRAINING]
        if not waiting:
            return None
        slot = min(waiting, key=lambda s: self._generation[s])
        if self.states[slot] is not SlotState.FULL:
            return None
        self.states[slot] = SlotState.TRAINING
        columns_used = None
        unused = np.flatnonzero(self._owners[slot] != COMPLETE)
        if unused.size:  # columns no actor filled (synchronous mode) hold no trainable row
            self.buffers[slot].seal_columns(unused)
            self._last_values[slot][unused] = 0.0
            self._last_dones[slot][unused] = False
            columns_used = self._owners[slot] == COMPLETE
        return FullRollout(
            slot=slot,
            buffer=self.buffers[slot],
            last_values=self._last_values[slot].copy(),
            last_dones=self._last_dones[slot].copy(),
            columns_used=columns_used,
            planned_columns=self.planned_columns,
        )

    def release(self, slot: int) -> None:
        """Return a trained buffer to filling, emptied, behind the other filling buffers.

        Raises:
            ValueError: the buffer is not training.
        """
        if self.states[slot] is not SlotState.TRAINING:
            raise ValueError(f"buffer {slot} is {self.states[slot].value}, expected training")
        self.buffers[slot].reset()
        self._owners[slot][:] = FREE
        self._generation[slot] = self._next_generation
        self._next_generation += 1
        self.states[slot] = SlotState.FILLING

    def trains_ahead_of(self, slot: int) -> int:
        """How many buffers train before ``slot`` (training now, or of an older generation)."""
        return sum(
            1
            for other, state in enumerate(self.states)
            if other != slot
            and (state is SlotState.TRAINING or self._generation[other] < self._generation[slot])
        )

    def buffer_fill(self, columns: int | None = None) -> float:
        """Fraction of rows written in the oldest filling buffer (0..1) out of ``columns`` columns
        (None: all of them), 1.0 when none is filling."""
        filling = self._filling()
        if not filling:
            return 1.0
        rows = self.rollout_length * max(1, self.num_columns if columns is None else columns)
        return float(self.buffers[filling[0]].column_steps.sum()) / rows
