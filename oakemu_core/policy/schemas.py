"""Step schemas with their action distribution: an env's schema, and a schema read from plain values.

:mod:`oakemu_core.step_schema` declares the fields and sits below the policy layer, so it never
builds an :class:`~oakemu_core.policy.distributions.ActionDistribution` itself; these two functions
do it for it.
"""

from __future__ import annotations

from typing import Any

from oakemu_core.policy.distributions import distribution_for_env, distribution_from_dict
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.step_schema import StepSchema, build_schema

__all__ = ["schema_for_env", "schema_from_dict"]


def schema_for_env(spec: Any, network: NetworkSpec | None = None) -> StepSchema:
    """The step schema of an :class:`oakemu_core.envs.EnvSpec`: its observation layout and the
    distribution of its action space (:func:`~oakemu_core.policy.distributions.distribution_for_env`),
    with the ``policy_state`` field of a recurrent ``network``.

    Raises:
        ValueError: an action space no distribution supports, or a mask width that does not fit it.
    """
    state_size = network.state_size if network is not None else 0
    return build_schema(spec.observation_layout, distribution_for_env(spec), state_size=state_size)


def schema_from_dict(value: Any) -> StepSchema:
    """Inverse of :meth:`StepSchema.to_dict` for untrusted input, the action distribution included
    (:meth:`StepSchema.from_dict` with
    :func:`~oakemu_core.policy.distributions.distribution_from_dict`).

    Raises:
        ValueError: naming what is wrong (a field, the distribution's kind or parameters).
    """
    return StepSchema.from_dict(value, distribution_from_dict)
