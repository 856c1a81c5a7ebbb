"""Step messages: one actor's env steps (arrays of every sent field of the step schema) and their checks.

A step message (actor PUSH -> learner PULL) is one multipart ZeroMQ message: a small msgpack header
(``"type": "step"``, ``"actor_id"``, ``"incarnation"`` (a fresh id on every actor start), ``"seq"``
(0, 1, 2, ... per incarnation), the ``"policy_version"`` and ``"revision"`` of the weights that acted,
``"slot"`` and the episodes that ended), then one frame per sent field of the step schema, in the
schema's order, holding the field's raw C-order bytes (no dtype, shape or name on the wire: they are
the :class:`StepSpec` agreed at join). A stacked observation field (Atari's ``(4, 84, 84)`` frames)
travels as two frames, its per-row flags and the newest frames plus the whole stacks of flagged
rows (:mod:`oakemu_core.transport.frame_stacks`). :func:`decode_step` checks every message against the
sender's spec (frame count, each frame's byte length, then the contents) and raises only
:class:`~oakemu_core.transport.codec.MessageRejected`. Ordering of ``seq`` is checked by the learner
(:mod:`oakemu_core.storage.assembler`), not here.

Copies: :func:`encode_step` returns views of the message's arrays (the sender's socket copies them
once into its messages) and fresh buffers for deduplicated stacks (sent without a copy);
:func:`decode_step` returns read-only ``np.frombuffer`` views of the received frames (no copy) and each
deduplicated stack as a :class:`~oakemu_core.transport.frame_stacks.StackedRows`, rebuilt where the
learner writes it (one copy). A step message of an actor with a step ring is the header alone
with ``"slot"`` set: its arrays are in that slot of the ring (:mod:`oakemu_core.transport.step_ring`),
and :func:`decode_step` reads them from there (frames in place, the checked fields as private copies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from oakemu_core.step_schema import StepSchema, check_step_consistency
from oakemu_core.transport.codec import (
    INT64_MAX,
    MAX_ARRAY_LEN,
    MessageRejected,
    check_local_id,
    check_local_int,
    checked_contents,
    describe,
    finite_float,
    get_int,
    get_str,
    header,
    pack,
    reject,
    require_fields,
    unpack,
)
from oakemu_core.transport.frame_stacks import (
    StackedRows,
    StackEncoder,
    decode_stacks,
    rebuild_stacks,
    stacked_fields,
    wire_bytes_per_env,
)

__all__ = [
    "TYPE_STEP",
    "MAX_STEPS_PER_MESSAGE",
    "MAX_ABS_EPISODE_RETURN",
    "StepSpec",
    "StepMessage",
    "StepRingReader",
    "StepEncoder",
    "encode_step",
    "decode_step",
]

TYPE_STEP = "step"
"""The ``"type"`` of a step message."""

MAX_STEPS_PER_MESSAGE = 1024
"""Largest ``steps_per_message`` K a spec may declare."""

MAX_ABS_EPISODE_RETURN = 1e12
"""Largest magnitude accepted for a raw episodic return."""

_STEP_FIELDS = (
    "actor_id",
    "incarnation",
    "seq",
    "policy_version",
    "revision",
    "slot",
    "episode_returns",
    "episode_lengths",
)

Frame = bytes | bytearray | memoryview
"""One ZeroMQ frame of a step message as :func:`encode_step` makes it and :func:`decode_step` reads it."""


# ---------------------------------------------------------------------------------------------
# StepSpec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    """What every step message of one actor must look like; agreed at join time.

    Attributes:
        num_envs: n, the number of envs of the actor = leading dimension of every step array.
        schema: the run's :class:`~oakemu_core.step_schema.StepSchema`; its *sent* fields are the
            message's arrays.
        steps_per_message: K, consecutive vector steps per step message (the learner chooses it
            at join, see :func:`oakemu_core.transport.batching.auto_steps_per_message`; it divides
            the rollout length so a message never crosses a segment boundary). K = 1: arrays
            ``(n, *shape)``; K > 1: ``(K, n, *shape)``.

    Raises:
        ValueError: ``num_envs`` is not an int >= 1, or ``steps_per_message`` not an int in
            ``[1, MAX_STEPS_PER_MESSAGE]``.

    Derived attributes: ``lead`` (``(n,)`` or ``(K, n)``), ``stacked`` (the names of the deduplicated
    stacked fields, :func:`~oakemu_core.transport.frame_stacks.stacked_fields`) and ``frame_count``
    (frames of a step message with its arrays inline: the header, one per field, one more per
    stacked field).
    """

    num_envs: int
    schema: StepSchema
    steps_per_message: int = 1

    def __post_init__(self) -> None:
        if (
            isinstance(self.num_envs, bool)
            or not isinstance(self.num_envs, (int, np.integer))
            or self.num_envs < 1
        ):
            raise ValueError(f"num_envs: expected an int >= 1, received {self.num_envs!r}")
        object.__setattr__(self, "num_envs", int(self.num_envs))
        k = self.steps_per_message
        if (
            isinstance(k, bool)
            or not isinstance(k, (int, np.integer))
            or not 1 <= k <= MAX_STEPS_PER_MESSAGE
        ):
            raise ValueError(
                f"steps_per_message: expected an int in [1, {MAX_STEPS_PER_MESSAGE}], received {k!r}"
            )
        object.__setattr__(self, "steps_per_message", int(k))
        # (field, shape, bytes, stacked) of every sent field in wire order, computed once for decode_step.
        lead = (self.num_envs,) if k == 1 else (int(k), self.num_envs)
        stacked = stacked_fields(self.schema)
        layout = tuple(
            (f, (*lead, *f.shape), math.prod(lead) * f.item_bytes, f.name in stacked)
            for f in self.schema.sent
        )
        object.__setattr__(self, "lead", lead)
        object.__setattr__(self, "stacked", stacked)
        object.__setattr__(self, "_wire_layout", layout)
        object.__setattr__(self, "_field_names", frozenset(f.name for f in self.schema.sent))
        object.__setattr__(self, "frame_count", 1 + len(layout) + len(stacked))

    def array_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Expected ``(dtype, shape)`` of every array of a :class:`StepMessage` (the schema's sent
        fields with a leading dimension n = ``num_envs``, after K when ``steps_per_message`` > 1)."""
        return {item.name: (item.dtype, shape) for item, shape, _, _ in self._wire_layout}

    def message_bytes(self) -> int:
        """Approximate encoded size of one step message in bytes in the steady state: the bytes K steps
        put on the wire (stacked frames deduplicated, :func:`~oakemu_core.transport.frame_stacks.wire_bytes_per_env`)
        + 1 KiB of keys and headers. A message with whole stacks (resets, key frames) is larger.

        Used to size socket buffers, so that the data in flight stays about one message, not MBs.
        """
        return self.steps_per_message * self.num_envs * wire_bytes_per_env(self.schema) + 1024

    def to_dict(self) -> dict[str, Any]:
        """msgpack-able form: ``num_envs``, ``steps_per_message`` and the schema's plain form."""
        return {
            "num_envs": self.num_envs,
            "steps_per_message": self.steps_per_message,
            "schema": self.schema.to_dict(),
        }

    @classmethod
    def from_dict(cls, value: Any) -> StepSpec:
        """Inverse of :meth:`to_dict` for untrusted input.

        Raises:
            MessageRejected: ``"schema"`` (not a map, missing/extra keys, wrong types, an invalid
                schema).
        """
        if not isinstance(value, dict) or value.keys() != {
            "num_envs",
            "steps_per_message",
            "schema",
        }:
            received = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            reject(
                "schema",
                f"spec: expected keys ['num_envs', 'schema', 'steps_per_message'], received {received}",
            )
        num_envs = value["num_envs"]
        if type(num_envs) is not int or not 1 <= num_envs <= MAX_ARRAY_LEN:
            reject(
                "schema",
                f"spec.num_envs: expected an int in [1, {MAX_ARRAY_LEN}], received {describe(num_envs)}",
            )
        steps = value["steps_per_message"]
        if type(steps) is not int or not 1 <= steps <= MAX_STEPS_PER_MESSAGE:
            reject(
                "schema",
                f"spec.steps_per_message: expected an int in [1, {MAX_STEPS_PER_MESSAGE}], "
                f"received {describe(steps)}",
            )
        from oakemu_core.policy.schemas import schema_from_dict  # torch only where a schema is read

        try:
            schema = schema_from_dict(value["schema"])
        except ValueError as error:
            reject("schema", f"spec.schema: {error}")
        return cls(num_envs=num_envs, schema=schema, steps_per_message=steps)


