"""A run folder belongs to one run, and ``oakemu train`` refuses what cannot start in one line, before
anything starts: the run folder's lock, new folders that never reuse one, live runs refused by pid,
unreadable newest checkpoints, incomplete ``config.toml``, ports claimed by a run that is starting,
and runs folders that cannot hold a run. No learner or actor process is started here (``oakemu
train`` fails the test if it starts one); the e2e side is in ``tests/e2e/test_e2e_run_folder.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from oakemu_services import cli
from oakemu_services import train as launcher
from oakemu_services.runtime import PortsInUseError, StopRequest

from oakemu_core.config import OakEmuConfig, load_config, to_toml
from oakemu_core.envs import env_spec
from oakemu_core.errors import CheckpointError, RunFolderError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint, save_run_checkpoint
from oakemu_core.run.run_folder import (
    check_config_complete,
    check_resume_folder,
    make_new_run_folder,
)
from oakemu_core.run.run_lock import (
    LOCK_FILE_NAME,
    RunFolderBusyError,
    RunFolderLock,
    holder_pid,
    live_holder,
)
from tests.e2e_helpers import REPO_ROOT

FROZEN = "20240102-030405"
"""The time every run of a test that freezes the clock is named with."""


@pytest.fixture(autouse=True)
def _clean_oakemu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OAKEMU_"):
            monkeypatch.delenv(name)


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``oakemu train`` fails the test if it starts a learner or an actor."""

    def start(child: Any) -> None:
        raise AssertionError(f"{child.name} was started")

    monkeypatch.setattr(launcher.Child, "start", start)


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run is named in the same second."""
    real = time.strftime
    monkeypatch.setattr(
        time, "strftime", lambda fmt, *args: FROZEN if fmt == "%Y%m%d-%H%M%S" else real(fmt, *args)
    )


def _config(runs_dir: Path, *args: str) -> OakEmuConfig:
    return load_config(
        ["--env", "CartPole-v1", "--runs-dir", str(runs_dir), "--metrics-port", "0", *args]
    )


def _stopped_run(
    run_dir: Path, *, updates: tuple[int, ...] = (1, 2), trained: int = 64
) -> OakEmuConfig:
    """A run folder as a stopped CartPole run leaves it: config.toml, checkpoints of ``updates``."""
    run_dir.mkdir(parents=True)
    config = _config(run_dir.parent, "--run-name", run_dir.name, "--total-env-steps", "100000")
    (run_dir / "config.toml").write_text(to_toml(config), encoding="utf-8")
    spec = env_spec("CartPole-v1")
    schema = schema_for_env(spec)
    model = build_model(spec.observation_layout, schema.distribution)
    for update in updates:
        save_run_checkpoint(
            run_dir,
            update,
            {
                "model": model.state_dict(),
                "global_step": trained * update,
                "episodes": update,
                "ppo": {"iterations": update, "trained_env_steps": trained * update},
                "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
            },
        )
    return config


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------- the lock
def test_the_lock_refuses_a_second_holder_naming_its_pid_until_released(tmp_path: Path) -> None:
    with RunFolderLock.acquire(tmp_path) as lock:
        assert (tmp_path / LOCK_FILE_NAME).read_text() == f"{os.getpid()}\n"
        assert holder_pid(tmp_path) == os.getpid() and live_holder(tmp_path) == f"pid {os.getpid()}"
        with pytest.raises(
            RunFolderBusyError, match=rf"in use by a live run \(pid {os.getpid()}\).*try later"
        ):
            RunFolderLock.acquire(tmp_path, hint="try later")
        assert lock.fd is not None
    assert holder_pid(tmp_path) is None and not (tmp_path / LOCK_FILE_NAME).exists()
    RunFolderLock.acquire(tmp_path).release()  # free again


def test_a_reader_testing_the_folder_at_the_same_moment_does_not_make_it_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """holder_pid (oakemu monitor) holds a shared lock for an instant: an acquire at that moment waits it
    out. The reader lets go during the acquire's first wait (whatever the machine's load)."""
    import fcntl

    from oakemu_core.run import run_lock

    (tmp_path / LOCK_FILE_NAME).write_text("")
    reader = os.open(tmp_path / LOCK_FILE_NAME, os.O_RDONLY)
    fcntl.flock(
        reader, fcntl.LOCK_SH | fcntl.LOCK_NB
    )  # what holder_pid takes while it tests the folder
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        if not waits:
            os.close(reader)  # the reader is done
        waits.append(seconds)

    monkeypatch.setattr(run_lock.time, "sleep", sleep)
    try:
        RunFolderLock.acquire(tmp_path).release()
    finally:
        if not waits:
            os.close(reader)
    assert len(waits) == 1


def test_the_kernel_frees_the_lock_of_a_process_killed_with_sigkill(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys, time
        from oakemu_core.run.run_lock import RunFolderLock
        lock = RunFolderLock.acquire({str(tmp_path)!r})
        print("held", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert holder_pid(tmp_path) == holder.pid
        with pytest.raises(RunFolderBusyError, match=f"pid {holder.pid}"):
            RunFolderLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait(10)
    assert holder_pid(tmp_path) is None  # the file still names the dead pid, but nobody holds it
    RunFolderLock.acquire(tmp_path).release()


# ------------------------------------------------------------------------ new run folders
def test_two_runs_named_in_the_same_second_get_a_folder_each(
    tmp_path: Path, frozen_clock: None
) -> None:
    config = _config(tmp_path / "runs")
    first = launcher.plan_run(config)
    second = launcher.plan_run(config)
    try:
        name = f"CartPole-v1__1__{FROZEN}"
        assert (first.run_dir.name, second.run_dir.name) == (name, f"{name}-2")
        for plan in (first, second):  # each config.toml names its own folder and ports
            saved = load_config(["--config", str(plan.config_file)])
            assert saved.run_name == plan.run_dir.name and saved.data_port == plan.config.data_port
            assert holder_pid(plan.run_dir) == os.getpid()
        assert first.config.data_port != second.config.data_port
    finally:
        first.release()
        second.release()
    assert holder_pid(first.run_dir) is None and not (first.run_dir / LOCK_FILE_NAME).exists()


def test_the_run_name_help_gives_the_default_name_a_run_gets(
    tmp_path: Path, frozen_clock: None
) -> None:
    """``--run-name``'s help names the default as runs get it: ``<env>__<seed>__<YYYYmmdd-HHMMSS>``."""
    plan = launcher.plan_run(_config(tmp_path / "runs", "--seed", "3"))
    plan.release()
    assert plan.run_dir.name == f"CartPole-v1__3__{FROZEN}"
    _, commands = cli.build_parser()
    for command in ("train", "learner"):
        help_text = " ".join(commands[command].format_help().split())
        assert "(default: <env>__<seed>__<YYYYmmdd-HHMMSS>)" in help_text, command


