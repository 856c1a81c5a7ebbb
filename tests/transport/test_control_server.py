"""The learner's control protocol without sockets (oakemu_core.transport.control_server): joins and
their env config, heartbeats, leaves, refusals, step rings and the synchronous mode's ranks; and what
a peer may not do: speak for an actor from another connection, ask for more than the run's limits,
report figures the telemetry cannot hold, flood the log or join faster than its host's rate."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.learner_telemetry import LearnerTelemetry
from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.auth import Connection, PeerBinding
from oakemu_core.transport.codec import MessageRejected, header, pack
from oakemu_core.transport.control import (
    ACTOR_ID_IN_USE,
    MAX_RETRY_AFTER_S,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    WeightsMessage,
    WeightsRequest,
    decode_message,
    encode_heartbeat,
    encode_join_reply,
    encode_leave,
    encode_weights_request,
)
from oakemu_core.transport.control_server import (
    ANONYMOUS_REFUSAL,
    JOIN_WAIT_NOTICE_S,
    START_GRACE_S,
    ControlServer,
)
from oakemu_core.transport.peer_limits import JOIN_BURST_PER_HOST, JOINS_PER_SECOND_PER_HOST
from oakemu_core.transport.steps import StepMessage

WEIGHTS = {"w": np.arange(3, dtype=np.float32)}


THIEF = Connection(b"thief", "127.0.0.1", "")
"""Another connection on the actors' own host (and, without CURVE, the same user id: none)."""


def own(actor_id: str) -> Connection:
    """The connection actor ``actor_id`` joins from (its routing id is its name, here)."""
    return Connection(actor_id.encode(), "127.0.0.1", "")


class Rejections:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, reason: str, text: str) -> None:
        self.events.append((reason, text))


@pytest.fixture
def make_server() -> Iterator[Any]:
    buffers: list[RolloutBuffer] = []

    def make(*, host_id: str = "", offer_ring: Any = None, **settings: Any) -> ControlServer:
        settings.setdefault("mode", "async")  # the tests of the synchronous mode say so
        config = OakEmuConfig(
            env_id="CartPole-v1", rollout_length=32, seed=7, log_level="WARNING", **settings
        )
        spec = env_spec(config.env_id)
        schema = schema_for_env(spec)
        buffers.append(
            RolloutBuffer(config.rollout_length, config.allocated_num_envs, schema=schema)
        )
        assembler = RolloutAssembler(
            [buffers[-1]], actor_timeout_s=10.0, sync=config.mode == "sync"
        )
        return ControlServer(
            config,
            schema,
            spec.observation_layout,
            assembler,
            PeerBinding(user_ids=False),
            Rejections(),
            host_id=host_id,
            offer_ring=offer_ring or (lambda request, spec: None),
            policy_version=3,
            weights=WEIGHTS,
        )

    yield make
    for buffer in buffers:
        buffer.close()


def decoded(replies: list[tuple[Any, bytes]]) -> list[tuple[Any, Any]]:
    return [(identity, decode_message(frame, max_bytes=2**24)) for identity, frame in replies]


def join(
    server: ControlServer,
    actor_id: str,
    *,
    num_envs: int = 2,
    identity: Any = None,
    peer: Any = None,
    stopping: bool = False,
    incarnation: str | None = None,
    **request: Any,
) -> list[tuple[Any, Any]]:
    message = JoinRequest(actor_id, incarnation or f"inc-{actor_id}", num_envs, "host", **request)
    return decoded(
        server.reply(
            message,
            0.0,
            identity=identity or actor_id,
            peer=peer or own(actor_id),
            stopping=stopping,
        )
    )


def heartbeat(
    server: ControlServer,
    actor_id: str,
    *,
    incarnation: str | None = None,
    peer: Any = None,
    stopping: bool = False,
) -> HeartbeatReply:
    message = Heartbeat(actor_id, incarnation or f"inc-{actor_id}", 0, 3, 10.0, 0.0, 0)
    [(_, reply)] = decoded(
        server.reply(message, 1.0, identity=actor_id, peer=peer or own(actor_id), stopping=stopping)
    )
    return reply


