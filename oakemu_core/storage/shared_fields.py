"""Named numpy arrays in POSIX shared memory, allocated together from one layout, with one owner.

:class:`SharedFields` makes one :class:`~oakemu_core.shared_memory.SharedArray` per entry of a
layout ``{name: (shape, dtype)}`` (one description instantiates the storage, as Sample Factory's
``alloc_trajectory_tensors`` does), under one token, so the segments of one set are named
``oakemu_<pid>_<token>_<name>``. The set owns them: it alone unlinks them (:meth:`close`, garbage
collection, interpreter exit); construction first sweeps segments of dead owners and checks that
the shared-memory file system has room, so a full ``/dev/shm`` is an error, not a ``SIGBUS``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from oakemu_core.shared_memory import SharedArray, new_token, sweep_stale_segments
from oakemu_core.storage.memory import ensure_shm_capacity

__all__ = ["SHM_DIR", "SharedFields", "layout_bytes"]

SHM_DIR = Path("/dev/shm")

Layout = Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]
"""Array name -> (shape, dtype)."""


def layout_bytes(layout: Layout) -> int:
    """Bytes the arrays of ``layout`` take: the sum of their ``nbytes``."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout.values())


class SharedFields:
    """Named shared-memory arrays owned by this object: writable arrays for the owner's writes and
    read-only views of the same memory for readers.

    Args:
        layout: array name -> ``(shape, dtype)``; names may hold dots (``observations.image``).
        shm_dir: the POSIX shared-memory directory; swept and checked for capacity when it exists.

    Attributes:
        arrays: name -> writable array (empty after :meth:`close`).
        views: name -> read-only view of that array (empty after :meth:`close`).

    Raises:
        SharedMemoryTooSmallError: ``shm_dir`` has less free space than the arrays need (nothing
            is allocated then).
    """

    def __init__(self, layout: Layout, shm_dir: str | os.PathLike[str] = SHM_DIR) -> None:
        if Path(shm_dir).is_dir():
            sweep_stale_segments(shm_dir)
            ensure_shm_capacity(layout_bytes(layout), shm_dir)
        shared: dict[str, SharedArray] = {}
        token = new_token()  # one token per set: its segments are oakemu_<pid>_<token>_<name>
        try:
            for name, (shape, dtype) in layout.items():
                shared[name] = SharedArray.create(
                    shape, dtype, field=name.replace(".", "__"), token=token
                )
        except BaseException:
            for array in shared.values():
                array.unlink()
                array.close()
            raise
        self._shared = shared
        self._shm_dir = Path(shm_dir)
        self.arrays: dict[str, np.ndarray] = {name: array.array for name, array in shared.items()}
        self.views: dict[str, np.ndarray] = {}
        for name, array in self.arrays.items():
            view = array.view()
            view.flags.writeable = False
            self.views[name] = view

    @property
    def nbytes(self) -> int:
        """Bytes of all the arrays."""
        return sum(array.nbytes for array in self._shared.values())

    def resident_bytes(self) -> int:
        """Bytes of the segments already backed by memory (pages touched), counted from ``shm_dir``."""
        resident = 0
        for array in self._shared.values():
            try:
                resident += os.stat(self._shm_dir / array.name).st_blocks * 512
            except OSError:
                continue
        return resident

    def close(self) -> None:
        """Drop the arrays and unlink the segments (idempotent). Arrays and views handed out before
        stay readable: the memory is unmapped when the last of them is freed."""
        self.arrays = {}
        self.views = {}
        for array in self._shared.values():
            if array.is_owner:
                array.unlink()
            array.close()

    def __getstate__(self) -> None:
        raise TypeError("SharedFields cannot be pickled: they own shared-memory segments")
