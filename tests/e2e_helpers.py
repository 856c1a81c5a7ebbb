"""Helpers for the end-to-end tests: free ports, ``oakemu`` service processes, cleanup checks.

Every process is started as ``python -m oakemu_services.cli <command> ...`` in a session of its own
(its pid is its process-group id), with stdout and stderr written to files under the test's
``tmp_path``.  The :func:`e2e_fixture` (``e2e``, registered for every test in ``tests/conftest.py``)
gives a test its ports, its runs folder and telemetry subscribers, tracks the processes it starts
and, while the test runs, every descendant they start (``oakemu train`` starts its learner and
actors in sessions of their own). On teardown, also when the test failed, it closes the
subscribers, stops whatever is still running and unlinks every ``/dev/shm/oakemu_<pid>_*`` segment
of a tracked process, each step in an ``ExitStack`` so that one failing step does not skip the
others; it fails the test if a segment was left (or, after a passing test, a process still ran).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from oakemu_core.run.telemetry import TelemetrySnapshot, TelemetrySubscriber
from oakemu_core.shared_memory import SEGMENT_PREFIX, parse_segment_owner

REPO_ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
PORT_FLAGS = (
    "--data-port",
    "--control-port",
    "--weights-port",
    "--telemetry-port",
    "--metrics-port",
)

T = TypeVar("T")

CARTPOLE_PPO_FLAGS = (
    *("--num-actors", "2", "--envs-per-actor", "4", "--rollout-length", "128"),
    *("--ppo-epochs", "10", "--num-minibatches", "8", "--learning-rate", "1e-3"),
    *("--clip-coef", "0.2", "--ent-coef", "0.0", "--checkpoint-every-updates", "0"),
)
"""``oakemu train`` flags of the end-to-end CartPole runs: 2 actors x 4 envs x 128 steps, CleanRL's
classic-control PPO (10 epochs of 8 minibatches, learning rate 1e-3, clip 0.2, no entropy bonus), no
periodic checkpoints."""


# ------------------------------------------------------------------------------------ ports
@dataclass(frozen=True)
class Ports:
    """Five distinct free TCP ports on 127.0.0.1 for one learner."""

    data: int
    control: int
    weights: int
    telemetry: int
    metrics: int

    def flags(self, role: str = "learner") -> list[str]:
        """``--data-port P1 --control-port P2 --weights-port P3 --telemetry-port P4 --metrics-port P5`` for a
        learner or ``oakemu train``; an actor's three (``role="actor"``: data, control, weights)."""
        values = (self.data, self.control, self.weights, self.telemetry, self.metrics)
        count = 3 if role == "actor" else 5
        return [
            item
            for flag, port in list(zip(PORT_FLAGS, values))[:count]
            for item in (flag, str(port))
        ]

    @property
    def telemetry_address(self) -> str:
        return f"tcp://127.0.0.1:{self.telemetry}"

    @property
    def data_address(self) -> str:
        return f"tcp://127.0.0.1:{self.data}"

    @property
    def control_address(self) -> str:
        return f"tcp://127.0.0.1:{self.control}"


def free_ports(count: int = 5) -> list[int]:
    """``count`` distinct TCP ports that were free on 127.0.0.1 a moment ago (bound together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def new_ports() -> Ports:
    """A fresh :class:`Ports` (five free ports)."""
    return Ports(*free_ports(5))


def python_path_with_site_hook(tmp_path: Path, code: str) -> str:
    """A ``PYTHONPATH`` for child processes that finds this repository and runs ``code`` at their
    start (as ``sitecustomize.py`` in ``tmp_path / "hooks"``): a test's way to slow or break one
    part of a real process."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(code)
    return os.pathsep.join([str(hooks), str(REPO_ROOT)])


def common_flags(ports: Ports, runs_dir: Path, *extra: str, role: str = "learner") -> list[str]:
    """Port flags, ``--runs-dir`` and ``extra`` flags for a learner or ``oakemu train``; an actor's port
    flags and ``extra`` for ``role="actor"`` (each command offers only the options it uses)."""
    if role == "actor":
        return [*ports.flags("actor"), *extra]
    return [*ports.flags(), "--runs-dir", str(runs_dir), *extra]


# ------------------------------------------------------------------------------- /proc scans
def _proc_stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, start time in clock ticks)`` of ``pid`` from ``/proc/<pid>/stat``, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # zombie: exited, waiting to be reaped
        return None
    return int(fields[1]), int(fields[19])


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
    return children


