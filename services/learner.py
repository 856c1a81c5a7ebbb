"""Learner process: owns the shared-memory rollout buffers, ingests actor steps, trains PPO, publishes weights.

Two threads, each owning its state:

- the *ingest* thread (main thread) owns every socket, polls them and frames their messages: it
  serves joins and heartbeats (:class:`~oakemu_core.transport.control_server.ControlServer`), hands
  the step messages its :class:`~oakemu_core.transport.step_source.SocketStepSource` reads to the
  :class:`~oakemu_core.algo.ingest_loop.IngestLoop` (books, actor expiry, budget and stop) that
  writes them into the filling buffer (:class:`RolloutAssembler`), hands full buffers to the
  trainer, publishes weights (one :class:`~oakemu_core.transport.published.PublishedWeights`) and
  telemetry, and stops reading step messages while no buffer is filling (back-pressure: actors
  then block in ``send``, or wait for a free step-ring slot);
- the *trainer* thread (:class:`~oakemu_core.algo.trainer.Trainer`) owns the model and optimizer:
  for each full buffer it drops rows that are too stale, computes GAE on the CPU, runs one PPO
  update on the device and returns new weights; it writes the periodic checkpoints and, once
  stopped, evaluates the final weights and writes the final checkpoint.

Run with ``oakemu learner`` or ``python -m oakemu_services.learner``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import zmq
from oakemu_services.runtime import (
    INTERRUPTED_EXIT_STATUS,
    claim_ports,
    claim_run_dir,
    install_stop_signals,
    interrupted_status,
    setup_logging,
    socket_buffer_bytes,
    startup_done,
)

from oakemu_core.algo.handshake import TrainResult, WeightsRevision
from oakemu_core.algo.health import RunCollapsedError
from oakemu_core.algo.ingest_loop import IngestLoop
from oakemu_core.algo.trainer import Trainer
from oakemu_core.config import OakEmuConfig, resolved_device, to_toml
from oakemu_core.envs import env_spec
from oakemu_core.envs.factory import check_env
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import CheckpointWriteFailed
from oakemu_core.run.learner_outputs import LearnerOutputs
from oakemu_core.run.learner_setup import (
    learner_torch_threads,
    log_ingest_summary,
    make_step_rings,
    num_rollout_buffers,
    peer_logs,
    ring_offerer,
    rollout_buffer_bytes,
)
from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.run.prometheus import PrometheusExporter
from oakemu_core.run.run_folder import check_resume_folder, format_changes, write_text_atomic
from oakemu_core.run.tracking import check_tracker_available
from oakemu_core.shared_memory import sweep_stale_segments
from oakemu_core.step_schema import StepSchema
from oakemu_core.storage.actors import ActorRegistry
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.memory import (
    SharedMemoryTooSmallError,
    ensure_shm_capacity,
)
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.auth import PeerBinding, TransportSecurityError, server_security
from oakemu_core.transport.channels import StepReceiver
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    StopNotice,
    WeightsMessage,
    decode_message,
    encode_stop,
    encode_weights,
)
from oakemu_core.transport.control_server import ControlServer, step_spec_for
from oakemu_core.transport.peer_limits import PeerLimits
from oakemu_core.transport.published import PublishedWeights
from oakemu_core.transport.step_ring import shared_memory_host_id
from oakemu_core.transport.step_source import SocketStepSource
from oakemu_core.transport.steps import StepMessage

log = logging.getLogger("oakemu.learner")

TELEMETRY_PERIOD_S = 1.0
RECV_BATCH = 64
"""Step messages read per loop turn before serving control messages again."""
CONTROL_BATCH = 64
"""Control requests served per loop turn."""
MAX_CONTROL_MESSAGE_BYTES = 1 << 20
"""Joins, heartbeats and leaves are tiny; ZeroMQ drops a peer that sends more."""


def send_replies(control: zmq.Socket, replies: list[tuple[Any, bytes]]) -> None:
    """Send ``(envelope, frame)`` control replies on the ROUTER socket ``control``: ``envelope`` is the
    request's frames before its empty delimiter (routing id, and the request id of a REQ_CORRELATE socket)."""
    for to, reply in replies:
        control.send_multipart([*to, b"", reply])


