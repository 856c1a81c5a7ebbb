"""What ``oakemu train`` says, without processes: progress views, the end of a run, exit descriptions,
crash reports of restarted actors, a child's output on a full disk, and the Python API's callbacks."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from oakemu_services.runtime import StopRequest
from oakemu_services.train import _restart_crashed, report
from oakemu_services.train_children import (
    ChildOutput,
    crash_traceback,
    exit_description,
    stop_reason,
)
from oakemu_services.train_view import (
    BarView,
    PlainView,
    QuietView,
    end_lines,
    metrics_records,
    progress_view,
)
from rich.console import Console

from oakemu_core.run.callbacks import (
    Callback,
    CallbackRunner,
    EvaluationInfo,
    RecordFollower,
    UpdateInfo,
)
from oakemu_core.run.telemetry import TelemetrySnapshot
from tests.fault_helpers import fill_disk


def snapshot(trained: int, *, update: int = 0, is_update: bool = False) -> TelemetrySnapshot:
    return TelemetrySnapshot(
        time=0.0,
        run_name="r",
        env_id="CartPole-v1",
        global_step=trained,
        sps=100.0,
        sps_recent=250.0,
        policy_version=update,
        iterations=update,
        trained_env_steps=trained,
        episodes=3,
        episodic_return_mean=21.5,
        is_update=is_update,
    )


def text_console() -> Console:
    """A console writing to a string, as stderr redirected to a file is (not a terminal)."""
    return Console(file=io.StringIO(), width=200)


# ------------------------------------------------------------------------------ progress views
def test_a_console_that_is_no_terminal_gets_plain_progress_lines_with_an_eta() -> None:
    console = text_console()
    assert isinstance(progress_view(console, 1000), PlainView)
    assert isinstance(progress_view(console, 1000, verbose=0), QuietView)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    bar = progress_view(terminal, 1000)
    assert isinstance(bar, BarView)
    bar.close()

    now = [100.0]
    view = PlainView(console, 1000, period_s=15.0, clock=lambda: now[0])
    view.tick()
    assert console.file.getvalue() == ""  # nothing due yet
    view.show(snapshot(0))
    now[0] = 110.0
    view.show(
        snapshot(250, update=1, is_update=True)
    )  # an update line at once, no progress line yet
    assert console.file.getvalue().splitlines()[-1].startswith("update     1 |")
    now[0] = 115.0
    view.show(snapshot(375))
    lines = console.file.getvalue().splitlines()
    # 375 of 1000 after 15 s at 25 steps/s: 625 left take 25 s.
    assert lines[-1] == (
        "trained 375/1,000 env steps (38%) | elapsed 0:00:15 | ETA 0:00:25 | 250 SPS, return 21.5"
    ), lines
    now[0] = 120.0
    view.show(snapshot(500))
    assert len(console.file.getvalue().splitlines()) == len(lines)  # at most one line per period
    view.close()  # the last figures, once
    assert (
        console.file.getvalue()
        .splitlines()[-1]
        .startswith("trained 500/1,000 env steps (50%) | elapsed 0:00:20")
    )
    assert "━" not in console.file.getvalue()


def test_plain_progress_says_it_waits_before_the_first_figures() -> None:
    console, now = text_console(), [0.0]
    view = PlainView(console, 1000, period_s=10.0, clock=lambda: now[0])
    now[0] = 12.0
    view.tick()
    assert (
        "trained 0/1,000 env steps (0%) | elapsed 0:00:12 | waiting for the learner"
        in console.file.getvalue()
    )


def _write_metrics(run_dir: Path, *records: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8"
    )


def test_the_end_names_the_final_and_best_evaluation_their_videos_and_the_next_commands(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "runs" / "r"
    _write_metrics(
        run_dir,
        {"global_step": 0, "eval/episodic_return": 20.0, "eval/policy_version": 0},
        {"global_step": 256, "charts/update": 1},
        {"global_step": 512, "eval/episodic_return": 500.0, "eval/policy_version": 10},
        {"global_step": 768, "eval/episodic_return": 96.5, "eval/policy_version": 12},
    )
    (run_dir / "videos").mkdir()
    for version in (0, 10, 12):
        (run_dir / "videos" / f"update_{version}.mp4").write_bytes(b"")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "checkpoint_00000012.pt").write_bytes(b"")
    (run_dir / "checkpoints" / "latest.pt").symlink_to("checkpoint_00000012.pt")
    lines = end_lines(run_dir, metrics_records(run_dir), resumable=False)
    assert lines[0] == (
        "evaluation: final return 96.50 (policy version 12), best return 500.00 (policy version 10)"
    )  # no best.pt kept (no tester): nothing to point at
    assert (
        lines[1]
        == f"videos: best {run_dir}/videos/update_10.mp4, final {run_dir}/videos/update_12.mp4"
    )
    assert lines[-1].startswith(
        f"next: oakemu evaluate {run_dir}/checkpoints/checkpoint_00000012.pt; oakemu export "
    )
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in lines[-1] and "--resume" not in lines[-1]

    (run_dir / "checkpoints" / "best.pt").write_bytes(b"")
    (run_dir / "videos" / "update_12.mp4").unlink()
    lines = end_lines(run_dir, metrics_records(run_dir), resumable=True)
    assert lines[0].endswith(
        f"best return 500.00 (policy version 10): {run_dir}/checkpoints/best.pt"
    )
    assert lines[1] == f"videos: best {run_dir}/videos/update_10.mp4"
    assert lines[-1].startswith(
        f"next: oakemu train --resume {run_dir}; oakemu evaluate {run_dir}/checkpoints/best.pt"
    )

    for name in (
        "best.mp4",
        "final.mp4",
    ):  # the tester's copies of the best and the last evaluation's video
        (run_dir / "videos" / name).write_bytes(b"")
    lines = end_lines(run_dir, metrics_records(run_dir), resumable=False)
    assert lines[1] == f"videos: best {run_dir}/videos/best.mp4, final {run_dir}/videos/final.mp4"


def test_a_run_without_evaluations_ends_with_the_next_commands_only(tmp_path: Path) -> None:
    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    assert [
        line.split(":")[0]
        for line in end_lines(tmp_path, metrics_records(tmp_path), resumable=False)
    ] == ["next"]


def test_the_next_commands_never_name_a_checkpoint_that_does_not_exist(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "latest.pt").symlink_to("checkpoint_00000079.pt")  # dangling: its write failed
    [line] = end_lines(tmp_path, [], resumable=False)
    assert line == f"next: tensorboard --logdir {tmp_path.parent}"
    (directory / "checkpoint_00000050.pt").write_bytes(b"")
    [line] = end_lines(tmp_path, [], resumable=False)
    assert line.startswith(
        f"next: oakemu evaluate {directory / 'checkpoint_00000050.pt'}; oakemu export "
    ), line


def test_the_readme_keeps_the_console_output_in_a_log_file_with_stderr() -> None:
    """The console output goes to stderr (as tqdm's and rich's): a log file needs ``2>&1``."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "`oakemu train ... > train.log 2>&1`" in readme