def descendants(pids: Sequence[int]) -> set[int]:
    """Live descendants (children, grandchildren, ...) of ``pids``, not including ``pids``."""
    children = _children_map()
    found: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def segments_of(pids: set[int]) -> list[str]:
    """Names of ``/dev/shm/oakemu_<pid>_*`` segments owned by one of ``pids``."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(
        path.name
        for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*")
        if parse_segment_owner(path.name) in pids
    )


# --------------------------------------------------------------------------------- processes
class ServiceProcess:
    """One started ``python -m oakemu_services.cli ...`` process and its output files."""

    def __init__(
        self, name: str, args: list[str], popen: subprocess.Popen[bytes], stdout: Path, stderr: Path
    ) -> None:
        self.name = name
        self.args = args
        self.popen = popen
        self.stdout_path = stdout
        self.stderr_path = stderr

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself (not its group)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """Wait for exit; raises ``AssertionError`` with the output tail when it does not exit in time."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout_s} s\n{self.describe()}"
            ) from None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def describe(self, lines: int = 40) -> str:
        """Command, exit status and the last ``lines`` lines of stdout and stderr (for failure messages)."""
        tail_out = "\n".join(self.stdout().splitlines()[-lines:])
        tail_err = "\n".join(self.stderr().splitlines()[-lines:])
        return (
            f"--- {self.name}: {' '.join(self.args)} (status {self.popen.poll()})\n"
            f"--- stdout:\n{tail_out}\n--- stderr:\n{tail_err}"
        )


# ------------------------------------------------------------------------------------- files
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a partly written last line is skipped); [] if missing."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def update_records(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics.jsonl lines written after a PPO update (those with ``charts/policy_version``)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "charts/policy_version" in r]


def only_run_dir(runs_dir: Path) -> Path:
    """The single run folder under ``runs_dir`` (fails if there is not exactly one)."""
    found = [p for p in runs_dir.iterdir() if p.is_dir()] if runs_dir.is_dir() else []
    assert len(found) == 1, f"expected one run folder in {runs_dir}, found {found}"
    return found[0]


# ------------------------------------------------------------------------------------ waiting
def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.2,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value (returned); AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{extra}")
        time.sleep(interval_s)


