"""Step channels (oakemu_core/transport/channels.py): one interface for an actor's step messages, inline
through its socket or in its step ring, and the learner's receiver that frees ring slots."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from oakemu_core.transport.channels import (
    RingStepChannel,
    SocketStepChannel,
    StepReceiver,
    open_step_channel,
    recv_frames,
    send_queue_messages,
)
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.step_ring import StepRing, StepRings
from oakemu_core.transport.steps import StepSpec, decode_step, encode_step
from tests.transport.test_wire import (
    ACTOR,
    ATARI_SCHEMA,
    ATARI_SPEC,
    INCARNATION,
    MAX_BYTES,
    N,
    atari_step,
    known_spec,
)

BLOCK_SPEC = StepSpec(num_envs=N, schema=ATARI_SCHEMA, steps_per_message=4)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    made = zmq.Context()
    yield made
    made.destroy(linger=0)


@pytest.fixture
def rings() -> Iterator[StepRings]:
    made = StepRings()
    yield made
    made.close()


class Pauses:
    """A channel's ``pause``: records each call and runs ``then`` (e.g. the learner releasing a slot)."""

    def __init__(self, then=lambda: None) -> None:
        self.calls: list[tuple[float, object]] = []
        self.then = then

    def __call__(self, seconds: float, writable: zmq.Socket | None = None) -> None:
        self.calls.append((seconds, writable))
        self.then()


def pipe(context: zmq.Context, name: str, queue: int = 2) -> tuple[zmq.Socket, zmq.Socket]:
    """A bound PULL and a connected PUSH socket whose send queue holds ``queue`` messages."""
    pull = context.socket(zmq.PULL)
    pull.bind(f"inproc://{name}")
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, queue)
    push.connect(f"inproc://{name}")
    return pull, push


def frames_of(frames: list, peer: str = "own") -> list[SimpleNamespace]:
    """A received multipart message as the learner's receiver sees it: frames with a ``buffer``, the peer."""
    return [SimpleNamespace(buffer=frame, peer=peer) for frame in frames]


def test_the_send_queue_holds_a_rings_slots_else_two_steps_or_one_block() -> None:
    assert send_queue_messages(1, None) == 2
    assert send_queue_messages(4, None) == 1
    assert send_queue_messages(4, SimpleNamespace(slots=3)) == 3
    # Synchronous mode: queued rows add no lag; up to 16 vector steps of the segment, 2 messages at least.
    assert send_queue_messages(4, None, sync_rollout_length=32) == 4
    assert send_queue_messages(1, None, sync_rollout_length=128) == 16
    assert send_queue_messages(32, None, sync_rollout_length=64) == 2
    assert send_queue_messages(4, SimpleNamespace(slots=3), sync_rollout_length=32) == 3


def test_the_socket_channel_sends_the_arrays_inline(context: zmq.Context) -> None:
    pull, push = pipe(context, "inline")
    channel = SocketStepChannel(push, threading.Event(), ATARI_SPEC)
    message = atari_step(seq=0)
    pauses = Pauses()
    channel.wait_writable(0, pauses)
    channel.send(message, pauses)
    frames = pull.recv_multipart()
    assert (
        frames == [bytes(frame) for frame in encode_step(message, ATARI_SPEC)]
        and pauses.calls == []
    )
    decoded = decode_step(frames, known_spec, max_bytes=MAX_BYTES)
    np.testing.assert_array_equal(decoded.fields["observations"], message.fields["observations"])
    channel.close()
    assert push.closed


def test_recv_frames_returns_each_message_whole_as_frames(context: zmq.Context) -> None:
    """The learner's receive: every frame of one message, the next message apart, and zmq.Again when
    none is queued."""
    pull, push = pipe(context, "frames", queue=4)
    with pytest.raises(zmq.Again):
        recv_frames(pull)
    messages = [
        [bytes(frame) for frame in encode_step(atari_step(seq=seq), ATARI_SPEC)] for seq in range(2)
    ]
    messages.append([b"alone"])
    for frames in messages:
        push.send_multipart(frames)
    for frames in messages:
        pull.poll(1000)
        received = recv_frames(pull)
        assert all(isinstance(frame, zmq.Frame) for frame in received)
        assert [frame.bytes for frame in received] == frames
    with pytest.raises(zmq.Again):
        recv_frames(pull)


def test_a_full_socket_queue_pauses_until_stopped(context: zmq.Context) -> None:
    push = context.socket(zmq.PUSH)  # no peer: every send would block
    stop = threading.Event()
    channel = SocketStepChannel(push, stop, ATARI_SPEC)
    pauses = Pauses(then=stop.set)
    channel.send(atari_step(), pauses)  # gives up once told to stop
    assert pauses.calls == [(0.1, push)]
    channel.close()


