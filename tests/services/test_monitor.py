"""``oakemu monitor``: fails fast without a learner, JSON / once output, clean exit on signals."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from oakemu_services import monitor

from oakemu_core.run.telemetry import ActorTelemetry, TelemetryPublisher, TelemetrySnapshot

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_snapshot(step: int = 100, *, is_update: bool = False, **overrides) -> TelemetrySnapshot:
    fields = dict(
        time=time.time(),
        run_name="monitor-test",
        env_id="CartPole-v1",
        global_step=step,
        sps=321.0,
        policy_version=step // 100,
        iterations=step // 100,
        episodes=7,
        episodic_return_mean=18.5,
        episodic_return_min=9.0,
        episodic_return_max=31.0,
        episodic_length_mean=18.5,
        policy_loss=-0.01,
        value_loss=2.5,
        entropy=0.68,
        approx_kl=0.002,
        clip_fraction=0.05,
        explained_variance=0.1,
        learning_rate=2.5e-4,
        buffer_fill=0.25,
        rejected_messages={"garbage": 3},
        dropped={"stale_rows": 8},
        policy_lag_min=0.0,
        policy_lag_mean=0.5,
        policy_lag_max=1.0,
        actors=[
            ActorTelemetry(
                actor_id="actor-a",
                incarnation="f00d",
                num_envs=4,
                sps=160.0,
                policy_lag=0.5,
                last_heard_s=0.2,
            ),
            ActorTelemetry(
                actor_id="actor-b",
                incarnation="beef",
                num_envs=4,
                sps=161.0,
                policy_lag=0.5,
                last_heard_s=0.3,
            ),
        ],
        is_update=is_update,
    )
    fields.update(overrides)
    return TelemetrySnapshot(**fields)


@contextmanager
def publishing(
    next_snapshot: Callable[[int], TelemetrySnapshot | None], period_s: float = 0.05
) -> Iterator[str]:
    """Publish ``next_snapshot(i)`` every ``period_s`` from a thread; ``None`` stops publishing."""
    publisher = TelemetryPublisher("tcp://127.0.0.1:*")
    stop = threading.Event()

    def loop() -> None:
        index = 0
        while not stop.is_set():
            snapshot = next_snapshot(index)
            if snapshot is None:
                return
            publisher.publish(snapshot)
            index += 1
            stop.wait(period_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield publisher.address
    finally:
        stop.set()
        thread.join(timeout=5)
        publisher.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def monitor_command(*args: str) -> list[str]:
    if (REPO_ROOT / "services" / "cli.py").exists():
        return [sys.executable, "-m", "oakemu_services.cli", "monitor", *args]
    return [
        sys.executable,
        "-c",
        "import sys; from oakemu_services.monitor import main; sys.exit(main(sys.argv[1], "
        "json_output='--json' in sys.argv, once='--once' in sys.argv, timeout_s=2.0))",
        *args,
    ]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return env


def run_monitor(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        monitor_command(*args),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_once_without_learner_fails_fast_with_a_clear_message():
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run_monitor("--connect", address, "--once", "--timeout", "2")
    elapsed = time.monotonic() - start
    assert result.returncode == monitor.EXIT_NO_TELEMETRY != 0
    assert f"no telemetry from {address}" in result.stderr
    assert "is the learner running?" in result.stderr
    assert result.stdout == ""
    assert elapsed < 30  # 2 s of waiting plus interpreter start-up, never a hang


def test_main_without_learner_returns_after_the_timeout(capsys):
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    assert monitor.main(address, once=True, timeout_s=0.5) == monitor.EXIT_NO_TELEMETRY
    assert 0.4 < time.monotonic() - start < 5
    assert f"no telemetry from {address} within 0.5 s" in capsys.readouterr().err


def test_bad_address_is_reported_not_raised(capsys):
    assert monitor.main("nonsense-address", once=True, timeout_s=0.5) == monitor.EXIT_BAD_ADDRESS
    assert "nonsense-address" in capsys.readouterr().err


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        monitor.main("tcp://127.0.0.1:1", timeout_s=0)


def test_json_once_prints_one_parseable_snapshot():
    expected = make_snapshot(500)
    with publishing(lambda i: expected) as address:
        result = run_monitor("--connect", address, "--json", "--once", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data == json.loads(json.dumps(expected.model_dump(mode="python")))
    assert data["global_step"] == 500 and [a["actor_id"] for a in data["actors"]] == [
        "actor-a",
        "actor-b",
    ]
    for field in (
        "sps",
        "episodes",
        "episodic_return_mean",
        "policy_loss",
        "approx_kl",
        "clip_fraction",
        "learning_rate",
        "policy_version",
        "buffer_fill",
        "rejected_messages",
        "dropped",
    ):
        assert field in data


def test_json_prints_first_then_only_updates_and_exits_when_the_learner_goes_silent():
    silence = threading.Event()

    def script(i: int) -> TelemetrySnapshot | None:  # a heartbeat per tick, every 10th an update
        return None if silence.is_set() else make_snapshot(100 + i, is_update=(i % 10 == 9))

    with publishing(script) as address:
        process = subprocess.Popen(
            monitor_command("--connect", address, "--json", "--timeout", "1.5"),
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines = [
                process.stdout.readline() for _ in range(3)
            ]  # the first snapshot and two updates
            silence.set()
            rest, stderr = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == monitor.EXIT_NO_TELEMETRY, stderr
    assert f"no telemetry from {address} for 1.5 s" in stderr
    records = [json.loads(line) for line in lines + rest.splitlines() if line.strip()]
    assert len(records) >= 3
    assert all(record["is_update"] for record in records[1:])
    steps = [record["global_step"] for record in records]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert all(step % 10 == 9 for step in steps[1:])


def test_snapshot_to_json_turns_non_finite_floats_into_null():
    snapshot = make_snapshot(explained_variance=math.nan, value_loss=math.inf)
    data = json.loads(monitor.snapshot_to_json(snapshot))
    assert data["explained_variance"] is None and data["value_loss"] is None
    assert data["policy_loss"] == -0.01


def test_once_view_shows_the_figures_and_the_actor_table():
    with publishing(lambda i: make_snapshot(12345)) as address:
        result = run_monitor("--connect", address, "--once", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in (
        "CartPole-v1",
        "12,345",
        "Actors (2)",
        "actor-a",
        "actor-b",
        "garbage",
        "stale_rows",
        "approx KL",
        "policy version",
        "18.50",
    ):
        assert text in out, f"{text!r} missing from:\n{out}"


def wait_until_catching(pid: int, sig: signal.Signals, timeout_s: float) -> None:
    """Wait until process ``pid`` has a handler for ``sig`` (its bit in ``SigCgt`` of
    ``/proc/<pid>/status``); fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(
            next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16
        )
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} installed no {sig.name} handler within {timeout_s} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_live_view_exits_cleanly_on_ctrl_c_and_sigterm(sig):
    with publishing(lambda i: make_snapshot(100 + i)) as address:
        process = subprocess.Popen(
            monitor_command("--connect", address, "--timeout", "10"),
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # The stop handlers are installed once the subscriber exists (however slow the start-up on
            # a busy machine); then a first snapshot and a few redraws.
            wait_until_catching(process.pid, signal.SIGTERM, timeout_s=120.0)
            time.sleep(2.0)
            assert process.poll() is None, process.communicate()
            process.send_signal(sig)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "monitor-test" in stdout


# ------------------------------------------------------------------------------- a run that is not running
def write_run_folder(
    run_dir: Path,
    *,
    telemetry_port: int,
    total_env_steps: int,
    updates: int = 2,
    checkpoints: int | None = None,
) -> Path:
    """A run folder as ``oakemu train`` leaves it: config.toml, ``updates`` update records of 1,024 env steps
    and an evaluation in metrics.jsonl, numbered checkpoints of updates 1 to ``checkpoints`` (default:
    ``updates``), each trained on 1,024 env steps per update, and best.pt."""
    from oakemu_core.run.checkpoint import save_run_checkpoint

    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.toml").write_text(
        f'env_id = "CartPole-v1"\ntotal_env_steps = {total_env_steps}\n'
        f"telemetry_port = {telemetry_port}\n",
        encoding="utf-8",
    )
    records = [
        {
            "global_step": 1024 * n,
            "charts/update": n,
            "charts/SPS": 1500.0 + n,
            "charts/episodic_return": 20.0 + n,
        }
        for n in range(1, updates + 1)
    ]
    records.insert(
        1, {"global_step": 1024, "eval/episodic_return": 131.5, "eval/policy_version": 1}
    )
    records.append(
        {
            "global_step": 1024 * updates,
            "eval/episodic_return": 99.25,
            "eval/policy_version": updates,
        }
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8"
    )
    for n in range(1, (updates if checkpoints is None else checkpoints) + 1):
        trained = {"iterations": n, "trained_env_steps": 1024 * n}
        save_run_checkpoint(run_dir, n, {"global_step": 1024 * n, "ppo": trained})
    (run_dir / "checkpoints" / "best.pt").write_bytes(b"")
    return run_dir


