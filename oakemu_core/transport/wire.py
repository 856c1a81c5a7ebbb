"""Wire protocol between actors and the learner: message schemas, msgpack codec, validation.

Every message is one msgpack map with ``"protocol"`` (= :data:`PROTOCOL_VERSION`) and ``"type"``;
messages an actor sends also carry ``"actor_id"`` and ``"incarnation"`` (a fresh id on every actor
start), and heartbeats / steps a ``"seq"`` (0, 1, 2, ... per incarnation) and the
``"policy_version"`` that produced them (steps also the ``"revision"`` of those weights within an
update).  Arrays travel as a map ::

    {"dtype": np.dtype.str (with byte order, e.g. "<f4", "|u1", "|b1", "<i8"),
     "shape": [int, ...],
     "data": C-contiguous bytes (msgpack bin)}

There is no pickle anywhere: only bool / signed int / unsigned int / float dtypes of 1, 2, 4 or 8
bytes are accepted (no object, void, string, datetime or complex kinds), and every frame is
unpacked with msgpack limits bounded by the frame length, so a declared size never causes an
allocation.

Untrusted input (anything coming off a socket) is decoded with :func:`decode_step` (trajectory
data, validated against the :class:`StepSpec` agreed at join time) or :func:`decode_message`
(control and weights messages).  Both raise only :class:`MessageRejected`, whose ``reason`` is
one of :data:`REJECTION_REASONS`, so the learner can count rejections by reason.  Ordering of
``seq`` is checked by the learner (``ingest.py``), not here.

Message types (``"type"`` tag: dataclass, direction, encoder):

- ``join``: :class:`JoinRequest`, actor REQ -> learner ROUTER, :func:`encode_join_request`
- ``join_reply``: :class:`JoinReply`, learner ROUTER -> actor REQ, :func:`encode_join_reply`
- ``heartbeat``: :class:`Heartbeat`, actor REQ -> learner ROUTER, :func:`encode_heartbeat`
- ``heartbeat_reply``: :class:`HeartbeatReply`, learner ROUTER -> actor REQ, :func:`encode_heartbeat_reply`
- ``leave``: :class:`Leave`, actor REQ -> learner ROUTER, :func:`encode_leave`
- ``weights``: :class:`WeightsMessage`, learner PUB -> actor SUB, :func:`encode_weights`
- ``stop``: :class:`StopNotice`, learner PUB -> actor SUB, :func:`encode_stop`
- ``step``: :class:`StepMessage`, actor PUSH -> learner PULL, :func:`encode_step`

Dtype strings from the wire are looked up in a fixed table of allowed canonical spellings and are
never handed to ``np.dtype`` (which would parse structured, object or subarray dtypes).

Copies: :func:`encode_step` hands msgpack each C-contiguous array's own buffer
(``ndarray.data``); msgpack copies it once into its (per-thread, reused) buffer and once more
into the returned ``bytes``.  :func:`decode_step` returns read-only ``np.frombuffer`` views of
the ``bytes`` objects msgpack unpacks (msgpack's one copy out of the frame; no further copy).
A step message of an actor with a step ring carries ``"slot"`` and an empty ``"fields"`` map: its
arrays are in that slot of the ring (:mod:`oakemu_core.transport.step_ring`), and :func:`decode_step` reads
them from there (frames in place, the checked fields as private copies).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, Protocol

import msgpack
import numpy as np

from oakemu_core.shared_memory import SEGMENT_PREFIX
from oakemu_core.step_schema import WIRE_DTYPES, StepField, StepSchema, check_step_consistency

__all__ = [
    "PROTOCOL_VERSION",
    "REJECTION_REASONS",
    "ALLOWED_DTYPE_KINDS",
    "HEARTBEAT_STATUSES",
    "MessageRejected",
    "StepSpec",
    "MAX_STEPS_PER_MESSAGE",
    "auto_steps_per_message",
    "JoinRequest",
    "JoinReply",
    "StepRingOffer",
    "MAX_RING_SLOTS",
    "Heartbeat",
    "HeartbeatReply",
    "Leave",
    "WeightsMessage",
    "StopNotice",
    "StepMessage",
    "ControlMessage",
    "encode_join_request",
    "encode_join_reply",
    "encode_heartbeat",
    "encode_heartbeat_reply",
    "encode_leave",
    "encode_weights",
    "encode_stop",
    "encode_step",
    "decode_message",
    "decode_step",
]

PROTOCOL_VERSION = 8
"""Version of this wire format; a frame with any other ``"protocol"`` value is rejected.
Version 2: step messages carry a ``"fields"`` map keyed by the step schema's field names, and
the join reply carries the schema itself. Version 3: the join reply's spec carries
``steps_per_message`` K; a step message of a spec with K > 1 carries K consecutive vector steps
(every field ``(K, n, *shape)``, the episodes of all K steps in step order). Version 4: a weights
message carries ``"revision"`` (weights published after an epoch, within an update). Version 5: a
step message carries the ``"revision"`` of the weights that acted, next to their version. Version 6:
a join request carries the actor's ``"host_id"``, a join reply may offer a ``"step_ring"``, and a step
message carries ``"slot"``: its arrays are in that slot of the actor's step ring (``"fields"`` is
then empty; :mod:`oakemu_core.transport.step_ring`), or nil for arrays inline. Version 7: a join request
carries the ``"inference_precision"`` of the actor's forward passes (``INFERENCE_PRECISIONS``).
Version 8: the learner announces the end of a run on the weights channel (``"stop"``)."""

INFERENCE_PRECISIONS = ("float32", "bfloat16")
"""Precisions of an actor's forward passes a join request may name: float32 (torch, ONNX Runtime) or
bfloat16 (``actor_inference = "bfloat16"``; the learner then re-evaluates every rollout in float32)."""

REJECTION_REASONS = (
    "oversized",
    "garbage",
    "protocol",
    "schema",
    "unknown_actor",
    "dtype",
    "shape",
    "size",
    "value_range",
)
"""The fixed set of :attr:`MessageRejected.reason` values (stable names for counters / logs)."""

ALLOWED_DTYPE_KINDS = frozenset("biuf")
"""numpy dtype kinds allowed on the wire: bool, signed int, unsigned int, float."""

HEARTBEAT_STATUSES = ("ok", "rejoin", "stop")
"""Allowed :attr:`HeartbeatReply.status` values."""

MAX_ID_LENGTH = 128
"""Longest ``actor_id`` / ``incarnation`` / weight name / config key, in characters."""

MAX_TEXT_LENGTH = 4096
"""Longest free-text string (hostname, reason, config string value), in characters."""

MAX_NDIM = 32
"""Most dimensions an array on the wire may declare (numpy itself allows 64)."""

_MAX_MAP_LEN = 4096  # weights dicts hold tens of tensors; every other map is tiny
_MAX_ARRAY_LEN = 65536  # shapes (<= MAX_NDIM) and per-message episode lists (<= K * num_envs)
MAX_STEPS_PER_MESSAGE = 1024
"""Largest ``steps_per_message`` K a spec may declare."""
MAX_RING_SLOTS = 64
"""Most slots a join reply's step ring may have (:func:`oakemu_core.transport.step_ring.ring_slots` gives 1-16)."""
_INT64_MAX = 2**63 - 1
_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})

