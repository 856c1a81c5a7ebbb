"""The shared-memory arrays of one rollout: allocation from the schema, life cycle, views, edits.

Every *stored* field of a :class:`~oakemu_core.step_schema.StepSchema` is one ``(T, N, *shape)``
array (``T = rollout_length`` rows, ``N = num_envs`` columns, one column per environment), in the
field's own dtype (uint8 frames stay uint8). Two bookkeeping arrays complete it: ``column_steps``
``(N,)`` (rows written so far in each column) and ``meta`` (generation counters: data writes,
trainable-mask changes, data generation at GAE), which tell a reader whether what it derived
(advantages, an uploaded flat batch) is still current. The field list lives in the schema only.

The arrays are :class:`~oakemu_core.storage.shared_fields.SharedFields` owned by one
:class:`RolloutArrays`: it alone unlinks the segments (``close()``, context-manager exit, garbage
collection, interpreter exit). :class:`~oakemu_core.storage.rollout_rows.RolloutRows` adds the
write, :class:`~oakemu_core.storage.rollout_buffer.RolloutBuffer` GAE and minibatches.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from oakemu_core.step_schema import StepSchema, check_array
from oakemu_core.storage.row_checks import check_positive_int, checked_columns
from oakemu_core.storage.shared_fields import SHM_DIR, SharedFields, layout_bytes

__all__ = ["DATA_GENERATION", "GAE_GENERATION", "MASK_GENERATION", "RolloutArrays"]

DATA_GENERATION, MASK_GENERATION, GAE_GENERATION = 0, 1, 2
"""Slots of the ``meta`` array: data writes, trainable-mask changes, data generation at GAE (-1: none)."""


def _array_layout(
    rollout_length: int, num_envs: int, schema: StepSchema
) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """``{array name: (shape, dtype)}`` of every array a buffer allocates: each stored field of
    ``schema`` as ``(T, N, *shape)``, plus ``column_steps`` ``(N,)`` and ``meta`` ``(3,)``.

    Raises:
        ValueError: for a non-positive ``rollout_length`` / ``num_envs``.
    """
    rows = (
        check_positive_int("rollout_length", rollout_length),
        check_positive_int("num_envs", num_envs),
    )
    layout = {f.name: (rows + f.shape, f.dtype) for f in schema.stored}
    layout["column_steps"] = ((rows[1],), np.dtype(np.int64))
    layout["meta"] = ((3,), np.dtype(np.int64))
    return layout


class _StoredField:
    """A read-only ``(T, N, *shape)`` view of one stored array, read as an attribute of the buffer
    (``buffer.rewards``); the attribute's name is the array's name."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, buffer: RolloutArrays | None, owner: type | None = None) -> Any:
        return self if buffer is None else buffer._view(self.name)

    def __set__(self, buffer: RolloutArrays, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is a read-only view; write rows with RolloutBuffer.write"
        )


class RolloutArrays:
    """The shared-memory arrays of one rollout (``rollout_length`` rows of ``num_envs`` columns per
    stored field of ``schema``), their read-only views and the edits that add no rows.

    Args:
        rollout_length: rows per column (``T``), positive.
        num_envs: columns (``N``), positive.
        schema: the step schema whose stored fields are allocated.
        shm_dir: directory of POSIX shared memory, checked for capacity and swept.

    Raises:
        ValueError: a non-positive length or env count.
        SharedMemoryTooSmallError: when ``shm_dir`` has less free space than :attr:`memory_bytes`.
    """

    def __init__(
        self,
        rollout_length: int,
        num_envs: int,
        schema: StepSchema,
        shm_dir: str | os.PathLike[str] = SHM_DIR,
    ) -> None:
        self._fields = SharedFields(_array_layout(rollout_length, num_envs, schema), shm_dir)
        self.schema = schema
        self._rollout_length = int(rollout_length)
        self._num_envs = int(num_envs)
        self._arrays = self._fields.arrays  # writable: this object's writes only
        self._views = self._fields.views  # read-only: what it hands out
        self._arrays["meta"][GAE_GENERATION] = -1
        self._closed = False

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
        self._views = {}
        self._arrays = {}
        self._fields.close()

    def __enter__(self) -> RolloutArrays:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> None:
        raise TypeError(f"{type(self).__name__} cannot be pickled: it owns shared-memory segments")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self.step}/{self._rollout_length}"
        return (
            f"{type(self).__name__}(rollout_length={self._rollout_length}, num_envs={self._num_envs}, "
            f"fields={list(self.schema.names)}, {state})"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

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
        shapes = {
            self.schema.observation_key(n): self.schema[n].shape
            for n in self.schema.observation_names
        }
        return shapes[""] if not self.schema.is_dict_observation else shapes

    @property
    def observation_dtype(self) -> Any:
        """Dtype of stored observations; for dict observations a dict key -> dtype."""
        dtypes = {
            self.schema.observation_key(n): self.schema[n].dtype
            for n in self.schema.observation_names
        }
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

    # ------------------------------------------------------------------ views
    def field(self, name: str) -> np.ndarray:
        """Read-only ``(T, N, *shape)`` view of any stored field (or ``column_steps``) by name.

        Raises:
            KeyError: not a stored field of this buffer's schema.
        """
        self._check_open()
        if name not in self._views or name == "meta":
            raise KeyError(
                f"{name!r}: not a stored field; stored fields are {[f.name for f in self.schema.stored]}"
            )
        return self._views[name]

    @property
    def observations(self) -> Any:
        """``(T, N, *observation_shape)``, or for dict observations a dict key -> array; read-only."""
        return self.schema.join_observations(
            {n: self._view(n) for n in self.schema.observation_names}
        )

    # Read-only views of the standard fields by attribute; any stored field by name: field().
    actions = _StoredField("``(T, N, *action_shape)`` action dtype, a_t as sampled.")
    log_probs = _StoredField("``(T, N)`` float32, log pi(a_t | s_t) of the acting policy.")
    values = _StoredField(
        "``(T, N)`` float32, V(s_t) of the acting policy (the learner's critic after replace_values)."
    )
    rewards = _StoredField("``(T, N)`` float32, r_t.")
    dones = _StoredField("``(T, N)`` bool, the episode ended on step t (terminated OR truncated).")
    bootstrap_values = _StoredField(
        "``(T, N)`` float32, V(true final observation) on truncated steps, else 0."
    )
    trainable = _StoredField(
        "``(T, N)`` bool, the row may enter a minibatch (see mark_untrainable)."
    )
    policy_versions = _StoredField(
        "``(T, N)`` int64, version of the weights that chose each action."
    )
    policy_revisions = _StoredField(
        "``(T, N)`` int64, revision of those weights within the update that made the next version "
        "(0: the version's own weights; 1, 2, ...: weights published during that update)."
    )
    advantages = _StoredField("``(T, N)`` float32, unnormalised GAE advantages from compute_gae.")
    returns = _StoredField("``(T, N)`` float32, ``advantages + values`` from compute_gae.")
    column_steps = _StoredField("``(N,)`` int64, rows written so far in each column.")

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
        self._bump(MASK_GENERATION)
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
        self._bump(DATA_GENERATION)

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
        self._bump(DATA_GENERATION)

    def reset(self) -> None:
        """Empty the buffer for the next rollout, keeping its memory (no reallocation)."""
        self._check_open()
        self._empty(slice(None))
        self._arrays["meta"][GAE_GENERATION] = -1

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
            raise ValueError(
                "seal_columns: expected empty columns, received columns that hold rows"
            )
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
        self._bump(DATA_GENERATION)