def is_request_envelope(parts: list[Any]) -> bool:
    """Whether a control message's frames are a REQ envelope: ``[routing id, empty, body]``, or
    ``[routing id, request id (4 bytes), empty, body]`` from a REQ_CORRELATE socket."""
    return (len(parts) == 3 or (len(parts) == 4 and len(parts[1].bytes) == 4)) and parts[
        -2
    ].bytes == b""


def bind_sockets(
    context: zmq.Context, config: OakEmuConfig, schema: StepSchema, security: Any
) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
    """The learner's step (PULL), control (ROUTER) and weights (PUB) sockets, bound to their ports
    (``security``: CURVE server settings, or None)."""

    def secure(sock: zmq.Socket) -> zmq.Socket:
        return security.apply(sock) if security is not None else sock

    data = secure(context.socket(zmq.PULL))
    # A small receive queue: back-pressure reaches the actors quickly, and rows stay fresh.
    data.setsockopt(zmq.RCVHWM, 4)
    typical = step_spec_for(config, schema, config.envs_per_actor, step_ring=False)  # remote
    data.setsockopt(zmq.RCVBUF, socket_buffer_bytes(typical.message_bytes()))
    data.setsockopt(zmq.LINGER, 0)
    # Memory guard: ZeroMQ drops a peer that sends more than this (never allocated). Messages
    # between max_message_bytes and this bound are received, rejected and counted ("oversized").
    data.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message_bytes)
    data.bind(config.bind_address(config.data_port))
    control = secure(context.socket(zmq.ROUTER))
    control.setsockopt(zmq.LINGER, 0)
    # An actor's reconnected socket keeps its routing id (auth.py).
    control.setsockopt(zmq.ROUTER_HANDOVER, 1)
    control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
    control.bind(config.bind_address(config.control_port))
    weights = secure(context.socket(zmq.PUB))
    weights.setsockopt(zmq.SNDHWM, 2)
    weights.setsockopt(zmq.LINGER, 0)
    weights.bind(config.bind_address(config.weights_port))
    return data, control, weights


