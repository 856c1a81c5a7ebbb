"""Shared fixtures: shared-memory leak check, helpers to run Python in a child process, and the
end-to-end fixtures ``e2e`` (``tests/e2e_helpers.py``) and ``small_tmpfs`` (``tests/fault_helpers.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

from oakemu_core.shared_memory import SEGMENT_PREFIX
from tests.e2e_helpers import REPO_ROOT, SHM_DIR, e2e_fixture  # noqa: F401 - the `e2e` fixture
from tests.fault_helpers import small_tmpfs_fixture  # noqa: F401 - the `small_tmpfs` fixture


def own_segments() -> set[str]:
    """Names of the ``/dev/shm/oakemu_<this pid>_*`` segments that exist now."""
    if not SHM_DIR.is_dir():
        return set()
    return {path.name for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}_*")}


@pytest.fixture
def no_oakemu_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``OAKEMU_*`` environment variable of the shell reaches the test's configurations."""
    for name in list(os.environ):
        if name.startswith("OAKEMU_"):
            monkeypatch.delenv(name)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "allow_shm_leak: the test may leave oakemu_ shared-memory segments for a later test "
        "(they are still removed at the end of the session)",
    )


@pytest.fixture(autouse=True)
def no_leaked_shared_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a shared-memory segment of this process behind, and remove it.

    Autouse and function-scoped, so it is torn down after the test's own fixtures: a buffer a
    fixture closes on teardown is not reported.
    """
    before = own_segments()
    yield
    left = sorted(own_segments() - before)
    if not left:
        return
    for name in left:
        (SHM_DIR / name).unlink(missing_ok=True)
    if request.node.get_closest_marker("allow_shm_leak") is None:
        pytest.fail(f"the test left shared-memory segments behind (now removed): {left}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for name in own_segments():
        (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a Python snippet in a fresh interpreter (repo root on ``sys.path``) and wait for it.

    Call as ``run_python(code, *args, timeout=60)``; returns the ``CompletedProcess`` with text
    stdout/stderr. The child is killed if it outlives ``timeout`` seconds.
    """

    def run(code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    return run


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has already exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid
