"""The checks of one write of rows into a rollout buffer: its columns, counts and field arrays.

:class:`WriteChecks` is what :meth:`~oakemu_core.storage.rollout_buffer.RolloutBuffer.write` runs
before it copies anything for a writer that is not behind the wire: every writable stored field of
the schema by name, dtype and shape (:meth:`~oakemu_core.step_schema.StepSchema.check_arrays`) and
value (:func:`~oakemu_core.step_schema.check_step_values`), the same checks
:func:`~oakemu_core.transport.steps.decode_step` applies to a step message. The column helpers turn
an actor's buffer columns into the cheapest numpy index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from oakemu_core.step_schema import StepSchema, check_array, check_step_values

__all__ = [
    "COMPUTED_FIELDS",
    "WriteChecks",
    "check_non_negative_int",
    "check_positive_int",
    "checked_columns",
    "column_index",
]

COMPUTED_FIELDS = ("policy_versions", "policy_revisions", "advantages", "returns")
"""Stored fields the buffer fills itself (the write stamps the versions, GAE the advantages and
returns); a writer provides the others."""


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int. Raises ValueError unless it is a positive int (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, received {value!r}")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int. Raises ValueError unless it is an int >= 0 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, received {value!r}")
    return int(value)


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
    if (
        not isinstance(columns, np.ndarray)
        or columns.ndim != 1
        or not np.issubdtype(columns.dtype, np.integer)
    ):
        received = (
            f"shape {columns.shape} dtype {columns.dtype}"
            if isinstance(columns, np.ndarray)
            else type(columns).__name__
        )
        raise ValueError(f"columns: expected a 1-D integer numpy array, received {received}")
    listed = columns.tolist()
    if listed and (min(listed) < 0 or max(listed) >= num_columns):
        raise ValueError(f"columns: expected indices in [0, {num_columns}), received {listed}")
    if len(set(listed)) != len(listed):
        raise ValueError(f"columns: expected distinct indices, received {listed}")
    columns = columns.astype(np.int64, copy=False)
    return columns, column_index(columns)


def _merge_leading(value: Any, lead: tuple[int, ...]) -> Any:
    """A ``(*lead, *shape)`` array as ``(prod(lead), *shape)`` (a view where numpy can); anything
    else unchanged, for the shape check to name."""
    if not isinstance(value, np.ndarray) or value.shape[: len(lead)] != lead:
        return value
    return value.reshape(math.prod(lead), *value.shape[len(lead) :])


class WriteChecks:
    """The field checks of a write for one schema, with the field lists they go by computed once.

    Args:
        schema: the buffer's step schema.

    Attributes:
        writable: the stored fields a writer provides (all stored fields but :data:`COMPUTED_FIELDS`).
        unsent_defaults: name -> default of the writable fields actors do not send (a schema's
            own additions): a write of validated step messages stores these.
    """

    def __init__(self, schema: StepSchema) -> None:
        self.schema = schema
        self.writable = tuple(f for f in schema.stored if f.name not in COMPUTED_FIELDS)
        self._sent_only = tuple(f for f in schema.sent if not f.stored)  # truncated, next_values
        self.unsent_defaults = {f.name: f.default for f in self.writable if not f.sent}

    def checked_fields(
        self, fields: Mapping[str, Any], rows: int | None, k: int
    ) -> dict[str, np.ndarray]:
        """Every writable field of ``fields`` (``(K, ...)`` arrays, ``(rows, K, ...)`` with
        ``rows``) after the checks, defaults filled in, in the shape given; the sent-only fields
        (``truncated``, ``next_values``) are checked, then dropped.

        Raises:
            ValueError: a wrong, missing or unknown field, or an impossible value (named).
        """
        lead = (k,) if rows is None else (rows, k)
        count = math.prod(lead)
        flat = (
            dict(fields)
            if rows is None
            else {name: _merge_leading(v, lead) for name, v in fields.items()}
        )
        sent_only = {f.name: flat.pop(f.name) for f in self._sent_only if f.name in flat}
        self.schema.check_arrays(flat, count, self.writable)
        for name, value in sent_only.items():
            check_array(name, value, (count, *self.schema[name].shape), self.schema[name].dtype)
        complete = {}
        for item in self.writable:
            value = flat.get(item.name)
            complete[item.name] = (
                np.full((count, *item.shape), item.default, item.dtype) if value is None else value
            )
        check_step_values(self.schema, {**complete, **sent_only})
        if rows is None:
            return complete
        return {name: value.reshape(*lead, *value.shape[1:]) for name, value in complete.items()}
