"""The learner's rollout storage: preallocated shared-memory arrays, GAE and PPO minibatches.

Every *stored* field of the buffer's :class:`~oakemu_core.step_schema.StepSchema` is one
``(T, N, *shape)`` array (``T = rollout_length`` rows, ``N = num_envs`` columns, one column per
environment), in the field's own dtype (uint8 frames stay uint8): observations (one array per
dict key), actions, log_probs, values, rewards, dones, bootstrap_values, trainable,
policy_versions, policy_revisions, advantages, returns, and whatever the action distribution adds (``action_mask``,
``action_mean``, ``action_std``). Two bookkeeping arrays complete it: ``column_steps`` ``(N,)``
(rows written so far in each column) and ``meta`` (write counters). The field list lives in the
schema only; this module never names a distribution's fields.

Every array is a :class:`~oakemu_core.shared_memory.SharedArray` owned by this buffer: it alone
unlinks the segments (``close()``, context-manager exit, garbage collection, interpreter exit);
construction first sweeps segments of dead owners.

Unlike Stable-Baselines3's buffers, observations are never cast to float32 (4x the memory for
Atari frames), one class serves plain and dict observations and every action space (no subclass
per variant), user errors raise ``ValueError`` naming the field instead of failing an ``assert``,
and reading minibatches never changes the stored arrays.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from oakemu_core.storage import gae
from oakemu_core.storage.memory import (
    RolloutBufferMemoryDiagnostic,
    cuda_free_bytes,
    ensure_shm_capacity,
    host_available_bytes,
    make_diagnostic,
    shm_free_bytes,
)
from oakemu_core.shared_memory import SharedArray, new_token, sweep_stale_segments
from oakemu_core.step_schema import StepSchema, check_array, default_schema

if TYPE_CHECKING:  # torch is imported lazily: actors and tools can use the buffer without it
    import torch

__all__ = [
    "FlatBatch",
    "RolloutBuffer",
    "RolloutBufferTrainableDiagnostics",
    "RolloutMinibatch",
    "StaleAdvantagesError",
    "check_array",
    "normalize_advantages",
]

SHM_DIR = Path("/dev/shm")

_GENERATION, _MASK_GENERATION, _GAE_GENERATION = 0, 1, 2
"""Slots of the ``meta`` array: data writes, trainable-mask changes, data generation at GAE."""
_BOOKKEEPING = ("column_steps", "meta")


class RolloutMinibatch(NamedTuple):
    """One PPO minibatch, every tensor on the requested device, first dimension = batch B.

    Attributes:
        observations: ``(B, *obs_shape)`` in the stored dtype (uint8 frames stay uint8), or for
            dict observations a dict key -> tensor.
        actions: ``(B, *action_shape)``. log_probs, values, advantages, returns: ``(B,)`` float32.
        fields: every minibatch field of the schema by name (the ones above included, plus e.g.
            ``action_mask``, ``action_mean``, ``action_std``, ``policy_versions``).
    """

    observations: Any
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    fields: dict[str, torch.Tensor]


@dataclass
class FlatBatch:
    """The trainable rows of a rollout, flattened in row-major ``(t, env)`` order, on a device.

    Built once per update (:meth:`RolloutBuffer.flat_batch`); epochs then only index it.

    Attributes:
        schema: the buffer's schema.
        fields: every minibatch field, ``(M, *shape)`` tensors (advantages normalised if asked).
        rows: ``(M,)`` int64 flat row indices ``t * num_envs + env`` of the trainable rows.
    """

    schema: StepSchema
    fields: dict[str, torch.Tensor]
    rows: np.ndarray

    @property
    def size(self) -> int:
        """Trainable rows ``M``."""
        return int(self.rows.size)

    def minibatches(self, num_minibatches: int, generator: np.random.Generator) -> list[RolloutMinibatch]:
        """Shuffle the rows and split them into ``num_minibatches`` minibatches (sizes differ by at
        most one; every row appears once).

        Raises:
            ValueError: ``num_minibatches`` not in ``[1, size]``.
        """
        import torch

        if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, (int, np.integer)) or num_minibatches <= 0:
            raise ValueError(f"num_minibatches: expected a positive int, received {num_minibatches!r}")
        if num_minibatches > self.size:
            raise ValueError(f"num_minibatches: expected at most the {self.size} trainable rows, received {num_minibatches}")
        device = next(iter(self.fields.values())).device
        order = torch.from_numpy(generator.permutation(self.size)).to(device)
        return [self._minibatch({name: tensor.index_select(0, positions) for name, tensor in self.fields.items()})
                for positions in torch.tensor_split(order, num_minibatches)]

    def whole(self) -> RolloutMinibatch:
        """Every row as one minibatch, in stored order, without a copy: for an update with one
        minibatch, whose gradient does not depend on the row order (no shuffle to pay for)."""
        return self._minibatch(dict(self.fields))

    def _minibatch(self, picked: dict[str, Any]) -> RolloutMinibatch:
        return RolloutMinibatch(
            observations=self.schema.join_observations(picked),
            actions=picked["actions"],
            log_probs=picked["log_probs"],
            values=picked["values"],
            advantages=picked["advantages"],
            returns=picked["returns"],
            fields=picked,
        )


@dataclass(frozen=True)
class RolloutBufferTrainableDiagnostics:
    """The trainable rows of a rollout, flattened in row-major ``(t, env)`` order.

    Attributes:
        values: ``(M,)`` float32, V(s_t) as stored (the acting policy's, or the learner's after re-evaluation).
        returns: ``(M,)`` float32, GAE returns.
        advantages: ``(M,)`` float32, unnormalised GAE advantages.
    """

    values: np.ndarray
    returns: np.ndarray
    advantages: np.ndarray


class StaleAdvantagesError(RuntimeError):
    """Minibatches were requested while the advantages do not describe the stored rows."""


def normalize_advantages(advantages: np.ndarray, trainable: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Normalise advantages to mean 0 and std 1 over the trainable rows only.

    One mask selects the rows for the count, the mean and the variance (population std, ddof 0),
    so rows that are not trainable never enter the statistics. Output: ``(a - mean) / (std + eps)``
    on trainable rows, 0 elsewhere.

    Args:
        advantages: any shape, floating.
        trainable: same shape, bool.
        eps: added to the std to avoid dividing by zero.

    Returns:
        float32 array of the input shape; all zeros when no row is trainable.

    Raises:
        ValueError: when the shapes differ or ``trainable`` is not bool.
    """
    if not isinstance(advantages, np.ndarray) or not isinstance(trainable, np.ndarray):
        raise ValueError("advantages, trainable: expected numpy arrays")
    if trainable.dtype != np.bool_:
        raise ValueError(f"trainable: expected dtype bool, received {trainable.dtype}")
    if advantages.shape != trainable.shape:
        raise ValueError(f"trainable: expected shape {advantages.shape} (as advantages), received {trainable.shape}")
    # One private copy of the mask serves the statistics and the assignment: the caller's array may
    # live in shared memory that another process can write.
    trainable = trainable.copy()
    normalised = np.zeros(advantages.shape, dtype=np.float32)
    selected = advantages[trainable].astype(np.float64)
    if selected.size == 0:
        return normalised
    mean = selected.mean()
    std = math.sqrt(((selected - mean) ** 2).mean())
    normalised[trainable] = ((selected - mean) / (std + eps)).astype(np.float32)
    return normalised


