"""Files replaced whole: a reader sees the old file or the whole new one, never a part; a full disk is
one :class:`~oakemu_core.errors.DiskFullError` that names the path, the bytes needed and the bytes free.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from oakemu_core.errors import DiskFullError

__all__ = ["disk_full_error", "replace_atomically", "write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file in the same folder, fsync,
    rename; a reader sees the old file or the whole new one, never a part.

    Raises:
        DiskFullError: no space (or quota) left; the message names the path, the bytes needed and free.
        OSError: any other write error. The temporary file is removed in both cases.
    """
    replace_atomically(Path(path), [text.encode("utf-8")])


def replace_atomically(path: Path, chunks: list[bytes]) -> None:
    """Replace ``path`` with ``chunks`` through a fsynced temporary file and a rename (see
    :func:`write_text_atomic`).

    Raises:
        DiskFullError: no space (or quota) left. OSError: any other write error.
    """
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise disk_full_error(error, path, sum(map(len, chunks))) from None
    try:
        with os.fdopen(fd, "wb") as target:
            target.writelines(chunks)
            target.flush()
            os.fsync(target.fileno())
        os.replace(tmp_name, path)
    except OSError as error:
        Path(tmp_name).unlink(missing_ok=True)
        raise disk_full_error(error, path, sum(map(len, chunks))) from None
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def disk_full_error(error: OSError, path: Path, needed: int) -> OSError:
    """:class:`DiskFullError` naming ``path``, ``needed`` bytes and the free bytes for ENOSPC / EDQUOT;
    ``error`` itself otherwise."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    existing = next((folder for folder in path.parents if folder.exists()), Path("."))
    try:
        free = f"{shutil.disk_usage(existing).free} bytes free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(
        f"cannot write {path}: {error.strerror or error} ({needed} bytes needed, {free} on "
        f"{path.parent})"
    )
