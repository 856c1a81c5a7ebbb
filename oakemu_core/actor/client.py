"""An actor's side of the control protocol: join, heartbeats, leave, weights, the step ring, and what a join sets up.

An actor reaches the learner through three sockets: the control REQ socket (:class:`ControlChannel`,
used by :class:`LearnerClient` for join, heartbeat, leave and weights requests), the weights SUB socket
(:func:`subscribe_weights`, read with :func:`newest_message`) and its step channel
(:mod:`oakemu_core.transport.channels`, made from the join's spec and the ring
:meth:`LearnerClient.attach_ring` attached). What the join reply's ``env_config`` and weights build
(envs, model, stepper) is :mod:`oakemu_core.actor.join_setup`.

Weights reach an actor on the weights channel, a PUB/SUB broadcast that loses what is published while
the actor's subscription is not connected yet (it connects after the first join) or its queue is full.
An actor that missed a publication would act with weights the learner no longer trains near: its rows
go stale, no update comes, nothing more is published. So each heartbeat reply names the learner's
current policy version, and an actor still behind it one :data:`WEIGHTS_MISSED_S` later asks for the
current weights on the control socket (:meth:`LearnerClient.fetch_weights`). The control socket is
point to point and a request left unanswered is asked again, so the weights arrive whatever the
weights channel lost; a re-publication on the weights channel could be lost the same way, and would go
to every actor. The weights channel stays the fast path: a request is the exception.

A join may be answered "not yet" (a join reply with ``retry_after_s``): a synchronous run waiting
for its planned actors, or too many joins from this host. The actor logs the reason (first, then
every :data:`WAIT_LOG_PERIOD_S`), waits ``retry_after_s`` (a random share longer, so actors of one host
spread out) and asks again with the same incarnation; the learner is there, so these waits do not
count against the join's patience.

The process loop around these is ``oakemu_services.actor``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import zmq

from oakemu_core.transport.auth import new_routing_id
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    ACTOR_ID_IN_USE,
    ControlMessage,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    WeightsMessage,
    WeightsRequest,
    decode_message,
    encode_heartbeat,
    encode_join_request,
    encode_leave,
    encode_weights_request,
)
from oakemu_core.transport.keepalive import keep_alive
from oakemu_core.transport.step_ring import StepRing, StepRingUnavailable

if TYPE_CHECKING:
    from oakemu_core.transport.auth import ClientSecurity

__all__ = [
    "REQUEST_TIMEOUT_S",
    "JOIN_PATIENCE_S",
    "WEIGHTS_QUEUE_MESSAGES",
    "WEIGHTS_MISSED_S",
    "WAIT_LOG_PERIOD_S",
    "LearnerUnreachable",
    "ActorSetupError",
    "RetryReport",
    "ControlChannel",
    "LearnerClient",
    "subscribe_weights",
    "newest_message",
]

log = logging.getLogger("oakemu.actor")

REQUEST_TIMEOUT_S = 2.0
"""Longest wait (s) for the learner's reply to one control request (then the request may be asked again)."""
JOIN_PATIENCE_S = 120.0
"""Shortest time (s) an actor keeps trying to join: a learner may take a while to start (loading
torch, building envs)."""
WEIGHTS_QUEUE_MESSAGES = 4
"""Weights messages the SUB socket queues (the actor reads them all and keeps the newest)."""
WEIGHTS_MISSED_S = 1.0
"""How long (s) an actor may stay behind the policy version its heartbeat replies name, the weights
channel read meanwhile, before it asks for the weights on the control socket (a publication takes
milliseconds to arrive)."""
WAIT_LOG_PERIOD_S = 5.0
"""A join answered "not yet" is logged at the first such answer, then at most once per this many seconds."""
RETRY_JITTER = 0.5
"""A join told to retry after X s asks again after X to (1 + this) * X s."""


class LearnerUnreachable(RuntimeError):
    """The learner did not answer for longer than the configured patience."""


class ActorSetupError(RuntimeError):
    """This actor cannot serve the learner's run (e.g. its env gives other step fields)."""


class RetryReport(Protocol):
    """Says whom a process is trying to reach (``oakemu_services.runtime.RetryReporter``):
    ``attempt()`` before each try, ``succeeded()`` once the peer answered."""

    def attempt(self) -> None: ...

    def succeeded(self) -> None: ...


