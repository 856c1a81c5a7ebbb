"""Env settings beyond the id: gymnasium.make keyword arguments and the Atari preprocessing, from the settings
to the env (spec, vector env, a join's env_config)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oakemu_core.config import load_config, make_config, to_toml
from oakemu_core.envs import UnsupportedEnvironmentError, env_spec, make_vector_env
from oakemu_core.envs.options import EnvOptions
from oakemu_core.transport.control_server import env_config

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


def test_the_defaults_are_cleanrls_atari_preprocessing() -> None:
    options = make_config().env_options
    assert options == EnvOptions() and options.make_kwargs == {}
    assert (options.atari_frame_skip, options.atari_frame_stack, options.atari_noop_max) == (
        4,
        4,
        30,
    )
    assert options.atari_sticky_actions is None and options.atari_episodic_life is True


def test_env_kwargs_from_an_option_a_variable_or_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert load_config(["--env-kwargs", '{"map_name": "8x8"}']).env_kwargs == {"map_name": "8x8"}
    monkeypatch.setenv("OAKEMU_ENV_KWARGS", '{"is_slippery": false}')
    assert load_config([]).env_kwargs == {"is_slippery": False}
    monkeypatch.delenv("OAKEMU_ENV_KWARGS")
    written = to_toml(
        make_config(env_id="FrozenLake-v1", env_kwargs={"map_name": "8x8", "is_slippery": False})
    )
    (tmp_path / "c.toml").write_text(written)
    assert load_config(["--config", str(tmp_path / "c.toml")]).env_kwargs == {
        "map_name": "8x8",
        "is_slippery": False,
    }
    with pytest.raises(Exception, match="expected a JSON object"):
        load_config(["--env-kwargs", "map_name=8x8"])


def test_env_kwargs_reach_gymnasium_make() -> None:
    small = env_spec("FrozenLake-v1")
    large = env_spec(
        "FrozenLake-v1", options=EnvOptions.from_settings({"env_kwargs": {"map_name": "8x8"}})
    )
    assert small.observation_shape == (16,) and large.observation_shape == (
        64,
    )  # one-hot of 4x4 / 8x8 states
    env = make_vector_env(
        "FrozenLake-v1",
        2,
        seed=0,
        options=EnvOptions.from_settings({"env_kwargs": {"map_name": "8x8"}}),
    )
    try:
        assert env.reset().shape == (2, 64)
    finally:
        env.close()
    with pytest.raises(
        UnsupportedEnvironmentError,
        match=r"env_kwargs: expected keyword arguments that 'CartPole-v1'",
    ):
        env_spec(
            "CartPole-v1", options=EnvOptions.from_settings({"env_kwargs": {"no_such_argument": 1}})
        )


def test_atari_preprocessing_settings_reach_ale_py() -> None:
    options = EnvOptions(
        atari_frame_stack=2, atari_frame_skip=2, atari_noop_max=0, atari_sticky_actions=0.0
    )
    assert env_spec("ALE/Breakout-v5").observation_shape == (4, 84, 84)
    assert env_spec("ALE/Breakout-v5", options=options).observation_shape == (2, 84, 84)
    env = make_vector_env("ALE/Breakout-v5", 1, seed=0, options=options)
    try:
        first = env.reset()
        assert first.shape == (1, 2, 84, 84) and first.dtype == np.uint8
    finally:
        env.close()


def test_actors_get_the_learners_env_options_in_the_join() -> None:
    config = make_config(
        env_id="FrozenLake-v1", env_kwargs={"map_name": "8x8"}, atari_frame_stack=3
    )
    sent = env_config(config, 0)
    assert all(
        value is None or isinstance(value, (bool, int, float, str)) for value in sent.values()
    )  # wire scalars
    assert EnvOptions.from_settings(sent) == config.env_options
