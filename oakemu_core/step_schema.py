"""The one declaration of every per-step field: name, per-env shape, dtype, roles and value checks.

A :class:`StepSchema` is built once from the env's observation layout and the policy's
:class:`~oakemu_core.policy.distributions.ActionDistribution` (:func:`build_schema`), in the spirit of
Sample Factory's ``alloc_trajectory_tensors`` (spaces + one list of policy outputs) and TorchRL's
composite specs. Everything else is derived from it: the rollout buffer's shared-memory arrays
and their size (``/dev/shm`` check, ``shm_size`` advice), validation of writes, the wire encoding
of step messages and its value checks, the actor's step buffers, minibatch tensors, and the
checkpoint's metadata. Nothing else lists the fields.

Roles of a field:

* ``sent``: actors send it in every step message (validated at the wire, the trust boundary);
* ``stored``: the rollout buffer allocates it as ``(T, N, *shape)``;
* ``minibatch``: PPO minibatches carry it (flattened over the trainable rows).

The standard fields (``n`` envs; shapes per env):

==================  ============  =======  ====  ======  =====  =========================================
name                shape         dtype    sent  stored  mini   meaning
==================  ============  =======  ====  ======  =====  =========================================
observations[.key]  obs shape     obs      x     x       x      s_t (one field per dict key)
actions             action shape  action   x     x       x      a_t as sampled
log_probs           ()            f32      x     x       x      log pi(a_t | s_t) of the acting policy
values              ()            f32      x     x       x      V(s_t) of the acting policy
rewards             ()            f32      x     x              r_t
dones               ()            bool     x     x              the episode ended on step t
truncated           ()            bool     x                    ... by a time limit (implies dones)
bootstrap_values    ()            f32      x     x              V(true final obs) if truncated, else 0
next_values         ()            f32      x                    V(s_{t+1}): GAE's last value
trainable           ()            bool     x     x              the row may be trained on
action_mask         (mask width)  bool     x     x       x      allowed actions (masked envs only)
action_mean/_std    (d,)          f32      x     x       x      Gaussian parameters (Box actions only)
policy_versions     ()            i64            x       x      version of the acting weights
policy_revisions    ()            i64            x              ... and their revision within it
advantages          ()            f32            x       x      GAE (written by compute_gae)
returns             ()            f32            x       x      advantages + values
==================  ============  =======  ====  ======  =====  =========================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: the schema, buffers and wire stay torch-free
    from oakemu_core.policy.distributions import ActionDistribution

__all__ = [
    "MAX_ABS_STEP_VALUE",
    "OBSERVATION_FIELD",
    "StepField",
    "StepSchema",
    "WIRE_DTYPES",
    "build_schema",
    "check_array",
    "check_step_values",
    "default_schema",
    "observation_field_name",
    "resolve_schema",
]

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


@dataclass(frozen=True, eq=False)
class StepSchema:
    """An ordered set of :class:`StepField` s, plus the action distribution they were built for.

    Args:
        fields: the fields, names unique.
        distribution: the policy's action distribution (None for a schema declared by hand,
            e.g. the plain constructor ``RolloutBuffer(T, N, shape, dtype)``).

    Raises:
        ValueError: duplicate names, or a required standard field missing.
    """

    fields: tuple[StepField, ...]
    distribution: ActionDistribution | None = None
    _by_name: dict[str, StepField] = field(init=False, repr=False, compare=False)

    REQUIRED = (
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "truncated",
        "bootstrap_values",
        "next_values",
        "trainable",
        "policy_versions",
        "policy_revisions",
        "advantages",
        "returns",
    )

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        object.__setattr__(self, "fields", fields)
        by_name: dict[str, StepField] = {}
        for item in fields:
            if item.name in by_name:
                raise ValueError(f"schema: field {item.name!r} declared twice")
            by_name[item.name] = item
        missing = [name for name in self.REQUIRED if name not in by_name]
        if missing or not self.observation_names:
            raise ValueError(f"schema: missing standard fields {missing or ['observations']}")
        object.__setattr__(self, "_by_name", by_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepSchema) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __getitem__(self, name: str) -> StepField:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property  # fields never change: computed once (the ingest path asks per message)
    def sent(self) -> tuple[StepField, ...]:
        """Fields in every step message, in declaration order."""
        return tuple(f for f in self.fields if f.sent)

    @cached_property
    def stored(self) -> tuple[StepField, ...]:
        """Fields the rollout buffer allocates."""
        return tuple(f for f in self.fields if f.stored)

    @cached_property
    def minibatch(self) -> tuple[StepField, ...]:
        """Fields PPO minibatches carry."""
        return tuple(f for f in self.fields if f.minibatch)

    @cached_property
    def action_fields(self) -> tuple[StepField, ...]:
        """Fields the action distribution reads back in the update: ``actions``, its stored
        parameters (``action_mean``, ``action_std``) and ``action_mask``."""
        names = {"actions", "action_mask"}
        if self.distribution is not None:
            names.update(self.distribution.stored_fields())
        return tuple(f for f in self.fields if f.name in names)

    @cached_property
    def observation_names(self) -> tuple[str, ...]:
        """Observation fields: ``("observations",)`` or ``("observations.<key>", ...)``."""
        return tuple(
            f.name
            for f in self.fields
            if f.name == OBSERVATION_FIELD or f.name.startswith(OBSERVATION_FIELD + ".")
        )

    @cached_property
    def is_dict_observation(self) -> bool:
        return self.observation_names != (OBSERVATION_FIELD,)

    def observation_key(self, name: str) -> str:
        """The observation key of an observation field (``""`` for the plain one)."""
        return "" if name == OBSERVATION_FIELD else name[len(OBSERVATION_FIELD) + 1 :]

    # -- observations as the env and the model see them -----------------------------------------
    def split_observations(self, observations: Any) -> dict[str, Any]:
        """``{field name: array}`` from an env's observations (an array, or a dict keyed by key)."""
        if not self.is_dict_observation:
            return {OBSERVATION_FIELD: observations}
        if not isinstance(observations, Mapping):
            raise ValueError(
                f"observations: expected a dict with keys "
                f"{[self.observation_key(n) for n in self.observation_names]}, "
                f"received {type(observations).__name__}"
            )
        missing = [
            self.observation_key(n)
            for n in self.observation_names
            if self.observation_key(n) not in observations
        ]
        if missing:
            raise ValueError(
                f"observations: missing keys {missing}, received keys {sorted(observations)}"
            )
        return {name: observations[self.observation_key(name)] for name in self.observation_names}

    def join_observations(self, fields: Mapping[str, Any]) -> Any:
        """Inverse of :meth:`split_observations`: one array, or a dict keyed by observation key."""
        if not self.is_dict_observation:
            return fields[OBSERVATION_FIELD]
        return {self.observation_key(name): fields[name] for name in self.observation_names}

    # -- validation of local writes ---------------------------------------------------------------
    def check_arrays(
        self, arrays: Mapping[str, Any], count: int, fields: Iterable[StepField]
    ) -> None:
        """Check that each of ``fields`` is in ``arrays`` with shape ``(count, *shape)`` and the exact dtype.

        Raises:
            ValueError: a field missing (with no default) or of the wrong type, shape or dtype,
                or an array that is not a field of this schema; the message names the field.
        """
        fields = tuple(fields)
        known = {f.name for f in fields}
        unknown = sorted(set(arrays) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}; this schema has {sorted(known)}")
        for item in fields:
            array = arrays.get(item.name)
            if array is None:
                if item.default is None:
                    raise ValueError(f"{item.name}: required field missing")
                continue
            check_array(item.name, array, (count, *item.shape), item.dtype)

    # -- sizes --------------------------------------------------------------------------------------
    def stored_bytes_per_row(self) -> int:
        """Bytes one ``(t, env)`` row takes in the rollout buffer (every stored field)."""
        return sum(f.item_bytes for f in self.stored)

    def sent_bytes_per_env(self) -> int:
        """Array bytes one env contributes to a step message."""
        return sum(f.item_bytes for f in self.sent)

    # -- plain form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain values for the join reply and checkpoints."""
        return {
            "fields": [f.to_dict() for f in self.fields],
            "distribution": None if self.distribution is None else self.distribution.to_dict(),
        }

    @classmethod
    def from_dict(
        cls,
        value: Any,
        distribution_from_dict: Callable[[dict[str, Any]], ActionDistribution] | None = None,
    ) -> StepSchema:
        """Inverse of :meth:`to_dict` for untrusted input.

        Args:
            value: a :meth:`to_dict` map.
            distribution_from_dict: parses its ``distribution`` map (the policy layer's
                :func:`~oakemu_core.policy.distributions.distribution_from_dict`;
                :func:`oakemu_core.policy.schemas.schema_from_dict` passes it); needed unless the
                distribution is None.

        Raises:
            ValueError: naming what is wrong, or a distribution map without ``distribution_from_dict``.
        """
        if not isinstance(value, dict) or value.keys() != {"fields", "distribution"}:
            raise ValueError("schema: expected a map with keys ['distribution', 'fields']")
        fields = value["fields"]
        if not isinstance(fields, list) or not 0 < len(fields) <= 256:
            raise ValueError("schema: fields must be a list of 1-256 field maps")
        distribution = value["distribution"]
        if distribution is not None:
            if not isinstance(distribution, dict):
                raise ValueError("schema: distribution must be a map or None")
            if distribution_from_dict is None:
                raise ValueError(
                    "schema: has an action distribution; parse it with "
                    "oakemu_core.policy.schemas.schema_from_dict"
                )
            distribution = distribution_from_dict(distribution)
        parsed = [StepField.from_dict(f) for f in fields]
        names = [f.name for f in parsed]
        if "policy_revisions" not in names and "policy_versions" in names:
            # A schema saved before rows carried the revision (checkpoints of earlier runs).
            parsed.insert(names.index("policy_versions") + 1, _policy_revisions_field())
        return cls(tuple(parsed), distribution)

    def with_field(self, new: StepField) -> StepSchema:
        """A copy with one more field (e.g. a user's extra per-step data)."""
        return replace(self, fields=(*self.fields, new))

    def describe(self) -> str:
        """One line per field: name, shape, dtype, roles (for logs and error messages)."""
        lines = []
        for f in self.fields:
            roles = ",".join(r for r in ("sent", "stored", "minibatch") if getattr(f, r))
            lines.append(f"{f.name} {f.shape} {f.dtype} [{roles}]")
        return "; ".join(lines)


