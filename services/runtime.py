"""Process plumbing shared by the services: logging, run folders (named and held), the learner's ports
(checked and claimed), stop signals, parent-death signal."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import logging
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection
from pathlib import Path

from oakemu_core.config import OakEmuConfig
from oakemu_core.errors import ConfigError
from oakemu_core.run.run_folder import PORT_FIELDS, make_new_run_folder, make_run_folder
from oakemu_core.run.run_lock import RunFolderLock, holder_pid

PARENT_PID_ENV = "OAKEMU_PARENT_PID"
SETUP_ERROR_EXIT_STATUS = 3
"""Exit status of an actor that cannot serve the learner's run (``oakemu_services.actor.ActorSetupError``):
restarting it would fail the same way, so ``oakemu train`` does not."""
"""Set by ``oakemu train`` for its children: they die with it even if it is killed with SIGKILL."""


class OneLineFormatter(logging.Formatter):
    """``TIME LEVEL logger: message`` with any newline (tracebacks included) escaped: one record per line."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO 8601 local time with milliseconds and the UTC offset."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        return (
            f"{stamp}.{int(record.msecs):03d}{time.strftime('%z', time.localtime(record.created))}"
        )

    def format(self, record: logging.LogRecord) -> str:
        """The record on one line (``\\n`` stands for a newline inside it)."""
        return super().format(record).replace("\r", "").replace("\n", "\\n")


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (epoch s), ``level``, ``logger``, ``message``, ``process``
    and, when there is one, ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON line."""
        document: dict[str, object] = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, ensure_ascii=False)


def resolved_log_format(log_format: str = "auto", stream: object | None = None) -> str:
    """``rich``, ``plain`` or ``json``: ``auto`` is rich on a terminal, plain otherwise (containers, files)."""
    if log_format != "auto":
        return log_format
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "rich" if callable(isatty) and isatty() else "plain"


def setup_logging(level: str, log_format: str = "auto") -> None:
    """Log to stderr, once per process: the rich view on a terminal, one record per line elsewhere.

    ``log_format`` is the ``log_format`` setting (``OAKEMU_LOG_FORMAT``): ``auto``, ``rich``, ``plain``
    or ``json``. ``plain`` and ``json`` never wrap or split a record, so ``docker compose logs`` and log
    shippers read one record per line.
    """
    chosen = resolved_log_format(log_format)
    root = logging.getLogger()
    if chosen == "rich":
        from rich.console import Console
        from rich.logging import RichHandler

        if not any(isinstance(h, RichHandler) for h in root.handlers):
            # Wide lines when stderr is a log file (oakemu train redirects children's output).
            console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
            handler: logging.Handler = RichHandler(
                console=console, show_path=False, rich_tracebacks=False, log_time_format="[%X]"
            )
            logging.basicConfig(
                level=level, format="%(name)s: %(message)s", handlers=[handler], force=True
            )
    else:
        formatter_type = JsonLineFormatter if chosen == "json" else OneLineFormatter
        if not any(isinstance(h.formatter, formatter_type) for h in root.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(formatter_type())
            logging.basicConfig(level=level, handlers=[handler], force=True)
    root.setLevel(level)


def default_run_name(config: OakEmuConfig) -> str:
    """``<env>__<seed>__<YYYYmmdd-HHMMSS>``, the CleanRL-style run name. ``<env>`` is the env id as
    a safe folder name: ``ALE/Breakout-v5`` -> ``ALE-Breakout-v5``, ``my_pkg.envs:MyEnv-v0`` ->
    ``MyEnv-v0``, ``gameboy:/roms/red.gb`` -> ``gameboy-red.gb``, ``retro:Airstriker-Genesis-v0`` ->
    ``retro-Airstriker-Genesis-v0``."""
    prefix, _, rest = config.env_id.rpartition(":")
    base = Path(rest).name if prefix == "gameboy" else rest
    tag = f"{prefix}-{base}" if prefix in ("gameboy", "retro") else base
    env = re.sub(r"[^A-Za-z0-9._-]+", "-", tag).strip("-") or "env"
    return f"{env}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(config: OakEmuConfig) -> tuple[Path, RunFolderLock | None]:
    """The learner's run folder (with ``logs/``), held by this process for the run (:class:`RunFolderLock`).

    Without ``run_name``, a new folder named by :func:`default_run_name` (``-2``, ``-3``, ... when that
    is taken). With ``run_name``, that folder, made when missing (a folder with a checkpoint is resumed).
    Under ``oakemu train`` (``OAKEMU_PARENT_PID``), the launcher holds the folder for its learner: None
    is returned as the lock then.

    Returns:
        ``(run_dir, lock)``.

    Raises:
        RunFolderBusyError: another live run holds the folder (the message names its pid).
        RunFolderError: the folder cannot be made or locked (read-only, not a folder).
        DiskFullError: no room for the folder (the message names it and the bytes free).
    """
    runs_dir = Path(config.runs_dir)
    if config.run_name is None:
        lock = make_new_run_folder(runs_dir, default_run_name(config), numbered=True)
        return make_run_folder(lock.run_dir), lock
    run_dir = make_run_folder(runs_dir / config.run_name)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and parent.isdigit() and holder_pid(run_dir) == int(parent):
        return run_dir, None
    return run_dir, RunFolderLock.acquire(
        run_dir, hint="stop that run first, or give this learner another --run-name"
    )


class StopRequest(threading.Event):
    """An event set by a stop signal; :attr:`signum` is the first signal that set it (None while unset)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None

    @property
    def exit_status(self) -> int:
        """The shell's status for a process stopped by :attr:`signum`: ``128 + signum`` (Ctrl-C: 130); 0 if unset."""
        return 128 + self.signum if self.signum is not None else 0


INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT
"""The shell's status after Ctrl-C (130)."""


def interrupted_status(status: int, stop: StopRequest) -> int:
    """A service's exit status: ``status``, or 130 when it ended cleanly after Ctrl-C (SIGINT). SIGTERM
    keeps ``status``: it is how Docker, Swarm and Kubernetes stop a service, not a failure."""
    return INTERRUPTED_EXIT_STATUS if status == 0 and stop.signum == signal.SIGINT else status


def learner_ports(config: OakEmuConfig) -> dict[str, int]:
    """``{setting: port}`` of every port the learner of ``config`` listens on."""
    return {name: int(getattr(config, name)) for name in PORT_FIELDS if getattr(config, name)}


def port_in_use(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` is taken: a TCP bind with ``SO_REUSEADDR`` (as ZeroMQ and the
    Prometheus server bind) fails with EADDRINUSE.

    Raises:
        ConfigError: ``host`` is no address of this machine (the bind fails for another reason).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise ConfigError(
                f"bind_host: expected an address of this machine, received {host!r} "
                f"({error.strerror or error})"
            ) from None
    return False


def check_ports_free(config: OakEmuConfig) -> None:
    """Refuse to start a learner whose ports are taken (another learner or ``oakemu train`` runs), before
    any process or run folder exists. The Prometheus port is checked on 0.0.0.0, where it listens.

    Raises:
        PortsInUseError: names every port in use and the flag that changes it.
    """
    taken = {
        name: f"{name}={port}"
        for name, port in learner_ports(config).items()
        if port_in_use("0.0.0.0" if name == "metrics_port" else config.bind_host, port)
    }
    if taken:
        raise PortsInUseError(config.bind_host, taken)


class PortsInUseError(ConfigError):
    """Ports a learner needs are in use; :attr:`names` are their settings (``data_port``, ...).

    Args:
        host: the address the ports were checked on.
        taken: ``{setting: "setting=port"}``, the text naming the process that claimed it where a claim
            did (``" (claimed by pid N)"``); the holder of a port taken without a claim is not known.
    """

    def __init__(self, host: str, taken: dict[str, str]) -> None:
        flags = ", ".join("--" + name.replace("_", "-") for name in taken)
        ports, others = ("port", "another") if len(taken) == 1 else ("ports", "others")
        super().__init__(
            f"{ports} in use on {host}: {', '.join(taken.values())}; choose {others} with {flags}"
        )
        self.names = tuple(taken)


PORT_CLAIM_PREFIX = "oakemu-port-"
"""The name of the abstract Unix socket (``\\0oakemu-port-<port>``) by which a process claims a TCP port."""


class PortClaims:
    """The learner ports this process claimed (see :func:`claim_ports`); :meth:`release` gives them up
    (so do the object's collection and the process's exit)."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._release = weakref.finalize(self, _close_all, sockets)

    def release(self) -> None:
        self._release()


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _claim_port(port: int) -> tuple[socket.socket | None, int | None]:
    """``(claim, None)`` when this process now holds the claim on ``port`` (``(None, None)`` where
    claims do not exist: not Linux); ``(None, pid)`` when another process holds it (pid 0: unknown)."""
    if not sys.platform.startswith("linux"):
        return None, None
    address = f"\0{PORT_CLAIM_PREFIX}{port}"
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(address)
    except OSError as error:
        claim.close()
        return (None, _claim_holder(address)) if error.errno == errno.EADDRINUSE else (None, None)
    claim.listen(
        socket.SOMAXCONN
    )  # a listening claim tells who holds it (SO_PEERCRED of a connection)
    return claim, None


def _claim_holder(address: str) -> int:
    """The pid of the process holding the claim at ``address`` (0 when it cannot be told)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(address)
            credentials = probe.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
            )
        except OSError:
            return 0
    return int(struct.unpack("3i", credentials)[0])


def claim_ports(config: OakEmuConfig) -> PortClaims:
    """Claim the ports the learner of ``config`` listens on, from its start until this process exits,
    or refuse them: in use (a TCP bind fails, :func:`check_ports_free`), or claimed by another process.

    A learner binds its ports seconds after its start was checked (torch, the env and the model load
    first): a run started meanwhile would find them free too and fail late. So ``oakemu train`` and a
    standalone learner claim each port by binding an abstract Unix socket named after it (Linux; scoped,
    as TCP ports are, to the network namespace; the kernel drops it when the process dies). A claim held
    by the process that started this one (``OAKEMU_PARENT_PID``: the launcher of this learner) or by
    this process is this learner's own.

    Raises:
        PortsInUseError: names every port in use (and the pid of a process that claimed it) and the
            flag that changes it; nothing stays claimed.
        ConfigError: ``bind_host`` is no address of this machine.
    """
    ports = learner_ports(config)
    parent = os.environ.get(PARENT_PID_ENV, "")
    own = {os.getpid(), int(parent) if parent.isdigit() else os.getpid()}
    held: list[socket.socket] = []
    taken: dict[str, str] = {}
    claims = PortClaims(held)
    for name, port in ports.items():
        claim, holder = _claim_port(port)
        if claim is not None:
            held.append(claim)
        elif holder is not None and holder not in own:
            taken[name] = (
                f"{name}={port} (claimed by {f'pid {holder}' if holder else 'another oakemu process'})"
            )
    try:
        check_ports_free(config)
    except PortsInUseError as error:
        taken = {name: taken.get(name, f"{name}={ports[name]}") for name in (*taken, *error.names)}
    except BaseException:
        claims.release()
        raise
    if taken:
        claims.release()
        raise PortsInUseError(config.bind_host, taken)
    return claims


def claim_free_ports(config: OakEmuConfig, tries: int = 5) -> tuple[OakEmuConfig, PortClaims]:
    """:func:`with_free_ports` and :func:`claim_ports`: ``config`` with free ports for those not given,
    all claimed. A chosen port that another run claimed in the meantime is chosen again (``tries`` times).

    Raises:
        PortsInUseError: a port given is in use (or the choices kept colliding).
        ConfigError: as :func:`claim_ports`.
    """
    attempt = 1
    while True:
        chosen = with_free_ports(config)
        try:
            return chosen, claim_ports(chosen)
        except PortsInUseError as error:
            if attempt >= tries or any(name in config.model_fields_set for name in error.names):
                raise
        attempt += 1


def free_ports(count: int, host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct TCP ports on ``host`` that nothing listens on now and not in ``avoid`` (the
    kernel's choices for binds to port 0, held together until all are chosen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            probe = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            probe.bind((host.strip("[]"), 0))
            port = int(probe.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports


def with_free_ports(config: OakEmuConfig) -> OakEmuConfig:
    """``config`` with a free port (:func:`free_ports`) for every port setting it was not given (flag,
    ``OAKEMU_*`` variable, TOML file): several ``oakemu train`` runs then share a machine."""
    unset = [name for name in PORT_FIELDS if name not in config.model_fields_set]
    given = {int(getattr(config, name)) for name in PORT_FIELDS if name in config.model_fields_set}
    return config.model_copy(
        update=dict(zip(unset, free_ports(len(unset), config.bind_host, avoid=given)))
    )


def install_stop_signals() -> StopRequest:
    """A :class:`StopRequest` set by the first SIGINT or SIGTERM (main thread only); a second Ctrl-C
    exits at once."""
    stop_event = StopRequest()

    def handler(signum: int, _frame: object) -> None:
        # Only a second Ctrl-C means "now": SIGTERM may arrive more than once (parent-death
        # signal, docker stop) and must still let the final checkpoint be written.
        if stop_event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if stop_event.signum is None:
            stop_event.signum = signum
        stop_event.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    die_with_parent()
    return stop_event


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the launching ``oakemu train`` dies (no orphans after kill -9).

    Only when started by ``oakemu train`` (``OAKEMU_PARENT_PID`` set); a no-op elsewhere.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not hasattr(ctypes, "CDLL"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def socket_buffer_bytes(message_bytes: int) -> int:
    """Kernel socket buffer for step streams: one message, at least 4 KiB (bytes).

    Bounds the steps in flight between an actor and the learner, hence their policy lag: the
    default (autotuned up to MBs) would hold thousands of small messages acted by old policies.
    """
    return max(4096, int(message_bytes))


class RetryReporter:
    """Says, at the first attempt and then every ``period_s``, which address a process is trying to
    reach and for how long, so a process waiting on a peer is never silent.

    ``attempt()`` is called before each try; ``succeeded()`` once the peer answered (logs how long it
    took when that was more than one period).
    """

    def __init__(
        self,
        logger: logging.Logger,
        peer: str,
        address: str,
        *,
        give_up_s: float | None = None,
        period_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.peer = peer
        self.address = address
        self.give_up_s = give_up_s
        self.period_s = period_s
        self.clock = clock
        self.started: float | None = None
        self.next_report = 0.0
        self.attempts = 0

    def attempt(self) -> None:
        """Record one try; log when it is the first one or a period has passed since the last line."""
        now = self.clock()
        self.attempts += 1
        if self.started is None:
            self.started = now
            self.next_report = now + self.period_s
            limit = f", giving up after {self.give_up_s:.0f} s" if self.give_up_s else ""
            self.logger.info("connecting to the %s at %s%s", self.peer, self.address, limit)
            return
        if now >= self.next_report:
            self.next_report = now + self.period_s
            left = (
                f" (giving up in {max(0.0, self.give_up_s - (now - self.started)):.0f} s)"
                if self.give_up_s
                else ""
            )
            self.logger.warning(
                "still trying to reach the %s at %s: no answer for %.0f s, %d attempts%s",
                self.peer,
                self.address,
                now - self.started,
                self.attempts,
                left,
            )

    def succeeded(self) -> None:
        """The peer answered: say so when the wait was long enough to have been reported."""
        if self.started is not None and self.clock() - self.started >= self.period_s:
            self.logger.info(
                "reached the %s at %s after %.0f s",
                self.peer,
                self.address,
                self.clock() - self.started,
            )
        self.started = None
        self.attempts = 0


def startup_done() -> None:
    """End a service's start: what the start made (imported modules, the model, the env) is frozen
    out of the garbage collector's reach (``gc.freeze``) and collection resumes. A no-op where the
    collector is already on (a service run in-process, by a test).

    :func:`oakemu_services.cli.run` turns the collector off before the service starts: importing
    torch makes some million objects and little garbage, and each full collection meanwhile walks
    them all (0.3-0.5 s of a learner's start). The learner calls this when it is ready to serve, an
    actor after its first join; other commands before they start.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
