"""Actor process: steps a vector env with a local CPU copy of the policy and streams steps to the learner.

Per vector step: record the observations and the policy's action bundle, step the envs, record
rewards / dones / truncation (with the value of the TRUE final observation of a truncated episode,
from the policy that acted), pick up newer weights, choose the next actions (whose values are also
the bootstrap ``next_values`` of this step). Every K vector steps (the join's ``steps_per_message``)
go to the learner as one message through the join's step channel (:mod:`oakemu_core.transport.channels`:
arrays inline, or in a step ring on the learner's machine). While the channel cannot take the next
message the actor waits before acting its steps; heartbeats go on and newer weights are loaded.

Pacing (:mod:`oakemu_core.actor.pacing`): an asynchronous actor acts at most :data:`AHEAD_SEGMENTS`
segments with one policy version, then waits (at most :data:`AHEAD_WAIT_S`) for newer weights, so it
does not compute steps the learner could not store. A synchronous one
(``env_config["mode"] == "sync"``) sends the last row of each segment of ``rollout_length`` rows (its
``next_values`` from the policy that acted) and waits for weights newer than that policy, which act
the next segment (policy lag 0 for every row).

Weights come on the weights channel; an actor whose heartbeat replies name a newer policy version
than it has for :data:`~oakemu_core.actor.client.WEIGHTS_MISSED_S` asks for them on the control
socket instead (the channel lost them), in both modes: asynchronous, it loads them at once;
synchronous, they are kept for the segment's end like weights read inside a segment.

Talking to the learner (join, heartbeats, weights, leave, the ring) is :mod:`oakemu_core.actor.client`;
what a join builds :mod:`oakemu_core.actor.join_setup`; which weights act and which wait
:mod:`oakemu_core.actor.weights` (the stepper's policy version is the actor's one record of them).
Run with ``oakemu actor`` or ``python -m oakemu_services.actor``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch
import zmq
from oakemu_services.runtime import (
    INTERRUPTED_EXIT_STATUS,
    SETUP_ERROR_EXIT_STATUS,
    RetryReporter,
    install_stop_signals,
    interrupted_status,
    setup_logging,
    socket_buffer_bytes,
    startup_done,
)

from oakemu_core.actor.central_inference import (
    INFERENCE_ADDRESS_ENV,
    CentralInferenceError,
    InferenceClient,
)
from oakemu_core.actor.client import (
    WEIGHTS_MISSED_S,
    ActorSetupError,
    ControlChannel,
    LearnerClient,
    LearnerUnreachable,
    newest_message,
    subscribe_weights,
)
from oakemu_core.actor.join_setup import ActorPolicy, set_up_policy
from oakemu_core.actor.pacing import AHEAD_SEGMENTS, AHEAD_WAIT_S, WEIGHTS_WAIT_WARNING_S, Pacing
from oakemu_core.actor.stepper import PolicyStepper, SteppedRow
from oakemu_core.actor.weights import ActorWeights
from oakemu_core.algo.ppo import cpu_has_native_bfloat16
from oakemu_core.config import ConfigError, OakEmuConfig
from oakemu_core.envs.spec import is_atari_env
from oakemu_core.run.metrics import StepRateMeter
from oakemu_core.transport.auth import client_security
from oakemu_core.transport.channels import StepChannel, open_step_channel, step_socket_connector
from oakemu_core.transport.control import JoinReply, JoinRequest, StopNotice, WeightsMessage
from oakemu_core.transport.liveness import process_identity
from oakemu_core.transport.step_blocks import StepBlock
from oakemu_core.transport.step_ring import StepRing, shared_memory_host_id
from oakemu_core.transport.steps import StepMessage, StepSpec

__all__ = [
    "AHEAD_SEGMENTS",
    "AHEAD_WAIT_S",
    "Actor",
    "ActorSetupError",
    "LearnerUnreachable",
    "main",
]

log = logging.getLogger("oakemu.actor")

HEARTBEAT_PERIOD_S = 1.0


class Actor:
    """One actor process: joins the learner, then steps and streams until told to stop.

    The socket-free parts are :mod:`oakemu_core.actor`'s: what a join builds
    (:class:`~oakemu_core.actor.join_setup.ActorPolicy`), the weights it acts with and holds
    (:class:`~oakemu_core.actor.weights.ActorWeights`: the stepper's policy version is the one
    record of them), how far it acts ahead (:class:`~oakemu_core.actor.pacing.Pacing`).
    """

    def __init__(self, config: OakEmuConfig, stop_event: threading.Event) -> None:
        self.config = config
        self.stop_event = stop_event
        self.actor_id = config.actor_id or f"{socket.gethostname()}-{os.getpid()}"
        self.context = zmq.Context()
        self.security = client_security(config)  # CURVE keys (oakemu_core.transport.auth)
        control = ControlChannel(
            self.context,
            config.learner_address(config.control_port),
            config.max_message_bytes,
            self.security,
        )
        patience_s = 3 * config.actor_timeout_s
        pid, pid_namespace = process_identity()
        request = JoinRequest(  # the client gives every join its own incarnation
            actor_id=self.actor_id,
            incarnation="",
            num_envs=config.envs_per_actor,
            hostname=socket.gethostname(),
            host_id=shared_memory_host_id() if config.step_transport == "auto" else "",
            inference_precision="bfloat16" if config.actor_inference == "bfloat16" else "float32",
            pid=pid,
            pid_namespace=pid_namespace,
        )
        # Heartbeats that get no answer mid-run are reported every few seconds, not only the give-up.
        self.client = LearnerClient(
            control,
            request,
            patience_s=patience_s,
            silence=RetryReporter(log, "learner", control.address, give_up_s=patience_s),
        )
        self.next_heartbeat = 0.0
        self.learner_holds_rows = 0  # the last heartbeat reply's held_rows: our steps it holds
        self.episodes = 0
        self.sps_meter = StepRateMeter(window=32)
        self.env_steps = 0
        self.policy: ActorPolicy | None = None  # envs, model, stepper: built by the first join
        self.stepper: PolicyStepper | None = None  # the policy's
        self.weights: ActorWeights | None = None  # loaded, held, fetched: from the first join on
        self.pacing = Pacing()
        self.seq = 0  # of the next step message of this incarnation
        self.steps_per_message = 1
        self.block: StepBlock | None = None  # the K vector steps of the next message
        self.channel: StepChannel | None = None  # the step channel of this incarnation
        self.weights_sub: zmq.Socket | None = None
        self.inference: InferenceClient | None = None  # actor_inference "central": the server
        if config.actor_inference == "central":
            self.inference = InferenceClient(
                self.context,
                central_inference_address(),
                name=self.actor_id,
                timeout_s=config.actor_timeout_s,
                max_bytes=config.max_message_bytes,
                stop=stop_event,
            )

    @property
    def incarnation(self) -> str:
        """Id of the current join."""
        return self.client.incarnation

    # -- joining ---------------------------------------------------------------------------
    def join(self) -> JoinReply:
        """Join as a new incarnation (retrying while the learner is not up yet); the first join builds
        envs, model and stepper; every join opens the step channel and loads the weights it returns."""
        reporter = RetryReporter(
            log, "learner", self.client.control.address, give_up_s=self.client.join_patience_s
        )
        reply = self.client.join(self.stop_event, reporter)
        spec, env_config = reply.spec, reply.env_config
        assert spec is not None
        self.seq = 0
        if self.weights is None:  # the first join
            self.policy = set_up_policy(self.config, reply, self.actor_id, self.inference)
            self.stepper = self.policy.stepper
            self.weights = ActorWeights(self.stepper, self.policy.load)
            if self.config.actor_inference == "bfloat16" and cpu_has_native_bfloat16() is False:
                log.warning(
                    "actor %s: this CPU has no AVX512-BF16 or AMX: bfloat16 is emulated and slower "
                    "than --actor-inference torch",
                    self.actor_id,
                )
            self.weights_sub = subscribe_weights(
                self.context, self.config.learner_address(self.config.weights_port), self.security
            )
        self.pacing.joined(
            env_config,
            reply.policy_version,
            version_changed=reply.policy_version != self.weights.policy_version,
        )
        self._open_channel(spec, self.client.attach_ring(reply))
        self.weights.rejoined(reply.policy_version, reply.weights)
        threads = (
            f" ({self.config.resolved_emulator_threads()} emulator threads per env group)"
            if is_atari_env(str(env_config["env_id"]))
            else ""
        )
        log.info(
            "actor %s joined as #%d: %s x %d envs%s, policy version %d",
            self.actor_id,
            reply.actor_index,
            env_config["env_id"],
            self.config.envs_per_actor,
            threads,
            reply.policy_version,
        )
        return reply

    def _open_channel(self, spec: StepSpec, ring: StepRing | None) -> None:
        """The step channel of a join (through ``ring`` if attached; the previous incarnation's is
        closed, its socket kept when sized the same) and the step block of its K."""
        connect = step_socket_connector(
            self.context,
            self.config.learner_address(self.config.data_port),
            buffer_bytes=socket_buffer_bytes(spec.message_bytes()),
            security=self.security,
        )
        self.channel = open_step_channel(
            spec,
            ring,
            connect,
            self.stop_event,
            previous=self.channel,
            sync_rollout_length=self.pacing.sync_rollout_length,
        )
        self.steps_per_message = spec.steps_per_message
        self.block = StepBlock(spec.schema, spec.num_envs, spec.steps_per_message)

    # -- weights ---------------------------------------------------------------------------
    def _poll_weights(self, *, hold: bool = False) -> bool:
        """Take the newest message waiting on the weights socket: newer weights are loaded (True),
        or with ``hold`` kept for the segment's end (a synchronous segment is acted by one version
        to its end), so a wait inside a segment still hears a stop notice. A :class:`StopNotice`
        sets the stop event."""
        assert self.weights_sub is not None and self.weights is not None
        message = newest_message(self.weights_sub, self.config.max_message_bytes)
        if isinstance(message, StopNotice):
            log.info(
                "learner announced the end of the run to actor %s (%s)",
                self.actor_id,
                message.reason,
            )
            self.stop_event.set()
            return False
        return isinstance(message, WeightsMessage) and self.weights.take(message, hold=hold)

    def _reselect(self) -> None:
        """Newer weights were loaded after the pending action was chosen: choose it again."""
        assert self.stepper is not None
        self.stepper.reselect()

    # -- waiting ---------------------------------------------------------------------------
    def heartbeat_if_due(self) -> None:
        """Heartbeat once a second; rejoin when the learner forgot us, stop when it says so.
        Raises :class:`_Rejoined` after a rejoin, ``LearnerUnreachable`` past the patience."""
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        assert self.weights is not None
        self.next_heartbeat = now + HEARTBEAT_PERIOD_S
        self.sps_meter.sample(now, self.env_steps)
        reply = self.client.heartbeat(
            self.seq,
            self.weights.policy_version,
            self.sps_meter.rate,
            self.weights.policy_lag,
            self.episodes,
        )
        if reply is None:
            return
        self.weights.heard(reply.policy_version)
        self.learner_holds_rows = reply.held_rows
        if reply.status == "stop":
            log.info("learner asked actor %s to stop", self.actor_id)
            self.stop_event.set()
        elif reply.status == "rejoin":
            log.warning(
                "learner does not know actor %s/%s: joining again", self.actor_id, self.incarnation
            )
            self.join()
            raise _Rejoined
        else:
            self._catch_up(reply.policy_version, now)

    def _catch_up(self, learner_version: int, now: float) -> None:
        """After a heartbeat reply naming the learner's ``learner_version``: read the weights channel,
        then, once behind it for :data:`~oakemu_core.actor.client.WEIGHTS_MISSED_S`, ask for the
        current weights on the control socket. Asynchronous mode: loaded at once (the pending action
        chosen again with them); synchronous: held for the segment's end."""
        assert self.weights is not None
        hold = self.pacing.synchronous
        if learner_version > self.weights.newest_version() and self._poll_weights(hold=hold):
            self._reselect()
        if self.stop_event.is_set() or not self.weights.fetch_due(
            learner_version, now, WEIGHTS_MISSED_S
        ):
            return
        message = self.client.fetch_weights()
        if message is not None and self.weights.took_fetched(
            message, hold=hold, actor_id=self.actor_id
        ):
            self._reselect()

    def _pause(self, seconds: float, writable: zmq.Socket | None = None) -> None:
        """The wait of the step channel (:class:`oakemu_core.transport.channels.Pause`): up to ``seconds``,
        ended early by ``writable`` becoming writable or by a message on the weights socket. Newer
        weights are loaded and the pending action chosen again with them (asynchronous mode: the actor
        does not resume with a policy that went stale while it waited) or held for the segment's end
        (synchronous mode); a stop notice stops the actor at once. A pause under 1 ms is a sleep. Then
        a heartbeat if due."""
        assert self.weights_sub is not None
        if writable is not None:
            poller = zmq.Poller()
            poller.register(writable, zmq.POLLOUT)
            poller.register(self.weights_sub, zmq.POLLIN)
            readable = bool(dict(poller.poll(int(seconds * 1000))).get(self.weights_sub))
        elif seconds < 0.001:
            time.sleep(seconds)
            readable = False
        else:
            readable = bool(self.weights_sub.poll(int(seconds * 1000)))
        if readable and self._poll_weights(hold=self.pacing.synchronous):
            self._reselect()
        self.heartbeat_if_due()

    def send_step(self, message: StepMessage) -> None:
        """Send one step message (``message.seq`` is :attr:`seq`) through the step channel, waiting
        while it cannot take it. Raises :class:`_Rejoined` after a rejoin."""
        assert self.channel is not None
        self.channel.send(message, self._pause)

    def _wait_for_weights_newer_than(self, version: int, *, give_up_s: float | None) -> bool:
        """Poll the weights socket (heartbeats go on) until weights newer than ``version`` are
        loaded (True), the actor is told to stop, or ``give_up_s`` passed while the learner holds
        none of this actor's steps (False: acting on now is not thrown away). Without a limit
        (synchronous mode, at a segment end) a long wait is logged every :data:`WEIGHTS_WAIT_WARNING_S`.
        Raises :class:`_Rejoined` after a rejoin."""
        assert self.weights_sub is not None and self.weights is not None
        weights = self.weights
        weights.load_held()
        start = time.monotonic()
        warn_at = start + WEIGHTS_WAIT_WARNING_S
        while not self.stop_event.is_set() and weights.policy_version <= version:
            weights.load_held()  # those a heartbeat's weights request brought
            now = time.monotonic()
            if give_up_s is not None and now - start > give_up_s and not self.learner_holds_rows:
                return False
            if give_up_s is None and now > warn_at:
                log.warning(
                    "actor %s: waiting %.0f s for the weights after version %d (learner at version %d)",
                    self.actor_id,
                    WEIGHTS_WAIT_WARNING_S,
                    version,
                    weights.learner_version,
                )
                warn_at = now + WEIGHTS_WAIT_WARNING_S
            if self.weights_sub.poll(20):
                self._poll_weights()
            self.heartbeat_if_due()
        return weights.policy_version > version

    def wait_if_too_far_ahead(self) -> None:
        """Asynchronous mode: after :data:`AHEAD_SEGMENTS` segments acted by the current weights,
        wait for newer ones (heartbeats go on), at most :data:`AHEAD_WAIT_S` while the learner holds
        none of its steps (else until they arrive: what it acted now would be thrown away); the pending
        next action is then chosen again with them. Raises :class:`_Rejoined` after a rejoin."""
        assert self.stepper is not None
        version = self.stepper.policy_version
        if not self.pacing.too_far_ahead(version):
            return
        got_newer = self._wait_for_weights_newer_than(version, give_up_s=AHEAD_WAIT_S)
        if got_newer:
            self._reselect()
        self.pacing.waited(
            got_newer,
            stopped=self.stop_event.is_set(),
            policy_version=version,
            actor_id=self.actor_id,
        )

    # -- stepping --------------------------------------------------------------------------
    def act_block(self) -> tuple[StepMessage, SteppedRow, bool]:
        """Act the K vector steps of the next message into the step block: the message, its last row
        and whether that row ends a synchronous segment. Weights are picked up only before a block's
        first action (asynchronous mode: in the last step's ``before_next_action``), so one policy
        version acts on a whole block; K divides ``rollout_length``, so a segment end is always a
        block's last step."""
        assert self.stepper is not None and self.block is not None
        stepper, block, k, pacing = self.stepper, self.block, self.steps_per_message, self.pacing
        block.clear()
        for i in range(k):
            last = i == k - 1
            segment_end = last and pacing.ends_segment(k)
            row = stepper.step(
                before_next_action=None if pacing.synchronous or not last else self._poll_weights,
                segment_end=segment_end,
            )
            block.record(
                row.buffers.sent_fields(row.next_values, stepper.schema),
                row.policy_version,
                row.env_step.episode_returns,
                row.env_step.episode_lengths,
                revision=row.policy_revision,
            )
            self.env_steps += row.buffers.num_envs
            self.episodes += len(row.env_step.episode_returns)
            pacing.acted(stepper.policy_version)
        return block.message(self.actor_id, self.incarnation, self.seq), row, segment_end

    def run(self) -> int:
        """Join (with ``actor_inference`` central, once the inference server is up), then act and send
        one message of K vector steps at a time until told to stop; 0."""
        if self.inference is not None:
            device = self.inference.wait_ready(self.stop_event)
            log.info(
                "actor %s: the inference server at %s is up (%s)",
                self.actor_id,
                self.inference.address,
                device,
            )
        self.join()
        startup_done()
        assert self.stepper is not None
        while not self.stop_event.is_set():
            try:
                self.wait_if_too_far_ahead()
                assert self.channel is not None
                self.channel.wait_writable(self.seq, self._pause)
            except _Rejoined:
                continue
            if self.stop_event.is_set():  # told to stop while waiting: act nothing more
                break
            message, row, segment_end = self.act_block()
            try:
                self.heartbeat_if_due()
                self.send_step(message)
                self.seq += 1
                self.pacing.sent(self.steps_per_message, segment_end)
                if segment_end:
                    self._wait_for_weights_newer_than(row.policy_version, give_up_s=None)
            except _Rejoined:
                pass  # this block is lost with the old incarnation; the new one starts at seq 0
        return 0

    def close(self) -> None:
        """Say goodbye (best effort), then release env and sockets."""
        if self.weights is not None:
            self.weights.log_summary(self.actor_id)
        self.pacing.log_summary(self.actor_id)
        if self.channel is not None:
            if self.channel.slot_waits:
                log.info(
                    "actor %s: %d step messages waited for a free step-ring slot",
                    self.actor_id,
                    self.channel.slot_waits,
                )
            self.client.leave()
            self.channel.close()
            self.channel = None
        self.client.control.close()
        if self.policy is not None:
            self.policy.env.close()
        if self.inference is not None:
            self.inference.close()
        self.context.destroy(linger=0)


