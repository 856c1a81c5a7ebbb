"""Process plumbing shared by the services: logging, run folders, stop signals, parent-death signal."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from pathlib import Path

from oakemu_core.config import OakEmuConfig

PARENT_PID_ENV = "OAKEMU_PARENT_PID"
"""Set by ``oakemu train`` for its children: they die with it even if it is killed with SIGKILL."""


def setup_logging(level: str) -> None:
    """Log to stderr through rich (timestamps, levels), once per process."""
    import sys

    from rich.console import Console
    from rich.logging import RichHandler

    root = logging.getLogger()
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        # Wide lines when stderr is a log file (oakemu train redirects children's output).
        console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False, log_time_format="[%X]")
        logging.basicConfig(level=level, format="%(name)s: %(message)s", handlers=[handler], force=True)
    root.setLevel(level)


def default_run_name(config: OakEmuConfig) -> str:
    """``<env id with / as ->__<seed>__<YYYYmmdd-HHMMSS>``, the CleanRL-style run name."""
    return f"{config.env_id.replace('/', '-')}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(config: OakEmuConfig) -> Path:
    """``runs_dir / run_name`` (created); a new timestamped name when ``run_name`` is unset."""
    run_dir = Path(config.runs_dir) / (config.run_name or default_run_name(config))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def install_stop_signals() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM (main thread only); a second one exits at once."""
    stop_event = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        # Only a second Ctrl-C means "now": SIGTERM may arrive more than once (parent-death
        # signal, docker stop) and must still let the final checkpoint be written.
        if stop_event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
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
