"""Tests for oakemu_core.storage.memory on fake /proc and cgroup trees and the real machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oakemu_core.storage.memory import (
    RolloutBufferMemoryDiagnostic,
    SharedMemoryTooSmallError,
    ensure_shm_capacity,
    host_available_bytes,
    make_diagnostic,
    shm_free_bytes,
)

GIB = 1024**3


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def host_bytes(tmp_path: Path, *, meminfo_kb: int, proc_cgroup: str, files: dict[str, str]) -> int:
    write_files(tmp_path, {"meminfo": f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n", "self_cgroup": proc_cgroup, **files})
    return host_available_bytes(
        meminfo_path=tmp_path / "meminfo", cgroup_root=tmp_path / "cg", proc_self_cgroup=tmp_path / "self_cgroup"
    )


def test_meminfo_alone(tmp_path: Path) -> None:
    assert host_bytes(tmp_path, meminfo_kb=2048, proc_cgroup="0::/\n", files={}) == 2048 * 1024


def test_cgroup_v2_limit_minus_working_set_across_ancestors(tmp_path: Path) -> None:
    files = {
        "cg/cgroup.controllers": "memory\n",
        "cg/a/b/memory.max": "1000000\n",
        "cg/a/b/memory.current": "600000\n",
        "cg/a/b/memory.stat": "anon 400000\ninactive_file 100000\nactive_file 5\n",
        "cg/a/memory.max": "max\n",
        "cg/a/memory.current": "900000\n",
    }
    # own cgroup: 1_000_000 - (600_000 - 100_000) = 500_000; the parent has no limit
    assert host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup="0::/a/b\n", files=files) == 500_000
    files["cg/a/memory.max"] = "700000\n"  # a tighter parent: 700_000 - 650_000 = 50_000
    files["cg/a/memory.current"] = "650000\n"
    assert host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup="0::/a/b\n", files=files) == 50_000


def test_meminfo_wins_when_smaller_than_the_cgroup(tmp_path: Path) -> None:
    files = {"cg/cgroup.controllers": "memory\n", "cg/memory.max": str(8 * GIB), "cg/memory.current": "0"}
    assert host_bytes(tmp_path, meminfo_kb=1000, proc_cgroup="0::/\n", files=files) == 1000 * 1024


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path: Path) -> None:
    files = {
        "cg/memory/x/y/memory.limit_in_bytes": "2000000\n",
        "cg/memory/x/y/memory.usage_in_bytes": "800000\n",
        "cg/memory/x/y/memory.stat": "cache 5\ntotal_inactive_file 300000\n",
        "cg/memory/x/memory.limit_in_bytes": "9223372036854771712\n",
        "cg/memory/x/memory.usage_in_bytes": "1\n",
    }
    proc_cgroup = "4:memory:/x/y\n3:cpu,cpuacct:/\n0::/\n"
    # 2_000_000 - (800_000 - 300_000) = 1_500_000
    assert host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup=proc_cgroup, files=files) == 1_500_000


def test_over_the_limit_gives_zero(tmp_path: Path) -> None:
    files = {"cg/cgroup.controllers": "", "cg/memory.max": "100", "cg/memory.current": "500"}
    assert host_bytes(tmp_path, meminfo_kb=1000, proc_cgroup="0::/\n", files=files) == 0


def test_real_machine_figures_are_positive() -> None:
    assert host_available_bytes() > 0
    if Path("/dev/shm").is_dir():
        assert shm_free_bytes() > 0


def test_shm_free_bytes_is_statvfs(tmp_path: Path) -> None:
    stats = os.statvfs(tmp_path)
    assert shm_free_bytes(tmp_path) == pytest.approx(stats.f_bavail * stats.f_frsize, rel=0.01)
    with pytest.raises(OSError):
        shm_free_bytes(tmp_path / "missing")


def test_ensure_shm_capacity(tmp_path: Path) -> None:
    ensure_shm_capacity(1, tmp_path)
    available = shm_free_bytes(tmp_path)
    required = available * 4 + 12345
    with pytest.raises(SharedMemoryTooSmallError) as raised:
        ensure_shm_capacity(required, tmp_path)
    message = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert f"need {required} bytes" in message
    assert "shm_size" in message and "docker compose" in message
    assert " bytes (" in message.split("only ")[1], "the available figure is given in bytes"


def test_make_diagnostic() -> None:
    fits = make_diagnostic("shm", 10, 10, "rollout arrays")
    assert fits == RolloutBufferMemoryDiagnostic("shm", 10, 10, True, fits.message)
    assert "fits" in fits.message and "10 bytes" in fits.message
    too_big = make_diagnostic("cpu", 11, 10, "rollout arrays")
    assert not too_big.ok and "DOES NOT FIT" in too_big.message
