"""Search spaces of ``oakemu tune``: the TOML format, its refusals (one line each) and the default spaces."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from oakemu_core.config import make_config
from oakemu_core.errors import ConfigError
from oakemu_core.presets import load_preset, preset_names
from oakemu_core.tuning.search_space import (
    DEFAULT_SPACE,
    IMAGES_SPACE,
    default_space,
    default_space_path,
    load_space,
    parse_space,
)

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_space_file_gives_floats_ints_and_choices_that_an_optuna_trial_samples(
    tmp_path: Path,
) -> None:
    space = load_space(
        _write(
            tmp_path,
            """
            [space.learning_rate]
            low = 1e-5
            high = 1e-2
            log = true
            [space.ppo_epochs]
            low = 1
            high = 20
            [space.clip_coef]
            choices = [0.1, 0.2]
            [space.net_arch]
            choices = ["64", "64,64"]
            """,
        )
    )
    kinds = {parameter.name: parameter.kind for parameter in space.parameters}
    assert kinds == {
        "learning_rate": "float",
        "ppo_epochs": "int",  # from the setting's type: ppo_epochs is an int
        "clip_coef": "categorical",
        "net_arch": "categorical",
    }
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = space.suggest(study.ask())
        assert 1e-5 <= params["learning_rate"] <= 1e-2
        assert isinstance(params["ppo_epochs"], int) and 1 <= params["ppo_epochs"] <= 20
        assert params["clip_coef"] in (0.1, 0.2) and params["net_arch"] in ("64", "64,64")
        make_config(**params)  # every sample is a valid setting


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected [space.<setting>] tables"),
        ("[other]\nx = 1\n[space.gamma]\nchoices = [0.9]", "received the key(s) other"),
        (
            "[space.lerning_rate]\nlow = 1e-5\nhigh = 1e-3",
            "'lerning_rate' is no setting; did you mean 'learning_rate'",
        ),
        ("[space.run_name]\nchoices = ['a']", "'run_name' cannot be tuned"),
        ("[space.gamma]\nlow = 0.99\nhigh = 0.9", "expected low < high"),
        ("[space.learning_rate]\nlow = 0.0\nhigh = 1e-3\nlog = true", "log = true needs low > 0"),
        (
            "[space.learning_rate]\nlow = 1e-5\nhigh = 1e-3\nlog = true\nstep = 1e-5",
            "expected step or log",
        ),
        ("[space.gamma]\nlow = 0.9", "expected choices = [...] or both low and high"),
        ("[space.gamma]\nlow = 0.9\nhigh = 0.99\nlg = true", "unknown key(s) lg"),
        ("[space.gamma]\nchoices = []", "expected a non-empty list"),
        ("[space.gamma]\nchoices = [0.9, 0.9]", "expected distinct values"),
        ("[space.gamma]\nchoices = [[0.9]]", "expected numbers, strings or booleans"),
        (
            "[space.gamma]\nchoices = [0.9]\nlow = 0.1",
            "expected choices or low/high, received both",
        ),
        ("[space.ppo_epochs]\nlow = 1.5\nhigh = 4", "low: expected an integer"),
        (
            "[space.gamma]\nlow = 0.9\nhigh = 0.99\ntype = 'double'",
            "type: expected 'int' or 'float'",
        ),
        ("[space.gamma]\nlow = 'a'\nhigh = 0.99", "low: expected a finite number"),
        ("space = 3", "received no [space.<setting>] table"),
    ],
)
def test_a_bad_space_is_one_line_naming_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_space(_write(tmp_path, text))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(tmp_path / "space.toml") in str(raised.value)


def test_a_missing_or_malformed_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read .*nothing.toml"):
        load_space(tmp_path / "nothing.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_space(_write(tmp_path, "[space.gamma\n"))


def test_values_are_checked_against_the_other_settings(tmp_path: Path) -> None:
    space = parse_space({"space": {"gamma": {"choices": [0.9, 1.5]}}}, "my.toml")
    with pytest.raises(ConfigError, match=r"my.toml: \[space.gamma\] 1.5: gamma: .*1"):
        space.check(lambda **params: make_config(**params))
    minibatches = parse_space({"space": {"num_minibatches": {"low": 1, "high": 512}}}, "my.toml")
    cartpole = load_preset("cartpole").settings  # 32 steps x 8 envs: 256 rows per rollout
    with pytest.raises(ConfigError, match=r"\[space.num_minibatches\] 512: num_minibatches"):
        minibatches.check(lambda **params: make_config(cartpole, **params))


@pytest.mark.parametrize("preset", preset_names())
def test_the_default_space_of_every_preset_fits_its_settings(preset: str) -> None:
    settings = load_preset(preset).settings
    space = default_space(settings["env_id"])
    space.check(lambda **params: make_config(settings, **params))
    images = preset in ("atari", "airstriker")
    assert default_space_path(settings["env_id"]).name == (
        IMAGES_SPACE if images else DEFAULT_SPACE
    )
    assert ("net_arch" in space.names) is not images
    assert {"learning_rate", "gamma", "clip_coef", "ppo_epochs"} <= set(space.names)