class _Rejoined(Exception):
    """Internal: the actor joined again (new incarnation) in the middle of a step."""


def central_inference_address() -> str:
    """The inference server's address ``oakemu train`` gave its actors.

    Raises:
        ConfigError: none given: a standalone actor (on another machine) has no inference server.
    """
    address = os.environ.get(INFERENCE_ADDRESS_ENV)
    if not address:
        raise ConfigError(
            "actor_inference: 'central' serves the actors oakemu train starts beside its inference "
            "server; this actor has none (use --actor-inference auto)"
        )
    return address


def main(config: OakEmuConfig) -> int:
    """Entry point of ``oakemu actor``: 0 when told to stop (by the learner, or SIGTERM), 130 after
    Ctrl-C (SIGINT), 1 when the learner or the inference server is unreachable."""
    setup_logging(config.log_level, config.log_format)
    if (
        config.actor_inference == "central"
    ):  # before joining: an actor that cannot act holds no slot
        central_inference_address()
    if config.actor_inference == "onnxruntime":  # before joining: a missing package holds no slot
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    torch.set_num_threads(config.torch_threads)
    stop_event = install_stop_signals()
    actor = Actor(config, stop_event)
    try:
        return interrupted_status(actor.run(), stop_event)
    except CentralInferenceError as error:
        if stop_event.is_set():  # told to stop while waiting for the inference server
            return interrupted_status(0, stop_event)
        log.error("actor %s: %s", actor.actor_id, error)
        return 1
    except LearnerUnreachable as error:
        log.error("actor %s: %s", actor.actor_id, error)
        return 1
    except ActorSetupError as error:
        log.error("actor %s: %s", actor.actor_id, error)
        return SETUP_ERROR_EXIT_STATUS
    except KeyboardInterrupt:  # stopped while joining, or a second Ctrl-C
        return interrupted_status(0, stop_event) if stop_event.is_set() else INTERRUPTED_EXIT_STATUS
    finally:
        actor.close()


if __name__ == "__main__":
    import sys

    from oakemu_services.cli import main as cli_main

    raise SystemExit(cli_main(["actor", *sys.argv[1:]]))
