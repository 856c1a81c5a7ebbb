"""Environment factory: specs, same-step autoreset with true final observations, reward clipping,
raw episode statistics. Atari runs are small (2 envs, a few hundred steps)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from oakemu_core.envs import (
    EnvSpec,
    UnsupportedEnvironmentError,
    VectorEnv,
    env_spec,
    make_eval_env,
    make_vector_env,
)

# ---------------------------------------------------------------------------------------------
# Specs


def test_cartpole_spec() -> None:
    spec = env_spec("CartPole-v1")
    assert spec == EnvSpec(
        env_id="CartPole-v1",
        observation_shape=(4,),
        observation_dtype=np.dtype(np.float32),
        num_actions=2,
        action_shape=(),
        action_dtype=np.dtype(np.int64),
        is_atari=False,
    )


@pytest.mark.parametrize(
    ("env_id", "num_actions"),
    [("ALE/Breakout-v5", 4), ("ALE/Pong-v5", 6), ("ALE/MontezumaRevenge-v5", 18), ("SpaceInvadersNoFrameskip-v4", 6)],
)
def test_atari_spec_uses_the_minimal_action_set(env_id: str, num_actions: int) -> None:
    spec = env_spec(env_id)
    assert spec.observation_shape == (4, 84, 84)
    assert spec.observation_dtype == np.uint8
    assert spec.num_actions == num_actions
    assert spec.is_atari


@pytest.mark.parametrize("env_id", ["NoSuchEnv-v0", "ALE/NoSuchGame-v5", "Pendulum-v1", "FrozenLake-v1"])
def test_unsupported_ids_raise_a_clear_error(env_id: str) -> None:
    with pytest.raises(UnsupportedEnvironmentError, match="env_id"):
        env_spec(env_id)


# ---------------------------------------------------------------------------------------------
# Gymnasium backend


def test_cartpole_truncation_reports_the_true_final_observation() -> None:
    num_envs, limit = 3, 5
    with make_vector_env("CartPole-v1", num_envs, seed=0, max_episode_steps=limit) as env:
        assert env.spec == env_spec("CartPole-v1")
        observations = env.reset()
        assert observations.shape == (num_envs, 4) and observations.dtype == np.float32
        # Reference: the same envs stepped one by one with plain Gymnasium, no autoreset.
        references = [gymnasium.make("CartPole-v1", max_episode_steps=limit) for _ in range(num_envs)]
        expected = [ref.reset(seed=i)[0] for i, ref in enumerate(references)]
        np.testing.assert_array_equal(observations, np.stack(expected))
        actions = np.array([0, 1, 0], dtype=np.int64)  # 5 steps are too few to fall: only truncation
        for t in range(limit):
            step = env.step(actions)
            expected = [ref.step(int(a))[0] for ref, a in zip(references, actions, strict=True)]
            if t < limit - 1:
                assert not step.dones.any()
                np.testing.assert_array_equal(step.observations, np.stack(expected))
        assert step.truncated.all() and not step.terminated.any()
        # final_observations is the 5th observation of the episode; observations the reset one.
        np.testing.assert_array_equal(step.final_observations, np.stack(expected))
        assert not np.any(np.all(step.final_observations == step.observations, axis=1))
        assert np.all(np.abs(step.observations) <= 0.05)  # CartPole resets uniformly in [-0.05, 0.05]
        assert step.episode_lengths == [limit] * num_envs
        assert step.episode_returns == [float(limit)] * num_envs
        assert step.episode_env_ids == [0, 1, 2]
        for ref in references:
            ref.close()


def test_cartpole_terminated_episode_statistics_match_a_reference_loop() -> None:
    """Always pushing left ends CartPole episodes by termination; compare with plain Gymnasium."""
    with make_vector_env("CartPole-v1", 2, seed=7) as env:
        env.reset()
        reference = gymnasium.make("CartPole-v1")
        reference.reset(seed=7)
        expected_lengths = []
        length = 0
        while len(expected_lengths) < 3:
            _, reward, terminated, truncated, _ = reference.step(0)
            length += 1
            if terminated or truncated:
                expected_lengths.append(length)
                length = 0
                reference.reset()
        reference.close()
        lengths: list[int] = []
        returns: list[float] = []
        while len(lengths) < 3:
            step = env.step(np.zeros(2, dtype=np.int64))
            for env_index, episode_length, episode_return in zip(
                step.episode_env_ids, step.episode_lengths, step.episode_returns, strict=True
            ):
                if env_index == 0:
                    lengths.append(episode_length)
                    returns.append(episode_return)
            assert step.training_rewards.dtype == np.float32
            assert np.all(step.training_rewards == 1.0)  # no clipping for non-Atari by default
        assert lengths == expected_lengths
        assert returns == [float(n) for n in expected_lengths]  # CartPole pays 1 per step


def test_float64_observations_are_cast_to_float32() -> None:
    env_id = "OakEmuTest/Float64Obs-v0"
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=_Float64ObsEnv, max_episode_steps=3)
    assert env_spec(env_id).observation_dtype == np.float32
    with make_vector_env(env_id, 2, seed=0) as env:
        assert env.reset().dtype == np.float32
        for _ in range(3):
            step = env.step(np.zeros(2, dtype=np.int64))
        assert step.observations.dtype == np.float32 and step.final_observations.dtype == np.float32
        assert step.truncated.all()
        np.testing.assert_array_equal(step.final_observations, np.full((2, 2), 3.0, dtype=np.float32))
        np.testing.assert_array_equal(step.observations, np.zeros((2, 2), dtype=np.float32))


class _Float64ObsEnv(gymnasium.Env):
    """Counts steps; observation ``[t, t]`` as float64."""

    observation_space = gymnasium.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float64), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return np.full(2, float(self.t)), 0.0, False, False, {}


def test_invalid_actions_are_rejected() -> None:
    with make_vector_env("CartPole-v1", 2, seed=0) as env:
        with pytest.raises(RuntimeError, match="reset"):
            env.step(np.zeros(2, dtype=np.int64))
        env.reset()
        with pytest.raises(ValueError, match=r"expected shape \(2,\)"):
            env.step(np.zeros(3, dtype=np.int64))
        with pytest.raises(ValueError, match="integer"):
            env.step(np.zeros(2, dtype=np.float32))
        with pytest.raises(ValueError, match=r"\[0, 2\)"):
            env.step(np.array([0, 2], dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# Adapter bookkeeping with a scripted backend (rewards larger than 1, independent reference)


class _ScriptedBackend:
    """Rewards, terminated and truncated rows come from a script; observation = step counter."""

    def __init__(self, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.rewards, self.terminated, self.truncated = rewards, terminated, truncated
        self.num_envs = rewards.shape[1]
        self.spec = EnvSpec("Scripted", (1,), np.dtype(np.float32), num_actions=3)
        self.t = 0

    def reset(self, seed: int | None) -> np.ndarray:
        return np.zeros((self.num_envs, 1), dtype=np.float32)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        t = self.t
        self.t += 1
        observations = np.full((self.num_envs, 1), t + 1, dtype=np.float32)
        final = observations.copy()
        done = self.terminated[t] | self.truncated[t]
        observations[done] = -1.0  # "reset" observation
        return observations, self.rewards[t].astype(np.float64), self.terminated[t], self.truncated[t], final

    def close(self) -> None:
        pass


def test_reward_clipping_and_raw_episode_returns_against_a_reference() -> None:
    rng = np.random.default_rng(0)
    steps, n = 40, 3
    rewards = rng.choice([-7.0, -0.5, 0.0, 0.25, 1.0, 4.0, 30.0], size=(steps, n))
    terminated = rng.random((steps, n)) < 0.1
    truncated = (rng.random((steps, n)) < 0.05) & ~terminated
    env = VectorEnv(_ScriptedBackend(rewards, terminated, truncated), seed=0, clip_rewards=True)
    env.reset()
    got: list[tuple[int, float, int]] = []
    for t in range(steps):
        step = env.step(np.zeros(n, dtype=np.int64))
        expected_clipped = np.array([min(max(r, -1.0), 1.0) for r in rewards[t]], dtype=np.float32)
        np.testing.assert_array_equal(step.training_rewards, expected_clipped)
        got += list(zip(step.episode_env_ids, step.episode_returns, step.episode_lengths, strict=True))
    # Reference: plain loops over each column.
    expected: list[tuple[int, float, int]] = []
    for t in range(steps):
        for i in range(n):
            if terminated[t, i] or truncated[t, i]:
                start = max([s + 1 for s in range(t) if terminated[s, i] or truncated[s, i]], default=0)
                expected.append((i, float(sum(rewards[start : t + 1, i])), t + 1 - start))
    assert got == expected
    assert len(expected) > 5

    unclipped = VectorEnv(_ScriptedBackend(rewards, terminated, truncated), seed=0, clip_rewards=False)
    unclipped.reset()
    np.testing.assert_array_equal(unclipped.step(np.zeros(n, dtype=np.int64)).training_rewards, rewards[0])


# ---------------------------------------------------------------------------------------------
# Atari (ale-py)


def test_breakout_frames_truncation_and_final_observations() -> None:
    limit = 40
    with make_vector_env("ALE/Breakout-v5", 2, seed=1, max_episode_steps=limit, num_threads=1) as env:
        assert env.clip_rewards  # auto: on for Atari
        observations = env.reset()
        assert observations.shape == (2, 4, 84, 84) and observations.dtype == np.uint8
        rng = np.random.default_rng(1)
        ended = 0
        episode_start = np.zeros(2, dtype=np.int64)
        for t in range(2 * limit):
            step = env.step(rng.integers(0, env.spec.num_actions, size=2))
            assert step.observations.shape == (2, 4, 84, 84) and step.observations.dtype == np.uint8
            assert step.training_rewards.dtype == np.float32
            assert np.all(np.abs(step.training_rewards) <= 1.0)
            for row, length in zip(step.episode_env_ids, step.episode_lengths, strict=True):
                ended += 1
                assert length == t + 1 - episode_start[row]
                episode_start[row] = t + 1
                if step.truncated[row]:
                    assert length == limit
                # the reset frame stack differs from the last frames of the finished episode
                assert np.any(step.final_observations[row] != step.observations[row])
            not_done = ~step.dones
            np.testing.assert_array_equal(step.final_observations[not_done], step.observations[not_done])
        assert ended >= 2


def test_atari_training_rewards_are_clipped_while_episode_returns_stay_raw() -> None:
    """Two identically seeded Space Invaders envs (points 5..30 per hit), one clipping, one not."""
    kwargs = dict(seed=3, max_episode_steps=150, num_threads=1)
    with (
        make_vector_env("ALE/SpaceInvaders-v5", 2, clip_rewards=True, **kwargs) as clipped,
        make_vector_env("ALE/SpaceInvaders-v5", 2, clip_rewards=False, **kwargs) as raw,
    ):
        np.testing.assert_array_equal(clipped.reset(), raw.reset())
        rng = np.random.default_rng(0)
        raw_sums = np.zeros(2)
        clipped_sums = np.zeros(2)
        clipped_sum_per_episode: list[float] = []
        clipped_returns: list[float] = []
        reference_returns: list[float] = []
        saw_big_reward = False
        for _ in range(150):
            actions = rng.integers(0, clipped.spec.num_actions, size=2)
            step_c, step_r = clipped.step(actions), raw.step(actions)
            np.testing.assert_array_equal(step_c.observations, step_r.observations)
            np.testing.assert_array_equal(step_c.training_rewards, np.clip(step_r.training_rewards, -1.0, 1.0))
            saw_big_reward |= bool(np.any(step_r.training_rewards > 1.0))
            raw_sums += step_r.training_rewards
            clipped_sums += step_c.training_rewards
            for row in step_r.episode_env_ids:
                reference_returns.append(float(raw_sums[row]))
                clipped_sum_per_episode.append(float(clipped_sums[row]))
                raw_sums[row] = clipped_sums[row] = 0.0
            clipped_returns += step_c.episode_returns
            assert step_c.episode_returns == step_r.episode_returns
        assert saw_big_reward
        assert len(reference_returns) == 2  # both truncated at 150 steps
        assert clipped_returns == reference_returns
        # the reported return is the game score, larger than the sum of clipped rewards
        assert any(r > c for r, c in zip(reference_returns, clipped_sum_per_episode, strict=True))


def test_eval_env_is_one_unclipped_env() -> None:
    with make_eval_env("ALE/Breakout-v5", seed=0, max_episode_steps=10) as env:
        assert env.num_envs == 1 and not env.clip_rewards
        assert env.reset().shape == (1, 4, 84, 84)
        for _ in range(10):
            step = env.step(np.array([1], dtype=np.int64))
        assert step.truncated.tolist() == [True] and step.episode_lengths == [10]
