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


def test_a_synchronous_actor_waiting_inside_its_segment_hears_the_stop_and_keeps_new_weights_for_the_end() -> None:
    """Synchronous mode: a wait inside a segment (a full step ring, back-pressure) ends at a stop
    notice, not at the next heartbeat a second later; weights read there are loaded only when the
    segment ends, so one version acts on the whole segment."""
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

        def load(version: int, arrays: dict, revision: int = 0) -> None:  # no model here
            loaded.append(version)
            actor.policy_version = version

        actor._load_weights = load
        actor.policy_version, actor.weights_revision, actor.sync_rollout_length = 0, 0, 32
        actor.next_heartbeat = float("inf")  # no learner to answer one

        def pause_until_read(frame: bytes) -> None:
            deadline = time.monotonic() + 5
            while not actor.weights_sub.poll(0):  # a PUB drops what it sends before the SUB is connected
                publisher.send(frame)
                time.sleep(0.01)
                assert time.monotonic() < deadline, "the message never arrived"
            start = time.monotonic()
            actor._pause(2.0)
            assert time.monotonic() - start < 0.5  # ended by the message, not the 2 s

        pause_until_read(encode_weights(WeightsMessage(1, {"w": np.zeros(2, np.float32)})))
        assert loaded == [] and actor.held_weights is not None  # held for the segment's end
        assert actor._wait_for_weights_newer_than(0, give_up_s=None) and loaded == [1]
        assert actor.held_weights is None and not stop.is_set()
        pause_until_read(encode_stop(StopNotice("env-step budget reached")))
        assert stop.is_set() and loaded == [1]
    finally:
        publisher.close(linger=0)
        actor.close()