def monitor_run(run_dir: Path, *args: str) -> tuple[int, str, str, float]:
    """``oakemu monitor RUN_DIR ARGS`` in this process: (exit status, stdout, stderr, seconds)."""
    from oakemu_services import cli

    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.main(["monitor", str(run_dir), *args])
    return status, out.getvalue(), err.getvalue(), time.monotonic() - start


@pytest.mark.parametrize("once", [True, False])
def test_a_finished_run_is_shown_from_its_folder_at_once(tmp_path: Path, once: bool) -> None:
    run_dir = write_run_folder(
        tmp_path / "cartpole-run", telemetry_port=free_port(), total_env_steps=2048
    )
    status, out, err, seconds = monitor_run(
        run_dir, "--timeout", "300", *(["--once"] if once else [])
    )
    assert (status, err) == (0, ""), err
    assert seconds < 120  # never waits for the timeout: nothing listens on the run's telemetry port
    assert "run cartpole-run finished (no learner at tcp://127.0.0.1:" in out
    assert "last update 2: env steps 2,048 of 2,048, return 22.00, SPS 1,502" in out
    assert "evaluation return: final 99.25, best 131.50" in out
    assert f"{run_dir / 'checkpoints' / 'checkpoint_00000002.pt'}" in out and "best.pt" in out


