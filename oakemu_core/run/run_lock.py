"""A run folder belongs to one run: the lock a live run holds on its folder.

A process that writes a run folder (the ``oakemu train`` launcher, a standalone ``oakemu learner``)
holds an exclusive ``flock`` on ``<run_dir>/run.lock`` while it lives and writes its pid into that file.
The kernel drops the lock when the last descriptor of it is closed: at exit, also after ``kill -9``.
``oakemu train`` passes the descriptor to its learner, so its run stays live until the launcher and
the learner have both exited (a learner whose launcher was killed writes its final checkpoint first).
A process that cannot take the lock within :data:`BUSY_RETRY_S` is refused with :class:`RunFolderBusyError`,
whose message names the holder's pid. Readers (``oakemu monitor``, ``evaluate``, ``export``, TensorBoard)
never hold it: :func:`holder_pid` tests a folder by taking a shared lock for an instant, which the retry
waits out.

A clean :meth:`RunFolderLock.release` removes the file; one left by a killed process holds a stale pid
but no lock, and the next run takes it over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
import weakref
from pathlib import Path

from oakemu_core.errors import DiskFullError, RunFolderError

__all__ = [
    "BUSY_RETRY_S",
    "LOCK_FILE_NAME",
    "RunFolderBusyError",
    "RunFolderLock",
    "holder_pid",
    "live_holder",
]

LOCK_FILE_NAME = "run.lock"
"""The lock file of a run folder (holds the pid of the process that holds the lock)."""
BUSY_RETRY_S = 0.1
"""Seconds :meth:`RunFolderLock.acquire` keeps trying a held lock before it refuses (a reader's
:func:`holder_pid` holds a shared lock for far less)."""
_RETRY_PERIOD_S = 0.005


class RunFolderBusyError(RunFolderError):
    """A live run holds the run folder; the one-line message names its pid (exit status 2)."""


def _recorded_pid(path: Path) -> int | None:
    """The pid written in the lock file ``path``, None when it holds none (yet) or cannot be read."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _describe_holder(path: Path) -> str:
    """``pid N``, with a note when that process has exited (its learner still holds the lock)."""
    pid = _recorded_pid(path)
    if pid is None:
        return "a process that has not written its pid yet"
    if not _pid_alive(pid):
        return f"pid {pid}, which has exited; a process it started (its learner) still writes the folder"
    return f"pid {pid}"


def holder_pid(run_dir: Path) -> int | None:
    """The pid of the live process holding ``run_dir`` (0 when it has not written it yet), None when no
    live process does. Reads only: a folder without a lock file is not live, and none is made.

    Raises:
        OSError: the lock file exists but cannot be opened.
    """
    path = Path(run_dir) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _recorded_pid(path) or 0
    finally:
        os.close(fd)  # also drops the shared lock taken to test it
    return None


def live_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir`` (``pid N``, see :func:`holder_pid`), None when no live process does."""
    return None if holder_pid(run_dir) is None else _describe_holder(Path(run_dir) / LOCK_FILE_NAME)


class RunFolderLock:
    """This process's exclusive hold on a run folder (see the module docstring).

    Made by :meth:`acquire`; :attr:`fd` is the descriptor to pass to a child process that writes the
    folder too (``subprocess.Popen(pass_fds=...)``); :meth:`release` (or leaving a ``with`` block, or the
    object's collection, or the interpreter's exit) gives the folder up.
    """

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = Path(run_dir)
        self.fd: int | None = fd
        self._release = weakref.finalize(self, _give_up, fd, self.path, os.getpid())

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE_NAME

    @classmethod
    def acquire(cls, run_dir: Path, *, hint: str = "") -> RunFolderLock:
        """Hold ``run_dir`` (an existing folder) for this process, or refuse when another process still
        holds it after :data:`BUSY_RETRY_S` seconds.

        Args:
            run_dir: the run folder.
            hint: what the user can do instead, appended to the refusal.

        Raises:
            RunFolderBusyError: another live process holds it (the message names its pid).
            RunFolderError: the lock file cannot be made (a read-only or missing folder).
        """
        run_dir = Path(run_dir)
        path = run_dir / LOCK_FILE_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(
                        f"cannot write {path}: {error.strerror} (the run folder's lock file)"
                    ) from None
                raise RunFolderError(
                    f"cannot lock the run folder {run_dir} ({error.strerror or error}: "
                    f"{path}); a run needs a folder it can write"
                ) from None
            if not _lock_within(fd, BUSY_RETRY_S):
                os.close(fd)
                raise RunFolderBusyError(
                    f"{run_dir} is in use by a live run ({_describe_holder(path)}); "
                    f"nothing was changed" + (f"; {hint}" if hint else "")
                )
            # The holder before us may have removed the file between our open and our lock: hold the
            # file the path names now, or try again.
            if _same_file(fd, path):
                break
            os.close(fd)
        with contextlib.suppress(
            OSError
        ):  # the pid only informs a refusal; a full disk must not stop the run here
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return cls(run_dir, fd)

    def release(self) -> None:
        """Give the folder up: remove the lock file and close it. Call it once the processes the
        descriptor was passed to have exited. A second call does nothing."""
        self._release()
        self.fd = None

    def __enter__(self) -> RunFolderLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def _lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, trying every :data:`_RETRY_PERIOD_S` for ``seconds``;
    False when another descriptor still holds a lock on the file then."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_RETRY_PERIOD_S)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _give_up(fd: int, path: Path, owner: int) -> None:
    """Remove the lock file ``path`` (when it is still ours) and close ``fd``; a process forked from the
    owner only closes its copy."""
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                path.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)
