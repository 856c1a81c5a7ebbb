"""Is an actor's process still running? The fastest trustworthy sign of a local actor's death.

An actor's join request carries its process id and its PID namespace
(:func:`process_identity`). When the namespace is the learner's own, the id names the same process
for both, and :class:`LocalProcesses` can tell at once that it exited (or was stopped with
``SIGSTOP``): its ``/proc/<pid>/stat`` is gone, belongs to a newer process (another start time), or
says state ``T``. Actors elsewhere (other machines, containers with their own PID namespace) give no
such sign: heartbeats and ``actor_timeout_s`` stay the only one.

Linux only (``/proc``); elsewhere nothing is watched.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LocalProcesses", "process_identity", "read_stat"]

PROC = Path("/proc")


def process_identity(proc: Path = PROC) -> tuple[int, str]:
    """``(pid, pid namespace)`` of this process: the namespace as ``/proc/self/ns/pid``'s link
    target (e.g. ``"pid:[4026531836]"``), ``""`` where it cannot be read."""
    try:
        namespace = os.readlink(proc / "self" / "ns" / "pid")
    except OSError:
        namespace = ""
    return os.getpid(), namespace


def read_stat(pid: int, proc: Path = PROC) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of process ``pid`` from ``/proc/<pid>/stat``
    (proc(5): fields 3 and 22), or None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": the command may hold spaces
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


class LocalProcesses:
    """The actors whose process this learner can see, keyed by ``(actor_id, incarnation)``.

    Args:
        proc: the proc file system (a folder of fake ``<pid>/stat`` files in tests).
    """

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self.namespace = process_identity(proc)[1]
        self._watched: dict[tuple[str, str], tuple[int, int]] = {}

    def watch(self, actor_id: str, incarnation: str, pid: int, namespace: str) -> bool:
        """Watch the actor's process when it shares this learner's PID namespace and runs now;
        returns whether it is watched."""
        if pid <= 0 or not namespace or namespace != self.namespace:
            return False
        stat = read_stat(pid, self.proc)
        if stat is None:
            return False
        self._watched[(actor_id, incarnation)] = (pid, stat[1])
        return True

    def gone(self) -> list[tuple[str, str, str]]:
        """``(actor_id, incarnation, why)`` of the watched actors whose process exited or is stopped
        (``why``: ``"exited"`` or ``"stopped"``); they are no longer watched."""
        found = []
        for key, (pid, started) in list(self._watched.items()):
            stat = read_stat(pid, self.proc)
            if stat is None or stat[1] != started or stat[0] in ("Z", "X"):
                found.append((*key, "exited"))
            elif stat[0] == "T":
                found.append((*key, "stopped"))
            else:
                continue
            del self._watched[key]
        return found

    def forget(self, actor_id: str, incarnation: str) -> None:
        """Stop watching that actor incarnation (it left or timed out)."""
        self._watched.pop((actor_id, incarnation), None)

    def retain(self, keys: set[tuple[str, str]]) -> None:
        """Stop watching every actor incarnation not in ``keys`` (those that left or timed out)."""
        for key in [k for k in self._watched if k not in keys]:
            del self._watched[key]
