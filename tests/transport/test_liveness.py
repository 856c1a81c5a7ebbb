"""The learner notices at once when a local actor's process exits or is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oakemu_core.transport.liveness import LocalProcesses, process_identity, read_stat


def fake_proc(tmp_path: Path, pid: int, state: str, started: int) -> Path:
    """A /proc with ns/pid and one process whose command holds spaces and parentheses."""
    (tmp_path / "self" / "ns").mkdir(parents=True, exist_ok=True)
    link = tmp_path / "self" / "ns" / "pid"
    if not link.is_symlink():
        link.symlink_to("pid:[4026531836]")
    folder = tmp_path / str(pid)
    folder.mkdir(exist_ok=True)
    rest = " ".join(["0"] * 18)  # fields 4..21
    (folder / "stat").write_text(f"{pid} (oakemu actor (x)) {state} {rest} {started} 0 0\n")
    return tmp_path


def test_read_stat_takes_state_and_start_time_after_the_command(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, "S", 12345)
    assert read_stat(42, proc) == ("S", 12345)
    assert read_stat(43, proc) is None
    state, started = read_stat(os.getpid())  # the real /proc: this process runs
    assert state in "RS" and started > 0


def test_exited_reused_and_stopped_processes_are_reported_once(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 7, "S", 100)
    fake_proc(tmp_path, 8, "R", 200)
    fake_proc(tmp_path, 9, "S", 300)
    processes = LocalProcesses(proc)
    assert processes.watch("a", "i1", 7, "pid:[4026531836]")
    assert processes.watch("b", "i2", 8, "pid:[4026531836]")
    assert processes.watch("c", "i3", 9, "pid:[4026531836]")
    assert not processes.watch("d", "i4", 7, "pid:[999]"), (
        "another PID namespace: pids mean other processes"
    )
    assert not processes.watch("e", "i5", 11, "pid:[4026531836]"), "no such process"
    assert processes.gone() == []
    (proc / "7" / "stat").unlink()  # exited
    fake_proc(tmp_path, 8, "R", 999)  # pid reused by a newer process
    fake_proc(tmp_path, 9, "T", 300)  # SIGSTOP
    assert sorted(processes.gone()) == [
        ("a", "i1", "exited"),
        ("b", "i2", "exited"),
        ("c", "i3", "stopped"),
    ]
    assert processes.gone() == []


def test_a_real_child_is_seen_running_stopped_and_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        processes = LocalProcesses()
        pid, namespace = process_identity()
        assert processes.watch("a", "i", child.pid, namespace)
        assert processes.gone() == []
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not (found := processes.gone()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert found == [("a", "i", "stopped")]
        assert processes.watch("a", "i2", child.pid, namespace)
        child.kill()
        child.wait(5)
        assert processes.gone() == [("a", "i2", "exited")]
    finally:
        child.kill()
        child.wait(5)
