"""OakEmuConfig: defaults, source precedence, validation messages, TOML round trip."""

from __future__ import annotations

import os
import tomllib
import typing
from pathlib import Path

import pytest

from oakemu_core.actor.fitting import fit_actor_count
from oakemu_core.config import (
    CONFIG_FILE_ENV_VAR,
    ConfigError,
    OakEmuConfig,
    available_cpus,
    load_config,
    resolved_device,
    to_toml,
)
from oakemu_core.envs.spec import is_atari_env
from oakemu_core.run.config_file import settings_from_toml
from oakemu_core.run.run_folder import resumed_settings


@pytest.fixture(autouse=True)
def _clean_oakemu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests must not see OAKEMU_* variables of the shell that runs them."""
    for name in list(os.environ):
        if name.startswith("OAKEMU_"):
            monkeypatch.delenv(name)


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_the_usual_atari_ppo_settings() -> None:
    config = load_config([])
    expected = {
        "env_id": "ALE/Breakout-v5",
        "num_envs": None,
        "rollout_length": 128,
        "total_env_steps": 10_000_000,
        "ppo_epochs": 4,
        "num_minibatches": 4,
        "learning_rate": 2.5e-4,
        "anneal_lr": True,
        "clip_coef": 0.1,
        "clip_value_range": "auto",
        "ent_coef": 0.01,
        "vf_coef": 0.5,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "max_grad_norm": 0.5,
        "target_kl": None,
        "normalize_advantages": True,
        "max_policy_lag": 2,
        "seed": 1,
        "device": "auto",
        "bind_host": "127.0.0.1",
        "learner_host": "127.0.0.1",
        "data_port": 5555,
        "control_port": 5556,
        "weights_port": 5557,
        "telemetry_port": 5558,
        "metrics_port": 9100,
        "actor_timeout_s": 10.0,
        "max_message_bytes": 64 * 1024 * 1024,
        "runs_dir": Path("runs"),
        "checkpoint_every_updates": 50,
        "torch_threads": 1,
        "log_level": "INFO",
    }
    assert {name: getattr(config, name) for name in expected} == expected
    assert config.buffer_num_envs == config.num_actors * config.envs_per_actor == 16
    assert config.num_actors == fit_actor_count(16, available_cpus())
    assert config.batch_size == 128 * 16
    assert config.resolved_clip_rewards is True


@pytest.mark.parametrize(
    ("num_envs", "cpus", "actors"),
    [
        (16, 1, 1),
        (16, 2, 1),
        (16, 3, 2),
        (16, 4, 2),
        (16, 5, 4),
        (16, 8, 4),
        (16, 64, 4),
        (8, 2, 1),
        (8, 3, 2),
        (8, 16, 2),
        (4, 16, 1),
        (6, 8, 1),
        (3, 8, 1),
        (32, 16, 8),
    ],
)
def test_fit_actor_count_leaves_the_learner_a_cpu_and_each_actor_four_envs(
    num_envs: int, cpus: int, actors: int
) -> None:
    assert fit_actor_count(num_envs, cpus) == actors


def test_actors_are_fitted_only_when_neither_count_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("oakemu_core.config.available_cpus", lambda: 8)
    fitted = OakEmuConfig(num_envs=8)
    assert (fitted.num_actors, fitted.envs_per_actor, fitted.buffer_num_envs) == (2, 4, 8)
    assert (OakEmuConfig().num_actors, OakEmuConfig().envs_per_actor) == (4, 4)
    assert (OakEmuConfig(num_actors=3).num_actors, OakEmuConfig(num_actors=3).envs_per_actor) == (
        3,
        8,
    )
    by_envs = OakEmuConfig(envs_per_actor=8)
    assert (by_envs.num_actors, by_envs.buffer_num_envs) == (2, 16)
    split = OakEmuConfig(num_envs=10, num_actors=3)
    assert split.envs_per_actor == 4
    # stable-retro runs one emulator per process: one env per actor, one actor per CPU the learner leaves.
    retro = "retro:Airstriker-Genesis-v0"
    assert (OakEmuConfig(env_id=retro).num_actors, OakEmuConfig(env_id=retro).envs_per_actor) == (
        7,
        1,
    )
    assert (
        OakEmuConfig(env_id=retro, num_envs=3).num_actors,
        OakEmuConfig(env_id=retro, num_envs=3).envs_per_actor,
    ) == (3, 1)
    assert (
        OakEmuConfig(env_id=retro, num_actors=2, envs_per_actor=2).envs_per_actor == 2
    )  # given: kept (refused later)


def test_every_field_has_a_description() -> None:
    missing = [name for name, field in OakEmuConfig.model_fields.items() if not field.description]
    assert missing == []


def test_precedence_flags_over_environment_over_toml_over_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml_file = write_toml(
        tmp_path / "run.toml",
        'env_id = "CartPole-v1"\nseed = 11\nrollout_length = 64\nlearning_rate = 0.001\n',
    )
    monkeypatch.setenv("OAKEMU_SEED", "22")
    monkeypatch.setenv("OAKEMU_ROLLOUT_LENGTH", "32")
    config = load_config(["--config", str(toml_file), "--rollout-length", "16"])
    assert config.env_id == "CartPole-v1"  # TOML over default
    assert config.learning_rate == 0.001  # TOML over default
    assert config.seed == 22  # environment over TOML
    assert config.rollout_length == 16  # flag over environment over TOML
    assert config.ppo_epochs == 4  # default
    assert config.config_file == toml_file


def test_toml_path_from_environment_variable_and_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env = write_toml(tmp_path / "env.toml", "seed = 3\n")
    from_arg = write_toml(tmp_path / "arg.toml", "seed = 4\n")
    from_flag = write_toml(tmp_path / "flag.toml", "seed = 5\n")
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(from_env))
    assert load_config(None).seed == 3
    assert OakEmuConfig().seed == 3  # direct construction honours the variable too
    assert load_config(None, toml_path=from_arg).seed == 4
    assert load_config(["--config", str(from_flag)], toml_path=from_arg).seed == 5


def test_flag_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(
        [
            "--env", "CartPole-v1",
            "--total-env-steps", "5000",
            "--no-anneal-lr",
            "--clip-rewards",
            "--num-envs", "24",
            "--target-kl", "0.015",
            "--metrics-port", "null",
            "--log-level", "debug",
        ]
    )  # fmt: skip
    assert config.env_id == "CartPole-v1"
    assert config.total_env_steps == 5000
    assert config.anneal_lr is False
    assert config.clip_rewards is True and config.resolved_clip_rewards is True
    assert config.num_envs == 24 and config.buffer_num_envs == 24
    assert config.target_kl == 0.015
    assert config.metrics_port is None and not config.metrics_enabled
    assert config.log_level == "DEBUG"
    assert load_config(["--env-id", "Acrobot-v1"]).env_id == "Acrobot-v1"
    assert load_config(["--env", "CartPole-v1"]).resolved_clip_rewards is False


def test_environment_variables_empty_means_unset_and_null_means_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OAKEMU_RUN_NAME", "")
    monkeypatch.setenv("OAKEMU_METRICS_PORT", "null")
    monkeypatch.setenv("OAKEMU_LEARNER_HOST", "learner")
    monkeypatch.setenv("OAKEMU_NORMALIZE_ADVANTAGES", "false")
    config = load_config(None)
    assert config.run_name is None
    assert config.metrics_port is None
    assert config.learner_host == "learner"
    assert config.normalize_advantages is False
    assert config.learner_address(config.data_port) == "tcp://learner:5555"


@pytest.mark.parametrize(
    ("args", "field", "received"),
    [
        (["--rollout-length", "0"], "rollout_length", "0"),
        (["--data-port", "70000"], "data_port", "70000"),
        (["--metrics-port", "-1"], "metrics_port", "-1"),
        (["--num-minibatches", "2049"], "num_minibatches", "2049"),
        (["--control-port", "5555"], "control_port", "5555"),
        (["--device", "gpu"], "device", "gpu"),
        (["--gamma", "1.5"], "gamma", "1.5"),
        (["--num-envs", "4", "--envs-per-actor", "8"], "num_envs", "4"),
        (["--run-name", "a/b"], "run_name", "a/b"),
        (["--learning-rate", "nan"], "learning_rate", "nan"),
    ],
)
def test_invalid_values_name_the_field_and_the_received_value(
    args: list[str], field: str, received: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(args)
    message = str(caught.value)
    assert field in message
    assert received in message


def test_num_minibatches_boundary_is_one_row_each() -> None:
    # 2 rows x 8 columns = 16 rows: 16 minibatches of one row is fine, 17 is not.
    assert (
        load_config(
            ["--rollout-length", "2", "--num-envs", "8", "--num-minibatches", "16"]
        ).num_minibatches
        == 16
    )
    with pytest.raises(ConfigError, match="num_minibatches"):
        load_config(["--rollout-length", "2", "--num-envs", "8", "--num-minibatches", "17"])


def test_unknown_flag_and_unknown_toml_key_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--rollout-lenght"):
        load_config(["--rollout-lenght", "3"])
    toml_file = write_toml(tmp_path / "typo.toml", "rollout_lenght = 3\n")
    with pytest.raises(ConfigError, match="rollout_lenght"):
        load_config(["--config", str(toml_file)])


def test_missing_or_malformed_toml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(["--config", str(tmp_path / "nope.toml")])
    broken = write_toml(tmp_path / "broken.toml", "seed = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(broken)])


def test_to_toml_round_trips_every_field(tmp_path: Path) -> None:
    config = load_config(
        [
            "--env",
            "CartPole-v1",
            "--actor-id",
            'actor "7" \\ x',
            "--target-kl",
            "0.02",
            "--learning-rate",
            "3e-5",
        ]
    )
    text = to_toml(config)
    parsed = tomllib.loads(text)  # valid TOML by the standard library's reader
    assert parsed["actor_id"] == 'actor "7" \\ x'
    assert "num_envs" not in parsed  # None is left out (TOML has no null)
    path = write_toml(tmp_path / "resolved.toml", text)
    again = load_config(["--config", str(path)])
    assert again.model_dump(exclude={"config_file"}) == config.model_dump(exclude={"config_file"})


def _nullable_with_other_default() -> list[str]:
    """Settings that accept None and default to something else: where a lost None changes the run."""
    return [
        name
        for name, field in OakEmuConfig.model_fields.items()
        if type(None) in typing.get_args(field.annotation) and field.default is not None
    ]


def test_a_none_that_is_not_the_default_survives_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`oakemu train` hands its configuration to the learner and actors as a ``to_toml`` file
    (``OAKEMU_CONFIG_FILE``): ``--clip-value-range null`` must reach them as None, not as the default
    ``auto`` (and the same for every setting whose default is not None)."""
    names = _nullable_with_other_default()
    assert {"clip_value_range", "metrics_port"} <= set(names)
    flags = [arg for name in names for arg in (f"--{name.replace('_', '-')}", "null")]
    config = load_config(["--env", "ALE/Breakout-v5", *flags])
    assert all(getattr(config, name) is None for name in names)
    assert config.resolved_clip_value_range is None  # plain MSE, not CleanRL's clip on Atari ids
    path = write_toml(tmp_path / "handed.toml", to_toml(config))
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(path))
    child = OakEmuConfig()
    assert {name: getattr(child, name) for name in names} == dict.fromkeys(names)
    assert child.model_dump(exclude={"config_file"}) == config.model_dump(exclude={"config_file"})
    assert settings_from_toml(to_toml(config), names)["clip_value_range"] is None
    run_dir = tmp_path / "run"  # `--resume run` starts from the run's own config.toml
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(config), encoding="utf-8")
    assert resumed_settings(run_dir)["clip_value_range"] is None
    # a commented line of another form, or naming no setting, sets nothing
    assert settings_from_toml("# clip_value_range = 0.2\n# not_a_setting = (unset)\n", names) == {}


