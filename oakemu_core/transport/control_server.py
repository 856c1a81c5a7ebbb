"""The learner's side of the control protocol, without sockets: joins, heartbeats and leaves in,
encoded replies out.

:class:`ControlServer` takes a decoded request (:class:`~oakemu_core.transport.control.JoinRequest`,
:class:`~oakemu_core.transport.control.Heartbeat`, :class:`~oakemu_core.transport.control.Leave`) with the
ZeroMQ identity and peer it came from, and returns the replies to send as ``(identity, frame)``
pairs: usually one, none for a synchronous-mode join that is held (see below); held joins are
answered by :meth:`ControlServer.tick`. It decides

* who may speak for an actor (:class:`~oakemu_core.transport.auth.PeerBinding`: an actor id belongs
  to the connection it joined from while the actor is connected; a join, heartbeat or leave for it
  from any other connection is refused and counted as ``impersonation``);
* whether a join is within the run's limits (:class:`~oakemu_core.transport.peer_limits.PeerLimits`:
  env count, connected actors) and its host's join rate (:class:`~oakemu_core.transport.peer_limits.JoinRate`:
  a join beyond it is answered "too many joins, retry in X s" with ``retry_after_s``; a join asked again
  by an incarnation already joined or held takes no further token);
* whether a join is accepted, with which :class:`~oakemu_core.transport.steps.StepSpec` (steps per
  message from the joining actor's env count), step ring (a callback the service passes in) and
  ``env_config`` (the scalars every actor builds its envs from);
* the synchronous mode's rollout members (:class:`~oakemu_core.transport.sync_joins.SyncJoins`: held
  joins, answered by :meth:`ControlServer.tick`);
* the weights an actor asks for on the control socket (a ``weights_request``: its weights channel
  missed a version the heartbeat replies name), answered with the current ones; the control socket is
  point to point and its requests are asked again, so an actor gets them even when every publication
  on the weights channel passes it by (a subscriber that connected late or whose queue was full);
* whether the run has an actor acting with rounded weights (:attr:`ControlServer.reevaluate_every_rollout`);
* which actors' processes it watches (:class:`~oakemu_core.transport.liveness.LocalProcesses`: those in
  the learner's PID namespace), so one that exits is dropped at once (:meth:`ControlServer.drop_gone_actors`).

The joined actors are the assembler's :class:`~oakemu_core.storage.actors.ActorRegistry`; the server
hands it the holders it makes (peer binding, process watch), which its ``forget`` releases. The
policy version and weights the replies carry are the assembler's
:class:`~oakemu_core.transport.published.PublishedWeights`, which the learner publishes.

The service (``oakemu_services.learner``) owns the sockets and the envelope framing. Every log line
a peer can cause goes through a rate-limited log (``rejections``, ``notices``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.policy.bfloat16_inference import check_supported as check_bfloat16_supported
from oakemu_core.policy.network import NetworkSettings
from oakemu_core.transport.auth import is_generated_routing_id
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    ACTOR_ID_IN_USE,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    WeightsMessage,
    WeightsRequest,
    encode_heartbeat_reply,
    encode_join_reply,
    encode_weights,
)
from oakemu_core.transport.frame_stacks import wire_bytes_per_env
from oakemu_core.transport.liveness import LocalProcesses
from oakemu_core.transport.peer_limits import JoinRate, PeerLimits
from oakemu_core.transport.steps import StepSpec
from oakemu_core.transport.sync_joins import JOIN_WAIT_NOTICE_S, START_GRACE_S, SyncJoins

if TYPE_CHECKING:
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.step_schema import StepSchema
    from oakemu_core.storage.actors import ActorRecord
    from oakemu_core.storage.assembler import RolloutAssembler
    from oakemu_core.transport.auth import PeerBinding

__all__ = [
    "ANONYMOUS_REFUSAL",
    "JOIN_WAIT_NOTICE_S",
    "MAX_ACTOR_ENVS",
    "START_GRACE_S",
    "ControlServer",
    "Reply",
    "env_config",
    "step_spec_for",
]

log = logging.getLogger("oakemu.learner")

ANONYMOUS_REFUSAL = (
    "the control socket has no routing id of its own: an actor's REQ socket sets one "
    "(oakemu_core.transport.auth.new_routing_id), kept for the process's life"
)
"""Reason of a join refused from a connection whose routing id ZeroMQ generated."""

MAX_ACTOR_ENVS = 65_536
"""Largest ``num_envs`` an actor may declare (the wire's limit for one array dimension); the run's
own, lower limit is ``max_envs_per_actor`` (:class:`~oakemu_core.transport.peer_limits.PeerLimits`)."""

Reply = tuple[Any, bytes]
"""``(identity, encoded reply)``: the ZeroMQ identity of the requester and the frame to send it."""


def env_config(config: OakEmuConfig, index: int) -> dict[str, Any]:
    """The scalars the actor of index ``index`` builds its envs from (the join reply's
    ``env_config``): env id and limits, reward clipping, observation normalisation, emulator
    settings, its env seed (``seed + 1000 * (index + 1)``), policy routing (the actor routes, the
    rows arrive non-trainable: :mod:`oakemu_core.actor.routing`) and the mode (in ``"sync"`` the
    actor ends a segment every ``rollout_length`` steps and waits there for the weights trained on
    it) and the policy network's settings (:class:`~oakemu_core.policy.network.NetworkSettings`)."""
    return {
        "env_id": config.env_id,
        "max_episode_steps": config.max_episode_steps,
        "clip_rewards": config.resolved_clip_rewards,
        "normalize_observations": config.normalize_observations,
        "emulator_settings": config.emulator_settings,
        "seed": config.seed + 1000 * (index + 1),
        "route_random_first_steps": config.route_random_first_steps,
        "route_random_probability": config.route_random_probability,
        "route_scripted_policy": config.route_scripted_policy,
        "route_scripted_probability": config.route_scripted_probability,
        "mode": config.mode,
        "rollout_length": config.rollout_length,
        **{name: getattr(config, name) for name in NetworkSettings.model_fields},
        **config.env_options.to_dict(),  # gymnasium.make keyword arguments, Atari preprocessing
    }


def step_spec_for(
    config: OakEmuConfig, schema: StepSchema, num_envs: int, *, step_ring: bool
) -> StepSpec:
    """The spec of the step messages of an actor of ``num_envs`` envs: K from
    ``config.resolved_steps_per_message`` (without the byte bound for a step ring). Through the
    sockets an automatic K also keeps a message of whole stacks (after resets, key frames: up to S
    times the deduplicated bytes) within ``max_message_bytes``, or such messages, and every message
    rebuilt from them, would be rejected."""
    steps = config.resolved_steps_per_message(
        wire_bytes_per_env(schema), num_envs, step_ring=step_ring
    )
    if not step_ring and config.steps_per_message == "auto":
        whole_step = num_envs * schema.sent_bytes_per_env()
        steps = max(
            k
            for k in range(1, steps + 1)
            if steps % k == 0 and (k == 1 or k * whole_step + 1024 <= config.max_message_bytes)
        )
    return StepSpec(num_envs=num_envs, schema=schema, steps_per_message=steps)


class ControlServer:
    """Answers the actors' control requests (see the module docstring).

    Args:
        config: the run's configuration (mode, actors, env settings, steps per message).
        schema: the run's step schema (the joining actors' step specs).
        observation_layout: the env's observation layout (may an actor act in bfloat16?).
        assembler: registers joined actors (its ``registry``: heartbeats, leaves, and the
            ``counters`` of every request served, ``accepted``, or refused, ``rejected``); its
            ``published`` weights are what the replies carry.
        peers: binds each actor id to the connection it joined from; the ``peer`` of :meth:`reply` is
            what its ``bind`` / ``allows_control`` take (:meth:`~oakemu_core.transport.auth.PeerBinding.connection`).
        rejections: logs a refused request, ``event(reason, text)`` (rate limited by the caller).
        notices: logs an actor's joins, leaves and waits, ``event(reason, text, level=...)`` (rate
            limited by the caller); None logs every line.
        limits: what a join may ask for; None: the limits of ``config``.
        host_id: this machine's shared-memory host id; ``""``: no step rings.
        offer_ring: ``(request, spec) -> StepRingOffer | None``: makes a step ring for a joining
            actor on this machine (None: no room, its arrays go inline).
        policy_version, weights: publish these weights now (:meth:`publish`); None: the
            assembler's published weights as they are.
        processes: watches the joined actors' processes (None: a :class:`LocalProcesses` on ``/proc``).
        join_rate: the joins each peer host may ask for (None: :class:`JoinRate`'s defaults).
    """

    def __init__(
        self,
        config: OakEmuConfig,
        schema: StepSchema,
        observation_layout: Any,
        assembler: RolloutAssembler,
        peers: PeerBinding,
        rejections: Any,
        *,
        host_id: str,
        offer_ring: Callable[[JoinRequest, StepSpec], StepRingOffer | None],
        policy_version: int | None = None,
        weights: dict[str, np.ndarray] | None = None,
        notices: Any = None,
        limits: PeerLimits | None = None,
        processes: LocalProcesses | None = None,
        join_rate: JoinRate | None = None,
    ) -> None:
        self.config = config
        self.schema = schema
        self.observation_layout = observation_layout
        self.assembler = assembler
        self.registry = assembler.registry
        self.counters = assembler.counters
        self.published = assembler.published
        self.peers = peers
        self.rejections = rejections
        self.notices = notices if notices is not None else _EveryLine()
        self.limits = limits if limits is not None else PeerLimits.from_config(config)
        self.host_id = host_id
        self.offer_ring = offer_ring
        self.sync = config.mode == "sync"
        if policy_version is not None:
            self.published.publish(policy_version, weights if weights is not None else {})
        self.processes = processes if processes is not None else LocalProcesses()
        self.registry.peers, self.registry.processes = peers, self.processes  # released by forget
        self.join_rate = join_rate if join_rate is not None else JoinRate()
        # The current weights, encoded once per version for weights requests: (version, frame).
        self._weights_frame: tuple[int, bytes] | None = None
        self.reevaluate_every_rollout = False
        """True once an actor acting with rounded weights (bfloat16) joined: every rollout is then
        re-evaluated in float32 before GAE."""
        self.sync_joins = SyncJoins(self)
        """Synchronous mode: the held joins and the actors' ranks."""

    @property
    def policy_version(self) -> int:
        """The published policy version, which every reply reports as the learner's."""
        return self.published.version

    def publish(self, policy_version: int, weights: dict[str, np.ndarray]) -> None:
        """Publish the newest weights (:meth:`PublishedWeights.publish`): what joining actors get
        and what every reply reports as the learner's version."""
        self.published.publish(policy_version, weights)

    # -- replies -----------------------------------------------------------------------------
    def rejoin(self) -> bytes:
        """The reply to a request that cannot be served (undecodable, unknown or refused): rejoin."""
        return encode_heartbeat_reply(
            HeartbeatReply(status="rejoin", policy_version=self.policy_version)
        )

    def refuse_join(self, reason: str) -> bytes:
        """A join reply refusing the join for ``reason``."""
        return encode_join_reply(JoinReply(False, reason, -1, None, {}, self.policy_version))

    def undecodable(self, error: MessageRejected) -> bytes:
        """Count a request rejected by the decoder and answer it with ``rejoin``."""
        self.counters.rejected[error.reason] += 1
        self.rejections.event(error.reason, str(error))
        return self.rejoin()

    def reply(
        self,
        message: Any,
        now: float,
        *,
        identity: Any = None,
        peer: Any = None,
        stopping: bool = False,
    ) -> list[Reply]:
        """Serve one decoded request from ``identity`` (its connection ``peer``, for the peer
        binding) at monotonic time ``now``; ``stopping``: the learner is shutting down (joins are
        refused, heartbeats answered ``stop``). Returns the replies to send, in order."""
        if isinstance(message, (JoinRequest, Heartbeat, Leave, WeightsRequest)):
            refusal = self._refuse_impersonation(message, peer)
            if refusal is not None:  # counted as such, never against its host's join rate
                return [(identity, refusal)]
        if isinstance(message, JoinRequest) and not stopping:
            throttled = self._throttle(message, now, peer)
            if throttled is not None:
                return [(identity, throttled)]
        if isinstance(message, JoinRequest):
            return self._join(message, now, identity, stopping)
        if isinstance(message, Heartbeat):
            known = self.registry.heartbeat(
                message.actor_id,
                message.incarnation,
                now=now,
                env_steps_per_second=message.env_steps_per_second,
                policy_lag=message.policy_lag,
                episodes=message.episodes,
            )
            self.counters.accepted["heartbeat" if known else "unknown_actor_control"] += 1
            status = "stop" if stopping else ("ok" if known else "rejoin")
            record = self.registry.get(message.actor_id, message.incarnation)
            held = record.pending_rows if record is not None else 0
            return [
                (
                    identity,
                    encode_heartbeat_reply(
                        HeartbeatReply(
                            status=status, policy_version=self.policy_version, held_rows=held
                        )
                    ),
                )
            ]
        if isinstance(message, WeightsRequest):
            return [(identity, self._weights_reply(message, stopping))]
        if isinstance(message, Leave):
            if self.assembler.leave(message.actor_id, message.incarnation):
                self.counters.accepted["leave"] += 1
                self.notices.event("leave", f"actor {message.actor_id} left", level=logging.INFO)
            else:
                self.counters.accepted["unknown_actor_control"] += 1
            return [
                (
                    identity,
                    encode_heartbeat_reply(
                        HeartbeatReply(status="stop", policy_version=self.policy_version)
                    ),
                )
            ]
        self.counters.rejected["schema"] += 1
        self.rejections.event(
            "schema", f"schema: a {type(message).__name__} is not a request the learner serves"
        )
        return [(identity, self.rejoin())]

    def _weights_reply(self, message: WeightsRequest, stopping: bool) -> bytes:
        """The current weights for a joined incarnation (encoded once per version), else ``rejoin`` (or
        ``stop`` while stopping)."""
        known = self.registry.get(message.actor_id, message.incarnation) is not None
        self.counters.accepted["weights_request" if known else "unknown_actor_control"] += 1
        if stopping or not known:
            return encode_heartbeat_reply(
                HeartbeatReply("stop" if stopping else "rejoin", self.policy_version)
            )
        self.notices.event(
            "weights_request",
            f"actor {message.actor_id} asked for the weights of version "
            f"{self.policy_version} on the control socket (its weights channel missed them)",
            level=logging.INFO,
        )
        published = self.published
        if self._weights_frame is None or self._weights_frame[0] != published.version:
            frame = encode_weights(WeightsMessage(published.version, published.weights))
            self._weights_frame = (published.version, frame)
        return self._weights_frame[1]

    def _throttle(self, message: JoinRequest, now: float, peer: Any) -> bytes | None:
        """None when ``message`` may be served (its host's :class:`JoinRate` had a token, or its
        incarnation joined or is held already: a join asked again); else the reply "too many joins,
        retry in X s", counted as ``rejected["join_rate"]``."""
        if self.answered_before(message) is not None or self.sync_joins.holds(message):
            return None
        host = peer.address if peer is not None else ""
        wait_s = self.join_rate.take(host, now)
        if wait_s <= 0.0:
            return None
        self.counters.rejected["join_rate"] += 1
        reason = f"too many joins from host {host or '(unknown)'}: retry in {wait_s:.1f} s"
        self.notices.event(
            "join_rate", f"actor {message.actor_id}: {reason}", level=logging.WARNING
        )
        return encode_join_reply(
            JoinReply(False, reason, -1, None, {}, self.policy_version, retry_after_s=wait_s)
        )

    def _refuse_impersonation(
        self, message: JoinRequest | Heartbeat | Leave | WeightsRequest, peer: Any
    ) -> bytes | None:
        """None when ``peer`` may speak for ``message.actor_id``; else the refusal, counted as
        ``anonymous_connection`` (a routing id ZeroMQ generated:
        :func:`~oakemu_core.transport.auth.is_generated_routing_id`) or ``impersonation``: a join for an
        actor id that a connected actor holds on another connection (the id is not taken over), a
        heartbeat or leave from another connection than its join's."""
        if peer is not None and is_generated_routing_id(peer.routing_id):
            # An earlier connection's unread request (the actor reconnected; ZeroMQ handed its routing
            # id to the new one), or a client that set no routing id: bound, it would tie the actor to
            # a connection nobody reads.
            self.counters.rejected["anonymous_connection"] += 1
            self.rejections.event(
                "anonymous_connection",
                f"anonymous_connection: a {type(message).__name__} for "
                f"actor {message.actor_id} from a connection without a routing id of its own",
            )
            return (
                self.refuse_join(ANONYMOUS_REFUSAL)
                if isinstance(message, JoinRequest)
                else self.rejoin()
            )
        if isinstance(message, JoinRequest):
            if self.peers.bind(message.actor_id, message.incarnation, peer):
                return None
            refusal = self.refuse_join(f"{ACTOR_ID_IN_USE} (until that actor leaves or times out)")
        elif self.peers.allows_control(message.actor_id, message.incarnation, peer):
            return None
        else:
            refusal = self.rejoin()
        self.counters.rejected["impersonation"] += 1
        self.rejections.event(
            "impersonation",
            f"impersonation: a {type(message).__name__} for actor {message.actor_id} from another "
            "connection than its join's",
        )
        return refusal

    def _join(self, message: JoinRequest, now: float, identity: Any, stopping: bool) -> list[Reply]:
        if stopping:
            self.counters.accepted["join_refused"] += 1
            return [(identity, self.refuse_join("learner is stopping"))]
        reason = self.limits.check_join(
            message,
            connected=len(self.registry),
            known=message.actor_id in self.registry.actors,
        )
        if reason is not None:
            self.counters.rejected["value_range"] += 1
            self.rejections.event(
                "value_range", f"value_range: join of actor {message.actor_id}: {reason}"
            )
            return [(identity, self.refuse_join(reason))]
        if (
            message.inference_precision == "bfloat16"
        ):  # refused before it counts as an actor that rounds
            try:
                check_bfloat16_supported(self.observation_layout)
            except ValueError as error:
                self.counters.accepted["join_refused"] += 1
                return [(identity, self.refuse_join(str(error)))]
        if self.sync:
            return self.sync_joins.join(message, now, identity)
        self.counters.accepted["join"] += 1
        return [(identity, self.grant_join(message, now, index=None))]

    def answered_before(self, message: JoinRequest) -> ActorRecord | None:
        """The joined record of ``message``'s incarnation (a join asked again), or None."""
        return self.registry.get(message.actor_id, message.incarnation)

    def grant_join(self, message: JoinRequest, now: float, index: int | None) -> bytes:
        """Register a joining actor (``index``: its synchronous-mode rank, None: the next number; a
        join asked again keeps its index) and encode the join reply with its spec, env config and the
        current weights."""
        retried = self.answered_before(message)
        if retried is not None:
            index = retried.index
        reachable = (
            bool(self.host_id) and message.host_id == self.host_id
        )  # same kernel and /dev/shm mount
        spec = self.step_spec(message.num_envs, step_ring=reachable)
        ring = self.offer_ring(message, spec) if reachable else None
        if reachable and ring is None:  # no room for a ring: the K of inline messages
            spec = self.step_spec(message.num_envs, step_ring=False)
        record = self.assembler.join(
            message.actor_id,
            message.incarnation,
            spec,
            hostname=message.hostname,
            now=now,
            index=index,
        )
        watched = self.processes.watch(
            message.actor_id, message.incarnation, message.pid, message.pid_namespace
        )
        if retried is None:  # a join asked again is answered again, and said once
            self.notices.event(
                "join",
                f"actor {message.actor_id} joined ({message.num_envs} envs, host "
                f"{message.hostname}, index {record.index}"
                f"{f', process {message.pid} watched' if watched else ''})",
                level=logging.INFO,
            )
        if message.inference_precision == "bfloat16" and not self.reevaluate_every_rollout:
            self.reevaluate_every_rollout = True
            log.info(
                "actor %s acts in %s: every rollout is re-evaluated in float32 before GAE%s",
                message.actor_id,
                message.inference_precision,
                ""
                if self.config.off_policy_correction == "decoupled"
                else " only with off_policy_correction 'decoupled' (the run has 'none': its rounded log-probs "
                "and values train as they are)",
            )
        return encode_join_reply(
            JoinReply(
                True,
                "",
                record.index,
                spec,
                env_config(self.config, record.index),
                self.policy_version,
                self.published.weights,
                step_ring=ring,
            )
        )

    def drop_gone_actors(self) -> list[tuple[str, str]]:
        """Drop the joined actors whose watched process exited or was stopped (their unfinished
        segments are discarded now, not after ``actor_timeout_s``), counted as ``dropped["exited_actors"]``
        / ``dropped["stopped_actors"]``; returns ``(actor_id, why)`` of each. A stopped one that is
        continued is told to rejoin at its next heartbeat."""
        dropped = []
        for actor_id, incarnation, why in self.processes.gone():
            if self.assembler.leave(actor_id, incarnation):
                self.counters.dropped[f"{why}_actors"] += 1
                dropped.append((actor_id, why))
        return dropped

    def step_spec(self, num_envs: int, *, step_ring: bool) -> StepSpec:
        """The spec of the step messages of an actor of ``num_envs`` envs (:func:`step_spec_for`)."""
        return step_spec_for(self.config, self.schema, num_envs, step_ring=step_ring)

    def tick(self, now: float) -> list[Reply]:
        """Synchronous mode: the replies to the held joins (:meth:`SyncJoins.tick`); call it every
        loop turn (and after a buffer is released). Else none."""
        return self.sync_joins.tick(now) if self.sync else []

    @property
    def held_joins(self) -> set[str]:
        """Synchronous mode: ids of the actors whose join is held (their peer bindings stay)."""
        return self.sync_joins.held_joins


class _EveryLine:
    """The ``notices`` of a server built without a rate-limited log: every event is a line."""

    def event(self, reason: str, detail: str, *, level: int = logging.INFO) -> None:
        log.log(level, "%s", detail)
