"""One per-step field: :class:`StepField` (name, per-env shape, dtype, roles, bounds and the checks
of its values), the dtypes a field may have (:data:`WIRE_DTYPES`) and the limits every field keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: the schema, buffers and wire stay torch-free
    pass


OBSERVATION_FIELD = "observations"
"""Field of a plain observation; a dict observation's key ``k`` is the field ``observations.k``."""
MAX_ABS_STEP_VALUE = 1e6
"""Largest magnitude accepted for rewards and value estimates (far above any real game's)."""
MAX_DIMENSIONS = 32


def _build_wire_dtypes() -> dict[str, np.dtype]:
    """Every canonical ``np.dtype.str`` a field may have (bool / int / uint / float of 1, 2, 4 or
    8 bytes, each byte order): the only dtype strings read from untrusted input."""
    table: dict[str, np.dtype] = {}
    for order in "<>|":
        for kind in "biuf":
            for size in (1, 2, 4, 8):
                text = f"{order}{kind}{size}"
                try:
                    dtype = np.dtype(text)
                except TypeError:
                    continue
                if dtype.str == text and dtype.kind == kind and dtype.itemsize == size:
                    table[text] = dtype
    return table


SMALL_ARRAY_SIZE = 64
"""Arrays of at most this many values are checked in plain Python (one numpy call costs ~1-3 us, more
than a loop over a few values; a step message has a dozen ``(n,)`` fields)."""

WIRE_DTYPES = _build_wire_dtypes()
"""Canonical dtype string -> dtype, for every dtype a field or wire array may have."""


def observation_field_name(key: str) -> str:
    """``"observations"`` for a plain observation (key ``""``), ``"observations.<key>"`` otherwise."""
    return OBSERVATION_FIELD if key == "" else f"{OBSERVATION_FIELD}.{key}"


