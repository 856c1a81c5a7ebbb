"""A learner's control and data handling under a hostile peer, on real sockets, in this process.

One CartPole learner (``oakemu_services.learner.Learner``, its loop driven by the test) and raw
ZeroMQ clients on 127.0.0.1: a heartbeat with a negative rate, a second connection that knows a
live actor's incarnation, a join asking for 65,536 envs, a flood of joins. The learner must
refuse and count each, keep serving the real actor, and keep its log short.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from oakemu_services.learner import Learner

from oakemu_core.config import OakEmuConfig
from oakemu_core.run.learner_setup import NOTICE_BURST
from oakemu_core.transport.auth import new_routing_id
from oakemu_core.transport.codec import header, pack
from oakemu_core.transport.control import (
    ACTOR_ID_IN_USE,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    decode_message,
    encode_heartbeat,
    encode_join_request,
    encode_leave,
)
from oakemu_core.transport.peer_limits import JOIN_BURST_PER_HOST, JoinRate
from oakemu_core.transport.step_ring import shared_memory_host_id
from oakemu_core.transport.steps import StepMessage, encode_step
from tests.e2e_helpers import new_ports


class Harness:
    """A learner whose loop the test turns, and ZeroMQ clients of it."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.context = zmq.Context()
        config = learner.config
        self.control_address = f"tcp://127.0.0.1:{config.control_port}"
        self.data_address = f"tcp://127.0.0.1:{config.data_port}"

    def client(self) -> zmq.Socket:
        """A REQ socket on the control port: one connection, with a routing id of its own."""
        sock = self.context.socket(zmq.REQ)
        sock.routing_id = new_routing_id()
        sock.connect(self.control_address)
        return sock

    def request(self, sock: zmq.Socket, frame: bytes) -> Any:
        """Send one request and turn the learner's control handling until the reply comes."""
        sock.send(frame)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            self.learner._handle_control(time.monotonic())
            if sock.poll(5):
                return decode_message(sock.recv(), max_bytes=2**26)
        raise AssertionError("the learner did not answer")

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    # Async mode: the synthetic actors here join and never step (a synchronous rollout would wait for them).
    ports = new_ports()
    runs = tmp_path_factory.mktemp("runs")
    config = OakEmuConfig(
        env_id="CartPole-v1",
        mode="async",
        num_actors=1,
        envs_per_actor=2,
        rollout_length=8,
        runs_dir=runs,
        run_name="abuse",
        bind_host="127.0.0.1",
        data_port=ports.data,
        control_port=ports.control,
        weights_port=ports.weights,
        telemetry_port=ports.telemetry,
        metrics_port=ports.metrics,
        actor_timeout_s=600.0,
        eval_every_updates=0,
        log_level="WARNING",
    )
    learner = Learner(config, runs / "abuse")
    made = Harness(learner)
    try:
        yield made
    finally:
        made.close()
        learner.close()


def join(
    harness: Harness,
    sock: zmq.Socket,
    actor_id: str,
    incarnation: str,
    num_envs: int = 2,
    host_id: str = "",
) -> JoinReply:
    reply = harness.request(
        sock, encode_join_request(JoinRequest(actor_id, incarnation, num_envs, "here", host_id))
    )
    assert isinstance(reply, JoinReply), reply
    return reply


def test_a_heartbeat_with_a_negative_rate_does_not_stop_the_learner(harness: Harness) -> None:
    learner, actor = harness.learner, harness.client()
    assert join(harness, actor, "rate", "inc-rate").accepted
    before = learner.assembler.counters.rejected["value_range"]
    forged = pack(
        {
            **header("heartbeat"),
            "actor_id": "rate",
            "incarnation": "inc-rate",
            "seq": 0,
            "policy_version": 0,
            "env_steps_per_second": -1.0,
            "policy_lag": 0.0,
            "episodes": 0,
        }
    )
    assert harness.request(actor, forged).status == "rejoin"
    assert learner.assembler.counters.rejected["value_range"] == before + 1
    assert learner.assembler.actors["rate"].env_steps_per_second == 0.0
    learner._publish_telemetry(
        is_update=False
    )  # the snapshot's schema refuses a negative rate: must not raise
    ok = harness.request(actor, encode_heartbeat(Heartbeat("rate", "inc-rate", 0, 0, 5.0, 0.0, 0)))
    assert ok.status == "ok" and learner.assembler.actors["rate"].env_steps_per_second == 5.0