def test_a_join_gets_its_index_spec_env_config_and_the_published_weights(make_server) -> None:
    server = make_server(num_actors=2, envs_per_actor=2)
    [(identity, reply)] = join(server, "a")
    assert identity == "a" and isinstance(reply, JoinReply) and reply.accepted
    assert reply.actor_index == 0 and reply.policy_version == 3
    np.testing.assert_array_equal(reply.weights["w"], WEIGHTS["w"])
    assert (
        reply.spec.num_envs == 2
        and reply.spec.steps_per_message == server.step_spec(2, step_ring=False).steps_per_message
    )
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
    [(_, reply)] = join(server, "a", num_envs=1025)
    assert not reply.accepted and "expected at most max_envs_per_actor=1024" in reply.reason
    assert server.counters.rejected["value_range"] == 1
    join(server, "a")
    [(_, reply)] = join(server, "a", peer=THIEF)
    assert not reply.accepted and "another connection" in reply.reason
    assert server.counters.rejected["impersonation"] == 1
    assert [reason for reason, _ in server.rejections.events] == ["value_range", "impersonation"]
    assert list(server.assembler.actors) == ["a"]


def test_heartbeats_answer_ok_rejoin_or_stop(make_server) -> None:
    server = make_server()
    join(server, "a")
    assert heartbeat(server, "a") == HeartbeatReply("ok", 3)
    assert (
        server.assembler.actors["a"].last_heard == 1.0
        and server.assembler.actors["a"].env_steps_per_second == 10.0
    )
    assert heartbeat(server, "a", incarnation="old").status == "rejoin"
    assert heartbeat(server, "nobody").status == "rejoin"
    assert heartbeat(server, "a", stopping=True).status == "stop"
    assert heartbeat(server, "a", peer=THIEF).status == "rejoin"
    assert (
        server.counters.accepted["heartbeat"] == 2
        and server.counters.accepted["unknown_actor_control"] == 2
    )
    assert server.counters.rejected["impersonation"] == 1


def test_a_leave_forgets_the_actor_and_is_answered_stop(make_server) -> None:
    server = make_server()
    join(server, "a")
    [(_, reply)] = decoded(server.reply(Leave("a", "inc-a"), 2.0, identity="a", peer=own("a")))
    assert reply.status == "stop" and "a" not in server.assembler.actors
    assert server.counters.accepted["leave"] == 1
    assert join(server, "a", peer=THIEF, incarnation="inc-a2")[0][1].accepted, (
        "an id that left is free to join"
    )
    [(_, again)] = decoded(server.reply(Leave("a", "inc-a"), 2.0, identity="a", peer=THIEF))
    assert again.status == "stop" and server.counters.accepted["unknown_actor_control"] == 1


def test_undecodable_and_unserved_requests_are_counted_and_answered_rejoin(make_server) -> None:
    server = make_server()
    reply = decode_message(
        server.undecodable(MessageRejected("garbage", "not msgpack")), max_bytes=2**10
    )
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
    ring_k = server.step_spec(2, step_ring=True).steps_per_message
    inline_k = server.step_spec(2, step_ring=False).steps_per_message
    assert offered == [("fits", ring_k), ("full", ring_k)], (
        "only actors on this machine are offered a ring"
    )
    assert ringed.step_ring == ring and ringed.spec.steps_per_message == ring_k
    assert full.step_ring is None and full.spec.steps_per_message == inline_k
    assert remote.step_ring is None and remote.spec.steps_per_message == inline_k


