"""Process plumbing shared by the services: logging, run folders, stop signals, parent-death signal."""

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
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from oakemu_core.config import OakEmuConfig
from oakemu_core.errors import ConfigError
from oakemu_core.run.run_folder import PORT_FIELDS, make_run_folder

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
        return f"{stamp}.{int(record.msecs):03d}{time.strftime('%z', time.localtime(record.created))}"

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
            logging.basicConfig(level=level, format="%(name)s: %(message)s", handlers=[handler], force=True)
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


def resolve_run_dir(config: OakEmuConfig) -> Path:
    """``runs_dir / run_name`` (created, with ``logs/``); a new timestamped name when ``run_name`` is unset.

    Raises:
        DiskFullError: no room for the folder (the message names it and the bytes free).
    """
    return make_run_folder(Path(config.runs_dir) / (config.run_name or default_run_name(config)))


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
            raise ConfigError(f"bind_host: expected an address of this machine, received {host!r} "
                              f"({error.strerror or error})") from None
    return False


def check_ports_free(config: OakEmuConfig) -> None:
    """Refuse to start a learner whose ports are taken (another learner or ``oakemu train`` runs), before
    any process or run folder exists. The Prometheus port is checked on 0.0.0.0, where it listens.

    Raises:
        ConfigError: names every port in use and the flag that changes it.
    """
    taken = [f"{name}={port}" for name, port in learner_ports(config).items()
             if port_in_use("0.0.0.0" if name == "metrics_port" else config.bind_host, port)]
    if taken:
        flags = ", ".join("--" + item.split("=")[0].replace("_", "-") for item in taken)
        raise ConfigError(f"ports in use on {config.bind_host}: {', '.join(taken)} (another learner or oakemu train "
                          f"holds them); choose others with {flags}")


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
    return config.model_copy(update=dict(zip(unset, free_ports(len(unset), config.bind_host, avoid=given))))


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

    def __init__(self, logger: logging.Logger, peer: str, address: str, *, give_up_s: float | None = None,
                 period_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
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
            left = f" (giving up in {max(0.0, self.give_up_s - (now - self.started)):.0f} s)" if self.give_up_s else ""
            self.logger.warning("still trying to reach the %s at %s: no answer for %.0f s, %d attempts%s",
                                self.peer, self.address, now - self.started, self.attempts, left)

    def succeeded(self) -> None:
        """The peer answered: say so when the wait was long enough to have been reported."""
        if self.started is not None and self.clock() - self.started >= self.period_s:
            self.logger.info("reached the %s at %s after %.0f s", self.peer, self.address, self.clock() - self.started)
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
