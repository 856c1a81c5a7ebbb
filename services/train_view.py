"""What ``oakemu train`` shows while a run trains and when it ends (the launcher's console output).

While it trains, one of three progress views (:func:`progress_view`):

* :class:`BarView` on a terminal: a rich progress bar (env steps trained against the budget, elapsed
  time, ETA, SPS, return) redrawn in place, with one line per PPO update above it;
* :class:`PlainView` elsewhere (a log file, CI, a notebook): one plain progress line every
  :data:`PLAIN_PROGRESS_PERIOD_S` seconds (env steps trained / budget, %, elapsed, ETA, SPS, return)
  besides the lines per PPO update, since a bar would appear only once, at the end;
* :class:`QuietView` (``verbose=0``): nothing.

At the end, :func:`end_lines` gives the final and best evaluations, their videos and the next
commands.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from oakemu_core.run.checkpoint_paths import CHECKPOINT_DIR_NAME, latest_checkpoint
from oakemu_core.run.metrics import EVAL_EPISODIC_RETURN, METRICS_FILE_NAME
from oakemu_core.run.run_folder import read_json_lines
from oakemu_core.run.telemetry import TelemetrySnapshot
from oakemu_core.run.tester import BEST_NAME
from oakemu_core.run.video import VIDEO_DIR_NAME, evaluation_video_path

PLAIN_PROGRESS_PERIOD_S = 15.0
"""Seconds between two plain progress lines (a console that is not a terminal)."""
ETA_WINDOW_S = 60.0
"""The ETA of a plain progress line assumes the rate of env steps trained over this many seconds."""


def print_line(console: Console, text: str, style: str | None = None) -> None:
    """``text`` as one line (never wrapped, no highlighting), in ``style`` (e.g. ``"red"``) when given."""
    console.print(text, style=style, highlight=False, soft_wrap=True, markup=False)


def update_line(snapshot: TelemetrySnapshot) -> str:
    """One line per PPO update: steps, SPS (since start, last 10 s), episodes, mean episodic return,
    losses, actors."""
    ret = (
        f"{snapshot.episodic_return_mean:8.2f}"
        if snapshot.episodic_return_mean is not None
        else "     n/a"
    )
    losses = (
        f" | pg {snapshot.policy_loss:+.3f} v {snapshot.value_loss:.3f} ent {snapshot.entropy:.3f}"
        if snapshot.policy_loss is not None
        else ""
    )
    return (
        f"update {snapshot.iterations:5d} | steps {snapshot.global_step:9d} | SPS {snapshot.sps:6.0f} "
        f"(recent {snapshot.sps_recent:6.0f}) | episodes {snapshot.episodes:6d} | return {ret}{losses} | "
        f"actors {snapshot.num_actors}"
    )


def _live_figures(snapshot: TelemetrySnapshot) -> str:
    """``<SPS> SPS, return <mean>``: the live figures of a progress bar or line."""
    ret = (
        f"{snapshot.episodic_return_mean:.1f}"
        if snapshot.episodic_return_mean is not None
        else "n/a"
    )
    return f"{snapshot.sps_recent:.0f} SPS, return {ret}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative number of seconds."""
    whole = int(max(0.0, seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class BarView:
    """The rich progress bar of a terminal, with the update lines printed above it."""

    def __init__(self, console: Console, total_env_steps: int) -> None:
        self.last_update = -1
        # "trained": env steps PPO trained on, the count the budget is spent by; ETA at the recent rate.
        columns = (
            TextColumn("[bold blue]trained"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(compact=True),
            TextColumn("{task.fields[info]}"),
        )
        self.progress = Progress(*columns, console=console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=total_env_steps, info="starting learner and actors"
        )

    def show(self, snapshot: TelemetrySnapshot) -> None:
        """Move the bar to ``snapshot``; print its update line when it is a new PPO update's."""
        self.progress.update(
            self.task, completed=snapshot.trained_env_steps, info=_live_figures(snapshot)
        )
        if snapshot.is_update and snapshot.iterations != self.last_update:
            self.last_update = snapshot.iterations
            print_line(self.progress.console, update_line(snapshot))

    def tick(self) -> None:
        """Nothing to do between snapshots: rich redraws the bar on its own."""

    def close(self) -> None:
        """Stop redrawing; the bar's last state stays on the terminal."""
        self.progress.stop()


class PlainView:
    """Progress for a console that is not a terminal: the update lines, and every ``period_s`` one
    line ``trained N/M env steps (P%) | elapsed H:MM:SS | ETA H:MM:SS | S SPS | return R``.

    The ETA assumes the rate of env steps trained over the last :data:`ETA_WINDOW_S` seconds.
    """

    def __init__(
        self,
        console: Console,
        total_env_steps: int,
        *,
        period_s: float = PLAIN_PROGRESS_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.total = int(total_env_steps)
        self.period_s = float(period_s)
        self.clock = clock
        self.started = clock()
        self.next_line = self.started + self.period_s
        self.last_update = -1
        self.latest: TelemetrySnapshot | None = None
        self.printed: TelemetrySnapshot | None = None
        self._trained: deque[tuple[float, int]] = (
            deque()
        )  # (time, env steps trained), the last ETA_WINDOW_S

    def show(self, snapshot: TelemetrySnapshot) -> None:
        """Take ``snapshot``: its update line when it is a new PPO update's, a progress line when due."""
        now = self.clock()
        self.latest = snapshot
        self._trained.append((now, snapshot.trained_env_steps))
        while len(self._trained) > 2 and now - self._trained[1][0] >= ETA_WINDOW_S:
            self._trained.popleft()
        if snapshot.is_update and snapshot.iterations != self.last_update:
            self.last_update = snapshot.iterations
            print_line(self.console, update_line(snapshot))
        self.tick()

    def tick(self) -> None:
        """Print the progress line when one is due (also while no snapshot arrives)."""
        now = self.clock()
        if now >= self.next_line:
            self.next_line = now + self.period_s
            print_line(self.console, self.progress_line(now))
            self.printed = self.latest

    def progress_line(self, now: float) -> str:
        """The progress line at time ``now`` (of the view's clock)."""
        elapsed = format_duration(now - self.started)
        if self.latest is None:
            return (
                f"trained 0/{self.total:,} env steps (0%) | elapsed {elapsed} | "
                "waiting for the learner's first figures"
            )
        trained = self.latest.trained_env_steps
        percent = 100.0 * trained / self.total if self.total else 100.0
        (t0, s0), (t1, s1) = self._trained[0], self._trained[-1]
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        eta = format_duration(max(0, self.total - trained) / rate) if rate > 0 else "n/a"
        if trained >= self.total:
            eta = format_duration(0)
        return (
            f"trained {trained:,}/{self.total:,} env steps ({percent:.0f}%) | elapsed {elapsed} | ETA {eta} | "
            f"{_live_figures(self.latest)}"
        )

    def close(self) -> None:
        """A last progress line when the figures changed since the last one printed."""
        if self.latest is not None and self.latest is not self.printed:
            print_line(self.console, self.progress_line(self.clock()))
            self.printed = self.latest


class QuietView:
    """No progress output (``verbose=0``)."""

    last_update = -1

    def show(self, snapshot: TelemetrySnapshot) -> None:
        """Only remember the newest PPO update."""
        if snapshot.is_update:
            self.last_update = snapshot.iterations

    def tick(self) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


ProgressView = BarView | PlainView | QuietView


def progress_view(console: Console, total_env_steps: int, verbose: int = 1) -> ProgressView:
    """:class:`QuietView` for ``verbose=0``, else :class:`BarView` on a terminal (``console.is_terminal``:
    not for a file, a pipe or a notebook) and :class:`PlainView` elsewhere."""
    if verbose <= 0:
        return QuietView()
    if console.is_terminal and not console.is_dumb_terminal:
        return BarView(console, total_env_steps)
    return PlainView(console, total_env_steps)


# ------------------------------------------------------------------------------ the end of a run
def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` ([] when it cannot be read)."""
    try:
        return list(read_json_lines(run_dir / METRICS_FILE_NAME))
    except OSError:
        return []


def final_update_line(records: list[dict[str, Any]]) -> tuple[int, str] | None:
    """``(update, line)`` of the last PPO update in ``records`` (metrics.jsonl: telemetry is lossy and
    the learner may exit before its last snapshots are read), or None when no update was recorded."""
    updates = [record for record in records if "charts/update" in record]
    if not updates:
        return None
    last = updates[-1]

    def figure(name: str, spec: str, missing: str = "n/a") -> str:
        value = last.get(name)
        return format(value, spec) if isinstance(value, (int, float)) else missing

    update = int(last["charts/update"])
    losses = (
        (
            f" | pg {figure('losses/policy_loss', '+.3f')} v {figure('losses/value_loss', '.3f')} "
            f"ent {figure('losses/entropy', '.3f')}"
        )
        if "losses/policy_loss" in last
        else ""
    )
    return update, (
        f"update {update:5d} | steps {int(last['global_step']):9d} | SPS {figure('charts/SPS', '6.0f')} "
        f"(recent {figure('charts/SPS_recent', '6.0f')}) | return "
        f"{figure('charts/episodic_return', '8.2f', '     n/a')}{losses} | actors "
        f"{figure('charts/actors', '.0f')} (final, metrics.jsonl)"
    )


def _evaluation_text(record: dict[str, Any]) -> str:
    version = record.get("eval/policy_version")
    of_version = f" (policy version {int(version)})" if isinstance(version, (int, float)) else ""
    return f"return {record[EVAL_EPISODIC_RETURN]:.2f}{of_version}"


def _video(run_dir: Path, name: str, record: dict[str, Any]) -> Path | None:
    """``videos/<name>`` (the tester's ``best.mp4`` / ``final.mp4``), else the video of the evaluation
    ``record`` (``videos/update_<policy version>.mp4``), when it exists; None otherwise."""
    path = run_dir / VIDEO_DIR_NAME / name
    version = record.get("eval/policy_version")
    if not path.is_file() and isinstance(version, (int, float)):
        path = evaluation_video_path(run_dir / VIDEO_DIR_NAME, int(version))
    return path if path.is_file() else None


def policy_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint the next commands (evaluate, export) use: ``checkpoints/best.pt`` when kept, else
    :func:`~oakemu_core.run.checkpoint_paths.latest_checkpoint`; None when the run has no checkpoint.
    Whether the run can be resumed is ``latest_checkpoint`` alone (a resume never starts from best.pt)."""
    best = run_dir / CHECKPOINT_DIR_NAME / BEST_NAME
    return best if best.is_file() else latest_checkpoint(run_dir)


def end_lines(run_dir: Path, records: list[dict[str, Any]], *, resumable: bool) -> list[str]:
    """What a run that ended cleanly leaves to say, given its ``metrics.jsonl`` ``records``:

    * ``evaluation: final return F (policy version V), best return B (policy version W): checkpoints/best.pt``
      (the best part when the tester kept ``best.pt``);
    * ``videos: best <path>, final <path>``: ``videos/best.mp4`` and ``videos/final.mp4``, or else the
      ``videos/update_<policy version>.mp4`` of those evaluations, those that exist;
    * ``next: ...`` the commands that come next: ``oakemu evaluate`` and ``oakemu export`` of
      :func:`policy_checkpoint` (none without a checkpoint), ``tensorboard``, and ``oakemu train --resume``
      when ``resumable``.
    """
    lines = []
    evaluations = [r for r in records if isinstance(r.get(EVAL_EPISODIC_RETURN), (int, float))]
    best_file = run_dir / CHECKPOINT_DIR_NAME / BEST_NAME
    if evaluations:
        final = evaluations[-1]
        best = max(evaluations, key=lambda r: r[EVAL_EPISODIC_RETURN])
        kept = f": {best_file}" if best_file.is_file() else ""
        lines.append(
            f"evaluation: final {_evaluation_text(final)}, best {_evaluation_text(best)}{kept}"
        )
        videos = {
            "best": _video(run_dir, "best.mp4", best),
            "final": _video(run_dir, "final.mp4", final),
        }
        if videos["best"] == videos["final"]:
            videos.pop("final")
        named = [f"{which} {path}" for which, path in videos.items() if path is not None]
        if named:
            lines.append(f"videos: {', '.join(named)}")
    checkpoint = policy_checkpoint(run_dir)
    commands = (
        [f"oakemu evaluate {checkpoint}", f"oakemu export {checkpoint} DIR"]
        if checkpoint is not None
        else []
    )
    commands.append(f"tensorboard --logdir {run_dir.parent}")
    if resumable:
        commands.insert(0, f"oakemu train --resume {run_dir}")
    lines.append("next: " + "; ".join(commands))
    return lines
