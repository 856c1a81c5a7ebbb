"""Service logs: one record per line off a terminal (plain or JSON), and an actor that cannot reach its
learner says which address it is trying, at once and every few seconds."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from oakemu_services.runtime import RetryReporter, resolved_log_format

from tests.e2e_helpers import E2EProcesses, e2e_fixture, new_ports  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} (INFO|WARNING|ERROR) oakemu\.test: "
)


def log_in_child(log_format: str) -> list[str]:
    """stderr lines of a child process that logs a long record, a multi-line one and an exception."""
    code = f"""
import logging
from oakemu_services.runtime import setup_logging
setup_logging("INFO", {log_format!r})
log = logging.getLogger("oakemu.test")
log.info("update %5d | " + "x" * 200 + " | actors %d", 7, 3)
log.warning("first line\\nsecond line")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it failed")
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stderr.splitlines()


def test_plain_logs_are_one_record_per_line_with_time_and_level() -> None:
    lines = log_in_child("plain")
    assert len(lines) == 3, lines
    assert all(LINE.match(line) for line in lines), lines
    assert lines[0].endswith("| actors 3") and "x" * 200 in lines[0]  # never wrapped
    assert lines[1].endswith("first line\\nsecond line")
    assert "Traceback (most recent call last)" in lines[2] and "ZeroDivisionError" in lines[2]


def test_json_logs_are_one_object_per_line() -> None:
    records = [json.loads(line) for line in log_in_child("json")]
    assert [r["level"] for r in records] == ["INFO", "WARNING", "ERROR"]
    assert records[0]["logger"] == "oakemu.test" and records[0]["message"].endswith("| actors 3")
    assert records[1]["message"] == "first line\nsecond line"
    assert "ZeroDivisionError" in records[2]["exception"]
    assert all(isinstance(r["time"], float) for r in records)


def test_auto_is_rich_on_a_terminal_and_plain_elsewhere() -> None:
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    assert resolved_log_format("auto", Stream(True)) == "rich"
    assert resolved_log_format("auto", Stream(False)) == "plain"
    assert resolved_log_format("json", Stream(True)) == "json"


def test_retry_reporter_says_whom_it_tries_at_once_and_every_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    reporter = RetryReporter(
        logging.getLogger("oakemu.test"),
        "learner",
        "tcp://learner:5556",
        give_up_s=120,
        period_s=5.0,
        clock=lambda: now[0],
    )
    with caplog.at_level(logging.INFO, logger="oakemu.test"):
        for _ in range(13):  # one attempt every 2 s for 24 s
            reporter.attempt()
            now[0] += 2.0
        reporter.succeeded()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "connecting to the learner at tcp://learner:5556, giving up after 120 s"
    waits = [m for m in messages if m.startswith("still trying")]
    assert len(waits) == 4, messages  # at 6, 12, 18 and 24 s
    assert waits[0] == (
        "still trying to reach the learner at tcp://learner:5556: no answer for 6 s, "
        "4 attempts (giving up in 114 s)"
    )
    assert messages[-1] == "reached the learner at tcp://learner:5556 after 26 s"


@pytest.mark.slow
def test_an_actor_without_a_learner_says_where_it_is_trying(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    ports = new_ports()  # nothing listens there
    actor = e2e.start(
        "actor", ["actor", "--learner-host", "127.0.0.1", "--control-port", str(ports.control)]
    )
    address = f"tcp://127.0.0.1:{ports.control}"
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and f"still trying to reach the learner at {address}" not in actor.stderr()
    ):
        time.sleep(0.5)
    log = actor.stderr()
    assert f"connecting to the learner at {address}" in log, actor.describe()
    assert f"still trying to reach the learner at {address}: no answer for" in log, actor.describe()
    actor.send_signal(signal.SIGTERM)
    assert actor.wait(timeout_s=30) == 0, actor.describe()


@pytest.mark.slow
def test_an_actor_that_loses_its_learner_mid_run_says_so_and_gives_up(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    """The learner is killed after the actor joined: the actor reports the silence every few seconds
    (not only when it gives up) and exits with status 1 after 3 x actor_timeout_s."""
    from tests.e2e_helpers import common_flags

    ports = new_ports()
    learner = e2e.start(
        "learner",
        [
            "learner",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--actor-timeout-s",
            "4",
            "--eval-every-updates",
            "0",
            *common_flags(ports, tmp_path / "runs"),
        ],
    )
    actor = e2e.start(
        "actor", ["actor", "--envs-per-actor", "2", "--actor-timeout-s", "4", *ports.flags("actor")]
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "joined as" not in actor.stderr():
        time.sleep(0.5)
    assert "joined as" in actor.stderr(), actor.describe()
    learner.send_signal(signal.SIGKILL)
    learner.wait(timeout_s=30)
    assert actor.wait(timeout_s=60) == 1, actor.describe()
    log = actor.stderr()
    address = f"tcp://127.0.0.1:{ports.control}"
    assert f"still trying to reach the learner at {address}: no answer for" in log, actor.describe()
    assert "learner silent for 12 s" in log, actor.describe()
    for name in e2e.leftover_segments():  # the killed learner could not unlink its buffers
        (Path("/dev/shm") / name).unlink(missing_ok=True)
