"""The rules between the fields of one step (truncated implies done, bootstrap values only on
truncated rows, the action taken allowed by its mask), and the check of one step's values for a
writer that is not behind the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from oakemu_core.step_schema.fields import (
    SMALL_ARRAY_SIZE,
)
from oakemu_core.step_schema.schema import StepSchema

if TYPE_CHECKING:  # torch is imported lazily: the schema, buffers and wire stay torch-free
    from oakemu_core.policy.distributions import ActionDistribution


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
