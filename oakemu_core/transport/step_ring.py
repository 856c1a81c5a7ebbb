"""Step rings: an actor on the learner's machine hands over its step arrays in shared memory.

Through the sockets, every byte of a step message is copied about six times (msgpack on the actor,
the kernel twice, ZeroMQ, msgpack on the learner, the rollout buffer). A :class:`StepRing` is a
shared-memory segment of ``slots`` message slots, created by the learner for one actor incarnation
(it owns and unlinks it). The actor copies a message's arrays into slot ``seq % slots`` and sends a
small step message that names the slot instead of carrying the arrays
(:class:`oakemu_core.transport.steps.StepMessage` ``slot``); the learner validates the slot's arrays
like inline ones, copies them into its rollout buffer, and marks the message released. Ordering,
joins, heartbeats and rejection stay on the sockets; the array bytes move through the ring, and its
free slots are the actor's back-pressure (below). The two ends that use a ring are
:class:`oakemu_core.transport.channels.RingStepChannel` (actor) and
:class:`oakemu_core.transport.channels.StepReceiver` (learner).

Layout: a 64-byte header (magic, a random token the actor checks, slot count and size, and the
release counter), then the slots; each slot holds the spec's sent fields in
:meth:`oakemu_core.transport.steps.StepSpec.array_layout` order, each at a 64-byte-aligned offset, C order.

Flow control: the header's ``released`` counts the messages the learner is done with (every
``seq`` below it). The actor writes message ``seq`` only when ``seq - released < slots``, so a slot
is never rewritten while the learner may still read it, and at most ``slots`` messages are in flight
(:func:`ring_slots`). The learner copies what it keeps (written rows, or held messages:
:meth:`oakemu_core.transport.steps.StepMessage.owned`) before it releases, and releases rejected messages too
(else an actor whose messages are all rejected would wait for a slot forever). It checks a slot's
values on a private copy, which is what it writes, so an actor that wrote a slot after sending it
cannot slip unchecked values in; fields where every bit pattern is valid (uint8 frames) are copied
from the slot directly. One writer per word: the actor writes slots, the learner writes
``released``; an aligned 8-byte store is atomic. The socket send / receive orders the actor's write
before the learner's read; the learner's reads before its release store are ordered on x86 (total
store order), while weaker memory models rely on the interpreter's own barriers around them.

Whether the two processes share the segment is tried, not assumed: the learner offers a ring when
the actor's join request names the learner's host id (kernel boot id and the device of ``/dev/shm``:
containers share the boot id, not the ``/dev/shm`` mount), the actor attaches it and checks the
token; where the attach fails anyway (another user) the actor sends its arrays inline, which the
learner takes as the answer and frees the ring.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from oakemu_core.shared_memory import SharedArray
from oakemu_core.transport.control import StepRingOffer
from oakemu_core.transport.steps import StepSpec

RING_VECTOR_STEPS = 16
"""Most vector steps a ring holds in flight (:func:`ring_slots`)."""


def ring_slots(steps_per_message: int, rollout_length: int, *, synchronous: bool = False) -> int:
    """Slots of a ring for messages of K = ``steps_per_message`` >= 1 vector steps:
    ``max(floor, min(16, rollout_length // 8) // K)``, where ``floor`` is 1 when one message is an eighth
    of the rollout or more (``8 * K >= rollout_length``), else 2. ``synchronous`` (``--mode sync``):
    ``max(2, min(16, rollout_length) // K)``.

    The slots bound the rows between acting and ingest: at most an eighth of a segment, and
    :data:`RING_VECTOR_STEPS` vector steps (about what the socket queues hold of one-step messages),
    so rows are no older when trained than through the sockets. An actor acts a message's steps only
    once its slot is free (:meth:`oakemu_core.transport.channels.RingStepChannel.wait_writable`), so
    these bound the rows it has acted that the learner has not read yet. Two slots at least let the
    actor fill one while the learner reads the other; one when a single message is an eighth of a
    segment or more, where the actor then waits while the learner reads it (measurements:
    ``docs/benchmarks.md``).

    In synchronous mode every row of a segment is acted by one policy version and trained on only when
    the whole rollout is in, so the time a row waits for ingest adds no lag: the ring holds up to
    :data:`RING_VECTOR_STEPS` vector steps of the segment, and the actor rarely waits for a slot.
    """
    if synchronous:
        return max(2, min(RING_VECTOR_STEPS, rollout_length) // steps_per_message)
    floor = 1 if 8 * steps_per_message >= rollout_length else 2
    return max(floor, min(RING_VECTOR_STEPS, rollout_length // 8) // steps_per_message)


_MAGIC = b"OAKRING1"
_HEADER_BYTES = 64
_ALIGN = 64
_SLOTS_WORD, _SLOT_BYTES_WORD, _RELEASED_WORD = (
    2,
    3,
    4,
)  # header as int64 words: magic, token, these
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
SHM_DIR = Path("/dev/shm")


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class StepRingUnavailable(Exception):
    """The offered ring cannot be used here (another ``/dev/shm``, or not the learner's segment)."""


def shared_memory_host_id(boot_id_path: Path = BOOT_ID_PATH, shm_dir: Path = SHM_DIR) -> str:
    """Who shares this process's POSIX shared memory: ``"<kernel boot id>/<device of /dev/shm>"``
    (Linux), or ``""`` where either is missing. A learner offers a step ring to an actor whose join
    request carries its own host id. Containers on one host share the boot id but each mounts its own
    ``/dev/shm`` (another device number), unless they share the host's (``ipc: host``)."""
    try:
        boot_id = boot_id_path.read_text(encoding="ascii").strip()[:64]
        device = shm_dir.stat().st_dev
    except (OSError, UnicodeDecodeError):
        return ""
    return f"{boot_id}/{device}" if boot_id else ""


def _field_offsets(
    spec: StepSpec,
) -> tuple[list[tuple[str, np.dtype, tuple[int, ...], int, int]], int]:
    """``(name, dtype, shape, offset, nbytes)`` of each sent field within a slot, and the slot's size."""
    fields, offset = [], 0
    for name, (dtype, shape) in spec.array_layout().items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        fields.append((name, dtype, shape, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return fields, max(offset, _ALIGN)


class StepRing:
    """``slots`` slots of one actor's step-message arrays in one shared-memory segment.

    Create with :meth:`create` (learner, owner) or :meth:`attach` (actor). Not thread-safe; one
    actor writes, one learner reads.

    Attributes:
        spec: the actor's :class:`~oakemu_core.transport.steps.StepSpec` (field dtypes and shapes of a slot).
        slots: number of slots.
    """

    def __init__(self, shared: SharedArray, spec: StepSpec, slots: int, token: str) -> None:
        """Wrap a mapped segment; use :meth:`create` or :meth:`attach`."""
        self.spec = spec
        self.slots = slots
        self._shared = shared
        self._token = token
        self._layout, self._slot_bytes = _field_offsets(spec)
        memory = shared.array
        self._header = memory[:_HEADER_BYTES].view(np.int64)
        self._slot_views: list[dict[str, np.ndarray]] = []  # writable (the actor's)
        self._read_views: list[dict[str, np.ndarray]] = []  # read-only (the learner's)
        for slot in range(slots):
            base = _HEADER_BYTES + slot * self._slot_bytes
            views = {
                name: memory[base + offset : base + offset + nbytes].view(dtype).reshape(shape)
                for name, dtype, shape, offset, nbytes in self._layout
            }
            self._slot_views.append(views)
            self._read_views.append({name: _read_only(view) for name, view in views.items()})

    @staticmethod
    def segment_bytes(spec: StepSpec, slots: int) -> int:
        """Bytes of a ring of ``slots`` slots for ``spec`` (header included)."""
        return _HEADER_BYTES + slots * _field_offsets(spec)[1]

    @classmethod
    def create(cls, spec: StepSpec, slots: int) -> StepRing:
        """Create a ring owned by this process (the learner), zero-filled, ``released`` = 0, of
        ``slots`` slots (:func:`ring_slots`).

        Raises:
            ValueError: ``slots`` < 1.
            OSError: the system cannot create or reserve the segment (``/dev/shm`` full).
        """
        if slots < 1:
            raise ValueError(f"slots: expected an int >= 1, received {slots}")
        token = secrets.token_hex(8)
        shared = SharedArray.create((cls.segment_bytes(spec, slots),), np.uint8, field="stepring")
        header = shared.array[:_HEADER_BYTES]
        header[:8] = np.frombuffer(_MAGIC, np.uint8)
        header[8:16] = np.frombuffer(bytes.fromhex(token), np.uint8)
        words = header.view(np.int64)
        words[_SLOTS_WORD], words[_SLOT_BYTES_WORD] = slots, _field_offsets(spec)[1]
        return cls(shared, spec, slots, token)

    @classmethod
    def attach(cls, offer: StepRingOffer, spec: StepSpec) -> StepRing:
        """Attach the ring the learner offered (the actor's side).

        Raises:
            StepRingUnavailable: no segment of that name here (another ``/dev/shm``), or it is not
                the offered ring (magic, token, slot count or slot size differ).
        """
        size = cls.segment_bytes(spec, offer.slots)
        try:
            shared = SharedArray.attach(offer.name, (size,), np.uint8)
        except (FileNotFoundError, ValueError, OSError) as error:
            raise StepRingUnavailable(f"cannot attach step ring {offer.name}: {error}") from None
        header = shared.array[:_HEADER_BYTES]
        words = header.view(np.int64)
        if (
            header[:8].tobytes() != _MAGIC
            or header[8:16].tobytes().hex() != offer.token
            or int(words[_SLOTS_WORD]) != offer.slots
            or int(words[_SLOT_BYTES_WORD]) != _field_offsets(spec)[1]
        ):
            shared.close()
            raise StepRingUnavailable(f"segment {offer.name} is not the offered step ring")
        return cls(shared, spec, offer.slots, offer.token)

    def offer(self) -> StepRingOffer:
        """What the join reply tells the actor: segment name, token and slot count."""
        return StepRingOffer(name=self._shared.name, token=self._token, slots=self.slots)

    @property
    def released(self) -> int:
        """Messages the learner is done with: every ``seq`` below this may be overwritten."""
        return int(self._header[_RELEASED_WORD])

    # -- actor side ------------------------------------------------------------------------------
    def is_free(self, seq: int) -> bool:
        """Whether message ``seq`` may be written now (the learner released ``seq - slots``)."""
        return seq - self.released < self.slots

    def write(self, seq: int, fields: Mapping[str, np.ndarray]) -> int:
        """Copy message ``seq``'s arrays into its slot; returns the slot (``seq % slots``).

        Args:
            seq: the message's sequence number (0, 1, ... of this incarnation).
            fields: every sent field of the spec, with the shape of
                :meth:`~oakemu_core.transport.steps.StepSpec.array_layout`, cast to the field's dtype with
                numpy's ``same_kind`` rule (which narrows, e.g. int64 to uint8, without a check: the
                learner's value checks see the narrowed values).

        Raises:
            RuntimeError: the slot is still in use (check :meth:`is_free` first).
            KeyError: the fields are not the spec's sent fields.
            ValueError: a field has another shape (checked before anything is written).
            TypeError: a field's dtype cannot be cast to the spec's (``same_kind``).
        """
        if not self.is_free(seq):
            raise RuntimeError(f"step ring slot of seq {seq} is in use (released {self.released})")
        slot = seq % self.slots
        views = self._slot_views[slot]
        if fields.keys() != views.keys():
            raise KeyError(f"fields: expected {sorted(views)}, received {sorted(fields)}")
        for name, view in views.items():
            if (
                np.shape(fields[name]) != view.shape
            ):  # np.copyto would broadcast one step into a block
                raise ValueError(
                    f"{name}: expected shape {view.shape}, received {np.shape(fields[name])}"
                )
        for name, view in views.items():
            np.copyto(view, fields[name], casting="same_kind")
        return slot

    # -- learner side ----------------------------------------------------------------------------
    def slot_fields(self, slot: int) -> dict[str, np.ndarray]:
        """Read-only views of one slot's arrays, by field name, with the dtypes and shapes of
        :meth:`~oakemu_core.transport.steps.StepSpec.array_layout` (``(n, *shape)``, or ``(K, n, *shape)``).
        Their contents are valid until the message is released; the same view objects every time.

        Raises:
            IndexError: ``slot`` is not in ``[0, slots)``.
        """
        return self._read_views[slot]

    def release(self, seq: int) -> None:
        """Mark message ``seq`` (and every earlier one) done: its slot may be rewritten."""
        if seq + 1 > self._header[_RELEASED_WORD]:
            self._header[_RELEASED_WORD] = seq + 1

    @property
    def name(self) -> str:
        """The segment's name."""
        return self._shared.name

    def close_name(self) -> None:
        """Owner: remove the segment's name (no new attach), keep the mapping. Idempotent."""
        if self._shared.is_owner:
            self._shared.unlink()

    def close(self) -> None:
        """Drop this ring's hold on the segment (the owner also unlinks the name first). Idempotent.
        The memory is unmapped when the last view of it is freed, this ring's own slot views included."""
        if self._shared.is_owner:
            self._shared.unlink()
        self._shared.close()


DEPARTED_RINGS_KEPT = 8
"""Rings of departed actor incarnations kept mapped (their names already unlinked), so that their
messages still in the sockets decode and count as late steps, not as malformed."""


class StepRingRefused(OSError):
    """A ring would exceed the learner's step-ring memory limits (the actor's arrays go inline)."""


class StepRings:
    """The learner's step rings by ``(actor_id, incarnation)``: made at join, freed when the actor
    departs or turns out to send inline (then its ring was not reachable from the actor).

    Args:
        max_bytes: most shared memory (bytes) all rings take together, departed ones kept mapped
            included (those are freed first to make room); None: no limit.
        max_bytes_per_actor: largest ring (bytes); None: no limit.
    """

    def __init__(
        self, *, max_bytes: int | None = None, max_bytes_per_actor: int | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_actor = max_bytes_per_actor
        self._live: dict[tuple[str, str], StepRing] = {}
        self._departed: dict[tuple[str, str], StepRing] = {}

    @property
    def used_bytes(self) -> int:
        """Shared-memory bytes of the rings this learner holds (live and departed)."""
        return sum(
            ring.segment_bytes(ring.spec, ring.slots)
            for ring in [*self._live.values(), *self._departed.values()]
        )

    def offer(
        self,
        actor_id: str,
        incarnation: str,
        spec: StepSpec,
        rollout_length: int,
        *,
        synchronous: bool = False,
    ) -> StepRingOffer:
        """Create a ring (:func:`ring_slots` slots, ``synchronous`` for ``--mode sync``) for a joining
        actor and return its offer. The rings of the actor's earlier incarnations depart (kept for their
        late messages); a join retried by the same incarnation is offered its ring again.

        Raises:
            StepRingRefused: the ring is larger than ``max_bytes_per_actor``, or finds no room in
                ``max_bytes`` (an ``OSError``).
            OSError: the system cannot create the segment (e.g. ``/dev/shm`` is full).
        """
        slots = ring_slots(spec.steps_per_message, rollout_length, synchronous=synchronous)
        previous = self._live.pop(
            (actor_id, incarnation), None
        )  # a join retried with the same incarnation
        if previous is not None and previous.spec == spec and previous.slots == slots:
            self._live[(actor_id, incarnation)] = (
                previous  # offered again: whichever reply the actor took, one ring
            )
            return previous.offer()
        if previous is not None:
            previous.close()
        for key in [key for key in self._live if key[0] == actor_id]:
            self._depart(key)
        size = StepRing.segment_bytes(spec, slots)
        if self.max_bytes_per_actor is not None and size > self.max_bytes_per_actor:
            raise StepRingRefused(
                f"a ring of {size / 2**20:.1f} MiB is larger than step_ring_max_mib_per_actor "
                f"({self.max_bytes_per_actor / 2**20:.1f} MiB)"
            )
        if self.max_bytes is not None:
            while self._departed and self.used_bytes + size > self.max_bytes:
                self._departed.pop(next(iter(self._departed))).close()
            if self.used_bytes + size > self.max_bytes:
                raise StepRingRefused(
                    f"the step rings take {self.used_bytes / 2**20:.1f} MiB, a ring of "
                    f"{size / 2**20:.1f} MiB more exceeds step_ring_max_mib "
                    f"({self.max_bytes / 2**20:.1f} MiB)"
                )
        ring = StepRing.create(spec, slots)
        self._live[(actor_id, incarnation)] = ring
        return ring.offer()

    def get(self, actor_id: str, incarnation: str) -> StepRing | None:
        """The ring of that incarnation (also of a recently departed one), or None."""
        key = (actor_id, incarnation)
        return self._live.get(key) or self._departed.get(key)

    def discard(self, actor_id: str, incarnation: str) -> bool:
        """Free the ring of an actor that sends inline; returns whether it had one."""
        ring = self._live.pop((actor_id, incarnation), None)
        if ring is not None:
            ring.close()
        return ring is not None

    def retain(self, live: set[tuple[str, str]], free: set[str] = frozenset()) -> None:
        """Unlink the rings of incarnations not in ``live``: those of the actor ids in ``free`` (actors
        that timed out: nothing of theirs is in flight) are unmapped at once, the others depart, and
        the newest :data:`DEPARTED_RINGS_KEPT` departed ones stay mapped for late messages."""
        for key in [key for key in self._live if key not in live]:
            if key[0] in free:
                self._live.pop(key).close()
            else:
                self._depart(key)
        while len(self._departed) > DEPARTED_RINGS_KEPT:
            self._departed.pop(next(iter(self._departed))).close()

    def release(self, actor_id: str, incarnation: str, *, free: bool = False) -> None:
        """The incarnation departed: its ring is unlinked and kept mapped for its late messages (the
        newest :data:`DEPARTED_RINGS_KEPT`), or unmapped at once with ``free`` (nothing in flight)."""
        key = (actor_id, incarnation)
        if key not in self._live:
            return
        if free:
            self._live.pop(key).close()
        else:
            self._depart(key)
        while len(self._departed) > DEPARTED_RINGS_KEPT:
            self._departed.pop(next(iter(self._departed))).close()

    def _depart(self, key: tuple[str, str]) -> None:
        ring = self._live.pop(key)
        ring.close_name()
        self._departed[key] = ring

    def __len__(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Unlink and unmap every ring."""
        for ring in [*self._live.values(), *self._departed.values()]:
            ring.close()
        self._live.clear()
        self._departed.clear()