# ---------------------------------------------------------------------------------------------
# StepMessage
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepMessage:
    """Actor PUSH -> learner PULL: one env step (or a block of K consecutive steps) of all n envs
    of one actor.

    Attributes:
        actor_id, incarnation: identify the sender; must match a joined actor.
        seq: 0, 1, 2, ... per incarnation (ordering is checked by the learner).
        policy_version: version of the weights that chose the actions.
        fields: every *sent* field of the actor's step schema by name, ``(n, *shape)`` each
            (observations, actions, log_probs, values, rewards, dones, truncated,
            bootstrap_values, next_values, trainable, and e.g. action_mask, action_mean, ...;
            see :mod:`oakemu_core.step_schema`); ``(K, n, *shape)`` each when the actor's spec
            has ``steps_per_message`` K > 1 (row ``i`` is the block's i-th step, in time order).
            A stacked uint8 field received newest-frame-only is a
            :class:`~oakemu_core.transport.frame_stacks.StackedRows` of that shape: rebuilt where
            it is written (``write_into``), or by ``np.asarray``.
        episode_returns: raw (unclipped) returns of the episodes that ended on this step (on
            any step of the block, in step order).
        episode_lengths: lengths, in env steps, of those episodes (same order and length).
        revision: revision of those weights within the update running on ``policy_version``
            (:class:`~oakemu_core.transport.control.WeightsMessage`; 0 for the version's own
            weights). With K steps, the ``(policy_version, revision)`` of the oldest weights that
            acted on any of them.
        slot: None: ``fields`` travel in the message. An int: the arrays are in this slot of the
            actor's step ring (:mod:`oakemu_core.transport.step_ring`). The actor sends ``fields``
            empty; :func:`decode_step` returns in ``fields`` read-only views of the slot for the
            fields where every bit pattern is valid (uint8 frames), valid only until the learner
            releases the message (:meth:`owned` copies them), and private copies of the others.
    """

    actor_id: str
    incarnation: str
    seq: int
    policy_version: int
    fields: dict[str, np.ndarray]
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    revision: int = 0
    slot: int | None = None

    def owned(self) -> StepMessage:
        """This message with arrays that stay valid after its ring slot is released: copies of the
        read-only views of a slot (:func:`decode_step` made the other fields private copies already),
        or ``self`` when the arrays came inline (views of a frame kept alive by them)."""
        if self.slot is None:
            return self
        return replace(
            self,
            fields={
                name: array if array.flags.writeable else array.copy()
                for name, array in self.fields.items()
            },
        )

    @property
    def num_envs(self) -> int:
        """n, the envs of the sending actor."""
        return int(self.fields["dones"].shape[-1])

    @property
    def num_steps(self) -> int:
        """K, the vector steps this message carries (1 for a one-step ``(n, *shape)`` message)."""
        dones = self.fields["dones"]
        return 1 if dones.ndim == 1 else int(dones.shape[0])


