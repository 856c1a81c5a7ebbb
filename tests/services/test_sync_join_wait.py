"""A synchronous run waiting for its planned actors, through real sockets: the learner's control
server behind a ROUTER (served as ``oakemu_services.learner`` serves it: requests, then ``tick`` every
20 ms) and an actor's :class:`~oakemu_core.actor.client.LearnerClient` on its REQ socket.

The situation of ``docker compose stop`` then ``up --scale actor=1`` on a run planned for 2 actors:
the one actor's join is held until the grace period ends. It hears why every
:data:`~oakemu_core.transport.sync_joins.JOIN_WAIT_NOTICE_S` (its log says "waiting for 1 more
actor(s) to join"), never reports the learner as unreachable, and joins when the grace period ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from oakemu_services.runtime import RetryReporter

from oakemu_core.actor.client import ControlChannel, LearnerClient
from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport import sync_joins
from oakemu_core.transport.auth import PeerBinding
from oakemu_core.transport.control import JoinRequest, decode_message
from oakemu_core.transport.control_server import ControlServer
from tests.e2e_helpers import free_ports

GRACE_S = 4.0


class Rejections:
    def event(self, reason: str, text: str) -> None:
        raise AssertionError(f"unexpected rejection: {text}")


@pytest.fixture
def learner(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A synchronous learner's control socket for a run of 2 planned actors; its address."""
    monkeypatch.setattr(sync_joins, "START_GRACE_S", GRACE_S)
    config = OakEmuConfig(
        env_id="CartPole-v1",
        mode="sync",
        num_actors=2,
        envs_per_actor=2,
        rollout_length=32,
        log_level="WARNING",
    )
    spec = env_spec(config.env_id)
    schema = schema_for_env(spec)
    buffer = RolloutBuffer(config.rollout_length, config.allocated_num_envs, schema=schema)
    peers = PeerBinding(user_ids=False)
    server = ControlServer(
        config,
        schema,
        spec.observation_layout,
        RolloutAssembler([buffer], actor_timeout_s=10.0, sync=True),
        peers,
        Rejections(),
        host_id="",
        offer_ring=lambda request, spec: None,
        policy_version=0,
        weights={},
    )
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_ports(1)[0]
    router.bind(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(20):
                parts = router.recv_multipart(copy=False)
                envelope, frame = tuple(parts[:-2]), parts[-1]
                message = decode_message(frame.bytes, max_bytes=1 << 20)
                for to, reply in server.reply(
                    message,
                    time.monotonic(),
                    identity=envelope,
                    peer=peers.connection(parts[0], frame),
                ):
                    router.send_multipart([*to, b"", reply])
            for to, reply in server.tick(time.monotonic()):
                router.send_multipart([*to, b"", reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        router.close(linger=0)
        context.term()
        buffer.close()


def test_one_actor_of_two_planned_hears_that_the_learner_waits_and_joins_after_the_grace(
    learner: str, caplog: pytest.LogCaptureFixture
) -> None:
    context = zmq.Context()
    control = ControlChannel(context, learner, 1 << 24)
    logger = logging.getLogger("oakemu.actor")
    silence = RetryReporter(logger, "learner", learner, give_up_s=30.0, period_s=1.0)
    client = LearnerClient(
        control, JoinRequest("solo", "", 2, "host"), patience_s=30.0, silence=silence
    )
    try:
        with caplog.at_level(logging.INFO, logger="oakemu.actor"):
            started = time.monotonic()
            reply = client.join(
                threading.Event(),
                RetryReporter(logger, "learner", learner, give_up_s=30.0, period_s=1.0),
            )
            waited = time.monotonic() - started
    finally:
        control.close()
        context.term()
    assert reply.accepted and reply.actor_index == 0
    assert (
        GRACE_S - 0.5 <= waited < GRACE_S + 30.0
    )  # not before the grace; the bound above is only "not stuck"
    lines = [record.getMessage() for record in caplog.records]
    assert not [line for line in lines if "no answer" in line], lines
    assert any(
        "the learner answered: mode='sync': waiting for 1 more actor(s) to join (up to 4 s" in line
        for line in lines
    ), lines