def test_the_ring_channel_waits_for_the_slot_then_sends_only_the_header(
    context: zmq.Context, rings: StepRings
) -> None:
    offer = rings.offer(ACTOR, INCARNATION, ATARI_SPEC, 16)  # 2 slots
    learner_ring = rings.get(ACTOR, INCARNATION)
    pull, push = pipe(context, "ring", queue=offer.slots)
    channel = RingStepChannel(
        push, StepRing.attach(offer, ATARI_SPEC), threading.Event(), ATARI_SPEC
    )
    receiver = StepReceiver(rings, known_spec, lambda *_: True, max_bytes=MAX_BYTES)
    free = Pauses()
    for seq in range(2):
        channel.wait_writable(seq, free)
        channel.send(atari_step(seq=seq, seed=seq), free)
    assert free.calls == [] and channel.slot_waits == 0
    released = Pauses(then=lambda: learner_ring.release(0))  # the learner reads message 0 meanwhile
    channel.wait_writable(2, released)
    assert len(released.calls) == 1 and channel.slot_waits == 1
    for seq in range(2):
        frames = pull.recv_multipart(copy=False)
        assert len(frames) == 1  # the header alone
        message = receiver.decode(frames)
        assert message.slot == seq % 2
        np.testing.assert_array_equal(
            message.fields["observations"], atari_step(seed=seq).fields["observations"]
        )
    channel.close()


def test_a_ring_channel_told_to_stop_while_waiting_sends_nothing(
    context: zmq.Context, rings: StepRings
) -> None:
    offer = rings.offer(ACTOR, INCARNATION, ATARI_SPEC, 16)
    pull, push = pipe(context, "stopped", queue=offer.slots)
    stop = threading.Event()
    ring = StepRing.attach(offer, ATARI_SPEC)
    channel = RingStepChannel(push, ring, stop, ATARI_SPEC)
    for seq in range(2):
        channel.send(atari_step(seq=seq), Pauses())
    channel.send(atari_step(seq=2), Pauses(then=stop.set))
    assert channel.slot_waits == 1 and ring.released == 0
    assert [pull.recv(zmq.NOBLOCK) is not None for _ in range(2)] == [True, True]
    assert not pull.poll(50)
    channel.close()


def test_a_rejoin_keeps_the_socket_only_for_the_same_k_and_ring_slots(context: zmq.Context) -> None:
    made: list[zmq.Socket] = []
    queues: list[int] = []

    def connect(queue: int) -> zmq.Socket:
        queues.append(queue)
        made.append(context.socket(zmq.PUSH))
        return made[-1]

    stop = threading.Event()
    closed: list[str] = []
    ring = SimpleNamespace(slots=4, close=lambda: closed.append("ring"))
    first = open_step_channel(ATARI_SPEC, None, connect, stop)
    assert isinstance(first, SocketStepChannel) and first.layout == (1, 0, 2)
    ringed = open_step_channel(BLOCK_SPEC, ring, connect, stop, previous=first)
    assert isinstance(ringed, RingStepChannel) and first.socket.closed and len(made) == 2
    ringed.slot_waits = 3
    again = open_step_channel(BLOCK_SPEC, ring, connect, stop, previous=ringed)
    assert again.socket is ringed.socket and closed == ["ring"] and again.slot_waits == 3
    inline = open_step_channel(BLOCK_SPEC, None, connect, stop, previous=again)
    assert inline.socket is not again.socket and again.socket.closed and closed == ["ring", "ring"]
    assert queues == [2, 4, 1]
    # Synchronous mode queues more blocks of a segment: another socket, not the asynchronous one.
    synchronous = open_step_channel(
        BLOCK_SPEC, None, connect, stop, previous=inline, sync_rollout_length=64
    )
    assert synchronous.socket is not inline.socket and inline.socket.closed
    assert queues == [
        2,
        4,
        1,
        send_queue_messages(BLOCK_SPEC.steps_per_message, None, sync_rollout_length=64),
    ]
    synchronous.close()


def test_the_receiver_frees_a_slot_after_ingest_or_rejection_on_its_own_peers_word(
    rings: StepRings,
) -> None:
    offer = rings.offer(ACTOR, INCARNATION, ATARI_SPEC, 16)
    actor_ring = StepRing.attach(offer, ATARI_SPEC)
    own = {"own"}
    receiver = StepReceiver(
        rings, known_spec, lambda a, i, frame: frame.peer in own, max_bytes=MAX_BYTES
    )

    def slot_frame(seq: int, peer: str = "own", nan: bool = False) -> list[SimpleNamespace]:
        fields = atari_step(seq=seq).fields
        if nan:
            fields = {**fields, "values": np.full(N, np.nan, np.float32)}
        slot = actor_ring.write(seq, fields)
        return frames_of(encode_step(replace(atari_step(seq=seq), fields={}, slot=slot)), peer)

    message = receiver.decode(slot_frame(0))
    assert actor_ring.released == 0
    with receiver.holding(message):
        assert actor_ring.released == 0  # still being ingested
    assert actor_ring.released == 1
    with pytest.raises(MessageRejected):
        receiver.decode(slot_frame(1, peer="thief", nan=True))
    assert actor_ring.released == 1  # another peer's word frees nothing
    with pytest.raises(MessageRejected):
        receiver.decode(slot_frame(1, nan=True))
    assert actor_ring.released == 2
    with pytest.raises(RuntimeError), receiver.holding(receiver.decode(slot_frame(2))):
        raise RuntimeError("ingest refused it")
    assert actor_ring.released == 3
    actor_ring.close()


def test_an_inline_message_frees_the_ring_its_actor_could_not_attach(rings: StepRings) -> None:
    rings.offer(ACTOR, INCARNATION, ATARI_SPEC, 16)
    receiver = StepReceiver(rings, known_spec, lambda *_: True, max_bytes=MAX_BYTES)
    message = receiver.decode(frames_of(encode_step(atari_step(), ATARI_SPEC)))
    with receiver.holding(message):
        pass
    assert len(rings) == 0
