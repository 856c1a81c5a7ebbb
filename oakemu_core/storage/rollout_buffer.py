"""The learner's rollout storage: one checked write, GAE and minibatches over shared-memory arrays.

A :class:`RolloutBuffer` is the :class:`~oakemu_core.storage.rollout_arrays.RolloutArrays` of its
:class:`~oakemu_core.step_schema.StepSchema` (one ``(T, N, *shape)`` array per stored field:
observations, one array per dict key, actions, log_probs, values, rewards, dones,
bootstrap_values, trainable, policy_versions, policy_revisions, advantages, returns, and whatever
the action distribution adds: ``action_mask``, ``action_mean``, ``action_std``) plus the way rows
go in and come out. The field list lives in the schema only; this module never names a
distribution's fields.

One way in, one way out (Stable-Baselines3's ``add`` / ``get``): :meth:`RolloutBuffer.write` is
the only write (:mod:`oakemu_core.storage.rollout_rows`; its checks:
:mod:`oakemu_core.storage.row_checks`), :meth:`RolloutBuffer.flat_batch`
the only read for PPO (:mod:`oakemu_core.storage.batches`; a recurrent policy's:
:meth:`RolloutBuffer.sequence_batch`, :mod:`oakemu_core.storage.sequences`); :meth:`~RolloutBuffer.add` (the
per-step write) and :meth:`~RolloutBuffer.get_minibatches` are thin layers over them.
Unlike Stable-Baselines3's buffers, observations are never cast to float32 (4x the memory for
Atari frames), one class serves plain and dict observations and every action space (no subclass
per variant), user errors raise ``ValueError`` naming the field instead of failing an ``assert``,
and reading minibatches never changes the stored arrays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.step_schema import StepSchema, check_array, resolve_schema
from oakemu_core.storage import gae
from oakemu_core.storage.batches import (
    FlatBatch,
    RolloutBufferTrainableDiagnostics,
    RolloutMinibatch,
    StaleAdvantagesError,
)
from oakemu_core.storage.memory import RolloutBufferMemoryDiagnostic, rollout_memory_pressure
from oakemu_core.storage.rollout_arrays import DATA_GENERATION, GAE_GENERATION, MASK_GENERATION
from oakemu_core.storage.rollout_rows import RolloutRows
from oakemu_core.storage.row_checks import check_positive_int, checked_columns, column_index
from oakemu_core.storage.sequences import SequenceBatch
from oakemu_core.storage.shared_fields import SHM_DIR

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
]


class RolloutBuffer(RolloutRows):
    """Fixed-size PPO rollout storage in shared memory, filled row by row, read as minibatches.

    A buffer holds ``rollout_length`` rows for each of ``num_envs`` columns. :meth:`write` writes
    rows of some columns (each column stays contiguous: row ``t`` is written after rows
    ``0..t-1``); :meth:`add`, the per-step write, writes one row of all columns through it. When every
    column holds ``rollout_length`` rows the buffer :attr:`is_full`; then :meth:`compute_gae`
    fills :attr:`advantages` and :attr:`returns`, and :meth:`flat_batch` serves the trainable rows
    (:meth:`get_minibatches` splits it). :meth:`reset` empties it for the next rollout without
    reallocating.

    Two ways to describe the fields (:func:`~oakemu_core.step_schema.resolve_schema`): the plain
    form ``RolloutBuffer(rollout_length, num_envs, observation_shape,
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
        schema = resolve_schema(
            "RolloutBuffer",
            schema,
            observation_shape,
            observation_dtype,
            action_shape,
            action_dtype,
        )
        super().__init__(rollout_length, num_envs, schema, shm_dir)
        self._batch_cache: tuple[tuple[Any, ...], FlatBatch | SequenceBatch] | None = None
        self._observation_uploads = 0
        self._rng = np.random.default_rng(seed)
        self._shm_dir = Path(shm_dir)

    def close(self) -> None:
        """Drop the uploaded batch, then close the arrays (:meth:`RolloutArrays.close`)."""
        self._batch_cache = None
        super().close()

    @property
    def observation_uploads(self) -> int:
        """How many times this buffer uploaded its observations to a device (cache misses of
        :meth:`flat_batch` and :meth:`sequence_batch`)."""
        return self._observation_uploads

    # ------------------------------------------------------------------ GAE
    def compute_gae(
        self, last_values: np.ndarray, last_dones: np.ndarray, gamma: float, gae_lambda: float
    ) -> None:
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
            self._arrays["rewards"],
            self._arrays["values"],
            dones,
            self._arrays["bootstrap_values"],
            last_values,
            gamma,
            gae_lambda,
        )
        self._arrays["advantages"][...] = advantages
        self._arrays["returns"][...] = returns
        meta = self._arrays["meta"]
        meta[GAE_GENERATION] = meta[DATA_GENERATION]

    @property
    def advantages_are_current(self) -> bool:
        """True when :meth:`compute_gae` ran after the last write, reset or column reset."""
        meta = self._view("meta")
        return bool(meta[GAE_GENERATION] == meta[DATA_GENERATION])

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
    def flat_batch(self, device: torch.device | str) -> FlatBatch:
        """The trainable rows of every minibatch field, flattened and on ``device``: what PPO reads.

        Built once per buffer state and device (cached until the next write, reset or mask
        change): each field's trainable rows are gathered on the CPU and uploaded once, so the
        epochs of an update cost no further transfers (:attr:`observation_uploads` counts the
        uploads). The stored arrays are never modified. Empty (``size`` 0) when no row is trainable.
        Advantages are served as GAE computed them (the PPO update normalises them per minibatch,
        :func:`oakemu_core.algo.losses.normalize_advantages`).

        Args:
            device: torch device for the tensors.

        Raises:
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        return self._cached_batch(
            device,
            ("flat",),
            lambda trainable, torch_device: FlatBatch.gather(
                self.schema, self._arrays, trainable, torch_device
            ),
        )

    def sequence_batch(
        self, device: torch.device | str, sequence_length: int | None
    ) -> SequenceBatch:
        """The rollout cut into sequences of ``sequence_length`` rows (None: whole columns), each
        from its stored ``policy_state``, with every minibatch field on ``device``: what PPO reads
        for a recurrent policy (:class:`~oakemu_core.storage.sequences.SequenceBatch`). Built and
        cached as :meth:`flat_batch` (one cached batch per buffer: asking for the other kind
        uploads again). Empty (no sequence) when no row is trainable.

        Raises:
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
            ValueError: the schema has no ``policy_state`` field, or a bad ``sequence_length``.
        """
        return self._cached_batch(
            device,
            ("sequences", sequence_length),
            lambda trainable, torch_device: SequenceBatch.gather(
                self.schema, self._arrays, trainable, sequence_length, torch_device
            ),
        )

    def _cached_batch(self, device: torch.device | str, kind: tuple[Any, ...], build: Any) -> Any:
        """The cached batch of ``kind`` on ``device``, or ``build(trainable copy, device)``'s, cached
        until the next write, reset or mask change."""
        import torch

        self._check_open()
        if not self.advantages_are_current:
            raise StaleAdvantagesError(
                "minibatches: the advantages are stale; call compute_gae() after the last write or reset"
            )
        torch_device = torch.device(device)
        meta = self._arrays["meta"]
        key = (int(meta[DATA_GENERATION]), int(meta[MASK_GENERATION]), str(torch_device), *kind)
        if self._batch_cache is not None and self._batch_cache[0] == key:
            return self._batch_cache[1]
        self._batch_cache = None  # free the old upload before making the new one
        trainable = self._arrays["trainable"].copy()  # a private copy: the shared mask may change
        batch = build(trainable, torch_device)
        self._observation_uploads += 1
        self._batch_cache = (key, batch)
        return batch

    def get_minibatches(
        self,
        num_minibatches: int,
        device: torch.device | str,
        *,
        generator: np.random.Generator | None = None,
    ) -> list[RolloutMinibatch]:
        """Split the trainable rows into shuffled minibatches of tensors on ``device`` (the
        minibatch split: :meth:`flat_batch` then :meth:`FlatBatch.minibatches`).

        Every trainable row appears exactly once per call; sizes differ by at most one (no row
        dropped, no small tail). The flat batch behind them is built once per buffer state, so
        calling this once per epoch uploads nothing more.

        Args:
            num_minibatches: number of minibatches, ``1 <= num_minibatches <= trainable_size``.
            device: torch device for the tensors.
            generator: numpy generator for the shuffle; the buffer's own (seeded at
                construction) when None.

        Returns:
            ``num_minibatches`` :class:`RolloutMinibatch` es.

        Raises:
            ValueError: ``num_minibatches`` not a positive int or larger than the trainable rows.
            StaleAdvantagesError: :meth:`compute_gae` has not run since the last write.
        """
        batch = self.flat_batch(device)
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
        check_positive_int("num_minibatches", num_minibatches)
        cached = (
            0
            if self._batch_cache is None
            else sum(
                t.numel() * t.element_size()
                for t in self._batch_cache[1].fields.values()
                if t.device.type == "cuda"
            )
        )
        return rollout_memory_pressure(
            self.schema,
            self.total_size,
            num_minibatches,
            buffer_bytes=self.memory_bytes,
            resident_bytes=self._fields.resident_bytes(),
            shm_dir=self._shm_dir,
            cached_cuda_bytes=cached,
        )
