"""``oakemu monitor``: fails fast without a learner, JSON / once output, clean exit on signals."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from oakemu_core.run.telemetry import ActorTelemetry, TelemetryPublisher, TelemetrySnapshot
from oakemu_services import monitor

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_snapshot(step: int = 100, *, is_update: bool = False, **overrides) -> TelemetrySnapshot:
    fields = dict(
        time=time.time(), run_name="monitor-test", env_id="CartPole-v1", global_step=step, sps=321.0,
        policy_version=step // 100, iterations=step // 100, episodes=7, episodic_return_mean=18.5,
        episodic_return_min=9.0, episodic_return_max=31.0, episodic_length_mean=18.5, policy_loss=-0.01,
        value_loss=2.5, entropy=0.68, approx_kl=0.002, clip_fraction=0.05, explained_variance=0.1,
        learning_rate=2.5e-4, buffer_fill=0.25, rejected_messages={"garbage": 3},
        dropped={"stale_rows": 8}, policy_lag_min=0.0, policy_lag_mean=0.5, policy_lag_max=1.0,
        actors=[ActorTelemetry(actor_id="actor-a", incarnation="f00d", num_envs=4, sps=160.0, policy_lag=0.5,
                               last_heard_s=0.2),
                ActorTelemetry(actor_id="actor-b", incarnation="beef", num_envs=4, sps=161.0, policy_lag=0.5,
                               last_heard_s=0.3)],
        is_update=is_update,
    )
    fields.update(overrides)
    return TelemetrySnapshot(**fields)


@contextmanager
def publishing(next_snapshot: Callable[[int], TelemetrySnapshot | None], period_s: float = 0.05) -> Iterator[str]:
    """Publish ``next_snapshot(i)`` every ``period_s`` from a thread; ``None`` stops publishing."""
    publisher = TelemetryPublisher("tcp://127.0.0.1:*")
    stop = threading.Event()

    def loop() -> None:
        index = 0
        while not stop.is_set():
            snapshot = next_snapshot(index)
            if snapshot is None:
                return
            publisher.publish(snapshot)
            index += 1
            stop.wait(period_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield publisher.address
    finally:
        stop.set()
        thread.join(timeout=5)
        publisher.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def monitor_command(*args: str) -> list[str]:
    if (REPO_ROOT / "services" / "cli.py").exists():
        return [sys.executable, "-m", "oakemu_services.cli", "monitor", *args]
    return [sys.executable, "-c", "import sys; from oakemu_services.monitor import main; sys.exit(main(sys.argv[1], "
            "json_output='--json' in sys.argv, once='--once' in sys.argv, timeout_s=2.0))", *args]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return env


def run_monitor(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(monitor_command(*args), cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout_s)


def test_once_without_learner_fails_fast_with_a_clear_message():
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run_monitor("--connect", address, "--once", "--timeout", "2")
    elapsed = time.monotonic() - start
    assert result.returncode == monitor.EXIT_NO_TELEMETRY != 0
    assert f"no telemetry from {address}" in result.stderr
    assert "is the learner running?" in result.stderr
    assert result.stdout == ""
    assert elapsed < 30  # 2 s of waiting plus interpreter start-up, never a hang


def test_main_without_learner_returns_after_the_timeout(capsys):
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    assert monitor.main(address, once=True, timeout_s=0.5) == monitor.EXIT_NO_TELEMETRY
    assert 0.4 < time.monotonic() - start < 5
    assert f"no telemetry from {address} within 0.5 s" in capsys.readouterr().err


def test_bad_address_is_reported_not_raised(capsys):
    assert monitor.main("nonsense-address", once=True, timeout_s=0.5) == monitor.EXIT_BAD_ADDRESS
    assert "nonsense-address" in capsys.readouterr().err


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        monitor.main("tcp://127.0.0.1:1", timeout_s=0)


def test_json_once_prints_one_parseable_snapshot():
    expected = make_snapshot(500)
    with publishing(lambda i: expected) as address:
        result = run_monitor("--connect", address, "--json", "--once", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data == json.loads(json.dumps(expected.model_dump(mode="python")))
    assert data["global_step"] == 500 and [a["actor_id"] for a in data["actors"]] == ["actor-a", "actor-b"]
    for field in ("sps", "episodes", "episodic_return_mean", "policy_loss", "approx_kl", "clip_fraction",
                  "learning_rate", "policy_version", "buffer_fill", "rejected_messages", "dropped"):
        assert field in data


def test_json_prints_first_then_only_updates_and_exits_when_the_learner_goes_silent():
    silence = threading.Event()

    def script(i: int) -> TelemetrySnapshot | None:  # a heartbeat per tick, every 10th an update
        return None if silence.is_set() else make_snapshot(100 + i, is_update=(i % 10 == 9))

    with publishing(script) as address:
        process = subprocess.Popen(monitor_command("--connect", address, "--json", "--timeout", "1.5"),
                                   cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            lines = [process.stdout.readline() for _ in range(3)]  # the first snapshot and two updates
            silence.set()
            rest, stderr = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == monitor.EXIT_NO_TELEMETRY, stderr
    assert f"no telemetry from {address} for 1.5 s" in stderr
    records = [json.loads(line) for line in lines + rest.splitlines() if line.strip()]
    assert len(records) >= 3
    assert all(record["is_update"] for record in records[1:])
    steps = [record["global_step"] for record in records]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert all(step % 10 == 9 for step in steps[1:])


def test_snapshot_to_json_turns_non_finite_floats_into_null():
    snapshot = make_snapshot(explained_variance=math.nan, value_loss=math.inf)
    data = json.loads(monitor.snapshot_to_json(snapshot))
    assert data["explained_variance"] is None and data["value_loss"] is None
    assert data["policy_loss"] == -0.01


def test_once_view_shows_the_figures_and_the_actor_table():
    with publishing(lambda i: make_snapshot(12345)) as address:
        result = run_monitor("--connect", address, "--once", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("CartPole-v1", "12,345", "Actors (2)", "actor-a", "actor-b", "garbage", "stale_rows",
                 "approx KL", "policy version", "18.50"):
        assert text in out, f"{text!r} missing from:\n{out}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_live_view_exits_cleanly_on_ctrl_c_and_sigterm(sig):
    with publishing(lambda i: make_snapshot(100 + i)) as address:
        process = subprocess.Popen(monitor_command("--connect", address, "--timeout", "10"), cwd=REPO_ROOT,
                                   env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(4.0)  # interpreter start-up, first snapshot, a few redraws
            assert process.poll() is None, process.communicate()
            process.send_signal(sig)
            stdout, stderr = process.communicate(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "monitor-test" in stdout
