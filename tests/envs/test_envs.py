"""Environment factory: specs, same-step autoreset with true final observations, reward clipping,
raw episode statistics. Atari runs are small (2 envs, a few hundred steps)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from oakemu_core.envs import (
    EnvSpec,
    InvalidActionMaskError,
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
        observation_layout={"": ((4,), np.dtype(np.float32))},
        action_space=gymnasium.spaces.Discrete(2),
        action_mask_width=0,
        is_atari=False,
    )
    assert spec != EnvSpec(
        "CartPole-v1", {"": ((4,), np.dtype(np.float32))}, gymnasium.spaces.Discrete(3)
    )
    assert not spec.is_dict_observation
    assert spec.observation_shape == (4,) and spec.observation_dtype == np.float32
    assert spec.num_actions == 2 and spec.action_shape == () and spec.action_dtype == np.int64
    assert spec == EnvSpec.discrete("CartPole-v1", (4,), np.float32, 2)
    assert hash(spec) == hash(EnvSpec.discrete("CartPole-v1", (4,), np.float32, 2))


@pytest.mark.parametrize(
    ("env_id", "num_actions"),
    [
        ("ALE/Breakout-v5", 4),
        ("ALE/Pong-v5", 6),
        ("ALE/MontezumaRevenge-v5", 18),
        ("SpaceInvadersNoFrameskip-v4", 6),
    ],
)
def test_atari_spec_uses_the_minimal_action_set(env_id: str, num_actions: int) -> None:
    spec = env_spec(env_id)
    assert spec.observation_shape == (4, 84, 84)
    assert spec.observation_dtype == np.uint8
    assert spec.num_actions == num_actions
    assert spec.is_atari


@pytest.mark.parametrize("env_id", ["NoSuchEnv-v0", "ALE/NoSuchGame-v5"])
def test_unknown_ids_raise_a_clear_error(env_id: str) -> None:
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
        references = [
            gymnasium.make("CartPole-v1", max_episode_steps=limit) for _ in range(num_envs)
        ]
        expected = [ref.reset(seed=i)[0] for i, ref in enumerate(references)]
        np.testing.assert_array_equal(observations, np.stack(expected))
        actions = np.array(
            [0, 1, 0], dtype=np.int64
        )  # 5 steps are too few to fall: only truncation
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
        assert np.all(
            np.abs(step.observations) <= 0.05
        )  # CartPole resets uniformly in [-0.05, 0.05]
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
        np.testing.assert_array_equal(
            step.final_observations, np.full((2, 2), 3.0, dtype=np.float32)
        )
        np.testing.assert_array_equal(step.observations, np.zeros((2, 2), dtype=np.float32))


class _Float64ObsEnv(gymnasium.Env):
    """Counts steps; observation ``[t, t]`` as float64."""

    observation_space = gymnasium.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[np.ndarray, dict]:
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
        self.spec = EnvSpec.discrete("Scripted", (1,), np.float32, num_actions=3)
        self.t = 0

    def reset(self, seed: int | None) -> tuple[np.ndarray, None]:
        return np.zeros((self.num_envs, 1), dtype=np.float32), None

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        t = self.t
        self.t += 1
        observations = np.full((self.num_envs, 1), t + 1, dtype=np.float32)
        final = observations.copy()
        done = self.terminated[t] | self.truncated[t]
        observations[done] = -1.0  # "reset" observation
        return (
            observations,
            self.rewards[t].astype(np.float64),
            self.terminated[t],
            self.truncated[t],
            final,
            None,
        )

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
        got += list(
            zip(step.episode_env_ids, step.episode_returns, step.episode_lengths, strict=True)
        )
    # Reference: plain loops over each column.
    expected: list[tuple[int, float, int]] = []
    for t in range(steps):
        for i in range(n):
            if terminated[t, i] or truncated[t, i]:
                start = max(
                    [s + 1 for s in range(t) if terminated[s, i] or truncated[s, i]], default=0
                )
                expected.append((i, float(sum(rewards[start : t + 1, i])), t + 1 - start))
    assert got == expected
    assert len(expected) > 5

    unclipped = VectorEnv(
        _ScriptedBackend(rewards, terminated, truncated), seed=0, clip_rewards=False
    )
    unclipped.reset()
    np.testing.assert_array_equal(
        unclipped.step(np.zeros(n, dtype=np.int64)).training_rewards, rewards[0]
    )


# ---------------------------------------------------------------------------------------------
# Atari (ale-py)


def test_breakout_frames_truncation_and_final_observations() -> None:
    limit = 40
    with make_vector_env(
        "ALE/Breakout-v5", 2, seed=1, max_episode_steps=limit, num_threads=1
    ) as env:
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
            np.testing.assert_array_equal(
                step.final_observations[not_done], step.observations[not_done]
            )
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
            np.testing.assert_array_equal(
                step_c.training_rewards, np.clip(step_r.training_rewards, -1.0, 1.0)
            )
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


# ---------------------------------------------------------------------------------------------
# Spaces: specs
#
# _ProbeEnv is configured per registered id; its observations are samples of its observation
# space drawn from its own seeded RNG, so a plain Gymnasium copy stepped side by side (the
# reference) sees the same raw values, which the tests convert independently.


class _ProbeEnv(gymnasium.Env):
    """Observation: samples of ``observation_space``; records the actions it receives.

    ``masks``: None (no masks), "info" (``info["action_mask"]``) or "method" (``action_masks()``);
    the mask is a fresh random one per observation (every segment allows at least one value),
    unless ``bad_mask`` (a callable ``(seed, t) -> mask or None``) overrides it.
    """

    def __init__(
        self,
        observation_space: gymnasium.Space,
        action_space: gymnasium.Space,
        masks: str | None = None,
        segments: tuple[int, ...] = (),
        bad_mask: object = None,
        horizon: int = 1000,
    ) -> None:
        self.observation_space, self.action_space = observation_space, action_space
        self.mask_mode, self.segments, self.bad_mask, self.horizon = (
            masks,
            segments,
            bad_mask,
            horizon,
        )
        self.received: list[object] = []
        self.reset_seed: int | None = None
        if masks == "method":  # sb3-contrib's convention, only on envs configured for it
            self.action_masks = self._action_masks

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[object, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.reset_seed = seed
            self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self._observe()

    def step(self, action: object) -> tuple[object, float, bool, bool, dict]:
        self.received.append(np.array(action, copy=True))
        self.t += 1
        observation, info = self._observe()
        return observation, 0.0, self.t >= self.horizon, False, info

    def _observe(self) -> tuple[object, dict]:
        observation = self.observation_space.sample()
        info: dict = {}
        if self.mask_mode is not None:
            mask = np.concatenate(
                [_random_segment_mask(self.np_random, n) for n in self.segments]
            ).astype(np.int8)
            if self.bad_mask is not None:
                override = self.bad_mask(self.reset_seed, self.t)  # type: ignore[operator]
                mask = mask if override is None else override
            self.mask = mask
            if self.mask_mode == "info":
                info["action_mask"] = mask
        return observation, info

    def _action_masks(self) -> np.ndarray:
        return self.mask


def _random_segment_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    mask = rng.random(n) < 0.5
    mask[rng.integers(n)] = True
    return mask


def _register(
    env_id: str, observation_space: gymnasium.Space, action_space: gymnasium.Space, **kwargs: object
) -> str:
    if env_id not in gymnasium.registry:
        gymnasium.register(
            id=env_id,
            entry_point=_ProbeEnv,
            kwargs={"observation_space": observation_space, "action_space": action_space, **kwargs},
        )
    return env_id


def _sub_envs(env: VectorEnv) -> list[_ProbeEnv]:
    return [sub.unwrapped for sub in env._backend._env.envs]  # type: ignore[attr-defined]


Box, Discrete, MultiDiscrete, MultiBinary, Dict = (
    gymnasium.spaces.Box,
    gymnasium.spaces.Discrete,
    gymnasium.spaces.MultiDiscrete,
    gymnasium.spaces.MultiBinary,
    gymnasium.spaces.Dict,
)
VECTOR = Box(-1.0, 1.0, (3,), np.float32)


def test_pendulum_spec_has_box_actions() -> None:
    spec = env_spec("Pendulum-v1")
    assert spec.observation_layout == {"": ((3,), np.dtype(np.float32))}
    assert spec.action_space == Box(-2.0, 2.0, (1,), np.float32)
    assert spec.action_shape == (1,) and spec.action_dtype == np.float32
    assert spec.action_mask_width == 0 and spec.action_mask_segments == ()
    with pytest.raises(ValueError, match="Discrete"):
        _ = spec.num_actions


def test_discrete_observations_are_one_hot_and_taxi_has_masks() -> None:
    assert env_spec("FrozenLake-v1").observation_layout == {"": ((16,), np.dtype(np.float32))}
    assert env_spec("FrozenLake-v1").action_mask_width == 0
    taxi = env_spec("Taxi-v4")
    assert taxi.observation_layout == {"": ((500,), np.dtype(np.float32))}
    assert (
        taxi.action_space == Discrete(6)
        and taxi.action_mask_width == 6
        and taxi.action_mask_segments == (6,)
    )


def test_taxi_v3_is_refused_with_gymnasiums_advice() -> None:
    """Gymnasium 1.4 deprecated Taxi-v3 (Taxi-v4 replaces it): the error says so."""
    with pytest.raises(UnsupportedEnvironmentError, match=r"Taxi-v3.*Taxi-v4"):
        env_spec("Taxi-v3")


NESTED = Dict(
    {
        "agent": Dict(
            {
                "position": Box(-5.0, 5.0, (2,), np.float64),
                "frame": Box(0, 255, (3, 4, 4), np.uint8),
            }
        ),
        "goal": Discrete(5, start=10),
        "flags": MultiBinary(3),
        "grid": MultiDiscrete([2, 3]),
    }
)


def _convert_nested(raw: dict) -> dict[str, np.ndarray]:
    """Independent conversion of a NESTED sample: flatten keys, one-hot, float32."""
    goal = np.zeros(5, dtype=np.float32)
    goal[raw["goal"] - 10] = 1.0
    grid = np.zeros(5, dtype=np.float32)
    grid[raw["grid"][0]] = 1.0
    grid[2 + raw["grid"][1]] = 1.0
    return {
        "agent.frame": raw["agent"]["frame"],
        "agent.position": raw["agent"]["position"].astype(np.float32),
        "flags": raw["flags"].astype(np.float32),
        "goal": goal,
        "grid": grid,
    }


def test_dict_observations_are_flattened_with_their_dtypes_against_a_reference() -> None:
    env_id = _register("OakEmuTest/NestedDict-v0", NESTED, Discrete(2), horizon=3)
    spec = env_spec(env_id)
    assert spec.observation_layout == {
        "agent.frame": ((3, 4, 4), np.dtype(np.uint8)),
        "agent.position": ((2,), np.dtype(np.float32)),
        "flags": ((3,), np.dtype(np.float32)),
        "goal": ((5,), np.dtype(np.float32)),
        "grid": ((5,), np.dtype(np.float32)),
    }
    assert spec.is_dict_observation and spec.observation_keys == (
        "agent.frame",
        "agent.position",
        "flags",
        "goal",
        "grid",
    )
    with pytest.raises(ValueError, match="observation_layout"):
        _ = spec.observation_shape
    references = [gymnasium.make(env_id) for _ in range(2)]
    with make_vector_env(env_id, 2, seed=5) as env:
        expected = [_convert_nested(ref.reset(seed=5 + i)[0]) for i, ref in enumerate(references)]
        observations = env.reset()
        for t in range(4):
            assert isinstance(observations, dict) and list(observations) == list(
                spec.observation_layout
            )
            for key, (shape, dtype) in spec.observation_layout.items():
                assert observations[key].shape == (2, *shape) and observations[key].dtype == dtype
                np.testing.assert_array_equal(
                    observations[key], np.stack([e[key] for e in expected])
                )
            step = env.step(np.array([0, 1]))
            outcomes = [ref.step(a) for ref, a in zip(references, [0, 1], strict=True)]
            expected = [_convert_nested(outcome[0]) for outcome in outcomes]
            if (
                t == 2
            ):  # horizon 3: both terminate; final = the 3rd observation, observations = reset ones
                assert step.terminated.all()
                for key in spec.observation_layout:
                    np.testing.assert_array_equal(
                        step.final_observations[key], np.stack([e[key] for e in expected])
                    )
                expected = [_convert_nested(ref.reset()[0]) for ref in references]
            observations = step.observations
    for ref in references:
        ref.close()


def test_multi_discrete_and_multi_binary_specs() -> None:
    md = env_spec(
        _register("OakEmuTest/MultiDiscreteStart-v0", VECTOR, MultiDiscrete([3, 5], start=[1, -2]))
    )
    assert md.action_space == MultiDiscrete([3, 5]) and md.action_space.start.tolist() == [0, 0]
    assert (
        md.action_shape == (2,)
        and md.action_dtype == np.int64
        and md.action_mask_segments == (3, 5)
    )
    mb = env_spec(_register("OakEmuTest/MultiBinary-v0", VECTOR, MultiBinary(4)))
    assert (
        mb.action_space == MultiBinary(4) and mb.action_shape == (4,) and mb.action_dtype == np.int8
    )
    assert mb.action_mask_segments == (2, 2, 2, 2)
    masked_md = env_spec(
        _register(
            "OakEmuTest/MaskedMD-v0", VECTOR, MultiDiscrete([3, 5]), masks="info", segments=(3, 5)
        )
    )
    assert masked_md.action_mask_width == 8
    masked_mb = env_spec(
        _register(
            "OakEmuTest/MaskedMB-v0", VECTOR, MultiBinary(3), masks="method", segments=(2, 2, 2)
        )
    )
    assert masked_mb.action_mask_width == 6


@pytest.mark.parametrize(
    ("name", "observation_space", "action_space", "named"),
    [
        ("TupleObs", gymnasium.spaces.Tuple((VECTOR, Discrete(2))), Discrete(2), "Tuple"),
        ("TextObs", gymnasium.spaces.Text(5), Discrete(2), "Text"),
        ("SequenceObs", gymnasium.spaces.Sequence(VECTOR), Discrete(2), "Sequence"),
        ("GraphObs", gymnasium.spaces.Graph(VECTOR, Discrete(2)), Discrete(2), "Graph"),
        ("OneOfObs", gymnasium.spaces.OneOf((VECTOR, Discrete(2))), Discrete(2), "OneOf"),
        (
            "NestedTupleObs",
            Dict({"a": Dict({"b": gymnasium.spaces.Tuple((VECTOR,))})}),
            Discrete(2),
            "Tuple.*'a.b'",
        ),
        ("TupleAct", VECTOR, gymnasium.spaces.Tuple((Discrete(2), Discrete(3))), "Tuple"),
        ("MD2DAct", VECTOR, MultiDiscrete([[2, 3], [4, 5]]), "MultiDiscrete"),
        ("MB2DAct", VECTOR, MultiBinary((2, 3)), "MultiBinary"),
        ("Box2DAct", VECTOR, Box(-1.0, 1.0, (2, 2), np.float32), "Box"),
        ("IntBoxAct", VECTOR, Box(0, 5, (2,), np.int64), "Box"),
    ],
)
def test_unsupported_spaces_are_refused_naming_the_space(
    name: str, observation_space: gymnasium.Space, action_space: gymnasium.Space, named: str
) -> None:
    env_id = _register(f"OakEmuTest/{name}-v0", observation_space, action_space)
    with pytest.raises(UnsupportedEnvironmentError, match=f"env_id.*{env_id}.*{named}"):
        env_spec(env_id)
    with pytest.raises(UnsupportedEnvironmentError, match=named):
        make_vector_env(env_id, 2, seed=0)


def test_spec_round_trips_through_plain_data() -> None:
    msgpack = pytest.importorskip("msgpack")
    specs = [
        env_spec("CartPole-v1"),
        env_spec("Pendulum-v1"),
        env_spec("Taxi-v4"),
        env_spec("OakEmuTest/NestedDict-v0")
        if "OakEmuTest/NestedDict-v0" in gymnasium.registry
        else env_spec(_register("OakEmuTest/NestedDict-v0", NESTED, Discrete(2), horizon=3)),
        env_spec(
            _register(
                "OakEmuTest/MaskedMB-v0", VECTOR, MultiBinary(3), masks="method", segments=(2, 2, 2)
            )
        ),
        env_spec(
            _register(
                "OakEmuTest/MultiDiscreteStart-v0", VECTOR, MultiDiscrete([3, 5], start=[1, -2])
            )
        ),
        env_spec(
            _register("OakEmuTest/UnboundedBox-v0", VECTOR, Box(-np.inf, np.inf, (2,), np.float64))
        ),
    ]
    for spec in specs:
        data = msgpack.unpackb(msgpack.packb(spec.to_dict()))
        assert EnvSpec.from_dict(data) == spec
    assert EnvSpec.from_dict(specs[1].to_dict()) != EnvSpec.from_dict(specs[2].to_dict())


# ---------------------------------------------------------------------------------------------
# Custom envs (module:EnvId) and the emulator seam


def test_module_env_id_imports_the_module() -> None:
    spec = env_spec("tests.spaces_envs:DictTarget-v0")
    assert spec.observation_layout == {
        "image": ((1, 12, 12), np.dtype(np.uint8)),
        "vector": ((2,), np.dtype(np.float32)),
    }
    assert spec.action_space == Discrete(4)
    with make_eval_env("tests.spaces_envs:MultiDiscreteTarget-v0", seed=0) as env:
        assert env.spec.action_space == MultiDiscrete([3, 4]) and env.reset().shape == (1, 7)


def test_module_import_errors_are_one_clear_error(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UnsupportedEnvironmentError, match=r"no_such_pkg_xyz.*ModuleNotFoundError"):
        env_spec("no_such_pkg_xyz.envs:Thing-v0")
    (tmp_path / "oakemu_broken_envs.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        UnsupportedEnvironmentError, match=r"oakemu_broken_envs.*RuntimeError: boom at import"
    ):
        make_vector_env("oakemu_broken_envs:Thing-v0", 1, seed=0)
    (tmp_path / "oakemu_empty_envs.py").write_text("X = 1\n")
    with pytest.raises(UnsupportedEnvironmentError, match="Nothing-v0"):
        env_spec("oakemu_empty_envs:Nothing-v0")


def test_module_env_ids_resolve_from_the_working_directory(tmp_path) -> None:
    """Console scripts (``oakemu``) do not put the working directory on sys.path; we search it."""
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "assert '' not in sys.path and sys.path[0] != __import__('os').getcwd()\n"
        "from oakemu_core.envs import env_spec\n"
        "print(sorted(env_spec('tests.spaces_envs:DictTarget-v0').observation_layout))\n"
    )
    repo_root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['image', 'vector']"


def test_emulator_ids_go_through_make_emulator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    calls: list[dict] = []

    def make_emulator_env(
        env_id: str, *, max_episode_steps: int | None, settings_file: str | None, seed: int | None
    ):
        calls.append(
            {
                "env_id": env_id,
                "max_episode_steps": max_episode_steps,
                "settings_file": settings_file,
                "seed": seed,
            }
        )
        return None if env_id.endswith("unknown") else gymnasium.make("CartPole-v1")

    fake = types.ModuleType("oakemu_core.envs.emulators")
    fake.make_emulator_env = make_emulator_env  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "oakemu_core.envs.emulators", fake)
    env_spec.cache_clear()
    spec = env_spec("gameboy:fake-rom", settings_file="s.toml")
    assert (
        spec.observation_layout == {"": ((4,), np.dtype(np.float32))}
        and spec.env_id == "gameboy:fake-rom"
    )
    calls.clear()
    with make_vector_env(
        "retro:fake-game", 2, seed=3, max_episode_steps=7, settings_file="s.toml"
    ) as env:
        assert env.reset().shape == (2, 4)
    assert [
        c["seed"] for c in calls if c["env_id"] == "retro:fake-game" and c["seed"] is not None
    ] == [3, 4]
    assert all(c["settings_file"] == "s.toml" for c in calls)
    assert any(c["max_episode_steps"] == 7 for c in calls)
    with pytest.raises(UnsupportedEnvironmentError, match="known emulator id"):
        env_spec("gameboy:unknown")
    monkeypatch.setitem(
        __import__("sys").modules, "oakemu_core.envs.emulators", None
    )  # import fails
    env_spec.cache_clear()
    with pytest.raises(UnsupportedEnvironmentError, match="emulator support.*not installed"):
        env_spec("gameboy:fake-rom")
    env_spec.cache_clear()


# ---------------------------------------------------------------------------------------------
# Action masks


def test_taxi_masks_and_one_hot_observations_match_a_reference_across_autoreset() -> None:
    num_envs, limit = 2, 4
    references = [gymnasium.make("Taxi-v4", max_episode_steps=limit) for _ in range(num_envs)]
    resets = [ref.reset(seed=11 + i) for i, ref in enumerate(references)]
    expected_obs = [r[0] for r in resets]
    expected_masks = [r[1]["action_mask"].astype(bool) for r in resets]
    rng = np.random.default_rng(0)
    saw_reset = False
    with make_vector_env("Taxi-v4", num_envs, seed=11, max_episode_steps=limit) as env:
        observations = env.reset()
        for t in range(3 * limit):
            np.testing.assert_array_equal(observations, np.eye(500, dtype=np.float32)[expected_obs])
            masks = env.action_masks()
            assert masks is not None and masks.dtype == np.bool_ and masks.shape == (num_envs, 6)
            np.testing.assert_array_equal(masks, np.stack(expected_masks))
            actions = np.array([rng.choice(np.flatnonzero(m)) for m in masks])
            step = env.step(actions)
            expected_obs, expected_masks = [], []
            for row, (ref, action) in enumerate(zip(references, actions, strict=True)):
                observation, _, terminated, truncated, info = ref.step(int(action))
                assert bool(step.dones[row]) == (terminated or truncated)
                if terminated or truncated:
                    assert int(np.argmax(step.final_observations[row])) == observation
                    observation, info = ref.reset()  # the new episode: its mask must be reported
                    saw_reset = True
                expected_obs.append(observation)
                expected_masks.append(info["action_mask"].astype(bool))
            np.testing.assert_array_equal(step.action_masks, np.stack(expected_masks))
            observations = step.observations
    assert saw_reset
    for ref in references:
        ref.close()


def test_method_masks_per_sub_action_after_autoreset_match_a_reference() -> None:
    from tests.spaces_envs import MaskedMultiDiscreteEnv

    env_id = "tests.spaces_envs:MaskedMultiDiscrete-v0"
    references = [MaskedMultiDiscreteEnv() for _ in range(3)]
    for i, ref in enumerate(references):
        ref.reset(seed=20 + i)
    with make_vector_env(env_id, 3, seed=20) as env:
        assert env.spec.action_mask_width == 7
        env.reset()
        rng = np.random.default_rng(1)
        for t in range(20):
            masks = env.action_masks()
            np.testing.assert_array_equal(
                masks, np.stack([ref.action_masks().astype(bool) for ref in references])
            )
            actions = np.array(
                [
                    [rng.choice(np.flatnonzero(m[:3])), rng.choice(np.flatnonzero(m[3:]))]
                    for m in masks
                ]
            )
            step = env.step(actions)
            for row, ref in enumerate(references):
                _, _, terminated, _, _ = ref.step(actions[row])
                if terminated:
                    ref.reset()
            assert step.dones.all() == (t % 8 == 7)
            np.testing.assert_array_equal(
                step.action_masks, np.stack([ref.action_masks().astype(bool) for ref in references])
            )


def test_masked_actions_are_refused_before_any_env_steps() -> None:
    env_id = _register(
        "OakEmuTest/MaskedMBProbe-v0", VECTOR, MultiBinary(3), masks="info", segments=(2, 2, 2)
    )
    with make_vector_env(env_id, 2, seed=0) as env:
        env.reset()
        masks = env.action_masks()
        assert masks is not None and masks.shape == (2, 6)
        # a bit whose value 1 is forbidden somewhere: find one, then ask for it
        row, bit = next(
            (r, b)
            for r in range(2)
            for b in range(3)
            if not masks[r, 2 * b + 1] or not masks[r, 2 * b]
        )
        forbidden = 1 if not masks[row, 2 * bit + 1] else 0
        actions = np.array(
            [
                [int(np.flatnonzero(masks[r, 2 * b : 2 * b + 2])[0]) for b in range(3)]
                for r in range(2)
            ]
        )
        bad = actions.copy()
        bad[row, bit] = forbidden
        with pytest.raises(ValueError, match=rf"env {row} .*forbids"):
            env.step(bad)
        assert all(sub.received == [] for sub in _sub_envs(env))  # nothing reached any env
        env.step(actions)
        received = [sub.received for sub in _sub_envs(env)]
        np.testing.assert_array_equal(np.stack([r[0] for r in received]), actions)
        assert received[0][0].dtype == np.int8


def _bad_mask_factory(kind: str) -> object:
    def bad_mask(seed: int | None, t: int) -> np.ndarray | None:
        if seed != 11 or t < 2:  # env 1 of a vector env seeded 10, from its second step on
            return None
        return {
            "wrong_width": np.ones(4, dtype=np.int8),
            "none_valid": np.zeros(5, dtype=np.int8),
            "sub_action_empty": np.array([1, 0, 0, 0, 0], dtype=bool),
            "float_dtype": np.ones(5, dtype=np.float32),
            "not_binary": np.array([2, 1, 1, 1, 1], dtype=np.int8),
        }[kind]

    return bad_mask


@pytest.mark.parametrize(
    "kind", ["wrong_width", "none_valid", "sub_action_empty", "float_dtype", "not_binary"]
)
def test_bad_masks_raise_naming_the_env(kind: str) -> None:
    env_id = _register(
        f"OakEmuTest/BadMask-{kind}-v0",
        VECTOR,
        MultiDiscrete([2, 3]),
        masks="info",
        segments=(2, 3),
        bad_mask=_bad_mask_factory(kind),
    )
    assert env_spec(env_id).action_mask_width == 5
    with make_vector_env(env_id, 2, seed=10) as env:
        env.reset()
        env.step(
            np.zeros((2, 2), dtype=np.int64)
            + np.argmax(env.action_masks()[:, :2], axis=1)[:, None] * [1, 0]
            + np.argmax(env.action_masks()[:, 2:], axis=1)[:, None] * [0, 1]
        )
        masks = env.action_masks()
        actions = np.stack(
            [np.argmax(masks[:, :2], axis=1), np.argmax(masks[:, 2:], axis=1)], axis=1
        )
        with pytest.raises(
            InvalidActionMaskError, match=rf"env 1 of 'OakEmuTest/BadMask-{kind}-v0'.*received"
        ):
            env.step(actions)


def test_a_bad_first_mask_is_refused_by_env_spec() -> None:
    env_id = _register(
        "OakEmuTest/BadFirstMask-v0",
        VECTOR,
        Discrete(3),
        masks="method",
        segments=(3,),
        bad_mask=lambda seed, t: np.zeros(3, dtype=bool),
    )
    with pytest.raises(
        InvalidActionMaskError,
        match=r"env 0 of 'OakEmuTest/BadFirstMask-v0'.*\[False, False, False\]",
    ):
        env_spec(env_id)
    assert issubclass(InvalidActionMaskError, ValueError)


# ---------------------------------------------------------------------------------------------
# Actions: start offsets, Box clipping, validation


def test_discrete_and_multi_discrete_starts_are_added_back_for_the_env() -> None:
    discrete = _register("OakEmuTest/DiscreteStart-v0", VECTOR, Discrete(3, start=-1))
    assert env_spec(discrete).action_space == Discrete(3)
    with make_vector_env(discrete, 2, seed=0) as env:
        env.reset()
        env.step(np.array([0, 2]))
        assert [int(sub.received[0]) for sub in _sub_envs(env)] == [-1, 1]
    multi = _register(
        "OakEmuTest/MultiDiscreteStart-v0", VECTOR, MultiDiscrete([3, 5], start=[1, -2])
    )
    with make_vector_env(multi, 2, seed=0) as env:
        env.reset()
        env.step(np.array([[0, 4], [2, 0]]))
        assert [sub.received[0].tolist() for sub in _sub_envs(env)] == [[1, 2], [3, -2]]
        with pytest.raises(ValueError, match=r"nvec \[3, 5\]"):
            env.step(np.array([[0, 5], [0, 0]]))
        with pytest.raises(ValueError, match=r"expected shape \(2, 2\)"):
            env.step(np.array([0, 1]))


def test_box_actions_are_clipped_at_the_env_boundary_and_non_finite_ones_refused() -> None:
    env_id = _register(
        "OakEmuTest/BoxAct-v0",
        VECTOR,
        Box(np.array([-1.0, 0.0]), np.array([1.0, 2.0]), dtype=np.float64),
    )
    spec = env_spec(env_id)
    assert spec.action_space == Box(
        np.array([-1.0, 0.0], np.float32), np.array([1.0, 2.0], np.float32), dtype=np.float32
    )
    with make_vector_env(env_id, 2, seed=0) as env:
        env.reset()
        sampled = np.array([[5.0, -3.0], [0.25, 1.5]], dtype=np.float32)
        kept = sampled.copy()
        env.step(sampled)
        np.testing.assert_array_equal(sampled, kept)  # the caller's (stored) action is untouched
        received = [sub.received[0] for sub in _sub_envs(env)]
        np.testing.assert_array_equal(np.stack(received), [[1.0, 0.0], [0.25, 1.5]])
        assert received[0].dtype == np.float64
        for bad in (np.nan, np.inf, -np.inf):
            actions = np.array([[0.0, 0.0], [0.0, bad]])
            with pytest.raises(ValueError, match=r"finite.*env 1"):
                env.step(actions)
        assert [len(sub.received) for sub in _sub_envs(env)] == [
            1,
            1,
        ]  # no non-finite action was stepped
        with pytest.raises(ValueError, match=r"expected shape \(2, 2\)"):
            env.step(np.zeros(2))


def test_pendulum_receives_clipped_torques_against_a_reference() -> None:
    with make_vector_env("Pendulum-v1", 1, seed=4) as env:
        reference = gymnasium.make("Pendulum-v1")
        np.testing.assert_array_equal(env.reset()[0], reference.reset(seed=4)[0])
        for torque in (7.5, -3.0, 0.5):
            step = env.step(np.array([[torque]], dtype=np.float32))
            observation, reward, *_ = reference.step(
                np.array([min(max(torque, -2.0), 2.0)], dtype=np.float32)
            )
            np.testing.assert_array_equal(step.observations[0], observation)
            assert step.training_rewards[0] == np.float32(reward)
        reference.close()


def test_multi_binary_actions_are_checked() -> None:
    env_id = _register("OakEmuTest/MultiBinary-v0", VECTOR, MultiBinary(4))
    with make_vector_env(env_id, 2, seed=0) as env:
        env.reset()
        with pytest.raises(ValueError, match=r"\{0, 1\}"):
            env.step(np.array([[0, 1, 2, 0], [0, 0, 0, 0]]))
        with pytest.raises(ValueError, match="integer"):
            env.step(np.zeros((2, 4), dtype=np.float32))
        env.step(np.array([[True, False, True, False], [0, 0, 0, 1]], dtype=bool))
        assert [sub.received[0].tolist() for sub in _sub_envs(env)] == [[1, 0, 1, 0], [0, 0, 0, 1]]