# ------------------------------------------------------------------------------- how it ended
def test_a_negative_status_is_named_as_the_signal_that_killed_the_process() -> None:
    assert exit_description(1) == "exited with status 1"
    assert exit_description(-15) == "was killed by SIGTERM"
    assert exit_description(-9) == "was killed by SIGKILL"


def _launch(tmp_path: Path, learner_status: int, output: str = "") -> SimpleNamespace:
    """What :func:`report` reads of a Launch whose learner exited with ``learner_status`` after writing
    ``output``."""
    console = text_console()
    learner = SimpleNamespace(
        stop_reason=lambda: stop_reason(output), log_note=lambda: f"log: {tmp_path / 'learner.log'}"
    )
    return SimpleNamespace(
        plan=SimpleNamespace(run_dir=tmp_path),
        errors=console,
        last_update=-1,
        first_actor_error=None,
        callbacks=None,
        learner_status=learner_status,
        learner=learner,
    )


def test_a_learner_killed_by_sigkill_exits_1_naming_the_signal(tmp_path: Path) -> None:
    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    launch = _launch(tmp_path, -9)
    status = report(launch, "learner", StopRequest(), launch.errors)  # type: ignore[arg-type]
    said = launch.errors.file.getvalue()
    assert status == 1, said
    assert (
        "error: the learner was killed by SIGKILL (out of memory? the kernel's OOM killer" in said
    )
    assert "see its log" not in said and "--resume" not in said  # no checkpoint to continue from

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_00000001.pt").write_bytes(b"")
    launch = _launch(tmp_path, -9)
    assert report(launch, "learner", StopRequest(), launch.errors) == 1  # type: ignore[arg-type]
    said = launch.errors.file.getvalue()
    assert said.rstrip().endswith(f"; continue with oakemu train --resume {tmp_path}"), said