def test_make_new_run_folder_never_takes_a_folder_that_holds_something(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    with make_new_run_folder(tmp_path, "exp", numbered=False) as lock:  # an empty folder is new
        assert lock.run_dir == tmp_path / "exp"
    (tmp_path / "exp" / "metrics.jsonl").write_text("")
    with pytest.raises(
        RunFolderError, match="holds an earlier run; nothing was changed; use --resume"
    ):
        make_new_run_folder(tmp_path, "exp", numbered=False, hint="use --resume")
    with make_new_run_folder(tmp_path, "exp", numbered=True) as lock:
        assert lock.run_dir == tmp_path / "exp-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp-2"]


def test_a_failed_lock_of_a_new_folder_raises_its_own_error_when_the_folder_is_not_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from oakemu_core.errors import DiskFullError

    def acquire(run_dir: Path, **_kwargs: Any) -> RunFolderLock:
        (Path(run_dir) / LOCK_FILE_NAME).write_text(
            ""
        )  # the lock file was made, then the disk was full
        raise DiskFullError(f"cannot write {run_dir / LOCK_FILE_NAME}: No space left on device")

    monkeypatch.setattr(RunFolderLock, "acquire", acquire)
    with pytest.raises(DiskFullError, match="No space left on device"):
        make_new_run_folder(tmp_path, "exp", numbered=True)


