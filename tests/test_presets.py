"""Presets: each shipped file loads and validates as a configuration; flags, OAKEMU_* variables and a TOML
file override it; the benchmark reads its hyperparameters from them."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oakemu_services import cli

from oakemu_core.config import OakEmuConfig, make_config
from oakemu_core.envs import env_spec
from oakemu_core.errors import ConfigError
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.presets import load_preset, preset_names
from oakemu_core.run.evaluation import build_evaluation

EXPECTED = {
    "cartpole": "CartPole-v1",
    "cartpole-lstm": "oakemu_core.envs.memory:CartPoleNoVel-v1",
    "lunarlander": "LunarLander-v3",
    "pendulum": "Pendulum-v1",
    "acrobot": "Acrobot-v1",
    "taxi": "Taxi-v4",
    "atari": "ALE/Breakout-v5",
    "airstriker": "retro:Airstriker-Genesis-v0",
}


pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


def test_the_package_ships_every_preset() -> None:
    assert preset_names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_loads_and_validates(name: str) -> None:
    preset = load_preset(name)
    assert preset.description and preset.expect
    config = make_config(base=preset.settings)
    assert config.env_id == EXPECTED[name]
    for key, value in preset.settings.items():
        assert getattr(config, key) == value, key  # every setting is a field, taken as written
    assert config.batch_size % config.num_minibatches == 0  # whole minibatches


class _FirstFrames:
    """A frame sink (oakemu_core.envs.render.FrameSink) that keeps the first frames of an episode."""

    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []
        self.error: str | None = None

    def begin(self, fps: float) -> bool:
        return not self.frames and self.error is None

    def add(self, frame: np.ndarray) -> None:
        self.frames.append(frame)

    def end(self) -> None:
        pass

    def fail(self, reason: str) -> None:
        self.error = reason


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_evaluates_and_records_videos_of_an_env_that_renders(name: str) -> None:
    # A user who trains a preset can watch it: evaluations on, with videos (best.mp4, final.mp4), and the
    # env renders full-colour frames with what the main install brings (box2d for LunarLander included).
    config = make_config(base=load_preset(name).settings)
    assert config.eval_every_updates > 0 and config.eval_video, name
    sink = _FirstFrames()
    model, env = build_evaluation(
        config.env_id,
        schema_for_env(env_spec(config.env_id)).to_dict(),
        seed=0,
        max_episode_steps=3,
        env_options=config.env_options,
        frame_sink=sink,
    )
    try:
        observations = env.reset()
        env.step(model.act(observations, action_mask=env.action_masks(), greedy=True).actions)
    finally:
        env.close()
    assert sink.error is None and sink.frames, name
    frame = sink.frames[0]
    assert (
        frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3 and frame.std() > 0
    ), name


def test_an_unknown_preset_names_the_closest_one() -> None:
    with pytest.raises(ConfigError, match=r"received 'cartpol'; did you mean 'cartpole'\?"):
        load_preset("cartpol")


def test_flags_variables_and_toml_override_a_preset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[Any, ...]] = []
    fake = types.ModuleType("oakemu_services.train")
    fake.main = lambda *args, **kwargs: calls.append(args) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "oakemu_services.train", fake)
    toml_file = tmp_path / "mine.toml"
    toml_file.write_text("gamma = 0.97\n", encoding="utf-8")
    monkeypatch.setenv("OAKEMU_PPO_EPOCHS", "7")
    assert (
        cli.main(
            ["train", "--preset", "cartpole", "--learning-rate", "5e-4", "--config", str(toml_file)]
        )
        == 0
    )
    config: OakEmuConfig = calls[0][0]
    assert (config.env_id, config.rollout_length, config.num_actors) == (
        "CartPole-v1",
        32,
        1,
    )  # the preset
    assert (config.learning_rate, config.ppo_epochs, config.gamma) == (
        5e-4,
        7,
        0.97,
    )  # flag, variable, TOML


RANGE = re.compile(r"\d+(?: seconds| minutes?)?(?: to |-)\d+ (?:seconds|minutes?|hours)")
"""A time as a range, quiet machine to busy one: "20-60 seconds", "20 seconds to 1 minute", "5-30 hours"."""


def test_preset_times_are_ranges_from_a_quiet_to_a_busy_machine() -> None:
    # One figure from a quiet machine misleads on a busy one (CartPole took 60 s, not "about 30").
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(r"^\| `([a-z][\w-]*)` \|.*\| ([^|]+) \|$", readme, re.M)
    }
    assert sorted(rows) == preset_names()
    for name, time_cell in rows.items():
        assert RANGE.search(time_cell), (name, time_cell)
        expect = load_preset(name).expect
        assert RANGE.search(expect) and "quiet to busy" in expect, (name, expect)
    quick_start = readme[readme.index("## Quick start") : readme.index("### Presets")]
    assert "about 30 seconds" not in quick_start
    assert re.search(
        r"--preset cartpole`.*\n?.*reaches a return of 500 in " + RANGE.pattern, quick_start
    )


def test_the_atari_preset_trains_an_unclipped_value_loss_that_a_flag_can_clip_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The atari preset sets ``clip_value_range`` to None with the ``# name = (unset)`` line config files
    use for None: plain MSE as SB3's, not the "auto" default's clip of 0.1 on Atari ids; a flag still
    chooses another value."""
    from tests.benchmarks.script_helpers import train_config

    assert load_preset("atari").settings["clip_value_range"] is None
    preset = train_config(["--preset", "atari"], monkeypatch)
    assert preset.clip_value_range is None and preset.resolved_clip_value_range is None
    assert train_config([], monkeypatch).resolved_clip_value_range == 0.1  # the defaults: CleanRL's
    clipped = train_config(["--preset", "atari", "--clip-value-range", "auto"], monkeypatch)
    assert clipped.resolved_clip_value_range == 0.1
