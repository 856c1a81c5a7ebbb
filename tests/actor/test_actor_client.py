"""The actor's side of the control protocol (oakemu_core/actor/client.py), without a learner: join,
heartbeats and leave against a scripted control channel, the ring attach and the weights socket
(what a join reply sets up: tests/actor/test_join_setup.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import zmq

from oakemu_core.actor import client
from oakemu_core.actor.client import (
    ActorSetupError,
    ControlChannel,
    LearnerClient,
    LearnerUnreachable,
    newest_message,
    subscribe_weights,
)
from oakemu_core.transport import keepalive
from oakemu_core.transport.control import (
    ACTOR_ID_IN_USE,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    StopNotice,
    WeightsMessage,
    WeightsRequest,
    decode_message,
    encode_heartbeat_reply,
    encode_stop,
    encode_weights,
)
from oakemu_core.transport.step_ring import StepRing, StepRings
from tests.transport.test_wire import ATARI_SPEC

MAX_BYTES = 1 << 20
REQUEST = JoinRequest("actor-0", "", 2, "host", "boot/1", "float32")


class Recorder:
    """A :class:`~oakemu_core.actor.client.RetryReport` that counts its calls."""

    def __init__(self) -> None:
        self.attempts = 0
        self.successes = 0

    def attempt(self) -> None:
        self.attempts += 1

    def succeeded(self) -> None:
        self.successes += 1


class ScriptedControl:
    """A control channel that answers each request with the next scripted reply (None: no answer)."""

    address = "tcp://learner:5556"
    connected = False

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.requests: list[Any] = []

    def request(self, frame: bytes, timeout_s: float = 2.0) -> Any:
        self.requests.append(decode_message(frame, max_bytes=MAX_BYTES))
        return self.replies.pop(0) if self.replies else None


def accepted(**changes: Any) -> JoinReply:
    return replace(JoinReply(True, "", 3, ATARI_SPEC, {"env_id": "X", "seed": 1}, 5), **changes)


def learner_client(
    control: ScriptedControl, patience_s: float = 10.0
) -> tuple[LearnerClient, Recorder]:
    silence = Recorder()
    return LearnerClient(control, REQUEST, patience_s=patience_s, silence=silence), silence


def test_join_asks_again_until_the_learner_answers_as_a_fresh_incarnation() -> None:
    control = ScriptedControl(None, accepted(), accepted())
    learner, _ = learner_client(control)
    reporter = Recorder()
    reply = learner.join(threading.Event(), reporter)
    assert reply.accepted and reply.actor_index == 3
    assert (reporter.attempts, reporter.successes) == (2, 1)
    first = learner.incarnation
    assert len(first) == 32 and [r.incarnation for r in control.requests] == [first, first]
    assert control.requests[0] == replace(REQUEST, incarnation=first)
    learner.join(threading.Event(), Recorder())
    assert learner.incarnation != first and control.requests[-1].incarnation == learner.incarnation


def test_a_refused_join_is_a_setup_error_and_a_stop_interrupts_the_wait() -> None:
    refused = ScriptedControl(JoinReply(False, "run is full", -1, None, {}, 0))
    with pytest.raises(ActorSetupError, match="run is full"):
        learner_client(refused)[0].join(threading.Event(), Recorder())
    stop = threading.Event()
    stop.set()
    with pytest.raises(KeyboardInterrupt):
        learner_client(ScriptedControl())[0].join(stop, Recorder())


def test_a_join_refused_because_the_id_is_in_use_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner still holds the id for this actor's previous process (until it times out): the
    actor asks again with the same incarnation instead of giving up as for other refusals."""
    monkeypatch.setattr(client, "REQUEST_TIMEOUT_S", 0.01)
    in_use = JoinReply(
        False, f"{ACTOR_ID_IN_USE} (until that actor leaves or times out)", -1, None, {}, 0
    )
    control = ScriptedControl(in_use, in_use, accepted())
    learner, _ = learner_client(control)
    assert learner.join(threading.Event(), Recorder()).accepted
    assert len(control.requests) == 3 and len({r.incarnation for r in control.requests}) == 1