class StepEncoder:
    """An actor's encoder of its step messages (:func:`encode_step`) with stacked-frame deduplication:
    it remembers the last rows it encoded, so make one per step channel (a rejoined actor starts over
    with whole stacks, as the learner expects of a new incarnation).

    Args:
        spec: the actor's step spec (the frames' order, shapes and stacked fields).
    """

    def __init__(self, spec: StepSpec) -> None:
        self.spec = spec
        self.stacks = StackEncoder()

    def encode(self, msg: StepMessage) -> list[Frame]:
        """The frames of ``msg`` (see :func:`encode_step`)."""
        return _encode(msg, self.spec, self.stacks)


def encode_step(msg: StepMessage, spec: StepSpec | None = None) -> list[Frame]:
    """The frames of a :class:`StepMessage` for the PUSH socket (``send_multipart``), every stack whole.

    Frames: the msgpack header (``bytes``), then each sent field of ``spec`` in the schema's order:
    a ``memoryview`` of the array's C-contiguous buffer (a view, no copy, unless the array is not
    C-contiguous: send it with a copy, or keep the array unchanged until sent), and for a stacked field
    its flags (``bytes``) and data (a fresh ``bytearray``; see
    :mod:`oakemu_core.transport.frame_stacks`). A message whose arrays are in a step-ring slot
    (``msg.slot`` an int) is the header alone, and needs no spec. :class:`StepEncoder` sends only the
    newest frame of a stack where it can.

    Raises:
        TypeError: an array field is not a numpy array or has another dtype than the spec's.
        ValueError: a scalar field has a bad value, episode lists differ in length, a slot message
            carries fields, a message with fields has no spec, the fields are not the spec's sent
            fields, or an array's shape is not the spec's; the message names the field.
    """
    return _encode(msg, spec, StackEncoder())