class ControlChannel:
    """One REQ socket to the learner's control ROUTER, kept for the channel's life.

    Every request carries a request id (``REQ_CORRELATE``: the learner echoes the envelope
    ``[request id, empty]``) and a new request may follow one left unanswered (``REQ_RELAXED``): a
    reply to an earlier request is dropped, so :meth:`request` returns only the answer to the newest.
    Requests queue only on a completed connection (``IMMEDIATE``): while no learner listens, nothing
    piles up to be delivered when one starts. The socket is never remade after a timeout: a remade
    socket would leave its unanswered requests queued at a learner that is bound but busy (starting
    on a GPU, loading a checkpoint), to be read later from a connection that is gone. ZeroMQ's
    connection heartbeats (:func:`~oakemu_core.transport.keepalive.keep_alive`) close and remake a
    connection that went silent; the learner refuses what arrives late from the closed one
    (``anonymous_connection``).

    The socket's routing id is a secret of the channel (:func:`~oakemu_core.transport.auth.new_routing_id`):
    the learner binds the actor to it.

    Args:
        context: the actor's ZeroMQ context.
        address: the learner's control endpoint (``tcp://host:port``).
        max_bytes: longest reply accepted.
        security: CURVE keys applied to the socket (:func:`oakemu_core.transport.auth.client_security`),
            or None.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        max_bytes: int,
        security: ClientSecurity | None = None,
    ) -> None:
        self.context = context
        self.address = address
        self.max_bytes = max_bytes
        self.security = security
        self.routing_id = new_routing_id()
        self.socket: zmq.Socket | None = None
        self.connected = False
        """Whether the last request that got no reply went out on a connection (the learner's port is
        open, nothing answered) rather than finding none."""

    def _connect(self) -> zmq.Socket:
        if self.socket is None:
            self.socket = self.context.socket(zmq.REQ)
            self.socket.routing_id = self.routing_id
            if self.security is not None:
                self.security.apply(self.socket)
            for option in (zmq.REQ_CORRELATE, zmq.REQ_RELAXED, zmq.IMMEDIATE):
                self.socket.setsockopt(option, 1)
            keep_alive(self.socket)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.connect(self.address)
        return self.socket

    def request(self, frame: bytes, timeout_s: float = REQUEST_TIMEOUT_S) -> ControlMessage | None:
        """Send one request; the decoded reply to it, or None: no connection, no reply within
        ``timeout_s``, or a malformed reply."""
        sock = self._connect()
        deadline = time.monotonic() + timeout_s
        self.connected = False
        if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):  # no connection to the learner yet
            return None
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return None
        self.connected = True
        while (remaining := deadline - time.monotonic()) > 0 and sock.poll(
            max(1, int(remaining * 1000))
        ):
            try:
                reply = sock.recv(zmq.NOBLOCK)
            except zmq.Again:  # the message that woke the poll answered an earlier request: dropped
                continue
            try:
                return decode_message(reply, max_bytes=self.max_bytes)
            except MessageRejected as error:
                log.warning("malformed reply from the learner: %s", error)
                return None
        return None

    def close(self) -> None:
        """Close the socket (a later request makes a new one)."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None


