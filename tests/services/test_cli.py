"""`oakemu` CLI: argument parsing and dispatch to the services (replaced by fakes here)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from oakemu_services import cli

from oakemu_core.config import OakEmuConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_oakemu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OAKEMU_"):
            monkeypatch.delenv(name)


class FakeService:
    """Stands in for oakemu_services.<name>; records the arguments of main() and returns a set code."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, return_code: int = 0) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.return_code = return_code
        module = types.ModuleType(f"oakemu_services.{name}")
        module.main = self._main  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"oakemu_services.{name}", module)

    def _main(self, *args: Any, **kwargs: Any) -> int:
        self.calls.append((args, kwargs))
        return self.return_code


def test_train_dispatch_with_config_flags_and_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    train = FakeService(monkeypatch, "train", return_code=7)
    # The run's own resolved config.toml is the base of a resumed run; flags still win over it.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.toml").write_text(
        'env_id = "Acrobot-v1"\nseed = 9\ntotal_env_steps = 100\n', encoding="utf-8"
    )
    code = cli.main(
        ["train", "--env", "CartPole-v1", "--total-env-steps", "5000", "--resume", str(tmp_path)]
    )
    assert code == 7
    [(args, kwargs)] = train.calls
    config, resume = args
    assert kwargs == {"preset": None}
    assert isinstance(config, OakEmuConfig)
    assert config.env_id == "CartPole-v1"
    assert config.total_env_steps == 5000
    assert config.seed == 9
    assert resume == tmp_path


def test_train_resume_without_config_toml_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeService(monkeypatch, "train")
    assert cli.main(["train", "--resume", str(tmp_path)]) == 2
    assert "config.toml" in capsys.readouterr().err


def test_train_without_resume_reads_environment_and_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    train = FakeService(monkeypatch, "train")
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("num_actors = 3\nseed = 4\n", encoding="utf-8")
    monkeypatch.setenv("OAKEMU_SEED", "5")
    assert cli.main(["train", "--config", str(toml_file)]) == 0
    [((config, resume), _)] = train.calls
    assert resume is None
    assert (config.num_actors, config.seed) == (3, 5)


