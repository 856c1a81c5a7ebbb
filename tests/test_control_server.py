"""The learner's control protocol without sockets (oakemu_core.transport.control_server): joins and
their env config, heartbeats, leaves, refusals, step rings and the synchronous mode's ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.control_server import MAX_ACTOR_ENVS, ControlServer
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    decode_message,
)

WEIGHTS = {"w": np.arange(3, dtype=np.float32)}


class Peers:
    """A peer binding where the connection ``"thief"`` may not speak for anybody."""

    def bind(self, actor_id: str, incarnation: str, peer: Any) -> bool:
        return peer != "thief"

    def allows(self, actor_id: str, incarnation: str, peer: Any) -> bool:
        return peer != "thief"


class Rejections:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, reason: str, text: str) -> None:
        self.events.append((reason, text))


@pytest.fixture
def make_server() -> Iterator[Any]:
    buffers: list[RolloutBuffer] = []

    def make(*, host_id: str = "", offer_ring: Any = None, **settings: Any) -> ControlServer:
        config = OakEmuConfig(env_id="CartPole-v1", rollout_length=32, seed=7, log_level="WARNING", **settings)
        spec = env_spec(config.env_id)
        schema = schema_for_env(spec)
        buffers.append(RolloutBuffer(config.rollout_length, config.buffer_num_envs, schema=schema))
        assembler = RolloutAssembler([buffers[-1]], actor_timeout_s=10.0, sync=config.mode == "sync")
        return ControlServer(config, schema, spec.observation_layout, assembler, Peers(), Rejections(),
                             host_id=host_id, offer_ring=offer_ring or (lambda request, spec: None),
                             policy_version=3, weights=WEIGHTS)

    yield make
    for buffer in buffers:
        buffer.close()


def decoded(replies: list[tuple[Any, bytes]]) -> list[tuple[Any, Any]]:
    return [(identity, decode_message(frame, max_bytes=2**24)) for identity, frame in replies]


def join(server: ControlServer, actor_id: str, *, num_envs: int = 2, identity: Any = None, peer: Any = "own",
         stopping: bool = False, **request: Any) -> list[tuple[Any, Any]]:
    message = JoinRequest(actor_id, f"inc-{actor_id}", num_envs, "host", **request)
    return decoded(server.reply(message, 0.0, identity=identity or actor_id, peer=peer, stopping=stopping))


def heartbeat(server: ControlServer, actor_id: str, *, incarnation: str | None = None, peer: Any = "own",
              stopping: bool = False) -> HeartbeatReply:
    message = Heartbeat(actor_id, incarnation or f"inc-{actor_id}", 0, 3, 10.0, 0.0, 0)
    [(_, reply)] = decoded(server.reply(message, 1.0, identity=actor_id, peer=peer, stopping=stopping))
    return reply


def test_a_join_gets_its_index_spec_env_config_and_the_published_weights(make_server) -> None:
    server = make_server(num_actors=2, envs_per_actor=2)
    [(identity, reply)] = join(server, "a")
    assert identity == "a" and isinstance(reply, JoinReply) and reply.accepted
    assert reply.actor_index == 0 and reply.policy_version == 3
    np.testing.assert_array_equal(reply.weights["w"], WEIGHTS["w"])
    assert reply.spec.num_envs == 2 and reply.spec.steps_per_message == server.step_spec(
        JoinRequest("a", "inc-a", 2, "host"), step_ring=False).steps_per_message
    assert reply.env_config["env_id"] == "CartPole-v1" and reply.env_config["seed"] == 7 + 1000 * 1
    assert reply.env_config["mode"] == "async" and reply.env_config["rollout_length"] == 32
    assert reply.step_ring is None
    [(_, second)] = join(server, "b")
    assert second.actor_index == 1 and second.env_config["seed"] == 7 + 1000 * 2
    assert server.counters.accepted["join"] == 2 and set(server.assembler.actors) == {"a", "b"}

    server.publish(4, {"w": np.zeros(3, np.float32)})
    [(_, later)] = join(server, "c")
    assert later.policy_version == 4 and not later.weights["w"].any()


def test_joins_are_refused_when_stopping_too_wide_or_from_another_peer(make_server) -> None:
    server = make_server()
    [(_, reply)] = join(server, "a", stopping=True)
    assert not reply.accepted and reply.reason == "learner is stopping" and reply.actor_index == -1
    assert server.counters.accepted["join_refused"] == 1
    [(_, reply)] = join(server, "a", num_envs=MAX_ACTOR_ENVS + 1)
    assert not reply.accepted and f"expected at most {MAX_ACTOR_ENVS}" in reply.reason
    assert server.counters.rejected["schema"] == 1
    [(_, reply)] = join(server, "a", peer="thief")
    assert not reply.accepted and "another connection" in reply.reason
    assert server.counters.rejected["impersonation"] == 1
    assert [reason for reason, _ in server.rejections.events] == ["schema", "impersonation"]
    assert server.assembler.actors == {}


def test_heartbeats_answer_ok_rejoin_or_stop(make_server) -> None:
    server = make_server()
    join(server, "a")
    assert heartbeat(server, "a") == HeartbeatReply("ok", 3)
    assert server.assembler.actors["a"].last_heard == 1.0 and server.assembler.actors["a"].env_steps_per_second == 10.0
    assert heartbeat(server, "a", incarnation="old").status == "rejoin"
    assert heartbeat(server, "nobody").status == "rejoin"
    assert heartbeat(server, "a", stopping=True).status == "stop"
    assert heartbeat(server, "a", peer="thief").status == "rejoin"
    assert server.counters.accepted["heartbeat"] == 2 and server.counters.accepted["unknown_actor_control"] == 2
    assert server.counters.rejected["impersonation"] == 1


def test_a_leave_forgets_the_actor_and_is_answered_stop(make_server) -> None:
    server = make_server()
    join(server, "a")
    [(_, reply)] = decoded(server.reply(Leave("a", "inc-a"), 2.0, identity="a", peer="own"))
    assert reply.status == "stop" and "a" not in server.assembler.actors
    assert server.counters.accepted["leave"] == 1
    [(_, again)] = decoded(server.reply(Leave("a", "inc-a"), 2.0, identity="a", peer="own"))
    assert again.status == "stop" and server.counters.accepted["unknown_actor_control"] == 1


def test_undecodable_and_unserved_requests_are_counted_and_answered_rejoin(make_server) -> None:
    server = make_server()
    reply = decode_message(server.undecodable(MessageRejected("garbage", "not msgpack")), max_bytes=2**10)
    assert reply == HeartbeatReply("rejoin", 3) and server.counters.rejected["garbage"] == 1
    [(_, reply)] = decoded(server.reply(HeartbeatReply("ok", 1), 0.0, identity="x"))
    assert reply.status == "rejoin" and server.counters.rejected["schema"] == 1


def test_an_actor_on_this_machine_gets_a_step_ring_or_the_inline_spec(make_server) -> None:
    offered: list[tuple[str, bool]] = []
    ring = StepRingOffer("oakemu_test_stepring", "0" * 16, 2)

    def offer(request: JoinRequest, spec: Any) -> StepRingOffer | None:
        offered.append((request.actor_id, spec.steps_per_message))
        return ring if request.actor_id == "fits" else None

    server = make_server(host_id="here", offer_ring=offer, num_actors=3, envs_per_actor=2)
    [(_, ringed)] = join(server, "fits", host_id="here")
    [(_, full)] = join(server, "full", host_id="here")
    [(_, remote)] = join(server, "remote", host_id="elsewhere")
    ring_k = server.step_spec(JoinRequest("x", "x", 2, "h"), step_ring=True).steps_per_message
    inline_k = server.step_spec(JoinRequest("x", "x", 2, "h"), step_ring=False).steps_per_message
    assert offered == [("fits", ring_k), ("full", ring_k)], "only actors on this machine are offered a ring"
    assert ringed.step_ring == ring and ringed.spec.steps_per_message == ring_k
    assert full.step_ring is None and full.spec.steps_per_message == inline_k
    assert remote.step_ring is None and remote.spec.steps_per_message == inline_k


def test_a_bfloat16_actor_turns_on_the_reevaluation_of_every_rollout_where_images_allow_it(make_server) -> None:
    server = make_server()
    [(_, refused)] = join(server, "b", inference_precision="bfloat16")
    assert not refused.accepted and "only for uint8 image observations" in refused.reason
    assert server.reevaluate_every_rollout is False
    assert join(server, "a", inference_precision="float32")[0][1].accepted
    assert server.reevaluate_every_rollout is False


def test_sync_joins_wait_for_every_actor_then_take_ranks_in_actor_id_order(make_server) -> None:
    server = make_server(mode="sync", num_actors=2, envs_per_actor=2)
    assert join(server, "zeta", identity="z-identity") == [], "held until both actors asked"
    assert server.counters.accepted["join"] == 1
    replies = join(server, "alpha", identity="a-identity")
    assert [(identity, reply.actor_index) for identity, reply in replies] == [("a-identity", 0), ("z-identity", 1)]
    assert all(reply.accepted and reply.env_config["mode"] == "sync" for _, reply in replies)
    assert {r.actor_id: r.index for r in server.assembler.actors.values()} == {"alpha": 0, "zeta": 1}

    # The run has started: a third actor finds no free rank; one that left is replaced at its rank.
    [(_, refused)] = join(server, "gamma")
    assert not refused.accepted and "actors are all connected" in refused.reason
    server.reply(Leave("zeta", "inc-zeta"), 1.0, identity="z-identity", peer="own")
    [(_, replacement)] = join(server, "gamma")
    assert replacement.accepted and replacement.actor_index == 1
    [(_, wrong)] = join(server, "delta", num_envs=3)
    assert not wrong.accepted and "envs_per_actor=2" in wrong.reason
    assert server.counters.accepted["join_refused"] == 2
