"""One step channel per side: how an actor's step messages reach the learner, inline or through a step ring.

Actor side: a step channel (:func:`open_step_channel`, at every join) takes the actor's step
messages in ``seq`` order: :meth:`~SocketStepChannel.wait_writable` before the actor acts the steps
of message ``seq``, :meth:`~SocketStepChannel.send` once they are acted.

- :class:`SocketStepChannel`: the arrays travel inline, as frames of the message, through the actor's
  PUSH socket, stacked frames deduplicated (:class:`~oakemu_core.transport.steps.StepEncoder`).
  Back-pressure: the socket's send queue (:func:`send_queue_messages`) is full.
- :class:`RingStepChannel`: the arrays go into the message's slot of the actor's step ring
  (:mod:`oakemu_core.transport.step_ring`); the socket carries the header and the slot. Back-pressure:
  the slot is not free yet, and the actor waits for it before acting, so the ring's slots bound the
  rows it has acted that the learner has not read.

While a channel waits it hands control to the actor's :class:`Pause` (heartbeats, newer weights), and
it gives up, dropping the message, once the actor's stop event is set.

Learner side: :class:`StepReceiver` decodes a step message (arrays inline or in the sender's ring
slot), keeps the last stacks of each actor's stacked fields, and frees the slot once the learner is
done with the message, whether ingested or rejected.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

import zmq

from oakemu_core.transport.auth import ClientSecurity
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.frame_stacks import StackHistories
from oakemu_core.transport.keepalive import keep_alive
from oakemu_core.transport.step_ring import StepRing, StepRings, ring_slots
from oakemu_core.transport.steps import (
    Frame,
    StepEncoder,
    StepMessage,
    StepSpec,
    decode_step,
    encode_step,
)

__all__ = [
    "Pause",
    "StepChannel",
    "SocketStepChannel",
    "RingStepChannel",
    "open_step_channel",
    "send_queue_messages",
    "step_socket_connector",
    "StepReceiver",
    "recv_frames",
]

log = logging.getLogger("oakemu.transport")

SEND_RETRY_S = 0.1
"""Longest pause (s) between two tries to send a message the socket's full queue refused."""
SLOT_POLL_FIRST_S = 0.0001
"""First pause (s) of the wait for a ring slot: a slot the learner is reading frees within a
fraction of a millisecond."""
SLOT_POLL_MAX_S = 0.01
"""The pauses of the wait for a ring slot double up to this (s): a learner that is training may take
seconds."""
SLOT_WAIT_WARNING_S = 30.0
"""Say so when a message waits longer than this (s) for its ring slot, and every as long again."""


class Pause(Protocol):
    """The actor's wait while its channel cannot take a message yet.

    Returns after at most ``seconds``, earlier when ``writable`` (a socket, if given) can send or when
    newer weights arrived; heartbeats go on meanwhile. May raise whatever the actor's heartbeat raises
    (a rejoin), which ends the channel's wait.
    """

    def __call__(self, seconds: float, writable: zmq.Socket | None = None) -> None: ...


class StepChannel(Protocol):
    """What an actor sends its step messages through (:class:`SocketStepChannel`,
    :class:`RingStepChannel`)."""

    socket: zmq.Socket
    layout: tuple[int, int, int]
    slot_waits: int

    def wait_writable(self, seq: int, pause: Pause) -> None:
        """Wait (``pause`` between looks) until message ``seq`` may be written, or the actor stops."""

    def send(self, message: StepMessage, pause: Pause) -> None:
        """Send the next message (``seq`` in order), waiting while the learner applies back-pressure."""

    def detach(self) -> zmq.Socket:
        """Free the channel but its socket, and return that."""

    def close(self) -> None:
        """Free the channel and its socket."""


def send_queue_messages(
    steps_per_message: int, ring: StepRing | None, *, sync_rollout_length: int = 0
) -> int:
    """Step messages an actor's PUSH socket queues before a send waits (its ``SNDHWM``).

    With a step ring, its slots: they bound the messages in flight, and a queue as long lets them all
    go. Else 2 one-step messages, or 1 block of K > 1 steps: the queues count messages, and K steps
    each would multiply the rows queued, hence their policy lag. In synchronous mode
    (``sync_rollout_length`` > 0, rows per segment) a queued row adds no lag: as many messages as a
    synchronous ring has slots (:func:`~oakemu_core.transport.step_ring.ring_slots`).
    """
    if ring is not None:
        return int(ring.slots)
    if sync_rollout_length > 0:
        return ring_slots(steps_per_message, sync_rollout_length, synchronous=True)
    return 2 if steps_per_message == 1 else 1


