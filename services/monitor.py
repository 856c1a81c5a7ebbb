"""``oakemu monitor``: attach to a running learner's telemetry and show it, read-only.

Any number of monitors can attach and detach at any time; they only subscribe to the learner's
lossy telemetry PUB socket (see ``oakemu_core.run.telemetry``), so none of them can slow or change
training.

Modes:

* default: a live view (rich) of the training figures, curves of the whole run (training return,
  evaluation return and SPS over env steps, unicode sparklines drawn from the learner's history, so
  a monitor attached late still sees the whole run) and a table of the actors;
* ``--json``: one JSON object per line - the first snapshot received (so a script sees the state at
  once), then every snapshot published after a PPO update (``"is_update": true``);
* ``--once``: print one snapshot (as a view, or as JSON with ``--json``) and exit 0.

A run on this machine (``oakemu monitor RUN``) that is not running - nothing listens on its telemetry
port, and its folder holds update records or checkpoints - is not waited for: the monitor prints the
run's last state from its folder (:func:`report_run_folder`) and exits 0. A run folder without either
(a run just starting) is waited for like an address.

If no telemetry arrives within ``timeout_s`` the monitor says so on stderr and exits with
:data:`EXIT_NO_TELEMETRY`; it never hangs. In ``--json`` mode the same applies when the learner goes
silent later. Ctrl-C (or SIGTERM) exits cleanly with 0.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from oakemu_core.errors import RunFolderError
from oakemu_core.run.metrics_table import METRICS, SECTIONS, format_line
from oakemu_core.run.telemetry import TelemetryAddressError, TelemetrySnapshot, TelemetrySubscriber

if TYPE_CHECKING:
    from oakemu_core.run.results import Run

EXIT_OK = 0
EXIT_NO_TELEMETRY = 1
"""Nothing (valid) arrived within the timeout: the learner is not there or not reachable."""
EXIT_BAD_ADDRESS = 2
"""The ``--connect`` address is not a valid ZeroMQ endpoint."""

_POLL_INTERVAL_S = 0.25
"""How often the live view redraws when no snapshot arrives (s)."""

CURVE_WIDTH = 60
"""Columns of each sparkline in the view."""

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
"""Eight levels of a sparkline, lowest first; a column without data is a space."""

NON_TERMINAL_WIDTH = 200
"""Columns of the ``--once`` view when stdout is not a terminal and ``COLUMNS`` is unset (rich's default, 80,
would wrap the labels of the side-by-side tables)."""

LISTEN_PROBE_TIMEOUT_S = 1.0
"""How long :func:`learner_listening` waits for a TCP connection to the telemetry port (s)."""


def main(
    connect: str,
    *,
    json_output: bool = False,
    once: bool = False,
    timeout_s: float = 5.0,
    security: Any = None,
    run_dir: Path | None = None,
) -> int:
    """Run the monitor against the telemetry publisher at ``connect``.

    Args:
        connect: ZeroMQ endpoint of the learner's telemetry, e.g. ``"tcp://learner:5558"``.
        run_dir: the run folder whose learner ``connect`` is (``oakemu monitor RUN``): when nothing listens
            there and the folder shows the run trained, its last state is printed instead of waiting.
        json_output: print JSON lines instead of the live view.
        once: print one snapshot and exit.
        timeout_s: seconds to wait for telemetry before giving up (first snapshot; in ``--json``
            mode also any later silence). Must be > 0.
        security: an :class:`oakemu_core.transport.auth.ClientSecurity` (CURVE keys) when the learner requires them.

    Returns:
        The process exit code: :data:`EXIT_OK`, :data:`EXIT_NO_TELEMETRY` or :data:`EXIT_BAD_ADDRESS`.

    Raises:
        ValueError: ``timeout_s`` is not a positive finite number.
    """
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, received {timeout_s!r}")
    if run_dir is not None and not _held_by_live_run(run_dir) and not learner_listening(connect):
        from oakemu_core.run.results import read_run

        run = read_run(run_dir)
        if run_has_trained(run):
            return report_run_folder(run, address=connect, json_output=json_output)
    try:
        subscriber = TelemetrySubscriber(connect, security=security)
    except TelemetryAddressError as exc:
        print(f"oakemu monitor: {exc}", file=sys.stderr)
        return EXIT_BAD_ADDRESS
    try:
        with _stop_on_signals() as stop:
            first = _receive(subscriber, timeout_s, stop)
            if first is None:
                _report_silence(subscriber, timeout_s, attached=False)
                return EXIT_NO_TELEMETRY
            if json_output:
                return _run_json(subscriber, first, once=once, timeout_s=timeout_s, stop=stop)
            if once:
                _once_console().print(render_snapshot(first, address=connect, age_s=0.0))
                return EXIT_OK
            return _run_live(subscriber, first, timeout_s=timeout_s, stop=stop)
    except (KeyboardInterrupt, _Stopped):
        return EXIT_OK
    finally:
        subscriber.close()


def _once_console() -> Console:
    """The console of the ``--once`` view: the terminal's width, or ``COLUMNS``; else (a pipe, a file)
    :data:`NON_TERMINAL_WIDTH` columns."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=NON_TERMINAL_WIDTH)
    return console


