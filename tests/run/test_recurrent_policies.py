"""A recurrent policy outside training: evaluation (``play_episodes``) carries its state per env and
restarts it at each episode's end; ``load_policy``'s :class:`Policy` keeps it between ``act`` calls and
starts again on ``reset()``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oakemu_core.envs import env_spec, make_vector_env
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.episodic import EpisodicActor
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.run.evaluation import play_episodes
from oakemu_core.run.loading import Policy

CARTPOLE = "CartPole-v1"
OBSERVATIONS = np.random.default_rng(0).normal(0.0, 1.0, size=(6, 4)).astype(np.float32)


def recurrent_model(kind: str = "lstm", seed: int = 0) -> ActorCritic:
    spec = env_spec(CARTPOLE)
    torch.manual_seed(seed)
    return build_model(
        spec.observation_layout,
        distribution_for_env(spec),
        network=NetworkSpec(recurrent=kind, recurrent_hidden=8),
    ).eval()


class StateSpy:
    """Wraps ``model.act`` and keeps the state each call was given and the state it returned."""

    def __init__(self, model: ActorCritic) -> None:
        self.given: list[np.ndarray] = []
        self.returned: list[np.ndarray] = []
        act = model.act

        def spied(*args, **kwargs):
            bundle = act(*args, **kwargs)
            self.given.append(np.array(kwargs["state"], copy=True))
            self.returned.append(np.array(bundle.next_state, copy=True))
            return bundle

        model.act = spied  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_play_episodes_carries_the_state_and_zeroes_it_at_each_episode_end(kind: str) -> None:
    model = recurrent_model(kind)
    spy = StateSpy(model)
    env = make_vector_env(CARTPOLE, 2, seed=3, clip_rewards=False, max_episode_steps=12)
    dones = []
    step = env.step

    def recorded_step(actions):
        result = step(actions)
        dones.append(result.dones.copy())
        return result

    env.step = recorded_step  # type: ignore[method-assign]
    try:
        result = play_episodes(model, env, episodes=4, greedy=True)
    finally:
        env.close()
    assert len(result.returns) == 4 and all(length <= 12 for length in result.lengths)
    np.testing.assert_array_equal(spy.given[0], 0.0)
    for t in range(1, len(spy.given)):
        expected = np.where(dones[t - 1][:, None], 0.0, spy.returned[t - 1])
        np.testing.assert_array_equal(spy.given[t], expected)
    ended = np.stack(dones[:-1])
    assert ended.any() and (~ended).any()
    given = np.stack(spy.given[1:])
    assert (given[ended] == 0).all() and (np.abs(given[~ended]).sum(axis=-1) > 0).all()
    assert not np.array_equal(spy.given[1], spy.given[2])  # the state changes from step to step


def test_policy_keeps_the_state_between_calls_and_reset_starts_again() -> None:
    model = recurrent_model()
    policy = Policy(model, CARTPOLE, Path("policy"))
    assert policy.recurrent and policy.state is None
    first = [policy.act(observation) for observation in OBSERVATIONS]
    state = policy.state
    assert state is not None and state.shape == (1, model.state_size)
    # the same as acting on the sequence with the model's own state passing
    expected, carried = [], model.initial_state(1)
    for observation in OBSERVATIONS:
        bundle = model.act(observation[None], greedy=True, state=carried)
        expected.append(bundle.actions[0])
        carried = bundle.next_state
    assert [int(a) for a in first] == [int(a) for a in expected]
    np.testing.assert_allclose(state, carried, atol=1e-6)
    policy.reset()
    assert policy.state is None
    again = [policy.act(observation) for observation in OBSERVATIONS]
    assert [int(a) for a in again] == [int(a) for a in first]
    np.testing.assert_allclose(policy.state, state, atol=1e-6)
    policy.state[:] = 0  # a copy: the policy's own state is untouched
    np.testing.assert_allclose(policy.state, state, atol=1e-6)


def test_a_batched_policy_resets_the_rows_whose_episode_ended() -> None:
    model = recurrent_model()
    policy = Policy(model, CARTPOLE, Path("policy"))
    batch = OBSERVATIONS[:3]
    policy.act(batch)
    policy.act(batch)
    before = policy.state
    policy.reset(np.array([False, True, False]))
    after = policy.state
    np.testing.assert_array_equal(after[1], 0.0)
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])
    policy.reset([0])
    np.testing.assert_array_equal(policy.state[0], 0.0)
    with pytest.raises(ValueError, match="reset"):
        policy.act(batch[:2])  # another number of envs without reset(): refused, state kept
    np.testing.assert_array_equal(policy.state[2], before[2])
    with pytest.raises(IndexError):
        policy.reset(np.array([True, False]))
    policy.reset()
    assert policy.act(batch[:2]).shape == (2,) and policy.state.shape == (2, model.state_size)


def test_a_feed_forward_policy_keeps_no_state() -> None:
    spec = env_spec(CARTPOLE)
    model = build_model(spec.observation_layout, distribution_for_env(spec)).eval()
    policy = Policy(model, CARTPOLE, Path("policy"))
    action = policy.act(OBSERVATIONS[0])
    policy.reset()
    policy.reset([0])
    assert not policy.recurrent and policy.state is None
    assert policy.act(OBSERVATIONS[0]) == action


def test_episodic_actor_refuses_a_state_row_outside_the_batch() -> None:
    actor = EpisodicActor(recurrent_model())
    actor.act(OBSERVATIONS[:2])
    with pytest.raises(IndexError):
        actor.reset([5])