TYPE_JOIN = "join"
TYPE_JOIN_REPLY = "join_reply"
TYPE_HEARTBEAT = "heartbeat"
TYPE_HEARTBEAT_REPLY = "heartbeat_reply"
TYPE_LEAVE = "leave"
TYPE_WEIGHTS = "weights"
TYPE_STOP = "stop"
TYPE_STEP = "step"


class MessageRejected(Exception):
    """A frame from the wire failed validation; it must not reach the rollout buffer.

    Attributes:
        reason: short machine-readable cause, one of :data:`REJECTION_REASONS`:
            ``"oversized"`` (frame longer than ``max_bytes``, checked before decoding),
            ``"garbage"`` (not a single valid msgpack object within the limits),
            ``"protocol"`` (missing or different ``"protocol"`` version),
            ``"schema"`` (wrong message type, missing / extra / wrong-typed field, non-finite
            float, inconsistent flags), ``"unknown_actor"`` (``(actor_id, incarnation)`` never
            joined or was dropped), ``"dtype"`` (array dtype not allowed or not the agreed one),
            ``"shape"`` (array shape not the agreed one), ``"size"`` (declared shape disagrees
            with the number of data bytes), ``"value_range"`` (finite but impossible values: an
            action out of range, a mask that allows nothing, an action its mask forbids, a huge
            reward, a bootstrap value on a row that was not truncated, ...).
        detail: human-readable text naming the field, the expected and the received value.
        sender: ``(actor_id, incarnation, seq)`` of a step message rejected after its header was
            read (:func:`decode_step`), else None.
    """

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECTION_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.sender: tuple[str, str, int] | None = None


def _reject(reason: str, detail: str) -> NoReturn:
    raise MessageRejected(reason, detail)


# ---------------------------------------------------------------------------------------------
# dtype / shape helpers (local values: TypeError / ValueError; wire values: MessageRejected)
# ---------------------------------------------------------------------------------------------


_WIRE_DTYPES = WIRE_DTYPES
_WIRE_DTYPE_STRS = {dtype: text for text, dtype in _WIRE_DTYPES.items()}  # dtype -> canonical str


def _wire_dtype(value: Any, name: str) -> np.dtype:
    """Look a dtype string from the wire up in the allowlist; nothing else is ever parsed.

    Only canonical spellings pass (``|u1`` not ``<u1``, ``|b1`` not ``?``), so a dtype string
    compares equal exactly when the dtype (byte order included) does.
    """
    if not isinstance(value, str):
        _reject("schema", f"{name}.dtype: expected str, received {type(value).__name__}")
    dtype = _WIRE_DTYPES.get(value)
    if dtype is None:
        _reject(
            "dtype",
            f"{name}.dtype: expected a bool/int/uint/float dtype string with byte order "
            f"(one of {sorted(_WIRE_DTYPES)}), received {value[:32]!r}",
        )
    return dtype


def _wire_shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        _reject("schema", f"{name}.shape: expected a list of at most {MAX_NDIM} ints, received {_describe(value)}")
    for d in value:
        if type(d) is not int or d < 0:
            _reject("schema", f"{name}.shape: expected non-negative ints, received {_describe(value)}")
    return tuple(value)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------------------------