def _scalar(name: str, dtype: Any, **roles: Any) -> StepField:
    return StepField(name, (), np.dtype(dtype), **roles)


def _policy_revisions_field() -> StepField:
    return _scalar("policy_revisions", np.int64, sent=False, default=0)


def build_schema(
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
    distribution: ActionDistribution | None,
    *,
    action_shape: tuple[int, ...] | None = None,
    action_dtype: Any = None,
) -> StepSchema:
    """The step schema for an env's observations and a policy's action distribution.

    Args:
        observation_layout: observation key -> (per-env shape, dtype); key ``""`` for a plain
            observation, key paths (``"a.b"``) for a dict observation.
        distribution: the action distribution; its action shape/dtype, bounds, stored parameters
            and mask width decide the action fields. None: a plain schema whose actions have
            ``action_shape`` / ``action_dtype`` and no value checks.

    Raises:
        ValueError: an empty layout, or neither a distribution nor an action shape/dtype.
    """
    if not observation_layout:
        raise ValueError("observation_layout: expected at least one observation key")
    fields: list[StepField] = [
        StepField(observation_field_name(key), tuple(shape), np.dtype(dtype), minibatch=True)
        for key, (shape, dtype) in sorted(observation_layout.items())
    ]
    if distribution is not None:
        low, high = distribution.action_bounds()
        fields.append(
            StepField(
                "actions",
                distribution.action_shape,
                distribution.action_dtype,
                minibatch=True,
                low=low,
                high=high,
            )
        )
    else:
        if action_shape is None or action_dtype is None:
            raise ValueError(
                "build_schema: expected a distribution, or action_shape and action_dtype"
            )
        fields.append(
            StepField("actions", tuple(action_shape), np.dtype(action_dtype), minibatch=True)
        )
    # A discrete log probability is <= 0; a Gaussian density may exceed 1 (positive log prob).
    discrete = distribution is not None and distribution.kind != "diag_gaussian"
    fields += [
        _scalar(
            "log_probs",
            np.float32,
            minibatch=True,
            low=-1e4 if discrete else -MAX_ABS_STEP_VALUE,
            high=1e-3 if discrete else MAX_ABS_STEP_VALUE,
        ),
        _scalar(
            "values", np.float32, minibatch=True, low=-MAX_ABS_STEP_VALUE, high=MAX_ABS_STEP_VALUE
        ),
        _scalar("rewards", np.float32, low=-MAX_ABS_STEP_VALUE, high=MAX_ABS_STEP_VALUE),
        _scalar("dones", np.bool_),
        _scalar("truncated", np.bool_, stored=False),
        _scalar(
            "bootstrap_values",
            np.float32,
            default=0.0,
            low=-MAX_ABS_STEP_VALUE,
            high=MAX_ABS_STEP_VALUE,
        ),
        _scalar(
            "next_values",
            np.float32,
            stored=False,
            low=-MAX_ABS_STEP_VALUE,
            high=MAX_ABS_STEP_VALUE,
        ),
        _scalar("trainable", np.bool_, default=True),
    ]
    if distribution is not None:
        for name, (shape, dtype) in distribution.stored_fields().items():
            positive = name == "action_std"
            fields.append(
                StepField(
                    name,
                    shape,
                    dtype,
                    minibatch=True,
                    low=1e-12 if positive else -MAX_ABS_STEP_VALUE,
                    high=MAX_ABS_STEP_VALUE,
                )
            )
        if distribution.mask_width:
            fields.append(
                StepField(
                    "action_mask",
                    (distribution.mask_width,),
                    np.bool_,
                    minibatch=True,
                    mask_segments=_mask_segments(distribution),
                )
            )
    fields += [
        _scalar("policy_versions", np.int64, sent=False, minibatch=True, default=0),
        _policy_revisions_field(),
        _scalar("advantages", np.float32, sent=False, minibatch=True, default=0.0),
        _scalar("returns", np.float32, sent=False, minibatch=True, default=0.0),
    ]
    return StepSchema(tuple(fields), distribution)


