"""Learner-side rollout assembly: actor registry, column assignment, double buffering, policy lag.

The learner owns ``len(buffers)`` rollout buffers (two by default) of shape ``(T, N)``. A buffer is
*filling* while actors stream steps into it, *full* when every column holds ``T`` rows, and
*training* while the PPO update reads it. Actors step their envs in lockstep and send one step
message per vector step; each actor gets a *segment*: up to ``num_envs`` free columns of the oldest
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

In the synchronous mode (``sync=True``, one buffer) a rollout is a *round*: its *members* are the
actors joined when it opens (at the start, and when the trained buffer is released), each filling its
own block of columns, members in index order from column 0 (the learner gives the indices in actor-id
order, so a fixed set of actors fills the same columns every round and a seed reproduces). An actor
that joins while the round is under way (a row is written) is not a member: the learner holds its
join until the next round opens (:attr:`RolloutAssembler.round_open`). The round is full when every
member's columns hold ``T`` rows; a member that leaves or is dropped takes its unfinished segment
with it (discarded, never trained), so the round is full with the other members' rows. Columns no
member filled are *sealed* (counted as full, no trainable row) and the rollout says which columns
hold rows (:attr:`FullRollout.columns_used`). A round whose members all left with nothing finished
opens again. The episodes a rollout's messages report enter :attr:`RolloutAssembler.episode_returns`
sorted by (actor index, seq) when the rollout is full, so a seed's run does not depend on the order
in which messages arrived.

Everything here is plain Python + numpy and runs in the learner's ingest thread; no sockets.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from oakemu_core.storage.rollout_buffer import RolloutBuffer, column_index
from oakemu_core.transport.steps import StepMessage, StepSpec

HELD_SLACK_MESSAGES = 16
"""Messages an actor's held queue takes beyond one segment. An asynchronous actor acts at most two
segments per policy version (``oakemu_services.actor.AHEAD_SEGMENTS``), but the messages still in the
sockets when a version arrives were acted by the one before (a few messages: the actor's send
high-water mark, kernel buffers sized to a few messages, the learner's receive queue)."""

FREE = -1
"""Column owner marker: the column holds no rows and belongs to no segment."""
COMPLETE = -2
"""Column owner marker: the column holds a finished segment of ``T`` rows."""


class SlotState(enum.Enum):
    """Life cycle of one rollout buffer: filling -> full -> training -> filling."""

    FILLING = "filling"
    FULL = "full"
    TRAINING = "training"


class StepRejected(Exception):
    """A well-formed step message that the learner refuses (``reason`` is a short counter key)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Segment:
    """Columns of one buffer that one actor is filling, and how many rows it has written."""

    slot: int
    columns: np.ndarray  # (k,) int64 buffer columns; the actor's env i writes column columns[i]
    rows_written: int = 0
    index: slice | np.ndarray = field(init=False)
    """How the buffer indexes ``columns`` (:func:`~oakemu_core.storage.rollout_buffer.column_index`)."""

    def __post_init__(self) -> None:
        self.index = column_index(self.columns)


@dataclass
class LagWindow:
    """Arrival lag of one actor's step messages (learner version - acting version, in versions),
    counted since the window was opened."""

    count: int = 0
    total: int = 0
    low: int = 0
    high: int = 0

    def add(self, lag: int) -> None:
        """Count one message's lag."""
        self.low = lag if self.count == 0 else min(self.low, lag)
        self.high = lag if self.count == 0 else max(self.high, lag)
        self.count += 1
        self.total += lag


@dataclass
class ActorRecord:
    """What the learner knows of one joined actor incarnation."""

    actor_id: str
    incarnation: str
    index: int
    spec: StepSpec
    hostname: str
    joined_at: float
    last_heard: float
    next_seq: int = 0
    segment: Segment | None = None
    env_steps_per_second: float = 0.0
    policy_lag: float = 0.0
    lag_window: LagWindow = field(default_factory=LagWindow)
    """Arrival lag of its step messages since :meth:`RolloutAssembler.take_lag`."""
    lag_stats: tuple[float, float, float] | None = None
    """``(min, mean, max)`` arrival lag of the last non-empty window (:meth:`RolloutAssembler.take_lag`)."""
    episodes: int = 0
    env_steps: int = 0
    pending: deque = field(default_factory=deque)
    """Step messages that found no free column, oldest first, consecutive in ``seq``; written as
    soon as columns free (:meth:`RolloutAssembler.release`), at most one segment of rows."""
    pending_rows: int = 0


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


@dataclass
class IngestCounters:
    """Counters the learner logs and serves as telemetry."""

    env_steps: int = 0
    """Env steps written into a rollout buffer (the global step count; discarded rows included, so
    it never goes backwards)."""
    rejected: Counter = field(default_factory=Counter)
    """Rejected messages by reason (wire reasons plus ``out_of_order``, ``future_version``)."""
    dropped: Counter = field(default_factory=Counter)
    """Dropped data by kind: ``no_capacity_steps``, ``stale_steps`` (env steps too old for
    ``max_policy_lag`` to start a segment), ``discarded_segment_rows``, ``stale_rows``,
    ``timed_out_actors``, ``seq_gap_steps`` (step messages missing from an actor's sequence),
    ``not_member_steps`` (synchronous mode: env steps of an actor that is not filling the rollout),
    ``late_steps`` (env steps that arrived after their actor left) and
    ``late_step_messages`` (the step messages that carried them)."""
    received: Counter = field(default_factory=Counter)
    """ZeroMQ messages read by the learner, by socket (``data``, ``control``; a multipart message is one)."""
    accepted: Counter = field(default_factory=Counter)
    """Messages served, by kind (``step``, ``join``, ``heartbeat``, ``leave``, ``join_refused``,
    ``unknown_actor_control``). Every message received is accepted, rejected (by reason) or a late
    step: ``sum(received) == sum(accepted) + sum(rejected, except unauthorized_key) +
    dropped["late_step_messages"]`` (see :meth:`unaccounted_messages`)."""

    def unaccounted_messages(self) -> int:
        """Messages received but neither accepted, rejected nor counted late (0 when the books balance).
        ``rejected["unauthorized_key"]`` counts refused connections, not messages, and is left out."""
        rejected = sum(v for k, v in self.rejected.items() if k != "unauthorized_key")
        return (sum(self.received.values()) - sum(self.accepted.values()) - rejected
                - self.dropped["late_step_messages"])


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
            mode, where the buffer may hold more: see :attr:`FullRollout.planned_columns`); 0: ``N``.

    Raises:
        ValueError: if ``buffers`` is empty or the buffers disagree in shape.
    """

    def __init__(self, buffers: list[RolloutBuffer], *, actor_timeout_s: float, sync: bool = False,
                 max_policy_lag: int | None = None, planned_columns: int = 0) -> None:
        if not buffers:
            raise ValueError("RolloutAssembler needs at least one rollout buffer, got none")
        shapes = {(b.rollout_length, b.num_envs, b.schema) for b in buffers}
        if len(shapes) != 1:
            raise ValueError("rollout buffers must share T, N and the step schema")
        self.buffers = buffers
        self.rollout_length = buffers[0].rollout_length
        self.num_columns = buffers[0].num_envs
        self.actor_timeout_s = actor_timeout_s
        self.planned_columns = int(planned_columns)
        self.states = [SlotState.FILLING for _ in buffers]
        self._owners = [np.full(self.num_columns, FREE, dtype=np.int64) for _ in buffers]
        self._last_values = [np.zeros(self.num_columns, np.float32) for _ in buffers]
        self._last_dones = [np.zeros(self.num_columns, bool) for _ in buffers]
        # Filling order: a lower generation fills first, so rollouts complete one at a time.
        self._generation = list(range(len(buffers)))
        self._next_generation = len(buffers)
        self._next_actor_index = 0
        self.actors: dict[str, ActorRecord] = {}
        # Specs of incarnations that left or were dropped (bounded, oldest forgotten first): their
        # steps still in flight decode normally and are counted as late, not as malformed.
        self._departed: dict[str, StepSpec] = {}
        self.counters = IngestCounters()
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []
        self.sync = bool(sync)
        self.max_policy_lag = max_policy_lag
        self._policy_version = 0  # the newest version known here (ingest, release)
        # Synchronous mode: (actor index, seq, returns, lengths) of the filling rollout's messages.
        self._round_episodes: list[tuple[int, int, list[float], list[int]]] = []
        # Synchronous mode: the members of the filling rollout, actor id -> its columns.
        self._members: dict[str, np.ndarray] = {}

    # ----------------------------------------------------------------------------------- actors
    def join(self, actor_id: str, incarnation: str, spec: StepSpec, *, hostname: str, now: float,
             index: int | None = None) -> ActorRecord:
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
        if spec.schema != self.buffers[0].schema:  # decode_step checks messages against spec.schema only
            raise ValueError("the actor's step schema differs from the rollout buffers' schema")
        if self.rollout_length % spec.steps_per_message:
            raise ValueError(
                f"steps_per_message: expected a divisor of rollout_length {self.rollout_length} (a step "
                f"message never crosses a segment boundary), received {spec.steps_per_message}")
        previous = self.actors.get(actor_id)
        # A repeated join of the same incarnation (its reply was lost) keeps its place in the rollout.
        kept = self._members.get(actor_id) if previous is not None and previous.incarnation == incarnation else None
        if previous is not None:
            self._forget(previous)
        if index is not None:
            holders = [r.actor_id for r in self.actors.values() if r.index == index]
            if holders:
                raise ValueError(f"actor index {index} is held by actor {holders[0]!r}")
        if self.sync and not self.has_room_for(spec.num_envs):
            raise ValueError(f"sync mode: {spec.num_envs} more envs do not fit in the buffer's "
                             f"{self.num_columns} columns beside the joined actors' {self.joined_envs}")
        if index is None:
            index = self._next_actor_index
        record = ActorRecord(
            actor_id=actor_id,
            incarnation=incarnation,
            index=index,
            spec=spec,
            hostname=hostname,
            joined_at=now,
            last_heard=now,
        )
        self._next_actor_index = max(self._next_actor_index, index) + 1
        self.actors[actor_id] = record
        if self.sync and self.round_open:
            self._open_round()
        elif kept is not None and np.all(self._owners[0][kept] == FREE):
            self._members[actor_id] = kept
        return record

    @property
    def joined_envs(self) -> int:
        """Envs of every joined actor (the columns they would fill in one rollout)."""
        return sum(r.spec.num_envs for r in self.actors.values())

    def has_room_for(self, num_envs: int) -> bool:
        """True when an actor of ``num_envs`` envs fits in the buffer beside the joined actors."""
        return self.joined_envs + num_envs <= self.num_columns

    # ------------------------------------------------------------------- synchronous rounds
    @property
    def round_open(self) -> bool:
        """Synchronous mode: True while the filling rollout has no row and no segment yet, so an
        actor joining now is one of its members (else its join waits for the next rollout)."""
        return self.states[0] is SlotState.FILLING and bool(np.all(self._owners[0] == FREE))

    @property
    def members(self) -> dict[str, np.ndarray]:
        """Synchronous mode: the filling rollout's members, actor id -> its ``(k,)`` int64 columns."""
        return dict(self._members)

    def _open_round(self) -> None:
        """Make every joined actor a member of the filling rollout, in index order from column 0."""
        self._members = {}
        start = 0
        for record in sorted(self.actors.values(), key=lambda r: r.index):
            k = record.spec.num_envs
            self._members[record.actor_id] = np.arange(start, start + k, dtype=np.int64)
            start += k

    def _close_round_if_done(self) -> None:
        """Synchronous mode: the rollout is full when every member's columns hold ``T`` rows (and one
        column does); with no member left and nothing finished, the round opens again."""
        owners = self._owners[0]
        if self.states[0] is not SlotState.FILLING:
            return
        if not np.any(owners == COMPLETE):
            if self.round_open:  # nothing written: whoever is joined now fills it
                self._open_round()
            return
        if all(np.all(owners[columns] == COMPLETE) for columns in self._members.values()):
            self.states[0] = SlotState.FULL
            self._release_round_episodes()

    def spec_for(self, actor_id: str, incarnation: str) -> StepSpec | None:
        """The step spec agreed at join time (also for a departed incarnation), or None if unknown."""
        record = self.actors.get(actor_id)
        if record is None or record.incarnation != incarnation:
            return self._departed.get(incarnation)
        return record.spec

    def heartbeat(self, actor_id: str, incarnation: str, *, now: float, env_steps_per_second: float,
                  policy_lag: float, episodes: int) -> bool:
        """Record a heartbeat; returns False when the incarnation is unknown (the actor must rejoin)."""
        record = self.actors.get(actor_id)
        if record is None or record.incarnation != incarnation:
            return False
        record.last_heard = now
        record.env_steps_per_second = env_steps_per_second
        record.policy_lag = policy_lag
        record.episodes = episodes
        return True

    @staticmethod
    def take_lag(record: ActorRecord) -> tuple[float, float, float] | None:
        """``(min, mean, max)`` policy lag at arrival (learner version - acting version, in versions)
        of the actor's step messages since the last call (the previous figures when none arrived
        since; None before the first); resets the window."""
        window = record.lag_window
        if window.count:
            record.lag_window = LagWindow()
            record.lag_stats = (float(window.low), window.total / window.count, float(window.high))
        return record.lag_stats

    def leave(self, actor_id: str, incarnation: str) -> bool:
        """Remove an actor that says goodbye; its unfinished segment is discarded."""
        record = self.actors.get(actor_id)
        if record is None or record.incarnation != incarnation:
            return False
        self._forget(record)
        self._drain_all()
        return True

    def expire_silent_actors(self, now: float) -> list[str]:
        """Drop actors silent for longer than ``actor_timeout_s``; returns their ids."""
        expired = [r.actor_id for r in self.actors.values() if now - r.last_heard > self.actor_timeout_s]
        for actor_id in expired:
            self._forget(self.actors[actor_id])
            self.counters.dropped["timed_out_actors"] += 1
        if expired:
            self._drain_all()
        return expired

    # ------------------------------------------------------------------------------------ steps
    def ingest(self, message: StepMessage, *, current_policy_version: int, now: float) -> None:
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
        record = self.actors.get(message.actor_id)
        if record is None or record.incarnation != message.incarnation:
            if message.incarnation in self._departed:
                # Steps still in flight when the actor left or was dropped: expected, not malformed.
                self.counters.dropped["late_steps"] += message.num_envs * message.num_steps
                self.counters.dropped["late_step_messages"] += 1
                raise StepRejected("departed_actor", f"actor {message.actor_id!r}/{message.incarnation} has left")
            raise StepRejected("unknown_actor", f"actor {message.actor_id!r}/{message.incarnation} has not joined")
        if message.seq < record.next_seq:  # a replay or a duplicate: never written twice
            raise StepRejected("out_of_order", f"actor {message.actor_id!r}: expected seq {record.next_seq}, "
                                               f"got {message.seq}")
        if message.seq > record.next_seq:
            # Steps went missing (rejected at the wire, or lost): the unfinished segment can no
            # longer hold consecutive rows, so it is discarded; this valid step starts a new one.
            self.counters.dropped["seq_gap_steps"] += message.seq - record.next_seq
            self._discard_segment(record)
            if record.pending:  # held rows are not consecutive with this step any more
                self.counters.dropped["discarded_segment_rows"] += record.spec.num_envs * record.pending_rows
                record.pending.clear()
                record.pending_rows = 0
            self._drain_all()
            record.next_seq = message.seq
        if message.policy_version > current_policy_version:
            raise StepRejected(
                "future_version",
                f"actor {message.actor_id!r}: policy_version {message.policy_version} > published {current_policy_version}",
            )
        record.next_seq += 1
        record.last_heard = now
        self._policy_version = max(self._policy_version, current_policy_version)
        record.lag_window.add(current_policy_version - message.policy_version)
        if self.sync:  # released in (index, seq) order when the rollout is full
            if message.episode_returns:
                self._round_episodes.append((record.index, message.seq, list(message.episode_returns),
                                             list(message.episode_lengths)))
        else:
            self.episode_returns.extend(message.episode_returns)
            self.episode_lengths.extend(message.episode_lengths)

        if record.segment is None and not record.pending:
            record.segment = self._assign_segment(record)
        if self.sync and record.segment is None:  # not a member, or its columns are done: not held
            self.counters.dropped["not_member_steps"] += message.num_envs * message.num_steps
            return
        if record.segment is None or record.pending:  # no free column: hold it (one segment at most)
            self._hold(record, message)
            return
        self._write(record, message)

    def _hold(self, record: ActorRecord, message: StepMessage) -> None:
        """Queue a step message that found no free column; drop the oldest beyond one segment.
        A step-ring message is copied out of its slot, which the learner releases after ingest."""
        record.pending.append(message.owned())
        record.pending_rows += message.num_steps
        while record.pending_rows > self.rollout_length + HELD_SLACK_MESSAGES * record.spec.steps_per_message:
            oldest = record.pending.popleft()
            record.pending_rows -= oldest.num_steps
            self.counters.dropped["no_capacity_steps"] += record.spec.num_envs * oldest.num_steps
        self._drain(record)

    def _drain(self, record: ActorRecord) -> None:
        """Write the actor's held messages while it gets columns."""
        while record.pending:
            if record.segment is None:
                record.segment = self._assign_segment(record)
                if record.segment is None:
                    return
            message = record.pending.popleft()
            record.pending_rows -= message.num_steps
            try:
                self._write(record, message)
            except StepRejected:  # counted by _write as discarded rows; the rest starts a new segment
                pass

    def _drain_all(self) -> None:
        """Columns were freed: write held messages, actors in index order."""
        for record in sorted((r for r in self.actors.values() if r.pending), key=lambda r: r.index):
            self._drain(record)

    def _drop_pending(self, record: ActorRecord) -> None:
        if record.pending:
            self.counters.dropped["no_capacity_steps"] += record.spec.num_envs * record.pending_rows
            record.pending.clear()
            record.pending_rows = 0

    @property
    def pending_rows(self) -> int:
        """Rows held (all actors) waiting for free columns."""
        return sum(r.pending_rows for r in self.actors.values())

    def _write(self, record: ActorRecord, message: StepMessage) -> None:
        """Write one message into the actor's (assigned) segment."""
        num_envs = record.spec.num_envs
        rows = message.num_steps  # K vector steps per message; K divides T (checked at join)
        segment = record.segment
        assert segment is not None
        k = len(segment.columns)
        # Our invariant: segments live only in filling buffers (the trainer reads the others).
        assert self.states[segment.slot] is SlotState.FILLING, (segment.slot, self.states[segment.slot])
        if segment.rows_written == 0 and self._too_old_for(segment.slot, message.policy_version):
            self._owners[segment.slot][segment.columns] = FREE  # the next step may start it
            record.segment = None
            self.counters.dropped["stale_steps"] += num_envs * rows
            return
        fields = message.fields
        if k < num_envs:  # fewer free columns than envs: the first k envs are written
            fields = {name: array[:k] if rows == 1 else array[:, :k] for name, array in fields.items()}
        try:  # decode_step validated the fields against the buffers' schema (checked at join)
            self.buffers[segment.slot].write(
                segment.rows_written, segment.index, fields, rows=None if rows == 1 else rows,
                policy_version=message.policy_version, policy_revision=message.revision, validated=True)
        except (ValueError, OverflowError) as error:  # the row bookkeeping disagrees: nothing was written
            self._discard_segment(record)
            raise StepRejected("schema", str(error)) from None
        segment.rows_written += rows
        record.env_steps += k * rows
        self.counters.env_steps += k * rows
        if k < num_envs:
            self.counters.dropped["no_capacity_steps"] += (num_envs - k) * rows
        if segment.rows_written == self.rollout_length:
            self._finish_segment(record, message)

    def _assign_segment(self, record: ActorRecord) -> Segment | None:
        """Give the actor up to ``num_envs`` free columns of the oldest filling buffer."""
        filling = [s for s, state in enumerate(self.states) if state is SlotState.FILLING]
        if self.sync:  # a member's own block of columns, while they are free
            columns = self._members.get(record.actor_id)
            if filling and columns is not None and np.all(self._owners[0][columns] == FREE):
                self._owners[0][columns] = record.index
                return Segment(slot=0, columns=columns)
            return None
        for slot in sorted(filling, key=lambda s: self._generation[s]):
            free = np.flatnonzero(self._owners[slot] == FREE)
            if free.size:
                columns = free[: record.spec.num_envs].astype(np.int64)
                self._owners[slot][columns] = record.index
                return Segment(slot=slot, columns=columns)
        return None

    def _finish_segment(self, record: ActorRecord, message: StepMessage) -> None:
        segment = record.segment
        assert segment is not None
        k = len(segment.columns)
        last = message.num_steps - 1  # the block's last step ends the segment
        next_values, dones = message.fields["next_values"], message.fields["dones"]
        self._last_values[segment.slot][segment.columns] = (next_values if last == 0 else next_values[last])[:k]
        self._last_dones[segment.slot][segment.columns] = (dones if last == 0 else dones[last])[:k]
        self._owners[segment.slot][segment.columns] = COMPLETE
        record.segment = None
        if self.sync:
            self._close_round_if_done()
        elif np.all(self._owners[segment.slot] == COMPLETE):
            self.states[segment.slot] = SlotState.FULL

    def _release_round_episodes(self) -> None:
        """Synchronous mode: the full rollout's episodes, in (actor index, seq) order."""
        for _, _, returns, lengths in sorted(self._round_episodes, key=lambda item: item[:2]):
            self.episode_returns.extend(returns)
            self.episode_lengths.extend(lengths)
        self._round_episodes = []

    def _forget(self, record: ActorRecord) -> None:
        """Remove an actor: discard its unfinished segment, remember the incarnation as departed."""
        self._discard_segment(record)
        self._drop_pending(record)
        self.actors.pop(record.actor_id, None)
        if self.sync:
            self._members.pop(record.actor_id, None)
            self._close_round_if_done()
        self._departed[record.incarnation] = record.spec
        while len(self._departed) > 1024:
            del self._departed[next(iter(self._departed))]

    def _discard_segment(self, record: ActorRecord) -> None:
        segment = record.segment
        if segment is None:
            return
        assert self.states[segment.slot] is SlotState.FILLING, (segment.slot, self.states[segment.slot])
        self.buffers[segment.slot].reset_columns(segment.columns)
        self._owners[segment.slot][segment.columns] = FREE
        self.counters.dropped["discarded_segment_rows"] += segment.rows_written * len(segment.columns)
        record.segment = None

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
        """Hand the oldest buffer to training if it is full (its state becomes TRAINING), or None.

        Buffers train in generation order: a newer full buffer waits while an older one is still
        filling. Otherwise an actor that stalls in the middle of its segment (descheduled, slow
        network) would pin that buffer while the other buffer filled and trained again and again
        with the other actors' steps, and the pinned rows would reach training many policy
        versions old (far beyond ``max_policy_lag``). In order,
        the policy version advances by one per rollout, so a row's lag stays bounded by the
        buffers in the ring plus the steps in flight.
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
        if unused.size:  # synchronous mode: columns no member filled hold no trainable row
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

    def release(self, slot: int, policy_version: int | None = None) -> None:
        """Return a trained buffer to filling, emptied, behind the other filling buffers; held
        steps are written into it (``policy_version``: the version its training produced, for the
        ``max_policy_lag`` check of the segments that start now)."""
        if self.states[slot] is not SlotState.TRAINING:
            raise ValueError(f"buffer {slot} is {self.states[slot].value}, expected training")
        self.buffers[slot].reset()
        self._owners[slot][:] = FREE
        self._generation[slot] = self._next_generation
        self._next_generation += 1
        self.states[slot] = SlotState.FILLING
        if policy_version is not None:
            self._policy_version = max(self._policy_version, policy_version)
        if self.sync:
            self._open_round()
        self._drain_all()

    def trains_at(self, slot: int) -> int:
        """The policy version the buffer ``slot`` will be trained with (at the earliest): the newest
        version known here plus one per buffer that trains before it (buffers train in generation
        order, each training adds one version)."""
        ahead = sum(1 for other, state in enumerate(self.states) if other != slot and (
            state is SlotState.TRAINING or self._generation[other] < self._generation[slot]))
        return self._policy_version + ahead

    def _too_old_for(self, slot: int, policy_version: int) -> bool:
        """True when a row acted by ``policy_version`` would train in ``slot`` older than ``max_policy_lag``."""
        if self.max_policy_lag is None or self.sync:  # sync: every row is acted by the current version
            return False
        return self.trains_at(slot) - policy_version > self.max_policy_lag

    def buffer_fill(self) -> float:
        """Fraction of rows written in the oldest filling buffer (0..1; synchronous mode: of its
        members' rows), 1.0 when none is filling."""
        filling = [s for s, state in enumerate(self.states) if state is SlotState.FILLING]
        if not filling:
            return 1.0
        slot = min(filling, key=lambda s: self._generation[s])
        columns = sum(len(c) for c in self._members.values()) if self.sync else self.num_columns
        return float(self.buffers[slot].column_steps.sum()) / (self.rollout_length * max(1, columns))

    def take_episodes(self) -> tuple[list[float], list[int]]:
        """Episodic returns and lengths received since the last call."""
        returns, lengths = self.episode_returns, self.episode_lengths
        self.episode_returns, self.episode_lengths = [], []
        return returns, lengths


def drop_stale_rows(buffer: RolloutBuffer, *, current_policy_version: int, max_policy_lag: int,
                    columns: np.ndarray | None = None) -> tuple[int, dict[str, float]]:
    """Exclude rows whose policy lag exceeds ``max_policy_lag`` from training.

    Policy lag of a row = ``current_policy_version - policy_versions[t, e]`` (updates between the
    policy that acted and the one about to be trained).

    Args:
        columns: ``(N,)`` bool, the columns that hold rows (the others are sealed and not looked
            at), or None: every column.

    Returns:
        ``(rows_dropped, stats)``: ``stats`` holds the lag ``min``/``mean``/``max`` over the rows
        of ``columns`` and ``newest_version``, the highest policy version that acted in them.
    """
    versions = buffer.policy_versions
    lag = current_policy_version - versions
    dropped = buffer.mark_untrainable(lag > max_policy_lag)
    if columns is not None:
        versions, lag = versions[:, columns], lag[:, columns]
    return dropped, {
        "min": float(lag.min()),
        "mean": float(lag.mean()),
        "max": float(lag.max()),
        "newest_version": float(versions.max()),
    }
