"""An actor service without envs or model, for tests of its weights handling: a stepper that only
owns the policy version, and :class:`~oakemu_core.actor.weights.ActorWeights` that record the
versions they load."""

from __future__ import annotations

from typing import Any

import numpy as np

from oakemu_core.actor.weights import ActorWeights


class FakeStepper:
    """The owner of the actor's ``(policy_version, weights_revision)``; counts :meth:`reselect`."""

    def __init__(self, policy_version: int = 0) -> None:
        self.policy_version = policy_version
        self.weights_revision = 0
        self.reselects = 0

    def reselect(self) -> bool:
        self.reselects += 1
        return True


def fake_weights(actor: Any, loaded: list[int], policy_version: int = 0) -> ActorWeights:
    """Give ``actor`` (an ``oakemu_services.actor.Actor`` that never joined) a :class:`FakeStepper` at
    ``policy_version`` and weights without a model: each load appends its version to ``loaded``."""
    actor.stepper = FakeStepper(policy_version)
    weights = ActorWeights(actor.stepper, lambda arrays: None)
    load = weights.load

    def recording_load(version: int, arrays: dict[str, np.ndarray], revision: int = 0) -> None:
        loaded.append(version)
        load(version, arrays, revision)

    weights.load = recording_load  # type: ignore[method-assign]
    actor.weights = weights
    return weights