def test_a_stopped_run_is_not_running_and_json_gives_its_last_state(tmp_path: Path) -> None:
    run_dir = write_run_folder(
        tmp_path / "stopped", telemetry_port=free_port(), total_env_steps=10_000
    )
    status, out, err, _ = monitor_run(run_dir, "--json", "--once")
    assert (status, err) == (0, ""), err
    [line] = out.splitlines()
    state = json.loads(line)
    assert (state["running"], state["finished"], state["updates"], state["global_step"]) == (
        False,
        False,
        2,
        2048,
    )
    assert (state["total_env_steps"], state["episodic_return"], state["sps"]) == (
        10_000,
        22.0,
        1502.0,
    )
    assert (state["final_evaluation"], state["last_evaluation"], state["best_evaluation"]) == (
        None,
        99.25,
        131.5,
    )
    assert state["last_evaluation_policy_version"] == 2
    assert state["resume_command"] == f"oakemu train --resume {run_dir}"
    status, out, _, _ = monitor_run(run_dir, "--once")
    assert status == 0 and "run stopped is not running (no learner at " in out
    assert "env steps 2,048 of 10,000" in out


def test_a_run_that_did_not_finish_shows_its_last_evaluation_not_a_final_one(
    tmp_path: Path,
) -> None:
    """A learner killed after its first evaluation (of policy version 0): that evaluation is not a final one."""
    run_dir = write_run_folder(
        tmp_path / "killed", telemetry_port=free_port(), total_env_steps=10_000, updates=1
    )
    records = [
        {"global_step": 0, "eval/episodic_return": 60.4, "eval/policy_version": 0},
        {"global_step": 1024, "charts/update": 1, "charts/SPS": 900.0},
    ]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8"
    )
    status, out, err, _ = monitor_run(run_dir, "--once")
    assert (status, err) == (0, ""), err
    assert "evaluation return: last evaluation (policy version 0) 60.40, best 60.40" in out
    assert "final" not in out
    status, out, _, _ = monitor_run(run_dir, "--json", "--once")
    state = json.loads(out)
    assert (
        state["final_evaluation"],
        state["last_evaluation"],
        state["last_evaluation_policy_version"],
    ) == (None, 60.4, 0)


