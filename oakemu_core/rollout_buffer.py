"""The learner's rollout storage: preallocated shared-memory arrays, GAE and PPO minibatches.

Layout (every array shape ``(T, N, ...)``, ``T = rollout_length`` rows, ``N = num_envs`` columns,
one column per environment)::

    observations      (T, N, *observation_shape)  observation dtype, kept as is (uint8 stays uint8)
    actions           (T, N, *action_shape)       action dtype (default () / int64: categorical)
    log_probs         (T, N) float32              log pi(a_t | s_t) of the acting policy
    values            (T, N) float32              V(s_t) of the acting policy
    rewards           (T, N) float32              reward received on step t
    dones             (T, N) bool                 the episode ended on step t (terminated OR truncated)
    bootstrap_values  (T, N) float32              V(true final observation) if truncated on step t, else 0
    trainable         (T, N) bool                 the row may enter a PPO minibatch
    policy_versions   (T, N) int64                version of the weights that chose the action
    advantages        (T, N) float32              GAE, unnormalised (written by compute_gae)
    returns           (T, N) float32              advantages + values (written by compute_gae)
    column_steps      (N,)   int64                rows written so far in each column

Every array is a :class:`~oakemu_core.shared_memory.SharedArray`, so another process can
:meth:`RolloutBuffer.attach` to a live buffer through its :attr:`RolloutBuffer.handle` and write
rows in place. The creating process alone unlinks the segments (``close()``, context-manager exit,
garbage collection, interpreter exit); construction first sweeps segments of dead owners.

Unlike Stable-Baselines3's buffer, observations are never cast to float32 (4x the memory for
Atari frames), user errors raise ``ValueError`` naming the field instead of failing an ``assert``,
and reading minibatches never changes the stored arrays.
"""

from __future__ import annotations

import hashlib

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from oakemu_core import gae
from oakemu_core.memory_diagnostics import (
    RolloutBufferMemoryDiagnostic,
    cuda_free_bytes,
    ensure_shm_capacity,
    host_available_bytes,
    make_diagnostic,
    shm_free_bytes,
)
from oakemu_core.shared_memory import SharedArray, new_token, sweep_stale_segments

if TYPE_CHECKING:  # torch is imported lazily: actors and tools can use the buffer without it
    import torch

SHM_DIR = Path("/dev/shm")

_STEP_FIELDS = ("observations", "actions", "log_probs", "values", "rewards", "dones", "trainable", "bootstrap_values")
_GENERATION, _MASK_GENERATION, _GAE_GENERATION, _LAYOUT = 0, 1, 2, 3
"""Slots of the shared ``meta`` array: data writes, trainable-mask changes, data generation at GAE,
and a fingerprint of the layout (so that :meth:`RolloutBuffer.attach` refuses a mismatched handle)."""


