"""Tests for oakemu_core.shared_memory: sharing, ownership, cleanup and the stale-segment sweep."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oakemu_core.shared_memory import (
    SEGMENT_PREFIX,
    SharedArray,
    parse_segment_owner,
    pid_is_alive,
    sweep_stale_segments,
)
from tests.conftest import REPO_ROOT, SHM_DIR

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs Linux /dev/shm")


def segment_exists(name: str) -> bool:
    return (SHM_DIR / name).exists()


def test_create_gives_zeroed_array_with_recognisable_name() -> None:
    shared = SharedArray.create((3, 4), np.uint8, field="observations")
    try:
        assert shared.array.shape == (3, 4)
        assert shared.array.dtype == np.uint8
        assert not shared.array.any()
        assert shared.name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")
        assert shared.name.endswith("_observations")
        assert parse_segment_owner(shared.name) == os.getpid()
        assert shared.is_owner
        assert shared.nbytes == 12
        assert segment_exists(shared.name)
    finally:
        shared.unlink()
        shared.close()
    assert not segment_exists(shared.name)
    assert shared.closed
    with pytest.raises(RuntimeError, match="closed"):
        _ = shared.array


def test_attach_in_same_process_shares_memory_both_ways() -> None:
    owner = SharedArray.create((2, 3), np.float32, field="values")
    try:
        other = SharedArray.attach(owner.name, (2, 3), np.float32)
        other.array[1, 2] = 4.5
        owner.array[0, 0] = -1.0
        assert owner.array[1, 2] == np.float32(4.5)
        assert other.array[0, 0] == np.float32(-1.0)
        assert not other.is_owner
        other.close()
        assert segment_exists(owner.name), "closing an attached array must not unlink"
    finally:
        owner.unlink()
        owner.close()


def test_non_owner_cannot_unlink() -> None:
    owner = SharedArray.create((1,), np.int64, field="steps")
    try:
        other = SharedArray.attach(owner.name, (1,), np.int64)
        with pytest.raises(RuntimeError, match="only the creating process"):
            other.unlink()
        other.close()
        assert segment_exists(owner.name)
    finally:
        owner.unlink()
        owner.close()


def test_attach_to_unlinked_segment_fails() -> None:
    owner = SharedArray.create((4,), np.int64, field="gone")
    owner.unlink()
    owner.close()
    with pytest.raises(FileNotFoundError):
        SharedArray.attach(owner.name, (4,), np.int64)


def test_attach_with_larger_shape_is_rejected() -> None:
    owner = SharedArray.create((4,), np.uint8, field="small")
    try:
        with pytest.raises(ValueError, match="expected at least 400 bytes"):
            SharedArray.attach(owner.name, (100,), np.float32)
    finally:
        owner.unlink()
        owner.close()


@pytest.mark.parametrize(
    ("shape", "field", "message"),
    [
        ((2,), "bad-name", "field"),
        ((2,), "", "field"),
        ((2,), "x/y", "field"),
        ((-1, 2), "ok", "shape"),
    ],
)
def test_invalid_arguments_are_rejected(shape: tuple[int, ...], field: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SharedArray.create(shape, np.float32, field=field)


def test_zero_size_array_is_supported() -> None:
    shared = SharedArray.create((0, 5), np.float32, field="empty")
    try:
        assert shared.array.shape == (0, 5)
        assert shared.nbytes == 0
    finally:
        shared.unlink()
        shared.close()


def test_unlink_is_idempotent() -> None:
    shared = SharedArray.create((2,), np.float32, field="twice")
    shared.unlink()
    shared.unlink()
    shared.close()
    shared.close()
    assert not segment_exists(shared.name)


def test_garbage_collected_owner_unlinks() -> None:
    shared = SharedArray.create((2,), np.float32, field="collected")
    name = shared.name
    del shared
    gc.collect()
    assert not segment_exists(name)


def test_child_process_writes_are_seen_and_its_exit_does_not_unlink(run_python) -> None:
    """An attaching process writes in place; its exit leaves the owner's segment alone (bpo-38119)."""
    owner = SharedArray.create((3,), np.int64, field="from_child")
    try:
        result = run_python(
            """
            import sys
            import numpy as np
            from oakemu_core.shared_memory import SharedArray
            attached = SharedArray.attach(sys.argv[1], (3,), np.int64)
            attached.array[:] = [7, 8, 9]
            attached.close()
            """,
            owner.name,
        )
        assert result.returncode == 0, result.stderr
        np.testing.assert_array_equal(owner.array, [7, 8, 9])
        assert segment_exists(owner.name)
        assert "leaked" not in result.stderr
    finally:
        owner.unlink()
        owner.close()


