"""Named shared-memory numpy arrays with a single owner and a stale-segment sweep.

A :class:`SharedArray` is a numpy array whose memory is a POSIX shared-memory segment
(``multiprocessing.shared_memory``), so another process can attach to it by name and read or
write it in place, without copying. Exactly one process, the one that created the segment (the
*owner*), removes its name from the system: on :meth:`SharedArray.unlink`, when the owning object
is garbage-collected, and at interpreter exit. An attached (non-owner) array never unlinks.

Segment names have the form ``oakemu_<owner pid>_<token>_<field>`` (see :data:`SEGMENT_PREFIX`),
so a segment left behind by a killed owner (``SIGKILL``, OOM killer) is recognisable;
:func:`sweep_stale_segments` removes those whose owner process no longer exists.

Why the standard library's resource tracker is bypassed: in Python < 3.13 every process that
*attaches* to a segment registers it with its resource tracker, which unlinks it when that process
exits, destroying the owner's segment (CPython issue bpo-38119 / gh-82300). Python 3.13 added
``track=False`` for this; on older versions the registration is undone right after opening.
Ownership is handled here instead, by the name's pid and the owner's finaliser.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import weakref
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import numpy as np

SEGMENT_PREFIX = "oakemu_"
"""Prefix of every shared-memory segment this project creates (``/dev/shm/oakemu_*``)."""

_FIELD_PATTERN = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_SEGMENT_PATTERN = re.compile(rf"^{SEGMENT_PREFIX}(\d+)_([0-9a-f]+)_([A-Za-z0-9_]+)$")
_HAS_TRACK_PARAMETER = sys.version_info >= (3, 13)


def _open_segment(name: str | None, *, create: bool, size: int) -> shared_memory.SharedMemory:
    """Open or create a POSIX segment that the resource tracker does not own (see module doc)."""
    if _HAS_TRACK_PARAMETER:  # pragma: no cover - exercised on Python >= 3.13 only
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
    segment = shared_memory.SharedMemory(name=name, create=create, size=size)
    # Undo the automatic registration: we unlink ourselves, and an attaching process must not.
    resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
    return segment


def _unlink_segment_name(name: str) -> bool:
    """Remove segment ``name`` from the system; return False if it was already gone."""
    try:
        if _HAS_TRACK_PARAMETER:  # pragma: no cover - Python >= 3.13
            shared_memory.SharedMemory(name=name, track=False).unlink()
        else:
            # SharedMemory.unlink() would also send UNREGISTER for a name we already unregistered.
            shared_memory._posixshmem.shm_unlink("/" + name)  # type: ignore[attr-defined]  # noqa: SLF001
    except FileNotFoundError:
        return False
    return True


def _owner_finalizer(name: str, owner_pid: int) -> None:
    """Unlink ``name`` if called in the owning process (a forked child inherits the finaliser)."""
    if os.getpid() == owner_pid:
        _unlink_segment_name(name)


def new_token() -> str:
    """A random 12-hex-digit token for segment names."""
    return secrets.token_hex(6)


def pid_is_alive(pid: int) -> bool:
    """Return whether a process with id ``pid`` exists (in this pid namespace).

    Args:
        pid: process id, positive.

    Returns:
        True when the process exists, also when it belongs to another user.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def parse_segment_owner(name: str) -> int | None:
    """Return the owner pid encoded in an ``oakemu_<pid>_<token>_<field>`` name, else None."""
    match = _SEGMENT_PATTERN.match(name)
    return int(match.group(1)) if match else None


