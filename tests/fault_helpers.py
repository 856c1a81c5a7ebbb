"""Helpers for disk-full tests: a small real tmpfs (when this process may mount one) and a filler.

The fixture ``small_tmpfs`` (registered for every test in ``tests/conftest.py``): a folder on a fresh
2 MiB tmpfs, unmounted (and removed) on teardown, also when the test failed. Tests that need it are skipped where ``mount -t tmpfs`` is not allowed (not root, no
CAP_SYS_ADMIN).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

TMPFS_BYTES = 2 * 1024 * 1024


def mount_tmpfs(path: Path, size_bytes: int = TMPFS_BYTES) -> bool:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (created); False when mounting is not allowed here."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode == 0


def unmount(path: Path) -> None:
    """Unmount ``path`` (lazily if busy: a process of the test may still hold a file there)."""
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill_disk(folder: Path, name: str = "filler", leave_bytes: int = 0) -> Path:
    """Write a file in ``folder`` until its file system is full (``ENOSPC``), then give back ``leave_bytes``.

    Returns the filler file (delete it to free the space again).
    """
    filler = folder / name
    block = b"\0" * 65536
    with open(filler, "ab", buffering=0) as f:
        for size in (65536, 4096, 256, 16, 1):
            try:
                while True:
                    f.write(block[:size])
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
    if leave_bytes:
        os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


@pytest.fixture(name="small_tmpfs")
def small_tmpfs_fixture(tmp_path: Path) -> Iterator[Path]:
    """A folder on a fresh 2 MiB tmpfs (skips the test where mounting is not allowed); unmounted on teardown."""
    mount_point = tmp_path / "tmpfs"
    if not mount_tmpfs(mount_point):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        yield mount_point
    finally:
        unmount(mount_point)