class LearnerClient:
    """One actor's requests to the learner: join, heartbeat, leave; and the ring a join offers.

    Args:
        control: the control channel to the learner.
        request: the join request without its incarnation (:meth:`join` makes a fresh one each time).
        patience_s: how long the learner may stay silent to heartbeats before it counts as gone.
        silence: reports heartbeats that get no answer.

    Attributes:
        incarnation: id of the current join (``""`` before the first).
    """

    def __init__(
        self,
        control: ControlChannel,
        request: JoinRequest,
        *,
        patience_s: float,
        silence: RetryReport,
    ) -> None:
        self.control = control
        self.request = request
        self.patience_s = patience_s
        self.silence = silence
        self.incarnation = ""
        self.last_reply = time.monotonic()

    @property
    def join_patience_s(self) -> float:
        """How long :meth:`join` keeps trying: ``max(JOIN_PATIENCE_S, patience_s)``."""
        return max(JOIN_PATIENCE_S, self.patience_s)

    @property
    def actor_id(self) -> str:
        """The actor's stable name."""
        return self.request.actor_id

    def join(self, stop: threading.Event, reporter: RetryReport) -> JoinReply:
        """Join as a fresh incarnation, asking again every :data:`REQUEST_TIMEOUT_S` until the learner
        answers (``reporter`` says whom the actor is trying to reach meanwhile).

        Returns:
            The accepted reply (``spec`` not None).

        A join refused because a connected actor holds the id (this actor's earlier process, until the
        learner drops it) is asked again within the same patience; one answered "not yet"
        (``retry_after_s``) is logged and asked again after that wait, the patience starting over.

        Raises:
            ActorSetupError: the learner refused the actor (the reason says why).
            LearnerUnreachable: no answer (or the id still in use) within :attr:`join_patience_s`.
            KeyboardInterrupt: ``stop`` was set before an answer came.
        """
        self.incarnation = uuid.uuid4().hex
        frame = encode_join_request(replace(self.request, incarnation=self.incarnation))
        patience_s = self.join_patience_s
        deadline = time.monotonic() + patience_s
        answered, said_at = False, -WAIT_LOG_PERIOD_S
        while not stop.is_set():
            if not answered:  # after an answer, asking again is no try to reach a silent learner
                reporter.attempt()
            reply = self.control.request(frame)
            answered = isinstance(reply, JoinReply)
            if isinstance(reply, JoinReply):
                reporter.succeeded()
                if not reply.accepted and reply.retry_after_s is not None:
                    now = time.monotonic()
                    if now - said_at >= WAIT_LOG_PERIOD_S:
                        log.info("actor %s: the learner answered: %s", self.actor_id, reply.reason)
                        said_at = now
                    deadline = now + patience_s
                    stop.wait(reply.retry_after_s * (1.0 + RETRY_JITTER * random.random()))
                    continue
                if (
                    not reply.accepted
                    and reply.reason.startswith(ACTOR_ID_IN_USE)
                    and time.monotonic() < deadline
                ):
                    log.warning("actor %s: %s; asking again", self.actor_id, reply.reason)
                    stop.wait(REQUEST_TIMEOUT_S)
                    continue
                if not reply.accepted:
                    raise ActorSetupError(f"learner refused actor {self.actor_id}: {reply.reason}")
                self.last_reply = time.monotonic()
                return reply
            if time.monotonic() > deadline:
                hint = (
                    ": its port accepts connections but nothing answered the join (a learner older than this "
                    "actor does not: upgrade the learner first)"
                    if self.control.connected
                    else ""
                )
                raise LearnerUnreachable(
                    f"no learner answered at {self.control.address} for {patience_s:.0f} s{hint}"
                )
        raise KeyboardInterrupt

    def heartbeat(
        self,
        seq: int,
        policy_version: int,
        env_steps_per_second: float,
        policy_lag: float,
        episodes: int,
    ) -> HeartbeatReply | None:
        """Send one heartbeat (the figures of :class:`~oakemu_core.transport.control.Heartbeat`);
        the learner's reply, or None when it did not answer in time.

        Raises:
            LearnerUnreachable: the learner has not answered for longer than ``patience_s``.
        """
        reply = self.control.request(
            encode_heartbeat(
                Heartbeat(
                    self.actor_id,
                    self.incarnation,
                    seq,
                    policy_version,
                    env_steps_per_second,
                    policy_lag,
                    episodes,
                )
            )
        )
        if not isinstance(reply, HeartbeatReply):
            self.silence.attempt()
            if time.monotonic() - self.last_reply > self.patience_s:
                raise LearnerUnreachable(f"learner silent for {self.patience_s:.0f} s")
            return None
        self.silence.succeeded()
        self.last_reply = time.monotonic()
        return reply

    def fetch_weights(self) -> WeightsMessage | None:
        """Ask the learner for its current weights on the control socket (the weights channel missed
        them); the weights, or None: no answer in time, or the learner answered ``rejoin`` / ``stop``
        (the next heartbeat acts on it)."""
        reply = self.control.request(
            encode_weights_request(WeightsRequest(self.actor_id, self.incarnation))
        )
        if reply is not None:
            self.last_reply = time.monotonic()
        return reply if isinstance(reply, WeightsMessage) else None

    def leave(self, timeout_s: float = 0.5) -> None:
        """Tell the learner this incarnation stops (best effort: no retry)."""
        if self.incarnation:
            self.control.request(
                encode_leave(Leave(self.actor_id, self.incarnation)), timeout_s=timeout_s
            )

    def attach_ring(self, reply: JoinReply) -> StepRing | None:
        """The step ring the join offered, attached, or None: none offered, or not reachable from here
        (e.g. another user's segment or another ``/dev/shm``; the arrays then go inline, which tells the
        learner to free the ring)."""
        if reply.step_ring is None or reply.spec is None:
            return None
        try:
            ring = StepRing.attach(reply.step_ring, reply.spec)
        except StepRingUnavailable as error:
            log.info("actor %s: step arrays go inline in the messages (%s)", self.actor_id, error)
            return None
        log.info(
            "actor %s: step arrays go through shared memory (%s, %d slots)",
            self.actor_id,
            ring.name,
            ring.slots,
        )
        return ring


def subscribe_weights(
    context: zmq.Context, address: str, security: ClientSecurity | None = None
) -> zmq.Socket:
    """A SUB socket on the learner's weights channel (weights and stop messages), queueing at most
    :data:`WEIGHTS_QUEUE_MESSAGES`; read it with :func:`newest_message`.

    Not ``ZMQ_CONFLATE``: its double buffer can lose the wake-up of an idle reader (the pipe stays
    inactive), and a reader waiting for weights already sent would wait forever.
    """
    sub = context.socket(zmq.SUB)
    if security is not None:
        security.apply(sub)
    keep_alive(sub)
    sub.setsockopt(zmq.RCVHWM, WEIGHTS_QUEUE_MESSAGES)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    return sub


def newest_message(sub: zmq.Socket, max_bytes: int) -> ControlMessage | None:
    """Read every message waiting on the weights socket ``sub`` and decode only the last (the newest
    weights, or the learner's stop notice, its last message); None when nothing waited or the last
    one was malformed (logged)."""
    frame = None
    while True:
        try:
            frame = sub.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
    if frame is None:
        return None
    try:
        return decode_message(frame.buffer, max_bytes=max_bytes)
    except MessageRejected as error:
        log.warning("malformed weights message ignored: %s", error)
        return None