def _mask_segments(distribution: ActionDistribution) -> tuple[int, ...]:
    if distribution.kind == "categorical":
        return (distribution.num_actions,)
    if distribution.kind == "multi_categorical":
        return distribution.nvec
    if distribution.kind == "bernoulli":
        return (2,) * distribution.num_bits
    raise ValueError(f"{distribution!r} has no action mask")


def default_schema(
    observation_shape: tuple[int, ...],
    observation_dtype: Any,
    action_shape: tuple[int, ...] = (),
    action_dtype: Any = np.int64,
) -> StepSchema:
    """The schema of ``RolloutBuffer(T, N, shape, dtype)``: one plain observation, actions without
    a declared distribution."""
    return build_schema(
        {"": (tuple(observation_shape), observation_dtype)},
        None,
        action_shape=tuple(action_shape),
        action_dtype=action_dtype,
    )


def resolve_schema(
    owner: str,
    schema: StepSchema | None,
    observation_shape: Sequence[int] | None,
    observation_dtype: Any,
    action_shape: Sequence[int] = (),
    action_dtype: Any = np.int64,
) -> StepSchema:
    """The schema of a constructor that takes the fields in one of two forms: the plain
    form (one observation shape and dtype, an action shape and dtype: :func:`default_schema`) or
    ``schema=`` (any observation and action space).

    Args:
        owner: the constructor's name, for error messages (``"RolloutBuffer"``).
        schema: the schema, or None for the plain form.
        observation_shape: shape of one observation, a tuple (or list) of non-negative ints.
        observation_dtype: dtype of observations, kept as is (e.g. ``np.uint8``).
        action_shape: shape of one action, ``()`` for a discrete action.
        action_dtype: dtype of actions.

    Raises:
        ValueError: neither form, both, or an observation shape that is not a sequence of
            non-negative ints.
    """
    if schema is not None:
        if observation_shape is not None or observation_dtype is not None:
            raise ValueError(
                f"{owner}: pass either schema= or observation_shape/observation_dtype, not both"
            )
        return schema
    if observation_shape is None or observation_dtype is None:
        raise ValueError(f"{owner}: expected observation_shape and observation_dtype, or schema=")
    if not isinstance(observation_shape, (tuple, list)) or any(
        isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0
        for d in observation_shape
    ):
        raise ValueError(
            f"observation_shape: expected a tuple of non-negative ints, received {observation_shape!r}"
        )
    return default_schema(
        tuple(observation_shape), observation_dtype, tuple(action_shape), action_dtype
    )


