"""An actor stops on the learner's stop notice (wire protocol 9), not only at its next heartbeat."""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.transport.control import StopNotice, WeightsMessage, encode_stop, encode_weights
from tests.e2e_helpers import free_ports


def test_a_stop_notice_on_the_weights_channel_stops_the_actor() -> None:
    from oakemu_services.actor import Actor

    data, control, weights = free_ports(3)
    config = OakEmuConfig(data_port=data, control_port=control, weights_port=weights)
    stop = threading.Event()
    actor = Actor(config, stop)
    publisher = actor.context.socket(zmq.PUB)
    try:
        publisher.bind(f"inproc://weights-{weights}")
        actor.weights_sub = actor.context.socket(zmq.SUB)
        actor.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
        actor.weights_sub.connect(f"inproc://weights-{weights}")
        loaded: list[int] = []
        actor._load_weights = lambda version, arrays, revision=0: loaded.append(version)  # no model here
        actor.policy_version, actor.weights_revision = 0, 0

        def deliver(frame: bytes) -> bool:
            deadline = time.monotonic() + 5
            while not actor.weights_sub.poll(10):  # a PUB drops what it sends before the SUB is connected
                publisher.send(frame)
                assert time.monotonic() < deadline, "the notice never arrived"
            return actor._poll_weights()

        assert deliver(encode_weights(WeightsMessage(1, {"w": np.zeros(2, np.float32)}))) and loaded == [1]
        assert not stop.is_set()
        assert deliver(encode_stop(StopNotice("env-step budget reached"))) is False
        assert stop.is_set() and loaded == [1]
    finally:
        publisher.close(linger=0)
        actor.close()