def _encode(msg: StepMessage, spec: StepSpec | None, stacks: StackEncoder) -> list[Frame]:
    check_local_id(msg.actor_id, "actor_id")
    if msg.slot is not None:
        check_local_int(msg.slot, "slot")
        if msg.fields:
            raise ValueError(
                "fields: expected none in a message whose arrays are in a step-ring slot"
            )
    elif spec is None:
        raise ValueError("spec: a step message with its arrays inline needs the actor's step spec")
    elif msg.fields.keys() != spec._field_names:
        raise ValueError(
            f"fields: expected {sorted(spec._field_names)}, received {sorted(msg.fields)}"
        )
    check_local_id(msg.incarnation, "incarnation")
    check_local_int(msg.seq, "seq")
    check_local_int(msg.policy_version, "policy_version")
    check_local_int(msg.revision, "revision")
    episode_returns = [float(r) for r in msg.episode_returns]
    episode_lengths = [int(length) for length in msg.episode_lengths]
    if len(episode_returns) != len(episode_lengths):
        raise ValueError(
            f"episode_lengths: expected {len(episode_returns)} entries (one per episode return), "
            f"received {len(episode_lengths)}"
        )
    frames: list[Frame] = [
        pack(
            {
                **header(TYPE_STEP),
                "actor_id": msg.actor_id,
                "incarnation": msg.incarnation,
                "seq": int(msg.seq),
                "policy_version": int(msg.policy_version),
                "revision": int(msg.revision),
                "slot": None if msg.slot is None else int(msg.slot),
                "episode_returns": episode_returns,
                "episode_lengths": episode_lengths,
            }
        )
    ]
    if msg.slot is not None:
        return frames
    assert spec is not None
    for item, shape, _, stacked in spec._wire_layout:
        array = msg.fields[item.name]
        if not isinstance(array, np.ndarray) or array.dtype != item.dtype:
            received = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise TypeError(
                f"{item.name}: expected a numpy array of dtype {item.dtype}, received {received}"
            )
        if array.shape != shape:
            raise ValueError(
                f"{item.name}: expected shape {list(shape)}, received {list(array.shape)}"
            )
        if stacked:
            frames.extend(stacks.encode(item, array, int(msg.seq), spec.num_envs))
        else:
            frames.append(memoryview(np.ascontiguousarray(array)).cast("B"))
    return frames