def step_socket_connector(
    context: zmq.Context, address: str, *, buffer_bytes: int, security: ClientSecurity | None = None
) -> Callable[[int], zmq.Socket]:
    """``connect`` for :func:`open_step_channel`: ``connect(queue_messages)`` makes a PUSH socket to the
    learner's data endpoint ``address`` whose send queue holds ``queue_messages`` messages and whose
    kernel send buffer ``buffer_bytes`` (about one message: the default, autotuned to MBs, would hold
    thousands of small messages acted by policies many versions old), with ``security``'s CURVE keys."""

    def connect(queue_messages: int) -> zmq.Socket:
        socket = context.socket(zmq.PUSH)
        if security is not None:
            security.apply(socket)
        keep_alive(socket)
        socket.setsockopt(zmq.SNDHWM, queue_messages)
        socket.setsockopt(zmq.SNDBUF, buffer_bytes)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    return connect


def _layout(
    steps_per_message: int, ring: StepRing | None, queue_messages: int | None = None
) -> tuple[int, int, int]:
    """What a channel's socket was made for: K, the ring's slots (0 without a ring) and its send queue
    (``SNDHWM``; default: :func:`send_queue_messages` of asynchronous mode)."""
    queue = (
        send_queue_messages(steps_per_message, ring) if queue_messages is None else queue_messages
    )
    return steps_per_message, ring.slots if ring is not None else 0, queue


class SocketStepChannel:
    """An actor's step messages with their arrays inline, through its PUSH socket.

    Args:
        socket: a connected PUSH socket, its send queue :func:`send_queue_messages` long.
        stop: the actor's stop event: a wait ends when it is set, and the message is not sent.
        spec: the actor's step spec (its K; the frames of its messages).
        queue_messages: the socket's send queue (``SNDHWM``); default: :func:`send_queue_messages` of
            asynchronous mode.

    Attributes:
        socket: the PUSH socket (owned: :meth:`close` closes it).
        layout: ``(K, ring slots or 0, send queue)`` the socket was made for.
        slot_waits: messages that waited for a free ring slot (0 here; counted on from the channel
            of the previous incarnation by :func:`open_step_channel`).
    """

    ring: StepRing | None = None  # a RingStepChannel's ring

    def __init__(
        self,
        socket: zmq.Socket,
        stop: threading.Event,
        spec: StepSpec,
        queue_messages: int | None = None,
    ) -> None:
        self.socket = socket
        self.stop = stop
        self.layout = _layout(spec.steps_per_message, self.ring, queue_messages)
        self.slot_waits = 0
        self.encoder = StepEncoder(spec)

    def wait_writable(self, seq: int, pause: Pause) -> None:
        """Wait until message ``seq`` may be written; through the socket, at once."""

    def send(self, message: StepMessage, pause: Pause) -> None:
        """Send ``message`` (the next ``seq``) with its arrays inline, pausing while the learner
        applies back-pressure; returns without sending when the actor is told to stop.

        Raises:
            TypeError / ValueError: from :func:`~oakemu_core.transport.steps.encode_step`.
        """
        self.send_frames(self.encoder.encode(message), pause)

    def send_frames(self, frames: Sequence[Frame], pause: Pause) -> None:
        """Send one multipart message: views of the actor's arrays are copied into it (the actor
        reuses them at once), buffers made for the message (``bytearray``) go without a copy."""
        while not self.stop.is_set():
            try:  # a full queue refuses the first frame; the others then always go
                self.socket.send(frames[0], zmq.NOBLOCK | (zmq.SNDMORE if len(frames) > 1 else 0))
                break
            except zmq.Again:
                pause(SEND_RETRY_S, self.socket)
        else:
            return
        last = len(frames) - 1
        for index in range(1, len(frames)):
            frame = frames[index]
            self.socket.send(
                frame, zmq.SNDMORE if index < last else 0, copy=not isinstance(frame, bytearray)
            )

    def detach(self) -> zmq.Socket:
        """Hand the socket over (to the next incarnation's channel) and free the rest."""
        return self.socket

    def close(self) -> None:
        """Close the socket at once (queued messages are dropped)."""
        self.socket.close(linger=0)


