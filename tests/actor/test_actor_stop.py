"""An actor stops on the learner's stop notice (wire protocol 9), not only at its next heartbeat; a
synchronous actor hears it inside a segment too, and keeps weights read there for the segment's end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.transport.control import (
    JoinReply,
    StopNotice,
    WeightsMessage,
    encode_stop,
    encode_weights,
)
from tests.actor_fakes import fake_weights
from tests.e2e_helpers import free_ports


@dataclass
class Weights:
    """An actor without a model whose weights socket an inproc PUB feeds; ``loaded`` lists the
    versions it loaded."""

    actor: Any
    publisher: zmq.Socket
    loaded: list[int] = field(default_factory=list)

    def deliver(self, frame: bytes) -> None:
        """Send ``frame`` until the actor's socket has it (a PUB drops what it sends before the SUB
        is connected)."""
        deadline = time.monotonic() + 5
        while not self.actor.weights_sub.poll(10):
            self.publisher.send(frame)
            assert time.monotonic() < deadline, "the message never arrived"


@pytest.fixture
def weights() -> Iterator[Weights]:
    from oakemu_services.actor import Actor

    data, control, port = free_ports(3)
    actor = Actor(
        OakEmuConfig(data_port=data, control_port=control, weights_port=port), threading.Event()
    )
    publisher = actor.context.socket(zmq.PUB)
    try:
        publisher.bind(f"inproc://weights-{port}")
        actor.weights_sub = actor.context.socket(zmq.SUB)
        actor.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
        actor.weights_sub.connect(f"inproc://weights-{port}")
        feed = Weights(actor, publisher)

        fake_weights(actor, feed.loaded)  # no model here
        actor.next_heartbeat = float("inf")  # no learner to answer one
        yield feed
    finally:
        publisher.close(linger=0)
        actor.close()


def _weights(version: int) -> bytes:
    return encode_weights(WeightsMessage(version, {"w": np.zeros(2, np.float32)}))


def _pause_until_read(feed: Weights, frame: bytes) -> None:
    """Deliver ``frame``, then one pause of the step channel (2 s at most): it ends at the message."""
    feed.deliver(frame)
    start = time.monotonic()
    feed.actor._pause(2.0)
    assert time.monotonic() - start < 0.5  # ended by the message, not the 2 s


def test_a_stop_notice_on_the_weights_channel_stops_the_actor(weights: Weights) -> None:
    actor = weights.actor
    weights.deliver(_weights(1))
    assert actor._poll_weights() and weights.loaded == [1]
    assert not actor.stop_event.is_set()
    weights.deliver(encode_stop(StopNotice("env-step budget reached")))
    assert actor._poll_weights() is False
    assert actor.stop_event.is_set() and weights.loaded == [1]


def test_a_synchronous_actor_waiting_inside_its_segment_hears_the_stop_and_keeps_new_weights_for_the_end(
    weights: Weights,
) -> None:
    """Synchronous mode: a wait inside a segment (a full step ring, back-pressure) ends at a stop
    notice, not at the next heartbeat a second later; weights read there are loaded only when the
    segment ends, so one version acts on the whole segment."""
    actor = weights.actor
    actor.pacing.sync_rollout_length = 32
    _pause_until_read(weights, _weights(1))
    assert weights.loaded == [] and actor.weights.held is not None  # held for the segment's end
    assert (
        actor.weights.learner_version == 1
    )  # the lag its heartbeats report counts the held version
    assert actor._wait_for_weights_newer_than(0, give_up_s=None) and weights.loaded == [1]
    assert actor.weights.held is None and not actor.stop_event.is_set()
    _pause_until_read(weights, encode_stop(StopNotice("env-step budget reached")))
    assert actor.stop_event.is_set() and weights.loaded == [1]


def test_weights_held_in_a_segment_are_dropped_when_the_actor_joins_again(weights: Weights) -> None:
    """Weights held inside a synchronous segment (v101) do not survive a rejoin: after the learner
    restarted from its checkpoint at v95, the next segment's end waits for the new learner's v96
    instead of loading the dead learner's v101 (which would label rows and stall the wait)."""
    actor = weights.actor
    fake_weights(actor, weights.loaded, 100)  # a rejoin: envs, model and stepper exist
    actor.pacing.sync_rollout_length = 32
    _pause_until_read(weights, _weights(101))  # inside a segment: v101 held for the segment's end
    assert actor.weights.held is not None and actor.weights.held.policy_version == 101

    # The learner crashes and is restarted from its checkpoint at version 95; the actor rejoins.
    reply = JoinReply(
        True,
        "",
        0,
        SimpleNamespace(steps_per_message=1),
        {"mode": "sync", "rollout_length": 32, "env_id": "CartPole-v1", "seed": 1},
        95,
        {},
    )
    actor.client.join = lambda stop, reporter: reply
    actor.client.attach_ring = lambda reply: None
    actor._open_channel = lambda spec, ring: None
    actor.join()
    assert actor.weights.policy_version == 95 and weights.loaded == [95]

    # End of the first segment after the rejoin (acted by v95): the actor waits for v96.
    actor._wait_for_weights_newer_than(95, give_up_s=0.2)
    assert actor.weights.policy_version != 101, (
        f"loaded the dead learner's held v101 (loads: {weights.loaded})"
    )
    assert actor.weights.held is None