class Learner:
    """The learner process: sockets and the ingest loop in this thread, a :class:`Trainer` in another.

    Args:
        config: the run's configuration. run_dir: the run folder (resumed from its latest checkpoint).
        trainer: the training side; None builds a :class:`Trainer` for ``config`` on its resolved device.
            A given trainer is owned from now on (closed with the learner, also when the start fails).
    """

    def __init__(self, config: OakEmuConfig, run_dir: Path, trainer: Trainer | None = None) -> None:
        # A start that fails half-way (a port in use, a bad checkpoint) releases what it made: the
        # hand-back pipe, the shared-memory segments, the sockets and the log files.
        # close() releases the same list, in reverse order, after the final checkpoint.
        self.config = config
        self.run_dir = run_dir
        with contextlib.ExitStack() as undo:
            self._build_training(trainer, undo)
            self._build_ingest(undo)
            self._build_outputs(undo)
            self._release = undo.pop_all()

    def _build_training(self, trainer: Trainer | None, undo: contextlib.ExitStack) -> None:
        """The trainer (resumed, behaviour-cloned) and the shared-memory rollout buffers."""
        config = self.config
        if trainer is not None:
            undo.callback(trainer.close)
        self.spec = (
            trainer.spec
            if trainer is not None
            else env_spec(
                config.env_id, settings_file=config.emulator_settings, options=config.env_options
            )
        )
        self.schema = (
            trainer.schema if trainer is not None else schema_for_env(self.spec, config.network)
        )
        self.buffer_bytes = rollout_buffer_bytes(config, self.schema)
        # Free what a killed learner left behind, then refuse now with the size needed, instead of
        # a bus error on the first write later.
        for name in sweep_stale_segments():
            log.warning("removed shared-memory segment %s left by a dead process", name)
        ensure_shm_capacity(num_rollout_buffers(config) * self.buffer_bytes)
        if trainer is None:
            trainer = Trainer(
                config, self.spec, self.schema, self.run_dir, device=resolved_device(config)
            )
            undo.callback(trainer.close)
        self.trainer = trainer
        self.trainer.resume()
        self.buffers: list[RolloutBuffer] = []
        for _ in range(num_rollout_buffers(config)):
            self.buffers.append(
                RolloutBuffer(config.rollout_length, config.allocated_num_envs, schema=self.schema)
            )
            undo.callback(self.buffers[-1].close)  # also when the next one fails
        # Behaviour cloning runs before the first weights are published: no actor ever acts with
        # the pre-BC policy on rows that PPO would then train with the post-BC one.
        bc_updates = self.trainer.ppo.behaviour_cloning_phase()
        if bc_updates:
            log.info(
                "behaviour cloning: %d replay-only updates on %s", bc_updates, config.bc_dataset
            )

    def _build_ingest(self, undo: contextlib.ExitStack) -> None:
        """The sockets, the actor registry with everything it releases, the assembler, the control
        server and the ingest loop, around one :class:`PublishedWeights`."""
        config = self.config
        self.published = PublishedWeights(self.trainer.policy_version, self.trainer.weights())
        self.rejection_log = peer_logs()
        # Shared-memory step rings of the actors on this machine (oakemu_core/transport/step_ring.py).
        self.rings = make_step_rings(
            config, reserved_bytes=num_rollout_buffers(config) * self.buffer_bytes
        )
        undo.callback(self.rings.close)
        self._setup_sockets(undo)
        registry = ActorRegistry(peers=self.peers, rings=self.rings)
        self.assembler = RolloutAssembler(
            self.buffers,
            actor_timeout_s=config.actor_timeout_s,
            sync=config.mode == "sync",
            max_policy_lag=config.max_policy_lag,
            planned_columns=config.buffer_num_envs,
            registry=registry,
            published=self.published,
        )
        receiver = StepReceiver(
            self.rings,
            registry.spec_for,
            self.peers.allows,
            max_bytes=config.max_message_bytes,
            notices=self.rejection_log["notices"],
        )
        registry.stacks = receiver.stacks
        self.steps = SocketStepSource(self.data, receiver, self.peers)
        peer_limits = PeerLimits.from_config(config)
        self.control_server = ControlServer(
            config,
            self.schema,
            self.spec.observation_layout,
            self.assembler,
            self.peers,
            self.rejection_log["control"],
            host_id=shared_memory_host_id() if config.step_transport == "auto" else "",
            offer_ring=ring_offerer(
                self.rings,
                config.rollout_length,
                self.rejection_log["notices"],
                synchronous=config.mode == "sync",
            ),
            policy_version=self.published.version,
            weights=self.published.weights,
            notices=self.rejection_log["notices"],
            limits=peer_limits,
        )
        self.loop = IngestLoop(
            self.assembler,
            self.control_server,
            peer_limits=peer_limits,
            total_env_steps=config.total_env_steps,
            rejections=self.rejection_log["data"],
            notices=self.rejection_log["notices"],
            progress=self.trainer.progress,
            trained_env_steps=self.trainer.ppo.trained_env_steps,
        )

    def _build_outputs(self, undo: contextlib.ExitStack) -> None:
        """Metrics, the episodes log, telemetry and the Prometheus endpoint."""
        self.outputs = LearnerOutputs(
            self.config,
            self.run_dir,
            context=self.context,
            security=self.security and self.security.for_role("monitor"),
            start_steps=self.assembler.counters.env_steps,
            undo=undo,
        )
        self.exit_status = 0

    @property
    def prometheus(self) -> PrometheusExporter | None:
        """The Prometheus endpoint, None when ``metrics_enabled`` is off."""
        return self.outputs.prometheus

    def _setup_sockets(self, undo: contextlib.ExitStack) -> None:
        self.context = zmq.Context()
        undo.callback(self.context.destroy, linger=0)  # closes the sockets made below too
        # The ZAP thread's own log.
        refusals = RateLimitedLog(log, "connections", first_prefix="refused connection")
        # CURVE + ZAP (oakemu_core.transport.auth)
        self.security = server_security(self.context, self.config, refusals)
        if self.security is not None:
            undo.callback(self.security.close)
        # Each actor's messages only from the peer it joined from (and its CURVE key, with CURVE).
        self.peers = PeerBinding(user_ids=self.security is not None)
        self.data, self.control, self.weights_pub = bind_sockets(
            self.context, self.config, self.schema, self.security
        )

    @property
    def policy_version(self) -> int:
        """Version of the newest weights published to the actors."""
        return self.published.version

    # -- control ----------------------------------------------------------------------------
    def _handle_control(self, now: float) -> None:
        for _ in range(CONTROL_BATCH):  # bounded: a flood of requests cannot starve the data path
            try:
                parts = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.assembler.counters.received["control"] += 1
            if not is_request_envelope(parts):  # a peer that does not speak REQ
                self.assembler.counters.rejected["garbage"] += 1
                self.rejection_log["control"].event(
                    "garbage",
                    f"garbage: expected a REQ envelope [identity, (4-byte request id,) empty, body], "
                    f"received {len(parts)} frames (not answered)",
                )
                continue
            identity, envelope, frame = parts[0], tuple(parts[:-2]), parts[-1]
            try:
                message = decode_message(frame.bytes, max_bytes=self.config.max_message_bytes)
            except MessageRejected as error:
                send_replies(self.control, [(envelope, self.control_server.undecodable(error))])
                continue
            # None held: a synchronous-mode join may wait for the next rollout (ControlServer.tick answers it).
            send_replies(
                self.control,
                self.control_server.reply(  # peer: routing id, address and CURVE key (auth.py)
                    message,
                    now,
                    identity=envelope,
                    peer=self.peers.connection(identity, frame),
                    stopping=bool(self.loop.stopping_reason),
                ),
            )

    # -- data -------------------------------------------------------------------------------
    def _handle_data(self, now: float) -> None:
        """Read up to :data:`RECV_BATCH` step messages while the assembler accepts them."""
        for _ in range(RECV_BATCH):
            if not self.assembler.accepting:
                return
            received = self.steps.receive()
            if received is None:
                return
            if not isinstance(received, StepMessage):
                self.loop.refuse_step(received)
                continue
            with self.steps.holding(received):  # written or copied (held) by the end: slot freed
                self.loop.take_step(received, now)

    # -- results ----------------------------------------------------------------------------
    def _hand_off_full_rollouts(self) -> None:
        if self.trainer.handshake.busy:
            return
        rollout = self.assembler.take_full_rollout()
        if rollout is not None:
            self.trainer.handshake.publish(
                rollout,
                self.loop.progress(),
                reevaluate=self.control_server.reevaluate_every_rollout,
            )

    def _collect_results(self) -> None:
        results = self.trainer.handshake.results()
        for position, result in enumerate(results):
            if isinstance(result, WeightsRevision):  # within an update: the actors' weights only
                # Newer weights later in the batch: only those are sent.
                if position == len(results) - 1:
                    self._publish_weights(
                        WeightsMessage(result.policy_version, result.weights, result.revision)
                    )
                continue
            # Published before the release: the joins held for the next rollout get these weights.
            self.control_server.publish(result.policy_version, result.weights)
            if result.slot is not None:
                self.assembler.release(result.slot)
            self._publish_weights(WeightsMessage(result.policy_version, result.weights))
            for event in result.events:
                log.info("%s", event)
            if result.slot is None:  # behaviour-cloning pre-training: new weights, no rollout
                continue
            self.loop.record_result(result)
            step, actors = self.assembler.counters.env_steps, len(self.assembler.actors)
            self.outputs.log_update(result, step, actors=actors, episodes=self.loop.episodes)
            self._publish_telemetry(is_update=True)

    def _publish_weights(self, message: WeightsMessage) -> None:
        self.weights_pub.send(encode_weights(message), copy=False)

    # -- telemetry --------------------------------------------------------------------------
    def _publish_telemetry(self, *, is_update: bool) -> None:
        if self.security is not None and self.security.refused:  # refused by the ZAP authenticator
            self.assembler.counters.rejected["unauthorized_key"] = self.security.refused
        for limiter in self.rejection_log.values():  # the summary of a burst that has ended
            limiter.flush()
        if self.security is not None:
            self.security.flush_log()
        trainer = self.trainer.handshake.trainer_counters  # handed over with the results
        snapshot = self.outputs.telemetry.snapshot(
            self.assembler,
            policy_version=self.published.version,
            iterations=trainer.iterations,
            episodes=self.loop.episodes,
            learning_rate=trainer.learning_rate,
            checkpoint_failures=trainer.checkpoint_failures,
            log_write_failures=self.outputs.write_failures,
            is_update=is_update,
            trained_env_steps=self.loop.trained_env_steps,
        )
        self.outputs.publish(snapshot)

    # -- main loop --------------------------------------------------------------------------
    def run(self, stop_event: threading.Event) -> int:
        """Serve until the env-step budget is spent or ``stop_event`` is set; returns the exit status
        (0, or 1 when the run collapsed or checkpoints kept failing)."""
        config = self.config
        write_text_atomic(self.run_dir / "config.toml", to_toml(config))
        if self.trainer.tester is not None:
            self.trainer.tester.start()
            # The first evaluation: the initial (or behaviour-cloned, or resumed) weights; kept, so a
            # tester still starting evaluates them and not only the newest weights.
            self.trainer.ppo.submit_to_tester(self.assembler.counters.env_steps, force=True)
        self.trainer.start(lambda: self.assembler.counters.env_steps)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        # A result handed back wakes the loop.
        poller.register(self.trainer.handshake.wake_fd, zmq.POLLIN)
        log.info(
            "learner for %s: %d x %d rollout buffers (%.1f MiB each) on %s, device %s, run %s",
            config.env_id,
            config.rollout_length,
            config.allocated_num_envs,
            self.buffer_bytes / 2**20,
            config.bind_host,
            self.trainer.device,
            self.run_dir,
        )
        data_registered, next_telemetry = False, time.monotonic()
        while True:
            training = self.trainer.handshake.busy
            self.loop.check_stop(stop_requested=stop_event.is_set(), training=training)
            if self.loop.stopping_reason and not training:
                log_ingest_summary(self.assembler)
                break
            if self.loop.wants_steps(training) != data_registered:
                data_registered = not data_registered
                if data_registered:
                    poller.register(self.data, zmq.POLLIN)
                else:
                    poller.unregister(self.data)
            events = dict(poller.poll(20))
            now = time.monotonic()
            if self.control in events:
                self._handle_control(now)
            if events.get(self.data):
                self._handle_data(now)
            self.outputs.log_episodes(self.loop.take_episodes(), self.assembler.counters.env_steps)
            if not self._turn_results():
                break
            if not self.loop.stopping_reason:
                self._hand_off_full_rollouts()
                # The synchronous mode's held joins.
                send_replies(self.control, self.control_server.tick(now))
            self.loop.expire(now)
            if now >= next_telemetry:
                self.outputs.telemetry.rates.sample(now, self.assembler.counters.env_steps)
                self._publish_telemetry(is_update=False)
                next_telemetry = now + TELEMETRY_PERIOD_S
        # Tell the actors to stop for a moment, so they exit before we close the sockets: at once on
        # the weights channel, and in the reply to each heartbeat (an actor that missed the notice).
        self.loop.stopping_reason = self.loop.stopping_reason or "the run collapsed"
        self.weights_pub.send(encode_stop(StopNotice(self.loop.stopping_reason)))
        self._drain_control(seconds=min(2.0, config.actor_timeout_s))
        return self.exit_status

    def _turn_results(self) -> bool:
        """Collect the trainer's results; False when the run must stop now (it collapsed, or
        checkpoint writes keep failing: logged, exit status 1, the final checkpoint kept)."""
        try:
            self._collect_results()
        except RuntimeError as error:
            if not isinstance(error.__cause__, (RunCollapsedError, CheckpointWriteFailed)):
                raise
            log.error("%s", error.__cause__)  # a clear stop: no traceback, final checkpoint kept
            self.exit_status = 1
            if isinstance(error.__cause__, CheckpointWriteFailed):
                self.loop.stopping_reason = "checkpoint writes keep failing"
            return False
        return True

    def _drain_control(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.assembler.actors:
            if self.control.poll(50):
                self._handle_control(time.monotonic())

    def close(self) -> None:
        """Stop the trainer (it evaluates the final weights and writes the final checkpoint), log
        what it handed back, then release sockets, loggers and shared memory (idempotent)."""
        try:
            self.trainer.handshake.report(self.loop.progress())
            self.trainer.stop()
            self._log_final_results()
        finally:
            self._release.close()  # what __init__ registered, newest first; empty after the first call
            self.trainer.close()  # again: a trainer that outlived stop() kept the pipe open the first time

    def _log_final_results(self) -> None:
        """The notes and the final weights' evaluations the stopped trainer handed back."""
        try:
            results = self.trainer.handshake.results()
        except (
            RuntimeError
        ) as error:  # the trainer failed after the loop had stopped reading results
            log.error("%s", error.__cause__)
            return
        for result in results:
            if isinstance(result, TrainResult):
                for event in result.events:
                    log.info("%s", event)
                for report in result.evaluations:
                    self.outputs.log_evaluation(report, self.assembler.counters.env_steps)


def main(config: OakEmuConfig) -> int:
    """Entry point of ``oakemu learner``: run until the budget is spent or SIGINT/SIGTERM.

    Returns:
        0 when the budget is spent or after SIGTERM (an orchestrator's stop: ``docker stop``,
        Kubernetes), 130 after Ctrl-C (SIGINT), both after the final checkpoint; 1 when the run
        collapsed, checkpoints kept failing, the final checkpoint was not written (a full disk: logged
        as ``final checkpoint <file> not written: ...``) or ``/dev/shm`` is too small.
    """
    setup_logging(config.log_level, config.log_format)
    # An unknown env id, a missing device or tracker or a port in use fails here, before the run folder exists.
    check_env(config.env_id, settings_file=config.emulator_settings, options=config.env_options)
    check_tracker_available(config.track)
    resolved_device(config)
    # Ports and run folder stay held until this process exits (oakemu train holds them for its learner).
    _ports, (run_dir, _run_lock) = claim_ports(config), claim_run_dir(config)
    # Resuming a folder: say which settings change; refuse (ResumeMismatchError, exit 2) another env,
    # other spaces or model, or a setting that cannot change, before anything in the folder is written.
    changes = check_resume_folder(
        run_dir, config, check_model=False
    ).changes  # the model is checked in restore
    if changes:
        log.warning(
            "resuming %s with changed settings (config.toml -> now): %s",
            run_dir,
            format_changes(changes),
        )
    stop_event = install_stop_signals()
    try:
        learner = Learner(config, run_dir)
    except (
        SharedMemoryTooSmallError,
        TransportSecurityError,
    ) as error:  # a deployment mistake: say what to change, no traceback
        log.error("learner cannot start: %s", error)
        return error.exit_status
    threads = learner_torch_threads(
        config.learner_threads, learner.trainer.learner_model.model.has_convolutions
    )
    if threads is not None:
        import torch  # the learner's model imported it already

        torch.set_num_threads(threads)
    log.info("learner torch threads: %s", threads or "torch's default (one per core)")
    startup_done()
    try:
        status = learner.run(stop_event)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now
        status = INTERRUPTED_EXIT_STATUS
    finally:
        learner.close()
    if (
        learner.trainer.checkpoint_writer.final_saved is None
    ):  # a run without its final checkpoint never exits 0
        if learner.trainer.running:
            log.error(
                "final checkpoint not written: the trainer did not finish its last update in time"
            )
        status = status or 1
    return interrupted_status(status, stop_event)


if __name__ == "__main__":
    from oakemu_services.cli import main as cli_main

    raise SystemExit(cli_main(["learner", *__import__("sys").argv[1:]]))