class RingStepChannel(SocketStepChannel):
    """An actor's step messages with their arrays in its step ring; the socket carries the rest.

    Args:
        socket, stop, spec: as for :class:`SocketStepChannel`.
        ring: the ring the actor attached (:meth:`~oakemu_core.transport.step_ring.StepRing.attach`);
            owned: :meth:`close` closes it.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        ring: StepRing,
        stop: threading.Event,
        spec: StepSpec,
        queue_messages: int | None = None,
    ) -> None:
        self.ring = ring
        super().__init__(socket, stop, spec, queue_messages)

    def wait_writable(self, seq: int, pause: Pause) -> None:
        """Wait until the slot of message ``seq`` is free (the learner released ``seq - slots``),
        pausing between looks: first for :data:`SLOT_POLL_FIRST_S`, doubling up to
        :data:`SLOT_POLL_MAX_S`. Returns early when the actor is told to stop; counts in
        :attr:`slot_waits` the messages that had to wait; logs a wait past :data:`SLOT_WAIT_WARNING_S`."""
        ring = self.ring
        if ring.is_free(seq):
            return
        self.slot_waits += 1
        delay, start = SLOT_POLL_FIRST_S, time.monotonic()
        warn_at = start + SLOT_WAIT_WARNING_S
        while not ring.is_free(seq) and not self.stop.is_set():
            pause(delay)
            delay = min(2 * delay, SLOT_POLL_MAX_S)
            if time.monotonic() > warn_at:
                log.warning(
                    "step message %d has waited %.0f s for a free slot of step ring %s",
                    seq,
                    time.monotonic() - start,
                    ring.name,
                )
                warn_at += SLOT_WAIT_WARNING_S

    def send(self, message: StepMessage, pause: Pause) -> None:
        """Copy ``message``'s arrays into its slot (waiting for it, if the actor did not) and send
        the message with the slot instead of the arrays; returns without sending when the actor is
        told to stop.

        Raises:
            KeyError / ValueError / TypeError: the fields do not fit the ring
                (:meth:`~oakemu_core.transport.step_ring.StepRing.write`).
        """
        self.wait_writable(message.seq, pause)  # free already when the actor waited before acting
        if not self.ring.is_free(message.seq):  # told to stop meanwhile
            return
        slot = self.ring.write(message.seq, message.fields)
        self.send_frames(encode_step(replace(message, fields={}, slot=slot)), pause)

    def detach(self) -> zmq.Socket:
        """Close the ring (it belongs to this incarnation) and hand the socket over."""
        self.ring.close()
        return self.socket

    def close(self) -> None:
        """Close the ring and the socket."""
        self.ring.close()
        super().close()


def open_step_channel(
    spec: StepSpec,
    ring: StepRing | None,
    connect: Callable[[int], zmq.Socket],
    stop: threading.Event,
    previous: StepChannel | None = None,
    *,
    sync_rollout_length: int = 0,
) -> StepChannel:
    """The step channel of a (re)joined actor incarnation: through ``ring`` when it attached one,
    else with the arrays inline.

    Args:
        spec: the join's step spec (its K).
        ring: the ring the actor attached, or None.
        connect: ``connect(queue_messages)`` -> a connected PUSH socket whose send queue (``SNDHWM``)
            holds ``queue_messages`` messages (:func:`send_queue_messages`).
        stop: the actor's stop event.
        previous: the channel of the incarnation before a rejoin, or None. It is closed; its socket
            is kept when it was made for the same K and ring slots, else a fresh one is connected (a
            queue sized for a ring's slots would hold too many inline blocks, whose rows would train
            too old). Its :attr:`~SocketStepChannel.slot_waits` count on.
        sync_rollout_length: rows per segment in synchronous mode, 0 in asynchronous mode
            (:func:`send_queue_messages`).
    """
    k = spec.steps_per_message
    queue = send_queue_messages(k, ring, sync_rollout_length=sync_rollout_length)
    socket = None
    if previous is not None:
        if previous.layout == _layout(k, ring, queue):
            socket = previous.detach()
        else:
            previous.close()
    if socket is None:
        socket = connect(queue)
    channel = (
        SocketStepChannel(socket, stop, spec, queue)
        if ring is None
        else RingStepChannel(socket, ring, stop, spec, queue)
    )
    channel.slot_waits = previous.slot_waits if previous is not None else 0
    return channel


def recv_frames(socket: zmq.Socket) -> list[zmq.Frame]:
    """One queued multipart message of ``socket`` as ``zmq.Frame`` objects, without waiting: what
    ``recv_multipart(zmq.NOBLOCK, copy=False)`` returns, but each frame's ``more`` says whether another
    follows instead of a ``getsockopt(RCVMORE)`` after every frame (half the CPU for a step message's
    dozen frames).

    Raises:
        zmq.Again: no message is queued.
    """
    frame = socket.recv(zmq.NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:  # the parts of a message arrive together: the rest are there
        frame = socket.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame)
    return frames


class StepReceiver:
    """The learner's end of the actors' step channels: decodes step messages, keeps each actor's last
    stacks (stacked-frame deduplication) and frees ring slots.

    The stacks of a message are remembered only when it comes from its actor's own peer: another
    peer's message must not become the stack the actor's next message is rebuilt from. They are
    forgotten with the actor (:meth:`retain`).

    A message whose arrays are in a ring slot holds that slot until the learner is done with it
    (:meth:`holding`); a message rejected at decode frees its slot at once. A slot is freed only on
    its own actor's word (``allows``): another peer's message would free slots still queued.

    Args:
        rings: the learner's step rings by ``(actor_id, incarnation)``.
        spec_for: ``(actor_id, incarnation) -> StepSpec`` of a joined actor, or None.
        allows: ``(actor_id, incarnation, frame) ->`` whether the frame comes from the peer that actor
            joined from (:meth:`oakemu_core.transport.auth.PeerBinding.allows`).
        max_bytes: messages longer than this (all frames) are rejected before decoding.
        notices: logs that an actor sends inline although offered a ring, ``event(reason, text,
            level=...)`` (a peer can cause it once per join: rate limited by the caller); None: the log.
    """

    def __init__(
        self,
        rings: StepRings,
        spec_for: Callable[[str, str], StepSpec | None],
        allows: Callable[[str, str, Any], bool],
        *,
        max_bytes: int,
        notices: Any = None,
    ) -> None:
        self.rings = rings
        self.spec_for = spec_for
        self.allows = allows
        self.max_bytes = max_bytes
        self.notices = notices
        self.stacks = StackHistories()

    def decode(self, frames: Sequence[Any]) -> StepMessage:
        """The checked step message of one multipart ZeroMQ message (``zmq.Frame`` objects, their
        ``buffer`` decoded; the first names the peer), arrays inline or read from the sender's ring slot.

        Raises:
            MessageRejected: as :func:`~oakemu_core.transport.steps.decode_step`. When the sender was
                read (a known incarnation, from its own peer), its slot is freed first: otherwise a few
                rejected messages in a row leave the actor waiting for a slot forever.
        """
        peer = frames[0] if frames else None
        try:
            message = decode_step(
                [frame.buffer for frame in frames],
                self.spec_for,
                max_bytes=self.max_bytes,
                ring_for=self.rings.get,
                stacks_for=self.stacks.previous,
            )
        except MessageRejected as error:
            if error.sender is not None:
                actor_id, incarnation, seq = error.sender
                ring = self.rings.get(actor_id, incarnation)
                if ring is not None and self.allows(actor_id, incarnation, peer):
                    ring.release(seq)
            raise
        spec = self.spec_for(message.actor_id, message.incarnation)
        if (
            message.slot is None
            and spec is not None
            and spec.stacked
            and self.allows(message.actor_id, message.incarnation, peer)
        ):
            self.stacks.remember(
                message.actor_id,
                message.incarnation,
                message.seq,
                message.fields,
                spec.stacked,
                block=spec.steps_per_message > 1,
            )
        return message

    def retain(self, keys: set[tuple[str, str]]) -> None:
        """Forget the stacks of every ``(actor_id, incarnation)`` not in ``keys`` (left, timed out, rejoined)."""
        self.stacks.retain(keys)

    @contextlib.contextmanager
    def holding(self, message: StepMessage) -> Iterator[None]:
        """While the learner ingests ``message`` (from its actor's own peer, checked by the caller):
        afterwards, or when ingest raises, its ring slot is freed (the learner has written or copied
        what it keeps by then). A message with its arrays inline frees the ring its actor was offered
        but could not attach."""
        ring = None
        if message.slot is not None:
            ring = self.rings.get(message.actor_id, message.incarnation)
        elif self.rings.discard(message.actor_id, message.incarnation):
            line = f"actor {message.actor_id} sends its step arrays inline (its step ring is not reachable from it)"
            if self.notices is not None:
                self.notices.event("ring_unreachable", line, level=logging.INFO)
            else:
                log.info("%s", line)
        try:
            yield
        finally:
            if ring is not None:
                ring.release(message.seq)