def column_index(columns: np.ndarray) -> slice | np.ndarray:
    """How to index ``(K,)`` int64 buffer ``columns``: a slice when they are consecutive (a plain
    strided copy, several times cheaper than numpy's fancy-index assignment), else the array itself."""
    listed = columns.tolist()
    if listed and listed == list(range(listed[0], listed[0] + len(listed))):
        return slice(listed[0], listed[0] + len(listed))
    return columns


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, received {value!r}")
    return int(value)


def _check_policy_version(policy_version: Any, name: str = "policy_version") -> int:
    if isinstance(policy_version, bool) or not isinstance(policy_version, (int, np.integer)) or policy_version < 0:
        raise ValueError(f"{name}: expected a non-negative int, received {policy_version!r}")
    return int(policy_version)


class RolloutBuffer:
    """Fixed-size PPO rollout storage in shared memory, filled row by row, read as minibatches.

    A buffer holds ``rollout_length`` rows for each of ``num_envs`` columns. Rows are written for
    all columns at once with :meth:`add`, or for some columns with :meth:`write_columns` (each
    column stays contiguous: row ``t`` is written after rows ``0..t-1``). When every column holds
    ``rollout_length`` rows the buffer :attr:`is_full`; then :meth:`compute_gae` fills
    :attr:`advantages` and :attr:`returns`, and :meth:`flat_batch` / :meth:`get_minibatches` serve
    the trainable rows. :meth:`reset` empties it for the next rollout without reallocating.

    Two ways to describe the fields: the seed API's plain form
    ``RolloutBuffer(rollout_length, num_envs, observation_shape, observation_dtype)`` (plus
    ``action_shape`` / ``action_dtype``), or ``schema=`` a :class:`StepSchema` (any observation
    and action space: dict observations, masks, Gaussian parameters).

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
        if schema is None:
            if observation_shape is None or observation_dtype is None:
                raise ValueError("RolloutBuffer: expected observation_shape and observation_dtype, or schema=")
            if not isinstance(observation_shape, tuple) or any(int(d) < 0 for d in observation_shape):
                raise ValueError(f"observation_shape: expected a tuple of non-negative ints, received {observation_shape!r}")
            schema = default_schema(observation_shape, observation_dtype, action_shape, action_dtype)
        elif observation_shape is not None or observation_dtype is not None:
            raise ValueError("RolloutBuffer: pass either schema= or observation_shape/observation_dtype, not both")
        layout = self.array_layout(rollout_length, num_envs, schema)
        if Path(shm_dir).is_dir():
            sweep_stale_segments(shm_dir)
            ensure_shm_capacity(self.required_bytes_for(layout), shm_dir)
        shared: dict[str, SharedArray] = {}
        token = new_token()  # one token per buffer: its segments are oakemu_<pid>_<token>_<array>
        try:
            for name, (shape, dtype) in layout.items():
                shared[name] = SharedArray.create(shape, dtype, field=name.replace(".", "__"), token=token)
        except BaseException:
            for array in shared.values():
                array.unlink()
                array.close()
            raise
        self.schema = schema
        # Stored fields a writer provides (the learner computes advantages, returns, versions);
        # computed once (the schema never changes): every write validates against it.
        self._writable = tuple(f for f in schema.stored if f.name not in ("policy_versions", "policy_revisions", "advantages", "returns"))
        # Writable fields actors do not send (a schema's own additions): write_validated stores their defaults.
        self._unsent_defaults = {f.name: f.default for f in self._writable if not f.sent}
        self._rollout_length = int(rollout_length)
        self._num_envs = int(num_envs)
        self._shared = shared
        self._arrays: dict[str, np.ndarray] = {name: array.array for name, array in shared.items()}
        self._views: dict[str, np.ndarray] = {}
        for name, array in self._arrays.items():
            view = array.view()
            view.flags.writeable = False
            self._views[name] = view
        self._arrays["meta"][_GAE_GENERATION] = -1
        self._closed = False
        self._flat_cache: tuple[tuple[Any, ...], FlatBatch] | None = None
        self._observation_uploads = 0
        self._rng = np.random.default_rng(seed)
        self._shm_dir = Path(shm_dir)

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def array_layout(rollout_length: int, num_envs: int, schema: StepSchema) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
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

    @staticmethod
    def required_bytes_for(layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> int:
        """Sum of the ``nbytes`` of the arrays in ``layout`` (see :meth:`array_layout`)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())

    @classmethod
    def estimate_memory_bytes(cls, rollout_length: int, num_envs: int, schema: StepSchema) -> int:
        """Shared-memory bytes a buffer with these arguments allocates (its :attr:`memory_bytes`)."""
        return cls.required_bytes_for(cls.array_layout(rollout_length, num_envs, schema))

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
        for array in self._shared.values():
            if array.is_owner:
                array.unlink()
            array.close()

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
        return sum(array.nbytes for array in self._shared.values())

    @property
    def memory_gb(self) -> float:
        """:attr:`memory_bytes` in GiB."""
        return self.memory_bytes / 1024**3

    @property
    def observation_uploads(self) -> int:
        """How many times this buffer uploaded its observations to a device (flat-batch cache misses)."""
        return self._observation_uploads

    def field(self, name: str) -> np.ndarray:
        """Read-only ``(T, N, *shape)`` view of any stored field (or ``column_steps``) by name.

        Raises:
            KeyError: not a stored field of this buffer's schema.
        """
        self._check_open()
        if name not in self._views or name == "meta":
            raise KeyError(f"{name!r}: not a stored field; stored fields are {[f.name for f in self.schema.stored]}")
        return self._views[name]

    # Read-only (T, N, ...) views of the standard fields.
    @property
    def observations(self) -> Any:
        """``(T, N, *observation_shape)``, or for dict observations a dict key -> array; read-only."""
        return self.schema.join_observations({n: self._view(n) for n in self.schema.observation_names})

    @property
    def actions(self) -> np.ndarray:
        """``(T, N, *action_shape)`` action dtype, read-only."""
        return self._view("actions")

    @property
    def log_probs(self) -> np.ndarray:
        """``(T, N)`` float32, log pi(a_t | s_t) of the acting policy, read-only."""
        return self._view("log_probs")

    @property
    def values(self) -> np.ndarray:
        """``(T, N)`` float32, V(s_t) of the acting policy (of the learner's critic after
        :meth:`replace_values`), read-only."""
        return self._view("values")

    @property
    def rewards(self) -> np.ndarray:
        """``(T, N)`` float32, read-only."""
        return self._view("rewards")

    @property
    def dones(self) -> np.ndarray:
        """``(T, N)`` bool, episode ended on step t (terminated OR truncated), read-only."""
        return self._view("dones")

    @property
    def bootstrap_values(self) -> np.ndarray:
        """``(T, N)`` float32, V(true final observation) on truncated steps, else 0, read-only."""
        return self._view("bootstrap_values")

    @property
    def trainable(self) -> np.ndarray:
        """``(T, N)`` bool, row may enter a minibatch, read-only (see :meth:`mark_untrainable`)."""
        return self._view("trainable")

    @property
    def policy_versions(self) -> np.ndarray:
        """``(T, N)`` int64, version of the weights that chose each action, read-only."""
        return self._view("policy_versions")

    @property
    def policy_revisions(self) -> np.ndarray:
        """``(T, N)`` int64, revision of those weights within the update that made the next version
        (0: the version's own weights; 1, 2, ...: weights published during that update), read-only."""
        return self._view("policy_revisions")

    @property
    def advantages(self) -> np.ndarray:
        """``(T, N)`` float32, unnormalised GAE advantages from :meth:`compute_gae`, read-only."""
        return self._view("advantages")

    @property
    def returns(self) -> np.ndarray:
        """``(T, N)`` float32, ``advantages + values`` from :meth:`compute_gae`, read-only."""
        return self._view("returns")

    @property
    def column_steps(self) -> np.ndarray:
        """``(N,)`` int64, rows written so far in each column, read-only."""
        return self._view("column_steps")

    # ------------------------------------------------------------------ writing
    def _validate_row(self, count: int, fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check one row of ``count`` columns; return every writable field, defaults filled in."""
        fields = dict(fields)
        fields.pop("truncated", None)  # actors send it; storage keeps it in dones + bootstrap_values
        fields.pop("next_values", None)
        writable = self._writable
        self.schema.check_arrays(fields, count, writable)
        complete = {}
        for item in writable:
            value = fields.get(item.name)
            complete[item.name] = np.full((count, *item.shape), item.default, dtype=item.dtype) if value is None else value
        dones, bootstrap = complete["dones"], complete["bootstrap_values"]
        if np.count_nonzero(bootstrap) and np.any(bootstrap[~dones] != 0):  # mostly all 0: one cheap call
            bad = np.flatnonzero((bootstrap != 0) & ~dones).tolist()
            raise ValueError(
                f"bootstrap_values: expected 0 where dones is False (a bootstrap value belongs to a "
                f"truncated step), received non-zero values at positions {bad}"
            )
        return complete

    def _observation_fields(self, observations: Any) -> dict[str, Any]:
        return self.schema.split_observations(observations)

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
        bootstrap_values: np.ndarray | None = None,
        policy_version: int = 0,
        policy_revision: int = 0,
        **fields: np.ndarray,
    ) -> None:
        """Write one row for all envs at row :attr:`step`.

        Every argument is validated before anything is written; there is no silent cast.

        Args:
            observations: ``(N, *observation_shape)`` observation dtype, s_t; a dict key ->
                array for dict observations.
            actions: ``(N, *action_shape)`` action dtype, a_t.
            log_probs: ``(N,)`` float32, log pi(a_t | s_t).
            values: ``(N,)`` float32, V(s_t).
            rewards: ``(N,)`` float32, r_t.
            dones: ``(N,)`` bool, the episode ended on this step (terminated OR truncated).
            trainable: ``(N,)`` bool or None (all trainable). False stores the step for GAE and
                bookkeeping but keeps it out of every minibatch.
            bootstrap_values: ``(N,)`` float32 or None (zeros): V(true final observation) where
                the episode was truncated on this step, 0 elsewhere (also where terminated).
            policy_version: version of the weights that chose the actions, >= 0.
            policy_revision: their revision within the update running on that version, >= 0
                (:attr:`policy_revisions`).
            **fields: the schema's other fields by name, e.g. ``action_mask=(N, width) bool``,
                ``action_mean=`` / ``action_std=`` ``(N, d)`` float32.

        Raises:
            ValueError: wrong type, shape or dtype of a field (message names the field, expected
                and received), an unknown or missing field, a non-zero bootstrap value where
                ``dones`` is False, a negative policy version or revision, or columns at different steps
                (use :meth:`write_columns`).
            OverflowError: when the buffer is full.
        """
        self._check_open()
        steps = self._arrays["column_steps"]
        step = int(steps.min())
        if int(steps.max()) != step:
            raise ValueError(
                f"add: expected every column at the same step, received column_steps from {step} to "
                f"{int(steps.max())}; use write_columns for columns filled separately"
            )
        if step >= self._rollout_length:
            raise OverflowError(f"RolloutBuffer is full ({self._rollout_length} rows); call reset() first")
        named = {**self._observation_fields(observations), "actions": actions, "log_probs": log_probs,
                 "values": values, "rewards": rewards, "dones": dones, "trainable": trainable,
                 "bootstrap_values": bootstrap_values, **fields}
        complete = self._validate_row(self._num_envs, {k: v for k, v in named.items() if v is not None})
        version = _check_policy_version(policy_version)
        revision = _check_policy_version(policy_revision, "policy_revision")
        self._store(step, None, slice(None), complete, version, revision)

    def write_columns(
        self,
        step_index: int,
        columns: np.ndarray,
        fields: Mapping[str, np.ndarray],
        *,
        policy_version: int = 0,
        policy_revision: int = 0,
    ) -> None:
        """Write row ``step_index`` of some columns (an actor's envs, mapped to buffer columns).

        Each listed column must already hold exactly ``step_index`` rows, so columns stay
        contiguous. ``fields`` maps schema field names to ``(K, *shape)`` arrays, ``K =
        len(columns)``; ``fields[name][i]`` goes to column ``columns[i]``. Fields the actor sends
        but the buffer does not store (``truncated``, ``next_values``) are ignored; optional
        fields (``trainable``, ``bootstrap_values``) may be left out. Everything is validated
        before writing.

        Args:
            step_index: the row to write, ``0 <= step_index < rollout_length``.
            columns: ``(K,)`` integer array of distinct column indices in ``[0, num_envs)``.
            fields: field name -> array, as in :meth:`add` for ``K`` columns.
            policy_version: version of the weights that chose the actions, >= 0.
            policy_revision: their revision within the update running on that version, >= 0
                (:attr:`policy_revisions`).

        Raises:
            ValueError: bad ``columns`` or ``step_index``, a column not holding ``step_index``
                rows, or any field error of :meth:`add`.
            OverflowError: when ``step_index >= rollout_length``.
        """
        self._check_open()
        columns, index = self._check_columns(columns)
        if isinstance(step_index, bool) or not isinstance(step_index, (int, np.integer)) or step_index < 0:
            raise ValueError(f"step_index: expected a non-negative int, received {step_index!r}")
        if step_index >= self._rollout_length:
            raise OverflowError(f"step_index: expected < rollout_length {self._rollout_length}, received {step_index}")
        steps = self._arrays["column_steps"]
        wrong = columns[steps[columns] != step_index]
        if wrong.size:
            raise ValueError(
                f"columns: expected every column to hold step_index={step_index} rows, received "
                f"columns {wrong.tolist()} holding {steps[wrong].tolist()} rows"
            )
        complete = self._validate_row(len(columns), fields)
        version = _check_policy_version(policy_version)
        revision = _check_policy_version(policy_revision, "policy_revision")
        self._store(int(step_index), None, index, complete, version, revision)

    def write_column_rows(
        self,
        step_index: int,
        columns: np.ndarray,
        fields: Mapping[str, np.ndarray],
        *,
        policy_version: int = 0,
        policy_revision: int = 0,
    ) -> None:
        """Write ``R`` consecutive rows ``step_index .. step_index + R - 1`` of some columns at once
        (a step message carrying a block of ``R`` vector steps; ``R = 1`` is :meth:`write_columns`).

        Same rules as :meth:`write_columns` with one more leading dimension: ``fields`` maps schema
        field names to ``(R, K, *shape)`` arrays, ``K = len(columns)``; ``fields[name][r, i]`` goes
        to row ``step_index + r`` of column ``columns[i]``. Everything is validated (shapes, dtypes,
        the bootstrap rule on every row) before anything is written; one bulk copy per field.

        Args:
            step_index: the first row to write; every listed column must hold exactly that many rows.
            columns: ``(K,)`` integer array of distinct column indices in ``[0, num_envs)``.
            fields: field name -> ``(R, K, *shape)`` array; R >= 1, the same for every field.
            policy_version: version of the weights that chose the actions of all R rows, >= 0.
            policy_revision: their revision, >= 0 (:attr:`policy_revisions`).

        Raises:
            ValueError: bad ``columns`` or ``step_index``, a column not holding ``step_index`` rows,
                fields of different R, or any field error of :meth:`add` (named).
            OverflowError: when ``step_index + R > rollout_length``.
        """
        self._check_open()
        columns, index = self._check_columns(columns)
        if isinstance(step_index, bool) or not isinstance(step_index, (int, np.integer)) or step_index < 0:
            raise ValueError(f"step_index: expected a non-negative int, received {step_index!r}")
        dones = fields.get("dones")
        if not isinstance(dones, np.ndarray) or dones.ndim != 2:
            raise ValueError(f"dones: expected a (rows, {len(columns)}) array, received "
                             f"{getattr(dones, 'shape', type(dones).__name__)}")
        rows = int(dones.shape[0])
        if rows < 1 or step_index + rows > self._rollout_length:
            raise OverflowError(f"rows: expected 1 <= step_index + rows <= rollout_length {self._rollout_length}, "
                                f"received step_index {step_index} + {rows} rows")
        steps = self._arrays["column_steps"]
        wrong = columns[steps[columns] != step_index]
        if wrong.size:
            raise ValueError(
                f"columns: expected every column to hold step_index={step_index} rows, received "
                f"columns {wrong.tolist()} holding {steps[wrong].tolist()} rows"
            )
        # Validate as one row of rows * K entries (views; the leading dimensions are merged).
        count = rows * len(columns)
        merged = {}
        for name, value in fields.items():
            if isinstance(value, np.ndarray) and value.ndim >= 2 and value.shape[:2] == (rows, len(columns)):
                merged[name] = value.reshape(count, *value.shape[2:])
            else:
                merged[name] = value  # wrong shape: _validate_row names it
        complete = self._validate_row(count, merged)
        version = _check_policy_version(policy_version)
        revision = _check_policy_version(policy_revision, "policy_revision")
        k = len(columns)
        blocks = {name: value.reshape(rows, k, *value.shape[1:]) for name, value in complete.items()}
        self._store(int(step_index), rows, index, blocks, version, revision)

    def write_validated(
        self,
        step_index: int,
        columns: slice | np.ndarray,
        fields: Mapping[str, np.ndarray],
        *,
        rows: int | None = None,
        policy_version: int,
        policy_revision: int = 0,
    ) -> None:
        """Write fields that were already validated against this buffer's schema: the learner's
        path for step messages, which :func:`oakemu_core.transport.steps.decode_step` checked against a
        :class:`~oakemu_core.transport.steps.StepSpec` of the same schema (the
        :class:`~oakemu_core.storage.assembler.RolloutAssembler` refuses any other spec at join). Checking them
        again cost about a third of the write (issue 11: 18-20 against 13-17 us per Atari step
        message, warm).

        Only the row bookkeeping is checked: every column holds ``step_index`` rows and the rows
        fit. Field names, dtypes, shapes and values are NOT: a caller that cannot vouch for them
        uses :meth:`write_columns` or :meth:`write_column_rows`, which check everything.

        Args:
            step_index: the first row to write.
            columns: the ``K`` buffer columns, a slice (consecutive columns: a plain strided copy)
                or a ``(K,)`` int64 array of distinct indices in ``[0, num_envs)``.
            fields: every writable field actors send, by name (others, e.g. ``truncated``, are
                ignored; fields actors do not send get their default): ``(K, *shape)`` arrays when
                ``rows`` is None (one row), else ``(rows, K, *shape)``. They are not checked: numpy
                broadcasts a wrong shape where it can, or raises after earlier fields were written.
            rows: None for one row, else the number of consecutive rows in ``fields``.
            policy_version: version of the weights that chose the actions, >= 0 (not checked).
            policy_revision: their revision, >= 0 (not checked).

        Raises:
            ValueError: a column does not hold ``step_index`` rows.
            OverflowError: the rows do not fit below ``rollout_length``.
        """
        self._check_open()
        if step_index + (rows or 1) > self._rollout_length:
            raise OverflowError(f"rows: expected step_index + rows <= rollout_length {self._rollout_length}, "
                                f"received step_index {step_index} + {rows or 1} rows")
        held = self._arrays["column_steps"][columns]
        if (held != step_index).any():  # the method: np.any's dispatch costs as much again
            raise ValueError(f"columns: expected every column to hold step_index={step_index} rows, "
                             f"received {held.tolist()}")
        if self._unsent_defaults:
            fields = {**fields, **self._unsent_defaults}
        self._store(step_index, rows, columns, fields, policy_version, policy_revision)

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

    def _check_columns(self, columns: Any) -> tuple[np.ndarray, slice | np.ndarray]:
        """``(columns as int64, index)``: ``index`` is a slice when the columns are consecutive (a
        plain strided copy, several times cheaper than numpy's fancy-index assignment), else the array.
        Checked in Python: an actor has a few to a few hundred columns."""
        if not isinstance(columns, np.ndarray) or columns.ndim != 1 or not np.issubdtype(columns.dtype, np.integer):
            received = f"shape {columns.shape} dtype {columns.dtype}" if isinstance(columns, np.ndarray) else type(columns).__name__
            raise ValueError(f"columns: expected a 1-D integer numpy array, received {received}")
        listed = columns.tolist()
        if listed and (min(listed) < 0 or max(listed) >= self._num_envs):
            raise ValueError(f"columns: expected indices in [0, {self._num_envs}), received {listed}")
        if len(set(listed)) != len(listed):
            raise ValueError(f"columns: expected distinct indices, received {listed}")
        columns = columns.astype(np.int64, copy=False)
        return columns, column_index(columns)

    def reset_columns(self, columns: np.ndarray) -> None:
        """Discard every row of some columns (the unfinished segment of a dropped actor).

        Their :attr:`column_steps` become 0 and their rows are no longer trainable.

        Raises:
            ValueError: bad ``columns`` (see :meth:`write_columns`).
        """
        self._check_open()
        columns, _ = self._check_columns(columns)
        self._arrays["column_steps"][columns] = 0
        self._arrays["trainable"][:, columns] = False
        self._arrays["dones"][:, columns] = False
        self._arrays["bootstrap_values"][:, columns] = 0.0
        self._bump(_GENERATION)

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
        self._arrays["column_steps"][:] = 0
        self._arrays["trainable"][:] = False
        self._arrays["dones"][:] = False
        self._arrays["bootstrap_values"][:] = 0.0
        self._bump(_GENERATION)
        self._arrays["meta"][_GAE_GENERATION] = -1

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
        """The trainable rows of every minibatch field, flattened and on ``device``.

        Built once per buffer state and device (cached until the next write, reset or mask
        change): each field's trainable rows are gathered on the CPU and uploaded once, so the
        epochs of an update cost no further transfers (:attr:`observation_uploads` counts the
        uploads). The stored arrays are never modified.

        Args:
            device: torch device for the tensors.
            normalize_advantages: normalise advantages over the trainable rows
                (:func:`normalize_advantages`); otherwise they are served unnormalised.

        Raises:
            ValueError: no trainable row.
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        import torch

        self._check_open()
        if not self.advantages_are_current:
            raise StaleAdvantagesError(
                "get_minibatches: the advantages are stale; call compute_gae() after the last write or reset"
            )
        torch_device = torch.device(device)
        meta = self._arrays["meta"]
        key = (int(meta[_GENERATION]), int(meta[_MASK_GENERATION]), str(torch_device), bool(normalize_advantages))
        if self._flat_cache is not None and self._flat_cache[0] == key:
            return self._flat_cache[1]
        self._flat_cache = None  # free the old upload before making the new one
        trainable = self._arrays["trainable"].copy()  # a private copy: the shared mask may change
        rows = np.flatnonzero(trainable.reshape(-1))
        if rows.size == 0:
            raise ValueError("get_minibatches: the buffer has no trainable row")
        tensors: dict[str, torch.Tensor] = {}
        for item in self.schema.minibatch:
            array = self._arrays[item.name]
            if item.name == "advantages" and normalize_advantages:
                array = normalize_advantages_fn(array, trainable)
            flat = array.reshape((self.total_size, *item.shape))
            tensors[item.name] = torch.from_numpy(flat[rows]).to(torch_device)
        self._observation_uploads += 1
        batch = FlatBatch(self.schema, tensors, rows)
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
        """Split the trainable rows into shuffled minibatches of tensors on ``device``.

        Every trainable row appears exactly once per call; sizes differ by at most one (no row
        dropped, no small tail). The flat batch behind them is built once per buffer state
        (:meth:`flat_batch`), so calling this once per epoch uploads nothing more.

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
        if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, (int, np.integer)) or num_minibatches <= 0:
            raise ValueError(f"num_minibatches: expected a positive int, received {num_minibatches!r}")
        self._check_open()
        if not self.advantages_are_current:
            raise StaleAdvantagesError(
                "get_minibatches: the advantages are stale; call compute_gae() after the last write or reset"
            )
        trainable_rows = self.trainable_size
        if num_minibatches > trainable_rows:
            raise ValueError(f"num_minibatches: expected at most the {trainable_rows} trainable rows, received {num_minibatches}")
        batch = self.flat_batch(device, normalize_advantages=normalize_advantages)
        return batch.minibatches(num_minibatches, generator if generator is not None else self._rng)

    # ------------------------------------------------------------------ memory
    def _resident_shm_bytes(self) -> int:
        """Bytes of this buffer's segments already backed by memory (counted as used)."""
        resident = 0
        for array in self._shared.values():
            try:
                resident += os.stat(self._shm_dir / array.name).st_blocks * 512
            except OSError:
                continue
        return resident

    def estimate_memory_pressure(self, num_minibatches: int) -> list[RolloutBufferMemoryDiagnostic]:
        """Project the memory a rollout of this buffer and one PPO update need.

        Figures (worst case: every row trainable):

        - ``cpu``: the shared arrays plus the flat batch gathered on the host (and, without CUDA,
          the flat batch itself and one minibatch of observations as float32 for the network),
          against :func:`host_available_bytes` plus the buffer's already resident pages.
        - ``shm``: :attr:`memory_bytes` against ``/dev/shm`` free space plus this buffer's own
          resident segments (Docker gives a container 64 MB by default).
        - ``cuda:<i>`` when CUDA is available: the flat batch, one minibatch's copy of it and one
          float32 minibatch of observations, against free device memory plus the current cache.

        Args:
            num_minibatches: PPO minibatches per epoch, positive.

        Returns:
            One :class:`RolloutBufferMemoryDiagnostic` per resource.

        Raises:
            ValueError: if ``num_minibatches`` is not a positive int.
        """
        self._check_open()
        _check_positive_int("num_minibatches", num_minibatches)
        rows = self.total_size
        flat_bytes = rows * sum(f.item_bytes for f in self.schema.minibatch) + rows * 8  # + row indices
        observation_elements = sum(math.prod(self.schema[n].shape) for n in self.schema.observation_names)
        float_minibatch_bytes = math.ceil(rows / num_minibatches) * observation_elements * 4
        minibatch_copy = math.ceil(flat_bytes / num_minibatches)
        resident = self._resident_shm_bytes()

        import torch

        cuda = torch.cuda.is_available()
        diagnostics: list[RolloutBufferMemoryDiagnostic] = []
        host_transient = flat_bytes + rows * 4  # gathered rows + normalised advantages
        if not cuda:
            host_transient += flat_bytes + minibatch_copy + float_minibatch_bytes
        diagnostics.append(
            make_diagnostic("cpu", self.memory_bytes + host_transient, host_available_bytes() + resident,
                            "rollout arrays and one update's flat batch")
        )
        if self._shm_dir.is_dir():
            diagnostics.append(
                make_diagnostic("shm", self.memory_bytes, shm_free_bytes(self._shm_dir) + resident, "rollout arrays")
            )
        if cuda:
            index = torch.cuda.current_device()
            free = cuda_free_bytes(index) or 0
            cached = 0
            if self._flat_cache is not None:
                cached = sum(t.numel() * t.element_size() for t in self._flat_cache[1].fields.values()
                             if t.device.type == "cuda")
            required = flat_bytes + minibatch_copy + float_minibatch_bytes
            diagnostics.append(
                make_diagnostic(f"cuda:{index}", required, free + cached,
                                "flat batch, one minibatch and one float32 minibatch of observations")
            )
        return diagnostics


normalize_advantages_fn = normalize_advantages  # flat_batch has a parameter of that name