_BUDGET_SPENT_ON_A_FULL_DISK = "\n".join(
    [
        "2026-01-01T00:00:00.000+0000 ERROR oakemu.checkpoint: checkpoint r/checkpoints/checkpoint_00000050.pt not "
        "written: [Errno 28] No space left on device (90000 bytes needed, 4096 bytes free on r/checkpoints); no earlier "
        "checkpoint; training goes on, retried at the next checkpoint (1 of 5 failures in a row allowed)",
        "2026-01-01T00:00:01.000+0000 INFO oakemu.learner: stopping: env-step budget reached",
        "2026-01-01T00:00:02.000+0000 ERROR oakemu.checkpoint: final checkpoint r/checkpoints/checkpoint_00000079.pt not "
        "written: [Errno 28] No space left on device (90000 bytes needed, 0 bytes free on r/checkpoints); no earlier "
        "checkpoint",
        "2026-01-01T00:00:02.000+0000 WARNING oakemu.learner: final checkpoint not written; the run resumes from its "
        "start (no checkpoint)",
    ]
)


def test_a_run_whose_final_checkpoint_was_not_written_exits_1_naming_the_file_and_the_bytes(
    tmp_path: Path,
) -> None:
    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    launch = _launch(tmp_path, 1, _BUDGET_SPENT_ON_A_FULL_DISK)
    console = text_console()
    assert report(launch, "learner", StopRequest(), console) == 1  # type: ignore[arg-type]
    said = (
        console.file.getvalue() + launch.errors.file.getvalue()
    )  # the error console is written last
    last = said.strip().splitlines()[-1]
    assert last.startswith(
        "error: the learner exited with status 1: final checkpoint "
        "r/checkpoints/checkpoint_00000079.pt not written: [Errno 28] No space left on device "
        "(90000 bytes needed, 0 bytes free on r/checkpoints)"
    ), said
    assert "either" not in last and "done:" not in said and "next:" not in said


def test_a_stop_by_ctrl_c_whose_final_checkpoint_failed_says_so_last(tmp_path: Path) -> None:
    import signal

    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    launch = _launch(tmp_path, 1, _BUDGET_SPENT_ON_A_FULL_DISK)
    stop = StopRequest()
    stop.signum = signal.SIGINT
    console = text_console()
    assert report(launch, "signal", stop, console) == 130  # type: ignore[arg-type]
    said = console.file.getvalue() + launch.errors.file.getvalue()
    assert f"stopped by SIGINT: run folder {tmp_path}\n" in said, said  # no checkpoint: no --resume
    assert (
        said.strip()
        .splitlines()[-1]
        .startswith(
            "error: the learner exited with status 1: final checkpoint "
            "r/checkpoints/checkpoint_00000079.pt not written"
        )
    ), said


def test_a_learner_that_exited_0_without_a_checkpoint_is_no_success(tmp_path: Path) -> None:
    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.pt").symlink_to("checkpoint_00000001.pt")  # dangling
    launch = _launch(tmp_path, 0)
    console = text_console()
    assert report(launch, "learner", StopRequest(), console) == 1  # type: ignore[arg-type]
    said = launch.errors.file.getvalue() + console.file.getvalue()
    assert f"error: the run ended without a checkpoint in {tmp_path / 'checkpoints'}" in said, said
    assert "done:" not in said and "next:" not in said


def test_a_run_with_only_best_pt_is_neither_resumable_nor_a_success(tmp_path: Path) -> None:
    """A resume never starts from best.pt: with no latest.pt and no checkpoint_<n>.pt, a learner that exited
    0 did not write its final checkpoint, and a stopped run gets no --resume hint."""
    import signal

    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 1})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"")
    launch = _launch(tmp_path, 0)
    console = text_console()
    assert report(launch, "learner", StopRequest(), console) == 1  # type: ignore[arg-type]
    said = launch.errors.file.getvalue() + console.file.getvalue()
    assert f"error: the run ended without a checkpoint in {tmp_path / 'checkpoints'}" in said, said

    stop = StopRequest()
    stop.signum = signal.SIGINT
    launch, console = _launch(tmp_path, 130), text_console()
    assert report(launch, "signal", stop, console) == 130  # type: ignore[arg-type]
    said = console.file.getvalue() + launch.errors.file.getvalue()
    assert f"stopped by SIGINT: run folder {tmp_path}\n" in said and "--resume" not in said, said


def test_an_older_metrics_record_is_not_shown_as_the_final_update(tmp_path: Path) -> None:
    """metrics.jsonl cut short (a full disk) lags behind the updates already shown from telemetry."""
    _write_metrics(tmp_path, {"global_step": 256, "charts/update": 63})
    launch = _launch(tmp_path, 1, _BUDGET_SPENT_ON_A_FULL_DISK)
    launch.last_update = 79
    console = text_console()
    report(launch, "learner", StopRequest(), console)  # type: ignore[arg-type]
    assert "update    63" not in console.file.getvalue() + launch.errors.file.getvalue()


