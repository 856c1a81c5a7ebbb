"""stable-retro backend on Airstriker-Genesis-v0 (the game stable-retro ships with its ROM).

stable-retro allows one emulator per process, so every test closes its env (the ``airstriker``
fixture) before the next one starts.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

retro = pytest.importorskip(
    "stable_retro", reason="stable-retro is not installed (pip install 'oakemu-rl[emulators]')"
)

from oakemu_core.envs.emulators import (
    EmulatorConfigError,
    EmulatorProcessError,
    make_emulator_env,
    validate_emulator_env,
)
from oakemu_core.envs.emulators.retro_backend import open_retro_envs

GAME = "Airstriker-Genesis-v0"
ENV_ID = f"retro:{GAME}"


@pytest.fixture
def settings(tmp_path: Path) -> Callable[[str], Path]:
    def write(body: str) -> Path:
        path = tmp_path / "emulator.toml"
        path.write_text(textwrap.dedent(body))
        return path

    return write


@pytest.fixture
def airstriker() -> Iterator[Callable[..., Any]]:
    """``airstriker(settings_path=None, max_episode_steps=None)``: the env, closed after the test."""
    envs: list[Any] = []

    def build(settings_path: Path | None = None, max_episode_steps: int | None = None) -> Any:
        env = make_emulator_env(
            ENV_ID,
            max_episode_steps=max_episode_steps,
            seed=0,
            settings_file=None if settings_path is None else str(settings_path),
        )
        envs.append(env)
        return env

    yield build
    for env in envs:
        env.close()
    assert open_retro_envs() == 0


def test_reset_step_and_raw_score(airstriker: Callable[..., Any]) -> None:
    env = airstriker()
    assert env.observation_space.shape == (4, 84, 84)
    assert env.action_space.shape == (12,)  # MultiBinary over the Genesis buttons
    observation, _ = env.reset(seed=0)
    assert observation.shape == (4, 84, 84) and observation.dtype == np.uint8
    fire = np.zeros(12, dtype=np.int8)
    fire[env.unwrapped.buttons.index("B")] = 1
    episode_return, steps, info = 0.0, 0, {}
    rng = np.random.default_rng(0)
    terminated = truncated = False
    while not (terminated or truncated):
        action = env.action_space.sample() | fire if rng.random() < 0.5 else fire  # keep shooting
        observation, reward, terminated, truncated, info = env.step(action)
        episode_return += reward
        steps += 1
        assert steps < 5000, "Airstriker with random play should end within 5000 agent steps"
    assert terminated and not truncated
    assert info["lives"] == 0
    assert episode_return > 0, "shooting for a whole game scores points"
    assert episode_return == info["score"], "the summed rewards are the game's raw score"


def test_discrete_combos_and_time_limit(
    airstriker: Callable[..., Any], settings: Callable[[str], Path]
) -> None:
    env = airstriker(
        settings("""
        [screen]
        height = 64
        width = 96
        frame_stack = 2
        [retro]
        action_mode = "discrete"
        combos = [[], ["B"], ["LEFT", "B"], ["RIGHT", "B"]]
        frames_per_action = 2
        max_episode_steps = 20
    """)
    )
    assert env.action_space.n == 4
    observation, _ = env.reset(seed=1)
    assert observation.shape == (2, 64, 96)
    flags = [env.step(step % 4)[2:4] for step in range(20)]
    assert flags[-1] == (False, True) and all(flag == (False, False) for flag in flags[:-1])


def test_state_pool(airstriker: Callable[..., Any], settings: Callable[[str], Path]) -> None:
    env = airstriker(settings('[retro]\nstates = ["Level1"]\n'))
    observation, _ = env.reset(seed=0)
    assert observation.shape == (4, 84, 84)


def test_second_emulator_in_one_process_is_refused(airstriker: Callable[..., Any]) -> None:
    first = airstriker()
    with pytest.raises(EmulatorProcessError, match="one emulator per process"):
        make_emulator_env(ENV_ID, max_episode_steps=None, settings_file=None, seed=1)
    first.close()
    second = airstriker()  # after close, a new one may start
    second.reset(seed=0)


def test_validation_refuses_more_than_one_env_per_process() -> None:
    with pytest.raises(EmulatorProcessError, match="envs_per_actor = 1"):
        validate_emulator_env(ENV_ID, None, envs_per_process=8)
    validate_emulator_env(ENV_ID, None, envs_per_process=1)


def test_process_backed_vector_env(airstriker: Callable[..., Any]) -> None:
    """Each env in a process of its own: 2 Airstriker emulators for one actor."""
    import gymnasium
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode

    def make_one() -> gymnasium.Env:
        return make_emulator_env(ENV_ID, max_episode_steps=50, settings_file=None, seed=None)

    vector = AsyncVectorEnv(
        [make_one, make_one], autoreset_mode=AutoresetMode.SAME_STEP, context="spawn"
    )
    try:
        observations, _ = vector.reset(seed=0)
        assert observations.shape == (2, 4, 84, 84)
        for _ in range(3):
            observations, rewards, *_ = vector.step(vector.action_space.sample())
        assert observations.shape == (2, 4, 84, 84) and rewards.shape == (2,)
    finally:
        vector.close()


@pytest.mark.parametrize(
    ("env_id", "body", "fragments"),
    [
        ("retro:NoSuchGame-Genesis-v0", "", ("NoSuchGame-Genesis-v0", "stable-retro game id")),
        ("retro:SonicTheHedgehog-Genesis-v0", "", ("ROM is not imported", "stable_retro.import")),
        (ENV_ID, '[retro]\nstates = ["Level9"]\n', ("retro.states[0]", "Level9")),
        (
            ENV_ID,
            '[retro]\naction_mode = "discrete"\ncombos = [["JUMP"]]\n',
            ("retro.combos[0]", "JUMP"),
        ),
        (ENV_ID, '[retro]\naction_mode = "discrete"\n', ("combos",)),
        (ENV_ID, '[retro]\nscenario = "nope"\n', ("retro.scenario", "nope")),
        ("retro:", "", ("expected e.g.",)),
    ],
)
def test_bad_inputs(
    env_id: str, body: str, fragments: tuple[str, ...], settings: Callable[[str], Path]
) -> None:
    if env_id == "retro:SonicTheHedgehog-Genesis-v0":
        try:
            retro.data.get_romfile_path("SonicTheHedgehog-Genesis-v0")
            pytest.skip("this machine has the Sonic ROM imported")
        except FileNotFoundError:
            pass
    with pytest.raises(EmulatorConfigError) as caught:
        validate_emulator_env(env_id, str(settings(body)) if body else None)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)
    assert open_retro_envs() == 0, "validation must not start an emulator"