class StepRingReader(Protocol):
    """What :func:`decode_step` needs of a step ring (:class:`oakemu_core.transport.step_ring.StepRing`)."""

    slots: int
    spec: StepSpec

    def slot_fields(self, slot: int) -> dict[str, np.ndarray]: ...


def decode_step(
    frames: Sequence[Frame],
    spec_for: Callable[[str, str], StepSpec | None],
    *,
    max_bytes: int,
    ring_for: Callable[[str, str], StepRingReader | None] | None = None,
    stacks_for: Callable[[str, str, int], Mapping[str, np.ndarray] | None] | None = None,
) -> StepMessage:
    """Decode and validate one step message (its ZeroMQ frames) against the spec of its sender.

    Checks, in order: the total size; the header (framing, protocol, types); the sender is known;
    the frame count (:attr:`StepSpec.frame_count`, or the header alone for a slot message); each
    array frame's byte length (the spec's dtype itemsize x shape, or what a stacked field's flags
    declare); the contents (floats finite, bools 0/1); each field's value checks (bounds, masks that
    allow something); the rules between fields (truncated implies done, bootstrap values only on
    truncated rows, the action taken is allowed by its mask;
    :func:`oakemu_core.step_schema.check_step_consistency`); the episode lists (at most K * n
    episodes). A block of K steps is checked whole, every check vectorised over its K x n rows: one bad
    row rejects the whole message. A message whose arrays are in a step-ring slot (``"slot"`` an
    int: :mod:`oakemu_core.transport.step_ring`) is checked the same way on the slot's arrays; their
    dtypes and shapes are the ring's layout, made from the same spec.

    Args:
        frames: the message's ZeroMQ frames (bytes-like: ``zmq.Frame.buffer`` views), header first.
        spec_for: ``(actor_id, incarnation) -> StepSpec`` of a joined actor, or None if unknown.
        max_bytes: messages whose frames total more than this are rejected before any decoding.
        ring_for: ``(actor_id, incarnation) ->`` that actor's step ring, or None (no ring; also
            the default): then a slot message is rejected.
        stacks_for: ``(actor_id, incarnation, seq) ->`` the last rows of every stacked field of that
            incarnation's message ``seq - 1`` (:meth:`~oakemu_core.transport.frame_stacks.StackHistories.previous`),
            or None (also the default): then a row sent as its newest frame only is rejected.

    Returns:
        A :class:`StepMessage` whose arrays have exactly the dtypes and shapes of
        :meth:`StepSpec.array_layout`: read-only ``np.frombuffer`` views of the frames,
        :class:`~oakemu_core.transport.frame_stacks.StackedRows` of deduplicated stacks (private
        read-only arrays where their values need a check); from a ring slot, read-only views of it for the fields
        without a content check (:attr:`~oakemu_core.step_schema.StepField.any_bits_valid`) and checked
        private copies of the others (what is checked is what is written: the slot stays writable by
        the actor).

    Raises:
        MessageRejected: ``"oversized"``, ``"garbage"``, ``"protocol"``, ``"schema"`` (wrong type,
            missing / extra / wrong-typed header field, missing or extra frames, NaN or inf in a float
            array or episode return, bool bytes other than 0 / 1, more finished episodes than envs, a
            slot message from an actor without a ring or with another slot than ``seq % slots``,
            array frames after a slot message, a newest-frame-only row with no stack to rebuild
            from), ``"unknown_actor"``, ``"size"`` (a frame's length is not the agreed one; detail
            names the field, expected and received bytes), ``"value_range"`` (impossible values,
            named). Once the header is read, the error's ``sender`` names ``(actor_id, incarnation, seq)``.
        TypeError: a frame is not a bytes-like object (a caller bug, not wire input).
    """
    views, obj = _header(frames, max_bytes)
    actor_id = get_str(obj, "actor_id")
    incarnation = get_str(obj, "incarnation")
    seq = get_int(obj, "seq")
    policy_version = get_int(obj, "policy_version")
    revision = get_int(obj, "revision")
    try:  # a rejection from here on names its sender: the learner releases a rejected ring slot
        spec = _sender_spec(spec_for, actor_id, incarnation)
        arrays = _message_arrays(
            views, obj, spec, (actor_id, incarnation, seq), ring_for=ring_for, stacks_for=stacks_for
        )
        episode_returns, episode_lengths = _checked_fields(obj, arrays, spec)
    except MessageRejected as error:
        error.sender = (actor_id, incarnation, seq)
        raise
    return StepMessage(
        actor_id=actor_id,
        incarnation=incarnation,
        seq=seq,
        policy_version=policy_version,
        fields=arrays,
        episode_returns=episode_returns,
        episode_lengths=episode_lengths,
        revision=revision,
        slot=obj["slot"],
    )


