"""The learner's actor registry: every joined actor incarnation, and everything held for it.

An actor incarnation that joins gets an :class:`ActorRecord` (its index, step spec, sequence number,
segment, held messages, arrival lag, rates). Beside the record, the learner holds per incarnation its
peer binding (:class:`~oakemu_core.transport.auth.PeerBinding`), its step ring
(:class:`~oakemu_core.transport.step_ring.StepRings`), the last stacks of its stacked fields
(:class:`~oakemu_core.transport.frame_stacks.StackHistories`) and the watch of its process
(:class:`~oakemu_core.transport.liveness.LocalProcesses`). :meth:`ActorRegistry.forget` releases all of
them in one call, and the rows the rollout assembler holds for it (a release callback registered
with :meth:`ActorRegistry.on_forget`); the incarnation is then remembered as departed, so its
messages still in flight count as late steps (:class:`DepartedIncarnations`).

The registry also owns the learner's ingest counters (:class:`IngestCounters`). Plain Python; no
sockets.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oakemu_core.storage.buffer_ring import Segment
from oakemu_core.transport.steps import StepSpec

if TYPE_CHECKING:
    from oakemu_core.transport.auth import PeerBinding
    from oakemu_core.transport.frame_stacks import StackHistories
    from oakemu_core.transport.liveness import LocalProcesses
    from oakemu_core.transport.step_ring import StepRings

__all__ = [
    "ActorRecord",
    "ActorRegistry",
    "DepartedIncarnations",
    "IngestCounters",
    "LagWindow",
]


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
    """Arrival lag of its step messages since :meth:`take_lag`."""
    lag_stats: tuple[float, float, float] | None = None
    """``(min, mean, max)`` arrival lag of the last non-empty window (:meth:`take_lag`)."""
    episodes: int = 0
    env_steps: int = 0
    pending: deque = field(default_factory=deque)
    """Step messages that found no free column, oldest first, consecutive in ``seq``; written as
    soon as columns free (:meth:`~oakemu_core.storage.assembler.RolloutAssembler.release`), at most
    one segment of rows."""
    pending_rows: int = 0
    served: int = 0
    """When it last started writing a segment (the assembler's count of segments started; 0: never):
    freed columns go to the actor served least recently (the rollout assembler's drain order)."""

    def take_lag(self) -> tuple[float, float, float] | None:
        """``(min, mean, max)`` policy lag at arrival (learner version - acting version, in versions)
        of the actor's step messages since the last call (the previous figures when none arrived
        since; None before the first); resets the window."""
        window = self.lag_window
        if window.count:
            self.lag_window = LagWindow()
            self.lag_stats = (float(window.low), window.total / window.count, float(window.high))
        return self.lag_stats

    def hold(self, message: Any, max_rows: int) -> int:
        """Queue a step message (owned: no ring slot) behind the held ones; the oldest go while more
        than ``max_rows`` rows are held. Returns the env steps of the messages that went."""
        self.pending.append(message)
        self.pending_rows += message.num_steps
        dropped = 0
        while self.pending_rows > max_rows:
            oldest = self.pending.popleft()
            self.pending_rows -= oldest.num_steps
            dropped += self.spec.num_envs * oldest.num_steps
        return dropped

    def clear_pending(self) -> int:
        """Forget the held messages; returns the env steps they held."""
        steps = self.spec.num_envs * self.pending_rows
        self.pending.clear()
        self.pending_rows = 0
        return steps


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
    ``timed_out_actors``, ``exited_actors`` / ``stopped_actors`` (a watched local process ended or
    was stopped: :mod:`oakemu_core.transport.liveness`), ``seq_gap_steps`` (step messages missing
    from an actor's sequence), ``not_member_steps`` (synchronous mode: env steps of an actor that is
    not filling the rollout),
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
        return (
            sum(self.received.values())
            - sum(self.accepted.values())
            - rejected
            - self.dropped["late_step_messages"]
        )


class DepartedIncarnations:
    """The step specs of the newest :data:`KEPT` incarnations that left or were dropped, for their late
    messages (in flight when they left): decoded against their spec, counted in ``counters`` as
    ``dropped["late_steps"]`` and ``dropped["late_step_messages"]``, never written."""

    KEPT = 1024

    def __init__(self, counters: IngestCounters) -> None:
        self.counters = counters
        self._specs: dict[str, StepSpec] = {}

    def add(self, incarnation: str, spec: StepSpec) -> None:
        self._specs[incarnation] = spec
        while len(self._specs) > self.KEPT:
            del self._specs[next(iter(self._specs))]

    def spec(self, incarnation: str) -> StepSpec | None:
        return self._specs.get(incarnation)

    def count_late(self, incarnation: str) -> bool:
        """Count one message of ``incarnation`` as late (True) when it departed, else False."""
        spec = self._specs.get(incarnation)
        if spec is None:
            return False
        self.counters.dropped["late_steps"] += spec.num_envs * spec.steps_per_message
        self.counters.dropped["late_step_messages"] += 1
        return True


class ActorRegistry:
    """The joined actor incarnations by actor id, and the per-incarnation holders it releases.

    Args:
        peers: the actors' peer bindings (released when the forgotten incarnation holds the binding:
            a newer incarnation's join has bound it already), or None.
        rings: the learner's step rings (a forgotten incarnation's ring departs, kept mapped for its
            late messages; freed at once with ``free_ring``), or None.
        stacks: the last frame stacks of each incarnation (forgotten), or None.
        processes: the watched actor processes (no longer watched), or None.
    """

    def __init__(
        self,
        *,
        peers: PeerBinding | None = None,
        rings: StepRings | None = None,
        stacks: StackHistories | None = None,
        processes: LocalProcesses | None = None,
    ) -> None:
        self.actors: dict[str, ActorRecord] = {}
        self.counters = IngestCounters()
        self.departed = DepartedIncarnations(self.counters)  # their steps in flight: late
        self.peers = peers
        self.rings = rings
        self.stacks = stacks
        self.processes = processes
        self._releases: list[Callable[[ActorRecord], None]] = []
        self._next_index = 0

    def __len__(self) -> int:
        return len(self.actors)

    def get(self, actor_id: str, incarnation: str) -> ActorRecord | None:
        """The record of that incarnation while it is the actor's joined one, else None."""
        record = self.actors.get(actor_id)
        return record if record is not None and record.incarnation == incarnation else None

    def keys(self) -> set[tuple[str, str]]:
        """``(actor_id, incarnation)`` of every joined incarnation."""
        return {(r.actor_id, r.incarnation) for r in self.actors.values()}

    def add(self, record: ActorRecord) -> None:
        """Register a joined incarnation.

        Raises:
            ValueError: the actor id is registered (forget its record first).
        """
        if record.actor_id in self.actors:
            raise ValueError(f"actor {record.actor_id!r} is registered: forget it first")
        self.actors[record.actor_id] = record

    def register(
        self,
        actor_id: str,
        incarnation: str,
        spec: StepSpec,
        *,
        hostname: str,
        now: float,
        index: int | None = None,
    ) -> ActorRecord:
        """Register a joined incarnation under ``index`` (None: the next number never given).

        Raises:
            ValueError: the actor id is registered (forget it first), or ``index`` is held by
                another joined actor.
        """
        if index is not None:
            holders = [r.actor_id for r in self.actors.values() if r.index == index]
            if holders:
                raise ValueError(f"actor index {index} is held by actor {holders[0]!r}")
        record = ActorRecord(
            actor_id=actor_id,
            incarnation=incarnation,
            index=self._next_index if index is None else index,
            spec=spec,
            hostname=hostname,
            joined_at=now,
            last_heard=now,
        )
        self.add(record)
        self._next_index = max(self._next_index, record.index) + 1
        return record

    def on_forget(self, release: Callable[[ActorRecord], None]) -> None:
        """Call ``release(record)`` for every record forgotten from now on, after it left
        :attr:`actors` (the rollout assembler: its segment and held messages)."""
        self._releases.append(release)

    def forget(self, record: ActorRecord, *, free_ring: bool = False) -> None:
        """Remove a joined incarnation and release everything held for it: the record, what the
        :meth:`on_forget` callbacks hold, its peer binding, step ring (departed for its late messages,
        or freed at once with ``free_ring``: an actor that timed out has nothing in flight), frame
        stacks and process watch. The incarnation is remembered as departed."""
        key = (record.actor_id, record.incarnation)
        if self.actors.get(record.actor_id) is record:
            del self.actors[record.actor_id]
        self.departed.add(record.incarnation, record.spec)
        for release in self._releases:
            release(record)
        if self.peers is not None:
            bound = self.peers.peers.get(record.actor_id)
            if bound is not None and bound[0] == record.incarnation:
                self.peers.forget(record.actor_id)
        if self.rings is not None:
            self.rings.release(*key, free=free_ring)
        if self.stacks is not None:
            self.stacks.forget(*key)
        if self.processes is not None:
            self.processes.forget(*key)

    def sweep(self, keep_bindings: set[str] = frozenset()) -> None:
        """Release what is held for incarnations that are not joined, which no :meth:`forget` will:
        the peer bindings of joins that were bound, then refused (except the actor ids in
        ``keep_bindings``: joins held for the next rollout), and the step ring, stacks and process
        watch of a join that failed after they were made."""
        live = self.keys()
        if self.peers is not None:
            self.peers.retain(set(self.actors) | set(keep_bindings))
        if self.rings is not None:
            self.rings.retain(live)
        if self.stacks is not None:
            self.stacks.retain(live)
        if self.processes is not None:
            self.processes.retain(live)

    def spec_for(self, actor_id: str, incarnation: str) -> StepSpec | None:
        """The step spec agreed at join time (also for a departed incarnation), or None if unknown."""
        record = self.get(actor_id, incarnation)
        return self.departed.spec(incarnation) if record is None else record.spec

    def count_late(self, actor_id: str, incarnation: str) -> bool:
        """Count a message of a departed ``incarnation`` (not ``actor_id``'s joined one) as late
        (True), else False."""
        return self.get(actor_id, incarnation) is None and self.departed.count_late(incarnation)

    def heartbeat(
        self,
        actor_id: str,
        incarnation: str,
        *,
        now: float,
        env_steps_per_second: float,
        policy_lag: float,
        episodes: int,
    ) -> bool:
        """Record a heartbeat; returns False when the incarnation is unknown (the actor must rejoin)."""
        record = self.get(actor_id, incarnation)
        if record is None:
            return False
        record.last_heard = now
        record.env_steps_per_second = env_steps_per_second
        record.policy_lag = policy_lag
        record.episodes = episodes
        return True

    def silent(self, now: float, timeout_s: float) -> list[ActorRecord]:
        """The records not heard from (step or heartbeat) for more than ``timeout_s`` seconds."""
        return [r for r in self.actors.values() if now - r.last_heard > timeout_s]

    @property
    def pending_rows(self) -> int:
        """Rows held (all actors) waiting for free columns."""
        return sum(r.pending_rows for r in self.actors.values())