def test_a_second_connection_with_a_stolen_incarnation_is_refused_and_the_actor_keeps_training(
    harness: Harness,
) -> None:
    """From 127.0.0.1, the victim's own address: a leave, a heartbeat and a join naming the victim's
    id and incarnation are refused and counted as impersonation; the victim's heartbeat is still
    ``ok`` and its steps are still written."""
    learner = harness.learner
    victim, thief = harness.client(), harness.client()
    reply = join(harness, victim, "victim", "inc-victim")
    assert reply.accepted and reply.step_ring is None
    counted = learner.assembler.counters.rejected["impersonation"]
    leave = harness.request(thief, encode_leave(Leave("victim", "inc-victim")))
    assert isinstance(leave, HeartbeatReply) and leave.status == "rejoin"
    beat = harness.request(
        thief, encode_heartbeat(Heartbeat("victim", "inc-victim", 0, 0, 1.0, 0.0, 0))
    )
    assert beat.status == "rejoin"
    takeover = join(harness, thief, "victim", "inc-victim")
    assert not takeover.accepted and takeover.reason.startswith(ACTOR_ID_IN_USE)
    assert learner.assembler.counters.rejected["impersonation"] == counted + 3
    assert learner.assembler.actors["victim"].incarnation == "inc-victim"
    assert (
        harness.request(
            victim, encode_heartbeat(Heartbeat("victim", "inc-victim", 0, 0, 1.0, 0.0, 0))
        ).status
        == "ok"
    )

    spec = reply.spec
    fields = {name: np.zeros(shape, dtype) for name, (dtype, shape) in spec.array_layout().items()}
    fields["trainable"][...] = True
    data = harness.context.socket(zmq.PUSH)
    data.connect(harness.data_address)
    written = learner.assembler.counters.env_steps
    data.send_multipart(encode_step(StepMessage("victim", "inc-victim", 0, 0, fields), spec))
    deadline = time.monotonic() + 10.0
    while learner.assembler.counters.env_steps == written and time.monotonic() < deadline:
        learner._handle_data(time.monotonic())
        time.sleep(0.005)
    assert learner.assembler.counters.env_steps == written + spec.steps_per_message * spec.num_envs


def test_a_message_of_a_departed_incarnation_that_cannot_be_decoded_is_a_late_step(
    harness: Harness,
) -> None:
    """A step message still in flight when its actor left, which the learner can no longer decode (a
    stacked observation sent as its newest frame only: the stack history left with the actor; here a
    frame short): counted as late steps, not as a rejection. The same message of a joined actor is
    rejected."""
    learner, actor = harness.learner, harness.client()
    reply = join(harness, actor, "leaver", "inc-leaver")
    spec = reply.spec
    fields = {name: np.zeros(shape, dtype) for name, (dtype, shape) in spec.array_layout().items()}
    broken = encode_step(StepMessage("leaver", "inc-leaver", 0, 0, fields), spec)[:-1]
    data = harness.context.socket(zmq.PUSH)
    data.connect(harness.data_address)
    counters = learner.assembler.counters

    def deliver() -> None:
        seen = counters.received["data"]
        data.send_multipart(broken)
        deadline = time.monotonic() + 10.0
        while counters.received["data"] == seen and time.monotonic() < deadline:
            learner._handle_data(time.monotonic())
            time.sleep(0.005)

    rejected = sum(counters.rejected.values())
    deliver()
    assert sum(counters.rejected.values()) == rejected + 1  # joined: a malformed message
    assert harness.request(actor, encode_leave(Leave("leaver", "inc-leaver"))).status == "stop"
    late, rejected = counters.dropped["late_steps"], sum(counters.rejected.values())
    deliver()
    assert counters.dropped["late_steps"] == late + spec.num_envs * spec.steps_per_message
    assert sum(counters.rejected.values()) == rejected
    data.close(linger=0)


def test_a_join_asking_for_65536_envs_is_refused_and_makes_no_step_ring(harness: Harness) -> None:
    learner = harness.learner
    assert learner.rings.used_bytes == 0
    reply = join(
        harness,
        harness.client(),
        "greedy",
        "inc-greedy",
        num_envs=65_536,
        host_id=shared_memory_host_id(),
    )
    assert not reply.accepted and "max_envs_per_actor" in reply.reason
    assert "greedy" not in learner.assembler.actors and learner.rings.used_bytes == 0


def test_a_join_flood_writes_a_bounded_number_of_log_lines(
    harness: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 joins from one connection (300 actor ids): every one answered and counted, the host's burst
    joined and the rest told to retry (the per-host join rate), at most the notice burst, a first line
    per reason and a summary logged. The host's bucket starts full (the earlier tests' joins from this
    host are not counted against it)."""
    learner, flooder = harness.learner, harness.client()
    monkeypatch.setattr(learner.control_server, "join_rate", JoinRate())
    counters = learner.assembler.counters
    joined, throttled = counters.accepted["join"], counters.rejected["join_rate"]
    with caplog.at_level(logging.INFO, logger="oakemu.learner"):
        replies = [join(harness, flooder, f"flood-{i}", f"inc-{i}") for i in range(300)]
        learner.rejection_log["notices"].flush(time.monotonic() + 60.0)
    lines = [r for r in caplog.records if r.name == "oakemu.learner"]
    accepted = sum(reply.accepted for reply in replies)
    assert JOIN_BURST_PER_HOST <= accepted < 300
    assert all(
        reply.retry_after_s > 0 and "too many joins" in reply.reason
        for reply in replies
        if not reply.accepted
    )
    assert counters.accepted["join"] - joined == accepted
    assert counters.rejected["join_rate"] - throttled == 300 - accepted
    # The burst, the first line of each reason (join, join_rate: logged whatever the burst) and one
    # summary; the harness is shared, so a reason may have had its first line in an earlier test.
    assert len(lines) <= NOTICE_BURST + 2 + 1, [r.getMessage() for r in lines][-5:]
    assert "skipped the lines of" in lines[-1].getMessage() and "join" in lines[-1].getMessage()


def test_the_prometheus_endpoint_listens_where_the_learner_binds(harness: Harness) -> None:
    exporter = harness.learner.prometheus
    assert exporter is not None and exporter._server.server_address[0] == "127.0.0.1"  # not 0.0.0.0
