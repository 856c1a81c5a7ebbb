"""What a join reply builds on an actor: envs that give the learner's step fields, the model with the
join's weights, the stepper at the join's policy version; a reply the actor cannot serve is a setup
error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from oakemu_core.actor.client import ActorSetupError
from oakemu_core.actor.join_setup import make_envs, make_model, make_stepper
from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.models import build_model, weights_to_arrays
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.transport.control import JoinReply
from oakemu_core.transport.steps import StepSpec
from tests.transport.test_wire import ATARI_SPEC


def cartpole_reply(schema: Any = None, **env_config: Any) -> JoinReply:
    spec = env_spec("CartPole-v1")
    schema = schema or schema_for_env(spec)
    torch.manual_seed(0)
    weights = weights_to_arrays(build_model(spec.observation_layout, schema.distribution))
    config = {
        "env_id": "CartPole-v1",
        "seed": 1,
        "clip_rewards": False,
        "max_episode_steps": None,
        "emulator_settings": None,
        "normalize_observations": False,
        **env_config,
    }
    return JoinReply(True, "", 0, StepSpec(2, schema), config, 4, weights)


def test_a_join_reply_sets_up_envs_model_and_stepper() -> None:
    reply = cartpole_reply()
    env = make_envs(OakEmuConfig(envs_per_actor=2), reply)
    try:
        model = make_model(env, reply)
        for name, array in weights_to_arrays(model).items():
            np.testing.assert_array_equal(array, reply.weights[name])
        stepper = make_stepper(env, model, reply)
        assert stepper.policy_version == 4 and stepper.router is None
        row = stepper.step()
        assert row.buffers.num_envs == 2
    finally:
        env.close()


def test_a_join_reply_the_actor_cannot_serve_is_a_setup_error() -> None:
    with pytest.raises(ActorSetupError, match="step fields"):
        make_envs(OakEmuConfig(envs_per_actor=2), cartpole_reply(schema=ATARI_SPEC.schema))
    reply = cartpole_reply(
        route_scripted_policy="no_such_module:policy", route_scripted_probability=0.5
    )
    env = make_envs(OakEmuConfig(envs_per_actor=2), reply)
    try:
        with pytest.raises(ActorSetupError, match="policy routing"):
            make_stepper(env, make_model(env, reply), reply)
    finally:
        env.close()