def _sender_spec(
    spec_for: Callable[[str, str], StepSpec | None], actor_id: str, incarnation: str
) -> StepSpec:
    """The spec of a joined sender; ``MessageRejected("unknown_actor")`` for any other."""
    spec = spec_for(actor_id, incarnation)
    if spec is None:
        reject(
            "unknown_actor",
            f"actor_id={actor_id!r} incarnation={incarnation!r} has not joined (or was dropped)",
        )
    return spec


def _message_arrays(
    views: list[memoryview],
    obj: dict[str, Any],
    spec: StepSpec,
    sender: tuple[str, str, int],
    *,
    ring_for: Callable[[str, str], StepRingReader | None] | None,
    stacks_for: Callable[[str, str, int], Mapping[str, np.ndarray] | None] | None,
) -> dict[str, np.ndarray]:
    """The step arrays of a message whose header ``obj`` was read, from its array frames (``views``
    after the header) or from its sender's step-ring slot, sized and typed as ``spec`` says (their
    contents are not checked yet: :func:`_checked_fields`).

    Raises:
        MessageRejected: ``"schema"`` or ``"size"`` (see :func:`decode_step`).
    """
    actor_id, incarnation, seq = sender
    if obj["slot"] is None:
        previous = (
            stacks_for(actor_id, incarnation, seq)
            if stacks_for is not None and spec.stacked
            else None
        )
        return _frame_arrays(views, spec, previous)
    if len(views) != 1:
        reject(
            "schema",
            f"frames: expected the header alone in a slot message, received {len(views)} frames",
        )
    ring = ring_for(actor_id, incarnation) if ring_for else None
    return _slot_arrays(_slot_fields(obj["slot"], seq, ring, spec), spec)


def _header(frames: Sequence[Frame], max_bytes: int) -> tuple[list[memoryview], dict[str, Any]]:
    """Views of the frames and the header's map, after the total size, framing, protocol and keys."""
    if not frames:
        reject("garbage", "expected a multipart step message, received no frame")
    try:
        views = [memoryview(frame) for frame in frames]
    except TypeError:
        raise TypeError("frames: expected bytes, bytearray or memoryview frames") from None
    size = sum(view.nbytes for view in views)
    if size > max_bytes:
        reject(
            "oversized",
            f"message is {size} bytes in {len(views)} frames, limit max_bytes={max_bytes}",
        )
    obj, message_type = unpack(views[0], max_bytes)
    if message_type != TYPE_STEP:
        reject("schema", f"type: expected {TYPE_STEP!r}, received {describe(message_type)}")
    require_fields(obj, _STEP_FIELDS)
    return views, obj


