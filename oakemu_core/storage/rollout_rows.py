"""How rows go into a rollout's arrays: one checked write of some columns, and the per-step write.

:class:`RolloutRows` is the :class:`~oakemu_core.storage.rollout_arrays.RolloutArrays` of a schema
plus its one write, :meth:`RolloutRows.write` (rows of some columns; every value checked before
anything is written, as a step message is checked on the wire: :mod:`oakemu_core.storage.row_checks`),
and :meth:`RolloutRows.add`, the per-step write of one row of every column through it.
:class:`~oakemu_core.storage.rollout_buffer.RolloutBuffer` adds GAE and minibatches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from oakemu_core.step_schema import StepSchema
from oakemu_core.storage.rollout_arrays import DATA_GENERATION, RolloutArrays
from oakemu_core.storage.row_checks import (
    WriteChecks,
    check_non_negative_int,
    check_positive_int,
    checked_columns,
)
from oakemu_core.storage.shared_fields import SHM_DIR
from oakemu_core.transport.frame_stacks import StackedRows

__all__ = ["RolloutRows"]


class RolloutRows(RolloutArrays):
    """The shared-memory arrays of one rollout (``rollout_length`` rows of ``num_envs`` columns) and
    the checked writes of their rows. Each column stays contiguous: row ``t`` is written after rows
    ``0..t-1``; :attr:`column_steps` counts the rows of each column.

    Args:
        rollout_length: rows per column (``T``), positive.
        num_envs: columns (``N``), positive.
        schema: the step schema (the stored fields and their checks).
        shm_dir: directory of POSIX shared memory, checked for capacity and swept.
    """

    def __init__(
        self,
        rollout_length: int,
        num_envs: int,
        schema: StepSchema,
        shm_dir: str | os.PathLike[str] = SHM_DIR,
    ) -> None:
        super().__init__(rollout_length, num_envs, schema, shm_dir)
        self._checks = WriteChecks(schema)  # the field lists every write goes by, computed once
        self._all_columns = np.arange(self._num_envs, dtype=np.int64)

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
        """Write one row for all envs at row :attr:`step` (the per-step write; :meth:`write` for all
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
        step = self._common_step()
        if action_masks is not None:
            if "action_mask" in fields:
                raise ValueError(
                    "action_masks: received the masks twice (as action_masks= and action_mask=)"
                )
            fields["action_mask"] = action_masks
        named = {
            **self.schema.split_observations(observations),
            "actions": actions,
            "log_probs": log_probs,
            "values": values,
            "rewards": rewards,
            "dones": dones,
            "trainable": trainable,
            "bootstrap_values": bootstrap_values,
            **fields,
        }
        self.write(
            step,
            slice(None),
            {k: v for k, v in named.items() if v is not None},
            policy_version=policy_version,
            policy_revision=policy_revision,
        )

    def _common_step(self) -> int:
        """The row every column is at (the next one :meth:`add` writes).

        Raises:
            ValueError: columns at different steps. OverflowError: the buffer is full.
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
            raise OverflowError(
                f"RolloutBuffer is full ({self._rollout_length} rows); call reset() first"
            )
        return step

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
                ``bootstrap_values``) are checked when present, then dropped. With ``validated``
                a field may be a step message's deduplicated stacks
                (:class:`~oakemu_core.transport.frame_stacks.StackedRows`): rebuilt straight into
                the rows.
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
            if self._checks.unsent_defaults:
                fields = {**fields, **self._checks.unsent_defaults}
            self._store(step_index, rows, columns, fields, policy_version, policy_revision)
            return
        if isinstance(columns, slice):  # consecutive columns: nothing to check but the fields' K
            index, k = columns, len(self._all_columns[columns])
        else:
            columns, index = checked_columns(columns, self._num_envs)
            k = len(columns)
        check_non_negative_int("step_index", step_index)
        if rows is not None:
            check_positive_int("rows", rows)
        self._check_rows_free(int(step_index), rows, index)
        complete = self._checks.checked_fields(fields, rows, k)
        version = check_non_negative_int("policy_version", policy_version)
        revision = check_non_negative_int("policy_revision", policy_revision)
        self._store(int(step_index), rows, index, complete, version, revision)

    def _check_rows_free(
        self, step_index: int, rows: int | None, index: slice | np.ndarray
    ) -> None:
        """Raise unless the ``rows`` (None: one) from ``step_index`` fit and are the next ones of every column."""
        if step_index + (rows or 1) > self._rollout_length:
            raise OverflowError(
                f"step_index: expected step_index + rows <= rollout_length {self._rollout_length}, "
                f"received step_index {step_index} + {rows or 1} rows"
            )
        held = self._arrays["column_steps"][index]
        if (held != step_index).any():  # the method: np.any's dispatch costs as much again
            wrong = held != step_index
            raise ValueError(
                f"columns: expected every column to hold step_index={step_index} rows, received "
                f"columns {self._all_columns[index][wrong].tolist()} holding {held[wrong].tolist()} rows"
            )

    def _store(
        self,
        row0: int,
        rows: int | None,
        index: slice | np.ndarray,
        fields: Mapping[str, np.ndarray],
        version: int,
        revision: int,
    ) -> None:
        """Copy every writable field into row ``row0`` (``rows`` None) or rows ``row0 .. row0 +
        rows - 1`` of the columns ``index``, stamp the policy version, count the rows. No checks."""
        at = row0 if rows is None else slice(row0, row0 + rows)
        arrays = self._arrays
        for item in self._checks.writable:
            value = fields[item.name]
            if isinstance(value, StackedRows) and isinstance(
                index, slice
            ):  # rebuilt straight into the rows
                value.write_into(arrays[item.name][at, index])
            else:  # an array, a default, or stacks rebuilt first (np.asarray) for columns that are not a slice
                arrays[item.name][at, index] = value
        arrays["policy_versions"][at, index] = version
        arrays["policy_revisions"][at, index] = revision
        arrays["column_steps"][index] += 1 if rows is None else rows
        self._bump(DATA_GENERATION)
