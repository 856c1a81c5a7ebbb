"""One record of an actor's policy version: weights loaded by a join, from the weights channel (PUB)
and from the control socket (the catch-up after the channel missed them) show the same version in
every place that reports it: the stepper, the step messages (their rows' acting version), the
heartbeats (the version and policy lag the learner's telemetry reads), and the model that acts.

A real actor service with a CartPole stepper; the learner is a scripted control socket and an inproc
weights publisher.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.models import build_model, weights_to_arrays
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.transport.control import (
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    WeightsMessage,
    WeightsRequest,
    decode_message,
    encode_weights,
)
from tests.actor.test_join_setup import cartpole_reply
from tests.e2e_helpers import free_ports

JOIN_VERSION = 4  # cartpole_reply's


def cartpole_weights(seed: int) -> dict[str, np.ndarray]:
    spec = env_spec("CartPole-v1")
    torch.manual_seed(seed)
    return weights_to_arrays(
        build_model(spec.observation_layout, schema_for_env(spec).distribution)
    )


class Learner:
    """The learner's side of the actor's control socket: the join answered with ``cartpole_reply``,
    heartbeats ``ok`` at :attr:`version`, weights requests with :attr:`weights`."""

    address = "tcp://learner:5556"
    connected = True

    def __init__(self) -> None:
        self.version, self.weights = JOIN_VERSION, {}
        self.requests: list[Any] = []

    def request(self, frame: bytes, timeout_s: float = 2.0) -> Any:
        message = decode_message(frame, max_bytes=1 << 24)
        self.requests.append(message)
        if isinstance(message, JoinRequest):
            return cartpole_reply()
        if isinstance(message, WeightsRequest):
            return WeightsMessage(self.version, self.weights)
        return HeartbeatReply("ok", self.version)

    def close(self) -> None:
        pass


class Feed:
    """A joined actor, its scripted learner and the weights publisher its SUB socket reads."""

    def __init__(self, actor: Any, learner: Learner, publisher: zmq.Socket) -> None:
        self.actor, self.learner, self.publisher = actor, learner, publisher

    def reported(self) -> dict[str, Any]:
        """Every place that reports the actor's version, read now: a heartbeat is sent, one step
        message acted."""
        actor = self.actor
        actor.next_heartbeat = 0.0
        actor.heartbeat_if_due()
        actor.next_heartbeat = float("inf")
        heartbeat = [m for m in self.learner.requests if isinstance(m, Heartbeat)][-1]
        message, _, _ = actor.act_block()
        return {
            "stepper": actor.stepper.policy_version,
            "step message": message.policy_version,
            "heartbeat": heartbeat.policy_version,
            "heartbeat lag": heartbeat.policy_lag,
        }

    def acts_with(self, arrays: dict[str, np.ndarray]) -> bool:
        model = weights_to_arrays(self.actor.policy.model)
        return all(np.array_equal(model[name], array) for name, array in arrays.items())


@pytest.fixture
def feed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Feed]:
    import oakemu_services.actor as actor_module
    from oakemu_services.actor import Actor

    monkeypatch.setattr(actor_module, "HEARTBEAT_PERIOD_S", 0.02)
    monkeypatch.setattr(actor_module, "WEIGHTS_MISSED_S", 0.1)
    data, control, port = free_ports(3)
    config = OakEmuConfig(
        env_id="CartPole-v1",
        envs_per_actor=2,
        data_port=data,
        control_port=control,
        weights_port=port,
    )
    actor = Actor(config, threading.Event())
    learner = Learner()
    actor.client.control = learner
    publisher = actor.context.socket(zmq.PUB)
    try:
        actor.join()
        publisher.bind(f"inproc://weights-{port}")
        actor.weights_sub.close(linger=0)
        actor.weights_sub = actor.context.socket(zmq.SUB)
        actor.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
        actor.weights_sub.connect(f"inproc://weights-{port}")
        actor.next_heartbeat = float("inf")
        yield Feed(actor, learner, publisher)
    finally:
        publisher.close(linger=0)
        actor.close()


def test_weights_from_the_join_the_weights_channel_and_the_catch_up_show_one_version(
    feed: Feed,
) -> None:
    actor, learner = feed.actor, feed.learner
    assert feed.reported() == {
        "stepper": JOIN_VERSION,
        "step message": JOIN_VERSION,
        "heartbeat": JOIN_VERSION,
        "heartbeat lag": 0.0,
    }
    assert feed.acts_with(cartpole_reply().weights)

    # The weights channel: version 5 published, read during a pause of the step channel.
    published = cartpole_weights(5)
    learner.version = 5
    frame = encode_weights(WeightsMessage(5, published))
    deadline = time.monotonic() + 5
    while not actor.weights_sub.poll(10):  # a PUB drops what it sends before the SUB connects
        feed.publisher.send(frame)
        assert time.monotonic() < deadline, "the publication never arrived"
    actor._pause(1.0)
    assert feed.reported() == {
        "stepper": 5,
        "step message": 5,
        "heartbeat": 5,
        "heartbeat lag": 0.0,
    }
    assert feed.acts_with(published)

    # The catch-up: the channel misses version 6 (a subscription that drops everything); the
    # heartbeat replies name it and the actor fetches it on the control socket.
    actor.weights_sub.close(linger=0)
    actor.weights_sub = actor.context.socket(zmq.SUB)
    actor.weights_sub.connect(f"inproc://weights-{actor.config.weights_port}")
    fetched = cartpole_weights(6)
    learner.version, learner.weights = 6, fetched
    feed.publisher.send(encode_weights(WeightsMessage(6, fetched)))
    deadline = time.monotonic() + 5
    while not any(isinstance(m, WeightsRequest) for m in learner.requests):
        actor.next_heartbeat = 0.0
        actor.heartbeat_if_due()
        time.sleep(0.02)
        assert time.monotonic() < deadline, "the actor never fetched the weights it missed"
    assert sum(isinstance(m, WeightsRequest) for m in learner.requests) == 1
    assert feed.reported() == {
        "stepper": 6,
        "step message": 6,
        "heartbeat": 6,
        "heartbeat lag": 0.0,
    }
    assert feed.acts_with(fetched)