def _frame_arrays(
    views: list[memoryview], spec: StepSpec, previous: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The arrays of an inline message's frames (after the header), lengths and contents checked."""
    if len(views) != spec.frame_count:
        reject(
            "schema",
            f"frames: expected {spec.frame_count} (the header, one per sent field and one more per "
            f"stacked field), received {len(views)}",
        )
    arrays: dict[str, np.ndarray] = {}
    index = 1
    for item, shape, nbytes, stacked in spec._wire_layout:
        name = item.name
        if (
            stacked
        ):  # rebuilt where written, unless its values need a check (bounds tighter than uint8's)
            rebuild = decode_stacks if item.any_bits_valid else rebuild_stacks
            arrays[name] = rebuild(
                item,
                views[index],
                views[index + 1],
                spec.lead,
                None if previous is None else previous[name],
            )
            index += 2
            continue
        view = views[index]
        index += 1
        if view.nbytes != nbytes:
            reject(
                "size",
                f"{name}: expected {nbytes} bytes ({item.dtype.str} x {list(shape)}), received {view.nbytes}",
            )
        array = np.frombuffer(view, dtype=item.dtype).reshape(shape)
        if array.flags.writeable:
            array.flags.writeable = False
        arrays[name] = array if item.any_bits_valid else checked_contents(array, None, name)
    return arrays


def _slot_arrays(in_ring: dict[str, np.ndarray], spec: StepSpec) -> dict[str, np.ndarray]:
    """The arrays of a slot message: frames in place, checked fields as checked private copies."""
    return {
        item.name: in_ring[item.name]
        if item.any_bits_valid  # no content check (uint8 frames): in place
        else checked_contents(in_ring[item.name].copy(), None, item.name)  # checked what is written
        for item, _, _, _ in spec._wire_layout
    }


def _checked_fields(
    obj: dict[str, Any], arrays: dict[str, np.ndarray], spec: StepSpec
) -> tuple[list[float], list[int]]:
    """The value checks of every field, the rules between fields and the episode lists."""
    rows: dict[
        str, np.ndarray
    ] = {}  # (K * n, *shape) views: the value checks see one batch of rows
    for item, _, _, _ in spec._wire_layout:
        array = arrays[item.name]
        if isinstance(
            array, StackedRows
        ):  # uint8 frames without bounds to check: any bit pattern is valid
            continue
        flat = array if spec.steps_per_message == 1 else array.reshape(-1, *item.shape)
        problem = item.check_values(flat)
        if problem is not None:
            reject("value_range", problem)
        rows[item.name] = flat
    problem = check_step_consistency(spec.schema, rows)
    if problem is not None:
        reject("value_range", problem)

    returns, lengths = obj["episode_returns"], obj["episode_lengths"]
    if (
        not isinstance(returns, list)
        or not isinstance(lengths, list)
        or len(returns) != len(lengths)
    ):
        reject("schema", "episode_returns / episode_lengths: expected two lists of equal length")
    if len(returns) > spec.num_envs * spec.steps_per_message:
        reject(
            "schema",
            f"episode_returns: expected at most {spec.num_envs} episodes per step x "
            f"{spec.steps_per_message} steps, received {len(returns)}",
        )
    episode_returns = [finite_float(r, "episode_returns") for r in returns]
    if any(abs(r) > MAX_ABS_EPISODE_RETURN for r in episode_returns):
        reject("value_range", f"episode_returns: expected |x| <= {MAX_ABS_EPISODE_RETURN:g}")
    for length in lengths:
        if type(length) is not int or not 0 <= length <= INT64_MAX:
            reject(
                "schema",
                f"episode_lengths: expected non-negative ints, received {describe(length)}",
            )
    return episode_returns, list(lengths)


def _slot_fields(
    slot: Any, seq: int, ring: StepRingReader | None, spec: StepSpec
) -> dict[str, np.ndarray]:
    """The arrays of a slot message (checks the slot against the ring), else rejects it."""
    if ring is None:
        reject("schema", "slot: this actor has no step ring (send the fields inline)")
    if (
        type(slot) is not int
        or slot != seq % ring.slots
        or (ring.spec is not spec and ring.spec != spec)
    ):
        reject(
            "schema",
            f"slot: expected seq % {ring.slots} = {seq % ring.slots} of this actor's ring, "
            f"received {describe(slot)}",
        )
    return ring.slot_fields(slot)
