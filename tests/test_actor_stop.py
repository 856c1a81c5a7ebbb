"""An actor stops on the learner's stop notice (wire protocol 9), not only at its next heartbeat."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import zmq

from oakemu_core.config import OakEmuConfig
from oakemu_core.transport.control import JoinReply, StopNotice, WeightsMessage, encode_stop, encode_weights
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


def test_weights_held_in_a_segment_are_dropped_when_the_actor_joins_again() -> None:
    """Weights held inside a synchronous segment (v101) do not survive a rejoin: after the learner
    restarted from its checkpoint at v95, the next segment's end waits for the new learner's v96
    instead of loading the dead learner's v101 (which would label rows and stall the wait)."""
    from oakemu_services.actor import Actor

    data, control, weights = free_ports(3)
    actor = Actor(OakEmuConfig(data_port=data, control_port=control, weights_port=weights), threading.Event())
    publisher = actor.context.socket(zmq.PUB)
    try:
        publisher.bind(f"inproc://weights-{weights}")
        actor.weights_sub = actor.context.socket(zmq.SUB)
        actor.weights_sub.setsockopt(zmq.SUBSCRIBE, b"")
        actor.weights_sub.connect(f"inproc://weights-{weights}")
        loaded: list[int] = []

        def load(version: int, arrays: dict, revision: int = 0) -> None:  # no model here
            loaded.append(version)
            actor.policy_version, actor.weights_revision = version, revision

        actor._load_weights = load
        actor.stepper = SimpleNamespace()  # a rejoin: envs, model and stepper exist
        actor.policy_version, actor.sync_rollout_length = 100, 32
        actor.next_heartbeat = float("inf")
        frame = encode_weights(WeightsMessage(101, {"w": np.zeros(2, np.float32)}))
        deadline = time.monotonic() + 5
        while not actor.weights_sub.poll(0):
            publisher.send(frame)
            time.sleep(0.01)
            assert time.monotonic() < deadline
        actor._pause(2.0)  # inside a segment: v101 held for the segment's end
        assert actor.held_weights is not None and actor.held_weights.policy_version == 101

        # The learner crashes and is restarted from its checkpoint at version 95; the actor rejoins.
        reply = JoinReply(True, "", 0, SimpleNamespace(steps_per_message=1),
                          {"mode": "sync", "rollout_length": 32, "env_id": "CartPole-v1", "seed": 1}, 95, {})
        actor.client.join = lambda stop, reporter: reply
        actor.client.attach_ring = lambda reply: None
        actor._open_channel = lambda spec, ring: None
        actor.join()
        assert actor.policy_version == 95 and loaded == [95]

        # End of the first segment after the rejoin (acted by v95): the actor should wait for v96.
        actor._wait_for_weights_newer_than(95, give_up_s=0.2)
        assert actor.policy_version != 101, f"loaded the dead learner's held v101 (loads: {loaded})"
        assert actor.held_weights is None
    finally:
        publisher.close(linger=0)
        actor.close()
