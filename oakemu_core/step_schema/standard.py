"""The standard fields of a step schema: :func:`build_schema` declares them from the env's observation
layout and the policy's action distribution (the table of :mod:`oakemu_core.step_schema`);
:func:`default_schema` and :func:`resolve_schema` serve constructors that take one plain observation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.step_schema.fields import (
    MAX_ABS_STEP_VALUE,
    StepField,
    observation_field_name,
    policy_revisions_field,
    scalar_field,
)
from oakemu_core.step_schema.schema import StepSchema

if TYPE_CHECKING:  # torch is imported lazily: the schema, buffers and wire stay torch-free
    from oakemu_core.policy.distributions import ActionDistribution


def build_schema(
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
    distribution: ActionDistribution | None,
    *,
    action_shape: tuple[int, ...] | None = None,
    action_dtype: Any = None,
    state_size: int = 0,
) -> StepSchema:
    """The step schema for an env's observations and a policy's action distribution.

    Args:
        observation_layout: observation key -> (per-env shape, dtype); key ``""`` for a plain
            observation, key paths (``"a.b"``) for a dict observation.
        distribution: the action distribution; its action shape/dtype, bounds, stored parameters
            and mask width decide the action fields. None: a plain schema whose actions have
            ``action_shape`` / ``action_dtype`` and no value checks.
        state_size: a recurrent policy's state floats per env (``policy_state``); 0: none.

    Raises:
        ValueError: an empty layout, or neither a distribution nor an action shape/dtype.
    """
    if not observation_layout:
        raise ValueError("observation_layout: expected at least one observation key")
    observations = [
        StepField(observation_field_name(key), tuple(shape), np.dtype(dtype), minibatch=True)
        for key, (shape, dtype) in sorted(observation_layout.items())
    ]
    fields = [
        *observations,
        _actions_field(distribution, action_shape, action_dtype),
        *_step_scalars(distribution),
        *(_distribution_fields(distribution) if distribution is not None else []),
        *([policy_state_field(state_size)] if state_size else []),
        scalar_field("policy_versions", np.int64, sent=False, minibatch=True, default=0),
        policy_revisions_field(),
        scalar_field("advantages", np.float32, sent=False, minibatch=True, default=0.0),
        scalar_field("returns", np.float32, sent=False, minibatch=True, default=0.0),
    ]
    return StepSchema(tuple(fields), distribution)


def policy_state_field(state_size: int) -> StepField:
    """``policy_state``: a recurrent policy's ``(state_size,)`` float32 state before the step (sent and
    stored; the learner's training sequences start from it: :mod:`oakemu_core.storage.sequences`)."""
    return StepField(
        "policy_state",
        (int(state_size),),
        np.dtype(np.float32),
        low=-MAX_ABS_STEP_VALUE,
        high=MAX_ABS_STEP_VALUE,
    )


def _actions_field(
    distribution: ActionDistribution | None, action_shape: Any, action_dtype: Any
) -> StepField:
    """``actions``: the distribution's shape, dtype and bounds, or (no distribution) the given
    shape and dtype without bounds."""
    if distribution is not None:
        low, high = distribution.action_bounds()
        return StepField(
            "actions",
            distribution.action_shape,
            distribution.action_dtype,
            minibatch=True,
            low=low,
            high=high,
        )
    if action_shape is None or action_dtype is None:
        raise ValueError("build_schema: expected a distribution, or action_shape and action_dtype")
    return StepField("actions", tuple(action_shape), np.dtype(action_dtype), minibatch=True)


def _step_scalars(distribution: ActionDistribution | None) -> list[StepField]:
    """The one-value-per-env fields an actor sends with every step (log probs to trainable)."""
    # A discrete log probability is <= 0; a Gaussian density may exceed 1 (positive log prob).
    discrete = distribution is not None and distribution.kind != "diag_gaussian"
    return [
        scalar_field(
            "log_probs",
            np.float32,
            minibatch=True,
            low=-1e4 if discrete else -MAX_ABS_STEP_VALUE,
            high=1e-3 if discrete else MAX_ABS_STEP_VALUE,
        ),
        scalar_field(
            "values", np.float32, minibatch=True, low=-MAX_ABS_STEP_VALUE, high=MAX_ABS_STEP_VALUE
        ),
        scalar_field("rewards", np.float32, low=-MAX_ABS_STEP_VALUE, high=MAX_ABS_STEP_VALUE),
        scalar_field("dones", np.bool_),
        scalar_field("truncated", np.bool_, stored=False),
        scalar_field(
            "bootstrap_values",
            np.float32,
            default=0.0,
            low=-MAX_ABS_STEP_VALUE,
            high=MAX_ABS_STEP_VALUE,
        ),
        scalar_field(
            "next_values",
            np.float32,
            stored=False,
            low=-MAX_ABS_STEP_VALUE,
            high=MAX_ABS_STEP_VALUE,
        ),
        scalar_field("trainable", np.bool_, default=True),
    ]


def _distribution_fields(distribution: ActionDistribution) -> list[StepField]:
    """What the distribution adds: its stored parameters (e.g. ``action_mean`` / ``action_std``) and
    the ``action_mask`` of a masked action space."""
    fields = []
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
    return fields


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
