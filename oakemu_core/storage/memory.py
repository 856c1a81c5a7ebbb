"""Host, ``/dev/shm`` and CUDA memory figures, the shared-memory capacity check, the share of
``/dev/shm`` the learner's step rings may take, and the memory a rollout buffer and one PPO update are
projected to need.

All sizes are in bytes. The host figure respects container limits: it is the smaller of the
kernel's ``MemAvailable`` and the headroom (limit minus usage, reclaimable page cache excluded) of
every memory cgroup above this process, cgroup v2 or v1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from oakemu_core.errors import UserError

if TYPE_CHECKING:
    from oakemu_core.step_schema import StepSchema

_CGROUP_V1_NO_LIMIT = 1 << 62  # v1 reports "no limit" as a huge page-aligned number near 2**63

STEP_RING_SHM_SHARE = 0.25
"""Share of the ``/dev/shm`` mount's size the learner's step rings take at most by default
(``step_ring_max_mib`` unset): Docker's ``shm_size`` 256 MiB gives them 64 MiB."""


@dataclass(frozen=True)
class RolloutBufferMemoryDiagnostic:
    """One projected memory requirement and whether it fits.

    Attributes:
        resource: ``"cpu"`` (host memory), ``"shm"`` (``/dev/shm``) or ``"cuda:<index>"``.
        required_bytes: bytes the rollout buffer and one minibatch pass need on that resource.
        available_bytes: bytes available for them there.
        ok: ``required_bytes <= available_bytes``.
        message: one human-readable line with both figures.
    """

    resource: str
    required_bytes: int
    available_bytes: int
    ok: bool
    message: str


class SharedMemoryTooSmallError(UserError, ValueError):
    """``/dev/shm`` has less free space than the rollout buffers need. Exit status 1, as
    :class:`~oakemu_core.errors.DiskFullError`: the settings may be right, the machine needs room."""

    exit_status = 1