def test_the_learner_stopped_by_failed_checkpoints_is_named_before_its_final_checkpoint() -> None:
    logged = "\n".join(
        [
            "2026-01-01T00:00:00.000+0000 ERROR oakemu.checkpoint: checkpoint c3.pt not written: [Errno 28] No space "
            "left on device; training goes on, retried at the next checkpoint (1 of 2 failures in a row allowed)",
            "2026-01-01T00:00:01.000+0000 ERROR oakemu.learner: 2 checkpoint writes in a row failed (max_checkpoint_"
            "failures = 2), stopping; last: checkpoint c4.pt not written: [Errno 28] No space left on device",
            "2026-01-01T00:00:01.000+0000 ERROR oakemu.learner: final checkpoint not written: 3 checkpoint writes in a "
            "row failed (max_checkpoint_failures = 2), stopping; last: checkpoint c4.pt not written",
            "2026-01-01T00:00:01.000+0000 WARNING oakemu.learner: final checkpoint not written; the run resumes from c2.pt",
        ]
    )
    assert stop_reason(logged) == (
        "2 checkpoint writes in a row failed (max_checkpoint_failures = 2), stopping; last: "
        "checkpoint c4.pt not written: [Errno 28] No space left on device; the final "
        "checkpoint was not written either"
    )
    assert stop_reason(logged.split("\n")[0]).endswith("1 of 2 failures in a row allowed)")
    assert stop_reason("INFO only") is None


# --------------------------------------------------------------------------- restarted actors
_TRACEBACK = """2026-01-01T00:00:00.000+0000 INFO oakemu.actor: actor actor-0 joined
Traceback (most recent call last):
  File "{own}/actor.py", line 401, in main
    return interrupted_status(actor.run(), stop_event)
                              ^^^^^^^^^^^
  File "/home/me/my_env.py", line 29, in step
    raise ValueError("bad action")
ValueError: bad action"""


class _CrashingChild:
    """What ``_restart_crashed`` reads of an actor that exits with status 1 after each start."""

    def __init__(self, name: str, output: str) -> None:
        self.name, self.output, self.restarts, self.gave_up, self.starts = name, output, 0, False, 0

    def poll(self) -> int | None:
        return 1

    def log_tail(self, lines: int) -> str:
        return self.output

    def start(self) -> None:
        self.starts += 1


def test_a_crash_is_shown_with_its_traceback_once_then_one_line_per_restart() -> None:
    import oakemu_services

    own = str(Path(oakemu_services.__file__).parent)
    console, shown = text_console(), set()
    actors = [_CrashingChild(f"actor-{i}", _TRACEBACK.format(own=own)) for i in range(2)]
    for _ in range(4):
        _restart_crashed(actors, console, 3, shown)  # type: ignore[arg-type]
    lines = console.file.getvalue().splitlines()
    assert lines[:6] == [
        "actor-0 exited with status 1; restarting (1/3)",
        "Traceback (most recent call last):",
        "  (1 frames of oakemu left out)",
        '  File "/home/me/my_env.py", line 29, in step',
        '    raise ValueError("bad action")',
        "ValueError: bad action",
    ]
    assert lines[6:] == [
        "actor-1 exited with status 1 (same error: ValueError: bad action); restarting (1/3)",
        "actor-0 exited with status 1 (same error: ValueError: bad action); restarting (2/3)",
        "actor-1 exited with status 1 (same error: ValueError: bad action); restarting (2/3)",
        "actor-0 exited with status 1 (same error: ValueError: bad action); restarting (3/3)",
        "actor-1 exited with status 1 (same error: ValueError: bad action); restarting (3/3)",
        "actor-0 exited with status 1 (same error: ValueError: bad action); not restarted",
        "actor-1 exited with status 1 (same error: ValueError: bad action); not restarted",
    ]


def test_a_crash_inside_oakemu_keeps_every_frame() -> None:
    import oakemu_services

    own = str(Path(oakemu_services.__file__).parent)
    text = _TRACEBACK.format(own=own).replace("/home/me/my_env.py", f"{own}/stepper.py")
    assert crash_traceback(text) == text.splitlines()[1:]
    assert crash_traceback("no traceback here\nValueError: x") is None