@pytest.mark.parametrize("command", ["learner", "actor"])
def test_learner_and_actor_dispatch(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    service = FakeService(monkeypatch, command, return_code=3)
    monkeypatch.setenv("OAKEMU_LEARNER_HOST", "10.0.0.2")
    monkeypatch.setenv(
        "OAKEMU_ACTOR_ID", "a1"
    )  # a setting the learner does not offer as an option: still read
    assert cli.main([command, "--envs-per-actor", "4"]) == 3
    [((config,), kwargs)] = service.calls
    assert kwargs == {}
    assert (config.envs_per_actor, config.actor_id, config.learner_host) == (4, "a1", "10.0.0.2")


def test_monitor_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = FakeService(monkeypatch, "monitor", return_code=1)
    assert (
        cli.main(["monitor", "--connect", "tcp://h:1234", "--json", "--once", "--timeout", "2.5"])
        == 1
    )
    assert monitor.calls == [
        (
            ("tcp://h:1234",),
            {
                "json_output": True,
                "once": True,
                "timeout_s": 2.5,
                "security": None,
                "run_dir": None,
            },
        )
    ]


def test_monitor_default_address_comes_from_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = FakeService(monkeypatch, "monitor")
    monkeypatch.setenv("OAKEMU_LEARNER_HOST", "learner")
    monkeypatch.setenv("OAKEMU_TELEMETRY_PORT", "6000")
    assert cli.main(["monitor"]) == 0
    assert monitor.calls == [
        (
            ("tcp://learner:6000",),
            {
                "json_output": False,
                "once": False,
                "timeout_s": 5.0,
                "security": None,
                "run_dir": None,
            },
        )
    ]


def test_evaluate_dispatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    evaluate = FakeService(monkeypatch, "evaluate")
    checkpoint = tmp_path / "ckpt.pt"
    assert (
        cli.main(["evaluate", str(checkpoint), "--episodes", "3", "--sampled", "--seed", "9"]) == 0
    )
    assert cli.main(["evaluate", str(checkpoint)]) == 0
    assert evaluate.calls == [
        (
            (checkpoint,),
            {"episodes": 3, "greedy": False, "seed": 9, "video_dir": None, "json_output": False},
        ),
        (
            (checkpoint,),
            {"episodes": 10, "greedy": True, "seed": 1, "video_dir": None, "json_output": False},
        ),
    ]


def test_config_error_exits_2_with_a_message_and_never_starts_the_service(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    train = FakeService(monkeypatch, "train")
    assert cli.main(["train", "--rollout-length", "0"]) == 2
    err = capsys.readouterr().err
    assert "rollout_length" in err and "Traceback" not in err
    assert train.calls == []


def test_usage_errors_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    actor = FakeService(monkeypatch, "actor")
    assert cli.main(["actor", "--no-such-flag"]) == 2
    assert "--no-such-flag" in capsys.readouterr().err
    assert cli.main(["evaluate", "x", "--episodes", "0"]) == 2
    assert cli.main(["evaluate", "x", "--greedy", "--sampled"]) == 2
    assert cli.main(["fly"]) == 2
    assert cli.main([]) == 2
    assert actor.calls == []


def test_help_lists_each_commands_own_options_in_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--resume",
        "--preset",
        "--config FILE",
        "--env-id ENV, --env ENV",
        "--total-env-steps STEPS",
        "--no-anneal-lr",
        "--clip-value-range RANGE|auto|null",
        "--data-port PORT",
        "--mode {async,sync}",
    ):
        assert flag in out, flag
    for group in (
        "environment settings:",
        "PPO settings:",
        "asynchronous mode settings:",
        "transport settings:",
        "checkpoints settings:",
        "rollback settings:",
        "behaviour cloning settings:",
        "routing settings:",
        "logging settings:",
    ):
        assert group in out, group
    assert "--learner-host" not in out and "--curve" not in out and "--actor-id" not in out
    assert "(default: null)" not in out and " str]" not in out and " int]" not in out
    assert (
        "Undefined" not in out and "(default: {})" in out
    )  # a default_factory's value (env_kwargs)
    assert "--clip-rewards [auto|false]" in out and "--no-clip-rewards: false." in out
    assert "(default: fitted; 8 with num_actors given)" in " ".join(out.split())
    assert cli.main(["actor", "--help"]) == 0
    out = capsys.readouterr().out
    assert (
        "--learner-host HOST" in out
        and "--curve-server-key FILE" in out
        and "--envs-per-actor N" in out
    )
    assert "--learning-rate" not in out and "--ppo-epochs" not in out and "--run-name" not in out


def test_version_typos_and_options_of_other_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("oakemu 0.")
    assert cli.main(["train", "--totl-env-steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean --total-env-steps?" in err
    assert cli.main(["actor", "--learning-rate", "1e-3"]) == 2
    assert (
        "--learning-rate is a setting of oakemu train and oakemu learner, not of oakemu actor"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("word", ["None", "null", "NULL"])
def test_none_and_null_both_unset_an_optional_setting(
    monkeypatch: pytest.MonkeyPatch, word: str
) -> None:
    train = FakeService(monkeypatch, "train")
    assert (
        cli.main(["train", "--clip-value-range", word, "--metrics-port", word, "--target-kl", word])
        == 0
    )
    config = train.calls[0][0][0]
    assert (config.clip_value_range, config.metrics_port, config.target_kl) == (None, None, None)


def test_every_setting_is_in_one_option_group() -> None:
    from oakemu_core.options import GROUPS

    grouped = [name for group in GROUPS for name in group.fields]
    assert sorted(grouped) == sorted(set(OakEmuConfig.model_fields) - {"config_file"})
    assert len(grouped) == len(set(grouped))


def test_missing_service_module_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(
        sys.modules, "oakemu_services.learner", None
    )  # makes the import raise ModuleNotFoundError
    assert cli.main(["learner"]) == 1
    assert "oakemu_services.learner" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OAKEMU_")}
    result = subprocess.run(
        [sys.executable, "-m", "oakemu_services.cli", "train", "--ppo-epochs", "0"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "ppo_epochs" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_console_entry_point_exits_with_mains_status(monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]["scripts"]
    assert scripts["oakemu"] == "oakemu_services.cli:run"
    import gc

    frozen: list[bool] = []  # the real gc.freeze would keep this test process's garbage for good
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    collecting: list[bool] = []
    forked: list[bytes] = []

    def main() -> int:
        collecting.append(gc.isenabled())
        read, write = os.pipe()
        pid = os.fork()  # a process forked during the start (an env's worker) collects again
        if pid == 0:
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        forked.append(os.read(read, 1))
        os.close(read)
        os.close(write)
        return 3

    monkeypatch.setattr(cli, "main", main)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.run()
    finally:
        gc.enable()
    assert exit_info.value.code == 3 and frozen == [True]
    assert collecting == [False]  # the service's start runs without the garbage collector
    assert forked == [b"1"]


@pytest.mark.parametrize(
    ("command", "collects"), [("keygen", True), ("learner", False), ("actor", False)]
)
def test_the_garbage_collector_is_back_before_a_command_that_does_not_turn_it_on_itself(
    monkeypatch: pytest.MonkeyPatch, command: str, collects: bool
) -> None:
    """Commands other than learner and actor start with the collector on (frozen first); the learner
    and an actor turn it on themselves when ready (runtime.startup_done)."""
    import gc

    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    seen: list[bool] = []
    monkeypatch.setitem(cli._COMMANDS, command, lambda namespace: seen.append(gc.isenabled()) or 0)
    gc.disable()
    try:
        assert cli.main([command] + (["name"] if command == "keygen" else [])) == 0
    finally:
        gc.enable()
    assert seen == [collects] and frozen == ([True] if collects else [])


def test_startup_done_freezes_and_collects_again_only_where_the_collector_was_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    from oakemu_services.runtime import startup_done

    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    startup_done()  # on already (a service run in-process): nothing to do
    assert frozen == [] and gc.isenabled()
    gc.disable()
    try:
        startup_done()
        assert frozen == [True] and gc.isenabled()
    finally:
        gc.enable()


def test_train_refuses_bfloat16_actors_for_an_env_without_images_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One readable line and exit 2, no run folder (the actors would fail at join and the run wait)."""
    monkeypatch.chdir(tmp_path)
    for key in [key for key in os.environ if key.startswith("OAKEMU_")]:
        monkeypatch.delenv(key)
    assert (
        cli.main(
            [
                "train",
                "--env",
                "CartPole-v1",
                "--actor-inference",
                "bfloat16",
                "--runs-dir",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "actor_inference='bfloat16': only for uint8 image observations (C, H, W), this env gives float32 (4,)"
        in err
    )
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


class _FakeChild:
    """What ``oakemu_services.train._restart_crashed`` reads of an actor process."""

    def __init__(self, name: str, statuses: list[int | None]) -> None:
        self.name, self.statuses, self.restarts, self.gave_up, self.starts = (
            name,
            statuses,
            0,
            False,
            0,
        )

    def poll(self) -> int | None:
        return self.statuses[min(self.starts, len(self.statuses) - 1)]

    def log_tail(self, lines: int) -> str:
        return f"last {lines} lines of {self.name}"

    def start(self) -> None:
        self.starts += 1


def test_oakemu_train_restarts_crashed_actors_but_not_setup_errors_and_says_when_none_is_left() -> (
    None
):
    """A crash (status 1) is restarted up to actor_restarts times; an actor that cannot set up for
    the run (SETUP_ERROR_EXIT_STATUS) is not; True only once every actor is gone for good."""
    from oakemu_services.runtime import SETUP_ERROR_EXIT_STATUS
    from oakemu_services.train import _restart_crashed
    from rich.console import Console

    max_restarts = 5
    console = Console(file=io.StringIO())
    crashing = _FakeChild("actor-0", [1])  # exits with 1 after every start
    misconfigured = _FakeChild("actor-1", [SETUP_ERROR_EXIT_STATUS])
    running = _FakeChild("actor-2", [None])
    actors = [crashing, misconfigured, running]
    results = [_restart_crashed(actors, console, max_restarts) for _ in range(max_restarts + 3)]
    assert crashing.starts == max_restarts and crashing.gave_up
    assert misconfigured.starts == 0 and misconfigured.gave_up
    assert not running.gave_up and not any(results)  # one actor still runs: the run goes on
    running.statuses = [SETUP_ERROR_EXIT_STATUS]
    assert _restart_crashed(actors, console, max_restarts)
    assert "actor-1 exited with status 3; not restarted" in console.file.getvalue()


# ------------------------------------------------------------------------------- honest exits
def test_every_user_error_class_is_one_user_error() -> None:
    """The CLI catches one class: each error a user can cause derives from it."""
    from oakemu_core.algo.demonstrations import DemonstrationDataError, DemonstrationMismatchError
    from oakemu_core.envs import UnsupportedEnvironmentError
    from oakemu_core.envs.emulators.settings import EmulatorConfigError
    from oakemu_core.errors import (
        CheckpointError,
        ConfigError,
        DiskFullError,
        RunFolderError,
        UserError,
    )
    from oakemu_core.policy.export import PolicyFolderError
    from oakemu_core.run.checkpoint import CheckpointNotFoundError
    from oakemu_core.run.run_folder import ResumeMismatchError
    from oakemu_core.run.telemetry import TelemetryBindError
    from oakemu_core.run.video import VideoUnavailableError
    from oakemu_core.storage.memory import SharedMemoryTooSmallError
    from oakemu_core.transport.auth import TransportSecurityError

    for error in (
        ConfigError,
        CheckpointError,
        CheckpointNotFoundError,
        RunFolderError,
        DiskFullError,
        UnsupportedEnvironmentError,
        EmulatorConfigError,
        ResumeMismatchError,
        TelemetryBindError,
        SharedMemoryTooSmallError,
        TransportSecurityError,
        DemonstrationDataError,
        DemonstrationMismatchError,
        VideoUnavailableError,
        PolicyFolderError,
    ):
        assert issubclass(error, UserError), error
    assert issubclass(
        CheckpointNotFoundError, FileNotFoundError
    )  # callers catching FileNotFoundError still do
    assert DiskFullError.exit_status == 1 and ConfigError.exit_status == 2


def test_evaluate_of_a_file_that_is_no_checkpoint_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_checkpoint = tmp_path / "config.toml"
    not_a_checkpoint.write_text('env_id = "CartPole-v1"\n', encoding="utf-8")
    assert cli.main(["evaluate", str(not_a_checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "weights_only" not in err
    assert f"{not_a_checkpoint} is not a readable checkpoint" in err
    assert cli.main(["evaluate", str(tmp_path / "missing.pt")]) == 2
    assert "no such checkpoint file" in capsys.readouterr().err


def test_resume_of_a_missing_path_names_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", "--resume", str(tmp_path / "no-such-run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oakemu train: error: --resume ") and "does not exist" in err
    assert "OAKEMU_CONFIG_FILE" not in err and err.count("\n") == 1


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has a CUDA device"
)
def test_device_cuda_without_a_gpu_exits_2_before_any_folder_or_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_processes(monkeypatch)
    # With a preset too: its line (what to expect of the run) comes only for a run that starts.
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "cartpole",
                "--device",
                "cuda",
                "--runs-dir",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "device: expected an available device, received 'cuda'" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def _forbid_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``oakemu train`` fail the test if it starts a learner or an actor."""
    from oakemu_services.train_children import Child

    def start(child: Any) -> None:
        raise AssertionError(f"{child.name} was started")

    monkeypatch.setattr(Child, "start", start)


def test_a_port_in_use_exits_2_before_any_folder_or_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    _forbid_processes(monkeypatch)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert (
            cli.main(
                [
                    "train",
                    "--env",
                    "CartPole-v1",
                    "--control-port",
                    str(port),
                    "--metrics-port",
                    "0",
                    "--runs-dir",
                    str(tmp_path / "runs"),
                ]
            )
            == 2
        )
    err = capsys.readouterr().err
    assert (
        f"oakemu train: error: port in use on 127.0.0.1: control_port={port}; choose another with "
        "--control-port" in err
    ), err
    assert "another learner" not in err  # a plain socket holds it: no guess who
    assert not (tmp_path / "runs").exists()


def test_resume_of_a_run_that_spent_its_budget_says_so_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from oakemu_core.config import load_config, to_toml
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.models import build_model
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.checkpoint import save_run_checkpoint

    _forbid_processes(monkeypatch)
    run_dir = tmp_path / "runs" / "done"
    run_dir.mkdir(parents=True)
    config = load_config(["--env", "CartPole-v1", "--total-env-steps", "1000"])
    (run_dir / "config.toml").write_text(to_toml(config), encoding="utf-8")
    schema = schema_for_env(env_spec("CartPole-v1"))
    model = build_model(env_spec("CartPole-v1").observation_layout, schema.distribution)
    save_run_checkpoint(
        run_dir,
        4,
        {
            "model": model.state_dict(),
            "global_step": 1100,
            "episodes": 3,
            "ppo": {"iterations": 4, "trained_env_steps": 1024},
            "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
        },
    )
    assert cli.main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert (
        "already reached its budget (1024 env steps trained by update 4, total_env_steps=1000)"
        in err
    )
    assert "--total-env-steps" in err and err.count("\n") == 1
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints",
        "config.toml",
    ]  # nothing written


@pytest.mark.parametrize(
    "given, expected",
    [
        ([], "absent"),
        (["--clip-rewards"], True),
        (["--no-clip-rewards"], False),
        (["--clip-rewards", "auto"], None),
        (["--clip-rewards", "null"], None),
        (["--clip-rewards", "false"], False),
    ],
)
def test_a_setting_that_may_be_none_takes_auto_from_the_command_line(
    given: list[str], expected: object
) -> None:
    """``bool | None`` settings: on, off, and back to the automatic choice (None) from the command line."""
    parser, _ = cli.build_parser()
    assert getattr(parser.parse_args(["train", *given]), "clip_rewards", "absent") == expected


def test_every_oakemu_variable_of_the_deploy_files_is_a_setting_or_a_known_deployment_variable() -> (
    None
):
    """The compose, stack and Kubernetes files' ``OAKEMU_*`` variables never trigger the unknown-variable warning."""
    import re

    from oakemu_core.config import OakEmuConfig
    from oakemu_core.options import unknown_variables

    files = [REPO_ROOT / "docker-compose.yml", *sorted((REPO_ROOT / "deploy").rglob("*.y*ml"))]
    names = {
        name for path in files for name in re.findall(r"\bOAKEMU_[A-Z0-9_]+", path.read_text())
    }
    assert "OAKEMU_GRAFANA_IMAGE" in names and "OAKEMU_MODE" in names  # the files were read
    assert unknown_variables(OakEmuConfig.model_fields, dict.fromkeys(names, "x")) == []


def test_unknown_oakemu_variables_warn_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    train = FakeService(monkeypatch, "train")
    monkeypatch.setenv("OAKEMU_LERNING_RATE", "1")
    monkeypatch.setenv("OAKEMU_SHM_SIZE", "2g")  # a compose variable, not a setting: no warning
    assert cli.main(["train"]) == 0
    err = capsys.readouterr().err
    assert (
        "warning: OAKEMU_LERNING_RATE is not a setting and is ignored (did you mean OAKEMU_LEARNING_RATE?)"
        in err
    )
    assert "SHM_SIZE" not in err
    assert train.calls[0][0][0].learning_rate == 2.5e-4
    assert cli.main(["train", "--help"]) == 0  # a user reading the help learns of the typo too
    assert "did you mean OAKEMU_LEARNING_RATE?" in capsys.readouterr().err


def test_train_on_a_full_disk_is_one_line_naming_the_path_and_the_bytes(
    small_tmpfs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fault_helpers import fill_disk

    _forbid_processes(monkeypatch)
    fill_disk(small_tmpfs)
    assert (
        cli.main(
            [
                "train",
                "--env",
                "CartPole-v1",
                "--runs-dir",
                str(small_tmpfs / "runs"),
                "--run-name",
                "r",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"cannot write {small_tmpfs}/runs/r/" in err and "No space left on device" in err
    assert "bytes needed" in err and "bytes free on" in err


def test_the_learner_and_an_actor_turn_the_collector_on_once_ready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With the collector off (as cli.run leaves it), the learner is serving and an actor stepping
    with it on again: learner.main calls startup_done before Learner.run, Actor.run after join."""
    import gc
    import threading

    from oakemu_services import actor as actor_service
    from oakemu_services import learner as learner_service

    monkeypatch.setattr(gc, "freeze", lambda: None)
    serving: list[bool] = []

    class FakeLearner:
        def __init__(self, config: OakEmuConfig, run_dir: Path) -> None:
            self.trainer = types.SimpleNamespace(
                learner_model=types.SimpleNamespace(
                    model=types.SimpleNamespace(has_convolutions=False)
                ),
                checkpoint_writer=types.SimpleNamespace(
                    final_saved=run_dir / "checkpoint_00000001.pt"
                ),
                running=False,
            )

        def run(self, stop_event: threading.Event) -> int:
            serving.append(gc.isenabled())
            return 0

        def close(self) -> None:
            pass

    monkeypatch.setattr(learner_service, "Learner", FakeLearner)
    from oakemu_services.runtime import StopRequest

    monkeypatch.setattr(learner_service, "install_stop_signals", StopRequest)
    monkeypatch.setattr(learner_service, "learner_torch_threads", lambda *args: None)
    monkeypatch.setattr(learner_service, "claim_ports", lambda config: None)
    stop = threading.Event()
    actor = actor_service.Actor(OakEmuConfig(env_id="CartPole-v1"), stop)

    def join() -> None:  # the first join: the actor would step from here on
        serving.append(gc.isenabled())
        actor.stepper = object()
        stop.set()

    monkeypatch.setattr(actor, "join", join)
    try:
        for start in (
            lambda: learner_service.main(
                OakEmuConfig(env_id="CartPole-v1", runs_dir=str(tmp_path))
            ),
            actor.run,
        ):
            gc.disable()
            assert start() == 0
            serving.append(gc.isenabled())
    finally:
        gc.enable()
        actor.close()
    assert serving == [
        True,
        True,
        False,
        True,
    ]  # learner serving and after; actor joining, then after


def test_train_refuses_numpy_actors_for_pictures_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in [key for key in os.environ if key.startswith("OAKEMU_")]:
        monkeypatch.delenv(key)
    assert (
        cli.main(
            [
                "train",
                "--env",
                "ALE/Breakout-v5",
                "--actor-inference",
                "numpy",
                "--runs-dir",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "actor_inference='numpy': only for one vector observation (MLP torsos), this env gives uint8"
        in err
    )
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------- unknown commands
@pytest.mark.parametrize(
    ("word", "hint"),
    [
        ("trian", " (did you mean 'train'?)"),
        ("evalute", " (did you mean 'evaluate'?)"),
        ("fly", " (oakemu --help lists the commands)"),
    ],
)
def test_an_unknown_command_is_one_line_naming_the_closest_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], word: str, hint: str
) -> None:
    train = FakeService(monkeypatch, "train")
    assert cli.main([word, "--env", "CartPole-v1"]) == 2
    assert capsys.readouterr().err == f"oakemu: error: unknown command '{word}'{hint}\n"
    assert train.calls == []


def test_oakemu_without_a_command_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().err == (
        "oakemu: error: expected a command: train, tune, learner, actor, monitor, evaluate, "
        "export, record, keygen (oakemu --help describes them, oakemu COMMAND --help "
        "one)\n"
    )
    assert cli.main(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("oakemu: error: unrecognized arguments: --bogus")
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("oakemu ")