def test_a_learner_that_never_answers_a_join_is_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error names the address, and where a connection was made but nothing answered, the likely
    cause (a learner older than the actor drops its requests unanswered)."""
    monkeypatch.setattr(client, "JOIN_PATIENCE_S", 0.0)
    learner, _ = learner_client(ScriptedControl(), patience_s=0.0)
    with pytest.raises(LearnerUnreachable, match="learner:5556 for 0 s$"):
        learner.join(threading.Event(), Recorder())
    silent = ScriptedControl()
    silent.connected = True
    with pytest.raises(LearnerUnreachable, match="upgrade the learner first"):
        learner_client(silent, patience_s=0.0)[0].join(threading.Event(), Recorder())


def wait_reply(reason: str, retry_after_s: float) -> JoinReply:
    return JoinReply(False, reason, -1, None, {}, 0, retry_after_s=retry_after_s)


def test_a_join_told_to_wait_logs_why_instead_of_no_answer_and_asks_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A synchronous learner holding the join for its planned actors answers "waiting for N more
    actors (up to 30 s)" (retry_after_s 0): the actor logs that reason once (not every answer), reports
    no attempt to reach a silent learner after the first, asks again with the same incarnation at once,
    and the answers do not count against its patience (here 0 s)."""
    monkeypatch.setattr(client, "JOIN_PATIENCE_S", 0.0)
    waiting = wait_reply(
        "mode='sync': waiting for 1 more actor(s) to join (up to 30 s, 29 s left)", 0.0
    )
    control = ScriptedControl(*[waiting] * 5, accepted())
    learner, _ = learner_client(control, patience_s=0.0)
    reporter = Recorder()
    with caplog.at_level("INFO", logger="oakemu.actor"):
        assert learner.join(threading.Event(), reporter).accepted
    assert len(control.requests) == 6 and len({r.incarnation for r in control.requests}) == 1
    assert reporter.attempts == 1, "the learner answered every ask: nothing to report as silence"
    said = [r.getMessage() for r in caplog.records if "waiting for 1 more actor" in r.getMessage()]
    assert said == [
        "actor actor-0: the learner answered: mode='sync': waiting for 1 more actor(s) to join "
        "(up to 30 s, 29 s left)"
    ]


def test_a_join_of_a_host_over_its_join_rate_backs_off_for_the_time_the_learner_names() -> None:
    throttled = wait_reply("too many joins from host 10.0.0.9: retry in 0.2 s", 0.2)
    control = ScriptedControl(throttled, throttled, accepted())
    asked_at: list[float] = []
    request = control.request

    def timed(frame: bytes, timeout_s: float = 2.0) -> Any:
        asked_at.append(time.monotonic())
        return request(frame, timeout_s)

    control.request = timed
    learner, _ = learner_client(control)
    assert learner.join(threading.Event(), Recorder()).accepted
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    assert len(gaps) == 2 and all(
        0.2 <= gap < 0.2 * (1 + client.RETRY_JITTER) + 0.2 for gap in gaps
    ), gaps


def test_fetch_weights_asks_on_the_control_socket_and_returns_only_weights() -> None:
    weights = WeightsMessage(9, {"w": np.ones(2, np.float32)})
    control = ScriptedControl(accepted(), weights, HeartbeatReply("rejoin", 9), None)
    learner, _ = learner_client(control)
    learner.join(threading.Event(), Recorder())
    assert learner.fetch_weights() is weights
    assert control.requests[-1] == WeightsRequest("actor-0", learner.incarnation)
    assert learner.fetch_weights() is None, "rejoin: the next heartbeat acts on it"
    assert learner.fetch_weights() is None, "no answer"