def _held_by_live_run(run_dir: Path) -> bool:
    """Whether a live process holds ``run_dir`` (its ``run.lock``): a run whose learner has not opened its
    telemetry port yet is live too. An unreadable lock file counts as live (the monitor then waits)."""
    from oakemu_core.run.run_lock import holder_pid

    try:
        return holder_pid(run_dir) is not None
    except OSError:
        return True


def run_folder(run: str | Path, runs_dir: str | Path = "runs") -> Path:
    """The folder of a run on this machine: ``run`` itself or ``runs_dir/run``, whichever holds a ``config.toml``
    (:func:`~oakemu_core.run.run_folder.find_run_folder`).

    Raises:
        RunFolderError: neither does.
    """
    from oakemu_core.run.run_folder import find_run_folder

    folder = find_run_folder(run, runs_dir)
    if folder is None:
        raise RunFolderError(
            f"monitor: expected a run folder or the name of one in {runs_dir}/, received {str(run)!r} "
            "(no config.toml there)"
        )
    return folder


def _run_settings(folder: Path) -> dict[str, Any]:
    """The run folder's ``config.toml``.

    Raises:
        RunFolderError: it cannot be read or parsed.
    """
    try:
        return tomllib.loads((folder / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise RunFolderError(f"monitor: cannot read {folder / 'config.toml'} ({error})") from None


def run_telemetry_address(run: str | Path, runs_dir: str | Path = "runs") -> str:
    """The telemetry address of a run on this machine, from its folder's ``config.toml`` (which records
    the ports ``oakemu train`` chose).

    Args:
        run: the run folder, or its name in ``runs_dir``.
        runs_dir: where run folders are (``runs_dir``, default ``runs``).

    Raises:
        RunFolderError: neither ``run`` nor ``runs_dir/run`` is a run folder with a readable ``config.toml``
            holding ``telemetry_port``.
    """
    settings = _run_settings(run_folder(run, runs_dir))
    port = settings.get("telemetry_port", 5558)
    host = str(settings.get("bind_host", "127.0.0.1"))
    host = (
        "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    )  # listening everywhere: reach it locally
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def run_has_trained(run: Run) -> bool:
    """True when the run folder holds an update record or a checkpoint (a run that has not got that far
    may still be starting)."""
    return run.updates > 0 or run.latest_checkpoint is not None


def learner_listening(connect: str, timeout_s: float = LISTEN_PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at the ``tcp://HOST:PORT`` endpoint ``connect`` (the
    learner's telemetry socket). A refused or failed connection is False; an endpoint of another transport,
    or no answer within ``timeout_s``, is True (it may be a learner: wait for its telemetry)."""
    host, _, port = connect.removeprefix("tcp://").rpartition(":")
    if not connect.startswith("tcp://") or not port.isdigit():
        return True
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except TimeoutError:
        return True
    except OSError:
        return False


def report_run_folder(run: Run, *, address: str, json_output: bool = False) -> int:
    """Print the last state of a run that is not running, as its folder records it
    (:func:`oakemu_core.run.results.read_run`); returns :data:`EXIT_OK`.

    The view says whether the run finished (its newest readable checkpoint trained ``total_env_steps``:
    :func:`~oakemu_core.run.run_folder.spent_budget`, as ``oakemu train`` judges it) or is not running, then its last
    update (number, env steps, training return, SPS since start), its evaluation return - the final one
    for a finished run, else the last evaluation with its policy version - and the best, its checkpoints,
    and for a run that can go on (not finished, with a checkpoint) the command that resumes it.
    ``json_output``: one JSON object with ``run_dir``, ``running`` (false), ``finished``, ``updates``,
    ``global_step``, ``total_env_steps``, ``episodic_return``, ``sps``, ``final_evaluation`` (a finished run's
    last evaluation), ``last_evaluation``, ``last_evaluation_policy_version``, ``best_evaluation``,
    ``latest_checkpoint``, ``best_checkpoint`` and ``resume_command`` (null where the folder has none or it
    does not apply).

    Raises:
        RunFolderError: ``config.toml`` cannot be read.
    """
    from oakemu_core.run.run_folder import (
        spent_budget,
    )  # loads the checkpoint (imports torch): not while it runs

    run_dir = run.run_dir
    total = _run_settings(run_dir).get("total_env_steps")
    total = total if isinstance(total, int) else None
    finished = spent_budget(run_dir) is not None
    version = _last_evaluation_version(run_dir)
    resume = (
        f"oakemu train --resume {run_dir}"
        if not finished and run.latest_checkpoint is not None
        else None
    )
    if json_output:
        _print_line(
            json.dumps(
                _finite_or_none(
                    {
                        "run_dir": str(run_dir),
                        "running": False,
                        "finished": finished,
                        "updates": run.updates,
                        "global_step": run.global_step,
                        "total_env_steps": total,
                        "episodic_return": run.episodic_return,
                        "sps": run.sps,
                        "final_evaluation": run.final_evaluation if finished else None,
                        "last_evaluation": run.final_evaluation,
                        "last_evaluation_policy_version": version,
                        "best_evaluation": run.best_evaluation,
                        "latest_checkpoint": None
                        if run.latest_checkpoint is None
                        else str(run.latest_checkpoint),
                        "best_checkpoint": None
                        if run.best_checkpoint is None
                        else str(run.best_checkpoint),
                        "resume_command": resume,
                    }
                )
            )
        )
        return EXIT_OK
    state = "finished" if finished else "is not running"
    last = (
        "final"
        if finished
        else "last evaluation" + ("" if version is None else f" (policy version {version})")
    )
    lines = [
        f"run {run_dir.name} {state} (no learner at {address}); its last state, from {run_dir}:",
        f"last update {run.updates}: env steps {run.global_step:,}"
        + ("" if total is None else f" of {total:,}")
        + f", return {_fmt(run.episodic_return, '.2f')}, SPS {_fmt(run.sps, ',.0f')}",
        f"evaluation return: {last} {_fmt(run.final_evaluation, '.2f')}, best {_fmt(run.best_evaluation, '.2f')}",
        f"latest checkpoint: {run.latest_checkpoint or '-'}; best: {run.best_checkpoint or '-'}",
    ]
    if resume is not None:
        lines.append(f"resume: {resume}")
    for line in lines:
        _print_line(line)
    return EXIT_OK


def _last_evaluation_version(run_dir: Path) -> int | None:
    """The policy version (``eval/policy_version``) of the last evaluation in the run's ``metrics.jsonl``,
    None without evaluations or when it is not recorded."""
    from oakemu_core.run.metrics import EVAL_EPISODIC_RETURN, METRICS_FILE_NAME
    from oakemu_core.run.run_folder import read_json_lines

    evaluations = [
        record
        for record in read_json_lines(run_dir / METRICS_FILE_NAME)
        if isinstance(record.get(EVAL_EPISODIC_RETURN), (int, float))
    ]
    version = evaluations[-1].get("eval/policy_version") if evaluations else None
    return int(version) if isinstance(version, (int, float)) and math.isfinite(version) else None


class _Stopped(Exception):
    """Ctrl-C or SIGTERM arrived while waiting for telemetry."""


def _receive(
    subscriber: TelemetrySubscriber, timeout_s: float, stop: threading.Event
) -> TelemetrySnapshot | None:
    """:meth:`TelemetrySubscriber.receive` in short waits, so a stop signal is seen within 0.25 s.

    Raises:
        _Stopped: ``stop`` was set.
    """
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        snapshot = subscriber.receive(min(remaining, _POLL_INTERVAL_S))
        if snapshot is not None:
            return snapshot
    raise _Stopped


def snapshot_to_json(snapshot: TelemetrySnapshot) -> str:
    """One-line JSON of every snapshot field; NaN / infinite floats become ``null`` (strict JSON)."""
    return json.dumps(_finite_or_none(snapshot.model_dump(mode="python")), allow_nan=False)


def render_snapshot(
    snapshot: TelemetrySnapshot, *, address: str, age_s: float, stale_after_s: float = 5.0
) -> Group:
    """Build the rich view of one snapshot: a header, the figures of
    :data:`~oakemu_core.run.metrics_table.METRICS` by section beside the rejected / dropped
    counters, the run's curves and the actors.

    Args:
        snapshot: what to show.
        address: the telemetry endpoint, shown in the header.
        age_s: seconds since the snapshot was received.
        stale_after_s: from this age on the header warns that the learner is silent.
    """
    summary = Table.grid(padding=(0, 2))
    summary.add_row(
        *(_figures_table(section, snapshot) for section in SECTIONS), _losses_table(snapshot)
    )
    return Group(
        _header(snapshot, address=address, age_s=age_s, stale_after_s=stale_after_s),
        summary,
        render_curves(snapshot),
        _actors_table(snapshot),
    )


def _header(
    snapshot: TelemetrySnapshot, *, address: str, age_s: float, stale_after_s: float
) -> Text:
    """Run, env, address and the snapshot's age (a warning once it is ``stale_after_s`` old)."""
    status = Text(f"last snapshot {age_s:4.1f} s ago", style="green")
    if age_s >= stale_after_s:
        status = Text(
            f"no telemetry for {age_s:.0f} s: is the learner still running?", style="bold red"
        )
    return Text.assemble(
        ("OakEmu-RL ", "bold"),
        (f"run {snapshot.run_name}  env {snapshot.env_id}  ", "cyan"),
        (f"{address}  ", "dim"),
        status,
    )


def _figures_table(section: str, snapshot: TelemetrySnapshot) -> Table:
    """The monitor lines of the table's rows in ``section``, in table order."""
    table = _key_value_table(section)
    for row in METRICS:
        if row.monitor is None or row.monitor.section != section:
            continue
        value = format_line(row, snapshot)
        if value is not None:
            style = row.monitor.style(snapshot) if row.monitor.style else None
            table.add_row(row.monitor.label, value, style=style)
    return table


def _losses_table(snapshot: TelemetrySnapshot) -> Table:
    """Rejected messages by reason (red when counted) and dropped data by kind (yellow)."""
    losses = _key_value_table("Rejected / dropped")
    for reason, count in sorted(snapshot.rejected_messages.items()):
        losses.add_row(f"rejected: {reason}", f"{count:,}", style="red" if count else None)
    for kind, count in sorted(snapshot.dropped.items()):
        losses.add_row(f"dropped: {kind}", f"{count:,}", style="yellow" if count else None)
    if not snapshot.rejected_messages and not snapshot.dropped:
        losses.add_row("none", "0")
    return losses


def _actors_table(snapshot: TelemetrySnapshot) -> Table:
    """One line per connected actor, by id."""
    actors = Table(title=f"Actors ({snapshot.num_actors})", title_justify="left", expand=False)
    actors.add_column("id")
    actors.add_column("incarnation", style="dim")
    actors.add_column("envs", justify="right")
    actors.add_column("SPS", justify="right")
    actors.add_column("lag min/mean/max", justify="right")
    actors.add_column("last heard", justify="right")
    for actor in sorted(snapshot.actors, key=lambda a: a.actor_id):
        lag = (
            f"{_fmt(actor.policy_lag_min, '.0f')} / {_fmt(actor.policy_lag, '.2f')} / "
            f"{_fmt(actor.policy_lag_max, '.0f')}"
        )
        actors.add_row(
            actor.actor_id,
            actor.incarnation[:12],
            str(actor.num_envs),
            _fmt(actor.sps, ".0f"),
            lag,
            f"{actor.last_heard_s:.1f} s",
        )
    return actors


def sparkline(
    values: Sequence[float | None], *, low: float | None = None, high: float | None = None
) -> str:
    """One character per value from :data:`SPARK_BLOCKS` (``None`` / NaN: a space).

    ``low`` / ``high`` default to the finite values' min / max; a flat series is drawn at the
    middle level.
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low = min(finite) if low is None else low
    high = max(finite) if high is None else high
    top = len(SPARK_BLOCKS) - 1
    chars = []
    for value in values:
        if value is None or not math.isfinite(value):
            chars.append(" ")
        elif high <= low:
            chars.append(SPARK_BLOCKS[top // 2])
        else:
            level = round((min(max(value, low), high) - low) / (high - low) * top)
            chars.append(SPARK_BLOCKS[level])
    return "".join(chars)


def resample(
    points: Sequence[tuple[int, float | None]], start: int, end: int, width: int
) -> list[float | None]:
    """Values of ``(global_step, value)`` points (increasing steps) on ``width`` columns spanning
    env steps ``start``..``end``: each column shows the last value at or before its right edge
    (a step curve; None before the first point)."""
    if width < 1:
        return []
    span = max(1, end - start)
    columns: list[float | None] = []
    index, current = 0, None
    for column in range(width):
        edge = start + span * (column + 1) / width
        while index < len(points) and points[index][0] <= edge:
            value = points[index][1]
            current = value if value is not None and math.isfinite(value) else current
            index += 1
        columns.append(current)
    return columns


def render_curves(snapshot: TelemetrySnapshot, *, width: int = CURVE_WIDTH) -> Table:
    """The run's curves over env steps from the snapshot's history: training return (episode
    window mean), evaluation return (tester mean) and SPS, one sparkline each with its last
    value and range. A history without points says so."""
    history = snapshot.history
    table = Table(title="Curves", title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column(no_wrap=True)
    table.add_column(justify="right")
    table.add_column(style="dim", no_wrap=True)
    steps = [p.global_step for p in history.training] + [p.global_step for p in history.evaluations]
    if not steps:
        table.add_row("no history yet", "", "", "")
        return table
    start, end = min(steps), max(steps)
    series = (
        ("train return", "cyan", [(p.global_step, p.episodic_return) for p in history.training]),
        ("eval return", "green", [(p.global_step, p.return_mean) for p in history.evaluations]),
        ("SPS", "magenta", [(p.global_step, p.sps) for p in history.training]),
    )
    for name, style, points in series:
        finite = [v for _, v in points if v is not None and math.isfinite(v)]
        if not finite:
            table.add_row(name, Text(" " * width), "-", "no data yet")
            continue
        line = sparkline(resample(points, start, end, width), low=min(finite), high=max(finite))
        table.add_row(
            name,
            Text(line, style=style),
            _fmt(finite[-1], ".1f"),
            f"min {min(finite):.1f}  max {max(finite):.1f}  ({len(points)} points)",
        )
    table.add_row(
        "env steps",
        Text(f"{start:,}".ljust(width - len(f"{end:,}")) + f"{end:,}", style="dim"),
        "",
        "",
    )
    return table


def _run_json(
    subscriber: TelemetrySubscriber,
    first: TelemetrySnapshot,
    *,
    once: bool,
    timeout_s: float,
    stop: threading.Event,
) -> int:
    """Print the first snapshot, then every update snapshot, one JSON object per line."""
    try:
        _print_line(snapshot_to_json(first))
        if once:
            return EXIT_OK
        while True:
            snapshot = _receive(subscriber, timeout_s, stop)
            if snapshot is None:
                _report_silence(subscriber, timeout_s, attached=True)
                return EXIT_NO_TELEMETRY
            if snapshot.is_update:
                _print_line(snapshot_to_json(snapshot))
    except BrokenPipeError:  # e.g. piped into `head -1`: the reader is done, so are we
        sys.stdout = None  # type: ignore[assignment]  # keep the interpreter from flushing again
        return EXIT_OK


def _run_live(
    subscriber: TelemetrySubscriber,
    first: TelemetrySnapshot,
    *,
    timeout_s: float,
    stop: threading.Event,
) -> int:
    """Redraw the live view until Ctrl-C; a silent learner is shown, not fatal (it may restart)."""
    address = subscriber.connect_address
    snapshot, received_at = first, time.monotonic()
    with Live(
        render_snapshot(snapshot, address=address, age_s=0.0), refresh_per_second=4, transient=False
    ) as live:
        while not stop.is_set():
            newer = subscriber.receive(_POLL_INTERVAL_S)
            if newer is not None:
                snapshot, received_at = newer, time.monotonic()
            live.update(
                render_snapshot(
                    snapshot,
                    address=address,
                    age_s=time.monotonic() - received_at,
                    stale_after_s=timeout_s,
                )
            )
    return EXIT_OK


def _report_silence(subscriber: TelemetrySubscriber, timeout_s: float, *, attached: bool) -> None:
    when = "for" if attached else "within"
    message = (
        f"oakemu monitor: no telemetry from {subscriber.connect_address} {when} {timeout_s:g} s: "
    )
    message += "is the learner still running?" if attached else "is the learner running?"
    if subscriber.rejected:
        message += (
            f" ({subscriber.rejected} malformed telemetry message(s) rejected; last: "
            f"{subscriber.last_rejection})"
        )
    print(message, file=sys.stderr, flush=True)


def _print_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _key_value_table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column(justify="right")
    return table


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: _finite_or_none(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(value) for value in obj]
    return obj


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """Ctrl-C and SIGTERM (``docker stop``) set the yielded event instead of raising
    KeyboardInterrupt wherever the main thread happens to be: raised inside rich's live display
    (which holds a lock its refresh thread needs) it could leave the monitor hung. Main thread
    only; elsewhere signals are left alone."""
    stop = threading.Event()

    def _set(signum: int, frame: object) -> None:
        stop.set()

    try:
        previous = {sig: signal.signal(sig, _set) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield stop
        return
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _module_main(argv: list[str]) -> int:
    """``python -m oakemu_services.monitor ...``: the same as ``oakemu monitor ...``."""
    from oakemu_services.cli import main as cli_main

    return cli_main(["monitor", *argv])


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
