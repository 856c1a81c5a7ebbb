"""Run a command with a time limit that cannot be outlived: a session of its own, a polite stop
first, and nothing it started left running or in ``/dev/shm`` (Linux ``/proc``).

:func:`run_command` is what ``benchmarks/gpu_check_all.py`` runs each of its steps with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["INTERRUPT_GRACE_S", "TERMINATE_GRACE_S", "run_command"]

INTERRUPT_GRACE_S = 15.0
"""Seconds between SIGINT (pytest writes its report, ``oakemu train`` stops cleanly) and SIGTERM."""
TERMINATE_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL."""
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "oakemu_"
"""``oakemu_<owner pid>_...``: the project's shared-memory segments (``oakemu_core.shared_memory``)."""


def _process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time in clock ticks)`` of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def _family(root: int, table: dict[int, tuple[int, int]]) -> set[tuple[int, int]]:
    """``(pid, start time)`` of ``root`` and its live descendants in ``table`` (those in sessions of
    their own included)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.add((pid, table[pid][1]))
        todo.extend(children.get(pid, []))
    return found


def _alive(processes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Those of ``processes`` still running: the same pid with the same start time (never a pid
    reused by another process)."""
    table = _process_table()
    return {(pid, start) for pid, start in processes if table.get(pid, (0, -1))[1] == start}


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def run_command(
    command: list[str],
    log_path: Path,
    timeout_s: float,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[str, int | None, float]:
    """Run ``command`` in a session of its own, stdout and stderr to ``log_path``. After ``timeout_s``
    seconds its process group gets SIGINT, :data:`INTERRUPT_GRACE_S` later SIGTERM,
    :data:`TERMINATE_GRACE_S` later SIGKILL. When it has ended, every descendant seen while it ran
    (polled every half second) that still runs gets SIGTERM, then SIGKILL, and the ``/dev/shm``
    segments any of them owned are removed.

    Returns ``(status, exit status, seconds)``; status ``ok`` (exit 0), ``failed`` or ``timeout``.
    """
    start = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    seen: set[tuple[int, int]] = set()
    timed_out = False
    signals = [
        (timeout_s, signal.SIGINT),
        (timeout_s + INTERRUPT_GRACE_S, signal.SIGTERM),
        (timeout_s + INTERRUPT_GRACE_S + TERMINATE_GRACE_S, signal.SIGKILL),
    ]
    try:
        while process.poll() is None:
            seen |= _family(process.pid, _process_table())
            while signals and time.monotonic() - start >= signals[0][0]:
                timed_out = True
                _signal_group(process.pid, signals.pop(0)[1])
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.5)
    finally:
        if process.poll() is None:  # interrupted here: nothing of it outlives this call
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        _stop_leftovers(seen)
    seconds = time.monotonic() - start
    status = "timeout" if timed_out else ("ok" if process.returncode == 0 else "failed")
    return status, process.returncode, seconds


def _stop_leftovers(seen: set[tuple[int, int]]) -> None:
    """SIGTERM, then SIGKILL after 5 s, the processes of ``seen`` still running; then remove the
    shared-memory segments any process of ``seen`` owned."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        left = _alive(seen)
        if not left:
            break
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        deadline = time.monotonic() + 5.0
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.2)
    pids = {pid for pid, _ in seen}
    if SHM_DIR.is_dir():
        for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
            owner = path.name[len(SEGMENT_PREFIX) :].split("_", 1)[0]
            if owner.isdigit() and int(owner) in pids:
                path.unlink(missing_ok=True)
