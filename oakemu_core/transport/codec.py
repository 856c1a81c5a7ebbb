"""The wire codec: msgpack framing, array maps, limits, and the one exception untrusted input raises.

Every message is one msgpack map with ``"protocol"`` (= :data:`PROTOCOL_VERSION`) and ``"type"``
(:func:`header`). Arrays travel as a map ::

    {"dtype": np.dtype.str (with byte order, e.g. "<f4", "|u1", "|b1", "<i8"),
     "shape": [int, ...],
     "data": C-contiguous bytes (msgpack bin)}

There is no pickle anywhere: only bool / signed int / unsigned int / float dtypes of 1, 2, 4 or 8
bytes are accepted (no object, void, string, datetime or complex kinds), and every frame is
unpacked with msgpack limits bounded by the frame length (:func:`unpack`), so a declared size never
causes an allocation. Dtype strings from the wire are looked up in a fixed table of allowed
canonical spellings and are never handed to ``np.dtype`` (which would parse structured, object or
subarray dtypes).

Two kinds of check live here, by where a value comes from: values from the wire (``get_*``,
:func:`decode_array`) raise :class:`MessageRejected`; values of our own process about to be sent
(``check_local_*``, :func:`encode_array`) raise ``ValueError`` / ``TypeError`` (a caller bug).

The messages themselves: :mod:`oakemu_core.transport.control` (join, heartbeat, leave, weights,
stop) and :mod:`oakemu_core.transport.steps` (step messages).
"""

from __future__ import annotations

import math
import threading
from typing import Any, NoReturn

import msgpack
import numpy as np

from oakemu_core.step_schema import WIRE_DTYPES

__all__ = [
    "PROTOCOL_VERSION",
    "REJECTION_REASONS",
    "ALLOWED_DTYPE_KINDS",
    "MAX_ID_LENGTH",
    "MAX_TEXT_LENGTH",
    "MAX_NDIM",
    "MAX_ARRAY_LEN",
    "INT64_MAX",
    "MessageRejected",
    "reject",
    "describe",
    "encode_array",
    "decode_array",
    "checked_contents",
    "get_str",
    "get_int",
    "get_bool",
    "get_float",
    "finite_float",
    "check_local_id",
    "check_local_int",
    "pack",
    "header",
    "unpack",
    "require_fields",
]

PROTOCOL_VERSION = 11
"""Version of the wire format; a frame with any other ``"protocol"`` value is rejected. Raised
whenever a message gains, loses or changes a field (the changes of each version:
``docs/benchmarks.md``)."""

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

MAX_ID_LENGTH = 128
"""Longest ``actor_id`` / ``incarnation`` / weight name / config key, in characters."""

MAX_TEXT_LENGTH = 4096
"""Longest free-text string (hostname, reason, config string value), in characters."""

MAX_NDIM = 32
"""Most dimensions an array on the wire may declare (numpy itself allows 64)."""

MAX_ARRAY_LEN = 65536
"""Longest msgpack array in a frame: shapes (<= :data:`MAX_NDIM`) and per-message episode lists
(<= K * num_envs); also the most envs a step spec may declare."""

_MAX_MAP_LEN = 4096  # weights dicts hold tens of tensors; every other map is tiny

INT64_MAX = 2**63 - 1
"""Largest int a scalar field may hold (msgpack's signed 64-bit range)."""