class Telemetry:
    """A telemetry subscriber that remembers the newest snapshot."""

    def __init__(self, address: str) -> None:
        self.subscriber = TelemetrySubscriber(address)
        self.latest: TelemetrySnapshot | None = None

    def wait(
        self,
        predicate: Callable[[TelemetrySnapshot], bool],
        timeout_s: float,
        what: str,
        on_timeout: Callable[[], str] | None = None,
    ) -> TelemetrySnapshot:
        """Read snapshots until one satisfies ``predicate`` (returned); AssertionError on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snapshot = self.subscriber.receive(
                timeout_s=min(1.0, max(0.05, deadline - time.monotonic()))
            )
            if snapshot is None:
                continue
            self.latest = snapshot
            if predicate(snapshot):
                return snapshot
        extra = on_timeout() if on_timeout is not None else ""
        latest = self.latest.model_dump() if self.latest is not None else None
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for telemetry: {what}; latest {latest}\n{extra}"
        )

    def close(self) -> None:
        self.subscriber.close()


def describe_all(*processes: ServiceProcess) -> Callable[[], str]:
    """An ``on_timeout`` callback: the output tails of ``processes`` (read when called)."""
    return lambda: "\n".join(p.describe(25) for p in processes)


# ----------------------------------------------------------------------------- the e2e fixture
@dataclass(frozen=True)
class FinishedRun:
    """An ``oakemu train`` (or ``--resume``) process that exited 0, and its run folder."""

    process: ServiceProcess
    run_dir: Path
    learner_log: str
    """The text of ``run_dir/logs/learner.log`` when the process had exited."""


class E2EProcesses:
    """One test's end-to-end set-up: ports, runs folder, started processes and their clean-up.

    ``ports`` (five free ports) and ``runs_dir`` (``tmp_path / "runs"``; a test may point it
    elsewhere before it starts a process) are what :meth:`flags`, :meth:`train` and
    :meth:`telemetry` use unless told otherwise. :meth:`close` (the fixture's teardown) undoes
    everything; see the module docstring.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.runs_dir = tmp_path / "runs"
        self.ports = new_ports()
        self.started: list[ServiceProcess] = []
        self._resources = contextlib.ExitStack()  # subscribers, sockets: closed first on teardown
        self._seen: dict[int, int] = {}  # pid -> start time of every tracked process and descendant
        self._lock = threading.Lock()
        self._stop_scan = threading.Event()
        self._scanner = threading.Thread(
            target=self._scan_loop, name="e2e-descendants", daemon=True
        )
        self._scanner.start()

    # -- starting ---------------------------------------------------------------------------
    def start(
        self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start ``python -m oakemu_services.cli *args`` in its own session; output to ``tmp_path/<name>.{stdout,stderr}``."""
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env.update(env or {})
        stdout_path = self.tmp_path / f"{name}.stdout"
        stderr_path = self.tmp_path / f"{name}.stderr"
        command = [sys.executable, "-m", "oakemu_services.cli", *args]
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            popen = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=child_env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        process = ServiceProcess(name, list(args), popen, stdout_path, stderr_path)
        with self._lock:
            self.started.append(process)
            stat = _proc_stat(popen.pid)
            if stat is not None:
                self._seen[popen.pid] = stat[1]
        return process

    def flags(self, *extra: str, role: str = "learner") -> list[str]:
        """:func:`common_flags` with this test's ``ports`` and ``runs_dir``."""
        return common_flags(self.ports, self.runs_dir, *extra, role=role)

    def telemetry(self, ports: Ports | None = None) -> Telemetry:
        """A :class:`Telemetry` subscriber on ``ports`` (default: this test's), closed on teardown at the latest."""
        telemetry = Telemetry((ports or self.ports).telemetry_address)
        self._resources.callback(telemetry.close)
        return telemetry

    def defer(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Call ``callback(*args, **kwargs)`` on teardown (before the processes are stopped), also when the test failed."""
        self._resources.callback(callback, *args, **kwargs)

    # -- running to the end ------------------------------------------------------------------
    def train(
        self,
        args: Sequence[str],
        *,
        timeout_s: float,
        name: str = "train",
        ports: Ports | None = None,
        runs_dir: Path | None = None,
        exit_timeout_s: float = 5.0,
    ) -> FinishedRun:
        """Run ``oakemu train *args`` with the port and runs-folder flags to its end, then :meth:`finish` it.

        The runs folder (``runs_dir``, default this test's) must end up holding exactly one run folder.
        """
        runs_dir = runs_dir or self.runs_dir
        process = self.start(name, ["train", *args, *common_flags(ports or self.ports, runs_dir)])
        return self.finish(
            process, timeout_s=timeout_s, runs_dir=runs_dir, exit_timeout_s=exit_timeout_s
        )

    def finish(
        self,
        process: ServiceProcess,
        *,
        timeout_s: float,
        run_dir: Path | None = None,
        runs_dir: Path | None = None,
        exit_timeout_s: float = 5.0,
    ) -> FinishedRun:
        """Wait for a run's launcher and check how it ended.

        Asserts: ``process`` exits 0 within ``timeout_s`` (else the message holds its output and the
        learner log's tail); ``learner.log`` holds no ``Traceback``; every tracked process exited
        within ``exit_timeout_s`` more and left no shared-memory segment. ``run_dir`` is the run
        folder, or the only one in ``runs_dir`` (default this test's).
        """
        status = process.wait(timeout_s)
        run_dir = run_dir or only_run_dir(runs_dir or self.runs_dir)
        log_path = run_dir / "logs" / "learner.log"
        learner_log = log_path.read_text(errors="replace") if log_path.exists() else ""
        tail = "\n".join(learner_log.splitlines()[-30:])
        assert status == 0, process.describe() + "\n--- learner.log tail:\n" + tail
        assert "Traceback" not in learner_log, tail
        self.assert_clean(exit_timeout_s)
        return FinishedRun(process, run_dir, learner_log)

    # -- tracking ---------------------------------------------------------------------------
    def _scan_once(self) -> None:
        with self._lock:
            roots = [p.pid for p in self.started]
        found = descendants(roots)
        with self._lock:
            for pid in found:
                if pid not in self._seen:
                    stat = _proc_stat(pid)
                    if stat is not None:
                        self._seen[pid] = stat[1]

    def _scan_loop(self) -> None:
        while not self._stop_scan.wait(0.2):
            with contextlib.suppress(OSError, ValueError, IndexError):  # an entry vanished mid-scan
                self._scan_once()

    def tracked_pids(self) -> set[int]:
        """Every pid started here or seen as a descendant of one (alive or not)."""
        self._scan_once()
        with self._lock:
            return set(self._seen)

    def alive(self) -> list[tuple[int, str]]:
        """``(pid, command line)`` of tracked processes still running (same pid AND start time)."""
        self._scan_once()
        with self._lock:
            seen = dict(self._seen)
        running = []
        for pid, start in seen.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[1] == start:
                try:
                    cmdline = (
                        Path(f"/proc/{pid}/cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                except OSError:
                    cmdline = "?"
                running.append((pid, cmdline.strip()))
        return running

    def assert_all_exited(self, timeout_s: float = 10.0) -> None:
        """Fail unless every tracked process (and descendant) has exited within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = self.alive()
            if not running:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"processes still running: {running}")
            time.sleep(0.2)

    def leftover_segments(self) -> list[str]:
        """``/dev/shm/oakemu_*`` segments owned by a tracked process."""
        return segments_of(self.tracked_pids())

    def assert_clean(self, timeout_s: float = 10.0) -> None:
        """:meth:`assert_all_exited` within ``timeout_s``, then no shared-memory segment of a tracked process is left."""
        self.assert_all_exited(timeout_s=timeout_s)
        assert self.leftover_segments() == []

    # -- teardown ---------------------------------------------------------------------------
    def _signal_alive(self, signum: int) -> None:
        with self._lock:
            seen = dict(self._seen)
            groups = [p.pid for p in self.started if p.poll() is None]
        for pgid in groups:
            try:
                os.killpg(pgid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        for pid, start in seen.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[1] == start:  # the same process, not a reused pid
                try:
                    os.kill(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def _stop_processes(self, problems: list[str]) -> None:
        """Stop everything still running (SIGTERM, then SIGKILL after 10 s) and reap the started processes."""
        self._scan_once()
        if all(p.poll() is not None for p in self.started):
            # The started processes all exited: their descendants (e.g. multiprocessing's resource
            # tracker, which exits when its parent's pipe closes) get a moment to follow.
            deadline = time.monotonic() + 5.0
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.alive():
            problems.append(f"processes still running at teardown (stopped now): {self.alive()}")
            self._signal_alive(signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.alive():
                self._signal_alive(signal.SIGKILL)
                time.sleep(0.5)
        for process in self.started:
            try:
                process.popen.wait(5.0)
            except subprocess.TimeoutExpired:
                problems.append(f"{process.name} (pid {process.pid}) survived SIGKILL")

    def _stop_scanner(self) -> None:
        self._stop_scan.set()
        self._scanner.join(2.0)

    def _unlink_segments(self, problems: list[str]) -> None:
        with self._lock:
            pids = set(self._seen)
        left = segments_of(pids)
        for name in left:
            (SHM_DIR / name).unlink(missing_ok=True)
        if left:
            problems.append(f"shared-memory segments left behind (now removed): {left}")

    def close(self) -> list[str]:
        """Undo the test's set-up; returns messages of the problems found.

        In order: close the resources (subscribers, :meth:`defer` callbacks), stop every tracked
        process, stop the scanner, unlink the tracked processes' segments. Each step runs even if
        an earlier one raised (the first error is raised after the last step).
        """
        problems: list[str] = []
        with contextlib.ExitStack() as steps:  # callbacks run last-registered first
            steps.callback(self._unlink_segments, problems)
            steps.callback(self._stop_scanner)
            steps.callback(self._stop_processes, problems)
            steps.enter_context(self._resources)
        return problems


@pytest.fixture(name="e2e")
def e2e_fixture(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[E2EProcesses]:
    """An :class:`E2EProcesses` whose processes are all stopped on teardown, even when the test fails.

    Teardown fails the test (as an error) if a shared-memory segment of a tracked process remains,
    and, when the test itself passed, if a process it started was still running.
    """
    failed_before = request.session.testsfailed
    processes = E2EProcesses(tmp_path)
    yield processes
    problems = processes.close()
    # The call phase's report is logged (and counted) before fixtures are torn down.
    test_failed = request.session.testsfailed > failed_before
    if problems and not test_failed:
        details = "\n".join(p.describe(15) for p in processes.started)
        pytest.fail("e2e cleanup: " + "; ".join(problems) + "\n" + details)