def test_a_socket_actor_s_whole_stack_messages_fit_max_message_bytes() -> None:
    """Breakout through the sockets: K = 4 by default; a lower max_message_bytes lowers K until a
    message of whole stacks (resets, key frames) fits it, never below 1."""
    spec = env_spec("ALE/Breakout-v5")
    schema = schema_for_env(spec)
    whole_step = 16 * schema.sent_bytes_per_env()  # 16 envs, whole stacks: ~452 KB

    with RolloutBuffer(8, 16, schema=schema) as buffer:
        assembler = RolloutAssembler([buffer], actor_timeout_s=10.0)

        def k(max_message_bytes: int, step_ring: bool = False) -> int:
            config = OakEmuConfig(
                env_id="ALE/Breakout-v5", max_message_bytes=max_message_bytes, log_level="WARNING"
            )
            server = ControlServer(
                config,
                schema,
                spec.observation_layout,
                assembler,
                PeerBinding(user_ids=False),
                Rejections(),
                host_id="",
                offer_ring=lambda request, spec: None,
                policy_version=0,
                weights=WEIGHTS,
            )
            return server.step_spec(16, step_ring=step_ring).steps_per_message

        assert k(64 * 2**20) == 4
        assert k(2 * whole_step + 1024) == 2
        assert k(2 * whole_step) == 1 == k(whole_step // 2)
        assert k(2 * whole_step, step_ring=True) == 4  # a ring's message is its header


def test_a_bfloat16_actor_turns_on_the_reevaluation_of_every_rollout_where_images_allow_it(
    make_server,
) -> None:
    server = make_server()
    [(_, refused)] = join(server, "b", inference_precision="bfloat16")
    assert not refused.accepted and "only for uint8 image observations" in refused.reason
    assert server.reevaluate_every_rollout is False
    assert join(server, "a", inference_precision="float32")[0][1].accepted
    assert server.reevaluate_every_rollout is False


def cartpole_step(actor_id: str, seq: int, num_envs: int = 2) -> StepMessage:
    """A CartPole step message of zeros from ``inc-<actor_id>``."""
    return StepMessage(
        actor_id,
        f"inc-{actor_id}",
        seq,
        3,
        fields={
            "observations": np.zeros((num_envs, 4), np.float32),
            "actions": np.zeros(num_envs, np.int64),
            "log_probs": np.zeros(num_envs, np.float32),
            "values": np.zeros(num_envs, np.float32),
            "rewards": np.ones(num_envs, np.float32),
            "dones": np.zeros(num_envs, bool),
            "truncated": np.zeros(num_envs, bool),
            "bootstrap_values": np.zeros(num_envs, np.float32),
            "next_values": np.zeros(num_envs, np.float32),
            "trainable": np.ones(num_envs, bool),
        },
    )


def test_sync_joins_wait_for_every_actor_then_take_ranks_in_actor_id_order(make_server) -> None:
    server = make_server(mode="sync", num_actors=2, envs_per_actor=2, max_actors=4)
    assert join(server, "zeta", identity="z-identity") == [], "held until both actors asked"
    assert server.counters.accepted["join"] == 1
    replies = join(server, "alpha", identity="a-identity")
    assert [(identity, reply.actor_index) for identity, reply in replies] == [
        ("a-identity", 0),
        ("z-identity", 1),
    ]
    assert all(reply.accepted and reply.env_config["mode"] == "sync" for _, reply in replies)
    assert {r.actor_id: r.index for r in server.assembler.actors.values()} == {
        "alpha": 0,
        "zeta": 1,
    }

    # Nothing written yet: a third actor joins this rollout at once.
    [(_, gamma)] = join(server, "gamma")
    assert (
        gamma.accepted
        and gamma.actor_index == 2
        and set(server.assembler.round.members) == {"alpha", "zeta", "gamma"}
    )
    server.assembler.ingest(cartpole_step("alpha", 0), current_policy_version=3, now=0.0)
    assert join(server, "delta") == [], (
        "the rollout is under way (alpha wrote a row): delta waits for the next one"
    )
    server.reply(Leave("zeta", "inc-zeta"), 1.0, identity="zeta", peer=own("zeta"))
    [(to, notice)] = decoded(server.tick(1.0))  # held for JOIN_WAIT_NOTICE_S: told why it waits
    assert (
        to == "delta"
        and not notice.accepted
        and notice.retry_after_s == 0.0
        and "next rollout" in notice.reason
    )
    assert server.tick(1.1) == [] and "delta" not in server.assembler.actors
    assert join(server, "delta") == [], "asked again at once, held again"
    # The members leave with nothing finished: the rollout opens again and delta joins it, at the lowest free rank.
    server.reply(Leave("alpha", "inc-alpha"), 1.0, identity="alpha", peer=own("alpha"))
    [(to, delta)] = decoded(server.tick(1.0))
    assert to == "delta" and delta.accepted and delta.actor_index == 0 and delta.policy_version == 3
    assert set(server.assembler.round.members) == {"gamma", "delta"}
    # zeta comes back to its old rank 1; a fifth actor finds no room (the buffer holds max_actors=4).
    [(_, zeta)] = decoded(
        server.reply(
            JoinRequest("zeta", "inc-zeta-2", 2, "host"), 2.0, identity="zeta", peer=own("zeta")
        )
    )
    assert zeta.accepted and zeta.actor_index == 1
    [(_, omega)] = join(server, "omega")
    assert omega.accepted and omega.actor_index == 3
    [(_, full)] = join(server, "psi")
    assert not full.accepted and "max_actors=4" in full.reason
    [(_, wrong)] = join(server, "epsilon", num_envs=3)
    assert not wrong.accepted and "envs_per_actor=2" in wrong.reason
    assert server.counters.accepted["join_refused"] == 2


def test_the_first_sync_rollout_starts_with_the_actors_present_after_the_grace_period(
    make_server,
) -> None:
    server = make_server(mode="sync", num_actors=3, envs_per_actor=2)
    assert join(server, "b") == [] and join(server, "a") == []
    notices = decoded(server.tick(START_GRACE_S - 1.0))
    assert sorted(to for to, _ in notices) == ["a", "b"]
    assert all(
        not n.accepted and n.retry_after_s == 0.0 and "1 more actor(s)" in n.reason
        for _, n in notices
    )
    assert join(server, "b") == [] and join(server, "a") == [], "asked again at once, held again"
    replies = decoded(server.tick(START_GRACE_S + 0.1))
    assert [(to, reply.actor_index) for to, reply in replies] == [("a", 0), ("b", 1)]


def test_a_heartbeat_reply_says_how_many_of_the_actors_steps_the_learner_holds(make_server) -> None:
    server = make_server(num_actors=1, envs_per_actor=2)  # async, one buffer of 2 columns x 32 rows
    join(server, "a")
    for seq in range(
        32 + 3
    ):  # the buffer is full (it does not train here): the last 3 steps are held
        server.assembler.ingest(cartpole_step("a", seq), current_policy_version=3, now=0.0)
    assert heartbeat(server, "a") == HeartbeatReply("ok", 3, held_rows=3)
    assert server.assembler.take_full_rollout() is not None
    server.assembler.release(0)  # the held steps go into the released buffer
    assert heartbeat(server, "a") == HeartbeatReply("ok", 3, held_rows=0)


# --- what a peer may not do ------------------------------------------------------------------------


def serve(server: ControlServer, frame: bytes, peer: Connection, now: float = 1.0) -> Any:
    """What the learner does with a control frame: decode (a rejection is counted and answered
    ``rejoin``), then serve; the decoded reply."""
    try:
        message = decode_message(frame, max_bytes=2**20)
    except MessageRejected as error:
        return decode_message(server.undecodable(error), max_bytes=2**20)
    [(_, reply)] = server.reply(message, now, identity=peer.routing_id, peer=peer)
    return decode_message(reply, max_bytes=2**24)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_join_never_takes_over_a_live_actors_id_from_another_connection(
    make_server, curve: bool
) -> None:
    """Neither another connection on the same host (plain), nor one holding the same, shared actor
    key or another key (CURVE), nor the victim's routing id from another key: the victim keeps its
    id, index and incarnation, and its heartbeats are still answered ``ok``."""
    server = make_server(num_actors=2)
    server.peers.user_ids = curve
    key = "actor-key" if curve else ""
    victim = Connection(b"victim-routing-id", "127.0.0.1", key)
    thieves = [Connection(b"thief", "127.0.0.1", key)]  # same host; with CURVE the shared actor key
    if curve:
        thieves += [
            Connection(b"thief", "127.0.0.1", "other-key"),
            Connection(b"victim-routing-id", "127.0.0.1", "other-key"),
        ]
    assert join(server, "victim", peer=victim)[0][1].accepted
    for attempt in range(20):  # one join every 0.4 s for 8 s, as the abuse run did
        thief = thieves[attempt % len(thieves)]
        [(_, reply)] = join(server, "victim", peer=thief, incarnation=f"thief-{attempt}")
        assert not reply.accepted and reply.reason.startswith(ACTOR_ID_IN_USE)
    record = server.assembler.actors["victim"]
    assert (record.incarnation, record.index) == ("inc-victim", 0)
    assert server.counters.rejected["impersonation"] == 20 and server.counters.accepted["join"] == 1
    assert heartbeat(server, "victim", peer=victim).status == "ok"


def test_a_join_asked_again_is_answered_again_with_its_index_and_said_once(make_server) -> None:
    """The copies of one join (one incarnation, one connection: asked again while the learner was
    busy) are each answered with the same index; the log says the actor joined once."""
    said: list[str] = []

    class Notices:
        def event(self, reason: str, text: str, *, level: int = logging.INFO) -> None:
            said.append(reason)

    server = make_server()
    server.notices = Notices()
    join(server, "other")
    replies = [join(server, "a")[0][1] for _ in range(3)]
    assert all(r.accepted for r in replies) and {r.actor_index for r in replies} == {1}
    assert said.count("join") == 2 and set(server.assembler.actors) == {"other", "a"}


def test_a_connection_whose_routing_id_zeromq_generated_speaks_for_no_actor(make_server) -> None:
    """The unread join of an actor's earlier connection, handed a generated routing id when the actor
    reconnected (or a client that set none): refused and counted as ``anonymous_connection``, never
    bound, so the actor's live connection joins at once; its heartbeat for a joined actor is not
    counted as impersonation and leaves the actor in place."""
    server = make_server()
    stale = Connection(b"\x00\x6b\x8b\x45\x67", "127.0.0.1", "")
    [(_, refused)] = join(server, "a", peer=stale)
    assert not refused.accepted and refused.reason == ANONYMOUS_REFUSAL
    assert "a" not in server.assembler.actors and "a" not in server.peers.peers
    [(_, accepted)] = join(server, "a")  # the live connection, same incarnation
    assert accepted.accepted and server.counters.rejected["anonymous_connection"] == 1
    assert heartbeat(server, "a", peer=stale).status == "rejoin"
    assert heartbeat(server, "a").status == "ok" and set(server.assembler.actors) == {"a"}
    assert (
        server.counters.rejected["anonymous_connection"] == 2
        and server.counters.rejected["impersonation"] == 0
    )


def test_a_leave_or_heartbeat_with_a_stolen_incarnation_from_the_same_host_is_refused(
    make_server,
) -> None:
    """Another connection on 127.0.0.1 that knows the victim's incarnation: refused, counted as
    impersonation; the victim stays, and its own leave still works."""
    server = make_server()
    victim, thief = own("victim"), THIEF
    join(server, "victim", peer=victim)
    stolen = Heartbeat("victim", "inc-victim", 5, 3, 1e6, 0.0, 10_000)
    assert serve(server, encode_leave(Leave("victim", "inc-victim")), thief).status == "rejoin"
    assert serve(server, encode_heartbeat(stolen), thief).status == "rejoin"
    assert server.counters.rejected["impersonation"] == 2
    assert (
        "victim" in server.assembler.actors
        and server.assembler.actors["victim"].env_steps_per_second == 0.0
    )
    assert serve(server, encode_leave(Leave("victim", "inc-victim")), victim).status == "stop"
    assert "victim" not in server.assembler.actors


def test_a_heartbeat_with_a_negative_rate_is_rejected_counted_and_telemetry_still_builds(
    make_server,
) -> None:
    """``env_steps_per_second = -1.0`` is a valid float on the wire; the telemetry schema refuses it, so
    it must never reach the actor's record (the learner would exit on its next snapshot)."""
    server = make_server()
    join(server, "a")
    forged = pack(
        {
            **header("heartbeat"),
            "actor_id": "a",
            "incarnation": "inc-a",
            "seq": 0,
            "policy_version": 3,
            "env_steps_per_second": -1.0,
            "policy_lag": 0.0,
            "episodes": 0,
        }
    )
    assert serve(server, forged, own("a")).status == "rejoin"
    lag = pack(
        {
            **header("heartbeat"),
            "actor_id": "a",
            "incarnation": "inc-a",
            "seq": 0,
            "policy_version": 3,
            "env_steps_per_second": 10.0,
            "policy_lag": -5.0,
            "episodes": 0,
        }
    )
    assert serve(server, lag, own("a")).status == "rejoin"
    assert server.counters.rejected["value_range"] == 2
    assert (
        server.assembler.actors["a"].env_steps_per_second == 0.0
        and server.assembler.actors["a"].policy_lag == 0.0
    )
    telemetry = LearnerTelemetry("run", "CartPole-v1", started=0.0, start_steps=0)
    snapshot = telemetry.snapshot(
        server.assembler,
        policy_version=3,
        iterations=0,
        episodes=0,
        learning_rate=1e-3,
        checkpoint_failures=0,
        log_write_failures=0,
        is_update=False,
    )
    assert [a.sps for a in snapshot.actors] == [0.0] and snapshot.rejected_messages[
        "value_range"
    ] == 2
    with pytest.raises(ValueError, match="env_steps_per_second"):
        encode_heartbeat(
            Heartbeat("a", "inc-a", 0, 3, -1.0, 0.0, 0)
        )  # our own actors never send one


def test_a_join_asking_for_65536_envs_is_refused_before_a_step_ring_is_made(make_server) -> None:
    offered: list[str] = []
    server = make_server(
        host_id="here", offer_ring=lambda request, spec: offered.append(request.actor_id)
    )
    [(_, reply)] = join(server, "greedy", num_envs=65_536, host_id="here")
    assert (
        not reply.accepted and "max_envs_per_actor=1024" in reply.reason and "65536" in reply.reason
    )
    assert offered == [] and server.assembler.actors == {}
    assert server.counters.rejected["value_range"] == 1
    wide = make_server(
        envs_per_actor=2048, num_envs=2048
    )  # the cap is never below the run's own actors
    assert join(wide, "wide", num_envs=2048)[0][1].accepted


def test_joins_of_new_actor_ids_stop_at_max_connected_actors(make_server) -> None:
    server = make_server(max_connected_actors=2)
    assert join(server, "a")[0][1].accepted and join(server, "b")[0][1].accepted
    [(_, refused)] = join(server, "c")
    assert not refused.accepted and "max_connected_actors=2" in refused.reason
    assert join(server, "a", incarnation="inc-a2")[0][1].accepted, "a connected actor may rejoin"


def test_a_join_floods_log_lines_are_bounded(make_server, caplog: pytest.LogCaptureFixture) -> None:
    """300 joins in 3 s (fake clock), new ids and takeover attempts: at most the burst, one first
    line per reason and one summary per 5 s reach the log; every join is still counted."""
    clock = [0.0]
    logger = logging.getLogger("oakemu.learner")
    notices = RateLimitedLog(
        logger,
        "actor events",
        first_prefix="",
        verb="skipped the lines of",
        level=logging.INFO,
        burst=8,
        clock=lambda: clock[0],
    )
    rejections = RateLimitedLog(
        logger, "control messages", first_prefix="rejected control message", clock=lambda: clock[0]
    )
    server = make_server(max_connected_actors=100)
    server.notices, server.rejections = notices, rejections
    with caplog.at_level(logging.INFO, logger="oakemu.learner"):
        for i in range(300):
            clock[0] = i / 100
            join(
                server,
                f"flood-{i}" if i % 2 else "flood-1",
                peer=Connection(b"x%d" % i, "127.0.0.1", ""),
            )
        clock[0] = 10.0
        notices.flush()
        rejections.flush()
    lines = [r.getMessage() for r in caplog.records if r.name == "oakemu.learner"]
    # notices: 1 first + 8 burst + 1 summary; rejections: 2 firsts (impersonation, value_range) + 1 summary
    assert len(lines) <= 13, lines
    assert notices.events + rejections.events == 300
    assert (
        server.counters.accepted["join"]
        + server.counters.rejected["impersonation"]
        + server.counters.rejected["value_range"]
        + server.counters.rejected["join_rate"]
        == 300
    )


# --- weights asked for on the control socket, held joins told why they wait, joins per host -------


def ask_weights(
    server: ControlServer,
    actor_id: str,
    *,
    incarnation: str | None = None,
    peer: Any = None,
    stopping: bool = False,
) -> Any:
    message = WeightsRequest(actor_id, incarnation or f"inc-{actor_id}")
    [(_, reply)] = decoded(
        server.reply(message, 1.0, identity=actor_id, peer=peer or own(actor_id), stopping=stopping)
    )
    return reply


def test_a_joined_actor_asking_for_the_weights_gets_the_current_ones_on_the_control_socket(
    make_server,
) -> None:
    """What an actor whose weights channel missed publications asks (a WeightsRequest): the weights
    the learner published last, each version encoded once; only its own incarnation from its own
    connection; ``rejoin`` for an unknown incarnation, ``stop`` while stopping."""
    server = make_server()
    join(server, "a")
    reply = ask_weights(server, "a")
    assert isinstance(reply, WeightsMessage) and (reply.policy_version, reply.revision) == (3, 0)
    np.testing.assert_array_equal(reply.weights["w"], WEIGHTS["w"])
    server.publish(9, {"w": np.full(3, 2.0, np.float32)})
    newer = ask_weights(server, "a")
    assert newer.policy_version == 9 and newer.weights["w"].tolist() == [2.0, 2.0, 2.0]
    assert server.counters.accepted["weights_request"] == 2
    assert ask_weights(server, "a", incarnation="old") == HeartbeatReply("rejoin", 9)
    assert ask_weights(server, "nobody") == HeartbeatReply("rejoin", 9)
    assert ask_weights(server, "a", peer=THIEF) == HeartbeatReply("rejoin", 9)
    assert (
        server.counters.rejected["impersonation"] == 1
        and server.counters.accepted["unknown_actor_control"] == 2
    )
    assert ask_weights(server, "a", stopping=True).status == "stop"
    round_trip = decode_message(
        encode_weights_request(WeightsRequest("a", "inc-a")), max_bytes=1024
    )
    assert round_trip == WeightsRequest("a", "inc-a")


class Notices:
    """A ``notices`` log that keeps ``(reason, text)`` of every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, reason: str, text: str, *, level: int = logging.INFO) -> None:
        self.events.append((reason, text))


def test_a_resumed_sync_run_tells_its_one_actor_that_it_waits_for_the_planned_second(
    make_server,
) -> None:
    """``docker compose stop`` then ``up --scale actor=1`` on a run planned for 2 actors: the join is
    held up to START_GRACE_S for the second, and meanwhile answered every JOIN_WAIT_NOTICE_S with why
    (a join reply with retry_after_s 0: the actor asks again at once), never left silent long enough
    for the actor to count the learner as unreachable (2 s); the learner logs the same reason, and
    that the rollout starts with fewer actors than planned."""
    server = make_server(mode="sync", num_actors=2, envs_per_actor=2)
    server.notices = notices = Notices()
    asked = JoinRequest("solo", "inc-solo", 2, "host")
    now = 0.0
    assert server.reply(asked, now, identity="ask-0", peer=own("solo")) == []  # held
    [(reason, said)] = notices.events
    assert reason == "sync_wait" and "waiting for 1 more actor(s) to join (up to 30 s" in said
    answers = []
    while now < START_GRACE_S + 1.0:
        now += 0.1
        replies = decoded(server.tick(now))
        if (
            replies
        ):  # the answer to the outstanding ask; the actor asks again at once, until granted
            answers.append((now, replies))
            if replies[0][1].accepted:
                break
            server.reply(asked, now, identity=f"ask-{len(answers)}", peer=own("solo"))
    *waits, (granted_at, [(to, grant)]) = answers
    assert (
        grant.accepted
        and grant.actor_index == 0
        and START_GRACE_S <= granted_at < START_GRACE_S + 0.2
    )
    assert to == f"ask-{len(waits)}", "the grant answers the newest ask"
    times = [0.0] + [at for at, _ in waits] + [granted_at]
    assert max(b - a for a, b in zip(times, times[1:])) <= JOIN_WAIT_NOTICE_S + 0.1 < 2.0
    for _, [(to, wait)] in waits:
        assert not wait.accepted and wait.retry_after_s == 0.0 and wait.actor_index == -1
        assert "waiting for 1 more actor(s) to join (up to 30 s" in wait.reason
    assert "1 s left" in waits[-1][1][0][1].reason
    assert (
        "sync_start",
        "mode='sync': the first rollout starts with 1 of 2 planned actors (30 s passed)",
    ) in notices.events
    assert server.counters.accepted["join"] == len(answers), "each ask counted when it arrives"


def test_joins_beyond_a_hosts_rate_are_told_when_to_retry_and_counted(make_server) -> None:
    """A token bucket per peer host: JOIN_BURST_PER_HOST joins at once, then JOINS_PER_SECOND_PER_HOST;
    each join beyond is answered "too many joins, retry in X s" (retry_after_s X), counted, and makes
    no step ring; another host is not slowed; a join asked again by an incarnation that joined takes no
    token; after the wait the actor gets in."""
    offered: list[str] = []

    def offer(request: JoinRequest, spec: Any) -> StepRingOffer:
        offered.append(request.actor_id)
        return StepRingOffer("oakemu_test_stepring", "0" * 16, 2)

    server = make_server(host_id="here", offer_ring=offer, max_connected_actors=1000)
    flood = Connection(b"flood", "10.0.0.9", "")

    def join_from(host_peer: Connection, name: str, now: float) -> JoinReply:
        message = JoinRequest(name, f"inc-{name}", 2, "host", host_id="here")
        peer = Connection(name.encode(), host_peer.address, "")
        [(_, reply)] = decoded(server.reply(message, now, identity=name, peer=peer))
        return reply

    replies = [join_from(flood, f"f{i}", 0.0) for i in range(JOIN_BURST_PER_HOST + 8)]
    assert all(r.accepted for r in replies[:JOIN_BURST_PER_HOST])
    throttled = replies[JOIN_BURST_PER_HOST:]
    assert all(
        not r.accepted
        and r.retry_after_s == pytest.approx(1 / JOINS_PER_SECOND_PER_HOST)
        and r.reason
        == f"too many joins from host 10.0.0.9: retry in {1 / JOINS_PER_SECOND_PER_HOST:.1f} s"
        for r in throttled
    )
    assert server.counters.rejected["join_rate"] == 8 and len(offered) == JOIN_BURST_PER_HOST
    assert join_from(Connection(b"x", "10.0.0.10", ""), "other-host", 0.0).accepted
    assert join_from(flood, "f0", 0.0).accepted, (
        "a join asked again by a joined incarnation is not throttled"
    )
    later = join_from(flood, f"f{JOIN_BURST_PER_HOST}", throttled[0].retry_after_s)
    assert later.accepted and server.counters.rejected["join_rate"] == 8


def test_anonymous_and_impersonating_joins_use_none_of_their_hosts_join_allowance(
    make_server,
) -> None:
    """Refused as anonymous_connection or impersonation first: never counted as join_rate, and the host's
    actors still get their whole burst."""
    server = make_server(max_connected_actors=1000)
    host = "10.0.0.9"
    assert join(server, "victim", peer=Connection(b"victim", host, ""))[0][1].accepted
    stale = Connection(b"\x00\x6b\x8b\x45\x67", host, "")
    thief = Connection(b"thief", host, "")
    for i in range(JOIN_BURST_PER_HOST):
        assert not join(server, f"anon{i}", peer=stale)[0][1].accepted
        assert not join(server, "victim", peer=thief, incarnation=f"inc-thief{i}")[0][1].accepted
    assert server.counters.rejected["anonymous_connection"] == JOIN_BURST_PER_HOST
    assert server.counters.rejected["impersonation"] == JOIN_BURST_PER_HOST
    assert server.counters.rejected["join_rate"] == 0
    joined = [
        join(server, f"a{i}", peer=Connection(f"a{i}".encode(), host, ""))[0][1]
        for i in range(JOIN_BURST_PER_HOST - 1)
    ]  # the burst less the victim's join
    assert all(reply.accepted for reply in joined) and server.counters.rejected["join_rate"] == 0


def test_a_join_reply_s_retry_after_is_checked_on_both_ends() -> None:
    wait = JoinReply(False, "waiting", -1, None, {}, 0, retry_after_s=0.5)
    assert decode_message(encode_join_reply(wait), max_bytes=1024).retry_after_s == 0.5
    for bad in (-1.0, MAX_RETRY_AFTER_S + 1, float("nan")):
        with pytest.raises(ValueError, match="retry_after_s"):
            encode_join_reply(replace(wait, retry_after_s=bad))
    with pytest.raises(ValueError, match="retry_after_s"):
        encode_join_reply(replace(wait, accepted=True, retry_after_s=0.0))
    forged = pack(
        {
            **header("join_reply"),
            "accepted": False,
            "reason": "",
            "actor_index": -1,
            "spec": None,
            "env_config": {},
            "policy_version": 0,
            "weights": {},
            "step_ring": None,
            "retry_after_s": -5.0,
        }
    )
    with pytest.raises(MessageRejected, match="retry_after_s"):
        decode_message(forged, max_bytes=1024)
