"""Learner-side rollout assembly: actor registry, column assignment, double buffering, policy lag.

The learner owns ``len(buffers)`` rollout buffers (two by default) of shape ``(T, N)``, kept by a
:class:`~oakemu_core.storage.buffer_ring.BufferRing` (filling, full, training; column owners).
Actors step their envs in lockstep and send one step message per vector step; each actor gets a
*segment*: up to ``num_envs`` free columns of the oldest
filling buffer, written row by row for ``T`` messages. A segment that does not finish (the actor
crashed, went silent, or sent out of order) is discarded: its columns are emptied and handed to the
next actor that asks. Steps that find no free column are held, not dropped: the actor's messages
queue in its record, consecutive in ``seq``, and are written as a new segment as soon as columns
free (a buffer is released after training, or another actor's segment is discarded). The queue holds
at most one segment (``T`` rows) per actor plus :data:`HELD_SLACK_MESSAGES` messages (the steps an
actor that stopped at its allowance may still have in the sockets); beyond that its OLDEST messages
are dropped and counted as ``no_capacity_steps`` (the newest rows stay consecutive). A segment never
starts with a step that would reach training older than ``max_policy_lag`` (a held step, or one that
waited in the sockets while both buffers were busy): it is dropped as ``stale_steps`` and the next
step starts the segment, so no stale row is written. The other ``no_capacity_steps``: an actor given
fewer free columns than it has envs (the buffer's columns are not a multiple of ``envs_per_actor``)
loses the rows of its extra envs. Back-pressure in the learner loop (it stops reading while no
buffer is filling) makes actors wait in ``send``.

In the synchronous mode (``sync=True``, one buffer) the columns are not handed out first come,
first served: a rollout is a :class:`~oakemu_core.storage.rounds.RolloutRound` whose members (the
actors joined when it opens) each fill their own block of columns; steps of an actor that is not a
member are not written (``not_member_steps``).

Episodes are counted once, here (:class:`~oakemu_core.storage.episodes.EpisodeBook`): the episodes a
step message reports are taken when the message is ingested (asynchronous mode), or when its rollout
is full, in (actor index, seq) order (synchronous mode); :meth:`RolloutAssembler.take_episodes`
hands them out.

Everything here is plain Python + numpy and runs in the learner's ingest thread; no sockets.
"""

from __future__ import annotations

import numpy as np

from oakemu_core.storage.actors import ActorRecord, ActorRegistry, IngestCounters
from oakemu_core.storage.buffer_ring import FREE, BufferRing, FullRollout, Segment, SlotState
from oakemu_core.storage.episodes import EpisodeBook, FinishedEpisode
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.storage.rounds import RolloutRound
from oakemu_core.storage.segments import SegmentWriter
from oakemu_core.transport.published import PublishedWeights
from oakemu_core.transport.steps import StepMessage, StepSpec

__all__ = [
    "HELD_SLACK_MESSAGES",
    "FullRollout",
    "RolloutAssembler",
    "SlotState",
    "StepRejected",
]

HELD_SLACK_MESSAGES = 16
"""Messages an actor's held queue takes beyond one segment. An asynchronous actor acts at most two
segments per policy version (``oakemu_services.actor.AHEAD_SEGMENTS``), but the messages still in the
sockets when a version arrives were acted by the one before (a few messages: the actor's send
high-water mark, kernel buffers sized to a few messages, the learner's receive queue)."""


class StepRejected(Exception):
    """A well-formed step message that the learner refuses (``reason`` is a short counter key)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RolloutAssembler:
    """Routes validated step messages from many actors into the columns of the learner's buffers.

    Args:
        buffers: the rollout buffers, all with the same ``(T, N)`` shape and observation/action
            spec; two give double buffering (one fills while the other trains).
        actor_timeout_s: an actor not heard from (step or heartbeat) for this many seconds is
            dropped and its unfinished segment discarded.
        sync: synchronous mode (see the module docstring): a rollout's members are the actors
            joined when it opens, each owns a block of columns, in index order; episodes are
            released in (index, seq) order when a rollout is full.
        max_policy_lag: when set, a step that would be more than this many versions old when its
            buffer trains does not start a segment: it is dropped and counted as ``stale_steps``
            (rows of a started segment are never older: an actor's versions only grow, and a
            buffer's training version is fixed once it has a segment, see :meth:`trains_at`).
        planned_columns: the columns a rollout holds with the run's planned actors (synchronous
            mode, where the buffer may hold more: :attr:`FullRollout.planned_columns`); 0: ``N``.
        registry: the joined actors (:class:`~oakemu_core.storage.actors.ActorRegistry`, shared
            with the control server); None: a registry of its own.
        published: the weights published to the actors, whose version the step messages are
            checked and aged against (shared with the control server); None: its own, version 0,
            raised by the ``current_policy_version`` of :meth:`ingest` and :meth:`release`.

    Raises:
        ValueError: if ``buffers`` is empty or the buffers disagree in shape.
    """

    def __init__(
        self,
        buffers: list[RolloutBuffer],
        *,
        actor_timeout_s: float,
        sync: bool = False,
        max_policy_lag: int | None = None,
        planned_columns: int = 0,
        registry: ActorRegistry | None = None,
        published: PublishedWeights | None = None,
    ) -> None:
        self._ring = BufferRing(buffers, planned_columns)
        self.buffers = self._ring.buffers
        self.rollout_length = self._ring.rollout_length
        self.num_columns = self._ring.num_columns
        self.actor_timeout_s = actor_timeout_s
        self.registry = registry if registry is not None else ActorRegistry()
        self.registry.on_forget(self._release_actor)
        self.segments = SegmentWriter(self._ring, self.counters, full_when_all=not sync)
        self.published = published if published is not None else PublishedWeights()
        self.episodes = EpisodeBook()
        self.sync = bool(sync)
        self.max_policy_lag = max_policy_lag
        self.round = RolloutRound(self._ring)
        """Synchronous mode: the filling rollout's members."""

    @property
    def actors(self) -> dict[str, ActorRecord]:
        """The joined actors by id (:attr:`ActorRegistry.actors`, read-only here)."""
        return self.registry.actors

    @property
    def counters(self) -> IngestCounters:
        """The learner's ingest counters (:attr:`ActorRegistry.counters`)."""
        return self.registry.counters

    @property
    def states(self) -> list[SlotState]:
        """The state of each buffer, by slot (:attr:`BufferRing.states`)."""
        return self._ring.states

    # ----------------------------------------------------------------------------------- actors
    def join(
        self,
        actor_id: str,
        incarnation: str,
        spec: StepSpec,
        *,
        hostname: str,
        now: float,
        index: int | None = None,
    ) -> ActorRecord:
        """Register an actor incarnation; a new incarnation of a known id replaces the old one.

        Args:
            index: the actor's index, chosen by the caller (synchronous mode: the actor's rank in
                actor-id order, which places its columns); None: the next unused number.

        Returns:
            The new record; ``index`` is unique among joined actors (actors seed their envs with it).

        Raises:
            ValueError: the spec's schema is not the buffers' (a learner bug: messages are written
                as checked against the spec), ``index`` is held by another joined actor,
                (synchronous mode) the joined actors' envs would not fit in the buffer
                (:meth:`has_room_for`), or the spec's ``steps_per_message`` does not divide the
                rollout length.
        """
        if (
            spec.schema != self.buffers[0].schema
        ):  # decode_step checks messages against spec.schema only
            raise ValueError("the actor's step schema differs from the rollout buffers' schema")
        if self.rollout_length % spec.steps_per_message:
            raise ValueError(
                f"steps_per_message: expected a divisor of rollout_length {self.rollout_length} (a step "
                f"message never crosses a segment boundary), received {spec.steps_per_message}"
            )
        previous = self.actors.get(actor_id)
        # A repeated join of the same incarnation (its reply was lost) keeps its place in the round.
        kept = (
            self.round.members.get(actor_id)
            if previous is not None and previous.incarnation == incarnation
            else None
        )
        if previous is not None:
            self.registry.forget(previous)
        if self.sync and not self.has_room_for(spec.num_envs):
            raise ValueError(
                f"sync mode: {spec.num_envs} more envs do not fit in the buffer's "
                f"{self.num_columns} columns beside the joined actors'"
            )
        record = self.registry.register(
            actor_id, incarnation, spec, hostname=hostname, now=now, index=index
        )
        if self.sync and self.round.is_open:
            self.round.open(self.actors.values())
        elif kept is not None and np.all(self._ring.owners(0)[kept] == FREE):
            self.round.members[actor_id] = kept
        return record

    def has_room_for(self, num_envs: int) -> bool:
        """True when an actor of ``num_envs`` envs fits in the buffer beside the joined actors."""
        return sum(r.spec.num_envs for r in self.actors.values()) + num_envs <= self.num_columns

    def _close_round_if_done(self) -> None:
        """Synchronous mode: episodes are released when the rollout is full (:meth:`RolloutRound.close`)."""
        if self.round.close(self.actors.values()):
            self.episodes.release_round()

    def spec_for(self, actor_id: str, incarnation: str) -> StepSpec | None:
        """:meth:`ActorRegistry.spec_for`."""
        return self.registry.spec_for(actor_id, incarnation)

    def count_late(self, actor_id: str, incarnation: str) -> bool:
        """:meth:`ActorRegistry.count_late`."""
        return self.registry.count_late(actor_id, incarnation)

    def heartbeat(self, actor_id: str, incarnation: str, **figures: float) -> bool:
        """:meth:`ActorRegistry.heartbeat`."""
        return self.registry.heartbeat(actor_id, incarnation, **figures)

    def leave(self, actor_id: str, incarnation: str) -> bool:
        """Forget an actor that says goodbye or whose process ended (:meth:`ActorRegistry.forget`:
        its unfinished segment is discarded, its step ring departs); False when unknown."""
        record = self.registry.get(actor_id, incarnation)
        if record is None:
            return False
        self.registry.forget(record)
        self._drain_all()
        return True

    def expire_silent_actors(self, now: float) -> list[str]:
        """Forget actors silent for longer than ``actor_timeout_s`` (their step rings are freed at
        once: nothing of theirs is in flight); returns their ids."""
        expired = self.registry.silent(now, self.actor_timeout_s)
        for record in expired:
            self.registry.forget(record, free_ring=True)
            self.counters.dropped["timed_out_actors"] += 1
        if expired:
            self._drain_all()
        return [record.actor_id for record in expired]

    # ------------------------------------------------------------------------------------ steps
    def ingest(
        self, message: StepMessage, *, now: float, current_policy_version: int | None = None
    ) -> None:
        """Write one validated step message into its actor's segment.

        The message arrays and their values were already checked against the actor's spec by
        :func:`oakemu_core.transport.steps.decode_step` (a message rejected there leaves a hole in the
        actor's ``seq``, so its next message discards the unfinished segment as out of order); they
        are written without a second check (:meth:`RolloutBuffer.write` with ``validated=True``: the
        spec's schema is the buffers', checked at :meth:`join`).

        Raises:
            StepRejected: unknown actor incarnation (``unknown_actor``), a sequence number below
                the next expected one (``out_of_order``: a duplicate or replay), a policy version
                the learner has not published (``future_version``). Nothing is written in these
                cases. A sequence number ABOVE the next expected one (steps went missing) discards
                the unfinished segment (its rows would no longer be consecutive), counts the
                missing steps as ``dropped["seq_gap_steps"]``, and writes this step as the first
                row of a new segment.
        """
        if current_policy_version is None:
            current_policy_version = self.published.version
        else:  # a caller without a shared PublishedWeights tells the version
            self.published.advance(current_policy_version)
        record = self.registry.get(message.actor_id, message.incarnation)
        if record is None:
            if self.registry.departed.count_late(
                message.incarnation
            ):  # in flight when the actor left: expected
                raise StepRejected(
                    "departed_actor", f"actor {message.actor_id!r}/{message.incarnation} has left"
                )
            raise StepRejected(
                "unknown_actor", f"actor {message.actor_id!r}/{message.incarnation} has not joined"
            )
        if message.seq < record.next_seq:  # a replay or a duplicate: never written twice
            raise StepRejected(
                "out_of_order",
                f"actor {message.actor_id!r}: expected seq {record.next_seq}, got {message.seq}",
            )
        if message.seq > record.next_seq:
            # Steps went missing (rejected at the wire, or lost): the unfinished segment can no
            # longer hold consecutive rows, so it is discarded; this valid step starts a new one.
            self.counters.dropped["seq_gap_steps"] += message.seq - record.next_seq
            self.segments.discard(record)
            if record.pending:  # held rows are not consecutive with this step any more
                self.counters.dropped["discarded_segment_rows"] += record.clear_pending()
            self._drain_all()
            record.next_seq = message.seq
        if message.policy_version > current_policy_version:
            raise StepRejected(
                "future_version",
                f"actor {message.actor_id!r}: policy_version {message.policy_version} "
                f"> published {current_policy_version}",
            )
        record.next_seq += 1
        record.last_heard = now
        record.lag_window.add(current_policy_version - message.policy_version)
        if record.segment is None and not record.pending:
            record.segment = self._claim(record)
        if self.sync and record.segment is None:  # not a member, or its columns are done: not held
            self.counters.dropped["not_member_steps"] += message.num_envs * message.num_steps
            return
        if self.sync:  # released in (index, seq) order when the rollout is full
            self.episodes.hold(record.index, message)
        else:
            self.episodes.take(message)
        if record.segment is None or record.pending:  # no free column: hold it (one segment)
            self._hold(record, message)
            return
        self._write(record, message)

    def _claim(self, record: ActorRecord) -> Segment | None:
        """Free columns for the actor's next segment (synchronous mode: its own block, if it is a
        member of the filling rollout), or None."""
        if not self.sync:
            return self._ring.claim(record.index, record.spec.num_envs)
        block = self.round.members.get(record.actor_id)
        return None if block is None else self._ring.claim(record.index, len(block), block=block)

    def _hold(self, record: ActorRecord, message: StepMessage) -> None:
        """Queue a step message that found no free column; drop the oldest beyond one segment.
        A step-ring message is copied out of its slot, which the learner releases after ingest."""
        max_rows = self.rollout_length + HELD_SLACK_MESSAGES * record.spec.steps_per_message
        self.counters.dropped["no_capacity_steps"] += record.hold(message.owned(), max_rows)
        self._drain(record)

    def _drain(self, record: ActorRecord) -> None:
        """Write the actor's held messages while it gets columns."""
        while record.pending:
            if record.segment is None:
                record.segment = self._claim(record)
                if record.segment is None:
                    return
            message = record.pending.popleft()
            record.pending_rows -= message.num_steps
            try:
                self._write(record, message)
            except (
                StepRejected
            ):  # counted by _write as discarded rows; the rest starts a new segment
                pass

    def _drain_all(self) -> None:
        """Columns were freed: write held messages, the actor served least recently first (in index order
        the lowest indices would take every freed column while more envs than columns hold steps)."""
        for record in sorted(
            (r for r in self.actors.values() if r.pending), key=lambda r: r.served
        ):
            self._drain(record)

    @property
    def pending_rows(self) -> int:
        """Rows held (all actors) waiting for free columns."""
        return self.registry.pending_rows

    def _write(self, record: ActorRecord, message: StepMessage) -> None:
        """Write one message into the actor's (assigned) segment, unless it would start the segment
        with a row too old for ``max_policy_lag`` (dropped as ``stale_steps``)."""
        segment = record.segment
        assert segment is not None
        # Our invariant: segments live only in filling buffers (the trainer reads the others).
        assert self.states[segment.slot] is SlotState.FILLING, (
            segment.slot,
            self.states[segment.slot],
        )
        if segment.rows_written == 0 and self._too_old_for(segment.slot, message.policy_version):
            self._ring.unclaim(segment)  # the next step may start it
            record.segment = None
            self.counters.dropped["stale_steps"] += record.spec.num_envs * message.num_steps
            return
        try:
            full = self.segments.write(record, message)
        except (ValueError, OverflowError) as error:  # the row bookkeeping disagrees
            raise StepRejected("schema", str(error)) from None
        if full:
            self.episodes.release_round()
        if self.sync and record.segment is None:  # its segment is complete
            self._close_round_if_done()

    def _release_actor(self, record: ActorRecord) -> None:
        """A forgotten actor (:meth:`ActorRegistry.forget`, called after it left :attr:`actors`):
        discard its unfinished segment and held messages, and its place in the round."""
        self.segments.discard(record)
        if record.pending:
            self.counters.dropped["no_capacity_steps"] += record.clear_pending()
        if self.sync:
            self.round.remove(record.actor_id)
            self._close_round_if_done()

    # ------------------------------------------------------------------------------- hand-off
    @property
    def accepting(self) -> bool:
        """True while the learner should keep reading step messages: some buffer is filling, and no
        actor's held queue is full while a training will soon free a buffer.

        A full held queue would drop that actor's oldest steps at its next message (steps computed
        and thrown away). While a buffer trains, not reading makes every actor wait in ``send``
        instead (back-pressure); the release drains the held steps, and reading resumes. Without a
        training in flight the reads go on: the buffer that would free columns may be waiting for
        another actor's steps. A slower actor's rows delayed by the pause stay within
        ``max_policy_lag``: they continue a started segment, whose buffer's training version was
        fixed when it started, and a new segment is checked before it starts (:meth:`trains_at`)."""
        if not any(state is SlotState.FILLING for state in self.states):
            return False
        if SlotState.TRAINING in self.states:
            return not any(r.pending_rows >= self.rollout_length for r in self.actors.values())
        return True

    def take_full_rollout(self) -> FullRollout | None:
        """Hand the oldest buffer to training if it is full (its state becomes TRAINING), or None
        (:meth:`BufferRing.take_full_rollout`: buffers train in generation order)."""
        return self._ring.take_full_rollout()

    def release(self, slot: int, policy_version: int | None = None) -> None:
        """Return a trained buffer to filling, emptied, behind the other filling buffers; held
        steps are written into it (``policy_version``: the version its training produced, for the
        ``max_policy_lag`` check of the segments that start now, when the caller shares no
        :class:`PublishedWeights` that holds it already).

        Raises:
            ValueError: the buffer is not training.
        """
        self._ring.release(slot)
        if policy_version is not None:
            self.published.advance(policy_version)
        if self.sync:
            self.round.open(self.actors.values())
        self._drain_all()

    def trains_at(self, slot: int) -> int:
        """The policy version the buffer ``slot`` will be trained with (at the earliest): the newest
        version published plus one per buffer that trains before it (buffers train in generation
        order, each training adds one version)."""
        return self.published.version + self._ring.trains_ahead_of(slot)

    def _too_old_for(self, slot: int, policy_version: int) -> bool:
        """True when a row acted by ``policy_version`` would train in ``slot`` older than ``max_policy_lag``."""
        if (
            self.max_policy_lag is None or self.sync
        ):  # sync: every row is acted by the current version
            return False
        return self.trains_at(slot) - policy_version > self.max_policy_lag

    def buffer_fill(self) -> float:
        """Fraction of rows written in the oldest filling buffer (0..1; synchronous mode: of its
        members' rows), 1.0 when none is filling."""
        return self._ring.buffer_fill(self.round.columns if self.sync else None)

    def take_episodes(self) -> list[FinishedEpisode]:
        """The episodes finished since the last call, in the order they were taken (module docstring)."""
        return self.episodes.hand_out()