_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})


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
            read (:func:`oakemu_core.transport.steps.decode_step`), else None.
    """

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECTION_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.sender: tuple[str, str, int] | None = None


def reject(reason: str, detail: str) -> NoReturn:
    """Raise :class:`MessageRejected` (``reason`` one of :data:`REJECTION_REASONS`)."""
    raise MessageRejected(reason, detail)


def describe(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error details about untrusted values."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------
# dtype / shape of a wire array
# ---------------------------------------------------------------------------------------------


_WIRE_DTYPE_STRS = {dtype: text for text, dtype in WIRE_DTYPES.items()}  # dtype -> canonical str


def _wire_dtype(value: Any, name: str) -> np.dtype:
    """Look a dtype string from the wire up in the allowlist; nothing else is ever parsed.

    Only canonical spellings pass (``|u1`` not ``<u1``, ``|b1`` not ``?``), so a dtype string
    compares equal exactly when the dtype (byte order included) does.
    """
    if not isinstance(value, str):
        reject("schema", f"{name}.dtype: expected str, received {type(value).__name__}")
    dtype = WIRE_DTYPES.get(value)
    if dtype is None:
        reject(
            "dtype",
            f"{name}.dtype: expected a bool/int/uint/float dtype string with byte order "
            f"(one of {sorted(WIRE_DTYPES)}), received {value[:32]!r}",
        )
    return dtype


def _wire_shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        reject(
            "schema",
            f"{name}.shape: expected a list of at most {MAX_NDIM} ints, received {describe(value)}",
        )
    for d in value:
        if type(d) is not int or d < 0:
            reject(
                "schema", f"{name}.shape: expected non-negative ints, received {describe(value)}"
            )
    return tuple(value)


# ---------------------------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------------------------


def encode_array(array: Any, name: str) -> dict[str, Any]:
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


def decode_array(value: Any, name: str) -> np.ndarray:
    """Validate one wire array map and return a read-only ``np.frombuffer`` view of its bytes.

    Order of checks: structure ("schema"), dtype allowlist ("dtype"), shape entries ("schema"),
    byte count = prod(shape) * itemsize computed with Python ints ("size"), bool bytes in {0, 1}
    and float values finite ("schema").

    Raises:
        MessageRejected: with the reason of the first check that fails.
    """
    if not isinstance(value, dict) or value.keys() != _ARRAY_KEYS:
        keys = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        reject(
            "schema",
            f"{name}: expected an array map with keys ['data', 'dtype', 'shape'], received {keys}",
        )
    dtype = _wire_dtype(value["dtype"], name)
    shape = _wire_shape(value["shape"], name)
    data = value["data"]
    if not isinstance(data, bytes):
        reject("schema", f"{name}.data: expected bin bytes, received {type(data).__name__}")
    declared = math.prod(shape) * dtype.itemsize  # Python ints: no overflow, no allocation
    if declared != len(data):
        reject(
            "size",
            f"{name}: shape {list(shape)[:MAX_NDIM]} x {dtype.str} declares {declared} bytes, "
            f"received {len(data)} bytes of data",
        )
    return checked_contents(np.frombuffer(data, dtype=dtype).reshape(shape), data, name)


def checked_contents(array: np.ndarray, data: bytes | None, name: str) -> np.ndarray:
    """``array`` (a view of ``data``; of shared memory when ``data`` is None) after the content
    checks: bool bytes in {0, 1}, floats finite.

    Raises:
        MessageRejected: ``"schema"`` naming ``name``.
    """
    kind = array.dtype.kind
    if kind == "b" and (array.tobytes() if data is None else data).translate(None, b"\x00\x01"):
        reject("schema", f"{name}: bool array holds bytes other than 0 and 1")
    if kind == "f" and not _all_finite(array):
        reject("schema", f"{name}: expected finite values, received NaN or inf")
    return array


def _all_finite(array: np.ndarray) -> bool:
    """Whether every element is finite; plain Python for small arrays, where a numpy ufunc
    call costs more than the loop (a step message has five ``(n,)`` float fields)."""
    if (
        array.size <= 64
    ):  # a finite sum has finite terms; else (or a sum that overflowed) each value is looked at
        values = array.reshape(-1).tolist()
        return math.isfinite(sum(values)) or all(map(math.isfinite, values))
    return bool(np.isfinite(array).all())


# ---------------------------------------------------------------------------------------------
# scalar fields: from the wire (MessageRejected) and of our own messages (ValueError)
# ---------------------------------------------------------------------------------------------


def get_str(obj: dict, key: str, *, max_len: int = MAX_ID_LENGTH, allow_empty: bool = False) -> str:
    """``obj[key]`` as a str of at most ``max_len`` printable characters (non-empty unless
    ``allow_empty``); else :class:`MessageRejected` ``"schema"``. Printable (``str.isprintable``: no
    line breaks, escape sequences or other control characters), because these strings reach log
    lines and terminal views, where a peer must not be able to forge a line or move the cursor."""
    value = obj[key]
    if (
        not isinstance(value, str)
        or len(value) > max_len
        or (not value and not allow_empty)
        or not value.isprintable()
    ):
        reject(
            "schema",
            f"{key}: expected a {'' if allow_empty else 'non-empty '}str of at most {max_len} printable chars, "
            f"received {describe(value)}",
        )
    return value


def get_int(obj: dict, key: str, *, minimum: int = 0) -> int:
    """``obj[key]`` as an int (not a bool) in ``[minimum, 2**63-1]``; else ``"schema"``."""
    value = obj[key]
    if type(value) is not int or not minimum <= value <= INT64_MAX:
        reject(
            "schema", f"{key}: expected an int in [{minimum}, 2**63-1], received {describe(value)}"
        )
    return value


def get_bool(obj: dict, key: str) -> bool:
    """``obj[key]`` as a bool; else ``"schema"``."""
    value = obj[key]
    if type(value) is not bool:
        reject("schema", f"{key}: expected a bool, received {describe(value)}")
    return value


def finite_float(value: Any, key: str) -> float:
    """``value`` (a float or an int) as a finite float; else ``"schema"`` naming ``key``."""
    if type(value) not in (float, int) or not math.isfinite(value):
        reject("schema", f"{key}: expected a finite float, received {describe(value)}")
    return float(value)


def get_float(obj: dict, key: str) -> float:
    """``obj[key]`` as a finite float; else ``"schema"``."""
    return finite_float(obj[key], key)


def check_local_id(value: Any, name: str) -> None:
    """Raise ValueError unless ``value`` is a non-empty str of at most :data:`MAX_ID_LENGTH` printable chars."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_ID_LENGTH
        or not value.isprintable()
    ):
        raise ValueError(
            f"{name}: expected a non-empty str of at most {MAX_ID_LENGTH} printable chars, "
            f"received {value!r}"
        )


