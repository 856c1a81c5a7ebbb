"""Tests for oakemu_core.storage.memory on fake /proc and cgroup trees and the real machine, and the
step rings' share of /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oakemu_core.storage.memory import (
    STEP_RING_SHM_SHARE,
    RolloutBufferMemoryDiagnostic,
    SharedMemoryTooSmallError,
    ensure_shm_capacity,
    host_available_bytes,
    make_diagnostic,
    shm_free_bytes,
    shm_total_bytes,
    step_ring_budget,
)

GIB = 1024**3


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def host_bytes(tmp_path: Path, *, meminfo_kb: int, proc_cgroup: str, files: dict[str, str]) -> int:
    write_files(
        tmp_path,
        {
            "meminfo": f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n",
            "self_cgroup": proc_cgroup,
            **files,
        },
    )
    return host_available_bytes(
        meminfo_path=tmp_path / "meminfo",
        cgroup_root=tmp_path / "cg",
        proc_self_cgroup=tmp_path / "self_cgroup",
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
    assert (
        host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup="0::/a/b\n", files=files)
        == 500_000
    )
    files["cg/a/memory.max"] = "700000\n"  # a tighter parent: 700_000 - 650_000 = 50_000
    files["cg/a/memory.current"] = "650000\n"
    assert (
        host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup="0::/a/b\n", files=files)
        == 50_000
    )


def test_meminfo_wins_when_smaller_than_the_cgroup(tmp_path: Path) -> None:
    files = {
        "cg/cgroup.controllers": "memory\n",
        "cg/memory.max": str(8 * GIB),
        "cg/memory.current": "0",
    }
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
    assert (
        host_bytes(tmp_path, meminfo_kb=8 * 1024 * 1024, proc_cgroup=proc_cgroup, files=files)
        == 1_500_000
    )


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


# --- the step rings' share of /dev/shm -----------------------------------------------------------------

MIB = 2**20


def fake_mount(monkeypatch: pytest.MonkeyPatch, size_bytes: int) -> None:
    """``os.statvfs`` reports a file system of ``size_bytes`` (4 KiB blocks) everywhere."""
    stats = os.statvfs("/")
    fields = dict(f_blocks=size_bytes // 4096, f_frsize=4096, f_bavail=size_bytes // 4096)
    monkeypatch.setattr(
        os,
        "statvfs",
        lambda path: type(
            "Stats",
            (),
            {**{n: getattr(stats, n) for n in dir(stats) if n.startswith("f_")}, **fields},
        )(),
    )


def test_the_mount_size_is_statvfs_blocks_times_fragment_size() -> None:
    stats = os.statvfs("/dev/shm")
    assert shm_total_bytes("/dev/shm") == stats.f_blocks * stats.f_frsize > 0


def test_the_step_rings_default_to_a_quarter_of_dev_shm_and_never_take_the_rollout_buffers_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Docker's shm_size 256 MiB with 110 MiB of rollout buffers (Atari defaults): the rings get 64 MiB (a
    quarter of the mount), at most the room the buffers leave; an explicit setting is honoured where it
    fits and lowered, with a note naming the setting and both sizes, where it does not."""
    fake_mount(monkeypatch, 256 * MIB)
    assert step_ring_budget(None, reserved_bytes=110 * MIB) == (
        int(256 * MIB * STEP_RING_SHM_SHARE),
        "",
    )
    assert step_ring_budget(None, reserved_bytes=220 * MIB) == (36 * MIB, ""), (
        "at most the room left"
    )
    assert step_ring_budget(100.0, reserved_bytes=110 * MIB) == (100 * MIB, "")
    budget, note = step_ring_budget(1024.0, reserved_bytes=110 * MIB)
    assert budget == 146 * MIB
    assert note.startswith(
        "step_ring_max_mib=1024 is more than /dev/shm holds beside the rollout buffers "
        "(146.0 MiB of its 256.0 MiB)"
    )
    assert step_ring_budget(None, reserved_bytes=300 * MIB) == (0, "")


def test_without_a_shared_memory_mount_the_setting_stands_or_no_ring_is_made(
    tmp_path: Path,
) -> None:
    assert step_ring_budget(8.0, reserved_bytes=0, path=tmp_path / "absent") == (8 * MIB, "")
    assert step_ring_budget(None, reserved_bytes=0, path=tmp_path / "absent") == (0, "")


def test_the_learner_caps_its_step_rings_by_the_mount(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """300 local joins of 1,024 CartPole envs in a 256 MiB /dev/shm: the learner's rings stop at a quarter
    of it (the rest of those actors send inline)."""
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.learner_setup import make_step_rings
    from oakemu_core.transport.step_ring import StepRingRefused
    from oakemu_core.transport.steps import StepSpec

    fake_mount(monkeypatch, 256 * MIB)
    rings = make_step_rings(OakEmuConfig(env_id="CartPole-v1"), reserved_bytes=10 * MIB)
    monkeypatch.undo()  # the rings are real segments in the real /dev/shm
    spec = StepSpec(
        num_envs=1024, schema=schema_for_env(env_spec("CartPole-v1")), steps_per_message=1
    )
    try:
        assert rings.max_bytes == 64 * MIB
        made = 0
        with pytest.raises(StepRingRefused, match="step_ring_max_mib"):
            for made in range(300):
                rings.offer(f"a{made}", "i", spec, 128)
        assert 0 < made < 300 and rings.used_bytes <= 64 * MIB
    finally:
        rings.close()
    with caplog.at_level("WARNING", logger="oakemu.learner"):
        fake_mount(monkeypatch, 256 * MIB)
        make_step_rings(
            OakEmuConfig(env_id="CartPole-v1", step_ring_max_mib=1024), reserved_bytes=10 * MIB
        ).close()
    assert any(
        "step_ring_max_mib=1024 is more than /dev/shm" in r.getMessage() for r in caplog.records
    )