def check_array(field_name: str, array: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Raise ValueError naming the field, the expected and the received shape/dtype (no casting)."""
    if not isinstance(array, np.ndarray):
        raise ValueError(
            f"{field_name}: expected a numpy array of shape {shape} and dtype {dtype}, "
            f"received {type(array).__name__}"
        )
    if array.shape != shape or array.dtype != dtype:
        raise ValueError(
            f"{field_name}: expected shape {shape} and dtype {dtype}, "
            f"received shape {array.shape} and dtype {array.dtype}"
        )


def _dtype_range(dtype: np.dtype) -> tuple[float, float]:
    """Smallest and largest value an array of ``dtype`` can hold (floats: -inf, inf)."""
    if dtype.kind == "b":
        return 0.0, 1.0
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return float(info.min), float(info.max)
    return -math.inf, math.inf


@dataclass(frozen=True, eq=False)
class StepField:
    """One per-step field (see the module docstring).

    Attributes:
        name: unique field name.
        shape: shape per env (``()`` for a scalar per env).
        dtype: numpy dtype (bool / int / uint / float, 1-8 bytes).
        sent, stored, minibatch: roles.
        default: value a writer may omit the field with (None: required); only for stored fields.
        low, high: inclusive bounds of every element (scalars, or arrays broadcast to ``shape``);
            None: unchecked. Floats are always checked finite on the wire.
        mask_segments: for a mask field, the sizes of its consecutive segments; each row must
            allow at least one entry of every segment.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sent: bool = True
    stored: bool = True
    minibatch: bool = False
    default: float | bool | None = None
    low: Any = None
    high: Any = None
    mask_segments: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.dtype.str not in WIRE_DTYPES:
            raise ValueError(
                f"{self.name}: expected a bool/int/uint/float dtype of 1-8 bytes, received {self.dtype}"
            )
        if len(self.shape) > MAX_DIMENSIONS or any(d < 0 for d in self.shape):
            raise ValueError(
                f"{self.name}: expected at most {MAX_DIMENSIONS} non-negative dimensions, received {self.shape}"
            )
        for bound in ("low", "high"):
            value = getattr(self, bound)
            if value is not None:
                array = np.asarray(value, dtype=np.float64)
                np.broadcast_to(array, self.shape)  # raises ValueError when it cannot fit
                object.__setattr__(self, bound, array)
        # A bound the dtype cannot pass (uint8 frames in [0, 255], an int64 low of -2**63, an
        # infinite float bound) is not checked: it would cost two passes over every frame for nothing.
        smallest, largest = _dtype_range(self.dtype)
        low = self.low if self.low is not None and np.any(self.low > smallest) else None
        high = self.high if self.high is not None and np.any(self.high < largest) else None
        object.__setattr__(self, "_checked_low", low)
        object.__setattr__(self, "_checked_high", high)
        # Scalar bounds as Python floats: a step message's (n,) fields are checked with min() /
        # max() over a list, which costs a tenth of the numpy calls for a few values.
        object.__setattr__(
            self, "_scalar_low", float(low) if low is not None and low.ndim == 0 else None
        )
        object.__setattr__(
            self, "_scalar_high", float(high) if high is not None and high.ndim == 0 else None
        )
        object.__setattr__(
            self,
            "_bounds_are_scalars",
            (low is None or low.ndim == 0) and (high is None or high.ndim == 0),
        )
        object.__setattr__(
            self, "_values_unchecked", low is None and high is None and self.mask_segments is None
        )
        # Computed once: decode_step asks for every field of every step-ring message.
        object.__setattr__(
            self,
            "_any_bits_valid",
            self.dtype.kind in "iu" and low is None and high is None and self.mask_segments is None,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepField) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    @property
    def any_bits_valid(self) -> bool:
        """Whether every bit pattern of the field is a valid value: an int / uint field without a
        bound its dtype can fail and without mask segments (uint8 frames). Such a field has no content
        check, so a step ring's slot of it is used in place; every other field is copied first
        (:func:`oakemu_core.transport.steps.decode_step`)."""
        return self._any_bits_valid

    @property
    def item_bytes(self) -> int:
        """Bytes of one env's value."""
        return math.prod(self.shape) * self.dtype.itemsize

    def check_values(self, array: np.ndarray) -> str | None:
        """Why ``array`` (``(n, *shape)``, already of the right dtype and shape) holds impossible
        values, or None when it is fine: bounds, then mask segments."""
        if array.size == 0 or self._values_unchecked:  # bools, uint8 frames: nothing to check
            return None
        if self._bounds_are_scalars and array.size <= SMALL_ARRAY_SIZE:
            values = array.ravel().tolist()
            too_low = self._scalar_low is not None and min(values) < self._scalar_low
            too_high = self._scalar_high is not None and max(values) > self._scalar_high
        else:
            too_low = self._checked_low is not None and bool(np.any(array < self._checked_low))
            too_high = self._checked_high is not None and bool(np.any(array > self._checked_high))
        if too_low:
            return f"{self.name}: expected values >= {_describe_bound(self.low)}, received min {array.min()!r}"
        if too_high:
            return f"{self.name}: expected values <= {_describe_bound(self.high)}, received max {array.max()!r}"
        if self.mask_segments is not None:
            start = 0
            for size in self.mask_segments:
                empty = ~array[..., start : start + size].any(axis=-1)
                if empty.any():
                    env = int(np.flatnonzero(empty.reshape(empty.shape[0], -1).any(axis=-1))[0])
                    return (
                        f"{self.name}: env {env} allows no action in entries {start}..{start + size - 1} "
                        f"(a mask must allow at least one)"
                    )
                start += size
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack / checkpoint)."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype.str,
            "sent": self.sent,
            "stored": self.stored,
            "minibatch": self.minibatch,
            "default": self.default,
            "low": None if self.low is None else self.low.tolist(),
            "high": None if self.high is None else self.high.tolist(),
            "mask_segments": None if self.mask_segments is None else list(self.mask_segments),
        }

    @classmethod
    def from_dict(cls, value: Any) -> StepField:
        """Inverse of :meth:`to_dict` for untrusted input. Raises ValueError naming what is wrong."""
        keys = {
            "name",
            "shape",
            "dtype",
            "sent",
            "stored",
            "minibatch",
            "default",
            "low",
            "high",
            "mask_segments",
        }
        if not isinstance(value, dict) or value.keys() != keys:
            received = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"schema field: expected keys {sorted(keys)}, received {received}")
        name, dtype = (
            value["name"],
            WIRE_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None,
        )
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ValueError(
                f"schema field name: expected a str of 1-128 chars, received {name!r}"[:200]
            )
        if dtype is None:
            raise ValueError(f"schema field {name}: dtype {value['dtype']!r} is not allowed"[:200])
        shape = value["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMENSIONS
            or any(type(d) is not int or d < 0 for d in shape)
        ):
            raise ValueError(
                f"schema field {name}: shape must be a list of non-negative ints"[:200]
            )
        for flag in ("sent", "stored", "minibatch"):
            if type(value[flag]) is not bool:
                raise ValueError(f"schema field {name}: {flag} must be a bool")
        if value["default"] is not None and type(value["default"]) not in (bool, int, float):
            raise ValueError(f"schema field {name}: default must be a number, a bool or None")
        segments = value["mask_segments"]
        if segments is not None and (
            not isinstance(segments, list) or any(type(s) is not int or s < 1 for s in segments)
        ):
            raise ValueError(f"schema field {name}: mask_segments must be a list of positive ints")
        try:
            return cls(
                name=name,
                shape=tuple(shape),
                dtype=dtype,
                sent=value["sent"],
                stored=value["stored"],
                minibatch=value["minibatch"],
                default=value["default"],
                low=value["low"],
                high=value["high"],
                mask_segments=None if segments is None else tuple(segments),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"schema field {name}: {error}"[:300]) from None


def _describe_bound(bound: np.ndarray) -> str:
    return repr(bound.item()) if bound.ndim == 0 else repr(bound.tolist())


def scalar_field(name: str, dtype: Any, **roles: Any) -> StepField:
    """A field of one value per env (shape ``()``); ``roles``: the other :class:`StepField` arguments."""
    return StepField(name, (), np.dtype(dtype), **roles)


def policy_revisions_field() -> StepField:
    """``policy_revisions``: the revision of the acting weights within their version (stored, not sent)."""
    return scalar_field("policy_revisions", np.int64, sent=False, default=0)