def test_heartbeats_report_silence_and_give_up_after_the_patience() -> None:
    control = ScriptedControl(accepted(), HeartbeatReply("ok", 7), None)
    learner, silence = learner_client(control, patience_s=0.2)
    learner.join(threading.Event(), Recorder())
    assert learner.heartbeat(4, 5, 100.0, 2.0, 1) == HeartbeatReply("ok", 7)
    sent = control.requests[-1]
    assert (sent.incarnation, sent.seq, sent.policy_version, sent.policy_lag, sent.episodes) == (
        learner.incarnation,
        4,
        5,
        2.0,
        1,
    )
    assert learner.heartbeat(5, 5, 100.0, 2.0, 1) is None and silence.attempts == 1
    time.sleep(0.3)
    with pytest.raises(LearnerUnreachable, match="silent"):
        learner.heartbeat(5, 5, 100.0, 2.0, 1)


def test_leave_names_the_incarnation_and_only_after_a_join() -> None:
    control = ScriptedControl(accepted())
    learner, _ = learner_client(control)
    learner.leave()
    assert control.requests == []
    learner.join(threading.Event(), Recorder())
    learner.leave()
    assert control.requests[-1] == Leave("actor-0", learner.incarnation)


def test_the_offered_ring_is_attached_when_reachable_else_the_arrays_go_inline() -> None:
    learner, _ = learner_client(ScriptedControl())
    assert learner.attach_ring(accepted()) is None
    rings = StepRings()
    try:
        offer = rings.offer("actor-0", "inc", ATARI_SPEC, 16)
        ring = learner.attach_ring(accepted(step_ring=offer))
        assert isinstance(ring, StepRing) and ring.slots == offer.slots
        ring.close()
        elsewhere = StepRingOffer(
            f"{offer.name}x", offer.token, offer.slots
        )  # as in another /dev/shm
        assert learner.attach_ring(accepted(step_ring=elsewhere)) is None
    finally:
        rings.close()


def test_the_control_channel_decodes_replies_and_keeps_its_socket_after_a_timeout() -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://control")
    answers = [encode_heartbeat_reply(HeartbeatReply("stop", 2)), b"not msgpack"]
    envelopes: list[list[bytes]] = []

    def serve() -> None:
        for answer in answers:
            *envelope, _ = (
                router.recv_multipart()
            )  # [routing id, request id, empty]: echoed as the learner does
            envelopes.append(envelope)
            router.send_multipart([*envelope, answer])

    server = threading.Thread(target=serve)
    server.start()
    control = ControlChannel(context, "inproc://control", MAX_BYTES)
    try:
        assert control.request(b"hello") == HeartbeatReply("stop", 2)
        assert control.request(b"hello") is None  # malformed reply
        server.join()
        socket = control.socket
        assert control.request(b"hello", timeout_s=0.05) is None and control.socket is socket
        assert control.connected  # sent on the connection, unanswered
        nobody = ControlChannel(context, f"tcp://127.0.0.1:{free_tcp_port()}", MAX_BYTES)
        assert nobody.request(b"hello", timeout_s=0.05) is None and not nobody.connected
        nobody.close()
        assert [len(e) for e in envelopes] == [3, 3] and envelopes[0][1] != envelopes[1][1]
        assert all(e[0] == control.routing_id and len(e[1]) == 4 and e[2] == b"" for e in envelopes)
    finally:
        control.close()
        router.close(linger=0)
        context.destroy(linger=0)


