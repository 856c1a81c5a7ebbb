"""Actor process: steps a vector env with a local CPU copy of the policy and streams steps to the learner.

Per vector step: record the observations and the policy's action bundle, step the envs, record
rewards / dones / truncation (with the value of the TRUE final observation of a truncated episode,
from the policy that acted), pick up newer weights, choose the next actions (whose values are also
the bootstrap ``next_values`` of this step), then send one step message.  ``send`` blocks when the
learner is not reading (back-pressure; with a step ring, below, the actor waits for a free slot
first); heartbeats continue meanwhile.

In the asynchronous mode an actor acts at most :data:`AHEAD_SEGMENTS` segments with one policy
version; then it waits (at most :data:`AHEAD_WAIT_S`) for newer weights, so it does not compute
steps the learner could not store.

In the synchronous mode (the join reply's ``env_config["mode"] == "sync"``) the actor counts its
rows: the last row of each segment of ``rollout_length`` rows takes its ``next_values`` from the
policy that acted, is sent, and then the actor waits (heartbeats continue) until weights newer
than that policy arrive; the next segment is acted by them (policy lag 0 for every row).

On the learner's machine (``step_transport = "auto"``) the arrays of each step message go through a
shared-memory step ring the learner offers at join (:mod:`oakemu_core.transport.step_ring`); the socket then
carries only the message's scalars and the slot. The actor waits (heartbeats continue, newer
weights are loaded) while its next slot is still unread, before it acts that message's steps: the
ring's slots are the back-pressure, and bound the rows an actor has acted that the learner has not
read yet (the learner may hold read ones while its buffers are full: ``oakemu_core/storage/assembler.py``).

Run with ``oakemu actor`` or ``python -m oakemu_services.actor``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import VectorEnv, make_vector_env
from oakemu_core.envs.factory import make_env_groups
from oakemu_core.envs.spec import is_atari_env
from oakemu_core.envs.vector import EnvGroups
from oakemu_core.run.metrics import StepRateMeter
from oakemu_core.policy.models import ActorCritic, build_model, load_weight_arrays
from oakemu_core.actor.routing import PolicyRouter, RoutingConfig
from oakemu_core.transport.step_ring import StepRing, StepRingUnavailable, shared_memory_host_id
from oakemu_core.step_schema import schema_for_env
from oakemu_core.transport.step_blocks import StepBlock
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.transport.wire import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    MessageRejected,
    StepMessage,
    StepSpec,
    StopNotice,
    WeightsMessage,
    decode_message,
    encode_heartbeat,
    encode_join_request,
    encode_leave,
    encode_step,
)
from oakemu_core.transport.auth import client_security
from oakemu_services.runtime import (
    SETUP_ERROR_EXIT_STATUS,
    RetryReporter,
    install_stop_signals,
    setup_logging,
    socket_buffer_bytes,
)

log = logging.getLogger("oakemu.actor")

HEARTBEAT_PERIOD_S = 1.0
REQUEST_TIMEOUT_S = 2.0
JOIN_PATIENCE_S = 120.0
WEIGHTS_QUEUE_MESSAGES = 4
"""Weights messages the SUB socket queues (the actor reads them all and keeps the newest)."""
WEIGHTS_WAIT_WARNING_S = 30.0
"""Say so when the weights of a finished segment (synchronous mode) or a free step-ring slot take
longer than this."""
AHEAD_SEGMENTS = 2
"""Asynchronous mode: an actor acts at most this many segments (``rollout_length`` vector steps
each) with one policy version, then waits for newer weights. In steady state a new version comes
with each released buffer, into which the actor's held segment is written; it then fills one
segment and holds the next while the other buffer trains: two segments per version keep it busy.
Rows beyond what the learner can store were computed and thrown away (issue 11: an actor far
ahead of a slower one had 20 % of its steps dropped as ``no_capacity_steps``; with three
segments per version, 5 %: the fast actor had taken the slow one's columns as well)."""
AHEAD_WAIT_S = 1.0
"""Longest wait for newer weights once :data:`AHEAD_SEGMENTS` are used up; then the actor goes on
(a fresh allowance). A run where every actor waits and no buffer can fill is thereby never stuck."""


class LearnerUnreachable(RuntimeError):
    """The learner did not answer for longer than the configured patience."""


class ActorSetupError(RuntimeError):
    """This actor cannot serve the learner's run (e.g. its env gives other step fields)."""


class ControlChannel:
    """REQ socket to the learner's control ROUTER, recreated after a timeout (ZeroMQ "lazy pirate")."""

    security = None  # an oakemu_core.transport.auth.ClientSecurity when CURVE is on
    def __init__(self, context: zmq.Context, address: str, max_bytes: int) -> None:
        self.context = context
        self.address = address
        self.max_bytes = max_bytes
        self.socket: zmq.Socket | None = None

    def _connect(self) -> zmq.Socket:
        if self.socket is None:
            self.socket = self.context.socket(zmq.REQ)
            if self.security is not None:
                self.security.apply(self.socket)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.connect(self.address)
        return self.socket

    def request(self, frame: bytes, timeout_s: float = REQUEST_TIMEOUT_S):
        """Send one request; the decoded reply, or None on timeout or a malformed reply."""
        sock = self._connect()
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            sock.close(linger=0)
            self.socket = None
            return None
        try:
            return decode_message(sock.recv(), max_bytes=self.max_bytes)
        except MessageRejected as error:
            log.warning("malformed reply from the learner: %s", error)
            return None

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None


class Actor:
    """One actor process: joins the learner, then steps and streams until told to stop."""

    def __init__(self, config: OakEmuConfig, stop_event: threading.Event) -> None:
        self.config = config
        self.stop_event = stop_event
        self.actor_id = config.actor_id or f"{socket.gethostname()}-{os.getpid()}"
        self.hostname = socket.gethostname()
        self.context = zmq.Context()
        self.control = ControlChannel(self.context, config.learner_address(config.control_port), config.max_message_bytes)
        self.security = self.control.security = client_security(config)  # CURVE keys (oakemu_core.transport.auth)
        self.patience_s = 3 * config.actor_timeout_s
        # Heartbeats that get no answer mid-run are reported every few seconds, not only the give-up.
        self.silence = RetryReporter(log, "learner", self.control.address, give_up_s=self.patience_s)
        self.last_reply = time.monotonic()
        self.next_heartbeat = 0.0
        self.learner_version = 0
        self.episodes = 0
        self.sps_meter = StepRateMeter(window=32)
        self.env_steps = 0
        self.env: VectorEnv | EnvGroups | None = None
        self.model: ActorCritic | None = None
        self.inference_backend: Any = None  # forward of actor_inference 'onnxruntime' or 'bfloat16' (has .load)
        self.stepper: PolicyStepper | None = None
        self.policy_version = 0
        self.weights_revision = 0  # > 0: weights published within the update that makes policy_version + 1
        self.steps_per_message = 1
        self.block: StepBlock | None = None
        self.sync_rollout_length = 0  # > 0: synchronous mode, rows per segment
        self.segment_rows = 0  # rows of the current segment sent (synchronous mode)
        self.ahead_rows = 0  # asynchronous mode: allowance of vector steps per policy version (0: none)
        self.rows_this_version = 0  # vector steps acted since the current weights were loaded
        self.ahead_waits = 0
        self.revisions_loaded = 0  # weights published within an update (publish_every_epoch) loaded
        self.ahead_waits_timed_out = 0
        self.data: zmq.Socket | None = None
        self.weights_sub: zmq.Socket | None = None
        self.ring: StepRing | None = None  # shared-memory step ring of this incarnation, if offered and attached
        self.message_layout: tuple[int, int] | None = None  # (K, ring slots or 0) the sockets are sized for
        self.ring_waits = 0  # messages that waited for their ring slot

    # -- joining ---------------------------------------------------------------------------
    def join(self) -> JoinReply:
        """Join (retrying while the learner is not up yet); loads the weights it returns."""
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        host_id = shared_memory_host_id() if self.config.step_transport == "auto" else ""
        precision = "bfloat16" if self.config.actor_inference == "bfloat16" else "float32"
        request = encode_join_request(
            JoinRequest(self.actor_id, self.incarnation, self.config.envs_per_actor, self.hostname, host_id, precision)
        )
        # A learner may take a while to start (loading torch, building envs): be patient at join.
        deadline = time.monotonic() + max(JOIN_PATIENCE_S, self.patience_s)
        reporter = RetryReporter(log, "learner", self.control.address, give_up_s=max(JOIN_PATIENCE_S, self.patience_s))
        while not self.stop_event.is_set():
            reporter.attempt()  # says whom it is trying to reach, at once and every few seconds
            reply = self.control.request(request)
            if isinstance(reply, JoinReply):
                reporter.succeeded()
                if not reply.accepted:
                    raise ActorSetupError(f"learner refused actor {self.actor_id}: {reply.reason}")
                self._on_joined(reply)
                return reply
            if time.monotonic() > deadline:
                raise LearnerUnreachable(
                    f"no learner answered at {self.control.address} for {max(JOIN_PATIENCE_S, self.patience_s):.0f} s"
                )
        raise KeyboardInterrupt

    def _on_joined(self, reply: JoinReply) -> None:
        assert reply.spec is not None
        env_config = reply.env_config
        if self.env is None:  # first join: build env, model and sockets
            seed = int(env_config["seed"])
            torch.manual_seed(seed)
            env_kwargs = dict(clip_rewards=bool(env_config["clip_rewards"]),
                              max_episode_steps=env_config.get("max_episode_steps"),
                              settings_file=env_config.get("emulator_settings"),
                              num_threads=self.config.resolved_emulator_threads())
            groups = min(self.config.env_groups, self.config.envs_per_actor)
            self.env = (make_env_groups(str(env_config["env_id"]), self.config.envs_per_actor, groups, seed=seed,
                                        **env_kwargs) if groups > 1  # overlapped stepping (issue 11)
                        else make_vector_env(str(env_config["env_id"]), self.config.envs_per_actor, seed=seed,
                                             **env_kwargs))
            schema = reply.spec.schema
            local = schema_for_env(self.env.spec)
            if local != schema:  # e.g. another version of the env or of OakEmu-RL on this machine
                raise ActorSetupError(
                    f"this actor's {env_config['env_id']} gives step fields [{local.describe()}], the learner "
                    f"expects [{schema.describe()}]: install the same env and OakEmu-RL versions as the learner"
                )
            self.model = build_model(self.env.spec.observation_layout, schema.distribution,
                                     normalize_observations=bool(env_config.get("normalize_observations")))
            self.model.eval()
            load_weight_arrays(self.model, reply.weights)  # the first actions come from the learner's weights
            if self.config.actor_inference != "torch":
                self.inference_backend = self._inference_backend(self.model)
                self.model.use_inference_backend(self.inference_backend)
            try:  # the learner's route_* settings; a scripted policy must import on this machine
                routing = RoutingConfig.from_mapping(env_config)
                router = PolicyRouter(self.env.spec, self.env.num_envs, routing, seed=seed) if routing.active else None
                if router is not None and isinstance(self.env, EnvGroups):
                    raise ValueError("not supported with env_groups > 1")
            except ValueError as error:
                raise ActorSetupError(f"policy routing: {error}") from None
            self.stepper = PolicyStepper(self.env, self.model, schema=schema, policy_version=reply.policy_version,
                                         router=router)
        self._attach_ring(reply)
        self._set_message_layout(reply.spec)
        self._load_weights(reply.policy_version, reply.weights)
        self.sync_rollout_length = int(env_config.get("rollout_length") or 0) if env_config.get("mode") == "sync" else 0
        self.ahead_rows = 0 if self.sync_rollout_length else AHEAD_SEGMENTS * int(env_config.get("rollout_length") or 0)
        self.segment_rows = 0  # a new incarnation starts a new segment
        self.last_reply = time.monotonic()
        threads = (f" ({self.config.resolved_emulator_threads()} emulator threads per env group)"
                   if is_atari_env(str(env_config["env_id"])) else "")
        log.info("actor %s joined as #%d: %s x %d envs%s, policy version %d", self.actor_id, reply.actor_index,
                 env_config["env_id"], self.config.envs_per_actor, threads, reply.policy_version)

    def _attach_ring(self, reply: JoinReply) -> None:
        """Use the step ring the learner offered to this incarnation, if it is reachable from here."""
        if self.ring is not None:  # the previous incarnation's ring
            self.ring.close()
            self.ring = None
        if reply.step_ring is None or reply.spec is None:
            return
        try:
            self.ring = StepRing.attach(reply.step_ring, reply.spec)
        except StepRingUnavailable as error:  # e.g. another user's segment: inline it is
            log.info("actor %s: step arrays go inline in the messages (%s)", self.actor_id, error)
        else:
            log.info("actor %s: step arrays go through shared memory (%s, %d slots)", self.actor_id,
                     self.ring.name, self.ring.slots)

    def _set_message_layout(self, spec: StepSpec) -> None:
        """Take the join's steps per message K and step ring: the step block, and data and weights
        sockets sized for them. A rejoin that changes either (a learner restarted with other
        settings, or without room for a ring) gets fresh sockets: a queue sized for a ring's slots
        would hold too many inline blocks, and their rows would train too old."""
        layout = (spec.steps_per_message, self.ring.slots if self.ring is not None else 0)
        if layout == self.message_layout:
            return
        if self.data is not None:  # a rejoin changed them: the old queues go with the old incarnation
            self.data.close(linger=0)
            self.weights_sub.close(linger=0)
        assert self.env is not None
        self.message_layout = layout
        self.spec_message_bytes = spec.message_bytes()
        # K vector steps per message (agreed at join; 1: send each step as it comes).
        self.steps_per_message = spec.steps_per_message
        self.block = (StepBlock(spec.schema, self.env.num_envs, self.steps_per_message)
                      if self.steps_per_message > 1 else None)
        self._connect_streams()

    def _connect_streams(self) -> None:
        config = self.config
        self.data = self.context.socket(zmq.PUSH)
        if self.security is not None:
            self.security.apply(self.data)
        # Back-pressure after two messages in flight (one when a message is a block of K > 1 steps:
        # the queues count messages, and K steps each would multiply the rows queued, hence their lag).
        # With a step ring its slots bound the messages in flight: a queue as long lets them all go.
        self.data.setsockopt(zmq.SNDHWM, self.ring.slots if self.ring is not None
                             else 2 if self.steps_per_message == 1 else 1)
        # ... and a kernel buffer of a few messages: the default (MBs, autotuned) would hold
        # thousands of small messages, acted by policies many versions old.
        self.data.setsockopt(zmq.SNDBUF, socket_buffer_bytes(self.spec_message_bytes))
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.connect(config.learner_address(config.data_port))
        self.weights_sub = self.context.socket(zmq.SUB)
        if self.security is not None:
            self.security.apply(self.weights_sub)
        # Not ZMQ_CONFLATE: its double buffer can lose the wake-up of an idle reader (the pipe stays
        # inactive), and a synchronous-mode actor then waited forever for weights already sent
        # (CartPole, seed 3, after 259 updates). A short queue, drained to the newest, instead.
        self.weights_sub.setsockopt(zmq.RCVHWM, WEIGHTS_QUEUE_MESSAGES)
        self.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.weights_sub.setsockopt(zmq.LINGER, 0)
        self.weights_sub.connect(config.learner_address(config.weights_port))

    def _inference_backend(self, model: ActorCritic) -> Any:
        """The forward passes of ``actor_inference`` 'onnxruntime' or 'bfloat16' for ``model``.
        Raises :class:`ActorSetupError` when they cannot serve this model."""
        config = self.config
        try:
            if config.actor_inference == "bfloat16":
                from oakemu_core.policy.bfloat16_inference import BFloat16Forward
                from oakemu_core.algo.ppo import cpu_has_native_bfloat16

                backend: Any = BFloat16Forward(model)
                log.info("actor %s: forward passes in bfloat16", self.actor_id)
                if cpu_has_native_bfloat16() is False:
                    log.warning("actor %s: this CPU has no AVX512-BF16 or AMX: bfloat16 is emulated and slower "
                                "than --actor-inference torch", self.actor_id)
                return backend
            from oakemu_core.policy.onnx_inference import OnnxForward

            backend = OnnxForward(model, threads=config.torch_threads)
            log.info("actor %s: forward passes by ONNX Runtime", self.actor_id)
            return backend
        except ValueError as error:
            raise ActorSetupError(str(error)) from None
        except Exception as error:  # noqa: BLE001 - the exporter's or ONNX Runtime's own: one readable line
            raise ActorSetupError(f"actor_inference={config.actor_inference!r} could not be set up "
                                  f"({type(error).__name__}: {error}); use --actor-inference torch") from None

    def _load_weights(self, version: int, weights: dict[str, np.ndarray], revision: int = 0) -> None:
        assert self.model is not None
        load_weight_arrays(self.model, weights)
        if self.inference_backend is not None:
            self.inference_backend.load(self.model)
        if version != self.policy_version:
            self.rows_this_version = 0
        self.policy_version = version
        self.weights_revision = revision
        self.revisions_loaded += revision > 0
        if self.stepper is not None:
            self.stepper.policy_version = version
            self.stepper.weights_revision = revision
        self.learner_version = max(self.learner_version, version)

    def _poll_weights(self) -> bool:
        """Load the newest weights waiting on the SUB socket, if newer (policy version, then the
        revision within an update); True when loaded.

        Every queued weights message is read and only the last one (the newest version) decoded. A
        :class:`StopNotice` (the learner's last message on this socket) sets the stop event."""
        assert self.weights_sub is not None
        frame = None
        while True:
            try:
                frame = self.weights_sub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
        if frame is None:
            return False
        frame = frame.buffer
        try:
            message = decode_message(frame, max_bytes=self.config.max_message_bytes)
        except MessageRejected as error:
            log.warning("malformed weights message ignored: %s", error)
            return False
        if isinstance(message, StopNotice):
            log.info("learner announced the end of the run to actor %s (%s)", self.actor_id, message.reason)
            self.stop_event.set()
            return False
        if isinstance(message, WeightsMessage) and (
                (message.policy_version, message.revision) > (self.policy_version, self.weights_revision)):
            self._load_weights(message.policy_version, message.weights, message.revision)
            return True
        return False

    # -- liveness --------------------------------------------------------------------------
    def heartbeat_if_due(self) -> None:
        """Heartbeat once a second; rejoin when the learner forgot us, stop when it says so."""
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + HEARTBEAT_PERIOD_S
        self.sps_meter.sample(now, self.env_steps)
        reply = self.control.request(
            encode_heartbeat(
                Heartbeat(self.actor_id, self.incarnation, self.seq, self.policy_version, self.sps_meter.rate,
                          float(self.learner_version - self.policy_version), self.episodes)
            )
        )
        if not isinstance(reply, HeartbeatReply):
            self.silence.attempt()
            if time.monotonic() - self.last_reply > self.patience_s:
                raise LearnerUnreachable(f"learner silent for {self.patience_s:.0f} s")
            return
        self.silence.succeeded()
        self.last_reply = time.monotonic()
        self.learner_version = max(self.learner_version, reply.policy_version)
        if reply.status == "stop":
            log.info("learner asked actor %s to stop", self.actor_id)
            self.stop_event.set()
        elif reply.status == "rejoin":
            log.warning("learner does not know actor %s/%s: joining again", self.actor_id, self.incarnation)
            self.join()
            raise _Rejoined

    def wait_for_free_slot(self) -> None:
        """With a step ring: wait (heartbeats go on, newer weights are loaded) until the slot of the
        next message is free, before acting its steps. Rows then wait in the ring, never acted and
        held in the actor as well: while the learner stops reading, at most the ring's slots of rows
        are acted by weights that are about to be replaced (issue 11, policy lag). Raises
        :class:`_Rejoined` after a rejoin."""
        ring = self.ring
        if ring is None or ring.is_free(self.seq):
            return
        self.ring_waits += 1
        self._wait_until(lambda: ring.is_free(self.seq))

    def send_step(self, message: StepMessage) -> None:
        """Send one step message: its arrays into the step ring's next slot when the actor has a
        ring (waiting, with heartbeats, while the learner has not read that slot yet), else inline.
        ``message.seq`` is :attr:`seq`. Raises :class:`_Rejoined` after a rejoin."""
        ring = self.ring
        if ring is not None:
            self.wait_for_free_slot()  # free already when run() waited before acting
            if not ring.is_free(message.seq):  # told to stop meanwhile
                return
            slot = ring.write(message.seq, message.fields)
            message = replace(message, fields={}, slot=slot)
        self.send(encode_step(message))

    def _wait_until(self, ready: Any) -> None:
        """Poll ``ready()`` until it is true or the actor is told to stop: first every 0.1 ms, backing
        off to every 10 ms (a slot the learner is reading frees within a fraction of a millisecond; a
        learner that is training may take seconds). From 1 ms on the pause is a wait on the weights
        socket. Heartbeats go on, and (asynchronous mode) newer weights are loaded and the pending
        action chosen again with them, as in :meth:`send`. A wait past
        :data:`WEIGHTS_WAIT_WARNING_S` is logged."""
        assert self.weights_sub is not None
        pause, start = 0.0001, time.monotonic()
        warn_at = start + WEIGHTS_WAIT_WARNING_S
        while not ready() and not self.stop_event.is_set():
            if pause < 0.001 or self.sync_rollout_length:  # sync mode loads weights only at segment ends
                time.sleep(pause)
                new_weights = False
            else:
                new_weights = bool(self.weights_sub.poll(int(pause * 1000)))
            pause = min(2 * pause, 0.01)
            if new_weights and self._poll_weights() and self.stepper is not None:
                self.stepper.reselect()
            self.heartbeat_if_due()
            if time.monotonic() > warn_at:
                log.warning("actor %s: step message %d has waited %.0f s for a free step-ring slot", self.actor_id,
                            self.seq, time.monotonic() - start)
                warn_at += WEIGHTS_WAIT_WARNING_S

    def send(self, frame: bytes) -> None:
        """Send one step message, waiting (with heartbeats) while the learner applies back-pressure.

        While it waits it also watches the weights socket (asynchronous mode): weights published
        meanwhile are loaded at once and the pending next action is chosen again with them
        (:meth:`PolicyStepper.reselect`), so the actor does not resume with a policy that went
        stale while it was blocked (issue 11, bounded policy lag).
        """
        assert self.data is not None and self.weights_sub is not None
        poller = None
        while not self.stop_event.is_set():
            try:
                self.data.send(frame, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if poller is None:
                    poller = zmq.Poller()
                    poller.register(self.data, zmq.POLLOUT)
                    if not self.sync_rollout_length:  # sync mode loads weights only at segment ends
                        poller.register(self.weights_sub, zmq.POLLIN)
                events = dict(poller.poll(100))
                if events.get(self.weights_sub) and self._poll_weights() and self.stepper is not None:
                    self.stepper.reselect()
                self.heartbeat_if_due()

    def wait_for_weights_after(self, version: int) -> None:
        """Synchronous mode: block until weights newer than ``version`` are loaded (heartbeats go on;
        returns early when the actor is told to stop). Raises :class:`_Rejoined` after a rejoin."""
        self._wait_for_weights_newer_than(version, give_up_s=None)

    def _wait_for_weights_newer_than(self, version: int, *, give_up_s: float | None) -> bool:
        """Poll the weights socket (heartbeats go on) until weights newer than ``version`` are
        loaded (True), the actor is told to stop, or ``give_up_s`` passed (False). Without a limit
        a long wait is logged every :data:`WEIGHTS_WAIT_WARNING_S`."""
        assert self.weights_sub is not None
        start = time.monotonic()
        warn_at = start + WEIGHTS_WAIT_WARNING_S
        while not self.stop_event.is_set() and self.policy_version <= version:
            now = time.monotonic()
            if give_up_s is not None and now - start > give_up_s:
                return False
            if give_up_s is None and now > warn_at:
                log.warning("actor %s: waiting %.0f s for the weights after version %d (learner at version %d)",
                            self.actor_id, WEIGHTS_WAIT_WARNING_S, version, self.learner_version)
                warn_at = now + WEIGHTS_WAIT_WARNING_S
            if self.weights_sub.poll(20):
                self._poll_weights()
            self.heartbeat_if_due()
        return self.policy_version > version

    def wait_if_too_far_ahead(self) -> None:
        """Asynchronous mode: after :data:`AHEAD_SEGMENTS` segments acted by the current weights,
        wait for newer ones (heartbeats go on), at most :data:`AHEAD_WAIT_S`; the pending next action
        is then chosen again with them. Raises :class:`_Rejoined` after a rejoin."""
        if not self.ahead_rows or self.rows_this_version < self.ahead_rows:
            return
        assert self.stepper is not None
        self.ahead_waits += 1
        if self._wait_for_weights_newer_than(self.policy_version, give_up_s=AHEAD_WAIT_S):
            self.stepper.reselect()
        elif not self.stop_event.is_set():
            self.ahead_waits_timed_out += 1
            log.debug("actor %s: no weights after version %d within %.1f s; acting on", self.actor_id,
                      self.policy_version, AHEAD_WAIT_S)
            self.rows_this_version = 0

    # -- stepping --------------------------------------------------------------------------
    def run(self) -> int:
        self.join()
        assert self.stepper is not None
        stepper = self.stepper
        while not self.stop_event.is_set():
            # One message = K vector steps (K = steps_per_message; K divides rollout_length, so a
            # segment end is always a block's last step). Weights are picked up only before a
            # block's first action, so one policy version acts on a whole block.
            block, k = self.block, self.steps_per_message
            try:
                self.wait_if_too_far_ahead()
                self.wait_for_free_slot()
            except _Rejoined:
                continue
            if self.stop_event.is_set():  # told to stop while waiting: act nothing more
                break
            if block is not None:
                block.clear()
            for i in range(k):
                last = i == k - 1
                segment_end = (bool(self.sync_rollout_length) and last
                               and self.segment_rows + k == self.sync_rollout_length)
                row = stepper.step(before_next_action=None if self.sync_rollout_length or not last else self._poll_weights,
                                   segment_end=segment_end)
                fields = row.buffers.sent_fields(row.next_values, stepper.schema)
                if block is not None:
                    block.record(fields, row.policy_version, row.env_step.episode_returns, row.env_step.episode_lengths,
                                 revision=row.policy_revision)
                self.env_steps += row.buffers.num_envs
                self.rows_this_version += 1
                self.episodes += len(row.env_step.episode_returns)
            if block is not None:
                message = block.message(self.actor_id, self.incarnation, self.seq)
            else:
                message = StepMessage(
                    actor_id=self.actor_id, incarnation=self.incarnation, seq=self.seq,
                    policy_version=row.policy_version, fields=fields,
                    episode_returns=row.env_step.episode_returns, episode_lengths=row.env_step.episode_lengths,
                    revision=row.policy_revision,
                )
            try:
                self.heartbeat_if_due()
                self.send_step(message)
                self.seq += 1
                self.segment_rows = 0 if segment_end else self.segment_rows + k
                if segment_end:
                    self.wait_for_weights_after(row.policy_version)
            except _Rejoined:
                pass  # this block is lost with the old incarnation; the new one starts at seq 0
        return 0

    def close(self) -> None:
        """Say goodbye (best effort), then release env and sockets."""
        if self.revisions_loaded:
            log.info("actor %s loaded %d weight revisions published within updates", self.actor_id,
                     self.revisions_loaded)
        if self.ahead_waits:
            log.info("actor %s waited for newer weights %d times (%d gave up after %.1f s)", self.actor_id,
                     self.ahead_waits, self.ahead_waits_timed_out, AHEAD_WAIT_S)
        if self.ring_waits:
            log.info("actor %s: %d step messages waited for a free step-ring slot", self.actor_id, self.ring_waits)
        if getattr(self, "incarnation", None) and self.data is not None:
            self.control.request(encode_leave(Leave(self.actor_id, self.incarnation)), timeout_s=0.5)
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.control.close()
        if self.env is not None:
            self.env.close()
        self.context.destroy(linger=0)


class _Rejoined(Exception):
    """Internal: the actor joined again (new incarnation) in the middle of a step."""


def main(config: OakEmuConfig) -> int:
    """Entry point of ``oakemu actor``: 0 when stopped, 1 when the learner is unreachable."""
    setup_logging(config.log_level, config.log_format)
    if config.actor_inference == "onnxruntime":  # before joining: a missing package holds no slot
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    torch.set_num_threads(config.torch_threads)
    stop_event = install_stop_signals()
    actor = Actor(config, stop_event)
    try:
        return actor.run()
    except LearnerUnreachable as error:
        log.error("actor %s: %s", actor.actor_id, error)
        return 1
    except ActorSetupError as error:
        log.error("actor %s: %s", actor.actor_id, error)
        return SETUP_ERROR_EXIT_STATUS
    except KeyboardInterrupt:
        return 0
    finally:
        actor.close()


if __name__ == "__main__":
    import sys

    from oakemu_services.cli import main as cli_main

    raise SystemExit(cli_main(["actor", *sys.argv[1:]]))
