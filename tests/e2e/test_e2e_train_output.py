"""End to end: what ``oakemu train`` says (stderr to a file, not a terminal) when a run ends well, when
its learner is killed, when the disk fills up, and when an actor's env keeps crashing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e_helpers import E2EProcesses, describe_all, read_jsonl, wait_for
from tests.fault_helpers import fill_disk

pytestmark = pytest.mark.slow

RUN_NAME = "out"
SMALL_CARTPOLE = [
    "--env",
    "CartPole-v1",
    "--num-actors",
    "1",
    "--envs-per-actor",
    "4",
    "--rollout-length",
    "32",
    "--ppo-epochs",
    "1",
    "--num-minibatches",
    "2",
    "--run-name",
    RUN_NAME,
]


def test_a_run_off_a_terminal_prints_plain_progress_and_ends_with_evaluations_and_next_commands(
    e2e: E2EProcesses,
) -> None:
    run = e2e.train(
        ["--preset", "cartpole", "--total-env-steps", "2048", "--run-name", RUN_NAME], timeout_s=240
    )
    err = run.process.stderr()
    lines = err.splitlines()
    assert "━" not in err, err  # no progress bar drawn once at the end
    assert any(
        line.startswith("trained 2,048/2,048 env steps (100%) | elapsed ") for line in lines
    ), err
    assert any(line.startswith("evaluation: final return ") for line in lines), err
    videos = sorted((run.run_dir / "videos").glob("*.mp4"))
    if videos:  # videos need the `video` extra
        assert any(
            line.startswith("videos: best ") and str(run.run_dir / "videos") in line
            for line in lines
        ), err
    assert lines[-2] == f"done: run folder {run.run_dir}"
    assert (
        lines[-1].startswith("next: oakemu evaluate ")
        and f"tensorboard --logdir {e2e.runs_dir}" in lines[-1]
    )


def _learner_pid(e2e: E2EProcesses) -> int | None:
    found = [pid for pid, command in e2e.alive() if "oakemu_services.cli learner" in command]
    return found[0] if found else None


def test_a_learner_killed_by_sigkill_makes_train_exit_1_naming_the_signal(
    e2e: E2EProcesses,
) -> None:
    telemetry = e2e.telemetry()
    train = e2e.start(
        "train", ["train", *SMALL_CARTPOLE, "--total-env-steps", "100000000", *e2e.flags()]
    )
    telemetry.wait(lambda s: s.iterations >= 2, 120, "2 updates", describe_all(train))
    pid = wait_for(lambda: _learner_pid(e2e), 10, "the learner's process")
    os.kill(pid, signal.SIGKILL)
    status = train.wait(timeout_s=60)
    err = train.stderr()
    assert status == 1, train.describe()
    assert "error: the learner was killed by SIGKILL" in err.splitlines()[-1], err
    assert "see its log" not in err
    e2e.assert_clean(timeout_s=15)  # the launcher removed the killed learner's shared memory


def test_a_full_disk_ends_with_why_the_learner_stopped_even_when_its_log_cannot_be_written(
    small_tmpfs: Path, e2e: E2EProcesses
) -> None:
    e2e.runs_dir = small_tmpfs / "runs"
    run_dir = e2e.runs_dir / RUN_NAME
    train = e2e.start(
        "train",
        [
            "train",
            *SMALL_CARTPOLE,
            "--total-env-steps",
            "100000000",
            "--checkpoint-every-updates",
            "1",
            "--max-checkpoint-failures",
            "2",
            "--eval-every-updates",
            "0",
            *e2e.flags(),
        ],
    )
    wait_for(
        lambda: (
            len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "charts/update" in r]) >= 2
        ),
        120,
        "2 updates",
        on_timeout=describe_all(train),
    )
    fill_disk(small_tmpfs)
    fill_disk(run_dir / "logs", name="learner.log")  # the room left in the log's last page too
    status = train.wait(timeout_s=90)
    last = train.stderr().splitlines()[-1]
    assert status == 1, train.describe()
    assert last.startswith(
        "error: the learner exited with status 1: 2 checkpoint writes in a row failed"
    ), last
    assert "No space left on device" in last and "training goes on" not in last, last
    assert last.endswith(
        f"(log: {run_dir / 'logs' / 'learner.log'}, incomplete: No space left on device)"
    ), last
    e2e.assert_clean(timeout_s=15)


def test_a_crashing_env_shows_its_traceback_once_then_one_line_per_restart(
    e2e: E2EProcesses,
) -> None:
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "tests.crash_envs:CrashingCartPole-v0",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "256",
            "--total-env-steps",
            "600",
            "--actor-restarts",
            "2",
            "--eval-every-updates",
            "0",
            "--run-name",
            RUN_NAME,
            *e2e.flags(),
        ],
    )
    status = train.wait(timeout_s=120)
    err = train.stderr()
    assert status == 1, train.describe()
    assert err.count("Traceback (most recent call last):") == 1, err
    assert "frames of oakemu left out" in err and 'tests/crash_envs.py", line' in err
    same = "actor-0 exited with status 1 (same error: tests.crash_envs.EnvBugError: simulated env bug after 200 steps)"
    assert f"{same}; restarting (2/2)" in err and f"{same}; not restarted" in err, err
    assert len(err.splitlines()) < 40, err
    e2e.assert_clean(timeout_s=10)