def check_step_consistency(schema: StepSchema, arrays: Mapping[str, np.ndarray]) -> str | None:
    """Rules that relate fields of one step (all ``(n, ...)`` arrays already of the right shape):

    * a truncated env is also done (``dones`` = terminated OR truncated);
    * ``bootstrap_values`` is 0 where the env was not truncated (a terminal state has no future);
      without ``truncated`` (a local writer: storage keeps truncation in ``dones`` and
      ``bootstrap_values`` only), 0 where the env is not done;
    * the action taken is allowed by the row's ``action_mask`` (masked actions are never taken).

    Returns:
        Why the step is impossible, or None.
    """
    truncated, dones = arrays.get("truncated"), arrays["dones"]
    if (
        truncated is None
    ):  # a local writer's step: storage keeps truncation in dones + bootstrap_values
        bootstrap = arrays.get("bootstrap_values")
        if bootstrap is not None and np.count_nonzero(bootstrap) and np.any(bootstrap[~dones] != 0):
            bad = np.flatnonzero((bootstrap != 0) & ~dones).tolist()
            return (
                f"bootstrap_values: expected 0 where dones is False (a bootstrap value belongs to a "
                f"truncated step), received non-zero values at positions {bad}"
            )
    else:
        bootstrap = arrays["bootstrap_values"]
        if (
            truncated.size <= SMALL_ARRAY_SIZE
        ):  # a few envs: plain Python is cheaper than numpy calls
            flags = truncated.ravel().tolist()
            if not any(
                flags
            ):  # the usual step: nothing truncated, so every bootstrap value must be 0
                truncated_not_done, bootstrap_not_truncated = False, any(bootstrap.ravel().tolist())
            else:
                rows = list(zip(flags, dones.ravel().tolist(), bootstrap.ravel().tolist()))
                truncated_not_done = any(t and not d for t, d, _ in rows)
                bootstrap_not_truncated = any(b != 0 and not t for t, _, b in rows)
        else:
            truncated_not_done = bool(np.any(truncated & ~dones))
            bootstrap_not_truncated = bool(np.any(bootstrap[~truncated] != 0))
        if truncated_not_done:
            return (
                "truncated: every truncated env must also be done (dones = terminated OR truncated)"
            )
        if bootstrap_not_truncated:
            return "bootstrap_values: expected 0 on rows that were not truncated"
    mask = arrays.get("action_mask")
    if mask is not None and schema.distribution is not None:
        allowed = taken_action_allowed(schema.distribution, arrays["actions"], mask)
        if not allowed.all():
            env = int(np.flatnonzero(~allowed)[0])
            return f"actions: env {env} took an action its action_mask forbids"
    return None