def _encode_array(array: Any, name: str) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` for one array.

    ``data`` is the array's own buffer (``ndarray.data``, a memoryview: msgpack reads it as a
    flat C-order byte string), not a copy, unless ``array`` is not C-contiguous (then one
    contiguous copy is made).

    Raises:
        TypeError: ``array`` is not a numpy array or its dtype is not allowed on the wire.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name}: expected numpy.ndarray, received {type(array).__name__}")
    dtype_str = _WIRE_DTYPE_STRS.get(array.dtype)
    if dtype_str is None:
        raise TypeError(
            f"{name}: expected a bool/int/uint/float dtype of 1, 2, 4 or 8 bytes, received {array.dtype.str!r}"
        )
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return {"dtype": dtype_str, "shape": list(array.shape), "data": array.data}


def _decode_array(value: Any, name: str) -> np.ndarray:
    """Validate one wire array map and return a read-only ``np.frombuffer`` view of its bytes.

    Order of checks: structure ("schema"), dtype allowlist ("dtype"), shape entries ("schema"),
    byte count = prod(shape) * itemsize computed with Python ints ("size"), bool bytes in {0, 1}
    and float values finite ("schema").
    """
    if not isinstance(value, dict) or value.keys() != _ARRAY_KEYS:
        keys = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        _reject("schema", f"{name}: expected an array map with keys ['data', 'dtype', 'shape'], received {keys}")
    dtype = _wire_dtype(value["dtype"], name)
    shape = _wire_shape(value["shape"], name)
    data = value["data"]
    if not isinstance(data, bytes):
        _reject("schema", f"{name}.data: expected bin bytes, received {type(data).__name__}")
    declared = math.prod(shape) * dtype.itemsize  # Python ints: no overflow, no allocation
    if declared != len(data):
        _reject(
            "size",
            f"{name}: shape {list(shape)[:MAX_NDIM]} x {dtype.str} declares {declared} bytes, "
            f"received {len(data)} bytes of data",
        )
    return _checked_contents(np.frombuffer(data, dtype=dtype).reshape(shape), data, name)


def _checked_contents(array: np.ndarray, data: bytes | None, name: str) -> np.ndarray:
    """``array`` (a view of ``data``; of shared memory when ``data`` is None) after the content
    checks: bool bytes in {0, 1}, floats finite."""
    kind = array.dtype.kind
    if kind == "b" and (array.tobytes() if data is None else data).translate(None, b"\x00\x01"):
        _reject("schema", f"{name}: bool array holds bytes other than 0 and 1")
    if kind == "f" and not _all_finite(array):
        _reject("schema", f"{name}: expected finite values, received NaN or inf")
    return array


def _all_finite(array: np.ndarray) -> bool:
    """Whether every element is finite; plain Python for small arrays, where a numpy ufunc
    call costs more than the loop (a step message has five ``(n,)`` float fields)."""
    if array.size <= 64:
        return all(map(math.isfinite, array.reshape(-1).tolist()))
    return bool(np.isfinite(array).all())


def _encode_weights(weights: Mapping[str, np.ndarray], name: str) -> dict[str, Any]:
    if not isinstance(weights, Mapping):
        raise TypeError(f"{name}: expected a mapping str -> numpy.ndarray, received {type(weights).__name__}")
    out: dict[str, Any] = {}
    for key, array in weights.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            raise TypeError(f"{name}: expected non-empty str keys of at most {MAX_ID_LENGTH} chars, received {key!r}")
        out[key] = _encode_array(array, f"{name}[{key!r}]")
    return out


def _decode_weights(value: Any, name: str) -> dict[str, np.ndarray]:
    if not isinstance(value, dict):
        _reject("schema", f"{name}: expected a map str -> array, received {type(value).__name__}")
    weights: dict[str, np.ndarray] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            _reject("schema", f"{name}: expected non-empty str keys of at most {MAX_ID_LENGTH} chars, received {_describe(key)}")
        weights[key] = _decode_array(item, f"{name}[{key!r}]")
    return weights


# ---------------------------------------------------------------------------------------------
# scalar fields
# ---------------------------------------------------------------------------------------------


def _get_str(obj: dict, key: str, *, max_len: int = MAX_ID_LENGTH, allow_empty: bool = False) -> str:
    value = obj[key]
    if not isinstance(value, str) or len(value) > max_len or (not value and not allow_empty):
        _reject(
            "schema",
            f"{key}: expected a {'' if allow_empty else 'non-empty '}str of at most {max_len} chars, "
            f"received {_describe(value)}",
        )
    return value


def _get_int(obj: dict, key: str, *, minimum: int = 0) -> int:
    value = obj[key]
    if type(value) is not int or not minimum <= value <= _INT64_MAX:
        _reject("schema", f"{key}: expected an int in [{minimum}, 2**63-1], received {_describe(value)}")
    return value


def _get_bool(obj: dict, key: str) -> bool:
    value = obj[key]
    if type(value) is not bool:
        _reject("schema", f"{key}: expected a bool, received {_describe(value)}")
    return value


def _finite_float(value: Any, key: str) -> float:
    if type(value) not in (float, int) or not math.isfinite(value):
        _reject("schema", f"{key}: expected a finite float, received {_describe(value)}")
    return float(value)


def _get_float(obj: dict, key: str) -> float:
    return _finite_float(obj[key], key)


def _check_local_id(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{name}: expected a non-empty str of at most {MAX_ID_LENGTH} chars, received {value!r}")


def _check_local_int(value: Any, name: str, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= _INT64_MAX:
        raise ValueError(f"{name}: expected an int in [{minimum}, 2**63-1], received {value!r}")


_SCALAR_TYPES = (type(None), bool, int, float, str)


def _encode_env_config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"env_config: expected a mapping str -> scalar, received {type(config).__name__}")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            raise TypeError(f"env_config: expected non-empty str keys, received {key!r}")
        if not isinstance(value, _SCALAR_TYPES):
            raise TypeError(
                f"env_config[{key!r}]: expected None, bool, int, float or str, received {type(value).__name__}"
            )
        out[key] = value
    return out


def _decode_env_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        _reject("schema", f"env_config: expected a map, received {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            _reject("schema", f"env_config: expected non-empty str keys, received {_describe(key)}")
        if type(item) not in _SCALAR_TYPES:
            _reject("schema", f"env_config[{key!r}]: expected None, bool, int, float or str, received {type(item).__name__}")
        if type(item) is float and not math.isfinite(item):
            _reject("schema", f"env_config[{key!r}]: expected a finite float, received {item!r}")
        if type(item) is str and len(item) > MAX_TEXT_LENGTH:
            _reject("schema", f"env_config[{key!r}]: string longer than {MAX_TEXT_LENGTH} chars")
    return value


# ---------------------------------------------------------------------------------------------
# framing
# ---------------------------------------------------------------------------------------------


_PACKERS = threading.local()


def _pack(message: dict[str, Any]) -> bytes:
    """msgpack bytes of ``message`` with a per-thread reused ``msgpack.Packer``.

    ``msgpack.packb`` allocates a fresh 1 MiB buffer on every call, which costs about 0.3 ms per
    Atari step message here; a reused packer keeps its buffer (Packer objects are not thread-safe,
    hence one per thread).
    """
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    try:
        return packer.pack(message)
    except BaseException:
        _PACKERS.packer = None  # a failed pack may leave partial data in the buffer
        raise


def _header(message_type: str) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "type": message_type}


def _unpack(frame: bytes | bytearray | memoryview, max_bytes: int) -> tuple[dict[str, Any], str]:
    """Size check, msgpack decode with bounded limits, protocol check; returns (map, type)."""
    try:
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
    except TypeError:
        raise TypeError(f"frame: expected bytes, bytearray or memoryview, received {type(frame).__name__}") from None
    if size > max_bytes:
        _reject("oversized", f"frame is {size} bytes, limit max_bytes={max_bytes}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=size,
            max_str_len=min(size, 4 * MAX_TEXT_LENGTH),  # bytes: up to 4 per UTF-8 char
            max_array_len=min(size, _MAX_ARRAY_LEN),
            max_map_len=min(size, _MAX_MAP_LEN),
            max_ext_len=0,
        )
    except Exception as error:  # msgpack raises ValueError subclasses, TypeError, ...: all garbage
        _reject("garbage", f"not a valid msgpack frame ({type(error).__name__}: {_describe(str(error))})")
    if not isinstance(obj, dict):
        _reject("schema", f"expected a msgpack map at top level, received {type(obj).__name__}")
    version = obj.get("protocol")
    if type(version) is not int or version != PROTOCOL_VERSION:
        _reject("protocol", f"protocol: expected {PROTOCOL_VERSION}, received {_describe(version)}")
    message_type = obj.get("type")
    if not isinstance(message_type, str):
        _reject("schema", f"type: expected a str, received {_describe(message_type)}")
    return obj, message_type


def _require_fields(obj: dict[str, Any], fields: tuple[str, ...]) -> None:
    expected = {"protocol", "type", *fields}
    received = obj.keys()
    if received != expected:
        missing = sorted(expected - received)
        extra = sorted(map(str, received - expected))
        _reject("schema", f"{obj['type']} message: missing fields {missing}, extra fields {extra}")


# ---------------------------------------------------------------------------------------------
# control messages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinRequest:
    """Actor -> learner (control socket): ask for env columns, the spec and current weights.

    Attributes:
        actor_id: stable name of the actor (e.g. ``"actor-0"``).
        incarnation: id unique to this start of the actor process (e.g. ``uuid4().hex``).
        num_envs: number of envs the actor steps (= columns it asks for).
        hostname: where the actor runs (diagnostics only).
        host_id: the actor's shared-memory host id (:func:`oakemu_core.transport.step_ring.shared_memory_host_id`) when it
            can take a step ring, ``""`` when it sends its arrays inline only.
        inference_precision: precision of the actor's forward passes, one of :data:`INFERENCE_PRECISIONS`:
            its log-probs and values are those of the learner's weights rounded to it.
    """

    actor_id: str
    incarnation: str
    num_envs: int
    hostname: str
    host_id: str = ""
    inference_precision: str = "float32"


@dataclass(frozen=True)
class StepRingOffer:
    """A step ring the learner made for one actor (:mod:`oakemu_core.transport.step_ring`).

    Attributes:
        name: shared-memory segment name (``oakemu_<pid>_<token>_stepring``).
        token: 16 hex digits written in the ring's header; the actor checks them after attaching.
        slots: message slots of the ring.
    """

    name: str
    token: str
    slots: int


@dataclass(frozen=True, eq=False)
class JoinReply:
    """Learner -> actor: accept (with spec, env config and current weights) or refuse a join.

    Attributes:
        accepted: whether the actor may start stepping.
        reason: why the join was refused ("" when accepted).
        actor_index: index the learner gave this actor (used e.g. for seeding); -1 when refused.
        spec: the :class:`StepSpec` every step message must follow; None when refused.
        env_config: scalars the actor builds its envs from (``env_id``, ``max_episode_steps``,
            ``clip_rewards``, ``seed``, ...); values are None, bool, int, float or str.
        policy_version: version of ``weights``.
        weights: parameter name -> array (model ``state_dict`` as numpy); empty when refused.
        step_ring: a shared-memory ring for the actor's step arrays, or None (send them inline).
    """

    accepted: bool
    reason: str
    actor_index: int
    spec: StepSpec | None
    env_config: dict[str, Any]
    policy_version: int
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    step_ring: StepRingOffer | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Actor -> learner (control socket), periodically: liveness plus actor-side figures.

    Attributes:
        actor_id, incarnation: as in :class:`JoinRequest`.
        seq: seq of the next step message this incarnation will send (= step messages sent so far).
        policy_version: version of the weights the actor acts with now.
        env_steps_per_second: the actor's env steps per second (all its envs), finite, >= 0.
        policy_lag: learner version minus acting version as last seen by the actor, in versions.
        episodes: episodes finished by this incarnation so far.
    """

    actor_id: str
    incarnation: str
    seq: int
    policy_version: int
    env_steps_per_second: float
    policy_lag: float
    episodes: int


@dataclass(frozen=True)
class HeartbeatReply:
    """Learner -> actor: ``"ok"``, ``"rejoin"`` (learner forgot this incarnation: join again) or
    ``"stop"`` (shut down), plus the learner's current policy version."""

    status: str
    policy_version: int


@dataclass(frozen=True)
class Leave:
    """Actor -> learner: the actor is stopping; its incomplete segment may be discarded now."""

    actor_id: str
    incarnation: str


@dataclass(frozen=True, eq=False)
class WeightsMessage:
    """Learner PUB -> actors: new weights. ``weights``: parameter name -> array, in model order.

    ``revision``: 0 for the weights an update ends with (the new ``policy_version``); 1, 2, ... for
    the weights after each epoch of the update still running on ``policy_version`` (asynchronous
    mode, ``publish_every_epoch``). An actor loads weights whose ``(policy_version, revision)`` is
    newer than its own; the rows it acts keep ``policy_version``."""

    policy_version: int
    weights: dict[str, np.ndarray]
    revision: int = 0


@dataclass(frozen=True)
class StopNotice:
    """Learner PUB -> actors: the run is over (``reason``: why, for the actors' logs). Actors stop at
    once instead of at their next heartbeat, whose reply says the same up to a second later."""

    reason: str


ControlMessage = JoinRequest | JoinReply | Heartbeat | HeartbeatReply | Leave | WeightsMessage | StopNotice


def encode_join_request(msg: JoinRequest) -> bytes:
    """Serialise a :class:`JoinRequest`. Raises ValueError naming a field with a bad value."""
    _check_local_id(msg.actor_id, "actor_id")
    _check_local_id(msg.incarnation, "incarnation")
    _check_local_int(msg.num_envs, "num_envs", minimum=1)
    if msg.inference_precision not in INFERENCE_PRECISIONS:
        raise ValueError(f"inference_precision: expected one of {INFERENCE_PRECISIONS}, received "
                         f"{msg.inference_precision!r}")
    return _pack(
        {
            **_header(TYPE_JOIN),
            "actor_id": msg.actor_id,
            "incarnation": msg.incarnation,
            "num_envs": int(msg.num_envs),
            "hostname": str(msg.hostname),
            "host_id": str(msg.host_id),
            "inference_precision": msg.inference_precision,
        }
    )


def encode_join_reply(msg: JoinReply) -> bytes:
    """Serialise a :class:`JoinReply`; weights travel as wire arrays (no copy before msgpack).

    Raises:
        TypeError / ValueError: a field has the wrong type (e.g. object-dtype weight, non-scalar
            config value); the message names the field.
    """
    _check_local_int(msg.actor_index, "actor_index", minimum=-1)
    _check_local_int(msg.policy_version, "policy_version")
    return _pack(
        {
            **_header(TYPE_JOIN_REPLY),
            "accepted": bool(msg.accepted),
            "reason": str(msg.reason),
            "actor_index": int(msg.actor_index),
            "spec": None if msg.spec is None else msg.spec.to_dict(),
            "env_config": _encode_env_config(msg.env_config),
            "policy_version": int(msg.policy_version),
            "weights": _encode_weights(msg.weights, "weights"),
            "step_ring": None if msg.step_ring is None else {
                "name": msg.step_ring.name, "token": msg.step_ring.token, "slots": int(msg.step_ring.slots)},
        }
    )


def encode_heartbeat(msg: Heartbeat) -> bytes:
    """Serialise a :class:`Heartbeat`. Raises ValueError naming a field with a bad value."""
    _check_local_id(msg.actor_id, "actor_id")
    _check_local_id(msg.incarnation, "incarnation")
    _check_local_int(msg.seq, "seq")
    _check_local_int(msg.policy_version, "policy_version")
    _check_local_int(msg.episodes, "episodes")
    return _pack(
        {
            **_header(TYPE_HEARTBEAT),
            "actor_id": msg.actor_id,
            "incarnation": msg.incarnation,
            "seq": int(msg.seq),
            "policy_version": int(msg.policy_version),
            "env_steps_per_second": float(msg.env_steps_per_second),
            "policy_lag": float(msg.policy_lag),
            "episodes": int(msg.episodes),
        }
    )


def encode_heartbeat_reply(msg: HeartbeatReply) -> bytes:
    """Serialise a :class:`HeartbeatReply`. Raises ValueError for an unknown ``status``."""
    if msg.status not in HEARTBEAT_STATUSES:
        raise ValueError(f"status: expected one of {HEARTBEAT_STATUSES}, received {msg.status!r}")
    _check_local_int(msg.policy_version, "policy_version")
    return _pack({**_header(TYPE_HEARTBEAT_REPLY), "status": msg.status, "policy_version": int(msg.policy_version)})


def encode_leave(msg: Leave) -> bytes:
    """Serialise a :class:`Leave`. Raises ValueError naming a field with a bad value."""
    _check_local_id(msg.actor_id, "actor_id")
    _check_local_id(msg.incarnation, "incarnation")
    return _pack({**_header(TYPE_LEAVE), "actor_id": msg.actor_id, "incarnation": msg.incarnation})


def encode_weights(msg: WeightsMessage) -> bytes:
    """Serialise a :class:`WeightsMessage` (arrays passed to msgpack as memoryviews)."""
    _check_local_int(msg.policy_version, "policy_version")
    _check_local_int(msg.revision, "revision")
    return _pack(
        {
            **_header(TYPE_WEIGHTS),
            "policy_version": int(msg.policy_version),
            "revision": int(msg.revision),
            "weights": _encode_weights(msg.weights, "weights"),
        }
    )


def encode_stop(msg: StopNotice) -> bytes:
    """Serialise a :class:`StopNotice`. Raises ValueError for a reason that is not short text."""
    if not isinstance(msg.reason, str) or len(msg.reason) > MAX_TEXT_LENGTH:
        raise ValueError(f"reason: expected a str of at most {MAX_TEXT_LENGTH} characters")
    return _pack({**_header(TYPE_STOP), "reason": msg.reason})


def _decode_join(obj: dict[str, Any]) -> JoinRequest:
    _require_fields(obj, ("actor_id", "incarnation", "num_envs", "hostname", "host_id", "inference_precision"))
    precision = _get_str(obj, "inference_precision")
    if precision not in INFERENCE_PRECISIONS:
        raise MessageRejected("value_range", f"inference_precision: expected one of {INFERENCE_PRECISIONS}, "
                              f"got {precision!r}")
    return JoinRequest(
        actor_id=_get_str(obj, "actor_id"),
        incarnation=_get_str(obj, "incarnation"),
        num_envs=_get_int(obj, "num_envs", minimum=1),
        hostname=_get_str(obj, "hostname", max_len=MAX_TEXT_LENGTH, allow_empty=True),
        host_id=_get_str(obj, "host_id", allow_empty=True),
        inference_precision=precision,
    )


_RING_KEYS = frozenset({"name", "token", "slots"})
_RING_TOKEN = re.compile(r"^[0-9a-f]{16}$")


def _decode_step_ring(value: Any) -> StepRingOffer | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.keys() != _RING_KEYS:
        _reject("schema", f"step_ring: expected None or a map with keys {sorted(_RING_KEYS)}")
    name, token = _get_str(value, "name"), _get_str(value, "token")
    if not name.startswith(SEGMENT_PREFIX) or not _RING_TOKEN.match(token):
        _reject("schema", f"step_ring: expected an {SEGMENT_PREFIX}* segment and 16 hex digits, received "
                          f"{_describe(name)} / {_describe(token)}")
    slots = _get_int(value, "slots", minimum=1)
    if slots > MAX_RING_SLOTS:
        _reject("schema", f"step_ring.slots: expected at most {MAX_RING_SLOTS}, received {slots}")
    return StepRingOffer(name=name, token=token, slots=slots)


def _decode_join_reply(obj: dict[str, Any]) -> JoinReply:
    _require_fields(obj, ("accepted", "reason", "actor_index", "spec", "env_config", "policy_version", "weights",
                          "step_ring"))
    spec = obj["spec"]
    accepted = _get_bool(obj, "accepted")
    if accepted and spec is None:
        _reject("schema", "spec: expected a step spec in an accepted join reply, received None")
    return JoinReply(
        accepted=accepted,
        reason=_get_str(obj, "reason", max_len=MAX_TEXT_LENGTH, allow_empty=True),
        actor_index=_get_int(obj, "actor_index", minimum=-1),
        spec=None if spec is None else StepSpec.from_dict(spec),
        env_config=_decode_env_config(obj["env_config"]),
        policy_version=_get_int(obj, "policy_version"),
        weights=_decode_weights(obj["weights"], "weights"),
        step_ring=_decode_step_ring(obj["step_ring"]),
    )


def _decode_heartbeat(obj: dict[str, Any]) -> Heartbeat:
    _require_fields(
        obj,
        ("actor_id", "incarnation", "seq", "policy_version", "env_steps_per_second", "policy_lag", "episodes"),
    )
    return Heartbeat(
        actor_id=_get_str(obj, "actor_id"),
        incarnation=_get_str(obj, "incarnation"),
        seq=_get_int(obj, "seq"),
        policy_version=_get_int(obj, "policy_version"),
        env_steps_per_second=_get_float(obj, "env_steps_per_second"),
        policy_lag=_get_float(obj, "policy_lag"),
        episodes=_get_int(obj, "episodes"),
    )


def _decode_heartbeat_reply(obj: dict[str, Any]) -> HeartbeatReply:
    _require_fields(obj, ("status", "policy_version"))
    status = obj["status"]
    if type(status) is not str or status not in HEARTBEAT_STATUSES:
        _reject("schema", f"status: expected one of {HEARTBEAT_STATUSES}, received {_describe(status)}")
    return HeartbeatReply(status=status, policy_version=_get_int(obj, "policy_version"))


def _decode_leave(obj: dict[str, Any]) -> Leave:
    _require_fields(obj, ("actor_id", "incarnation"))
    return Leave(actor_id=_get_str(obj, "actor_id"), incarnation=_get_str(obj, "incarnation"))


def _decode_stop(obj: dict[str, Any]) -> StopNotice:
    _require_fields(obj, ("reason",))
    return StopNotice(reason=_get_str(obj, "reason", max_len=MAX_TEXT_LENGTH, allow_empty=True))


def _decode_weights_message(obj: dict[str, Any]) -> WeightsMessage:
    _require_fields(obj, ("policy_version", "revision", "weights"))
    return WeightsMessage(policy_version=_get_int(obj, "policy_version"), weights=_decode_weights(obj["weights"], "weights"),
                          revision=_get_int(obj, "revision"))


_CONTROL_DECODERS: dict[str, Callable[[dict[str, Any]], ControlMessage]] = {
    TYPE_JOIN: _decode_join,
    TYPE_JOIN_REPLY: _decode_join_reply,
    TYPE_HEARTBEAT: _decode_heartbeat,
    TYPE_HEARTBEAT_REPLY: _decode_heartbeat_reply,
    TYPE_LEAVE: _decode_leave,
    TYPE_WEIGHTS: _decode_weights_message,
    TYPE_STOP: _decode_stop,
}


def decode_message(frame: bytes | bytearray | memoryview, *, max_bytes: int) -> ControlMessage:
    """Decode and validate one control or weights frame (any type except ``"step"``).

    Args:
        frame: one ZeroMQ frame.
        max_bytes: frames longer than this are rejected before any decoding.

    Returns:
        A :class:`JoinRequest`, :class:`JoinReply`, :class:`Heartbeat`, :class:`HeartbeatReply`,
        :class:`Leave`, :class:`WeightsMessage` or :class:`StopNotice`; arrays are read-only views.

    Raises:
        MessageRejected: for any malformed frame (``reason`` in :data:`REJECTION_REASONS`); a
            ``"step"`` frame is rejected with ``"schema"`` (use :func:`decode_step`).
        TypeError: ``frame`` is not a bytes-like object (a caller bug, not wire input).
    """
    obj, message_type = _unpack(frame, max_bytes)
    decoder = _CONTROL_DECODERS.get(message_type)
    if decoder is None:
        hint = " (step messages are decoded with decode_step)" if message_type == TYPE_STEP else ""
        _reject("schema", f"type: expected one of {sorted(_CONTROL_DECODERS)}, received {_describe(message_type)}{hint}")
    return decoder(obj)


# ---------------------------------------------------------------------------------------------
# step messages
# ---------------------------------------------------------------------------------------------


_STEP_FIELDS = ("actor_id", "incarnation", "seq", "policy_version", "revision", "fields", "slot", "episode_returns",
                "episode_lengths")


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
        episode_returns: raw (unclipped) returns of the episodes that ended on this step (on
            any step of the block, in step order).
        episode_lengths: lengths, in env steps, of those episodes (same order and length).
        revision: revision of those weights within the update running on ``policy_version``
            (:class:`WeightsMessage`; 0 for the version's own weights). With K steps, the
            ``(policy_version, revision)`` of the oldest weights that acted on any of them.
        slot: None: ``fields`` travel in the message. An int: the arrays are in this slot of the
            actor's step ring (:mod:`oakemu_core.transport.step_ring`). The actor sends ``fields`` empty;
            :func:`decode_step` returns in ``fields`` read-only views of the slot for the fields
            where every bit pattern is valid (uint8 frames), valid only until the learner releases
            the message (:meth:`owned` copies them), and private copies of the others.
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
        return replace(self, fields={name: array if array.flags.writeable else array.copy()
                                     for name, array in self.fields.items()})

    @property
    def num_envs(self) -> int:
        """n, the envs of the sending actor."""
        return int(self.fields["dones"].shape[-1])

    @property
    def num_steps(self) -> int:
        """K, the vector steps this message carries (1 for a one-step ``(n, *shape)`` message)."""
        dones = self.fields["dones"]
        return 1 if dones.ndim == 1 else int(dones.shape[0])


def encode_step(msg: StepMessage) -> bytes:
    """Serialise a :class:`StepMessage` for the PUSH socket.

    Each array goes to msgpack as a ``memoryview`` of its C-contiguous buffer (no copy unless the
    array is not C-contiguous); msgpack copies it once into its buffer and once into the result.
    Shapes and dtypes are not checked against a spec here: the learner does that on decode.

    A message whose arrays are in a step-ring slot (``msg.slot`` an int) is sent with ``fields``
    empty.

    Raises:
        TypeError: an array field is not a numpy array or has a dtype not allowed on the wire.
        ValueError: a scalar field has a bad value, episode lists differ in length, or a slot
            message carries fields; the message names the field.
    """
    _check_local_id(msg.actor_id, "actor_id")
    if msg.slot is not None:
        _check_local_int(msg.slot, "slot")
        if msg.fields:
            raise ValueError("fields: expected none in a message whose arrays are in a step-ring slot")
    _check_local_id(msg.incarnation, "incarnation")
    _check_local_int(msg.seq, "seq")
    _check_local_int(msg.policy_version, "policy_version")
    _check_local_int(msg.revision, "revision")
    episode_returns = [float(r) for r in msg.episode_returns]
    episode_lengths = [int(length) for length in msg.episode_lengths]
    if len(episode_returns) != len(episode_lengths):
        raise ValueError(
            f"episode_lengths: expected {len(episode_returns)} entries (one per episode return), "
            f"received {len(episode_lengths)}"
        )
    return _pack(
        {
            **_header(TYPE_STEP),
            "actor_id": msg.actor_id,
            "incarnation": msg.incarnation,
            "seq": int(msg.seq),
            "policy_version": int(msg.policy_version),
            "revision": int(msg.revision),
            "fields": {name: _encode_array(array, name) for name, array in msg.fields.items()},
            "slot": None if msg.slot is None else int(msg.slot),
            "episode_returns": episode_returns,
            "episode_lengths": episode_lengths,
        }
    )


def decode_step(
    frame: bytes | bytearray | memoryview,
    spec_for: Callable[[str, str], StepSpec | None],
    *,
    max_bytes: int,
    ring_for: Callable[[str, str], StepRingReader | None] | None = None,
) -> StepMessage:
    """Decode and validate one step frame against the spec of its sender.

    Checks, in order: framing and header; the sender is known; exactly the schema's sent fields,
    each with the agreed dtype and shape ``(n, *shape)``, or ``(K, n, *shape)`` for a spec with
    ``steps_per_message`` K > 1 (floats finite, bools 0/1); each field's value checks (bounds,
    masks that allow something); the rules between fields (truncated implies done, bootstrap
    values only on truncated rows, the action taken is allowed by its mask;
    :func:`oakemu_core.step_schema.check_step_consistency`); the episode lists (at most K * n
    episodes). A block is checked whole, every check vectorised over its K x n rows: one bad row
    rejects the whole message. A message whose arrays are in a step-ring slot (``"slot"`` an int:
    :mod:`oakemu_core.transport.step_ring`) is checked the same way on the slot's arrays; their dtypes and
    shapes are the ring's layout, made from the same spec.

    Args:
        frame: one ZeroMQ frame from the PULL socket.
        spec_for: ``(actor_id, incarnation) -> StepSpec`` of a joined actor, or None if unknown.
        max_bytes: frames longer than this are rejected before any decoding.
        ring_for: ``(actor_id, incarnation) ->`` that actor's step ring, or None (no ring; also
            the default): then a slot message is rejected.

    Returns:
        A :class:`StepMessage` whose arrays have exactly the dtypes and shapes of
        :meth:`StepSpec.array_layout`: read-only ``np.frombuffer`` views of the frame; from a ring
        slot, read-only views of it for the fields without a content check
        (:attr:`~oakemu_core.step_schema.StepField.any_bits_valid`) and checked private copies of the
        others (what is checked is what is written: the slot stays writable by the actor).

    Raises:
        MessageRejected: ``"oversized"``, ``"garbage"``, ``"protocol"``, ``"schema"`` (wrong type,
            missing / extra / wrong-typed field, NaN or inf in a float array or episode return,
            more finished episodes than envs, a slot message from an actor without a ring or
            with another slot than ``seq % slots``, fields next to a slot), ``"unknown_actor"``, ``"dtype"`` / ``"shape"``
            (detail names the field, expected and received value), ``"size"`` (declared shape
            disagrees with the data length), ``"value_range"`` (impossible values, named).
        TypeError: ``frame`` is not a bytes-like object (a caller bug, not wire input).
    """
    obj, message_type = _unpack(frame, max_bytes)
    if message_type != TYPE_STEP:
        _reject("schema", f"type: expected {TYPE_STEP!r}, received {_describe(message_type)}")
    _require_fields(obj, _STEP_FIELDS)
    actor_id = _get_str(obj, "actor_id")
    incarnation = _get_str(obj, "incarnation")
    seq = _get_int(obj, "seq")
    policy_version = _get_int(obj, "policy_version")
    revision = _get_int(obj, "revision")
    try:  # a rejection from here on names its sender: the learner releases a rejected ring slot
        return _checked_step(obj, actor_id, incarnation, seq, policy_version, revision, spec_for, ring_for)
    except MessageRejected as error:
        error.sender = (actor_id, incarnation, seq)
        raise


def _checked_step(obj: dict[str, Any], actor_id: str, incarnation: str, seq: int, policy_version: int,
                  revision: int, spec_for: Callable[[str, str], StepSpec | None],
                  ring_for: Callable[[str, str], StepRingReader | None] | None) -> StepMessage:
    """:func:`decode_step` after the header: the sender's spec, the arrays and the episodes."""
    spec = spec_for(actor_id, incarnation)
    if spec is None:
        _reject("unknown_actor", f"actor_id={actor_id!r} incarnation={incarnation!r} has not joined (or was dropped)")

    received = obj["fields"]
    if not isinstance(received, dict):
        _reject("schema", f"fields: expected a map field name -> array, received {type(received).__name__}")
    slot = obj["slot"]
    in_ring = None
    if slot is not None:
        in_ring = _slot_fields(slot, seq, received, ring_for(actor_id, incarnation) if ring_for else None, spec)
    elif received.keys() != spec._field_names:
        missing = sorted(spec._field_names - received.keys())
        extra = sorted(map(_describe, received.keys() - spec._field_names))
        _reject("schema", f"fields: missing {missing}, extra {extra}")
    arrays: dict[str, np.ndarray] = {}
    rows: dict[str, np.ndarray] = {}  # (K * n, *shape) views: the value checks see one batch of rows
    for item, dtype_str, shape, shape_list, nbytes in spec._wire_layout:
        name = item.name
        if in_ring is None:
            array = _inline_array(received[name], item, dtype_str, shape, shape_list, nbytes)
        elif item.any_bits_valid:  # the ring's layout is the spec's; no content check (uint8 frames): in place
            array = in_ring[name]
        else:  # checked on a private copy, which is what gets written: the slot stays writable by the actor
            array = _checked_contents(in_ring[name].copy(), None, name)
        flat = array if spec.steps_per_message == 1 else array.reshape(-1, *item.shape)
        problem = item.check_values(flat)
        if problem is not None:
            _reject("value_range", problem)
        arrays[name] = array
        rows[name] = flat
    problem = check_step_consistency(spec.schema, rows)
    if problem is not None:
        _reject("value_range", problem)

    returns, lengths = obj["episode_returns"], obj["episode_lengths"]
    if not isinstance(returns, list) or not isinstance(lengths, list) or len(returns) != len(lengths):
        _reject("schema", "episode_returns / episode_lengths: expected two lists of equal length")
    if len(returns) > spec.num_envs * spec.steps_per_message:
        _reject("schema", f"episode_returns: expected at most {spec.num_envs} episodes per step x "
                          f"{spec.steps_per_message} steps, received {len(returns)}")
    episode_returns = [_finite_float(r, "episode_returns") for r in returns]
    if any(abs(r) > MAX_ABS_EPISODE_RETURN for r in episode_returns):
        _reject("value_range", f"episode_returns: expected |x| <= {MAX_ABS_EPISODE_RETURN:g}")
    for length in lengths:
        if type(length) is not int or not 0 <= length <= _INT64_MAX:
            _reject("schema", f"episode_lengths: expected non-negative ints, received {_describe(length)}")

    return StepMessage(
        actor_id=actor_id,
        incarnation=incarnation,
        seq=seq,
        policy_version=policy_version,
        fields=arrays,
        episode_returns=episode_returns,
        episode_lengths=list(lengths),
        revision=revision,
        slot=slot,
    )


def _inline_array(value: Any, item: StepField, dtype_str: str, shape: tuple[int, ...], shape_list: list[int],
                  nbytes: int) -> np.ndarray:
    """One inline array of a step message, with the agreed dtype and shape, contents checked."""
    name = item.name
    data = value.get("data") if type(value) is dict else None
    if (type(data) is bytes and len(data) == nbytes and len(value) == 3 and value.get("dtype") == dtype_str
            and value.get("shape") == shape_list and all(type(d) is int for d in value["shape"])):
        # The agreed dtype and shape, spelled exactly: no generic parsing (a message has a dozen fields).
        return _checked_contents(np.frombuffer(data, dtype=item.dtype).reshape(shape), data, name)
    array = _decode_array(value, name)  # anything else takes the generic path, which names what is wrong
    if array.dtype.str != dtype_str:
        _reject("dtype", f"{name}: expected dtype {dtype_str!r}, received {array.dtype.str!r}")
    if array.shape != shape:
        _reject("shape", f"{name}: expected shape {list(shape)}, received {list(array.shape)}")
    return array


class StepRingReader(Protocol):
    """What :func:`decode_step` needs of a step ring (:class:`oakemu_core.transport.step_ring.StepRing`)."""

    slots: int
    spec: StepSpec

    def slot_fields(self, slot: int) -> dict[str, np.ndarray]: ...


def _slot_fields(slot: Any, seq: int, received: dict, ring: StepRingReader | None,
                 spec: StepSpec) -> dict[str, np.ndarray]:
    """The arrays of a slot message (checks the slot against the ring), else rejects it."""
    if received:
        _reject("schema", f"fields: expected none in a slot message, received {sorted(map(_describe, received))}")
    if ring is None:
        _reject("schema", "slot: this actor has no step ring (send the fields inline)")
    if type(slot) is not int or slot != seq % ring.slots or (ring.spec is not spec and ring.spec != spec):
        _reject("schema", f"slot: expected seq % {ring.slots} = {seq % ring.slots} of this actor's ring, "
                          f"received {_describe(slot)}")
    return ring.slot_fields(slot)


MAX_ABS_EPISODE_RETURN = 1e12
"""Largest magnitude accepted for a raw episodic return."""


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
            at join, see :func:`auto_steps_per_message`; it divides the rollout length so a message
            never crosses a segment boundary). K = 1: arrays ``(n, *shape)``; K > 1: ``(K, n, *shape)``.

    Raises:
        ValueError: ``num_envs`` is not an int >= 1, or ``steps_per_message`` not an int in
            ``[1, MAX_STEPS_PER_MESSAGE]``.
    """

    num_envs: int
    schema: StepSchema
    steps_per_message: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_envs, bool) or not isinstance(self.num_envs, (int, np.integer)) or self.num_envs < 1:
            raise ValueError(f"num_envs: expected an int >= 1, received {self.num_envs!r}")
        object.__setattr__(self, "num_envs", int(self.num_envs))
        k = self.steps_per_message
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_STEPS_PER_MESSAGE:
            raise ValueError(f"steps_per_message: expected an int in [1, {MAX_STEPS_PER_MESSAGE}], received {k!r}")
        object.__setattr__(self, "steps_per_message", int(k))
        # (field, canonical dtype str, shape) of every sent field, computed once for decode_step.
        lead = (self.num_envs,) if k == 1 else (int(k), self.num_envs)
        layout = tuple((f, f.dtype.str, (*lead, *f.shape), [*lead, *f.shape], math.prod(lead) * f.item_bytes)
                       for f in self.schema.sent)
        object.__setattr__(self, "_wire_layout", layout)
        object.__setattr__(self, "_field_names", frozenset(f.name for f in self.schema.sent))

    def array_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Expected ``(dtype, shape)`` of every array of a :class:`StepMessage` (the schema's sent
        fields with a leading dimension n = ``num_envs``, after K when ``steps_per_message`` > 1)."""
        return {item.name: (item.dtype, shape) for item, _, shape, _, _ in self._wire_layout}

    def message_bytes(self) -> int:
        """Approximate encoded size of one step message in bytes (array bytes of K steps + 1 KiB of
        keys and headers).

        Used to size socket buffers, so that the data in flight stays a few messages, not MBs.
        """
        return self.steps_per_message * self.num_envs * self.schema.sent_bytes_per_env() + 1024

    def to_dict(self) -> dict[str, Any]:
        """msgpack-able form: ``num_envs``, ``steps_per_message`` and the schema's plain form."""
        return {"num_envs": self.num_envs, "steps_per_message": self.steps_per_message,
                "schema": self.schema.to_dict()}

    @classmethod
    def from_dict(cls, value: Any) -> StepSpec:
        """Inverse of :meth:`to_dict` for untrusted input.

        Raises:
            MessageRejected: ``"schema"`` (not a map, missing/extra keys, wrong types, an invalid
                schema).
        """
        if not isinstance(value, dict) or value.keys() != {"num_envs", "steps_per_message", "schema"}:
            received = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            _reject("schema", f"spec: expected keys ['num_envs', 'schema', 'steps_per_message'], received {received}")
        num_envs = value["num_envs"]
        if type(num_envs) is not int or not 1 <= num_envs <= _MAX_ARRAY_LEN:
            _reject("schema", f"spec.num_envs: expected an int in [1, {_MAX_ARRAY_LEN}], received {_describe(num_envs)}")
        steps = value["steps_per_message"]
        if type(steps) is not int or not 1 <= steps <= MAX_STEPS_PER_MESSAGE:
            _reject("schema", f"spec.steps_per_message: expected an int in [1, {MAX_STEPS_PER_MESSAGE}], "
                              f"received {_describe(steps)}")
        try:
            schema = StepSchema.from_dict(value["schema"])
        except ValueError as error:
            _reject("schema", f"spec.schema: {error}")
        return cls(num_envs=num_envs, schema=schema, steps_per_message=steps)


AUTO_MESSAGE_TARGET_BYTES = 32 * 1024
"""Array bytes :func:`auto_steps_per_message` packs into one message at most (unless one vector
step of the actor's envs is already larger). Below this size a message's fixed cost (encode, syscalls, decode, validation,
ingest: about 100 us on the learner) dominates by far. Larger messages still gain on a learner
whose ingest is the limit (``bench_ingest.py``: a Breakout message of 4 steps x 8 envs is ingested
at 1.26 x the rate of single steps), but the learner PPO update is the limit on every machine
measured so far, and one step per message keeps an Atari actor's rows moving without delay. An
actor with a step ring has no byte bound (its arrays do not travel in the message): Breakout with 8
envs then sends 4 steps per message."""
AUTO_MAX_STEPS_PER_MESSAGE = 32
"""Most steps :func:`auto_steps_per_message` puts in one message (caps how long an actor holds
steps before sending them)."""
AUTO_MESSAGES_PER_SEGMENT = 32
""":func:`auto_steps_per_message` keeps ``K <= rollout_length / 32``: the queues between an actor and
the learner hold a few MESSAGES (high-water marks) plus a few KiB (kernel buffers: a dozen small
messages), so K steps per message multiply the steps in flight by K. Measured on CartPole
(rollout_length 32, a loaded 2-core machine): K = 4 let queued rows reach training 3-6 versions
old (stale rows 50 %), K = 1 kept them within 2; 32 messages per segment keep the queued rows a
small part of a segment."""
AUTO_MESSAGE_TARGET_ROWS = 128
"""Env steps (K x num_envs) :func:`auto_steps_per_message` packs into one message at most. A message's
fixed cost (about 100 us on the learner) is then under 1 us per row, and larger messages only add
to the rows acted while the learner's buffers are full (they wait in about ten socket messages and
16 held ones, so they train a version later). LunarLander-v3, 16 envs, rollout_length 1024, 500k
steps, async, seeds 1-6: K = 32 (512 rows per message) left a sixth to a quarter of the rows 2
versions old (policy lag 1.16-1.25 versions, 857-981 SGD steps; last-100 return mean 88.7, median
95.4), K = 8 (128 rows) almost none (1.00-1.03 versions, 729-781 SGD steps; mean 110.7, median
95.8), at the same SPS. Capping K by the rollout instead (rollout_length / 128) cost CartPole at the default
settings (2 actors x 8 envs, rollout 128, cheap updates, ingest-bound) a quarter of its SPS at K = 1
against K = 4 (6,703 / 8,760 against 10,230 / 10,963 steps/s), for no less lag."""


AUTO_MESSAGE_MIN_ROWS = 32
"""Env steps (K x num_envs) :func:`auto_steps_per_message` allows in one message of an actor with a
step ring when the rollout is shorter than 64 steps (where ``rollout_length / 32`` allows one vector
step), as long as K stays within an eighth of the rollout (``min_rows``).
Every message costs the learner's loop thread about 50 us of CPU, and while an update runs each one
also hands the GIL back and forth with the trainer thread: CartPole at the rl-zoo settings (8 envs,
rollout 32, 20 epochs on 256 rows, one actor) trained 1.2 x faster with K = 4 than with K = 1 (PPO
update 27-28 against 33-34 ms; 100k env steps in 15.8-16.1 against 18.8-18.9 s). The step ring
(:func:`oakemu_core.transport.step_ring.ring_slots`) and the actor's wait for a free slot before acting keep the
rows acted ahead as few as with K = 1 (policy lag 1.13 against 1.14 versions)."""


def auto_steps_per_message(env_step_bytes: int, rollout_length: int, *, num_envs: int,
                           target_bytes: int | None = AUTO_MESSAGE_TARGET_BYTES,
                           target_rows: int = AUTO_MESSAGE_TARGET_ROWS,
                           max_steps: int = AUTO_MAX_STEPS_PER_MESSAGE, min_rows: int = 0) -> int:
    """The ``steps_per_message`` the learner gives an actor by default (``steps_per_message =
    "auto"``): the largest divisor K of ``rollout_length`` with ``K <= max_steps``,
    ``K <= rollout_length / AUTO_MESSAGES_PER_SEGMENT`` (32) or, for a rollout shorter than 64
    steps (where that is 1), ``K * num_envs <= min_rows`` and ``K <= rollout_length / 8``, and always
    ``K * num_envs * env_step_bytes <= target_bytes`` and ``K * num_envs <= target_rows``; 1 when two
    vector steps already exceed ``target_bytes`` or ``target_rows`` (more than 64 envs), or the
    rollout is shorter than 64 steps and ``min_rows`` does not allow more.

    Examples: ALE/Breakout-v5, 8 envs: one vector step is ~226 KB -> K = 1; CartPole-v1, 8 envs: ~330 bytes
    -> K = 4 with rollout_length 128; with 32, 4 for an actor with a step ring (``min_rows`` 32:
    :data:`AUTO_MESSAGE_MIN_ROWS`) and 1 through the sockets; LunarLander-v3, 16 envs, rollout 1024 ->
    8 (128 rows).

    Args:
        env_step_bytes: array bytes of one env's step (``StepSchema.sent_bytes_per_env()``).
        rollout_length: rows per segment (T); K divides it.
        num_envs: envs of the actor (rows per vector step).
        target_bytes: the bound on a message's array bytes; None: none (an actor with a step ring,
            whose arrays do not travel in the message: Breakout, 8 envs -> K = 4).
        min_rows: up to how many rows (``K * num_envs``) a message may carry when the rollout is
            shorter than 64 steps (within an eighth of the rollout); 0: one vector step there. For
            actors with a step ring, whose slots bound the rows acted ahead
            (:func:`oakemu_core.transport.step_ring.ring_slots`); through the sockets, whose queues count
            messages, K steps per message would multiply those rows by K.

    Raises:
        ValueError: ``env_step_bytes``, ``rollout_length`` or ``num_envs`` < 1.
    """
    if env_step_bytes < 1 or rollout_length < 1 or num_envs < 1:
        raise ValueError(f"auto_steps_per_message: expected env_step_bytes, rollout_length and num_envs >= 1, "
                         f"received {env_step_bytes}, {rollout_length}, {num_envs}")
    step_bytes = num_envs * env_step_bytes  # one vector step of the actor
    most = rollout_length // AUTO_MESSAGES_PER_SEGMENT
    if most <= 1:  # a rollout under 64 steps: up to min_rows rows per message, within an eighth of it
        most = max(1, min(min_rows // num_envs, rollout_length // 8))
    best = 1
    for k in range(1, min(max_steps, most) + 1):
        if (rollout_length % k == 0 and (target_bytes is None or k * step_bytes <= target_bytes)
                and k * num_envs <= target_rows):
            best = k
    return best
