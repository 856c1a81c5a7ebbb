"""Actor process: steps a vector env with a local CPU copy of the policy and streams steps to the learner.

Per vector step: record the observations and the policy's action bundle, step the envs, record
rewards / dones / truncation (with the value of the TRUE final observation of a truncated episode,
from the policy that acted), pick up newer weights, choose the next actions (whose values are also
the bootstrap ``next_values`` of this step). Every K vector steps (the join's ``steps_per_message``)
go to the learner as one message through the join's step channel (:mod:`oakemu_core.transport.channels`:
arrays inline, or in a step ring on the learner's machine). While the channel cannot take the next
message the actor waits before acting its steps; heartbeats go on and newer weights are loaded.

Pacing: an asynchronous actor acts at most :data:`AHEAD_SEGMENTS` segments with one policy version,
then waits (at most :data:`AHEAD_WAIT_S`) for newer weights, so it does not compute steps the learner
could not store. A synchronous one (``env_config["mode"] == "sync"``) sends the last row of each
segment of ``rollout_length`` rows (its ``next_values`` from the policy that acted) and waits for
weights newer than that policy, which act the next segment (policy lag 0 for every row).

Weights come on the weights channel; an actor whose heartbeat replies name a newer policy version
than it has for :data:`~oakemu_core.actor.client.WEIGHTS_MISSED_S` asks for them on the control
socket instead (the channel lost them), in both modes: asynchronous, it loads them at once;
synchronous, they are kept for the segment's end like weights read inside a segment.

Talking to the learner (join, heartbeats, weights, leave, the ring) is :mod:`oakemu_core.actor.client`.
Run with ``oakemu actor`` or ``python -m oakemu_services.actor``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np
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

from oakemu_core.actor.client import (
    WEIGHTS_MISSED_S,
    ActorSetupError,
    ControlChannel,
    LearnerClient,
    LearnerUnreachable,
    make_envs,
    make_inference_backend,
    make_model,
    make_stepper,
    newest_message,
    subscribe_weights,
)
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.algo.ppo import cpu_has_native_bfloat16
from oakemu_core.config import OakEmuConfig
from oakemu_core.envs.spec import is_atari_env
from oakemu_core.envs.vector import EnvGroups, VectorEnv
from oakemu_core.policy.models import ActorCritic, load_weight_arrays
from oakemu_core.run.metrics import StepRateMeter
from oakemu_core.transport.auth import client_security
from oakemu_core.transport.channels import StepChannel, open_step_channel, step_socket_connector
from oakemu_core.transport.control import JoinReply, JoinRequest, StopNotice, WeightsMessage
from oakemu_core.transport.liveness import process_identity
from oakemu_core.transport.step_blocks import StepBlock
from oakemu_core.transport.step_ring import StepRing, shared_memory_host_id
from oakemu_core.transport.steps import StepMessage, StepSpec

__all__ = ["Actor", "ActorSetupError", "LearnerUnreachable", "main"]

log = logging.getLogger("oakemu.actor")

HEARTBEAT_PERIOD_S = 1.0
WEIGHTS_WAIT_WARNING_S = 30.0
"""Say so when the weights of a finished segment (synchronous mode) take longer than this."""
AHEAD_SEGMENTS = 2
"""Asynchronous mode: segments (``rollout_length`` vector steps each) an actor acts with one policy
version before it waits for newer weights. A new version comes with each released buffer, into which
the actor's held segment is written; it fills one segment and holds the next while the other buffer
trains."""
AHEAD_WAIT_S = 1.0
"""Longest wait for newer weights once :data:`AHEAD_SEGMENTS` are used up; then the actor goes on
(a fresh allowance). A run where every actor waits and no buffer can fill is thereby never stuck."""


class Actor:
    """One actor process: joins the learner, then steps and streams until told to stop."""

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
        self.learner_version = 0
        self.learner_holds_rows = (
            0  # the last heartbeat reply's held_rows: steps of ours the learner holds
        )
        self.held_weights: WeightsMessage | None = (
            None  # read within a synchronous segment, loaded at its end
        )
        self.behind_since: float | None = (
            None  # when a heartbeat reply first named a version newer than ours
        )
        self.weights_fetched = (
            0  # weights asked for on the control socket (the weights channel missed them)
        )
        self.episodes = 0
        self.sps_meter = StepRateMeter(window=32)
        self.env_steps = 0
        self.env: VectorEnv | EnvGroups | None = None
        self.model: ActorCritic | None = None
        self.inference_backend: Any = (
            None  # forward of actor_inference other than torch's (has .load)
        )
        self.stepper: PolicyStepper | None = None
        self.policy_version = 0
        self.weights_revision = (
            0  # > 0: weights published within the update that makes policy_version + 1
        )
        self.seq = 0  # of the next step message of this incarnation
        self.steps_per_message = 1
        self.block: StepBlock | None = None  # the K vector steps of the next message
        self.channel: StepChannel | None = None  # the step channel of this incarnation
        self.weights_sub: zmq.Socket | None = None
        self.sync_rollout_length = 0  # > 0: synchronous mode, rows per segment
        self.segment_rows = 0  # rows of the current segment sent (synchronous mode)
        self.ahead_rows = (
            0  # asynchronous mode: allowance of vector steps per policy version (0: none)
        )
        self.rows_this_version = 0  # vector steps acted since the current weights were loaded
        self.ahead_waits = 0
        self.ahead_waits_timed_out = 0
        self.revisions_loaded = 0  # weights published within an update (publish_every_epoch) loaded

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
        if self.stepper is None:  # the first join
            torch.manual_seed(int(env_config["seed"]))
            self.env = make_envs(self.config, reply)
            self.model = make_model(
                self.env, reply
            )  # the first actions come from the learner's weights
            if self.config.actor_inference != "torch":
                self.inference_backend = make_inference_backend(
                    self.config.actor_inference,
                    self.model,
                    threads=self.config.torch_threads,
                    actor_id=self.actor_id,
                )
                self.model.use_inference_backend(
                    self.inference_backend
                )  # None ("auto" for a CNN): torch's
                if self.config.actor_inference == "bfloat16" and cpu_has_native_bfloat16() is False:
                    log.warning(
                        "actor %s: this CPU has no AVX512-BF16 or AMX: bfloat16 is emulated and slower "
                        "than --actor-inference torch",
                        self.actor_id,
                    )
            self.stepper = make_stepper(self.env, self.model, reply)
            self.weights_sub = subscribe_weights(
                self.context, self.config.learner_address(self.config.weights_port), self.security
            )
        self.sync_rollout_length = (
            int(env_config.get("rollout_length") or 0) if env_config.get("mode") == "sync" else 0
        )
        self._open_channel(spec, self.client.attach_ring(reply))
        self._load_weights(reply.policy_version, reply.weights)
        self.ahead_rows = (
            0
            if self.sync_rollout_length
            else AHEAD_SEGMENTS * int(env_config.get("rollout_length") or 0)
        )
        self.segment_rows = 0  # a new incarnation starts a new segment
        self.held_weights = (
            None  # read for the last one's segment, perhaps from a learner that restarted since
        )
        self.behind_since = None
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
            sync_rollout_length=self.sync_rollout_length,
        )
        self.steps_per_message = spec.steps_per_message
        self.block = StepBlock(spec.schema, spec.num_envs, spec.steps_per_message)

    # -- weights ---------------------------------------------------------------------------
    def _load_weights(
        self, version: int, weights: dict[str, np.ndarray], revision: int = 0
    ) -> None:
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

    def _poll_weights(self, *, hold: bool = False) -> bool:
        """Load the newest weights waiting on the weights socket, if newer (policy version, then the
        revision within an update); True when loaded. A :class:`StopNotice` sets the stop event.
        ``hold``: keep newer weights for :meth:`_load_held_weights` instead (a synchronous segment is
        acted by one version to its end), so a wait inside a segment still hears a stop notice."""
        assert self.weights_sub is not None
        message = newest_message(self.weights_sub, self.config.max_message_bytes)
        if isinstance(message, StopNotice):
            log.info(
                "learner announced the end of the run to actor %s (%s)",
                self.actor_id,
                message.reason,
            )
            self.stop_event.set()
            return False
        return isinstance(message, WeightsMessage) and self._take_weights(message, hold=hold)

    def _take_weights(self, message: WeightsMessage, *, hold: bool) -> bool:
        """Load ``message`` if newer than the weights acting (True), or with ``hold`` keep it for
        :meth:`_load_held_weights` if newer than those and any held already (False)."""
        if not self._is_newer(message):
            return False
        if hold:
            held = self.held_weights
            if held is None or (message.policy_version, message.revision) > (
                held.policy_version,
                held.revision,
            ):
                self.held_weights = message
            self.learner_version = max(
                self.learner_version, message.policy_version
            )  # the lag heartbeats report
            return False
        self._load_weights(message.policy_version, message.weights, message.revision)
        return True

    def _is_newer(self, message: WeightsMessage) -> bool:
        return (message.policy_version, message.revision) > (
            self.policy_version,
            self.weights_revision,
        )

    def _load_held_weights(self) -> None:
        """Load the weights :meth:`_poll_weights` held during a synchronous segment, if still newer."""
        message, self.held_weights = self.held_weights, None
        if message is not None and self._is_newer(message):
            self._load_weights(message.policy_version, message.weights, message.revision)

    # -- waiting ---------------------------------------------------------------------------
    def heartbeat_if_due(self) -> None:
        """Heartbeat once a second; rejoin when the learner forgot us, stop when it says so.
        Raises :class:`_Rejoined` after a rejoin, ``LearnerUnreachable`` past the patience."""
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + HEARTBEAT_PERIOD_S
        self.sps_meter.sample(now, self.env_steps)
        reply = self.client.heartbeat(
            self.seq,
            self.policy_version,
            self.sps_meter.rate,
            float(self.learner_version - self.policy_version),
            self.episodes,
        )
        if reply is None:
            return
        self.learner_version = max(self.learner_version, reply.policy_version)
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

    def _newest_weights_version(self) -> int:
        """The newest policy version this actor has: acting, or held for its segment's end."""
        return max(
            self.policy_version,
            -1 if self.held_weights is None else self.held_weights.policy_version,
        )

    def _catch_up(self, learner_version: int, now: float) -> None:
        """After a heartbeat reply naming the learner's ``learner_version``: once the actor has been behind
        it for :data:`~oakemu_core.actor.client.WEIGHTS_MISSED_S` with the weights channel read, ask
        for the current weights on the control socket. Asynchronous mode: loaded at once (the pending
        action chosen again with them); synchronous: held for the segment's end."""
        hold = bool(self.sync_rollout_length)
        if (
            learner_version > self._newest_weights_version()
            and self._poll_weights(hold=hold)
            and self.stepper is not None
        ):
            self.stepper.reselect()
        if learner_version <= self._newest_weights_version():
            self.behind_since = None
            return
        if self.behind_since is None:
            self.behind_since = now
        if now - self.behind_since < WEIGHTS_MISSED_S or self.stop_event.is_set():
            return
        self.behind_since = (
            None  # the next request another WEIGHTS_MISSED_S later, if this one fails
        )
        message = self.client.fetch_weights()
        if message is None:
            return
        self.weights_fetched += 1
        log.log(
            logging.WARNING if self.weights_fetched == 1 else logging.DEBUG,
            "actor %s: the weights channel missed policy version %d (acting with %d): fetched on the control "
            "socket",
            self.actor_id,
            message.policy_version,
            self.policy_version,
        )
        if self._take_weights(message, hold=hold) and self.stepper is not None:
            self.stepper.reselect()

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
        if (
            readable
            and self._poll_weights(hold=bool(self.sync_rollout_length))
            and self.stepper is not None
        ):
            self.stepper.reselect()
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
        assert self.weights_sub is not None
        self._load_held_weights()
        start = time.monotonic()
        warn_at = start + WEIGHTS_WAIT_WARNING_S
        while not self.stop_event.is_set() and self.policy_version <= version:
            self._load_held_weights()  # those a heartbeat's weights request brought
            now = time.monotonic()
            if give_up_s is not None and now - start > give_up_s and not self.learner_holds_rows:
                return False
            if give_up_s is None and now > warn_at:
                log.warning(
                    "actor %s: waiting %.0f s for the weights after version %d (learner at version %d)",
                    self.actor_id,
                    WEIGHTS_WAIT_WARNING_S,
                    version,
                    self.learner_version,
                )
                warn_at = now + WEIGHTS_WAIT_WARNING_S
            if self.weights_sub.poll(20):
                self._poll_weights()
            self.heartbeat_if_due()
        return self.policy_version > version

    def wait_if_too_far_ahead(self) -> None:
        """Asynchronous mode: after :data:`AHEAD_SEGMENTS` segments acted by the current weights,
        wait for newer ones (heartbeats go on), at most :data:`AHEAD_WAIT_S` while the learner holds
        none of its steps (else until they arrive: what it acted now would be thrown away); the pending next action
        is then chosen again with them. Raises :class:`_Rejoined` after a rejoin."""
        if not self.ahead_rows or self.rows_this_version < self.ahead_rows:
            return
        assert self.stepper is not None
        self.ahead_waits += 1
        if self._wait_for_weights_newer_than(self.policy_version, give_up_s=AHEAD_WAIT_S):
            self.stepper.reselect()
        elif not self.stop_event.is_set():
            self.ahead_waits_timed_out += 1
            log.debug(
                "actor %s: no weights after version %d within %.1f s; acting on",
                self.actor_id,
                self.policy_version,
                AHEAD_WAIT_S,
            )
            self.rows_this_version = 0

    # -- stepping --------------------------------------------------------------------------
    def run(self) -> int:
        """Join, then act and send one message of K vector steps at a time until told to stop; 0."""
        self.join()
        startup_done()
        assert self.stepper is not None
        stepper = self.stepper
        while not self.stop_event.is_set():
            # K divides rollout_length, so a segment end is always a block's last step. Weights are
            # picked up only before a block's first action, so one policy version acts on a whole block.
            block, k = self.block, self.steps_per_message
            try:
                self.wait_if_too_far_ahead()
                assert self.channel is not None and block is not None
                self.channel.wait_writable(self.seq, self._pause)
            except _Rejoined:
                continue
            if self.stop_event.is_set():  # told to stop while waiting: act nothing more
                break
            block.clear()
            for i in range(k):
                last = i == k - 1
                segment_end = (
                    bool(self.sync_rollout_length)
                    and last
                    and self.segment_rows + k == self.sync_rollout_length
                )
                row = stepper.step(
                    before_next_action=None
                    if self.sync_rollout_length or not last
                    else self._poll_weights,
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
                self.rows_this_version += 1
                self.episodes += len(row.env_step.episode_returns)
            message = block.message(self.actor_id, self.incarnation, self.seq)
            try:
                self.heartbeat_if_due()
                self.send_step(message)
                self.seq += 1
                self.segment_rows = 0 if segment_end else self.segment_rows + k
                if segment_end:
                    self._wait_for_weights_newer_than(row.policy_version, give_up_s=None)
            except _Rejoined:
                pass  # this block is lost with the old incarnation; the new one starts at seq 0
        return 0

    def close(self) -> None:
        """Say goodbye (best effort), then release env and sockets."""
        if self.revisions_loaded:
            log.info(
                "actor %s loaded %d weight revisions published within updates",
                self.actor_id,
                self.revisions_loaded,
            )
        if self.weights_fetched:
            log.info(
                "actor %s fetched the weights %d times on the control socket (the weights channel missed them)",
                self.actor_id,
                self.weights_fetched,
            )
        if self.ahead_waits:
            log.info(
                "actor %s waited for newer weights %d times (%d gave up after %.1f s)",
                self.actor_id,
                self.ahead_waits,
                self.ahead_waits_timed_out,
                AHEAD_WAIT_S,
            )
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
        if self.env is not None:
            self.env.close()
        self.context.destroy(linger=0)


class _Rejoined(Exception):
    """Internal: the actor joined again (new incarnation) in the middle of a step."""


def main(config: OakEmuConfig) -> int:
    """Entry point of ``oakemu actor``: 0 when told to stop (by the learner, or SIGTERM), 130 after
    Ctrl-C (SIGINT), 1 when the learner is unreachable."""
    setup_logging(config.log_level, config.log_format)
    if config.actor_inference == "onnxruntime":  # before joining: a missing package holds no slot
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    torch.set_num_threads(config.torch_threads)
    stop_event = install_stop_signals()
    actor = Actor(config, stop_event)
    try:
        return interrupted_status(actor.run(), stop_event)
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
