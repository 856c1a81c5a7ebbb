"""The documented API's names and signatures hold: users' code calls them as written.

The expected parameter lists are the API pages' (``RolloutBuffer``, ``PPOActorStepBuffers``,
``PPOLearner``): names, order and the documented defaults. Extra optional parameters after them are
allowed; a renamed, reordered or removed parameter, or a lost default, is not.
"""

from __future__ import annotations

import inspect

import pytest

import oakemu_core

# (object path, method or None for the constructor) -> [(name, has_default)], in order.
SIGNATURES: dict[tuple[str, str | None], list[tuple[str, bool]]] = {
    ("RolloutBuffer", None): [
        ("rollout_length", False),
        ("num_envs", False),
        ("observation_shape", False),
        ("observation_dtype", False),
    ],
    ("RolloutBuffer", "add"): [
        ("observations", False),
        ("actions", False),
        ("log_probs", False),
        ("values", False),
        ("rewards", False),
        ("dones", False),
        ("trainable", True),
    ],
    ("RolloutBuffer", "compute_gae"): [
        ("last_values", False),
        ("last_dones", False),
        ("gamma", False),
        ("gae_lambda", False),
    ],
    ("RolloutBuffer", "estimate_memory_pressure"): [("num_minibatches", False)],
    ("RolloutBuffer", "get_minibatches"): [("num_minibatches", False), ("device", False)],
    ("RolloutBuffer", "reset"): [],
    ("RolloutBuffer", "trainable_diagnostics"): [],
    ("PPOActorStepBuffers", None): [
        ("observations", False),
        ("actions", False),
        ("log_probs", False),
        ("values", False),
        ("rewards", False),
        ("dones", False),
        ("trainable", False),
    ],
    ("PPOActorStepBuffers", "add_to_rollout_buffer"): [("rollout_buffer", False)],
    ("PPOActorStepBuffers", "create"): [
        ("num_envs", False),
        ("observation_shape", False),
        ("observation_dtype", False),
    ],
    ("PPOActorStepBuffers", "record_action_bundle_for_env_ids"): [
        ("action_bundle", False),
        ("env_ids", False),
        ("trainable", False),
    ],
    ("PPOActorStepBuffers", "record_step_result"): [
        ("env_id", False),
        ("reward", False),
        ("done", False),
    ],
    ("PPOActorStepBuffers", "reset_action_selection"): [],
    ("PPOActorStepBuffers", "reset_step_results"): [],
    ("PPOLearner", None): [
        ("context", False),
        ("learner_model", False),
        ("rollout_buffer", False),
        ("optimizer", False),
        ("lr_schedule", False),
        ("action_mask", True),
        ("bc_sampler", True),
    ],
    ("PPOLearner", "restore_state"): [("state", False)],
    ("PPOLearner", "run"): [
        ("stop_event", False),
        ("current_step", False),
        ("rollout_handshake", False),
        ("policy", False),
    ],
    ("PPOLearner", "step"): [("actor_steps", False)],
}

PROPERTIES = {
    "RolloutBuffer": [
        "is_full",
        "memory_bytes",
        "memory_gb",
        "num_envs",
        "observation_dtype",
        "observation_shape",
        "rollout_length",
        "step",
        "total_size",
        "trainable_size",
    ],
    "PPOLearner": ["iterations", "rollouts_collected"],
}

NAMES = [
    "RolloutBuffer",
    "PPOActorStepBuffers",
    "PPOLearner",
    "RuntimeContext",
    "PPOExperimentConfiguration",
    "ThreadSafeModel",
    "PPOLearnerRuntimeState",
    "RolloutHandshake",
    "CheckpointPolicy",
]


def _parameters(owner: str, method: str | None) -> list[inspect.Parameter]:
    cls = getattr(oakemu_core, owner)
    target = cls.__init__ if method is None else getattr(cls, method)
    params = list(inspect.signature(target).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


@pytest.mark.parametrize("name", NAMES)
def test_the_documented_names_import_from_the_package(name: str) -> None:
    assert getattr(oakemu_core, name) is not None


@pytest.mark.parametrize(("owner", "method"), list(SIGNATURES), ids=lambda v: str(v))
def test_documented_parameters_come_first_in_order(owner: str, method: str | None) -> None:
    expected = SIGNATURES[(owner, method)]
    params = _parameters(owner, method)
    assert [p.name for p in params[: len(expected)]] == [name for name, _ in expected]
    for param, (name, optional) in zip(params, expected):
        # A documented default must stay; a parameter may gain one (documented calls still work).
        assert not optional or param.default is not inspect.Parameter.empty, name
    # Anything after the documented parameters must be optional: documented calls still work.
    for extra in params[len(expected) :]:
        assert extra.default is not inspect.Parameter.empty or extra.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ), f"{owner}.{method or '__init__'}: extra required parameter {extra.name}"


@pytest.mark.parametrize(
    ("owner", "attribute"), [(o, a) for o, attrs in PROPERTIES.items() for a in attrs]
)
def test_documented_properties_exist(owner: str, attribute: str) -> None:
    assert isinstance(inspect.getattr_static(getattr(oakemu_core, owner), attribute), property)


def test_a_learner_built_as_documented_steps_on_its_buffer() -> None:
    """The documented construction and ``step(actor_steps)`` train on the given buffer."""
    import numpy as np
    import torch

    from oakemu_core import (
        PPOExperimentConfiguration,
        PPOLearner,
        RolloutBuffer,
        RuntimeContext,
        ThreadSafeModel,
    )
    from oakemu_core.policy.models import build_model

    torch.manual_seed(0)
    T, N = 16, 2
    model = build_model((4,), np.float32, 2)
    buffer = RolloutBuffer(T, N, (4,), np.float32)
    rng = np.random.default_rng(0)
    for _ in range(T):
        buffer.add(
            rng.normal(size=(N, 4)).astype(np.float32),
            rng.integers(0, 2, size=N),
            np.full(N, -0.69, np.float32),
            rng.normal(size=N).astype(np.float32),
            np.ones(N, np.float32),
            np.zeros(N, bool),
        )
    buffer.compute_gae(np.zeros(N, np.float32), np.zeros(N, bool), 0.99, 0.95)
    config = PPOExperimentConfiguration(num_minibatches=2, ppo_epochs=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    learner = PPOLearner(RuntimeContext(config), ThreadSafeModel(model), buffer, optimizer, None)
    before = [p.detach().clone() for p in model.parameters()]
    learner.step(actor_steps=T * N)
    assert learner.iterations == 1 and learner.rollouts_collected == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