# ------------------------------------------------------------------------------- child output
def test_a_child_error_is_known_when_its_log_cannot_be_written(small_tmpfs: Path) -> None:
    log_path = small_tmpfs / "learner.log"
    log_path.write_bytes(b"")
    fill_disk(small_tmpfs)
    message = "2026-01-01T00:00:00.000+0000 ERROR oakemu.learner: 5 checkpoint writes in a row failed, stopping"
    code = f"import sys; print('x' * 8192); print({message!r}, file=sys.stderr)"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert child.stdout is not None
        output = ChildOutput(child.stdout, log_path)
        assert child.wait(60) == 0
        output.drain(10.0)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
    assert output.lines()[-1] == message
    assert output.write_error == "No space left on device"
    assert log_path.stat().st_size < 8192


# ---------------------------------------------------------------------------------- callbacks
def test_callbacks_see_each_update_and_evaluation_and_false_stops() -> None:
    seen: list[Any] = []

    class StopAtReturn(Callback):
        def on_evaluation(self, info: EvaluationInfo) -> bool | None:
            seen.append(
                (
                    "evaluation",
                    info.policy_version,
                    info.return_mean,
                    info.best_return,
                    info.is_best,
                )
            )
            return info.return_mean < 100

    runner = CallbackRunner([StopAtReturn(), lambda info: seen.append(type(info).__name__)])
    records = [
        {
            "global_step": 256,
            "charts/update": 1,
            "losses/policy_loss": -0.01,
            "charts/episodic_return": 20.0,
        },
        {"global_step": 300, "eval/episodic_return": 50.0, "eval/policy_version": 1},
        {"global_step": 512, "charts/update": 2, "losses/policy_loss": None},
        {"global_step": 600, "eval/episodic_return": 30.0, "eval/policy_version": 2},
    ]
    assert not runner.feed(records)
    assert seen == [
        "UpdateInfo",
        ("evaluation", 1, 50.0, 50.0, True),
        "EvaluationInfo",
        "UpdateInfo",
        ("evaluation", 2, 30.0, 50.0, False),
        "EvaluationInfo",
    ]
    assert runner.feed(
        [
            {"global_step": 700, "eval/episodic_return": 120.0, "eval/policy_version": 3},
            {"global_step": 800, "charts/update": 3},
        ]
    )
    assert (
        runner.stop_reason
        == "StopAtReturn.on_evaluation returned False at the evaluation of policy version 3"
    )
    assert seen[-1] == (
        "evaluation",
        3,
        120.0,
        120.0,
        True,
    )  # the plain callable and update 3 come after the stop
    assert runner.error is None


def test_update_info_carries_the_update_figures() -> None:
    info = UpdateInfo.from_record(
        {
            "global_step": 512,
            "charts/update": 2.0,
            "charts/episodic_return": 21.5,
            "losses/value_loss": 3.0,
            "losses/clipfrac": 0.1,
            "charts/SPS": 1000.0,
        }
    )
    assert (
        info.update,
        info.global_step,
        info.episodic_return,
        info.value_loss,
        info.clip_fraction,
        info.sps,
    ) == (2, 512, 21.5, 3.0, 0.1, 1000.0)
    assert info.policy_loss is None and info.metrics["losses/value_loss"] == 3.0


def test_a_callback_that_raises_stops_and_keeps_the_error_and_false_after_the_end_is_ignored() -> (
    None
):
    def broken(info: Any) -> None:
        raise ValueError("my bug")

    runner = CallbackRunner(broken)
    assert runner.feed([{"global_step": 1, "charts/update": 1}])
    assert (
        isinstance(runner.error, ValueError)
        and runner.stop_reason == "broken raised ValueError: my bug at update 1"
    )
    ended = CallbackRunner(lambda info: False)
    assert not ended.feed([{"global_step": 1, "charts/update": 1}], may_stop=False)
    with pytest.raises(TypeError, match="expected a Callback or a callable, received int"):
        CallbackRunner([1])  # type: ignore[list-item]


def test_the_record_follower_reads_each_complete_new_record_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = RecordFollower(path, since=1000.0)
    assert follower.new_records() == []  # no file yet
    path.write_text(
        '{"wall_time": 999.0, "charts/update": 1}\n{"wall_time": 1001.0, "charts/update": 2}\n{"wall'
    )
    assert follower.new_records() == [
        {"wall_time": 1001.0, "charts/update": 2}
    ]  # the earlier session's is skipped
    with open(path, "a") as file:
        file.write('_time": 1002.0, "charts/update": 3}\nnot json\n')
    assert follower.new_records() == [{"wall_time": 1002.0, "charts/update": 3}]
    assert follower.new_records() == []
    path.write_text(
        '{"wall_time": 1003.0, "charts/update": 3}\n'
    )  # cut by a resumed learner: read from the start
    assert follower.new_records() == [{"wall_time": 1003.0, "charts/update": 3}]
