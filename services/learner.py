"""Learner process: owns the shared-memory rollout buffers, ingests actor steps, trains PPO, publishes weights.

Two threads, each owning its state:

- the *ingest* thread (main thread) owns every socket and the :class:`RolloutAssembler`: it serves
  joins and heartbeats, writes step messages into the filling buffer, hands full buffers to the
  trainer, publishes weights and telemetry, and stops reading step messages while no buffer is
  filling (back-pressure: actors then block in ``send``, or wait for a free step-ring slot);
- the *trainer* thread owns the model and optimizer: for each full buffer it drops rows that are too
  stale, computes GAE on the CPU, runs one PPO update on the device and returns new weights;
  it also writes checkpoints.

Run with ``oakemu learner`` or ``python -m oakemu_services.learner``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from oakemu_core.policy.bfloat16_inference import check_supported as check_bfloat16_supported
from oakemu_core.transport.auth import (
    PeerBinding,
    TransportSecurityError,
    public_tag,
    server_security,
)
from oakemu_core.run.checkpoint import (
    CheckpointWriteFailed,
    CheckpointWriter,
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
)
from oakemu_core.config import OakEmuConfig, resolved_device, to_toml
from oakemu_core.envs import EnvSpec, env_spec
from oakemu_core.envs.factory import check_env
from oakemu_core.storage.assembler import RolloutAssembler, SlotState, StepRejected
from oakemu_core.algo.learner import (
    CheckpointPolicy,
    HealthMonitor,
    PPOExperimentConfiguration,
    PPOLearner,
    RolloutHandshake,
    RunCollapsedError,
    RuntimeContext,
    ThreadSafeModel,
    TrainResult,
    WeightsRevision,
)
from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.storage.memory import (
    SharedMemoryTooSmallError,
    ensure_shm_capacity,
)
from oakemu_core.run.metrics import (
    EpisodeWindow,
    JsonLinesWriter,
    MetricsLogger,
    RunStepRates,
    evaluation_scalars,
    update_scalars,
)
from oakemu_core.policy.models import build_model
from oakemu_core.algo.ppo import LinearSchedule, PPOUpdateStats, cpu_has_native_bfloat16
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.run.run_folder import (
    check_resume_compatible,
    check_resume_folder,
    format_changes,
    truncate_run_logs,
)
from oakemu_core.shared_memory import sweep_stale_segments
from oakemu_core.transport.channels import StepReceiver
from oakemu_core.transport.step_ring import StepRings, shared_memory_host_id
from oakemu_core.step_schema import StepSchema, schema_for_env
from oakemu_core.run.telemetry import (
    ActorTelemetry,
    PrometheusExporter,
    TelemetryHistory,
    TelemetryPublisher,
    TelemetrySnapshot,
)
from oakemu_core.run.tester import EvaluationReport, tester_from_config
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    StopNotice,
    WeightsMessage,
    decode_message,
    encode_heartbeat_reply,
    encode_join_reply,
    encode_stop,
    encode_weights,
)
from oakemu_core.transport.steps import StepSpec
from oakemu_services.runtime import (
    install_stop_signals,
    resolve_run_dir,
    setup_logging,
    socket_buffer_bytes,
)

log = logging.getLogger("oakemu.learner")

NUM_ROLLOUT_BUFFERS = 2
"""One buffer fills while the other trains (asynchronous mode; the synchronous mode has one)."""
TELEMETRY_PERIOD_S = 1.0
FINAL_EVALUATION_TIMEOUT_S = 30.0
"""Longest wait (s) for the evaluation of the final weights at exit: shutdown stays prompt even when
a greedy early Atari policy never loses a life (episodes then run to the 27,000-step limit)."""
RECV_BATCH = 64
"""Step messages read per loop turn before serving control messages again."""
CONTROL_BATCH = 64
"""Control requests served per loop turn."""
MAX_CONTROL_MESSAGE_BYTES = 1 << 20
"""Joins, heartbeats and leaves are tiny; ZeroMQ drops a peer that sends more."""
MAX_ACTOR_ENVS = 65_536
"""Largest ``num_envs`` an actor may declare (the wire's limit for one array dimension)."""


def num_rollout_buffers(config: OakEmuConfig) -> int:
    """Rollout buffers the learner allocates: two (double buffering) in the asynchronous mode, one in
    the synchronous mode (its actors wait while the only rollout in flight trains)."""
    return 1 if config.mode == "sync" else NUM_ROLLOUT_BUFFERS


def rollout_buffer_bytes(config: OakEmuConfig, schema: StepSchema) -> int:
    """Shared-memory bytes of one rollout buffer for ``config`` (every stored field of ``schema``)."""
    return RolloutBuffer.estimate_memory_bytes(config.rollout_length, config.buffer_num_envs, schema)


# ------------------------------------------------------------------------------------ trainer
class Trainer:
    """The training side of the learner: model, optimizer, the library's :class:`PPOLearner` (its
    ``run`` loop is the trainer thread), the checkpoint policy and the resume path."""

    def __init__(self, config: OakEmuConfig, spec: EnvSpec, schema: StepSchema, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.spec = spec
        self.schema = schema
        self.device = resolved_device(config)
        torch.manual_seed(config.seed)
        if config.mode == "sync":  # a seed's run reproduces exactly: no nondeterministic kernels
            torch.use_deterministic_algorithms(True, warn_only=True)
        assert schema.distribution is not None
        model = build_model(spec.observation_layout, schema.distribution,
                            normalize_observations=config.normalize_observations).to(self.device)
        if torch.device(self.device).type == "cpu" and model.has_convolutions:  # oneDNN: Breakout updates 1.38 x faster
            model.use_channels_last()
        if config.learner_precision == "bfloat16":
            device = torch.device(self.device)
            if device.type == "cpu" and cpu_has_native_bfloat16() is False:
                log.warning("learner_precision bfloat16: this CPU has neither AVX512-BF16 nor AMX, so bfloat16 is "
                            "emulated and the update is likely slower than with float32")
            elif device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
                log.warning("learner_precision bfloat16: GPUs before compute capability 8 (Ampere) emulate "
                            "bfloat16; the update is likely slower than with float32")
        self.learner_model = ThreadSafeModel(model)
        # The fused kernel (one op for all parameters instead of a Python loop over them) cuts an
        # SGD step of the CartPole MLP by 10-30 % on this CPU; same Adam (CleanRL's eps).
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=1e-5,
                                          fused=torch.device(self.device).type in ("cpu", "cuda"))
        self.schedule = LinearSchedule(config.learning_rate, 0.0, 1)
        self._follow_budget()
        # Periodic evaluation in a process of its own (None when eval_every_updates is 0).
        self.tester = tester_from_config(config, schema.to_dict())
        context = RuntimeContext(PPOExperimentConfiguration.from_config(config), self.device, tester=self.tester,
                                 eval_every_updates=config.eval_every_updates)
        self.ppo = PPOLearner(context, self.learner_model, None, self.optimizer, self.schedule,
                              bc_sampler=self._bc_sampler())
        health = None
        if config.rollback:
            if not config.checkpoint_every_updates and not config.checkpoint_every_seconds:
                log.warning("rollback is on but no checkpoint is written before exit (checkpoint_every_updates "
                            "and checkpoint_every_seconds are 0): a collapse before the first evaluation's "
                            "best.pt stops the run instead of rolling back")
            health = HealthMonitor(max_approx_kl=config.rollback_max_approx_kl,
                                   eval_fraction=config.rollback_eval_fraction,
                                   eval_patience=config.rollback_eval_patience)
        # A failed write (full disk) is logged with the file and the bytes needed/free, counted and
        # retried at the next checkpoint; max_checkpoint_failures in a row raise CheckpointWriteFailed.
        self.checkpoint_writer = CheckpointWriter(run_dir, keep_last=config.keep_checkpoints,
                                                  max_consecutive_failures=config.max_checkpoint_failures)
        self.checkpoints = CheckpointPolicy(
            run_dir, state_fn=self.checkpoint_state, save_fn=self._save, health=health,
            every_updates=config.checkpoint_every_updates, every_seconds=config.checkpoint_every_seconds,
            lr_factor=config.rollback_lr_factor, max_rollbacks=config.max_rollbacks,
        )
        self.handshake = RolloutHandshake()
        if config.mode == "async" and config.publish_every_epoch:  # weights after each epoch, to the actors
            self.ppo.revision_sink = lambda version, revision, weights: self.handshake.complete(
                WeightsRevision(version, revision, weights))
            self.ppo.revision_max_approx_kl = config.rollback_max_approx_kl if config.rollback else None
            self.ppo.revision_min_sgd_steps = config.publish_min_sgd_steps
        self.global_step = 0
        self.episodes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _follow_budget(self) -> None:
        # The schedule keeps its progress but follows this run's budget and learning rate: a resume
        # with a larger --total-env-steps must not continue at the old run's final learning rate 0.
        config = self.config
        self.schedule.start = config.learning_rate
        self.schedule.end = 0.0 if config.anneal_lr else config.learning_rate
        self.schedule.total_updates = max(1, math.ceil(config.total_env_steps / config.batch_size))

    def _bc_sampler(self) -> Any:
        if self.config.bc_dataset is None:
            return None
        from oakemu_core.algo.demonstrations import DemonstrationSampler

        return DemonstrationSampler(self.config.bc_dataset, self.spec)

    # -- state ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.ppo.policy_version

    def weights(self) -> dict[str, np.ndarray]:
        return self.learner_model.snapshot()[1]

    def restore(self, path: Path) -> dict[str, Any]:
        """Load model, optimizer, schedule, counters and RNG state from a checkpoint file."""
        state = load_checkpoint(path, map_location=self.device)
        # Another env, other spaces or another model: refuse (ResumeMismatchError, exit 2) before
        # anything is loaded or anything in the run folder is written.
        check_resume_compatible(state, env_id=self.spec.env_id, schema=self.schema, model=self.ppo.model,
                                checkpoint_path=path)
        self.ppo.load_checkpoint_state(state)
        self._follow_budget()
        restore_rng_state(state["rng"])
        self.global_step = int(state["global_step"])
        self.episodes = int(state["episodes"])
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resume needs, as plain values (see :mod:`oakemu_core.run.checkpoint`)."""
        return {
            **self.ppo.checkpoint_state(),
            "rng": capture_rng_state(),
            "global_step": int(self.global_step),
            "episodes": int(self.episodes),
            "config": self.config.model_dump(mode="json"),
            "env": {"env_id": self.spec.env_id, "schema": self.schema.to_dict()},
        }

    def _save(self, run_dir: Path, update: int, state: dict[str, Any]) -> Path | None:
        """None when the write failed (logged, counted); CheckpointWriteFailed after too many in a row."""
        return self.checkpoint_writer.save(update, state)

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (the final one at exit)."""
        return self.checkpoints.final(self.ppo)

    # -- thread -----------------------------------------------------------------------------
    def start(self, current_step: Any) -> None:
        """Start :meth:`PPOLearner.run` in the trainer thread."""
        self._thread = threading.Thread(
            target=self.ppo.run, args=(self._stop, current_step, self.handshake, self.checkpoints),
            name="oakemu-trainer", daemon=True,
        )
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """The trainer thread is alive (still, after a :meth:`stop` that timed out)."""
        return self._thread is not None and self._thread.is_alive()


# ------------------------------------------------------------------------------------ learner
class Learner:
    """The learner process: sockets + assembler in this thread, :class:`Trainer` in another."""

    def __init__(self, config: OakEmuConfig, run_dir: Path) -> None:
        # A start that fails half-way (a port in use, a bad checkpoint) releases what it made: the
        # hand-back pipe, the shared-memory segments, the sockets and the log files.
        # close() releases the same list, in reverse order, after the final checkpoint.
        with contextlib.ExitStack() as undo:
            self._build(config, run_dir, undo)
            self._release = undo.pop_all()

    def _build(self, config: OakEmuConfig, run_dir: Path, undo: contextlib.ExitStack) -> None:
        self.config = config
        self.run_dir = run_dir
        self.spec = env_spec(config.env_id, settings_file=config.emulator_settings)
        self.schema = schema_for_env(self.spec)
        self.buffer_bytes = rollout_buffer_bytes(config, self.schema)
        # Free what a killed learner left behind, then refuse now with the size needed, instead of
        # a bus error on the first write later.
        for name in sweep_stale_segments():
            log.warning("removed shared-memory segment %s left by a dead process", name)
        ensure_shm_capacity(num_rollout_buffers(config) * self.buffer_bytes)
        self.trainer = Trainer(config, self.spec, self.schema, run_dir)
        undo.callback(self._close_handshake)
        resume_from = latest_checkpoint(run_dir)
        if resume_from is not None:
            self.trainer.restore(resume_from)
            log.info("resumed from %s at %d env steps, update %d", resume_from, self.trainer.global_step,
                     self.trainer.ppo.iterations)
            # Records past the checkpoint would be written again by this run: cut them (global_step
            # never goes back in metrics.jsonl / episodes.jsonl, whatever the number of crashes).
            cut = truncate_run_logs(run_dir, self.trainer.global_step)
            if any(cut.values()):
                log.info("removed records past the checkpoint's %d env steps: %s", self.trainer.global_step,
                         ", ".join(f"{name} {count}" for name, count in cut.items() if count))
        self.buffers: list[RolloutBuffer] = []
        for _ in range(num_rollout_buffers(config)):
            self.buffers.append(RolloutBuffer(config.rollout_length, config.buffer_num_envs, schema=self.schema))
            undo.callback(self.buffers[-1].close)  # also when the next one fails
        self.sync = config.mode == "sync"
        self.assembler = RolloutAssembler(self.buffers, actor_timeout_s=config.actor_timeout_s, sync=self.sync,
                                          max_policy_lag=config.max_policy_lag)
        # Synchronous mode: joins wait until num_actors actors have asked, then get their indices in
        # actor-id order (columns and env seeds do not depend on who connected first).
        self._pending_joins: dict[str, tuple[Any, JoinRequest]] = {}
        self._sync_ranks: dict[str, int] = {}
        self.assembler.counters.env_steps = self.trainer.global_step
        # Behaviour cloning runs before the first weights are published: no actor ever acts with
        # the pre-BC policy on rows that PPO would then train with the post-BC one.
        bc_updates = self.trainer.ppo.behaviour_cloning_phase()
        if bc_updates:
            log.info("behaviour cloning: %d replay-only updates on %s", bc_updates, config.bc_dataset)
        self.policy_version = self.trainer.policy_version
        self.latest_weights = self.trainer.weights()
        self.episodes = self.trainer.episodes
        self.window = EpisodeWindow(maxlen=100)
        self.last_stats: PPOUpdateStats | None = None
        self.last_lag: dict[str, float] = {}
        self.trainable_share = 1.0
        self.history = TelemetryHistory()
        self.exit_status = 0
        self.rollbacks = 0
        self.started = time.monotonic()
        # One step counter (assembler.counters.env_steps), two rates: since this learner started
        # (start-up included) and over the last seconds. Sampled at every update and telemetry tick.
        self.rates = RunStepRates(self.started, self.assembler.counters.env_steps)
        self.stopping_reason = ""
        # Rejections are counted exactly; the log gets the first of each reason and a summary every 5 s.
        self.rejection_log = {
            "data": RateLimitedLog(log, "step messages", first_prefix="rejected step message"),
            "control": RateLimitedLog(log, "control messages", first_prefix="rejected control message"),
        }
        # Shared-memory step rings of the actors on this machine (oakemu_core/transport/step_ring.py).
        self.rings = StepRings()
        undo.callback(self.rings.close)
        self.host_id = shared_memory_host_id() if config.step_transport == "auto" else ""
        self._setup_sockets(undo)
        self.metrics = MetricsLogger(run_dir)
        undo.callback(self.metrics.close)
        # One line per finished episode (raw game score), as CleanRL logs charts/episodic_return.
        # Each record is written whole or not at all; a failed write is counted, never fatal.
        self.episodes_log = JsonLinesWriter(run_dir / "episodes.jsonl")
        undo.callback(self.episodes_log.close)
        self.telemetry = TelemetryPublisher(config.bind_address(config.telemetry_port), context=self.context,
                                            security=self.security)
        undo.callback(self.telemetry.close)
        self.prometheus = PrometheusExporter(config.metrics_port) if config.metrics_enabled else None
        if self.prometheus is not None:
            undo.callback(self.prometheus.close)

    def _setup_sockets(self, undo: contextlib.ExitStack) -> None:
        config = self.config
        self.context = zmq.Context()
        undo.callback(self.context.destroy, linger=0)  # closes the sockets made below too
        self.security = server_security(self.context, config)  # CURVE + ZAP when config.curve (oakemu_core.transport.auth)
        if self.security is not None:
            undo.callback(self.security.close)
        # Each actor's messages only from the peer it joined from (and its CURVE key, with CURVE).
        self.peers = PeerBinding(user_ids=self.security is not None)
        self.data = self._secure(self.context.socket(zmq.PULL))
        # A small receive queue: back-pressure reaches the actors quickly, and rows stay fresh.
        self.data.setsockopt(zmq.RCVHWM, 4)
        typical = StepSpec(config.envs_per_actor, self.schema, steps_per_message=config.resolved_steps_per_message(
            self.schema.sent_bytes_per_env(), config.envs_per_actor))
        self.data.setsockopt(zmq.RCVBUF, socket_buffer_bytes(typical.message_bytes()))
        self.data.setsockopt(zmq.LINGER, 0)
        # Memory guard: ZeroMQ drops a peer that sends more than this (never allocated). Messages
        # between max_message_bytes and this bound are received, rejected and counted ("oversized").
        self.data.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message_bytes)
        self.data.bind(config.bind_address(config.data_port))
        self.control = self._secure(self.context.socket(zmq.ROUTER))
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self.control.bind(config.bind_address(config.control_port))
        self.weights_pub = self._secure(self.context.socket(zmq.PUB))
        self.weights_pub.setsockopt(zmq.SNDHWM, 2)
        self.weights_pub.setsockopt(zmq.LINGER, 0)
        self.weights_pub.bind(config.bind_address(config.weights_port))

    def _secure(self, sock: zmq.Socket) -> zmq.Socket:
        return self.security.apply(sock) if self.security is not None else sock

    # -- control ----------------------------------------------------------------------------
    def _handle_control(self, now: float) -> None:
        for _ in range(CONTROL_BATCH):  # bounded: a flood of requests cannot starve the data path
            try:
                parts = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.assembler.counters.received["control"] += 1
            if len(parts) != 3 or parts[1].bytes != b"":  # not [identity, "", body]: a peer that does not speak REQ
                self.assembler.counters.rejected["garbage"] += 1
                self.rejection_log["control"].event(
                    "garbage", f"garbage: expected a REQ envelope [identity, empty, body], received {len(parts)} "
                    "frames (not answered)")
                continue
            identity, _, frame = parts
            try:
                message = decode_message(frame.bytes, max_bytes=self.config.max_message_bytes)
            except MessageRejected as error:
                self.assembler.counters.rejected[error.reason] += 1
                self.rejection_log["control"].event(error.reason, str(error))
                reply = encode_heartbeat_reply(HeartbeatReply(status="rejoin", policy_version=self.policy_version))
                self.control.send_multipart([identity, b"", reply])
                continue
            reply = self._reply(message, now, peer=frame, identity=identity)
            if reply is not None:  # None: a join held until the synchronous mode's actors are all there
                self.control.send_multipart([identity, b"", reply])

    def _reply(self, message: Any, now: float, peer: Any = None, identity: Any = None) -> bytes | None:
        stopping = bool(self.stopping_reason)
        if isinstance(message, (JoinRequest, Heartbeat, Leave)) and not (
            self.peers.bind(message.actor_id, message.incarnation, peer) if isinstance(message, JoinRequest)
            else self.peers.allows(message.actor_id, message.incarnation, peer)
        ):  # another connection speaking for a known actor: refused and counted
            self.assembler.counters.rejected["impersonation"] += 1
            self.rejection_log["control"].event(
                "impersonation", f"impersonation: a {type(message).__name__} for actor {message.actor_id} from another peer")
            if isinstance(message, JoinRequest):
                return encode_join_reply(JoinReply(False, "actor id in use by another connection", -1, None, {},
                                                   self.policy_version))
            return encode_heartbeat_reply(HeartbeatReply(status="rejoin", policy_version=self.policy_version))
        if isinstance(message, JoinRequest):
            if stopping:
                self.assembler.counters.accepted["join_refused"] += 1
                return encode_join_reply(JoinReply(False, "learner is stopping", -1, None, {}, self.policy_version))
            if message.num_envs > MAX_ACTOR_ENVS:
                self.assembler.counters.rejected["schema"] += 1
                reason = f"num_envs: expected at most {MAX_ACTOR_ENVS}, received {message.num_envs}"
                self.rejection_log["control"].event("schema", f"schema: join of actor {message.actor_id}: {reason}")
                return encode_join_reply(JoinReply(False, reason, -1, None, {}, self.policy_version))
            if message.inference_precision == "bfloat16":  # refused before it counts as an actor that rounds
                try:
                    check_bfloat16_supported(self.spec.observation_layout)
                except ValueError as error:
                    self.assembler.counters.accepted["join_refused"] += 1
                    return encode_join_reply(JoinReply(False, str(error), -1, None, {}, self.policy_version))
            if self.sync:
                return self._sync_join(message, now, identity)
            self.assembler.counters.accepted["join"] += 1
            return self._grant_join(message, now, index=None)
        if isinstance(message, Heartbeat):
            known = self.assembler.heartbeat(
                message.actor_id, message.incarnation, now=now,
                env_steps_per_second=message.env_steps_per_second, policy_lag=message.policy_lag,
                episodes=message.episodes,
            )
            self.assembler.counters.accepted["heartbeat" if known else "unknown_actor_control"] += 1
            status = "stop" if stopping else ("ok" if known else "rejoin")
            return encode_heartbeat_reply(HeartbeatReply(status=status, policy_version=self.policy_version))
        if isinstance(message, Leave):
            if self.assembler.leave(message.actor_id, message.incarnation):
                self.assembler.counters.accepted["leave"] += 1
                log.info("actor %s left", message.actor_id)
            else:
                self.assembler.counters.accepted["unknown_actor_control"] += 1
            return encode_heartbeat_reply(HeartbeatReply(status="stop", policy_version=self.policy_version))
        self.assembler.counters.rejected["schema"] += 1
        self.rejection_log["control"].event(
            "schema", f"schema: a {type(message).__name__} is not a request the learner serves")
        return encode_heartbeat_reply(HeartbeatReply(status="rejoin", policy_version=self.policy_version))

    def _grant_join(self, message: JoinRequest, now: float, index: int | None) -> bytes:
        """Register a joining actor (``index``: its synchronous-mode rank, None: the next number)
        and encode the join reply with its spec, env config and the current weights."""
        reachable = self._ring_reachable(message)
        spec = self._step_spec(message, step_ring=reachable)
        ring = self._offer_ring(message, spec) if reachable else None
        if reachable and ring is None:  # no room for a ring: the K of inline messages
            spec = self._step_spec(message, step_ring=False)
        record = self.assembler.join(message.actor_id, message.incarnation, spec, hostname=message.hostname, now=now,
                                     index=index)
        log.info("actor %s joined (%d envs, host %s, index %d)", message.actor_id, message.num_envs,
                 message.hostname, record.index)
        if message.inference_precision == "bfloat16" and not self.trainer.ppo.reevaluate_every_rollout:
            self.trainer.ppo.reevaluate_every_rollout = True
            log.info("actor %s acts in %s: every rollout is re-evaluated in float32 before GAE%s", message.actor_id,
                     message.inference_precision, "" if self.config.off_policy_correction == "decoupled" else
                     " only with off_policy_correction 'decoupled' (the run has 'none': its rounded log-probs "
                     "and values train as they are)")
        env_config = {
            "env_id": self.config.env_id,
            "max_episode_steps": self.config.max_episode_steps,
            "clip_rewards": self.config.resolved_clip_rewards,
            "normalize_observations": self.config.normalize_observations,
            "emulator_settings": self.config.emulator_settings,
            "seed": self.config.seed + 1000 * (record.index + 1),
            # policy routing (oakemu_core/actor/routing.py): the actor routes, the rows arrive non-trainable
            "route_random_first_steps": self.config.route_random_first_steps,
            "route_random_probability": self.config.route_random_probability,
            "route_scripted_policy": self.config.route_scripted_policy,
            "route_scripted_probability": self.config.route_scripted_probability,
            # the synchronous mode: the actor ends a segment every rollout_length steps and waits there
            # for the weights trained on it
            "mode": self.config.mode,
            "rollout_length": self.config.rollout_length,
        }
        return encode_join_reply(
            JoinReply(True, "", record.index, spec, env_config, self.policy_version, self.latest_weights,
                      step_ring=ring)
        )

    def _step_spec(self, message: JoinRequest, *, step_ring: bool) -> StepSpec:
        """The spec of a joining actor's step messages (K without the byte bound for a step ring)."""
        steps = self.config.resolved_steps_per_message(self.schema.sent_bytes_per_env(), message.num_envs,
                                                       step_ring=step_ring)
        return StepSpec(num_envs=message.num_envs, schema=self.schema, steps_per_message=steps)

    def _ring_reachable(self, message: JoinRequest) -> bool:
        """Whether the joining actor may share this process's shared memory: the same kernel and
        ``/dev/shm`` mount (:func:`~oakemu_core.transport.step_ring.shared_memory_host_id`); its attach decides."""
        return bool(self.host_id) and message.host_id == self.host_id

    def _offer_ring(self, message: JoinRequest, spec: StepSpec) -> StepRingOffer | None:
        """A step ring for an actor on this machine, else None (its arrays go inline)."""
        try:
            return self.rings.offer(message.actor_id, message.incarnation, spec, self.config.rollout_length)
        except OSError as error:  # e.g. /dev/shm full: the sockets carry the arrays instead
            log.warning("no step ring for actor %s (%s): its step arrays go inline", message.actor_id, error)
            return None

    def _sync_join(self, message: JoinRequest, now: float, identity: Any) -> bytes | None:
        """Synchronous mode: hold joins until ``num_actors`` actors have asked, then answer them all
        with indices in actor-id order; later joins take their old index or a free one.

        Returns:
            The reply to send now, or None when the join is held (answered later through the
            control socket) or was answered here with the others.
        """
        config = self.config
        if message.num_envs != config.envs_per_actor:
            self.assembler.counters.accepted["join_refused"] += 1
            reason = (f"mode='sync': every actor steps envs_per_actor={config.envs_per_actor} envs, "
                      f"received num_envs={message.num_envs}")
            log.warning("refused actor %s: %s", message.actor_id, reason)
            return encode_join_reply(JoinReply(False, reason, -1, None, {}, self.policy_version))
        self.assembler.counters.accepted["join"] += 1  # a held join counts when it arrives (each retry too)
        if self._sync_ranks:  # the run has started: an actor comes back or replaces one that left
            held = {r.index for r in self.assembler.actors.values() if r.actor_id != message.actor_id}
            rank = self._sync_ranks.get(message.actor_id)
            if rank is None or rank in held:
                free = sorted(set(range(config.num_actors)) - held)
                rank = free[0] if free else None
            if rank is None:
                self.assembler.counters.accepted["join"] -= 1
                self.assembler.counters.accepted["join_refused"] += 1
                reason = f"mode='sync': the run's num_actors={config.num_actors} actors are all connected"
                log.warning("refused actor %s: %s", message.actor_id, reason)
                return encode_join_reply(JoinReply(False, reason, -1, None, {}, self.policy_version))
            self._sync_ranks[message.actor_id] = rank
            return self._grant_join(message, now, index=rank)
        self._pending_joins[message.actor_id] = (identity, message)  # a retry replaces the held request
        if len(self._pending_joins) < config.num_actors:
            log.info("mode='sync': actor %s waits for %d more actor(s) to join", message.actor_id,
                     config.num_actors - len(self._pending_joins))
            return None
        pending, self._pending_joins = self._pending_joins, {}
        for rank, actor_id in enumerate(sorted(pending)):
            self._sync_ranks[actor_id] = rank
            held_identity, request = pending[actor_id]
            self.control.send_multipart([held_identity, b"", self._grant_join(request, now, index=rank)])
        return None

    # -- data -------------------------------------------------------------------------------
    def _handle_data(self, now: float) -> None:
        receiver = StepReceiver(self.rings, self.assembler.spec_for, self.peers.allows,
                                max_bytes=self.config.max_message_bytes)
        for _ in range(RECV_BATCH):
            if not self.assembler.accepting:
                return
            try:
                parts = self.data.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.assembler.counters.received["data"] += 1
            if len(parts) != 1:  # actors send one frame per step message
                self.assembler.counters.rejected["garbage"] += 1
                self.rejection_log["data"].event("garbage", f"garbage: expected 1 frame, received {len(parts)}")
                continue
            frame = parts[0]
            try:
                message = receiver.decode(frame)
            except MessageRejected as error:
                self.assembler.counters.rejected[error.reason] += 1
                self.rejection_log["data"].event(error.reason, str(error))
                continue
            try:
                if not self.peers.allows(message.actor_id, message.incarnation, frame):
                    raise StepRejected("impersonation", f"a step for actor {message.actor_id} from another peer")
                with receiver.holding(message):  # written or copied (held) by the end, or rejected: slot freed
                    self.assembler.ingest(message, current_policy_version=self.policy_version, now=now)
            except StepRejected as error:
                if error.reason != "departed_actor":  # late steps are counted as dropped, not rejected
                    self.assembler.counters.rejected[error.reason] += 1
                    self.rejection_log["data"].event(error.reason, str(error))
                continue
            except MessageRejected as error:
                self.assembler.counters.rejected[error.reason] += 1
                self.rejection_log["data"].event(error.reason, str(error))
                continue
            self.assembler.counters.accepted["step"] += 1
            if message.episode_returns:
                self.episodes += len(message.episode_returns)
                for episode_return, length in zip(message.episode_returns, message.episode_lengths):
                    self.episodes_log.write({
                        "global_step": self.assembler.counters.env_steps, "actor_id": message.actor_id,
                        "policy_version": message.policy_version, "episodic_return": episode_return,
                        "episodic_length": length,
                    })

    # -- results ----------------------------------------------------------------------------
    def _hand_off_full_rollouts(self) -> None:
        if self.trainer.handshake.busy:
            return
        rollout = self.assembler.take_full_rollout()
        if rollout is not None:
            self.trainer.global_step = self.assembler.counters.env_steps
            self.trainer.episodes = self.episodes
            self.trainer.handshake.publish(rollout)

    def _collect_results(self) -> None:
        results = self.trainer.handshake.results()
        for position, result in enumerate(results):
            if isinstance(result, WeightsRevision):  # within an update: the actors' weights only
                if position == len(results) - 1:  # newer weights later in the batch: only those are sent
                    self._publish_weights(WeightsMessage(result.policy_version, result.weights, result.revision))
                continue
            if result.slot is not None:
                self.assembler.release(result.slot, result.policy_version)
            self.policy_version = result.policy_version
            self.latest_weights = result.weights
            self._publish_weights(WeightsMessage(result.policy_version, result.weights))
            for event in result.events:
                log.info("%s", event)
            if result.slot is None:  # behaviour-cloning pre-training: new weights, no rollout
                continue
            self.assembler.counters.dropped["stale_rows"] += result.stale_rows
            self.last_lag = result.lag
            self.trainable_share = result.trainable_share
            self.rollbacks = result.rollbacks
            self._log_update(result)
            # A full rollout still waiting is trained before the run stops (not left untrained).
            budget_spent = self.assembler.counters.env_steps >= self.config.total_env_steps
            if budget_spent and not self.stopping_reason and SlotState.FULL not in self.assembler.states:
                self.stopping_reason = "env-step budget reached"
                log.info("stopping: %s at %d env steps, update %d", self.stopping_reason,
                         self.assembler.counters.env_steps, result.iterations)

    def _publish_weights(self, message: WeightsMessage) -> None:
        self.weights_pub.send(encode_weights(message), copy=False)

    def _log_update(self, result: TrainResult) -> None:
        """One metrics record, one log line and one telemetry snapshot per PPO update, all with the
        same update number (``charts/update``), ``global_step`` and SPS."""
        step = self.assembler.counters.env_steps
        self.rates.sample(time.monotonic(), step)
        scalars: dict[str, float] = {"charts/update": result.iterations, "charts/SPS": self.sps(),
                                     "charts/SPS_recent": self.rates.recent(),
                                     "charts/actors": len(self.assembler.actors),
                                     "charts/policy_version": result.policy_version}
        scalars.update({f"charts/policy_lag_{k}": result.lag[k] for k in ("min", "mean", "max")})
        # The same lag in SGD steps, counting the revisions published within an update.
        scalars.update({f"charts/policy_lag_sgd_steps_{k}": result.lag[f"sgd_{k}"] for k in ("min", "mean", "max")
                        if f"sgd_{k}" in result.lag})
        scalars["charts/newest_acting_policy_version"] = result.lag["newest_version"]
        scalars["charts/stale_rows"] = result.stale_rows
        scalars["charts/trainable_share"] = result.trainable_share
        scalars["charts/rollbacks"] = result.rollbacks
        if result.stats is not None:
            self.last_stats = result.stats
            scalars.update(update_scalars(result.stats))
            if result.stats.nonfinite_minibatches:
                log.warning("update %d: %d minibatches had a non-finite gradient and were skipped",
                            result.iterations, result.stats.nonfinite_minibatches)
        if self.window.count:
            scalars["charts/episodic_return"] = self.window.mean
            scalars["charts/episodic_length"] = self.window.mean_length
        self.metrics.log(step, scalars)
        self.history.record_update(step, self.window.mean if self.window.count else None, self.sps())
        for report in result.evaluations:
            self._log_evaluation(report)
        ret = f"{self.window.mean:8.2f}" if self.window.count else "     n/a"
        loss = (f"pg {result.stats.policy_loss:+.3f} v {result.stats.value_loss:.3f} ent {result.stats.entropy:.3f} "
                f"kl {result.stats.approx_kl:.4f}") if result.stats else "no trainable rows"
        log.info("update %5d | steps %9d | SPS %6.0f (recent %6.0f) | episodes %6d | return %s | %s | actors %d",
                 result.iterations, step, self.sps(), self.rates.recent(), self.episodes, ret, loss,
                 len(self.assembler.actors))
        self._publish_telemetry(is_update=True)

    def _log_evaluation(self, report: EvaluationReport) -> None:
        """A tester report into metrics (at the current step: global_step never goes back),
        the telemetry history and the log."""
        self.metrics.log(self.assembler.counters.env_steps, evaluation_scalars(report))
        self.history.record_evaluation(report)
        log.info("evaluation of policy version %d: return %.2f +- %.2f over %d episodes (%s)",
                 report.policy_version, report.return_mean, report.return_std, report.episodes,
                 "greedy" if report.greedy else "sampled")

    def _final_evaluation(self) -> None:
        """Evaluate the final weights (training has stopped), keeping best.pt; then stop the tester."""
        tester = self.trainer.tester
        try:
            if tester.alive:
                tester.submit(self.trainer.policy_version, self.trainer.weights(), self.assembler.counters.env_steps,
                              keep=True)
                version = self.trainer.policy_version
                reports = tester.drain(timeout_s=FINAL_EVALUATION_TIMEOUT_S)
                for report in reports:
                    self._log_evaluation(report)
                    for note in self.trainer.checkpoints.after_evaluation(self.trainer.ppo, report):
                        log.info("%s", note)
                if not any(report.policy_version == version for report in reports):
                    log.warning("the evaluation of the final weights did not finish within %.0f s: skipped "
                                "(oakemu evaluate plays the final checkpoint)", FINAL_EVALUATION_TIMEOUT_S)
        except RunCollapsedError as error:
            log.error("%s", error)
        finally:
            tester.close()

    # -- telemetry --------------------------------------------------------------------------
    def sps(self) -> float:
        """Env steps per second since this learner started (wall clock, start-up included), as of
        the last sample of :attr:`rates`."""
        return self.rates.overall()

    def snapshot(self, *, is_update: bool) -> TelemetrySnapshot:
        now = time.monotonic()
        stats = self.last_stats
        counters = self.assembler.counters
        return TelemetrySnapshot(
            time=time.time(),
            run_name=self.run_dir.name,
            env_id=self.config.env_id,
            global_step=max(0, counters.env_steps),
            sps=self.sps(),
            sps_recent=self.rates.recent(),
            policy_version=self.policy_version,
            iterations=self.trainer.ppo.iterations,
            episodes=self.episodes,
            episodic_return_mean=self.window.mean if self.window.count else None,
            episodic_return_min=self.window.min if self.window.count else None,
            episodic_return_max=self.window.max if self.window.count else None,
            episodic_length_mean=self.window.mean_length if self.window.count else None,
            policy_loss=stats.policy_loss if stats else None,
            value_loss=stats.value_loss if stats else None,
            entropy=stats.entropy if stats else None,
            approx_kl=stats.approx_kl if stats else None,
            clip_fraction=stats.clip_fraction if stats else None,
            explained_variance=_finite_or_none(stats.explained_variance) if stats else None,
            learning_rate=stats.learning_rate if stats else self.trainer.ppo._learning_rate(),
            buffer_fill=min(1.0, self.assembler.buffer_fill()),
            rejected_messages=dict(counters.rejected),
            dropped=dict(counters.dropped),
            messages_received=dict(counters.received),
            messages_accepted=dict(counters.accepted),
            checkpoint_failures=self.trainer.checkpoint_writer.failures,
            trainable_share=self.trainable_share,
            log_write_failures=self.metrics.write_failures + self.episodes_log.failures,
            policy_lag_min=self.last_lag.get("min"),
            policy_lag_mean=self.last_lag.get("mean"),
            policy_lag_max=self.last_lag.get("max"),
            actors=[
                ActorTelemetry(
                    actor_id=r.actor_id, incarnation=public_tag(r.incarnation), num_envs=r.spec.num_envs,
                    sps=r.env_steps_per_second, last_heard_s=max(0.0, now - r.last_heard),
                    # lag of its rows at arrival (min/mean/max since the last snapshot), else the heartbeat's
                    policy_lag=lag[1] if lag else r.policy_lag,
                    policy_lag_min=lag[0] if lag else None, policy_lag_max=lag[2] if lag else None,
                )
                for r in self.assembler.actors.values()
                for lag in (self.assembler.take_lag(r),)
            ],
            is_update=is_update,
            **self.history.snapshot_fields(),
        )

    def _publish_telemetry(self, *, is_update: bool) -> None:
        if self.security is not None and self.security.refused:  # clients refused by the ZAP authenticator
            self.assembler.counters.rejected["unauthorized_key"] = self.security.refused
        for limiter in self.rejection_log.values():  # the summary of a burst that has ended
            limiter.flush()
        snapshot = self.snapshot(is_update=is_update)
        if self.prometheus is not None:  # first: a client that saw this record scrapes figures as new
            self.prometheus.update(snapshot)
        self.telemetry.publish(snapshot)

    # -- main loop --------------------------------------------------------------------------
    def run(self, stop_event: threading.Event) -> int:
        """Serve until the env-step budget is spent or ``stop_event`` is set; returns 0."""
        config = self.config
        (self.run_dir / "config.toml").write_text(to_toml(config))
        if self.trainer.tester is not None:
            self.trainer.tester.start()
            # The first evaluation: the initial (or behaviour-cloned, or resumed) weights; kept, so a
            # tester still starting evaluates them and not only the newest weights.
            self.trainer.tester.submit(self.policy_version, self.latest_weights, self.assembler.counters.env_steps,
                                       keep=True)
        self.trainer.start(lambda: self.assembler.counters.env_steps)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.trainer.handshake.wake_fd, zmq.POLLIN)  # a result handed back wakes the loop
        data_registered = False
        next_telemetry = next_expiry = time.monotonic()
        log.info("learner for %s: %d x %d rollout buffers (%.1f MiB each) on %s, device %s, run %s",
                 config.env_id, config.rollout_length, config.buffer_num_envs, self.buffer_bytes / 2**20,
                 config.bind_host, self.trainer.device, self.run_dir)
        while True:
            # The budget stops the run right after an update is logged (_collect_results), so the last
            # metrics record, the telemetry and the final checkpoint agree on global_step and the
            # update count. Once the budget is spent, steps are read only while no update is in flight
            # (to fill the rollout that will be the last one); a resume with nothing left stops here.
            budget_spent = self.assembler.counters.env_steps >= config.total_env_steps
            if not self.stopping_reason and (stop_event.is_set() or (budget_spent and self._nothing_in_flight())):
                self.stopping_reason = "signal" if stop_event.is_set() else "env-step budget reached"
                log.info("stopping: %s", self.stopping_reason)
            if self.stopping_reason and not self.trainer.handshake.busy:
                counters = self.assembler.counters  # one line to compare runs (issue 11: dropped steps)
                buffers = ", ".join(f"{state.value} {int(buffer.column_steps.sum())} rows"
                                    for state, buffer in zip(self.assembler.states, self.buffers))
                log.info("ingest: %d env steps written, %d vector steps held, dropped %s; buffers: %s",
                         counters.env_steps, self.assembler.pending_rows, dict(counters.dropped), buffers)
                break
            want_data = (self.assembler.accepting and not self.stopping_reason
                         and not (budget_spent and self.trainer.handshake.busy))
            if want_data != data_registered:
                (poller.register(self.data, zmq.POLLIN) if want_data else poller.unregister(self.data))
                data_registered = want_data
            events = dict(poller.poll(20))
            now = time.monotonic()
            if self.control in events:
                self._handle_control(now)
            if events.get(self.data):
                self._handle_data(now)
            returns, lengths = self.assembler.take_episodes()
            if returns:
                self.window.add(returns, lengths)
            try:
                self._collect_results()
            except RuntimeError as error:
                if not isinstance(error.__cause__, (RunCollapsedError, CheckpointWriteFailed)):
                    raise
                log.error("%s", error.__cause__)  # a clear stop: no traceback, final checkpoint kept
                self.exit_status = 1
                break
            if not self.stopping_reason:
                self._hand_off_full_rollouts()
            if now >= next_expiry:
                self.peers.retain(self.assembler.actors)
                for actor_id in self.assembler.expire_silent_actors(now):
                    log.warning("actor %s silent for %.1f s: dropped, its unfinished segment discarded",
                                actor_id, config.actor_timeout_s)
                self.rings.retain({(r.actor_id, r.incarnation) for r in self.assembler.actors.values()})
                next_expiry = now + 0.5
            if now >= next_telemetry:
                self.rates.sample(now, self.assembler.counters.env_steps)
                self._publish_telemetry(is_update=False)
                next_telemetry = now + TELEMETRY_PERIOD_S
        # Tell the actors to stop for a moment, so they exit before we close the sockets: at once on
        # the weights channel, and in the reply to each heartbeat (an actor that missed the notice).
        self.stopping_reason = self.stopping_reason or "the run collapsed"
        self.weights_pub.send(encode_stop(StopNotice(self.stopping_reason)))
        self._drain_control(seconds=min(2.0, config.actor_timeout_s))
        return self.exit_status

    def _nothing_in_flight(self) -> bool:
        """No rollout in training, none full, and no row written in a filling buffer."""
        return (not self.trainer.handshake.busy
                and all(state is SlotState.FILLING for state in self.assembler.states)
                and not any(int(buffer.column_steps.sum()) for buffer in self.buffers))

    def _drain_control(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.assembler.actors:
            if self.control.poll(50):
                self._handle_control(time.monotonic())

    def close(self) -> None:
        """Final checkpoint, then release sockets, loggers and shared memory (idempotent)."""
        try:
            self.trainer.stop()
            if self.trainer.tester is not None:
                self._final_evaluation()
            # The step count continues from every env step received, trained or not (monotonic).
            self.trainer.global_step = max(self.trainer.global_step, self.assembler.counters.env_steps)
            self.trainer.episodes = self.episodes
            try:
                path = self.trainer.checkpoint()
            except CheckpointWriteFailed as error:  # already logged as the reason to stop, or the last straw
                log.error("final checkpoint not written: %s", error)
                path = None
            if path is not None:
                log.info("final checkpoint %s", path)
            else:
                log.error("final checkpoint not written; the run resumes from %s",
                          self.trainer.checkpoint_writer.last_saved or "its start (no checkpoint)")
        finally:
            self._release.close()  # what __init__ registered, newest first; empty after the first call
            self._close_handshake()  # again: a trainer that outlived stop() kept the pipe open the first time

    def _close_handshake(self) -> None:
        if not self.trainer.running:  # a trainer still inside complete() would write to a reused fd
            self.trainer.handshake.close()


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def main(config: OakEmuConfig) -> int:
    """Entry point of ``oakemu learner``: run until the budget is spent or SIGINT/SIGTERM."""
    setup_logging(config.log_level, config.log_format)
    # An unknown env id fails here, before the run folder is created.
    check_env(config.env_id, settings_file=config.emulator_settings)
    run_dir = resolve_run_dir(config)
    # Resuming a folder: say which settings change; refuse (ResumeMismatchError, exit 2) another env,
    # other spaces or model, or a setting that cannot change, before anything in the folder is written.
    changes = check_resume_folder(run_dir, config, check_model=False)  # the model is checked in restore
    if changes:
        log.warning("resuming %s with changed settings (config.toml -> now): %s", run_dir, format_changes(changes))
    stop_event = install_stop_signals()
    try:
        learner = Learner(config, run_dir)
    except (SharedMemoryTooSmallError, TransportSecurityError) as error:  # a deployment mistake: say what to change, no traceback
        log.error("learner cannot start: %s", error)
        return 1
    try:
        return learner.run(stop_event)
    finally:
        learner.close()


if __name__ == "__main__":
    from oakemu_services.cli import main as cli_main

    raise SystemExit(cli_main(["learner", *__import__("sys").argv[1:]]))