def test_a_reply_to_an_unanswered_request_is_dropped_and_the_newest_is_answered() -> None:
    """After a timeout the channel asks again on the same connection (one routing id, a secret of
    the channel); a late reply to the first request is not taken as the answer to the second."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.bind("inproc://control-ids")
    control = ControlChannel(context, "inproc://control-ids", MAX_BYTES)
    try:
        assert control.request(b"unanswered", timeout_s=0.05) is None
        *first, body = router.recv_multipart()
        assert body == b"unanswered"
        replies: list[Any] = []
        asker = threading.Thread(
            target=lambda: replies.append(control.request(b"again", timeout_s=5.0))
        )
        asker.start()
        assert router.poll(5000)
        *second, body = router.recv_multipart()
        assert body == b"again"
        router.send_multipart(
            [*first, encode_heartbeat_reply(HeartbeatReply("stop", 1))]
        )  # late: dropped
        router.send_multipart([*second, encode_heartbeat_reply(HeartbeatReply("ok", 2))])
        asker.join()
        assert replies == [HeartbeatReply("ok", 2)]
        assert (
            first[0] == second[0] == control.routing_id
            and len(first[0]) == 16
            and first[1] != second[1]
        )
        assert ControlChannel(context, "inproc://control-ids", MAX_BYTES).routing_id != first[0]
    finally:
        control.close()
        router.close(linger=0)
        context.destroy(linger=0)


class QuickControl(ControlChannel):
    """A control channel whose requests time out after 0.1 s (the join loop uses the default)."""

    def request(self, frame: bytes, timeout_s: float = 0.1) -> Any:
        return super().request(frame, timeout_s)


def free_tcp_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_joins_asked_while_the_learner_is_bound_but_busy_all_come_from_the_actors_connection() -> (
    None
):
    """A learner that binds its sockets before a slow start (a GPU's initialisation, a checkpoint)
    reads the join asked several times at once: every copy comes from the actor's one connection, so
    the peer binding takes each (no impersonation) and the actor gets the answer to its newest copy."""
    from oakemu_core.transport.auth import PeerBinding
    from oakemu_core.transport.control import encode_join_reply
    from services.learner import is_request_envelope

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    router.bind(address)
    learner = LearnerClient(
        QuickControl(context, address, MAX_BYTES), REQUEST, patience_s=10.0, silence=Recorder()
    )
    replies: list[JoinReply] = []
    joiner = threading.Thread(
        target=lambda: replies.append(learner.join(threading.Event(), Recorder()))
    )
    try:
        joiner.start()
        time.sleep(0.8)  # busy: the join is asked again every 0.1 s meanwhile
        peers, answered = PeerBinding(user_ids=False), 0
        while joiner.is_alive() and router.poll(2000):
            parts = router.recv_multipart(copy=False)
            assert is_request_envelope(parts)
            request = decode_message(parts[-1].bytes, max_bytes=MAX_BYTES)
            assert peers.bind(
                request.actor_id, request.incarnation, peers.connection(parts[0], parts[-1])
            )
            answered += 1
            router.send_multipart([*parts[:-1], encode_join_reply(accepted(actor_index=answered))])
            time.sleep(0.01)  # the joiner may take the answer before the next copy is read
        joiner.join(5.0)
        assert answered >= 3 and not peers.refused
        assert replies[0].accepted and 1 <= replies[0].actor_index <= answered
        assert router.poll(500) == 0 or not joiner.is_alive()
    finally:
        learner.control.close()
        router.close(linger=0)
        context.destroy(linger=0)


def test_no_request_piles_up_while_no_learner_listens() -> None:
    """Requests queue only on a completed connection: a join asked for a while before the learner
    binds reaches it once, not once per attempt."""
    from oakemu_core.transport.control import encode_join_reply

    context = zmq.Context()
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    learner = LearnerClient(
        QuickControl(context, address, MAX_BYTES), REQUEST, patience_s=10.0, silence=Recorder()
    )
    replies: list[JoinReply] = []
    joiner = threading.Thread(
        target=lambda: replies.append(learner.join(threading.Event(), Recorder()))
    )
    router = context.socket(zmq.ROUTER)
    try:
        joiner.start()
        time.sleep(0.6)  # 0.1 s per attempt: about 6 attempts with no learner
        router.bind(address)
        assert router.poll(5000)
        *envelope, _ = router.recv_multipart()
        router.send_multipart([*envelope, encode_join_reply(accepted())])
        joiner.join(5.0)
        assert replies and replies[0].accepted
        assert router.poll(300) == 0  # no earlier attempt was queued to arrive now
    finally:
        learner.control.close()
        router.close(linger=0)
        context.destroy(linger=0)


class FreezingProxy:
    """A TCP proxy to ``port`` on 127.0.0.1 whose :meth:`freeze` stops forwarding on the connections
    open now, closing nothing (a half-open path: a stale NAT entry), while new ones pass."""

    def __init__(self, port: int) -> None:
        import socket

        self.port_to, self.frozen, self.accepted, self.closed = port, set(), 0, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[Any, Any]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.closed:
            try:
                client_side, _ = self.listener.accept()
            except OSError:
                return
            pair = (client_side, socket.create_connection(("127.0.0.1", self.port_to)))
            self.pairs.append(pair)
            self.accepted += 1
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair: tuple[Any, Any]) -> None:
        import select

        try:
            while not self.closed:
                if id(pair) in self.frozen:
                    time.sleep(0.05)
                    continue
                readable, _, _ = select.select(list(pair), [], [], 0.05)
                for source in readable:
                    data = source.recv(65536) if id(pair) not in self.frozen else b""
                    if not data and id(pair) not in self.frozen:
                        return
                    (pair[1] if source is pair[0] else pair[0]).sendall(data)
        except OSError:  # closed by close()
            return

    def freeze(self) -> None:
        self.frozen |= {id(pair) for pair in self.pairs}

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for pair in self.pairs:
            for sock in pair:
                sock.close()


def test_the_control_channel_heals_a_connection_that_went_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A control connection that stops carrying bytes without closing (a half-open path) answers no
    connection heartbeat: it is closed and made again, and the next request is answered through the
    new one instead of the actor waiting until TCP gives up."""
    monkeypatch.setattr(keepalive, "HEARTBEAT_IVL_MS", 100)
    monkeypatch.setattr(keepalive, "HEARTBEAT_TIMEOUT_MS", 500)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    proxy = FreezingProxy(router.bind_to_random_port("tcp://127.0.0.1"))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                *envelope, _ = router.recv_multipart()
                router.send_multipart([*envelope, encode_heartbeat_reply(HeartbeatReply("ok", 1))])

    server = threading.Thread(target=serve)
    server.start()
    control = ControlChannel(context, f"tcp://127.0.0.1:{proxy.port}", MAX_BYTES)
    try:
        assert control.request(b"first", timeout_s=5.0) == HeartbeatReply("ok", 1)
        proxy.freeze()
        deadline, reply = time.monotonic() + 8.0, None
        while reply is None and time.monotonic() < deadline:
            reply = control.request(b"again", timeout_s=0.5)
        assert reply == HeartbeatReply("ok", 1) and proxy.accepted == 2
    finally:
        stop.set()
        server.join()
        control.close()
        router.close(linger=0)
        proxy.close()
        context.destroy(linger=0)


@pytest.fixture
def weights_pub() -> Iterator[tuple[zmq.Context, zmq.Socket]]:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind("inproc://weights")
    yield context, pub
    pub.close(linger=0)
    context.destroy(linger=0)


def test_the_newest_weights_message_wins(weights_pub: tuple[zmq.Context, zmq.Socket]) -> None:
    context, pub = weights_pub
    sub = subscribe_weights(context, "inproc://weights")
    assert newest_message(sub, MAX_BYTES) is None
    deadline = time.monotonic() + 5
    while not sub.poll(10):  # a PUB drops what it sends before the SUB is connected
        pub.send(encode_weights(WeightsMessage(0, {"w": np.zeros(2, np.float32)})))
        assert time.monotonic() < deadline
    for version in (1, 2):
        pub.send(encode_weights(WeightsMessage(version, {"w": np.full(2, version, np.float32)})))
    time.sleep(0.05)
    newest = newest_message(sub, MAX_BYTES)
    assert isinstance(newest, WeightsMessage) and newest.policy_version == 2
    pub.send(b"garbage")
    time.sleep(0.05)
    assert newest_message(sub, MAX_BYTES) is None
    pub.send(encode_stop(StopNotice("done")))
    time.sleep(0.05)
    assert newest_message(sub, MAX_BYTES) == StopNotice("done")
