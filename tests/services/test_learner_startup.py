"""The learner refuses to start when /dev/shm cannot hold its two rollout buffers."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.learner_setup import (
    NUM_ROLLOUT_BUFFERS,
    learner_torch_threads,
    rollout_buffer_bytes,
)
from oakemu_core.storage.memory import shm_free_bytes

REPO = Path(__file__).resolve().parents[2]


def _free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    return ports


def _cartpole_learner_config(tmp_path: Path, run_name: str) -> OakEmuConfig:
    """A small CartPole learner on free loopback ports, metrics (Prometheus) on."""
    data, control, weights, telemetry, metrics = _free_ports(5)
    return OakEmuConfig(
        env_id="CartPole-v1",
        num_actors=1,
        envs_per_actor=2,
        num_envs=2,
        rollout_length=8,
        runs_dir=tmp_path,
        run_name=run_name,
        bind_host="127.0.0.1",
        data_port=data,
        control_port=control,
        weights_port=weights,
        telemetry_port=telemetry,
        metrics_port=metrics,
        log_level="WARNING",
    )


def test_rollout_buffer_bytes_matches_a_real_buffer() -> None:
    """The learner's /dev/shm figure is what a buffer of the run's schema really allocates: every
    stored field (here Taxi's masks too) plus column_steps and the 3-slot meta array."""
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

    for env_id in ("CartPole-v1", "Taxi-v4", "Pendulum-v1"):
        config = OakEmuConfig(
            env_id=env_id, envs_per_actor=3, num_envs=6, rollout_length=10, mode="async"
        )
        schema = schema_for_env(env_spec(config.env_id))
        with RolloutBuffer(10, 6, schema=schema) as buffer:
            array_bytes = (
                sum(buffer.field(f.name).nbytes for f in schema.stored)
                + buffer.column_steps.nbytes
                + 3 * 8
            )
            assert buffer.memory_bytes == array_bytes
        assert rollout_buffer_bytes(config, schema) == array_bytes


def test_learner_refuses_a_rollout_that_does_not_fit_in_dev_shm(tmp_path: Path) -> None:
    # An Atari rollout far larger than /dev/shm: the learner must stop at start-up with the size it needs.
    free = shm_free_bytes("/dev/shm")
    per_env_step = 4 * 84 * 84
    rollout_length = 8
    num_envs = int(free // (NUM_ROLLOUT_BUFFERS * rollout_length * per_env_step)) + 8
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oakemu_services.cli",
            "learner",
            "--env-id",
            "ALE/Breakout-v5",
            "--mode",
            "async",
            "--envs-per-actor",
            "8",
            "--num-envs",
            str(num_envs),
            "--rollout-length",
            str(rollout_length),
            "--runs-dir",
            str(tmp_path),
            "--run-name",
            "too-big",
            "--metrics-port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    output = " ".join((result.stdout + result.stderr).split())
    needed = re.search(r"need (\d+) bytes", output)
    assert needed, output
    config = OakEmuConfig(
        env_id="ALE/Breakout-v5",
        envs_per_actor=8,
        num_envs=num_envs,
        rollout_length=rollout_length,
        mode="async",
    )
    assert int(needed.group(1)) == NUM_ROLLOUT_BUFFERS * rollout_buffer_bytes(
        config, schema_for_env(env_spec(config.env_id))
    )
    assert "shm_size" in output
    assert "Traceback" not in output


def test_a_learner_that_fails_to_start_releases_what_it_made(tmp_path: Path) -> None:
    """A start that fails at its last step (the telemetry port is taken) leaves no file descriptor
    (hand-back pipe, sockets, log files) and no shared-memory segment behind (conftest's leak check)."""
    import os

    import pytest
    from oakemu_services.learner import Learner

    from oakemu_core.run.telemetry import TelemetryBindError
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = _free_ports(4)  # for the other sockets
        config = OakEmuConfig(
            env_id="CartPole-v1",
            envs_per_actor=2,
            num_envs=2,
            rollout_length=8,
            runs_dir=tmp_path,
            run_name="taken",
            bind_host="127.0.0.1",
            data_port=ports[0],
            control_port=ports[1],
            weights_port=ports[2],
            metrics_port=ports[3],
            telemetry_port=taken.getsockname()[1],
            log_level="WARNING",
        )
        with RolloutBuffer(8, 2, schema=schema_for_env(env_spec("CartPole-v1"))):
            pass  # shared memory's resource tracker opens its pipe once per process: before the snapshot
        open_fds = set(os.listdir("/proc/self/fd"))
        with pytest.raises(TelemetryBindError):
            Learner(config, tmp_path / "taken")
        assert set(os.listdir("/proc/self/fd")) - open_fds == set()


def test_a_joining_actor_gets_steps_per_message_for_its_own_env_count(tmp_path: Path) -> None:
    """K is computed from the joining actor's envs, not from the configured envs_per_actor or the
    buffer's columns: 128 env steps per message at most, rollout_length 1024."""
    from oakemu_services.learner import Learner

    from oakemu_core.transport.control import JoinRequest, decode_message

    ports = _free_ports(5)
    config = OakEmuConfig(
        env_id="CartPole-v1",
        num_actors=1,
        envs_per_actor=16,
        num_envs=16,
        rollout_length=1024,
        runs_dir=tmp_path,
        run_name="join",
        data_port=ports[0],
        control_port=ports[1],
        weights_port=ports[2],
        telemetry_port=ports[3],
        metrics_port=ports[4],
        log_level="WARNING",
    )
    learner = Learner(config, tmp_path / "join")
    try:
        for num_envs, expected in ((16, 8), (2, 32), (4, 32), (8, 16)):
            request = JoinRequest(f"a{num_envs}", "inc", num_envs, "h")
            reply = decode_message(
                learner.control_server.grant_join(request, 0.0, None), max_bytes=2**24
            )
            assert reply.spec.num_envs == num_envs and reply.spec.steps_per_message == expected, (
                num_envs
            )
    finally:
        learner.close()


def _precision_learner(tmp_path: Path, env_id: str):
    from oakemu_services.learner import Learner

    ports = _free_ports(5)
    config = OakEmuConfig(
        env_id=env_id,
        num_actors=1,
        envs_per_actor=2,
        rollout_length=8,
        runs_dir=tmp_path,
        run_name="precision",
        data_port=ports[0],
        control_port=ports[1],
        weights_port=ports[2],
        telemetry_port=ports[3],
        metrics_port=ports[4],
        log_level="WARNING",
    )
    return Learner(config, tmp_path / "precision")


def _join(learner, actor_id: str, precision: str):
    """A join request through the learner's control handling (peer binding and refusals included)."""
    from oakemu_core.transport.control import JoinRequest, decode_message, encode_join_request

    request = JoinRequest(actor_id, f"inc-{actor_id}", 2, "h", inference_precision=precision)
    [(_, frame)] = learner.control_server.reply(
        decode_message(encode_join_request(request), max_bytes=2**24), 0.0
    )
    return decode_message(frame, max_bytes=2**26)


def test_an_actor_acting_in_bfloat16_turns_on_the_reevaluation_of_every_rollout(
    tmp_path: Path,
) -> None:
    """The join request's precision reaches the library learner: float32 actors leave rollouts of the
    current version as they are, the first bfloat16 actor makes every rollout re-evaluated."""
    learner = _precision_learner(tmp_path, "ALE/Breakout-v5")
    try:
        assert _join(learner, "a", "float32").accepted
        assert learner.control_server.reevaluate_every_rollout is False
        assert _join(learner, "b", "bfloat16").accepted
        assert learner.control_server.reevaluate_every_rollout is True
    finally:
        learner.close()


def test_a_bfloat16_actor_is_refused_with_the_reason_where_the_env_has_no_images(
    tmp_path: Path,
) -> None:
    """It would fail to build its forward passes: refused at join (not restarted by ``oakemu train``),
    and the learner does not start re-evaluating every rollout for it."""
    learner = _precision_learner(tmp_path, "CartPole-v1")
    try:
        reply = _join(learner, "b", "bfloat16")
        assert not reply.accepted and "only for uint8 image observations" in reply.reason
        assert learner.control_server.reevaluate_every_rollout is False
        assert _join(learner, "a", "float32").accepted
    finally:
        learner.close()


def test_the_trainer_hands_publish_min_sgd_steps_to_the_learner(tmp_path: Path) -> None:
    """``publish_min_sgd_steps`` reaches the library learner in async mode (sync publishes no revisions)."""
    from oakemu_core.algo.trainer import Trainer
    from oakemu_core.config import resolved_device

    for mode, expected_sink in (("async", True), ("sync", False)):
        config = OakEmuConfig(
            env_id="CartPole-v1",
            num_actors=1,
            envs_per_actor=2,
            num_envs=2,
            rollout_length=8,
            mode=mode,
            publish_min_sgd_steps=7,
            runs_dir=tmp_path,
            log_level="WARNING",
        )
        spec = env_spec(config.env_id)
        trainer = Trainer(
            config, spec, schema_for_env(spec), tmp_path / mode, device=resolved_device(config)
        )
        try:
            assert (trainer.ppo.revision_sink is not None) == expected_sink
            if expected_sink:
                assert trainer.ppo.revision_min_sgd_steps == 7
        finally:
            trainer.handshake.close()


def test_a_closed_learner_releases_what_it_made(tmp_path: Path) -> None:
    """close() writes the final checkpoint, then releases the one list __init__ registered: no file
    descriptor (pipe, sockets, Prometheus' server, log files) and no shared-memory segment is left,
    and a second close() releases nothing twice."""
    import os

    from oakemu_services.learner import Learner

    from oakemu_core.storage.rollout_buffer import RolloutBuffer

    config = _cartpole_learner_config(tmp_path, "closed")
    assert config.metrics_enabled
    with RolloutBuffer(8, 2, schema=schema_for_env(env_spec("CartPole-v1"))):
        pass  # shared memory's resource tracker opens its pipe once per process: before the snapshot
    open_fds, segments = set(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm"))
    learner = Learner(config, tmp_path / "closed")
    assert set(os.listdir("/dev/shm")) - segments, "the learner's buffers live in /dev/shm"
    released_at_checkpoint = []
    checkpoint = learner.trainer.checkpoint

    def checkpoint_and_look() -> Path | None:
        released_at_checkpoint.append((learner.buffers[0]._closed, learner.context.closed))
        return checkpoint()

    learner.trainer.checkpoint = checkpoint_and_look
    learner.close()
    assert released_at_checkpoint == [(False, False)], (
        "the final checkpoint comes before the release"
    )
    assert list((tmp_path / "closed").glob("checkpoints/*.pt"))
    assert set(os.listdir("/proc/self/fd")) - open_fds == set()
    assert set(os.listdir("/dev/shm")) - segments == set()
    learner.close()  # idempotent: nothing left to release


def test_the_pipe_outlives_a_trainer_that_did_not_stop_in_time(tmp_path: Path) -> None:
    """A trainer thread still alive after stop() timed out may still hand back a result: the first
    close() keeps the hand-back pipe open (a reused fd would get its write), a close() after the
    thread ended releases it."""
    import threading

    from oakemu_services.learner import Learner

    learner = Learner(_cartpole_learner_config(tmp_path, "late"), tmp_path / "late")
    finish = threading.Event()
    learner.trainer._thread = threading.Thread(
        target=finish.wait, daemon=True
    )  # a trainer deaf to stop()
    learner.trainer._thread.start()
    learner.trainer.stop = lambda timeout_s=60.0: None  # as if the join timed out
    pipe = learner.trainer.handshake
    try:
        learner.close()
        assert pipe.wake_fd != -1, "closed under a trainer that may still write to it"
    finally:
        finish.set()
        learner.trainer._thread.join()
        learner.close()
    assert pipe.wake_fd == -1


def test_a_cpu_learner_keeps_image_convolutions_channels_last(tmp_path: Path) -> None:
    """On the CPU the learner's CNN is channels-last (oneDNN's faster layout); an MLP stays as built."""
    from oakemu_core.algo.trainer import Trainer
    from oakemu_core.config import resolved_device

    for env_id, expected in (("ALE/Breakout-v5", True), ("CartPole-v1", False)):
        config = OakEmuConfig(
            env_id=env_id,
            num_actors=1,
            envs_per_actor=2,
            num_envs=2,
            rollout_length=8,
            device="cpu",
            runs_dir=tmp_path,
            log_level="WARNING",
        )
        spec = env_spec(config.env_id)
        trainer = Trainer(
            config,
            spec,
            schema_for_env(spec),
            tmp_path / env_id.replace("/", "-"),
            device=resolved_device(config),
        )
        try:
            assert trainer.learner_model.model.channels_last is expected, env_id
        finally:
            trainer.handshake.close()


def test_the_trainers_final_checkpoint_records_the_counters_reported_last(tmp_path: Path) -> None:
    """The ingest thread reports the run's counters through the handshake; when the trainer stops,
    its thread writes the final checkpoint with them."""
    from oakemu_core.algo.handshake import RunProgress
    from oakemu_core.algo.trainer import Trainer
    from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint

    config = OakEmuConfig(
        env_id="CartPole-v1",
        num_actors=1,
        envs_per_actor=2,
        num_envs=2,
        rollout_length=8,
        device="cpu",
        eval_every_updates=0,
        runs_dir=tmp_path,
        log_level="WARNING",
    )
    spec = env_spec(config.env_id)
    trainer = Trainer(config, spec, schema_for_env(spec), tmp_path / "final", device="cpu")
    try:
        trainer.start(lambda: 123)
        trainer.handshake.report(RunProgress(global_step=123, episodes=4))
        trainer.stop()
        assert not trainer.running
        state = load_checkpoint(latest_checkpoint(tmp_path / "final"))
        assert (state["global_step"], state["episodes"]) == (123, 4)
        (final,) = trainer.handshake.results()
        assert final.slot is None
    finally:
        trainer.close()


def test_an_mlp_learner_takes_one_torch_thread_a_cnn_learner_torch_default_unless_given() -> None:
    assert learner_torch_threads(None, has_convolutions=False) == 1
    assert learner_torch_threads(None, has_convolutions=True) is None
    assert learner_torch_threads(3, has_convolutions=False) == 3
    assert learner_torch_threads(2, has_convolutions=True) == 2
