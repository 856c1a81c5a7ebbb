"""``oakemu record`` with a recurrent model: the model's state is carried from step to step and zeroed
where an episode ended (the Minari writing itself is tested in test_demonstrations.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.algo import recording
from oakemu_core.envs import make_vector_env
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import build_model
from oakemu_core.policy.network import NetworkSpec


def test_a_recurrent_model_records_with_its_state_restarted_at_each_episode_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(recording._Episode, "episode_buffer", lambda self, episode_id: self)
    env = make_vector_env("CartPole-v1", 2, seed=4, clip_rewards=False, max_episode_steps=10)
    torch.manual_seed(0)
    model = build_model(
        env.spec.observation_layout,
        distribution_for_env(env.spec),
        network=NetworkSpec(recurrent="gru", recurrent_hidden=8),
    ).eval()
    given, returned = [], []
    act = model.act

    def spied(*args, **kwargs):
        bundle = act(*args, **kwargs)
        given.append(np.array(kwargs["state"], copy=True))
        returned.append(np.array(bundle.next_state, copy=True))
        return bundle

    model.act = spied  # type: ignore[method-assign]
    dones = []
    step = env.step

    def recorded_step(actions):
        result = step(actions)
        dones.append(result.dones.copy())
        return result

    env.step = recorded_step  # type: ignore[method-assign]
    try:
        policy = recording.make_recording_policy(model, env.spec)
        episodes, returns = recording._play_episodes(env, policy, 3, "policy model")
    finally:
        env.close()
    assert len(episodes) == len(returns) == 3
    np.testing.assert_array_equal(given[0], 0.0)
    for t in range(1, len(given)):
        np.testing.assert_array_equal(
            given[t], np.where(dones[t - 1][:, None], 0.0, returned[t - 1])
        )
    ended = np.stack(dones[:-1])
    assert ended.any() and (np.abs(np.stack(given[1:])[~ended]).sum(axis=-1) > 0).all()
