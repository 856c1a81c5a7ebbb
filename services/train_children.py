"""The child processes of ``oakemu train`` and what their output says.

:class:`Child` is one ``oakemu learner`` or ``oakemu actor`` process; its output (stdout and stderr, one
pipe) goes through the launcher (:class:`ChildOutput`) into its log file, so its last error is known even
when the log cannot be written (a full disk). :func:`errors_in`, :func:`last_error` and
:func:`stop_reason` read the errors of that output (plain log records, ``oakemu`` error lines,
tracebacks), :func:`crash_traceback` the traceback of a crash, :func:`exit_description` its exit status.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import IO

import oakemu_services

import oakemu_core
from oakemu_core.shared_memory import SEGMENT_PREFIX, parse_segment_owner

OUTPUT_LINES_KEPT = 400
"""The newest lines of a child's output the launcher keeps in memory (its errors are read from them)."""
OUTPUT_DRAIN_S = 2.0
"""How long the launcher waits for the rest of an exited child's output."""

_ERROR_RECORD = re.compile(r"^\S+ (?:ERROR|CRITICAL) [\w.]+: (.+)$")
"""A plain log record of level ERROR or CRITICAL (:class:`oakemu_services.runtime.OneLineFormatter`)."""
_CLI_ERROR = re.compile(r"^oakemu \w+: error: (.+)$")
"""The one line ``oakemu`` prints for a user error (:mod:`oakemu_services.cli`)."""
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Failed|Interrupt)\b.*"
)
"""The last line of a Python traceback: ``module.ErrorName: message``."""
_STOPPING_RECORD = re.compile(r"^\S+ INFO [\w.]+: stopping: (.+)$")
"""The learner's record of a stop that is no error (its budget spent, a signal)."""
_TRACEBACK_START = "Traceback (most recent call last):"
_FINAL_CHECKPOINT_FAILED = re.compile(r"^final checkpoint\b.* not written")
"""How the learner's error about its final checkpoint starts (``CheckpointWriter`` in ``run/checkpoint.py``,
``CheckpointPolicy.final`` in ``algo/health.py``)."""
_OWN_CODE = tuple(
    str(Path(package.__file__).parent) + os.sep for package in (oakemu_core, oakemu_services)
)
"""Where oakemu's own source files are: their frames are left out of a crash shown on the console."""


def exit_description(status: int) -> str:
    """``exited with status N``, or ``was killed by SIGNAME`` for a negative status (Popen's returncode
    of a process ended by a signal)."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return f"was killed by {name}"


class ChildOutput:
    """A child's output (stdout and stderr, one pipe), copied line by line to its log file by a thread
    of its own, the newest :data:`OUTPUT_LINES_KEPT` lines kept in memory: the launcher reads the
    child's last error from them, also when the log file cannot be written (a full disk). A launcher
    killed with SIGKILL takes the pipe with it: its children still stop cleanly (parent-death signal,
    final checkpoint) but their last lines do not reach the log."""

    def __init__(self, pipe: IO[bytes], log_path: Path) -> None:
        self.log_path = log_path
        self.write_error: str | None = None
        """Why lines could not be appended to the log file (the first failure); None while all were."""
        self._pipe = pipe
        self._lines: deque[str] = deque(maxlen=OUTPUT_LINES_KEPT)
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._copy, name=f"oakemu-output-{log_path.stem}", daemon=True
        )
        self._thread.start()

    def _copy(self) -> None:
        try:
            fd: int | None = os.open(
                self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
        except OSError as error:
            fd, self.write_error = None, error.strerror or str(error)
        with self._pipe:
            for line in iter(lambda: self._pipe.readline(65536), b""):
                with self._lock:
                    self._lines.append(line.decode(errors="replace").rstrip("\r\n"))
                if fd is None:
                    continue
                try:
                    os.write(fd, line)
                except OSError as error:  # a full disk: the line stays in memory only
                    self.write_error = self.write_error or error.strerror or str(error)
        if fd is not None:
            os.close(fd)

    def lines(self) -> list[str]:
        """The newest lines (oldest first), without their line ends."""
        with self._lock:
            return list(self._lines)

    def drain(self, timeout_s: float = OUTPUT_DRAIN_S) -> None:
        """Wait until the output ended (every writer closed it) or ``timeout_s`` passed."""
        self._thread.join(timeout_s)


class Child:
    """One service process with its log file (its output goes through :class:`ChildOutput`)."""

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_path
        self.pass_fds = pass_fds
        """Descriptors the process inherits (the learner: the run folder's lock)."""
        self.restarts = 0
        self.gave_up = False  # exited with an error and not restarted
        self.process: subprocess.Popen[bytes] | None = None
        self.output: ChildOutput | None = None
        """The output of the newest start."""

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches only the launcher, which then stops children in order.
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=self.pass_fds,
        )
        assert self.process.stdout is not None
        self.output = ChildOutput(self.process.stdout, self.log_path)

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def remove_leftover_segments(self, shm_dir: Path = Path("/dev/shm")) -> list[str]:
        """Unlink the shared-memory segments (``oakemu_<pid>_*``) of the newest start when a signal
        killed it (it had no chance to); returns their names."""
        if self.process is None or (self.process.poll() or 0) >= 0 or not shm_dir.is_dir():
            return []
        removed = []
        for path in shm_dir.glob(f"{SEGMENT_PREFIX}{self.process.pid}_*"):
            if parse_segment_owner(path.name) == self.process.pid:
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return sorted(removed)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the newest start's output (all of it once the child exited)."""
        if self.output is None:
            return ""
        if self.poll() is not None:
            self.output.drain()
        return "\n".join(self.output.lines()[-lines:])

    def log_note(self) -> str:
        """``log: <path>``, with why it is incomplete when lines could not be written to it."""
        missing = self.output.write_error if self.output is not None else None
        return f"log: {self.log_path}" + (f", incomplete: {missing}" if missing else "")

    def error_line(self) -> str | None:
        """The newest error in its output: the last traceback's final line or ERROR record, else None."""
        return last_error(self.log_tail(OUTPUT_LINES_KEPT))

    def stop_reason(self) -> str | None:
        """Why it stopped, from its output (:func:`stop_reason`)."""
        return stop_reason(self.log_tail(OUTPUT_LINES_KEPT))


