"""An actor that missed the weights gets them again: its weights subscription drops every publication
(a PUB/SUB subscriber that connected late, or whose queue was full), the heartbeat replies name the
learner's newer policy version, and the actor asks for the weights on the control socket, in both
modes: asynchronous, loaded at once; synchronous, held for its segment's end, where it was waiting.

Without this an asynchronous actor acts with its first weights for ever (its rows too stale to train,
so no update and no further publication) and a synchronous one waits at its segment's end for ever.
End to end (separate processes, an actor whose weights port reaches no learner): ``tests/e2e/test_e2e_elastic.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.transport.control import (
    Heartbeat,
    HeartbeatReply,
    WeightsMessage,
    WeightsRequest,
    decode_message,
    encode_weights,
)
from tests.actor_fakes import fake_weights
from tests.e2e_helpers import free_ports

LEARNER_VERSION = 5


class Learner:
    """The learner's side of the actor's control socket: heartbeats answered ``ok`` at
    :data:`LEARNER_VERSION`, weights requests with those weights."""

    address = "tcp://learner:5556"
    connected = True

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def request(self, frame: bytes, timeout_s: float = 2.0) -> Any:
        message = decode_message(frame, max_bytes=1 << 20)
        self.requests.append(message)
        if isinstance(message, WeightsRequest):
            return WeightsMessage(LEARNER_VERSION, {"w": np.full(2, LEARNER_VERSION, np.float32)})
        return HeartbeatReply("ok", LEARNER_VERSION)

    def count(self, kind: type) -> int:
        return sum(isinstance(message, kind) for message in self.requests)


@dataclass
class Deaf:
    """An actor (no model: ``loaded`` lists the versions it loaded) whose weights socket is connected to
    the learner's PUB but drops every message published there (it never subscribed), and whose
    control socket reaches :class:`Learner`."""

    actor: Any
    learner: Learner
    publisher: zmq.Socket
    loaded: list[int] = field(default_factory=list)

    def publish_missed(self) -> None:
        """The learner publishes its newer weights; the actor's subscription drops them."""
        self.publisher.send(
            encode_weights(WeightsMessage(LEARNER_VERSION, {"w": np.zeros(2, np.float32)}))
        )
        assert not self.actor.weights_sub.poll(100), "the subscription was to drop the publication"


@pytest.fixture
def deaf(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deaf]:
    import oakemu_services.actor as actor_module
    from oakemu_services.actor import Actor

    monkeypatch.setattr(actor_module, "HEARTBEAT_PERIOD_S", 0.05)
    monkeypatch.setattr(actor_module, "WEIGHTS_MISSED_S", 0.2)
    data, control, port = free_ports(3)
    actor = Actor(
        OakEmuConfig(data_port=data, control_port=control, weights_port=port), threading.Event()
    )
    publisher = actor.context.socket(zmq.PUB)
    try:
        publisher.bind(f"inproc://weights-{port}")
        actor.weights_sub = actor.context.socket(
            zmq.SUB
        )  # no SUBSCRIBE: every publication is dropped
        actor.weights_sub.connect(f"inproc://weights-{port}")
        learner = Learner()
        actor.client.control = learner
        actor.client.incarnation = "inc-1"
        feed = Deaf(actor, learner, publisher)

        fake_weights(actor, feed.loaded)
        yield feed
    finally:
        publisher.close(linger=0)
        actor.client.control = type(
            "Closed", (), {"request": lambda *a, **k: None, "close": lambda self: None}
        )()
        actor.close()


def test_an_asynchronous_actor_behind_the_heartbeat_s_version_fetches_and_loads_the_weights(
    deaf: Deaf,
) -> None:
    actor = deaf.actor
    deaf.publish_missed()
    started = time.monotonic()
    while not deaf.loaded and time.monotonic() - started < 5.0:
        actor.heartbeat_if_due()
        time.sleep(0.01)
    assert deaf.loaded == [LEARNER_VERSION] and actor.weights.policy_version == LEARNER_VERSION
    assert time.monotonic() - started >= 0.2, "asked only after WEIGHTS_MISSED_S behind"
    assert deaf.learner.count(WeightsRequest) == 1 and actor.weights.fetched == 1
    time.sleep(0.1)
    actor.heartbeat_if_due()
    assert deaf.learner.count(WeightsRequest) == 1, "not behind any more: no further request"
    last = [m for m in deaf.learner.requests if isinstance(m, Heartbeat)][-1]
    assert last.policy_version == LEARNER_VERSION and last.policy_lag == 0.0


def test_a_synchronous_actor_waiting_at_its_segment_end_gets_the_weights_it_missed(
    deaf: Deaf,
) -> None:
    """An actor that missed every publication, waiting for weights newer than its acting version at its
    segment's end, fetches them on the control socket, loads them and stops waiting."""
    actor = deaf.actor
    actor.pacing.sync_rollout_length = 32
    deaf.publish_missed()
    watchdog = threading.Timer(5.0, actor.stop_event.set)
    watchdog.start()
    try:
        assert actor._wait_for_weights_newer_than(0, give_up_s=None), (
            "still waiting when the watchdog stopped it"
        )
    finally:
        watchdog.cancel()
    assert deaf.loaded == [LEARNER_VERSION] and not actor.stop_event.is_set()


def test_a_synchronous_actor_inside_its_segment_keeps_the_fetched_weights_for_the_segment_s_end(
    deaf: Deaf,
) -> None:
    """One version acts on a whole synchronous segment: weights fetched while the actor waits inside
    it (a full step ring) are held, then loaded at the segment's end without waiting."""
    actor = deaf.actor
    actor.pacing.sync_rollout_length = 32
    started = time.monotonic()
    while actor.weights.held is None and time.monotonic() - started < 5.0:
        actor._pause(0.02)
    assert actor.weights.held is not None and actor.weights.held.policy_version == LEARNER_VERSION
    assert deaf.loaded == []
    count = deaf.learner.count(WeightsRequest)
    for _ in range(10):
        actor._pause(0.05)
    assert deaf.learner.count(WeightsRequest) == count, "held weights count as having the version"
    assert actor._wait_for_weights_newer_than(0, give_up_s=0.5) and deaf.loaded == [LEARNER_VERSION]


def test_weights_the_channel_delivers_late_need_no_request(deaf: Deaf) -> None:
    """The weights channel stays the fast path: weights waiting on it when a heartbeat names their
    version are read there, and nothing is asked on the control socket."""
    actor = deaf.actor
    actor.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
    deadline = time.monotonic() + 5.0
    while not actor.weights_sub.poll(
        10
    ):  # a PUB drops what it sends before the subscription arrives
        deaf.publisher.send(
            encode_weights(WeightsMessage(LEARNER_VERSION, {"w": np.zeros(2, np.float32)}))
        )
        assert time.monotonic() < deadline
    actor.next_heartbeat = 0.0
    actor.heartbeat_if_due()
    assert deaf.loaded == [LEARNER_VERSION] and deaf.learner.count(WeightsRequest) == 0