def check_local_int(value: Any, name: str, minimum: int = 0) -> None:
    """Raise ValueError unless ``value`` is an int (numpy's too, not a bool) in ``[minimum, 2**63-1]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not minimum <= value <= INT64_MAX
    ):
        raise ValueError(f"{name}: expected an int in [{minimum}, 2**63-1], received {value!r}")


# ---------------------------------------------------------------------------------------------
# framing
# ---------------------------------------------------------------------------------------------


_PACKERS = threading.local()


def pack(message: dict[str, Any]) -> bytes:
    """msgpack bytes of ``message`` with a per-thread reused ``msgpack.Packer``.

    ``msgpack.packb`` allocates a fresh 1 MiB buffer on every call; a reused packer keeps its
    buffer (Packer objects are not thread-safe, hence one per thread).
    """
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    try:
        return packer.pack(message)
    except BaseException:
        _PACKERS.packer = None  # a failed pack may leave partial data in the buffer
        raise


def header(message_type: str) -> dict[str, Any]:
    """The two keys every message starts with: ``protocol`` and ``type``."""
    return {"protocol": PROTOCOL_VERSION, "type": message_type}


def unpack(frame: bytes | bytearray | memoryview, max_bytes: int) -> tuple[dict[str, Any], str]:
    """Size check, msgpack decode with bounded limits, protocol check; returns ``(map, type)``.

    Raises:
        MessageRejected: ``"oversized"`` (longer than ``max_bytes``), ``"garbage"`` (not one msgpack
            object within the limits), ``"schema"`` (not a map, or ``type`` not a str),
            ``"protocol"`` (not :data:`PROTOCOL_VERSION`).
        TypeError: ``frame`` is not a bytes-like object (a caller bug, not wire input).
    """
    try:
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
    except TypeError:
        raise TypeError(
            f"frame: expected bytes, bytearray or memoryview, received {type(frame).__name__}"
        ) from None
    if size > max_bytes:
        reject("oversized", f"frame is {size} bytes, limit max_bytes={max_bytes}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=size,
            max_str_len=min(size, 4 * MAX_TEXT_LENGTH),  # bytes: up to 4 per UTF-8 char
            max_array_len=min(size, MAX_ARRAY_LEN),
            max_map_len=min(size, _MAX_MAP_LEN),
            max_ext_len=0,
        )
    except Exception as error:  # msgpack raises ValueError subclasses, TypeError, ...: all garbage
        reject(
            "garbage", f"not a valid msgpack frame ({type(error).__name__}: {describe(str(error))})"
        )
    if not isinstance(obj, dict):
        reject("schema", f"expected a msgpack map at top level, received {type(obj).__name__}")
    version = obj.get("protocol")
    if type(version) is not int or version != PROTOCOL_VERSION:
        reject("protocol", f"protocol: expected {PROTOCOL_VERSION}, received {describe(version)}")
    message_type = obj.get("type")
    if not isinstance(message_type, str):
        reject("schema", f"type: expected a str, received {describe(message_type)}")
    return obj, message_type


def require_fields(obj: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Reject (``"schema"``) a message whose keys are not exactly ``protocol``, ``type`` and ``fields``."""
    expected = {"protocol", "type", *fields}
    received = obj.keys()
    if received != expected:
        missing = sorted(expected - received)
        extra = sorted(map(str, received - expected))
        reject("schema", f"{obj['type']} message: missing fields {missing}, extra fields {extra}")