def _layout_fingerprint(layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> int:
    """A stable int64 digest of every array's name, shape and dtype."""
    text = ";".join(f"{name}:{shape}:{np.dtype(dtype).str}" for name, (shape, dtype) in sorted(layout.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


class RolloutMinibatch(NamedTuple):
    """One PPO minibatch, every tensor on the requested device, first dimension = batch B.

    observations ``(B, *obs_shape)`` in the stored dtype (uint8 frames stay uint8), actions
    ``(B, *action_shape)``, log_probs/values/advantages/returns ``(B,)`` float32.
    """

    observations: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


@dataclass(frozen=True)
class RolloutBufferTrainableDiagnostics:
    """The trainable rows of a rollout, flattened in row-major ``(t, env)`` order.

    Attributes:
        values: ``(M,)`` float32, V(s_t) of the acting policy.
        returns: ``(M,)`` float32, GAE returns.
        advantages: ``(M,)`` float32, unnormalised GAE advantages.
    """

    values: np.ndarray
    returns: np.ndarray
    advantages: np.ndarray


@dataclass(frozen=True)
class RolloutBufferHandle:
    """Everything another process needs to :meth:`RolloutBuffer.attach` to a live buffer.

    Small and picklable (plain strings, ints and tuples). ``observation_dtype`` and
    ``action_dtype`` are numpy dtype strings (``np.dtype(...).str``, e.g. ``"|u1"``);
    ``segments`` maps each array name to its shared-memory segment name.
    """

    rollout_length: int
    num_envs: int
    observation_shape: tuple[int, ...]
    observation_dtype: str
    action_shape: tuple[int, ...]
    action_dtype: str
    segments: dict[str, str] = field(default_factory=dict)


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


_normalize_over_trainable = normalize_advantages  # get_minibatches has a parameter of that name


def check_array(field_name: str, array: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Raise ValueError naming the field, the expected and the received shape/dtype (no casting).

    Shared by every writer of rollout data (the buffer and the actor's step buffers).
    """
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


def _check_policy_version(policy_version: Any) -> int:
    if isinstance(policy_version, bool) or not isinstance(policy_version, (int, np.integer)) or policy_version < 0:
        raise ValueError(f"policy_version: expected a non-negative int, received {policy_version!r}")
    return int(policy_version)


class RolloutBuffer:
    """Fixed-size PPO rollout storage in shared memory, filled row by row, read as minibatches.

    A buffer holds ``rollout_length`` rows for each of ``num_envs`` columns. Rows are written for
    all columns at once with :meth:`add`, or for some columns with :meth:`write_columns` (each
    column stays contiguous: row ``t`` is written after rows ``0..t-1``). When every column holds
    ``rollout_length`` rows the buffer :attr:`is_full`; then :meth:`compute_gae` fills
    :attr:`advantages` and :attr:`returns`, and :meth:`get_minibatches` serves the trainable rows.
    :meth:`reset` empties it for the next rollout without reallocating.

    Args:
        rollout_length: rows per column (``T``), positive.
        num_envs: columns (``N``), positive.
        observation_shape: shape of one observation, e.g. ``(4, 84, 84)``.
        observation_dtype: dtype of observations, kept as is (e.g. ``np.uint8``).
        action_shape: shape of one action, ``()`` for a discrete action.
        action_dtype: dtype of actions (``np.int64`` for a categorical policy, ``np.float32`` for
            a continuous one).
        seed: seed of the shuffle generator used when :meth:`get_minibatches` gets none.
        shm_dir: directory of POSIX shared memory, checked for capacity and swept.

    Raises:
        ValueError: for a non-positive length / env count or a negative shape dimension.
        SharedMemoryTooSmallError: when ``shm_dir`` has less free space than :attr:`memory_bytes`.
    """

    def __init__(
        self,
        rollout_length: int,
        num_envs: int,
        observation_shape: tuple[int, ...],
        observation_dtype: Any,
        *,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
        seed: int | None = None,
        shm_dir: str | os.PathLike[str] = SHM_DIR,
    ) -> None:
        layout = self.array_layout(
            rollout_length, num_envs, observation_shape, observation_dtype,
            action_shape=action_shape, action_dtype=action_dtype,
        )
        if Path(shm_dir).is_dir():
            sweep_stale_segments(shm_dir)
            ensure_shm_capacity(self.required_bytes_for(layout), shm_dir)
        shared: dict[str, SharedArray] = {}
        token = new_token()  # one token per buffer: its segments are oakemu_<pid>_<token>_<array>
        try:
            for name, (shape, dtype) in layout.items():
                shared[name] = SharedArray.create(shape, dtype, field=name, token=token)
        except BaseException:
            for array in shared.values():
                array.unlink()
                array.close()
            raise
        shared["meta"].array[_GAE_GENERATION] = -1
        shared["meta"].array[_LAYOUT] = _layout_fingerprint(layout)
        self._setup(rollout_length, num_envs, observation_shape, observation_dtype, action_shape, action_dtype, shared)
        self._owner = True
        self._rng = np.random.default_rng(seed)
        self._shm_dir = Path(shm_dir)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def array_layout(
        rollout_length: int,
        num_envs: int,
        observation_shape: tuple[int, ...],
        observation_dtype: Any,
        *,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
    ) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Return ``{array name: (shape, dtype)}`` of every array a buffer allocates.

        Raises:
            ValueError: for a non-positive ``rollout_length`` / ``num_envs`` or a negative
                dimension in a shape.
        """
        for name, count in (("rollout_length", rollout_length), ("num_envs", num_envs)):
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count <= 0:
                raise ValueError(f"{name}: expected a positive int, received {count!r}")
        for name, shape in (("observation_shape", observation_shape), ("action_shape", action_shape)):
            if not isinstance(shape, tuple) or any(int(dim) < 0 for dim in shape):
                raise ValueError(f"{name}: expected a tuple of non-negative ints, received {shape!r}")
        rows = (int(rollout_length), int(num_envs))
        float32, boolean, int64 = np.dtype(np.float32), np.dtype(np.bool_), np.dtype(np.int64)
        return {
            "observations": (rows + tuple(int(d) for d in observation_shape), np.dtype(observation_dtype)),
            "actions": (rows + tuple(int(d) for d in action_shape), np.dtype(action_dtype)),
            "log_probs": (rows, float32),
            "values": (rows, float32),
            "rewards": (rows, float32),
            "dones": (rows, boolean),
            "bootstrap_values": (rows, float32),
            "trainable": (rows, boolean),
            "policy_versions": (rows, int64),
            "advantages": (rows, float32),
            "returns": (rows, float32),
            "column_steps": ((int(num_envs),), int64),
            "meta": ((4,), int64),
        }

    @staticmethod
    def required_bytes_for(layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> int:
        """Sum of the ``nbytes`` of the arrays in ``layout`` (see :meth:`array_layout`)."""
        return sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in layout.values())

    @classmethod
    def estimate_memory_bytes(
        cls,
        rollout_length: int,
        num_envs: int,
        observation_shape: tuple[int, ...],
        observation_dtype: Any,
        *,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
    ) -> int:
        """Shared-memory bytes a buffer with these arguments allocates (its :attr:`memory_bytes`)."""
        return cls.required_bytes_for(
            cls.array_layout(
                rollout_length, num_envs, observation_shape, observation_dtype,
                action_shape=action_shape, action_dtype=action_dtype,
            )
        )

    def _setup(
        self,
        rollout_length: int,
        num_envs: int,
        observation_shape: tuple[int, ...],
        observation_dtype: Any,
        action_shape: tuple[int, ...],
        action_dtype: Any,
        shared: dict[str, SharedArray],
    ) -> None:
        self._rollout_length = int(rollout_length)
        self._num_envs = int(num_envs)
        self._observation_shape = tuple(int(d) for d in observation_shape)
        self._observation_dtype = np.dtype(observation_dtype)
        self._action_shape = tuple(int(d) for d in action_shape)
        self._action_dtype = np.dtype(action_dtype)
        self._shared = shared
        self._arrays: dict[str, np.ndarray] = {name: array.array for name, array in shared.items()}
        self._views: dict[str, np.ndarray] = {}
        for name, array in self._arrays.items():
            view = array.view()
            view.flags.writeable = False
            self._views[name] = view
        self._closed = False
        self._observation_cache: tuple[tuple[int, int, str], torch.Tensor] | None = None
        self._observation_uploads = 0
        self._last_minibatch_rows: list[np.ndarray] = []

    @property
    def handle(self) -> RolloutBufferHandle:
        """Picklable description of this buffer's segments, for :meth:`attach` in another process."""
        self._check_open()
        return RolloutBufferHandle(
            rollout_length=self._rollout_length,
            num_envs=self._num_envs,
            observation_shape=self._observation_shape,
            observation_dtype=self._observation_dtype.str,
            action_shape=self._action_shape,
            action_dtype=self._action_dtype.str,
            segments={name: array.name for name, array in self._shared.items()},
        )

    @classmethod
    def attach(cls, handle: RolloutBufferHandle) -> RolloutBuffer:
        """Attach to a live buffer created by another (or this) process; never unlinks.

        Writes through the attached buffer are visible to the owner and vice versa. Each process
        keeps its own device observation cache, keyed on a shared write counter, so a write by
        any process invalidates every cache.

        Raises:
            FileNotFoundError: when the owner has closed the buffer (or died and it was swept).
            ValueError: when the handle's shapes do not match the segments.
        """
        layout = cls.array_layout(
            handle.rollout_length, handle.num_envs, tuple(handle.observation_shape), handle.observation_dtype,
            action_shape=tuple(handle.action_shape), action_dtype=handle.action_dtype,
        )
        missing = sorted(set(layout) - set(handle.segments))
        if missing:
            raise ValueError(f"handle.segments: expected names for {sorted(layout)}, missing {missing}")
        shared: dict[str, SharedArray] = {}
        try:
            for name, (shape, dtype) in layout.items():
                shared[name] = SharedArray.attach(handle.segments[name], shape, dtype)
        except BaseException:
            for array in shared.values():
                array.close()
            raise
        if int(shared["meta"].array[_LAYOUT]) != _layout_fingerprint(layout):
            for array in shared.values():
                array.close()
            raise ValueError(
                "handle: its shapes/dtypes do not match the live buffer's layout (T, N, observation and "
                f"action shape and dtype); received T={handle.rollout_length}, N={handle.num_envs}, "
                f"observations {tuple(handle.observation_shape)} {handle.observation_dtype}"
            )
        buffer = cls.__new__(cls)
        buffer._setup(
            handle.rollout_length, handle.num_envs, tuple(handle.observation_shape), handle.observation_dtype,
            tuple(handle.action_shape), handle.action_dtype, shared,
        )
        buffer._owner = False
        buffer._rng = np.random.default_rng()
        buffer._shm_dir = SHM_DIR
        return buffer

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Release this process's mappings; the creating process also unlinks the segments.

        Idempotent. Arrays read from the buffer before stay readable (the memory is unmapped
        when the last of them is freed); every buffer method raises ``RuntimeError`` afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self._observation_cache = None
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
        raise TypeError("RolloutBuffer cannot be pickled; send buffer.handle and call RolloutBuffer.attach(handle)")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self.step}/{self._rollout_length}"
        return (
            f"RolloutBuffer(rollout_length={self._rollout_length}, num_envs={self._num_envs}, "
            f"observation_shape={self._observation_shape}, observation_dtype={self._observation_dtype}, "
            f"{'owner' if self._owner else 'attached'}, {state})"
        )

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
    def observation_shape(self) -> tuple[int, ...]:
        """Shape of one observation."""
        return self._observation_shape

    @property
    def observation_dtype(self) -> np.dtype[Any]:
        """Dtype of stored observations."""
        return self._observation_dtype

    @property
    def action_shape(self) -> tuple[int, ...]:
        """Shape of one action (``()`` for discrete actions)."""
        return self._action_shape

    @property
    def action_dtype(self) -> np.dtype[Any]:
        """Dtype of stored actions."""
        return self._action_dtype

    @property
    def is_owner(self) -> bool:
        """True for the creating process's buffer (the one that unlinks)."""
        return self._owner

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
        """How many times this process uploaded the observations to a device (cache misses)."""
        return self._observation_uploads

    @property
    def last_minibatch_rows(self) -> list[np.ndarray]:
        """Row indices of the minibatches of the last :meth:`get_minibatches` call.

        One ``(B_i,)`` int64 array per minibatch, in minibatch order, holding flat row indices
        ``t * num_envs + env`` (so ``policy_versions.reshape(-1)[rows]`` are the minibatch's
        versions). Empty before the first call.
        """
        return list(self._last_minibatch_rows)

    # read-only (T, N, ...) views of the shared arrays
    @property
    def observations(self) -> np.ndarray:
        """``(T, N, *observation_shape)`` observation dtype, read-only."""
        return self._view("observations")

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
        """``(T, N)`` float32, V(s_t) of the acting policy, read-only."""
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
    def _validate_step(
        self,
        count: int,
        observations: np.ndarray,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        trainable: np.ndarray | None,
        bootstrap_values: np.ndarray | None,
    ) -> dict[str, np.ndarray]:
        """Check one row of ``count`` columns; return every step field, defaults filled in."""
        rows = (count,)
        float32, boolean = np.dtype(np.float32), np.dtype(np.bool_)
        check_array("observations", observations, rows + self._observation_shape, self._observation_dtype)
        check_array("actions", actions, rows + self._action_shape, self._action_dtype)
        check_array("log_probs", log_probs, rows, float32)
        check_array("values", values, rows, float32)
        check_array("rewards", rewards, rows, float32)
        check_array("dones", dones, rows, boolean)
        if trainable is None:
            trainable = np.ones(rows, dtype=np.bool_)
        check_array("trainable", trainable, rows, boolean)
        if bootstrap_values is None:
            bootstrap_values = np.zeros(rows, dtype=np.float32)
        check_array("bootstrap_values", bootstrap_values, rows, float32)
        if np.any(bootstrap_values[~dones] != 0):
            bad = np.flatnonzero((bootstrap_values != 0) & ~dones).tolist()
            raise ValueError(
                f"bootstrap_values: expected 0 where dones is False (a bootstrap value belongs to a "
                f"truncated step), received non-zero values at positions {bad}"
            )
        return {
            "observations": observations, "actions": actions, "log_probs": log_probs, "values": values,
            "rewards": rewards, "dones": dones, "trainable": trainable, "bootstrap_values": bootstrap_values,
        }

    def add(
        self,
        observations: np.ndarray,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        trainable: np.ndarray | None = None,
        *,
        bootstrap_values: np.ndarray | None = None,
        policy_version: int = 0,
    ) -> None:
        """Write one row for all envs at row :attr:`step`.

        Every argument is validated before anything is written; there is no silent cast.

        Args:
            observations: ``(N, *observation_shape)`` observation dtype, s_t.
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

        Raises:
            ValueError: wrong type, shape or dtype of a field (message names the field, expected
                and received), a non-zero bootstrap value where ``dones`` is False, a negative
                policy version, or columns at different steps (use :meth:`write_columns`).
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
        fields = self._validate_step(
            self._num_envs, observations, actions, log_probs, values, rewards, dones, trainable, bootstrap_values
        )
        version = _check_policy_version(policy_version)
        for name, value in fields.items():
            self._arrays[name][step] = value
        self._arrays["policy_versions"][step] = version
        steps += 1
        self._bump(_GENERATION)

    def write_columns(
        self,
        step_index: int,
        columns: np.ndarray,
        observations: np.ndarray,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        trainable: np.ndarray | None = None,
        *,
        bootstrap_values: np.ndarray | None = None,
        policy_version: int = 0,
    ) -> None:
        """Write row ``step_index`` of some columns (an actor's envs, mapped to buffer columns).

        Each listed column must already hold exactly ``step_index`` rows, so columns stay
        contiguous. Arrays are as in :meth:`add` with first dimension ``K = len(columns)``;
        ``arrays[i]`` goes to column ``columns[i]``. Everything is validated before writing.

        Args:
            step_index: the row to write, ``0 <= step_index < rollout_length``.
            columns: ``(K,)`` integer array of distinct column indices in ``[0, num_envs)``.
            observations, actions, log_probs, values, rewards, dones, trainable, bootstrap_values,
            policy_version: as in :meth:`add`, for ``K`` columns.

        Raises:
            ValueError: bad ``columns`` or ``step_index``, a column not holding ``step_index``
                rows, or any field error of :meth:`add`.
            OverflowError: when ``step_index >= rollout_length``.
        """
        self._check_open()
        columns = self._check_columns(columns)
        if isinstance(step_index, bool) or not isinstance(step_index, (int, np.integer)) or step_index < 0:
            raise ValueError(f"step_index: expected a non-negative int, received {step_index!r}")
        if step_index >= self._rollout_length:
            raise OverflowError(
                f"step_index: expected < rollout_length {self._rollout_length}, received {step_index}"
            )
        steps = self._arrays["column_steps"]
        wrong = columns[steps[columns] != step_index]
        if wrong.size:
            raise ValueError(
                f"columns: expected every column to hold step_index={step_index} rows, received "
                f"columns {wrong.tolist()} holding {steps[wrong].tolist()} rows"
            )
        fields = self._validate_step(
            len(columns), observations, actions, log_probs, values, rewards, dones, trainable, bootstrap_values
        )
        version = _check_policy_version(policy_version)
        row = int(step_index)
        for name, value in fields.items():
            self._arrays[name][row, columns] = value
        self._arrays["policy_versions"][row, columns] = version
        steps[columns] += 1
        self._bump(_GENERATION)

    def _check_columns(self, columns: Any) -> np.ndarray:
        if not isinstance(columns, np.ndarray) or columns.ndim != 1 or not np.issubdtype(columns.dtype, np.integer):
            received = f"shape {columns.shape} dtype {columns.dtype}" if isinstance(columns, np.ndarray) else type(columns).__name__
            raise ValueError(f"columns: expected a 1-D integer numpy array, received {received}")
        if columns.size and (columns.min() < 0 or columns.max() >= self._num_envs):
            raise ValueError(f"columns: expected indices in [0, {self._num_envs}), received {columns.tolist()}")
        if np.unique(columns).size != columns.size:
            raise ValueError(f"columns: expected distinct indices, received {columns.tolist()}")
        return columns.astype(np.int64, copy=False)

    def reset_columns(self, columns: np.ndarray) -> None:
        """Discard every row of some columns (the unfinished segment of a dropped actor).

        Their :attr:`column_steps` become 0 and their rows are no longer trainable.

        Raises:
            ValueError: bad ``columns`` (see :meth:`write_columns`).
        """
        self._check_open()
        columns = self._check_columns(columns)
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

        See :func:`oakemu_core.gae.compute_gae` for the formula (Schulman et al. 2016, with a
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
    def _device_observations(self, device: torch.device) -> torch.Tensor:
        """All ``T * N`` observations on ``device``, uploaded once per buffer state."""
        import torch

        meta = self._arrays["meta"]
        key = (int(meta[_GENERATION]), int(meta[_MASK_GENERATION]), str(device))
        if self._observation_cache is not None and self._observation_cache[0] == key:
            return self._observation_cache[1]
        self._observation_cache = None  # free the old upload before making the new one
        flat = self._arrays["observations"].reshape((self.total_size, *self._observation_shape))
        tensor = torch.from_numpy(flat).to(device)
        self._observation_cache = (key, tensor)
        self._observation_uploads += 1
        return tensor

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
        dropped, no small tail). Observations are uploaded to ``device`` once and cached until the
        buffer changes (:attr:`observation_uploads` counts uploads); minibatch observations are
        gathered on the device. The other arrays are gathered to the trainable rows on the CPU
        and uploaded once per call. The stored arrays are never modified.

        Args:
            num_minibatches: number of minibatches, ``1 <= num_minibatches <= trainable_size``.
            device: torch device for the tensors.
            normalize_advantages: normalise advantages over the trainable rows first
                (:func:`normalize_advantages`); otherwise they are served unnormalised.
            generator: numpy generator for the shuffle; the buffer's own (seeded at
                construction) when None.

        Returns:
            ``num_minibatches`` :class:`RolloutMinibatch` es; row indices in
            :attr:`last_minibatch_rows`.

        Raises:
            ValueError: ``num_minibatches`` not a positive int or larger than the trainable rows.
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        import torch

        self._check_open()
        if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, (int, np.integer)) or num_minibatches <= 0:
            raise ValueError(f"num_minibatches: expected a positive int, received {num_minibatches!r}")
        if not self.advantages_are_current:
            raise StaleAdvantagesError(
                "get_minibatches: the advantages are stale; call compute_gae() after the last write or reset"
            )
        trainable = self._arrays["trainable"]
        rows = np.flatnonzero(trainable.reshape(-1))
        if num_minibatches > rows.size:
            raise ValueError(
                f"num_minibatches: expected at most the {rows.size} trainable rows, received {num_minibatches}"
            )
        torch_device = torch.device(device)
        observations = self._device_observations(torch_device)

        advantages = (
            _normalize_over_trainable(self._arrays["advantages"], trainable)
            if normalize_advantages
            else self._arrays["advantages"]
        )
        total = self.total_size

        def gathered(array: np.ndarray) -> torch.Tensor:
            flat = array.reshape((total, *array.shape[2:]))
            return torch.from_numpy(np.ascontiguousarray(flat[rows])).to(torch_device)

        actions = gathered(self._arrays["actions"])
        log_probs = gathered(self._arrays["log_probs"])
        values = gathered(self._arrays["values"])
        advantages_t = gathered(advantages)
        returns = gathered(self._arrays["returns"])
        rows_t = torch.from_numpy(rows).to(torch_device)

        rng = generator if generator is not None else self._rng
        order = rng.permutation(rows.size)
        minibatches: list[RolloutMinibatch] = []
        minibatch_rows: list[np.ndarray] = []
        for positions in np.array_split(order, num_minibatches):
            positions_t = torch.from_numpy(positions).to(torch_device)
            minibatches.append(
                RolloutMinibatch(
                    observations=observations.index_select(0, rows_t.index_select(0, positions_t)),
                    actions=actions.index_select(0, positions_t),
                    log_probs=log_probs.index_select(0, positions_t),
                    values=values.index_select(0, positions_t),
                    advantages=advantages_t.index_select(0, positions_t),
                    returns=returns.index_select(0, positions_t),
                )
            )
            minibatch_rows.append(rows[positions])
        self._last_minibatch_rows = minibatch_rows
        return minibatches

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
        """Project the memory a rollout of this buffer and one PPO minibatch pass need.

        Figures (worst case: every row trainable):

        - ``cpu``: the shared arrays plus what one :meth:`get_minibatches` call allocates on
          the host (gathered scalars; when CUDA is absent also the minibatch observations and one
          minibatch of observations as float32 for the network), against
          :func:`host_available_bytes` plus the buffer's already resident pages.
        - ``shm``: :attr:`memory_bytes` against ``/dev/shm`` free space plus this buffer's own
          resident segments (Docker gives a container 64 MB by default).
        - ``cuda:<i>`` when CUDA is available: the observation cache, the minibatch observation
          copies of one call, the scalar tensors and one float32 minibatch, against free device
          memory plus this buffer's current cache.

        Args:
            num_minibatches: PPO minibatches per epoch, positive.

        Returns:
            One :class:`RolloutBufferMemoryDiagnostic` per resource.

        Raises:
            ValueError: if ``num_minibatches`` is not a positive int.
        """
        self._check_open()
        if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, (int, np.integer)) or num_minibatches <= 0:
            raise ValueError(f"num_minibatches: expected a positive int, received {num_minibatches!r}")
        rows = self.total_size
        observation_elements = int(np.prod(self._observation_shape, dtype=np.int64))
        observation_bytes = rows * observation_elements * self._observation_dtype.itemsize
        action_bytes = rows * int(np.prod(self._action_shape, dtype=np.int64)) * self._action_dtype.itemsize
        scalar_bytes = action_bytes + rows * (4 * 4 + 8 + 8)  # 4 float32 fields, row and position indices
        float_minibatch_bytes = math.ceil(rows / num_minibatches) * observation_elements * 4
        resident = self._resident_shm_bytes()

        import torch

        cuda = torch.cuda.is_available()
        diagnostics: list[RolloutBufferMemoryDiagnostic] = []
        host_transient = scalar_bytes + rows * 4  # + normalised advantages
        if not cuda:
            host_transient += observation_bytes + scalar_bytes + float_minibatch_bytes
        diagnostics.append(
            make_diagnostic(
                "cpu", self.memory_bytes + host_transient, host_available_bytes() + resident,
                "rollout arrays and one minibatch pass",
            )
        )
        if self._shm_dir.is_dir():
            diagnostics.append(
                make_diagnostic("shm", self.memory_bytes, shm_free_bytes(self._shm_dir) + resident, "rollout arrays")
            )
        if cuda:
            index = torch.cuda.current_device()
            free = cuda_free_bytes(index) or 0
            cached = 0
            if self._observation_cache is not None and self._observation_cache[1].device.type == "cuda":
                cached = self._observation_cache[1].numel() * self._observation_cache[1].element_size()
            required = 2 * observation_bytes + 2 * scalar_bytes + float_minibatch_bytes
            diagnostics.append(
                make_diagnostic(
                    f"cuda:{index}", required, free + cached,
                    "observation cache, one call's minibatches and one float32 minibatch",
                )
            )
        return diagnostics