def _log_events(text: str) -> list[tuple[str, str]]:
    """The errors and stops of a log text, oldest first: ``("error", message)`` for each ERROR/CRITICAL
    record, ``oakemu`` error line and traceback's final line (``module.NameError: message``); ``("stop",
    reason)`` for each learner record of a stop that is no error (``stopping: env-step budget reached``)."""
    events = []
    for line in text.splitlines():
        line = line.strip()
        record = _ERROR_RECORD.match(line) or _CLI_ERROR.match(line)
        stopping = _STOPPING_RECORD.match(line)
        if record:
            events.append(("error", record.group(1)))
        elif stopping:
            events.append(("stop", stopping.group(1)))
        elif _EXCEPTION_LINE.match(line):
            events.append(("error", line))
    return events


def errors_in(text: str) -> list[str]:
    """The errors of a log text, oldest first: each ERROR/CRITICAL record's message and each
    traceback's final line (``module.NameError: message``)."""
    return [message for kind, message in _log_events(text) if kind == "error"]


def last_error(text: str) -> str | None:
    """The newest error of a log text (:func:`errors_in`); None when there is none."""
    errors = errors_in(text)
    return errors[-1] if errors else None


def stop_reason(text: str) -> str | None:
    """Why the learner whose log text is ``text`` stopped: its newest error, or, when that is the
    failure of its final checkpoint following the error that stopped it (no ``stopping: ...`` record of
    a budget spent or a signal between them), the error before it with ``; the final checkpoint was not
    written either``; None when it logged no error."""
    events = _log_events(text)
    final_failed = bool(events) and _FINAL_CHECKPOINT_FAILED.match(events[-1][1]) is not None
    if final_failed and len(events) >= 2 and events[-1][0] == events[-2][0] == "error":
        return f"{events[-2][1]}; the final checkpoint was not written either"
    errors = [message for kind, message in events if kind == "error"]
    return errors[-1] if errors else None


def crash_traceback(text: str) -> list[str] | None:
    """The last Python traceback in ``text`` (from ``Traceback (most recent call last):`` to its
    exception line) with oakemu's own frames left out when the error was raised outside oakemu (a
    user's env): ``[header, "  (N frames of oakemu left out)", frames..., exception]``; None when
    ``text`` holds no traceback."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK_START)]
    if not starts:
        return None
    frames: list[list[str]] = []
    exception = None
    for line in lines[starts[-1] + 1 :]:
        if line.startswith("  File "):
            frames.append([line])
        elif line.startswith("    ") and frames:
            frames[-1].append(line)
        elif line.strip():
            exception = line
            break
    if exception is None:
        return None

    def own(frame: list[str]) -> bool:
        path = frame[0].split('"')[1] if frame[0].count('"') >= 2 else ""
        return path.startswith(_OWN_CODE) or path.startswith("<frozen ")

    kept = (
        frames if not frames or own(frames[-1]) else [frame for frame in frames if not own(frame)]
    )
    left_out = len(frames) - len(kept)
    note = [f"  ({left_out} frames of oakemu left out)"] if left_out else []
    return [_TRACEBACK_START, *note, *(line for frame in kept for line in frame), exception]