def sweep_stale_segments(shm_dir: str | os.PathLike[str] = "/dev/shm") -> list[str]:
    """Remove the ``oakemu_*`` segments whose owner process is no longer alive.

    A segment is stale when its name parses as ``oakemu_<pid>_<token>_<field>`` and no process
    ``<pid>`` exists. Names that do not parse, and segments of live processes, are left alone.
    Caveat: the check uses this process's pid namespace, so containers sharing one ``/dev/shm``
    (``ipc: shareable``) must also share the pid namespace, or not run the sweep.

    Args:
        shm_dir: directory where the system exposes POSIX shared memory (Linux: ``/dev/shm``).

    Returns:
        The names removed, sorted. Empty when ``shm_dir`` does not exist.
    """
    directory = Path(shm_dir)
    if not directory.is_dir():
        return []
    removed: list[str] = []
    for entry in directory.iterdir():
        owner = parse_segment_owner(entry.name)
        if owner is None or pid_is_alive(owner):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:  # another process swept it first
            continue
        removed.append(entry.name)
    return sorted(removed)


class SharedArray:
    """A numpy array stored in a named POSIX shared-memory segment.

    Build one with :meth:`create` (this process becomes the owner) or :meth:`attach` (by name, from
    any process). :attr:`array` is a writable view of the segment; writes are visible to every
    process attached to it. The mapping stays valid while any view of it is alive, even after
    :meth:`close`, so a stale view never points at unmapped memory.

    Ownership: only the creating process unlinks, on :meth:`unlink`, when the owner object is
    garbage-collected, or at interpreter exit. A ``fork``-ed child inherits the object but never
    unlinks it (the owner pid is checked).
    """

    def __init__(
        self,
        segment: shared_memory.SharedMemory,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        owner: bool,
    ) -> None:
        """Wrap an open segment; use :meth:`create` or :meth:`attach` instead of calling this."""
        self._segment: shared_memory.SharedMemory | None = segment
        self._name = segment.name
        self._shape = shape
        self._dtype = dtype
        self._owner = owner
        self._array: np.ndarray | None = np.ndarray(shape, dtype=dtype, buffer=segment.buf)
        self._finalizer: weakref.finalize | None = None
        if owner:
            self._finalizer = weakref.finalize(self, _owner_finalizer, self._name, os.getpid())

    @staticmethod
    def _normalise(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
        normalised_shape = tuple(int(dim) for dim in shape)
        if any(dim < 0 for dim in normalised_shape):
            raise ValueError(
                f"shape: expected non-negative dimensions, received {normalised_shape}"
            )
        normalised_dtype = np.dtype(dtype)
        if normalised_dtype.hasobject:
            raise ValueError(
                f"dtype: expected a fixed-size numpy dtype, received {normalised_dtype}"
            )
        return normalised_shape, normalised_dtype

    @classmethod
    def create(
        cls, shape: Sequence[int], dtype: Any, *, field: str, token: str | None = None
    ) -> SharedArray:
        """Create a zero-filled shared array owned by this process.

        The segment's pages are reserved up front (``posix_fallocate``) when the platform allows
        it, so a full ``/dev/shm`` fails here with an ``OSError`` (``ENOSPC``) instead of a
        ``SIGBUS`` on a later write.

        Args:
            shape: array shape; dimensions may be 0.
            dtype: any fixed-size numpy dtype.
            field: short name of the array (``[A-Za-z0-9_]``, 1-64 chars), the last part of the
                segment name ``oakemu_<pid>_<token>_<field>``.
            token: lowercase hex string shared by related arrays (e.g. the arrays of one rollout
                buffer); a fresh random one when None. The pair (token, field) must be new.

        Returns:
            The owner ``SharedArray``.

        Raises:
            ValueError: for a bad field name or token, a negative dimension or an object dtype.
            FileExistsError: when a segment with that name exists already.
            OSError: when the system cannot create or reserve the segment.
        """
        if not isinstance(field, str) or not _FIELD_PATTERN.match(field):
            raise ValueError(f"field: expected 1-64 characters of [A-Za-z0-9_], received {field!r}")
        if token is None:
            token = new_token()
        elif not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{1,32}", token):
            raise ValueError(f"token: expected 1-32 lowercase hex digits, received {token!r}")
        normalised_shape, normalised_dtype = cls._normalise(shape, dtype)
        nbytes = int(np.prod(normalised_shape, dtype=np.int64)) * normalised_dtype.itemsize
        size = max(nbytes, 1)  # the system refuses zero-size segments
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{token}_{field}"
        segment = _open_segment(name, create=True, size=size)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(segment._fd, 0, size)  # noqa: SLF001
        except OSError:
            segment.close()
            _unlink_segment_name(segment.name)
            raise
        return cls(segment, normalised_shape, normalised_dtype, owner=True)

    @classmethod
    def attach(cls, name: str, shape: Sequence[int], dtype: Any) -> SharedArray:
        """Attach to an existing segment by name (non-owner: never unlinks).

        Args:
            name: segment name as returned by :attr:`name` of the owner.
            shape: the owner's shape.
            dtype: the owner's dtype.

        Returns:
            A non-owner ``SharedArray`` sharing the owner's memory.

        Raises:
            FileNotFoundError: when no segment has that name (the owner unlinked it or died).
            ValueError: when the segment is smaller than ``shape`` x ``dtype`` needs.
        """
        normalised_shape, normalised_dtype = cls._normalise(shape, dtype)
        nbytes = int(np.prod(normalised_shape, dtype=np.int64)) * normalised_dtype.itemsize
        segment = _open_segment(name, create=False, size=0)
        if segment.size < nbytes:
            size = segment.size
            segment.close()
            raise ValueError(
                f"segment {name}: expected at least {nbytes} bytes for shape {normalised_shape} "
                f"{normalised_dtype}, received a segment of {size} bytes"
            )
        return cls(segment, normalised_shape, normalised_dtype, owner=False)

    @property
    def array(self) -> np.ndarray:
        """Writable view of the segment with this array's shape and dtype.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._array is None:
            raise RuntimeError(f"shared array {self._name} is closed")
        return self._array

    @property
    def name(self) -> str:
        """Segment name (``oakemu_<owner pid>_<token>_<field>``), what :meth:`attach` takes."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """Array shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """Array dtype."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the array (the segment may be one byte larger for an empty array)."""
        return int(np.prod(self._shape, dtype=np.int64)) * self._dtype.itemsize

    @property
    def is_owner(self) -> bool:
        """True in the creating process's object, which alone unlinks the segment."""
        return self._owner

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._segment is None

    def close(self) -> None:
        """Drop this object's mapping. Idempotent; does not unlink (see :meth:`unlink`).

        Views handed out earlier stay valid: the memory is unmapped once the last one is freed.
        """
        segment = self._segment
        if segment is None:
            return
        self._segment = None
        self._array = None
        # SharedMemory.close() would unmap the memory even while numpy views of it exist (numpy
        # keeps a reference to the memoryview but no buffer export, so nothing stops the unmap)
        # and a later read through such a view crashes the process. Instead, drop the segment's
        # own references: the memoryview that every view of the array is based on keeps the mmap
        # alive, and the mapping is released when the last view is garbage-collected (at once
        # when there is none).
        fd = segment._fd  # noqa: SLF001
        segment._buf = None  # noqa: SLF001
        segment._mmap = None  # noqa: SLF001
        if fd >= 0:
            os.close(fd)
            segment._fd = -1  # noqa: SLF001

    def unlink(self) -> None:
        """Remove the segment's name from the system (owner only). Idempotent.

        Processes already attached keep their mapping; new :meth:`attach` calls fail.

        Raises:
            RuntimeError: when called on a non-owner (attached) array.
        """
        if not self._owner:
            raise RuntimeError(
                f"shared array {self._name}: only the creating process may unlink it"
            )
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()  # unlinks (owner pid check included) and disarms the finaliser

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        state = "closed" if self.closed else "open"
        return f"SharedArray({self._name!r}, shape={self._shape}, dtype={self._dtype}, {role}, {state})"