def test_a_stopped_run_with_a_checkpoint_and_budget_left_shows_how_to_resume_it(
    tmp_path: Path,
) -> None:
    stopped = write_run_folder(
        tmp_path / "stopped", telemetry_port=free_port(), total_env_steps=10_000
    )
    finished = write_run_folder(
        tmp_path / "finished", telemetry_port=free_port(), total_env_steps=2048
    )
    no_checkpoint = write_run_folder(
        tmp_path / "no-checkpoint", telemetry_port=free_port(), total_env_steps=10_000
    )
    for path in (no_checkpoint / "checkpoints").iterdir():
        path.unlink()
    status, out, _, _ = monitor_run(stopped, "--once")
    assert status == 0 and f"resume: oakemu train --resume {stopped}\n" in out
    for run_dir in (finished, no_checkpoint):
        status, out, _, _ = monitor_run(run_dir, "--once")
        assert status == 0 and "last update 2" in out and "--resume" not in out
        status, out, _, _ = monitor_run(run_dir, "--json", "--once")
        assert json.loads(out)["resume_command"] is None


def test_a_run_is_finished_only_when_its_checkpoint_trained_the_budget_as_resume_judges_it(
    tmp_path: Path,
) -> None:
    """metrics.jsonl reached total_env_steps, but the final checkpoint was not written (the newest trained
    1,024 env steps): the run did not finish, and resuming it trains the rest."""
    run_dir = write_run_folder(
        tmp_path / "unfinished", telemetry_port=free_port(), total_env_steps=2048, checkpoints=1
    )
    status, out, err, _ = monitor_run(run_dir, "--once")
    assert (status, err) == (0, ""), err
    assert (
        "run unfinished is not running" in out
        and f"resume: oakemu train --resume {run_dir}\n" in out
    ), out
    status, out, _, _ = monitor_run(run_dir, "--json", "--once")
    assert json.loads(out)["finished"] is False


def test_once_outside_a_terminal_does_not_wrap_the_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped or redirected (no terminal, no COLUMNS): rich's 80 columns would break "SPS (since start)"."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    with publishing(lambda i: make_snapshot(12345)) as address, redirect_stdout(out):
        assert monitor.main(address, once=True, timeout_s=20) == 0
    for label in (
        "SPS (since start)",
        "SPS (last 10 s)",
        "return min / max",
        "policy lag",
        "explained var",
    ):
        assert label in out.getvalue(), out.getvalue()


def test_a_run_without_files_yet_keeps_waiting_for_its_learner(tmp_path: Path) -> None:
    run_dir = tmp_path / "starting"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(f"telemetry_port = {free_port()}\n", encoding="utf-8")
    status, out, err, seconds = monitor_run(run_dir, "--once", "--timeout", "1")
    assert status == monitor.EXIT_NO_TELEMETRY and out == "" and seconds >= 0.9
    assert "within 1 s: is the learner running?" in err


def test_a_run_held_by_a_live_process_waits_for_its_learner_even_with_files(tmp_path: Path) -> None:
    """A resumed run whose learner has not opened its telemetry port yet is live (its run.lock is held)."""
    from oakemu_core.run.run_lock import RunFolderLock

    run_dir = write_run_folder(
        tmp_path / "resuming", telemetry_port=free_port(), total_env_steps=10_000
    )
    lock = RunFolderLock.acquire(run_dir)
    try:
        status, out, err, seconds = monitor_run(run_dir, "--once", "--timeout", "1")
    finally:
        lock.release()
    assert status == monitor.EXIT_NO_TELEMETRY and out == "" and seconds >= 0.9
    assert "is the learner running?" in err


def test_a_live_learner_of_a_run_with_files_is_monitored(tmp_path: Path) -> None:
    with publishing(lambda i: make_snapshot(4096)) as address:
        port = int(address.rsplit(":", 1)[1])
        run_dir = write_run_folder(tmp_path / "live", telemetry_port=port, total_env_steps=2048)
        status, out, err, _ = monitor_run(run_dir, "--json", "--once", "--timeout", "20")
    assert status == 0, err
    assert json.loads(out)["global_step"] == 4096


def test_the_monitor_starts_without_importing_torch() -> None:
    """A monitor attaches within a second or two: torch (1 s or more to import) loads only to report a run
    that is not running."""
    code = "import sys, oakemu_services.monitor; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=subprocess_env(),
        check=True,
    )
    assert result.stdout.strip() == "False"