def test_the_python_api_finds_its_run_folder_when_the_name_got_a_suffix(
    tmp_path: Path, frozen_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from oakemu_services import api

    taken = tmp_path / "runs" / f"CartPole-v1__1__{FROZEN}"
    taken.mkdir(parents=True)
    (taken / "metrics.jsonl").write_text('{"global_step": 64, "charts/update": 1}\n')
    used: list[Path] = []

    def fake_main(config: OakEmuConfig, *args: Any, plan: Any = None, **kwargs: Any) -> int:
        used.append(plan.run_dir)
        assert holder_pid(plan.run_dir) == os.getpid()  # held while the run trains
        return 0

    monkeypatch.setattr(launcher, "main", fake_main)
    run = api.train(
        env_id="CartPole-v1", runs_dir=str(tmp_path / "runs"), metrics_port=0, verbose=0
    )
    assert used == [taken.with_name(taken.name + "-2")] and run.run_dir == used[0]
    assert run.updates == 0  # not the other run's record
    assert holder_pid(run.run_dir) is None  # released when train returned


# ---------------------------------------------------------------------------- live runs
def test_run_name_of_a_live_run_is_refused_naming_its_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    _stopped_run(run_dir)
    with RunFolderLock.acquire(run_dir):  # the run is live
        before = sorted(p.name for p in run_dir.rglob("*"))
        assert (
            cli.main(
                [
                    "train",
                    "--env",
                    "CartPole-v1",
                    "--run-name",
                    "exp1",
                    "--runs-dir",
                    str(tmp_path / "runs"),
                ]
            )
            == 2
        )
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(
            f"oakemu train: error: {run_dir} is in use by a live run (pid {os.getpid()})"
        ), line
        assert cli.main(["train", "--resume", str(run_dir)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert (
            f"{run_dir} is in use by a live run (pid {os.getpid()})" in line
            and "before resuming" in line
        )
        assert (
            sorted(p.name for p in run_dir.rglob("*")) == before
        )  # the lock file is the live run's
    assert sorted(tmp_path.joinpath("runs").iterdir()) == [run_dir]


def test_run_name_of_a_stopped_run_is_refused_pointing_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    _stopped_run(run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert (
        cli.main(
            [
                "train",
                "--env",
                "CartPole-v1",
                "--run-name",
                "exp1",
                "--runs-dir",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    line = _one_error_line(capsys.readouterr().err)
    assert f"{run_dir} exists and holds an earlier run; nothing was changed" in line, line
    assert f"oakemu train --resume {run_dir}" in line and "another --run-name" in line
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_run_name_of_a_run_that_spent_its_budget_points_to_resume_with_a_larger_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    _stopped_run(run_dir, trained=60_000)  # update 2 trained 120,000 of total_env_steps=100000
    assert (
        cli.main(
            [
                "train",
                "--env",
                "CartPole-v1",
                "--run-name",
                "exp1",
                "--runs-dir",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    line = _one_error_line(capsys.readouterr().err)
    assert (
        f"{run_dir} exists and holds an earlier run; nothing was changed; it trained its whole budget (120,000 "
        "env steps, total_env_steps=100000)" in line
    ), line
    assert f"oakemu train --resume {run_dir} --total-env-steps N with N above 120000" in line, line
    assert "once stopped" not in line and "another --run-name" in line


def test_a_resumed_run_says_which_checkpoint_it_continues_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    config = _stopped_run(run_dir, updates=(1, 2), trained=25_600).model_copy(
        update={"num_actors": 1, "envs_per_actor": 1}
    )

    class Launched(Exception):
        """What the test's Launch raises: the console lines before the processes start are printed."""

    def launch(*_args: Any, **_kwargs: Any) -> None:
        raise Launched

    monkeypatch.setattr(launcher, "install_stop_signals", StopRequest)
    monkeypatch.setattr(launcher, "Launch", launch)
    plan = launcher.plan_run(config, resume=run_dir)
    try:
        with pytest.raises(Launched):
            launcher.main(config, plan=plan)
    finally:
        plan.release()
    out, err = capsys.readouterr()
    assert out == ""  # the console is stderr's (the README: `> train.log 2>&1`)
    assert (
        f"resuming {run_dir} from checkpoint_00000002.pt (update 2, 51,200 env steps trained)\n"
        in err
    ), err
    assert ": CartPole-v1, 1 actor x 1 env, 100000 env steps -> " in err, err
    assert (
        "changed settings (config.toml -> now): " in err and f"resuming {run_dir} with" not in err
    )


def test_resume_takes_a_run_name_in_the_runs_folder_as_monitor_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _stopped_run(Path("runs") / "k9")
    _stopped_run(Path("elsewhere") / "k8")
    seen: dict[str, Any] = {}

    def main(config: OakEmuConfig, resume: Path | None, **_kwargs: Any) -> int:
        seen.update(config=config, resume=resume)
        return 0

    monkeypatch.setattr(launcher, "main", main)
    assert cli.main(["train", "--resume", "k9"]) == 0
    assert seen["resume"] == Path("runs/k9") and seen["config"].run_name == "k9"
    assert cli.main(["train", "--resume", "k8", "--runs-dir", "elsewhere"]) == 0
    assert seen["resume"] == Path("elsewhere/k8") and seen["config"].run_name == "k8"
    assert cli.main(["train", "--resume", "runs/k9"]) == 0 and seen["resume"] == Path("runs/k9")
    Path(
        "k9"
    ).mkdir()  # a folder of that name here that holds no run: the name still means runs/k9, as in monitor
    assert cli.main(["train", "--resume", "k9"]) == 0 and seen["resume"] == Path("runs/k9")
    from oakemu_services.monitor import run_folder

    assert run_folder("k9") == Path("runs/k9")
    assert cli.main(["train", "--resume", "nope"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        "oakemu train: error: --resume nope: expected a run folder (runs/<name>/) or the name of one in "
        "the runs folder, received a path that does not exist"
    ), line


# ------------------------------------------------------------------- unreadable checkpoints
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resume_skips_an_unreadable_newest_checkpoint_with_a_warning(
    tmp_path: Path, damage: str
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    config = _stopped_run(run_dir, updates=(1, 2))
    newest = run_dir / "checkpoints" / "checkpoint_00000002.pt"
    data = newest.read_bytes()
    damaged = data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data))
    newest.write_bytes(damaged)
    plan = launcher.plan_run(config, resume=run_dir)
    try:
        [note] = plan.notes
        assert (
            f"checkpoint {newest} is not readable" in note
            and "resuming from checkpoint_00000001.pt" in note
        )
        assert "kept as checkpoint_00000002.pt.unreadable" in note
        # What the learner resumes from is now the intact checkpoint; the damaged bytes are kept.
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "checkpoint_00000001.pt"
        assert (
            run_dir / "checkpoints" / "checkpoint_00000002.pt.unreadable"
        ).read_bytes() == damaged
        assert load_checkpoint(latest_checkpoint(run_dir))["ppo"]["iterations"] == 1
    finally:
        plan.release()


def test_resume_of_a_relative_run_folder_sets_a_damaged_latest_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--resume runs/NAME`` (relative, as the README writes it) with ``latest.pt`` damaged through its
    link: one warning, the damaged file kept, ``latest.pt`` pointing at the checkpoint resumed from."""
    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs") / "r6"
    config = _stopped_run(run_dir, updates=(1, 2))
    os.truncate(run_dir / "checkpoints" / "latest.pt", 5000)
    plan = launcher.plan_run(config, resume=run_dir)
    try:
        [note] = plan.notes
        assert (
            f"checkpoint {run_dir / 'checkpoints' / 'checkpoint_00000002.pt'} is not readable"
            in note
        ), note
        assert (
            run_dir / "checkpoints" / "checkpoint_00000002.pt.unreadable"
        ).stat().st_size == 5000
        assert os.readlink(run_dir / "checkpoints" / "latest.pt") == "checkpoint_00000001.pt"
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "checkpoint_00000001.pt"
    finally:
        plan.release()


def test_resume_with_no_readable_checkpoint_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    _stopped_run(run_dir, updates=(1, 2))
    for path in (run_dir / "checkpoints").glob("checkpoint_*.pt"):
        path.write_bytes(path.read_bytes()[:100])
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert cli.main(["train", "--resume", str(run_dir)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert (
        f"cannot resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} is readable" in line
    ), line
    assert "checkpoint_00000002.pt: " in line and "checkpoint_00000001.pt: " in line
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_check_resume_folder_sets_nothing_aside_when_it_refuses(tmp_path: Path) -> None:
    run_dir = tmp_path / "exp1"
    config = _stopped_run(run_dir, updates=(1, 2))
    (run_dir / "checkpoints" / "checkpoint_00000002.pt").write_bytes(b"garbage")
    with pytest.raises(RunFolderError, match="already reached its budget"):
        check_resume_folder(
            run_dir, config.model_copy(update={"total_env_steps": 10}), check_budget=True
        )
    assert (run_dir / "checkpoints" / "checkpoint_00000002.pt").read_bytes() == b"garbage"
    with pytest.raises(CheckpointError):
        load_checkpoint(latest_checkpoint(run_dir))  # still the damaged one: nothing was moved


# ------------------------------------------------------------------------- config.toml
def test_an_incomplete_config_toml_names_the_settings_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    run_dir = tmp_path / "runs" / "exp1"
    _stopped_run(run_dir)
    text = (run_dir / "config.toml").read_text()
    cut = text[: text.index("\nenv_id = ") + 1]  # cut at a line end: still valid TOML
    (run_dir / "config.toml").write_text(cut)
    assert cli.main(["train", "--resume", str(run_dir)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{run_dir / 'config.toml'} is incomplete" in line and "env_id" in line, line
    assert "other settings" not in line and "None" not in line
    assert (run_dir / "config.toml").read_text() == cut
    names = [name for name in OakEmuConfig.model_fields if name != "config_file"]
    check_config_complete(run_dir.with_name("none"), names)  # no file: nothing to say
    (run_dir / "config.toml").write_text(text)
    check_config_complete(run_dir, names)  # unset settings are named as comments


def test_a_config_toml_from_before_the_network_settings_is_complete(tmp_path: Path) -> None:
    """A run made before a setting existed lacks it: its default is how that run behaved."""
    from oakemu_core.run.run_folder import ADDED_SETTINGS

    run_dir = tmp_path / "old"
    run_dir.mkdir()
    names = [name for name in OakEmuConfig.model_fields if name != "config_file"]
    lines = [f"{name} = 1" for name in names if name not in ADDED_SETTINGS]
    (run_dir / "config.toml").write_text("\n".join(lines) + "\n")
    check_config_complete(run_dir, names)
    assert {"net_arch", "recurrent", "ortho_init"} <= ADDED_SETTINGS <= set(names)
    (run_dir / "config.toml").write_text(
        "\n".join(line for line in lines if not line.startswith("seed ")) + "\n"
    )
    with pytest.raises(RunFolderError, match=r"lacks 1 of \d+ settings \(seed\)"):
        check_config_complete(run_dir, names)


# -------------------------------------------------------------------------------- ports
def test_a_port_claimed_by_a_run_that_is_starting_is_refused_fast(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_processes: None,
) -> None:
    """A launcher claims its ports at its check; its learner binds them seconds later. A second run
    given one of those ports meanwhile is refused first (before the env, device and tracker checks),
    naming the first one's pid."""
    from oakemu_services.runtime import free_ports

    def check_can_start(config: OakEmuConfig) -> None:
        raise AssertionError("the checks after the ports ran")

    monkeypatch.setattr(launcher, "check_can_start", check_can_start)

    data, control, weights, telemetry = free_ports(4)
    code = textwrap.dedent(f"""
        import time
        from oakemu_core.config import load_config
        from oakemu_services.runtime import claim_ports
        claims = claim_ports(load_config(["--data-port", "{data}", "--control-port", "{control}", "--weights-port",
                                          "{weights}", "--telemetry-port", "{telemetry}", "--metrics-port", "0"]))
        print("claimed", flush=True)
        time.sleep(60)
    """)
    starting = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert starting.stdout is not None and starting.stdout.readline().strip() == "claimed"
        assert (
            cli.main(
                [
                    "train",
                    "--env",
                    "CartPole-v1",
                    "--weights-port",
                    str(weights),
                    "--metrics-port",
                    "0",
                    "--runs-dir",
                    str(tmp_path / "runs"),
                ]
            )
            == 2
        )
    finally:
        starting.send_signal(signal.SIGKILL)
        starting.wait(10)
    line = _one_error_line(capsys.readouterr().err)
    assert (
        f"port in use on 127.0.0.1: weights_port={weights} (claimed by pid {starting.pid}); choose another with "
        "--weights-port" in line
    ), line
    plural = str(
        PortsInUseError(
            "127.0.0.1", {"data_port": "data_port=5555", "weights_port": "weights_port=5557"}
        )
    )
    assert plural == (
        "ports in use on 127.0.0.1: data_port=5555, weights_port=5557; choose others with --data-port, "
        "--weights-port"
    )
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- runs folder
def test_a_runs_dir_that_is_a_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    runs = tmp_path / "runs"
    runs.write_text("not a folder")
    assert cli.main(["train", "--env", "CartPole-v1", "--runs-dir", str(runs)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--runs-dir {runs}: expected a folder for run folders, received a file" in line, line
    assert cli.main(["train", "--env", "CartPole-v1", "--runs-dir", str(runs / "inside")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--runs-dir {runs / 'inside'}: cannot make" in line and "Not a directory" in line, line


def test_a_read_only_runs_dir_is_one_line_and_exit_2(
    small_tmpfs: Path, capsys: pytest.CaptureFixture[str], no_processes: None
) -> None:
    (small_tmpfs / "runs").mkdir()
    if (
        subprocess.run(
            ["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot remount the tmpfs read-only here")
    try:
        assert (
            cli.main(["train", "--env", "CartPole-v1", "--runs-dir", str(small_tmpfs / "runs")])
            == 2
        )
        line = _one_error_line(capsys.readouterr().err)
        assert (
            f"--runs-dir {small_tmpfs / 'runs'}: cannot make" in line
            and "Read-only file system" in line
        ), line
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], capture_output=True)


# ------------------------------------------------------------------- a standalone learner
def test_a_standalone_learner_holds_its_run_folder(
    tmp_path: Path, frozen_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from oakemu_services.runtime import PARENT_PID_ENV, claim_run_dir

    config = _config(tmp_path)
    first_dir, first = claim_run_dir(config)
    second_dir, second = claim_run_dir(config)  # the same second: another folder
    assert (first_dir.name, second_dir.name) == (
        f"CartPole-v1__1__{FROZEN}",
        f"CartPole-v1__1__{FROZEN}-2",
    )
    assert first is not None and second is not None and (first_dir / "logs").is_dir()
    named = config.model_copy(update={"run_name": first_dir.name})
    with pytest.raises(RunFolderBusyError, match=f"pid {os.getpid()}.*another --run-name"):
        claim_run_dir(named)
    # The learner of oakemu train: its launcher (here: this process) holds the folder for it.
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))
    assert claim_run_dir(named) == (first_dir, None)
    first.release()
    second.release()
    monkeypatch.delenv(PARENT_PID_ENV)
    run_dir, lock = claim_run_dir(named)  # a learner restarted on its stopped run resumes it
    assert run_dir == first_dir and lock is not None
    lock.release()