def check_step_values(schema: StepSchema, arrays: Mapping[str, np.ndarray]) -> None:
    """Check one step's values for a writer that is not behind the wire (``RolloutBuffer.add``,
    the per-step write) with the checks :func:`oakemu_core.transport.steps.decode_step` applies
    to a step message: floats finite; :meth:`StepField.check_values` of the
    :attr:`~StepSchema.action_fields` (actions within the action space, distribution parameters in
    range, masks that allow something); then :func:`check_step_consistency` (truncation rules,
    masked actions never taken).

    The wire's magnitude limit on the other fields (rewards, values, log probabilities:
    :data:`MAX_ABS_STEP_VALUE`) guards the learner against garbage from the network; a local
    writer may store any finite number there.

    Args:
        schema: the step schema.
        arrays: field name -> ``(n, *shape)`` array of the field's dtype and shape (checked before,
            e.g. by :meth:`StepSchema.check_arrays`); at least ``dones`` (and ``actions`` with an
            ``action_mask``).

    Raises:
        ValueError: the first impossible value; the message names the field.
    """
    for name, array in arrays.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ValueError(f"{name}: expected finite values, received NaN or inf")
    for item in schema.action_fields:
        problem = None if item.name not in arrays else item.check_values(arrays[item.name])
        if problem is not None:
            raise ValueError(problem)
    problem = check_step_consistency(schema, arrays)
    if problem is not None:
        raise ValueError(problem)


def taken_action_allowed(
    distribution: ActionDistribution, actions: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """``(n,)`` bool: whether each row's action is allowed by its ``(n, mask_width)`` mask."""
    rows = np.arange(actions.shape[0])
    if distribution.kind == "categorical":
        return mask[rows, actions.astype(np.int64)]
    if distribution.kind == "multi_categorical":
        offsets = np.concatenate([[0], np.cumsum(distribution.nvec)[:-1]])
        columns = actions.astype(np.int64) + offsets
        return np.take_along_axis(mask, columns, axis=1).all(axis=1)
    if distribution.kind == "bernoulli":
        columns = 2 * np.arange(distribution.num_bits) + actions.astype(np.int64)
        return np.take_along_axis(mask, columns, axis=1).all(axis=1)
    return np.ones(actions.shape[0], dtype=bool)