def test_views_survive_close_without_crashing(run_python) -> None:
    """Reading a view after close() must not touch unmapped memory (run in a child: a crash is SIGSEGV)."""
    result = run_python(
        """
        import gc
        import numpy as np
        from oakemu_core.shared_memory import SharedArray
        owner = SharedArray.create((4,), np.int64, field="view")
        attached = SharedArray.attach(owner.name, (4,), np.int64)
        view = attached.array[1:]
        owner_view = owner.array
        attached.close()
        owner.unlink()
        owner.close()
        gc.collect()
        view[0] = 5
        print(int(view[0]) + int(owner_view[1]))
        """
    )
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.strip() == "10"


def test_owner_unlinks_at_interpreter_exit(run_python) -> None:
    result = run_python(
        """
        import numpy as np
        from oakemu_core.shared_memory import SharedArray
        kept = SharedArray.create((8,), np.float32, field="at_exit")
        print(kept.name)
        """
    )
    assert result.returncode == 0, result.stderr
    name = result.stdout.strip()
    assert name.startswith(SEGMENT_PREFIX)
    assert not segment_exists(name)


def test_forked_child_exit_does_not_unlink_the_parents_segment(run_python) -> None:
    result = run_python(
        """
        import os
        import numpy as np
        from oakemu_core.shared_memory import SharedArray
        kept = SharedArray.create((8,), np.float32, field="forked")
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)  # normal exit: runs the inherited atexit finalisers
        os.waitpid(pid, 0)
        print(os.path.exists("/dev/shm/" + kept.name))
        kept.unlink()
        print(os.path.exists("/dev/shm/" + kept.name))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_sweep_removes_segments_of_a_killed_owner() -> None:
    code = (
        "import sys, time, numpy as np\n"
        "from oakemu_core.shared_memory import SharedArray\n"
        "kept = SharedArray.create((16,), np.uint8, field='killed')\n"
        "print(kept.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    name = ""
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith(f"{SEGMENT_PREFIX}{child.pid}_")
        live = SharedArray.create((2,), np.uint8, field="live")
        try:
            assert name not in sweep_stale_segments(), "a live owner's segment must be kept"
            assert segment_exists(name)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            assert segment_exists(name), "SIGKILL skips every cleanup"
            removed = sweep_stale_segments()
            assert name in removed
            assert not segment_exists(name)
            assert live.name not in removed
            assert segment_exists(live.name)
        finally:
            live.unlink()
            live.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
        if name:
            (SHM_DIR / name).unlink(missing_ok=True)


def test_sweep_only_touches_parsable_names_of_dead_owners(tmp_path: Path, dead_pid: int) -> None:
    stale = f"{SEGMENT_PREFIX}{dead_pid}_abc123_observations"
    alive = f"{SEGMENT_PREFIX}{os.getpid()}_abc123_observations"
    unrelated = ["oakemu_notapid_abc_x", "other_123_abc_x", f"{SEGMENT_PREFIX}{dead_pid}"]
    for name in [stale, alive, *unrelated]:
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale_segments(tmp_path) == [stale]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([alive, *unrelated])
    assert sweep_stale_segments(tmp_path / "missing") == []


def test_pid_is_alive(dead_pid: int) -> None:
    assert pid_is_alive(os.getpid())
    assert not pid_is_alive(dead_pid)
    assert not pid_is_alive(0)
    assert not pid_is_alive(2**62)
