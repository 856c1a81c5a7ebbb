"""The synchronous mode's rollout *round*: which actors fill the filling rollout, and where.

A round's *members* are the actors joined when it opens (at the start, and when the trained buffer
is released), each with its own block of columns, members in actor-index order from column 0 (the
learner gives the indices in actor-id order, so a fixed set of actors fills the same columns every
round and a seed reproduces). The round is *open* while no member has claimed a column: an actor
that joins then is a member; one that joins later waits for the next round (the learner holds its
join). The round is full when every member's columns are complete; a member that leaves or is
dropped takes its unfinished segment with it, so the round is full with the others' rows (the
columns nobody filled are sealed when the buffer is taken for training:
:meth:`~oakemu_core.storage.buffer_ring.BufferRing.take_full_rollout`). A round whose members all
left with nothing finished opens again.

The synchronous mode has one rollout buffer, slot 0 of the :class:`BufferRing`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from oakemu_core.storage.buffer_ring import COMPLETE, FREE, BufferRing, SlotState

if TYPE_CHECKING:
    from oakemu_core.storage.actors import ActorRecord

__all__ = ["RolloutRound"]


class RolloutRound:
    """The members of the synchronous mode's filling rollout (see the module docstring).

    Args:
        ring: the learner's buffer ring (one buffer).
    """

    def __init__(self, ring: BufferRing) -> None:
        self.ring = ring
        self.members: dict[str, np.ndarray] = {}
        """Actor id -> its ``(k,)`` int64 columns in the filling rollout."""

    @property
    def is_open(self) -> bool:
        """True while the filling rollout has no segment yet (an actor joining now is a member)."""
        return self.ring.states[0] is SlotState.FILLING and bool(
            np.all(self.ring.owners(0) == FREE)
        )

    def open(self, actors: Iterable[ActorRecord]) -> None:
        """Make the joined ``actors`` the members, in index order, columns from 0 on."""
        self.members = {}
        start = 0
        for record in sorted(actors, key=lambda r: r.index):
            self.members[record.actor_id] = np.arange(
                start, start + record.spec.num_envs, dtype=np.int64
            )
            start += record.spec.num_envs

    @property
    def columns(self) -> int:
        """Columns the members fill."""
        return sum(len(columns) for columns in self.members.values())

    def remove(self, actor_id: str) -> None:
        """An actor that left or was dropped is no member any more (its segment is the caller's to discard)."""
        self.members.pop(actor_id, None)

    def close(self, actors: Iterable[ActorRecord]) -> bool:
        """Mark the filling rollout full when it has a complete column and every member's columns
        are complete (True); open it again to the joined ``actors`` when no segment is left."""
        owners = self.ring.owners(0)
        if self.ring.states[0] is not SlotState.FILLING:
            return False
        if np.any(owners == COMPLETE) and all(
            np.all(owners[c] == COMPLETE) for c in self.members.values()
        ):
            self.ring.mark_full(0)
            return True
        if self.is_open:
            self.open(actors)
        return False
