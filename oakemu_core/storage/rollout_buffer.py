"""The learner's rollout storage: preallocated shared-memory arrays, one checked write, GAE.

Every *stored* field of the buffer's :class:`~oakemu_core.step_schema.StepSchema` is one
``(T, N, *shape)`` array (``T = rollout_length`` rows, ``N = num_envs`` columns, one column per
environment), in the field's own dtype (uint8 frames stay uint8): observations (one array per
dict key), actions, log_probs, values, rewards, dones, bootstrap_values, trainable,
policy_versions, policy_revisions, advantages, returns, and whatever the action distribution adds
(``action_mask``, ``action_mean``, ``action_std``). Two bookkeeping arrays complete it:
``column_steps`` ``(N,)`` (rows written so far in each column) and ``meta`` (write counters). The
field list lives in the schema only; this module never names a distribution's fields.

The arrays are :class:`~oakemu_core.storage.shared_fields.SharedFields` owned by this buffer: it
alone unlinks the segments (``close()``, context-manager exit, garbage collection, interpreter exit).

One way in, one way out (Stable-Baselines3's ``add`` / ``get``): :meth:`RolloutBuffer.write` is
the only write, :meth:`RolloutBuffer.flat_batch` the only read for PPO
(:mod:`oakemu_core.storage.batches`); the seed API's :meth:`~RolloutBuffer.add` and
:meth:`~RolloutBuffer.get_minibatches` are thin layers over them. Unlike Stable-Baselines3's
buffers, observations are never cast to float32 (4x the memory for Atari frames), one class serves
plain and dict observations and every action space (no subclass per variant), user errors raise
``ValueError`` naming the field instead of failing an ``assert``, and reading minibatches never
changes the stored arrays.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.step_schema import StepSchema, check_array, check_step_values, resolve_schema
from oakemu_core.storage import gae
from oakemu_core.storage.batches import (
    FlatBatch,
    RolloutBufferTrainableDiagnostics,
    RolloutMinibatch,
    StaleAdvantagesError,
    normalize_advantages,
)
from oakemu_core.storage.memory import RolloutBufferMemoryDiagnostic, rollout_memory_pressure
from oakemu_core.storage.shared_fields import SHM_DIR, SharedFields, layout_bytes

if TYPE_CHECKING:  # torch is imported lazily: actors and tools can use the buffer without it
    import torch

__all__ = [
    "FlatBatch",
    "RolloutBuffer",
    "RolloutBufferTrainableDiagnostics",
    "RolloutMinibatch",
    "StaleAdvantagesError",
    "checked_columns",
    "column_index",
    "normalize_advantages",
]

_GENERATION, _MASK_GENERATION, _GAE_GENERATION = 0, 1, 2
"""Slots of the ``meta`` array: data writes, trainable-mask changes, data generation at GAE."""
_COMPUTED = ("policy_versions", "policy_revisions", "advantages", "returns")
"""Stored fields the buffer fills itself (:meth:`RolloutBuffer.write` stamps the versions,
:meth:`RolloutBuffer.compute_gae` the advantages and returns); a writer provides the others."""


def column_index(columns: np.ndarray) -> slice | np.ndarray:
    """How to index ``(K,)`` int64 buffer ``columns``: a slice when they are consecutive (a plain
    strided copy, several times cheaper than numpy's fancy-index assignment), else the array itself."""
    listed = columns.tolist()
    if listed and listed == list(range(listed[0], listed[0] + len(listed))):
        return slice(listed[0], listed[0] + len(listed))
    return columns


def checked_columns(columns: Any, num_columns: int) -> tuple[np.ndarray, slice | np.ndarray]:
    """``(columns as int64, their index)`` (:func:`column_index`) after checking them: a 1-D
    integer array of distinct indices in ``[0, num_columns)`` (in Python: an actor has a few to a
    few hundred columns).

    Raises:
        ValueError: naming what is wrong with ``columns``.
    """
    if not isinstance(columns, np.ndarray) or columns.ndim != 1 or not np.issubdtype(columns.dtype, np.integer):
        received = f"shape {columns.shape} dtype {columns.dtype}" if isinstance(columns, np.ndarray) else type(columns).__name__
        raise ValueError(f"columns: expected a 1-D integer numpy array, received {received}")
    listed = columns.tolist()
    if listed and (min(listed) < 0 or max(listed) >= num_columns):
        raise ValueError(f"columns: expected indices in [0, {num_columns}), received {listed}")
    if len(set(listed)) != len(listed):
        raise ValueError(f"columns: expected distinct indices, received {listed}")
    columns = columns.astype(np.int64, copy=False)
    return columns, column_index(columns)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, received {value!r}")
    return int(value)


def _check_non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, received {value!r}")
    return int(value)


def _array_layout(rollout_length: int, num_envs: int, schema: StepSchema) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """``{array name: (shape, dtype)}`` of every array a buffer allocates: each stored field of
    ``schema`` as ``(T, N, *shape)``, plus ``column_steps`` ``(N,)`` and ``meta`` ``(3,)``.

    Raises:
        ValueError: for a non-positive ``rollout_length`` / ``num_envs``.
    """
    rows = (_check_positive_int("rollout_length", rollout_length), _check_positive_int("num_envs", num_envs))
    layout = {f.name: (rows + f.shape, f.dtype) for f in schema.stored}
    layout["column_steps"] = ((rows[1],), np.dtype(np.int64))
    layout["meta"] = ((3,), np.dtype(np.int64))
    return layout


def _merge_leading(value: Any, lead: tuple[int, ...]) -> Any:
    """A ``(*lead, *shape)`` array as ``(prod(lead), *shape)`` (a view where numpy can); anything
    else unchanged, for the shape check to name."""
    if not isinstance(value, np.ndarray) or value.shape[:len(lead)] != lead:
        return value
    return value.reshape(math.prod(lead), *value.shape[len(lead):])


class _StoredField:
    """A read-only ``(T, N, *shape)`` view of one stored array, read as an attribute of the buffer
    (``buffer.rewards``); the attribute's name is the array's name."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, buffer: RolloutBuffer | None, owner: type | None = None) -> Any:
        return self if buffer is None else buffer._view(self.name)

    def __set__(self, buffer: RolloutBuffer, value: Any) -> None:
        raise AttributeError(f"{self.name} is a read-only view; write rows with RolloutBuffer.write")


class RolloutBuffer:
    """Fixed-size PPO rollout storage in shared memory, filled row by row, read as minibatches.

    A buffer holds ``rollout_length`` rows for each of ``num_envs`` columns. :meth:`write` writes
    rows of some columns (each column stays contiguous: row ``t`` is written after rows
    ``0..t-1``); the seed API's :meth:`add` writes one row of all columns through it. When every
    column holds ``rollout_length`` rows the buffer :attr:`is_full`; then :meth:`compute_gae`
    fills :attr:`advantages` and :attr:`returns`, and :meth:`flat_batch` serves the trainable rows
    (:meth:`get_minibatches` splits it). :meth:`reset` empties it for the next rollout without
    reallocating.

    Two ways to describe the fields (:func:`~oakemu_core.step_schema.resolve_schema`): the seed
    API's plain form ``RolloutBuffer(rollout_length, num_envs, observation_shape,
    observation_dtype)`` (plus ``action_shape`` / ``action_dtype``), or ``schema=`` a
    :class:`StepSchema` (any observation and action space: dict observations, masks, Gaussian
    parameters).

    Args:
        rollout_length: rows per column (``T``), positive.
        num_envs: columns (``N``), positive.
        observation_shape: shape of one observation, e.g. ``(4, 84, 84)`` (plain form).
        observation_dtype: dtype of observations, kept as is (e.g. ``np.uint8``) (plain form).
        action_shape: shape of one action, ``()`` for a discrete action (plain form).
        action_dtype: dtype of actions (plain form).
        schema: the step schema; replaces the four arguments above.
        seed: seed of the shuffle generator used when :meth:`get_minibatches` gets none.
        shm_dir: directory of POSIX shared memory, checked for capacity and swept.

    Raises:
        ValueError: a non-positive length / env count, neither a schema nor an observation
            shape/dtype, or both.
        SharedMemoryTooSmallError: when ``shm_dir`` has less free space than :attr:`memory_bytes`.
    """

    def __init__(
        self,
        rollout_length: int,
        num_envs: int,
        observation_shape: tuple[int, ...] | None = None,
        observation_dtype: Any = None,
        *,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
        schema: StepSchema | None = None,
        seed: int | None = None,
        shm_dir: str | os.PathLike[str] = SHM_DIR,
    ) -> None:
        schema = resolve_schema("RolloutBuffer", schema, observation_shape, observation_dtype,
                                action_shape, action_dtype)
        self._fields = SharedFields(_array_layout(rollout_length, num_envs, schema), shm_dir)
        self.schema = schema
        # Computed once (the schema never changes): every write goes by them.
        self._writable = tuple(f for f in schema.stored if f.name not in _COMPUTED)
        self._sent_only = tuple(f for f in schema.sent if not f.stored)  # truncated, next_values
        # Writable fields actors do not send (a schema's own additions): a validated write stores their defaults.
        self._unsent_defaults = {f.name: f.default for f in self._writable if not f.sent}
        self._rollout_length = int(rollout_length)
        self._num_envs = int(num_envs)
        self._all_columns = np.arange(self._num_envs, dtype=np.int64)
        self._arrays = self._fields.arrays  # writable: this buffer's writes only
        self._views = self._fields.views  # read-only: what the buffer hands out
        self._arrays["meta"][_GAE_GENERATION] = -1
        self._closed = False
        self._flat_cache: tuple[tuple[Any, ...], FlatBatch] | None = None
        self._observation_uploads = 0
        self._rng = np.random.default_rng(seed)
        self._shm_dir = Path(shm_dir)

    @staticmethod
    def estimate_memory_bytes(rollout_length: int, num_envs: int, schema: StepSchema) -> int:
        """Shared-memory bytes a buffer with these arguments allocates (its :attr:`memory_bytes`)."""
        return layout_bytes(_array_layout(rollout_length, num_envs, schema))

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Release the mappings and unlink the segments (idempotent).

        Arrays read from the buffer before stay readable (the memory is unmapped when the last of
        them is freed); every buffer method raises ``RuntimeError`` afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self._flat_cache = None
        self._views = {}
        self._arrays = {}
        self._fields.close()

    def __enter__(self) -> RolloutBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> None:
        raise TypeError("RolloutBuffer cannot be pickled: it owns shared-memory segments")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self.step}/{self._rollout_length}"
        return (f"RolloutBuffer(rollout_length={self._rollout_length}, num_envs={self._num_envs}, "
                f"fields={list(self.schema.names)}, {state})")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RolloutBuffer is closed")

    def _view(self, name: str) -> np.ndarray:
        self._check_open()
        return self._views[name]

    def _bump(self, slot: int) -> None:
        self._arrays["meta"][slot] += 1

    # ------------------------------------------------------------------ properties
    @property
    def rollout_length(self) -> int:
        """Rows per column (``T``)."""
        return self._rollout_length

    @property
    def num_envs(self) -> int:
        """Columns (``N``), one per environment."""
        return self._num_envs

    @property
    def observation_shape(self) -> Any:
        """Shape of one observation; for dict observations a dict key -> shape."""
        shapes = {self.schema.observation_key(n): self.schema[n].shape for n in self.schema.observation_names}
        return shapes[""] if not self.schema.is_dict_observation else shapes

    @property
    def observation_dtype(self) -> Any:
        """Dtype of stored observations; for dict observations a dict key -> dtype."""
        dtypes = {self.schema.observation_key(n): self.schema[n].dtype for n in self.schema.observation_names}
        return dtypes[""] if not self.schema.is_dict_observation else dtypes

    @property
    def action_shape(self) -> tuple[int, ...]:
        """Shape of one action (``()`` for discrete actions)."""
        return self.schema["actions"].shape

    @property
    def action_dtype(self) -> np.dtype[Any]:
        """Dtype of stored actions."""
        return self.schema["actions"].dtype

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def step(self) -> int:
        """Rows written in every column: the row :meth:`add` writes next (min of :attr:`column_steps`)."""
        return int(self._view("column_steps").min())

    @property
    def is_full(self) -> bool:
        """True when every column holds ``rollout_length`` rows."""
        return bool(np.all(self._view("column_steps") == self._rollout_length))

    @property
    def total_size(self) -> int:
        """Transitions the buffer holds when full: ``rollout_length * num_envs``."""
        return self._rollout_length * self._num_envs

    @property
    def trainable_size(self) -> int:
        """Written rows that are trainable (what :meth:`get_minibatches` serves)."""
        return int(np.count_nonzero(self._view("trainable")))

    @property
    def memory_bytes(self) -> int:
        """Bytes of all preallocated arrays (shared memory): the sum of their ``nbytes``."""
        self._check_open()
        return self._fields.nbytes

    @property
    def memory_gb(self) -> float:
        """:attr:`memory_bytes` in GiB."""
        return self.memory_bytes / 1024**3

    @property
    def observation_uploads(self) -> int:
        """How many times this buffer uploaded its observations to a device (flat-batch cache misses)."""
        return self._observation_uploads

    # ------------------------------------------------------------------ views
    def field(self, name: str) -> np.ndarray:
        """Read-only ``(T, N, *shape)`` view of any stored field (or ``column_steps``) by name.

        Raises:
            KeyError: not a stored field of this buffer's schema.
        """
        self._check_open()
        if name not in self._views or name == "meta":
            raise KeyError(f"{name!r}: not a stored field; stored fields are {[f.name for f in self.schema.stored]}")
        return self._views[name]

    @property
    def observations(self) -> Any:
        """``(T, N, *observation_shape)``, or for dict observations a dict key -> array; read-only."""
        return self.schema.join_observations({n: self._view(n) for n in self.schema.observation_names})

    # Read-only views of the standard fields by attribute; any stored field by name: field().
    actions = _StoredField("``(T, N, *action_shape)`` action dtype, a_t as sampled.")
    log_probs = _StoredField("``(T, N)`` float32, log pi(a_t | s_t) of the acting policy.")
    values = _StoredField("``(T, N)`` float32, V(s_t) of the acting policy (the learner's critic after replace_values).")
    rewards = _StoredField("``(T, N)`` float32, r_t.")
    dones = _StoredField("``(T, N)`` bool, the episode ended on step t (terminated OR truncated).")
    bootstrap_values = _StoredField("``(T, N)`` float32, V(true final observation) on truncated steps, else 0.")
    trainable = _StoredField("``(T, N)`` bool, the row may enter a minibatch (see mark_untrainable).")
    policy_versions = _StoredField("``(T, N)`` int64, version of the weights that chose each action.")
    policy_revisions = _StoredField(
        "``(T, N)`` int64, revision of those weights within the update that made the next version "
        "(0: the version's own weights; 1, 2, ...: weights published during that update).")
    advantages = _StoredField("``(T, N)`` float32, unnormalised GAE advantages from compute_gae.")
    returns = _StoredField("``(T, N)`` float32, ``advantages + values`` from compute_gae.")
    column_steps = _StoredField("``(N,)`` int64, rows written so far in each column.")

    # ------------------------------------------------------------------ writing
    def add(
        self,
        observations: Any,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        trainable: np.ndarray | None = None,
        *,
        action_masks: np.ndarray | None = None,
        bootstrap_values: np.ndarray | None = None,
        policy_version: int = 0,
        policy_revision: int = 0,
        **fields: np.ndarray,
    ) -> None:
        """Write one row for all envs at row :attr:`step` (the seed API; :meth:`write` for all
        columns, so checked the same way before anything is written; there is no silent cast).

        Args:
            observations: ``(N, *observation_shape)`` observation dtype, s_t; a dict key ->
                array for dict observations.
            actions: ``(N, *action_shape)`` action dtype, a_t; allowed by its action mask.
            log_probs: ``(N,)`` float32, log pi(a_t | s_t).
            values: ``(N,)`` float32, V(s_t).
            rewards: ``(N,)`` float32, r_t.
            dones: ``(N,)`` bool, the episode ended on this step (terminated OR truncated).
            trainable: ``(N,)`` bool or None (all trainable). False stores the step for GAE and
                bookkeeping but keeps it out of every minibatch.
            action_masks: ``(N, mask width)`` bool, the schema's ``action_mask`` field (the name
                of sb3-contrib's ``MaskableRolloutBuffer.add``); each row allows at least one
                action of every segment.
            bootstrap_values: ``(N,)`` float32 or None (zeros): V(true final observation) where
                the episode was truncated on this step, 0 elsewhere (also where terminated).
            policy_version: version of the weights that chose the actions, >= 0.
            policy_revision: their revision within the update running on that version, >= 0
                (:attr:`policy_revisions`).
            **fields: the schema's other fields by name, e.g. ``action_mask=`` (as
                ``action_masks``), ``action_mean=`` / ``action_std=`` ``(N, d)`` float32.

        Raises:
            ValueError: as :meth:`write` (the message names the field, expected and received), the
                masks given twice, or columns at different steps (use :meth:`write`).
            OverflowError: when the buffer is full.
        """
        self._check_open()
        steps = self._arrays["column_steps"]
        step = int(steps.min())
        if int(steps.max()) != step:
            raise ValueError(
                f"add: expected every column at the same step, received column_steps from {step} to "
                f"{int(steps.max())}; use write for columns filled separately"
            )
        if step >= self._rollout_length:
            raise OverflowError(f"RolloutBuffer is full ({self._rollout_length} rows); call reset() first")
        if action_masks is not None:
            if "action_mask" in fields:
                raise ValueError("action_masks: received the masks twice (as action_masks= and action_mask=)")
            fields["action_mask"] = action_masks
        named = {**self.schema.split_observations(observations), "actions": actions, "log_probs": log_probs,
                 "values": values, "rewards": rewards, "dones": dones, "trainable": trainable,
                 "bootstrap_values": bootstrap_values, **fields}
        self.write(step, slice(None), {k: v for k, v in named.items() if v is not None},
                   policy_version=policy_version, policy_revision=policy_revision)

    def write(
        self,
        step_index: int,
        columns: slice | np.ndarray,
        fields: Mapping[str, np.ndarray],
        *,
        rows: int | None = None,
        policy_version: int = 0,
        policy_revision: int = 0,
        validated: bool = False,
    ) -> None:
        """Write row ``step_index`` (``rows`` None) or rows ``step_index .. step_index + rows - 1``
        of some columns (an actor's envs, mapped to buffer columns): the buffer's one write.

        Every listed column must hold exactly ``step_index`` rows, so columns stay contiguous.
        ``fields[name][i]`` (``fields[name][r, i]`` with ``rows``) goes to column ``columns[i]``.
        Everything is checked before anything is written, as
        :func:`~oakemu_core.transport.steps.decode_step` checks a step message: the columns, the
        field names, dtypes and shapes (:meth:`~oakemu_core.step_schema.StepSchema.check_arrays`),
        the values (:func:`~oakemu_core.step_schema.check_step_values`: finite floats, bounds,
        masks, truncation rules, masked actions), the policy version and revision. With
        ``validated=True`` (fields that ``decode_step`` checked against this schema: the
        :class:`~oakemu_core.storage.assembler.RolloutAssembler` refuses any other spec at join),
        only the row bookkeeping is checked: checking a step message twice would cost a third of
        the write.

        Args:
            step_index: the first row to write, >= 0.
            columns: the ``K`` buffer columns: a ``(K,)`` integer array of distinct indices in
                ``[0, num_envs)``, or a slice of consecutive columns (:func:`column_index`).
            fields: field name -> ``(K, *shape)`` array, ``(rows, K, *shape)`` with ``rows``: every
                writable stored field (those with a default, ``trainable`` and
                ``bootstrap_values``, may be left out); ``truncated`` and ``next_values`` (sent by
                actors, not stored: storage keeps truncation in ``dones`` and
                ``bootstrap_values``) are checked when present, then dropped.
            rows: None for one row, else the number of consecutive rows in ``fields``, >= 1.
            policy_version: version of the weights that chose the actions, >= 0.
            policy_revision: their revision within the update running on that version, >= 0
                (:attr:`policy_revisions`).
            validated: the fields passed ``decode_step`` against this schema; nothing but the rows
                is checked (a wrong shape is broadcast where numpy can, or raises after earlier
                fields were written).

        Raises:
            ValueError: bad ``columns``, ``step_index`` or ``rows``, a column not holding
                ``step_index`` rows, a wrong, missing or unknown field, an impossible value, or a
                negative policy version or revision; the message names what is wrong.
            OverflowError: when ``step_index + rows > rollout_length``.
        """
        self._check_open()
        if validated:
            self._check_rows_free(step_index, rows, columns)
            if self._unsent_defaults:
                fields = {**fields, **self._unsent_defaults}
            self._store(step_index, rows, columns, fields, policy_version, policy_revision)
            return
        if isinstance(columns, slice):  # consecutive columns: nothing to check but the fields' K
            index, k = columns, len(self._all_columns[columns])
        else:
            columns, index = checked_columns(columns, self._num_envs)
            k = len(columns)
        _check_non_negative_int("step_index", step_index)
        if rows is not None:
            _check_positive_int("rows", rows)
        self._check_rows_free(int(step_index), rows, index)
        complete = self._checked_fields(fields, rows, k)
        version = _check_non_negative_int("policy_version", policy_version)
        revision = _check_non_negative_int("policy_revision", policy_revision)
        self._store(int(step_index), rows, index, complete, version, revision)

    def _check_rows_free(self, step_index: int, rows: int | None, index: slice | np.ndarray) -> None:
        """Raise unless the ``rows`` (None: one) from ``step_index`` fit and are the next ones of every column."""
        if step_index + (rows or 1) > self._rollout_length:
            raise OverflowError(f"step_index: expected step_index + rows <= rollout_length {self._rollout_length}, "
                                f"received step_index {step_index} + {rows or 1} rows")
        held = self._arrays["column_steps"][index]
        if (held != step_index).any():  # the method: np.any's dispatch costs as much again
            wrong = held != step_index
            raise ValueError(
                f"columns: expected every column to hold step_index={step_index} rows, received "
                f"columns {self._all_columns[index][wrong].tolist()} holding {held[wrong].tolist()} rows"
            )

    def _checked_fields(self, fields: Mapping[str, Any], rows: int | None, k: int) -> dict[str, np.ndarray]:
        """Every writable field of ``fields`` (``(K, ...)`` arrays, ``(rows, K, ...)`` with
        ``rows``) after the checks of :meth:`write`, defaults filled in, in the shape given."""
        lead = (k,) if rows is None else (rows, k)
        count = math.prod(lead)
        flat = dict(fields) if rows is None else {name: _merge_leading(v, lead) for name, v in fields.items()}
        sent_only = {f.name: flat.pop(f.name) for f in self._sent_only if f.name in flat}
        self.schema.check_arrays(flat, count, self._writable)
        for name, value in sent_only.items():
            check_array(name, value, (count, *self.schema[name].shape), self.schema[name].dtype)
        complete = {}
        for item in self._writable:
            value = flat.get(item.name)
            complete[item.name] = np.full((count, *item.shape), item.default, item.dtype) if value is None else value
        check_step_values(self.schema, {**complete, **sent_only})
        if rows is None:
            return complete
        return {name: value.reshape(*lead, *value.shape[1:]) for name, value in complete.items()}

    def _store(self, row0: int, rows: int | None, index: slice | np.ndarray, fields: Mapping[str, np.ndarray],
               version: int, revision: int) -> None:
        """Copy every writable field into row ``row0`` (``rows`` None) or rows ``row0 .. row0 +
        rows - 1`` of the columns ``index``, stamp the policy version, count the rows. No checks."""
        at = row0 if rows is None else slice(row0, row0 + rows)
        arrays = self._arrays
        for item in self._writable:
            arrays[item.name][at, index] = fields[item.name]
        arrays["policy_versions"][at, index] = version
        arrays["policy_revisions"][at, index] = revision
        arrays["column_steps"][index] += 1 if rows is None else rows
        self._bump(_GENERATION)

    # ------------------------------------------------------------------ edits
    def reset_columns(self, columns: np.ndarray) -> None:
        """Discard every row of some columns (the unfinished segment of a dropped actor).

        Their :attr:`column_steps` become 0 and their rows are no longer trainable.

        Raises:
            ValueError: bad ``columns`` (see :func:`checked_columns`).
        """
        self._check_open()
        self._empty(checked_columns(columns, self._num_envs)[1])

    def mark_untrainable(self, mask: np.ndarray) -> int:
        """Exclude the rows where ``mask`` is True from training (e.g. policy lag too large).

        Args:
            mask: ``(T, N)`` bool.

        Returns:
            How many rows were trainable before and are not any more.

        Raises:
            ValueError: wrong shape or dtype of ``mask``.
        """
        self._check_open()
        check_array("mask", mask, (self._rollout_length, self._num_envs), np.dtype(np.bool_))
        trainable = self._arrays["trainable"]
        cleared = int(np.count_nonzero(trainable & mask))
        trainable[mask] = False
        self._bump(_MASK_GENERATION)
        return cleared

    def scale_rewards(self, factor: float) -> None:
        """Multiply every stored reward by ``factor`` (reward scaling before GAE; see
        :class:`oakemu_core.algo.normalization.RewardScaler`).

        Raises:
            ValueError: a non-finite or non-positive factor.
        """
        self._check_open()
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor: expected a finite positive float, received {factor!r}")
        self._arrays["rewards"] *= np.float32(factor)
        self._bump(_GENERATION)

    def replace_values(self, values: np.ndarray) -> None:
        """Overwrite every stored V(s_t) (the learner's critic re-evaluating rows that an older
        policy version acted; :meth:`compute_gae` must run again afterwards).

        Args:
            values: ``(T, N)`` float32, finite.

        Raises:
            ValueError: a wrong shape or dtype, or a non-finite value.
        """
        self._check_open()
        check_array("values", values, (self._rollout_length, self._num_envs), np.dtype(np.float32))
        if not np.isfinite(values).all():
            raise ValueError("values: expected finite values, received NaN or inf")
        self._arrays["values"][...] = values
        self._bump(_GENERATION)

    def reset(self) -> None:
        """Empty the buffer for the next rollout, keeping its memory (no reallocation)."""
        self._check_open()
        self._empty(slice(None))
        self._arrays["meta"][_GAE_GENERATION] = -1

    def seal_columns(self, index: np.ndarray) -> None:
        """Count the columns ``index`` (``(k,)`` int64, holding no rows) as full with no trainable
        row: a rollout trained with fewer columns than the buffer has. GAE then reads zero
        rewards, values and dones there; the other fields are never read for them.

        Raises:
            ValueError: a column of ``index`` already holds rows.
        """
        self._check_open()
        arrays = self._arrays
        if np.any(arrays["column_steps"][index]):
            raise ValueError("seal_columns: expected empty columns, received columns that hold rows")
        self._empty(index)
        for name in ("rewards", "values"):
            arrays[name][:, index] = 0.0
        arrays["column_steps"][index] = self._rollout_length

    def _empty(self, index: slice | np.ndarray) -> None:
        """Forget every row of the columns ``index``: no rows held, none trainable, no episode
        ends or bootstrap values left for GAE (the other fields are overwritten before they are read)."""
        arrays = self._arrays
        arrays["column_steps"][index] = 0
        arrays["trainable"][:, index] = False
        arrays["dones"][:, index] = False
        arrays["bootstrap_values"][:, index] = 0.0
        self._bump(_GENERATION)

    # ------------------------------------------------------------------ GAE
    def compute_gae(self, last_values: np.ndarray, last_dones: np.ndarray, gamma: float, gae_lambda: float) -> None:
        """Fill :attr:`advantages` and :attr:`returns` with GAE over the full rollout.

        See :func:`oakemu_core.storage.gae.compute_gae` for the formula (Schulman et al. 2016, with a
        bootstrap term for truncated steps). ``V_T = last_values``.

        Args:
            last_values: ``(N,)`` float32, V(observation after the last row) of each column.
            last_dones: ``(N,)`` bool, must equal ``dones[-1]``: whether the last row ended its
                episode. Checked because mixing the "done on step t" and "done before step t"
                conventions silently corrupts advantages.
            gamma: discount factor in ``[0, 1]``.
            gae_lambda: GAE lambda in ``[0, 1]``.

        Raises:
            ValueError: the buffer is not full, a wrong shape/dtype, ``last_dones != dones[-1]``,
                or gamma/lambda outside ``[0, 1]``.
        """
        self._check_open()
        if not self.is_full:
            steps = self._arrays["column_steps"]
            raise ValueError(
                f"compute_gae: expected a full buffer ({self._rollout_length} rows in every column), "
                f"received column_steps from {int(steps.min())} to {int(steps.max())}"
            )
        check_array("last_values", last_values, (self._num_envs,), np.dtype(np.float32))
        check_array("last_dones", last_dones, (self._num_envs,), np.dtype(np.bool_))
        dones = self._arrays["dones"]
        mismatch = np.flatnonzero(last_dones != dones[-1])
        if mismatch.size:
            raise ValueError(
                f"last_dones: expected to equal dones[-1] (did the last row end its episode?), "
                f"received {last_dones[mismatch].tolist()} where dones[-1] is "
                f"{dones[-1][mismatch].tolist()} at columns {mismatch.tolist()}"
            )
        advantages, returns = gae.compute_gae(
            self._arrays["rewards"], self._arrays["values"], dones, self._arrays["bootstrap_values"],
            last_values, gamma, gae_lambda,
        )
        self._arrays["advantages"][...] = advantages
        self._arrays["returns"][...] = returns
        meta = self._arrays["meta"]
        meta[_GAE_GENERATION] = meta[_GENERATION]

    @property
    def advantages_are_current(self) -> bool:
        """True when :meth:`compute_gae` ran after the last write, reset or column reset."""
        meta = self._view("meta")
        return bool(meta[_GAE_GENERATION] == meta[_GENERATION])

    def normalized_advantages(self) -> np.ndarray:
        """``(T, N)`` float32 advantages normalised over trainable rows (0 on the others).

        See :func:`normalize_advantages`.
        """
        return normalize_advantages(self._view("advantages"), self._view("trainable"))

    def trainable_diagnostics(self) -> RolloutBufferTrainableDiagnostics | None:
        """Flattened values, returns and advantages of the trainable rows, for learner logging.

        Returns:
            The arrays (copies, row-major ``(t, env)`` order), or None when no row is trainable.
        """
        trainable = self._view("trainable")
        if not trainable.any():
            return None
        return RolloutBufferTrainableDiagnostics(
            values=self._view("values")[trainable],
            returns=self._view("returns")[trainable],
            advantages=self._view("advantages")[trainable],
        )

    # ------------------------------------------------------------------ minibatches
    def flat_batch(self, device: torch.device | str, *, normalize_advantages: bool = False) -> FlatBatch:
        """The trainable rows of every minibatch field, flattened and on ``device``: what PPO reads.

        Built once per buffer state and device (cached until the next write, reset or mask
        change): each field's trainable rows are gathered on the CPU and uploaded once, so the
        epochs of an update cost no further transfers (:attr:`observation_uploads` counts the
        uploads). The stored arrays are never modified. Empty (``size`` 0) when no row is trainable.

        Args:
            device: torch device for the tensors.
            normalize_advantages: normalise advantages over the trainable rows
                (:func:`~oakemu_core.storage.batches.normalize_advantages`); otherwise they are
                served unnormalised.

        Raises:
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        import torch

        self._check_open()
        if not self.advantages_are_current:
            raise StaleAdvantagesError(
                "minibatches: the advantages are stale; call compute_gae() after the last write or reset")
        torch_device = torch.device(device)
        meta = self._arrays["meta"]
        key = (int(meta[_GENERATION]), int(meta[_MASK_GENERATION]), str(torch_device), bool(normalize_advantages))
        if self._flat_cache is not None and self._flat_cache[0] == key:
            return self._flat_cache[1]
        self._flat_cache = None  # free the old upload before making the new one
        trainable = self._arrays["trainable"].copy()  # a private copy: the shared mask may change
        batch = FlatBatch.gather(self.schema, self._arrays, trainable, torch_device, normalize=normalize_advantages)
        self._observation_uploads += 1
        self._flat_cache = (key, batch)
        return batch

    def get_minibatches(
        self,
        num_minibatches: int,
        device: torch.device | str,
        *,
        normalize_advantages: bool = False,
        generator: np.random.Generator | None = None,
    ) -> list[RolloutMinibatch]:
        """Split the trainable rows into shuffled minibatches of tensors on ``device`` (the seed
        API: :meth:`flat_batch` then :meth:`FlatBatch.minibatches`).

        Every trainable row appears exactly once per call; sizes differ by at most one (no row
        dropped, no small tail). The flat batch behind them is built once per buffer state, so
        calling this once per epoch uploads nothing more.

        Args:
            num_minibatches: number of minibatches, ``1 <= num_minibatches <= trainable_size``.
            device: torch device for the tensors.
            normalize_advantages: normalise advantages over the trainable rows first.
            generator: numpy generator for the shuffle; the buffer's own (seeded at
                construction) when None.

        Returns:
            ``num_minibatches`` :class:`RolloutMinibatch` es.

        Raises:
            ValueError: ``num_minibatches`` not a positive int or larger than the trainable rows.
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        batch = self.flat_batch(device, normalize_advantages=normalize_advantages)
        return batch.minibatches(num_minibatches, generator if generator is not None else self._rng)

    # ------------------------------------------------------------------ memory
    def estimate_memory_pressure(self, num_minibatches: int) -> list[RolloutBufferMemoryDiagnostic]:
        """Project the CPU, ``/dev/shm`` and CUDA memory a rollout of this buffer and one PPO update
        need (:func:`~oakemu_core.storage.memory.rollout_memory_pressure`).

        Args:
            num_minibatches: PPO minibatches per epoch, positive.

        Returns:
            One :class:`RolloutBufferMemoryDiagnostic` per resource.

        Raises:
            ValueError: if ``num_minibatches`` is not a positive int.
        """
        self._check_open()
        _check_positive_int("num_minibatches", num_minibatches)
        cached = 0 if self._flat_cache is None else sum(
            t.numel() * t.element_size() for t in self._flat_cache[1].fields.values() if t.device.type == "cuda")
        return rollout_memory_pressure(self.schema, self.total_size, num_minibatches,
                                       buffer_bytes=self.memory_bytes, resident_bytes=self._fields.resident_bytes(),
                                       shm_dir=self._shm_dir, cached_cuda_bytes=cached)