def test_is_atari_env() -> None:
    assert is_atari_env("ALE/Breakout-v5")
    assert is_atari_env("BreakoutNoFrameskip-v4")
    assert not is_atari_env("CartPole-v1")
    assert not is_atari_env("Breakout")


def test_resolved_device() -> None:
    import torch

    assert resolved_device(load_config(["--device", "cpu"])) == "cpu"
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved_device(load_config([])) == expected_auto
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device"):
            resolved_device(load_config(["--device", "cuda"]))


def test_value_clipping_is_cleanrl_for_atari_only_and_in_value_units() -> None:
    """auto: the policy clip coefficient for Atari ids (CleanRL ppo_atari.py), off elsewhere
    (SB3's default); an explicit range or null wins everywhere."""
    assert (
        load_config(["--env", "ALE/Pong-v5", "--clip-coef", "0.2"]).resolved_clip_value_range == 0.2
    )
    assert load_config(["--env", "CartPole-v1"]).resolved_clip_value_range is None
    assert (
        load_config(["--env", "CartPole-v1", "--clip-value-range", "10"]).resolved_clip_value_range
        == 10.0
    )
    assert (
        load_config(
            ["--env", "ALE/Pong-v5", "--clip-value-range", "null"]
        ).resolved_clip_value_range
        is None
    )