def format_bytes(num_bytes: int) -> str:
    """Format a byte count with a binary unit, e.g. ``"231.2 MiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024.0
    raise AssertionError("unreachable")  # pragma: no cover


def _read_int(path: Path) -> int | None:
    """Read a single integer from a cgroup/proc file; None when absent, ``max`` or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path, key: str) -> int:
    """Read ``key value`` from a cgroup ``memory.stat`` file; 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo_available(meminfo_path: Path) -> int | None:
    try:
        for line in meminfo_path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file reports kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_paths(proc_self_cgroup: Path) -> tuple[str | None, str | None]:
    """Return (v2 path, v1 memory-controller path) of this process's cgroup, as in the file."""
    v2_path = v1_path = None
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    return v2_path, v1_path


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root/a/b``, ``root/a``, ``root``: a cgroup and every cgroup above it."""
    parts = [part for part in cgroup_path.split("/") if part]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _cgroup_headroom(
    directories: list[Path], *, limit_file: str, usage_file: str, inactive_key: str
) -> int | None:
    """Smallest ``limit - (usage - inactive_file)`` over the cgroups that have a limit."""
    headroom: int | None = None
    for directory in directories:
        limit = _read_int(directory / limit_file)
        usage = _read_int(directory / usage_file)
        if limit is None or usage is None or limit >= _CGROUP_V1_NO_LIMIT:
            continue
        working_set = max(usage - _read_stat(directory / "memory.stat", inactive_key), 0)
        room = max(limit - working_set, 0)
        headroom = room if headroom is None else min(headroom, room)
    return headroom


def host_available_bytes(
    *,
    meminfo_path: str | os.PathLike[str] = "/proc/meminfo",
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> int:
    """Return the host memory this process can still use, in bytes.

    The minimum of ``MemAvailable`` (``/proc/meminfo``) and, for each memory cgroup from this
    process's own up to the root, ``limit - (usage - inactive_file)``: cgroup v2 ``memory.max`` /
    ``memory.current`` (under ``cgroup_root``, or ``cgroup_root/unified`` on hybrid systems),
    cgroup v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` (under
    ``cgroup_root/memory``). Inactive file cache is subtracted from usage because the kernel
    reclaims it before an out-of-memory kill (the same working-set rule ``docker stats`` uses).

    Args:
        meminfo_path: path of ``/proc/meminfo`` (a parameter for tests).
        cgroup_root: mount point of the cgroup file systems.
        proc_self_cgroup: path of ``/proc/self/cgroup``.

    Returns:
        Available bytes; when no source is readable (not Linux), ``sysconf`` free physical pages,
        or 0 when even that is unavailable.
    """
    root = Path(cgroup_root)
    candidates: list[int] = []
    available = _meminfo_available(Path(meminfo_path))
    if available is not None:
        candidates.append(available)
    v2_path, v1_path = _cgroup_paths(Path(proc_self_cgroup))
    if v2_path is not None:
        for base in (root, root / "unified"):
            if (base / "cgroup.controllers").exists():
                headroom = _cgroup_headroom(
                    _ancestors(base, v2_path),
                    limit_file="memory.max",
                    usage_file="memory.current",
                    inactive_key="inactive_file",
                )
                if headroom is not None:
                    candidates.append(headroom)
                break
    if v1_path is not None:
        headroom = _cgroup_headroom(
            _ancestors(root / "memory", v1_path),
            limit_file="memory.limit_in_bytes",
            usage_file="memory.usage_in_bytes",
            inactive_key="total_inactive_file",
        )
        if headroom is not None:
            candidates.append(headroom)
    if candidates:
        return min(candidates)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 0


def shm_free_bytes(path: str | os.PathLike[str] = "/dev/shm") -> int:
    """Return the free bytes of the file system at ``path`` (``statvfs``: ``f_bavail * f_frsize``).

    Raises:
        OSError: when ``path`` does not exist.
    """
    stats = os.statvfs(path)
    return int(stats.f_bavail) * int(stats.f_frsize)


def shm_total_bytes(path: str | os.PathLike[str] = "/dev/shm") -> int:
    """Return the size of the file system at ``path`` (``statvfs``: ``f_blocks * f_frsize``): a tmpfs
    mount's ``size``, e.g. Docker's ``shm_size``.

    Raises:
        OSError: when ``path`` does not exist.
    """
    stats = os.statvfs(path)
    return int(stats.f_blocks) * int(stats.f_frsize)


def step_ring_budget(
    setting_mib: float | None, *, reserved_bytes: int, path: str | os.PathLike[str] = "/dev/shm"
) -> tuple[int, str]:
    """The bytes the learner's step rings may take together in ``path``, and a note ("" or one line).

    ``setting_mib`` (``step_ring_max_mib``, MiB) when given, else :data:`STEP_RING_SHM_SHARE` of the
    mount's size; either way at most what the mount holds beside ``reserved_bytes`` (the rollout
    buffers). A setting larger than that is lowered to it, and the note says so. Without the mount
    (no POSIX shared memory here): the setting, or 0 (no rings).
    """
    setting = None if setting_mib is None else int(setting_mib * 2**20)
    try:
        size = shm_total_bytes(path)
    except OSError:
        return (setting or 0), ""
    room = max(0, size - int(reserved_bytes))
    if setting is None:
        return min(int(size * STEP_RING_SHM_SHARE), room), ""
    if setting <= room:
        return setting, ""
    return room, (
        f"step_ring_max_mib={setting_mib:g} is more than {path} holds beside the rollout buffers "
        f"({format_bytes(room)} of its {format_bytes(size)}): the step rings take at most "
        f"{format_bytes(room)} (raise shm_size, or lower step_ring_max_mib)"
    )


def shm_size_hint(required_bytes: int) -> str:
    """Return a docker compose ``shm_size`` value comfortably above ``required_bytes``."""
    mebibytes = -(-int(required_bytes * 1.25) // (1024 * 1024))  # 25 % headroom, rounded up
    if mebibytes >= 1024:
        return f"{-(-mebibytes // 1024)}gb"
    return f"{max(mebibytes, 64)}mb"


def ensure_shm_capacity(required_bytes: int, path: str | os.PathLike[str] = "/dev/shm") -> None:
    """Check that ``path`` has at least ``required_bytes`` free, before creating segments there.

    Writing past the end of a full ``/dev/shm`` kills the process with ``SIGBUS``; Docker gives a
    container only 64 MB by default, less than one Atari-sized rollout.

    Args:
        required_bytes: bytes about to be allocated in shared memory.
        path: the shared-memory file system.

    Raises:
        SharedMemoryTooSmallError: when free space is smaller; the message gives both figures and
            says to raise ``shm_size`` in docker compose.
        OSError: when ``path`` does not exist.
    """
    available = shm_free_bytes(path)
    if required_bytes > available:
        raise SharedMemoryTooSmallError(
            f"{path}: the rollout buffers need {required_bytes} bytes ({format_bytes(required_bytes)}) "
            f"of shared memory but only {available} bytes ({format_bytes(available)}) are free. "
            f"Raise `shm_size` for this service in docker compose (e.g. shm_size: "
            f'"{shm_size_hint(required_bytes)}"), or use a shorter rollout / fewer envs.'
        )


def cuda_free_bytes(device_index: int) -> int | None:
    """Return free memory of CUDA device ``device_index`` in bytes, None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device_index)
    return int(free)


def make_diagnostic(
    resource: str, required_bytes: int, available_bytes: int, what: str
) -> RolloutBufferMemoryDiagnostic:
    """Build a :class:`RolloutBufferMemoryDiagnostic` with a one-line message about ``what``."""
    ok = required_bytes <= available_bytes
    verdict = "fits" if ok else "DOES NOT FIT"
    message = (
        f"{resource}: {what} need {format_bytes(required_bytes)} ({required_bytes} bytes), "
        f"{format_bytes(available_bytes)} ({available_bytes} bytes) available: {verdict}"
    )
    return RolloutBufferMemoryDiagnostic(
        resource, int(required_bytes), int(available_bytes), ok, message
    )


def rollout_memory_pressure(
    schema: StepSchema,
    rows: int,
    num_minibatches: int,
    *,
    buffer_bytes: int,
    resident_bytes: int,
    shm_dir: Path,
    cached_cuda_bytes: int = 0,
) -> list[RolloutBufferMemoryDiagnostic]:
    """Project the memory a rollout buffer and one PPO update need, per resource.

    Figures (worst case: every row trainable):

    - ``cpu``: the shared arrays plus the flat batch gathered on the host (and, without CUDA,
      the flat batch itself and one minibatch of observations as float32 for the network),
      against :func:`host_available_bytes` plus the buffer's already resident pages.
    - ``shm``: the shared arrays against ``shm_dir`` free space plus the buffer's own resident
      segments (Docker gives a container 64 MB by default); left out when ``shm_dir`` is absent.
    - ``cuda:<i>`` when CUDA is available: the flat batch, one minibatch's copy of it and one
      float32 minibatch of observations, against free device memory plus the current cache.

    Args:
        schema: the buffer's step schema.
        rows: rows of the buffer (``T * N``).
        num_minibatches: PPO minibatches per epoch, positive.
        buffer_bytes: bytes of the buffer's shared arrays.
        resident_bytes: bytes of them already backed by memory (counted as used).
        shm_dir: the shared-memory file system.
        cached_cuda_bytes: bytes of the buffer's flat batch already uploaded to CUDA.

    Returns:
        One :class:`RolloutBufferMemoryDiagnostic` per resource.
    """
    import torch

    flat_bytes = rows * sum(f.item_bytes for f in schema.minibatch) + rows * 8  # + row indices
    observation_elements = sum(math.prod(schema[n].shape) for n in schema.observation_names)
    float_minibatch_bytes = math.ceil(rows / num_minibatches) * observation_elements * 4
    minibatch_copy = math.ceil(flat_bytes / num_minibatches)
    cuda = torch.cuda.is_available()
    diagnostics: list[RolloutBufferMemoryDiagnostic] = []
    host_transient = flat_bytes + rows * 4  # gathered rows + normalised advantages
    if not cuda:
        host_transient += flat_bytes + minibatch_copy + float_minibatch_bytes
    diagnostics.append(
        make_diagnostic(
            "cpu",
            buffer_bytes + host_transient,
            host_available_bytes() + resident_bytes,
            "rollout arrays and one update's flat batch",
        )
    )
    if shm_dir.is_dir():
        diagnostics.append(
            make_diagnostic(
                "shm", buffer_bytes, shm_free_bytes(shm_dir) + resident_bytes, "rollout arrays"
            )
        )
    if cuda:
        index = torch.cuda.current_device()
        free = cuda_free_bytes(index) or 0
        diagnostics.append(
            make_diagnostic(
                f"cuda:{index}",
                flat_bytes + minibatch_copy + float_minibatch_bytes,
                free + cached_cuda_bytes,
                "flat batch, one minibatch and one float32 minibatch of observations",
            )
        )
    return diagnostics
