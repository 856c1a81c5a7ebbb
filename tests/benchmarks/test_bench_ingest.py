"""benchmarks/bench_ingest.py runs end to end on a tiny budget (the figures themselves are not checked:
speed lives in the benchmark, not in tests)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ingest_benchmark_prints_its_figures_with_cartpole() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench_ingest.py"),
            "--env",
            "CartPole-v1",
            "--seconds",
            "1",
            "--repeats",
            "1",
            "--no-training-load",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rate = re.search(r"^ingest \(env steps/s\)\s+([\d,]+)", result.stdout, re.MULTILINE)
    assert rate is not None and int(rate.group(1).replace(",", "")) > 0, result.stdout
    assert "ingest / memcpy bandwidth:" in result.stdout and "actor cores" in result.stdout, (
        result.stdout
    )


@pytest.mark.slow
def test_replayed_messages_are_taken_by_the_learner_as_real_ones(tmp_path: Path) -> None:
    """bench_ingest's ``--feeder replay``: 64 Breakout messages (stacks deduplicated, a key frame
    first) encoded once and re-sent with fresh headers past the cycle's end (seq 64 is a key frame
    again): the learner writes every row and rejects nothing, as with messages encoded one by one."""
    import threading

    from benchmarks.synthetic_actors import SyntheticActor, no_update_learner
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.transport.frame_stacks import KEYFRAME_MESSAGES
    from tests.e2e_helpers import free_ports

    ports = free_ports(5)
    config = OakEmuConfig(
        env_id="ALE/Breakout-v5",
        num_actors=1,
        envs_per_actor=2,
        num_envs=64,
        mode="async",
        total_env_steps=10**12,
        data_port=ports[0],
        control_port=ports[1],
        weights_port=ports[2],
        telemetry_port=ports[3],
        metrics_port=ports[4],
        runs_dir=tmp_path,
        run_name="replay",
        checkpoint_every_updates=0,
        eval_every_updates=0,
        step_transport="sockets",
        log_level="WARNING",
        actor_timeout_s=300.0,  # encoding the replayed messages sends no heartbeat: minutes on a busy CPU
    )
    learner = no_update_learner(config, tmp_path / "replay")
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
    thread.start()
    actor = SyntheticActor(config.env_id, 2, ports, "replayer", threading.Event(), "sockets")
    try:
        actor.join()
        actor.start_replay()
        assert len(actor.replayed) == KEYFRAME_MESSAGES
        messages = KEYFRAME_MESSAGES + 8
        sent = sum(actor.send_next() for _ in range(messages))
        assert sent == messages and actor.rejoins == 0
        counters = learner.assembler.counters
        expected = messages * actor.env_steps_per_message
        deadline = time.monotonic() + 30
        while counters.env_steps < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counters.env_steps == expected, (
            counters.env_steps,
            expected,
            dict(counters.rejected),
        )
        assert not any(counters.rejected.values()), dict(counters.rejected)
    finally:
        actor.close()
        stop.set()
        thread.join(60)
        learner.close()
