"""oakemu_core.envs.memory: CartPoleNoVel-v1 observes CartPole-v1's positions only, with its dynamics,
time limit and registration (gymnasium.make by ``module:EnvId``, OakEmu's vector env factory)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from oakemu_core.envs import env_spec, make_vector_env
from oakemu_core.envs.memory import PositionsOnly

ENV_ID = "oakemu_core.envs.memory:CartPoleNoVel-v1"


def test_observations_are_cartpoles_positions_under_the_same_seed_and_actions() -> None:
    no_vel, full = gymnasium.make(ENV_ID), gymnasium.make("CartPole-v1")
    observation, _ = no_vel.reset(seed=7)
    reference, _ = full.reset(seed=7)
    assert observation.shape == (2,) and observation.dtype == np.float32
    assert no_vel.observation_space.shape == (2,)
    np.testing.assert_array_equal(
        no_vel.observation_space.high, full.observation_space.high[[0, 2]]
    )
    actions = np.random.default_rng(0).integers(0, 2, 60)
    steps, episodes = 0, 0
    for action in actions:
        observation, reward, terminated, truncated, _ = no_vel.step(int(action))
        reference, reference_reward, ref_terminated, ref_truncated, _ = full.step(int(action))
        np.testing.assert_array_equal(observation, reference[[0, 2]])
        assert (reward, terminated, truncated) == (reference_reward, ref_terminated, ref_truncated)
        steps += 1
        if terminated or truncated:
            episodes += 1
            observation, _ = no_vel.reset(seed=100 + episodes)
            reference, _ = full.reset(seed=100 + episodes)
            np.testing.assert_array_equal(observation, reference[[0, 2]])
    assert steps == 60 and episodes >= 1  # random play ends an episode within 60 steps
    no_vel.close()
    full.close()


def test_the_time_limit_is_cartpoles() -> None:
    env = gymnasium.make(ENV_ID)
    assert env.spec is not None and env.spec.max_episode_steps == 500
    assert env.spec.reward_threshold == 475.0
    env.close()


def test_oakemus_vector_env_factory_builds_it() -> None:
    assert env_spec(ENV_ID).observation_layout == {"": ((2,), np.dtype(np.float32))}
    with make_vector_env(ENV_ID, 2, seed=0) as env:
        observations = env.reset()
        assert observations.shape == (2, 2) and observations.dtype == np.float32
        step = env.step(np.array([0, 1]))
        assert step.observations.shape == (2, 2)
    references = [gymnasium.make("CartPole-v1") for _ in range(2)]
    for i, reference in enumerate(references):  # env i is seeded with seed + i
        np.testing.assert_array_equal(observations[i], reference.reset(seed=i)[0][[0, 2]])
        reference.close()


def test_positions_only_refuses_an_index_outside_the_observation() -> None:
    with pytest.raises(ValueError, match="indices"):
        PositionsOnly(gymnasium.make("CartPole-v1"), (0, 4))