def test_evaluation_is_greedy_except_for_atari_by_default() -> None:
    """auto (rl-zoo's choice): sampled for Atari ids, whose early greedy policies can stall for 27k steps."""
    assert load_config(["--env", "ALE/Breakout-v5"]).resolved_eval_greedy is False
    assert load_config(["--env", "CartPole-v1"]).resolved_eval_greedy is True
    assert (
        load_config(["--env", "ALE/Breakout-v5", "--eval-greedy", "true"]).resolved_eval_greedy
        is True
    )
    assert (
        load_config(["--env", "CartPole-v1", "--eval-greedy", "false"]).resolved_eval_greedy
        is False
    )


def test_evaluation_defaults_keep_the_tester_cheap_and_record_best_and_final() -> None:
    """Periodic evaluation paced to a tenth of the wall time; videos of the best, the final and every 10th
    evaluation (tests/run/test_tester.py and test_tester_videos.py show what these settings do)."""
    config = load_config([])
    assert (
        config.eval_every_updates,
        config.eval_max_share,
        config.eval_video,
        config.eval_video_every,
    ) == (10, 0.1, True, 10)
    for name in ("eval_max_share", "eval_video_every"):
        assert (
            "(default" not in OakEmuConfig.model_fields[name].description
        )  # --help adds the default
    paced = load_config(["--eval-max-share", "0.25", "--eval-video-every", "0"])
    assert (paced.eval_max_share, paced.eval_video_every) == (0.25, 0)
    for args, field in (
        (["--eval-max-share", "0"], "eval_max_share"),
        (["--eval-max-share", "1.5"], "eval_max_share"),
        (["--eval-video-every", "-1"], "eval_video_every"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(args)


@pytest.mark.parametrize(
    ("name", "flag", "value", "toml"),
    [
        ("bind_host", "--bind-host", "0.0.0.0", '"0.0.0.0"'),  # TransportSettings
        ("curve", "--curve", True, "true"),  # SecuritySettings
        ("keep_checkpoints", "--keep-checkpoints", 7, "7"),  # RunSettings
        ("max_rollbacks", "--max-rollbacks", 1, "1"),  # RollbackSettings
    ],
)
def test_settings_declared_beside_their_code_keep_their_flag_variable_and_toml_key(
    name: str, flag: str, value: object, toml: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    assert getattr(load_config([flag] if value is True else [flag, text]), name) == value
    monkeypatch.setenv(f"OAKEMU_{name.upper()}", text)
    assert getattr(load_config([]), name) == value
    monkeypatch.delenv(f"OAKEMU_{name.upper()}")
    path = write_toml(tmp_path / "c.toml", f"{name} = {toml}\n")
    assert getattr(load_config(["--config", str(path)]), name) == value
