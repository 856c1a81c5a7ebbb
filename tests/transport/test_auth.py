"""Authenticated transport (ZeroMQ CURVE + ZAP) and actor identity bound to its connection, on real sockets.

Unit tests for the key files, then end-to-end tests with a real learner process:
- without CURVE, a second connection cannot leave, heartbeat or join for an actor that joined from
  127.0.0.1, not even from 127.0.0.1 with the actor's incarnation, nor step for it from another
  address (127.0.0.2): refused and counted as ``impersonation``; telemetry never shows the incarnation;
- with CURVE, an authorised actor trains, while an actor and a monitor without an authorised key are
  refused (counted as ``unauthorized_key``), never join and never receive weights or telemetry; a
  monitor key cannot join; a second connection with the same actor key cannot speak for an actor.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

from oakemu_core.run.telemetry import TelemetrySnapshot, TelemetrySubscriber
from oakemu_core.transport.auth import (
    Connection,
    PeerBinding,
    TransportSecurityError,
    generate_keypair,
    is_loopback,
    load_keypair,
    load_public_key,
    new_routing_id,
    public_tag,
    server_security,
)
from oakemu_core.transport.control import (
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    decode_message,
    encode_join_request,
    encode_leave,
)
from oakemu_core.transport.step_ring import StepRing, shared_memory_host_id
from oakemu_core.transport.steps import StepMessage, encode_step
from tests.e2e_helpers import E2EProcesses, Ports, common_flags, e2e_fixture, new_ports  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 64 * 2**20


# --- keys -------------------------------------------------------------------------------------------


def test_generate_keypair_writes_a_public_file_and_a_private_secret_file(tmp_path: Path) -> None:
    public, secret = generate_keypair(tmp_path / "keys", "actor")
    assert public.name == "actor.key" and secret.name == "actor.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair_public, pair_secret = load_keypair(secret)
    assert load_public_key(public) == pair_public and len(pair_secret) == 40
    with pytest.raises(TransportSecurityError, match="exists already"):
        generate_keypair(tmp_path / "keys", "actor")
    assert generate_keypair(tmp_path / "keys", "actor", overwrite=True)[0] == public
    assert load_public_key(public) != pair_public  # a new pair
    with pytest.raises(TransportSecurityError, match="holds no secret key"):
        load_keypair(public)
    with pytest.raises(TransportSecurityError, match="does not exist"):
        load_public_key(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_text("not a key\n")
    with pytest.raises(TransportSecurityError, match="not a ZeroMQ key file|holds no public key"):
        load_public_key(tmp_path / "junk.key")


def test_oakemu_keygen_cli_and_its_user_errors(tmp_path: Path) -> None:
    def keygen(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "oakemu_services.cli", "keygen", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = keygen("learner", "--dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "learner.key").is_file() and (tmp_path / "learner.key_secret").is_file()
    assert load_public_key(tmp_path / "learner.key").decode() in first.stdout
    again = keygen("learner", "--dir", str(tmp_path))
    assert (
        again.returncode == 2
        and "exists already" in again.stderr
        and "Traceback" not in again.stderr
    )
    bad = keygen("../escape", "--dir", str(tmp_path))
    assert bad.returncode == 2 and "plain file name" in bad.stderr and "Traceback" not in bad.stderr


def test_is_loopback() -> None:
    assert (
        is_loopback("127.0.0.1")
        and is_loopback("localhost")
        and is_loopback("::1")
        and is_loopback("127.3.2.1")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("learner")


def test_peer_binding_refuses_another_connection_and_counts() -> None:
    """Control requests are bound to the join's connection (routing id, address, CURVE key); step
    frames to its address and key (real frames carry the peer address; anything else has none)."""
    binding = PeerBinding()
    context = zmq.Context()
    try:
        pull = context.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        frames = {}
        for source in ("127.0.0.1", "127.0.0.2"):
            push = context.socket(zmq.PUSH)
            push.connect(f"tcp://{source}:0;127.0.0.1:{port}")
            push.send(source.encode())
            frame = pull.recv(copy=False)
            frames[frame.bytes.decode()] = frame
            push.close(linger=0)
        joined = binding.connection(b"actor-a", frames["127.0.0.1"])
        assert joined == Connection(b"actor-a", "127.0.0.1", "")
        same_host = binding.connection(b"other", frames["127.0.0.1"])
        assert binding.bind("a", "inc-1", joined)
        assert binding.allows_control("a", "inc-1", joined) and binding.allows(
            "a", "inc-1", frames["127.0.0.1"]
        )
        assert binding.bind("a", "inc-2", joined), "a rejoin from its own connection"
        assert not binding.allows_control(
            "a", "inc-2", same_host
        )  # a stolen incarnation, same host
        assert not binding.bind(
            "a", "inc-3", same_host
        )  # a join as a live actor from another connection
        assert not binding.allows("a", "inc-2", frames["127.0.0.2"])  # a step from another address
        assert binding.refused["impersonation"] == 3
        assert binding.allows(
            "unknown", "x", frames["127.0.0.2"]
        )  # unknown actors are the assembler's business
        binding.retain(set())
        assert binding.bind(
            "a", "inc-3", same_host
        )  # after the actor is gone, a new connection may use the id
    finally:
        context.destroy(linger=0)
    assert public_tag("inc-1") != "inc-1" and len(public_tag("inc-1")) == 12
    routing_ids = {new_routing_id() for _ in range(100)}
    assert len(routing_ids) == 100 and all(len(r) == 16 and r[0] != 0 for r in routing_ids)


def test_key_roles_a_monitor_key_cannot_join_an_actor_key_cannot_watch_and_identity_is_per_connection(
    tmp_path: Path,
) -> None:
    """Real CURVE sockets in this process: keys in ``actors/`` reach the control socket only, keys in
    ``monitors/`` the telemetry socket only, keys in the folder itself (the layout before roles) both;
    refusals are counted. Two connections with the same (shared) actor key are still two identities."""
    keys, authorised = tmp_path / "keys", tmp_path / "keys" / "authorized"
    for name in ("learner", "actor", "monitor", "legacy"):
        generate_keypair(keys, name)
    for name, folder in (
        ("actor", authorised / "actors"),
        ("monitor", authorised / "monitors"),
        ("legacy", authorised),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    server_key = load_public_key(keys / "learner.key")
    config = SimpleNamespace(
        curve=True,
        bind_host="127.0.0.1",
        curve_secret_key=keys / "learner.key_secret",
        curve_authorized_keys=authorised,
    )
    context = zmq.Context()
    security = server_security(context, config)
    clients: list[zmq.Socket] = []
    try:
        control = security.apply(context.socket(zmq.ROUTER))
        control_port = control.bind_to_random_port("tcp://127.0.0.1")
        telemetry = security.for_role("monitor").apply(context.socket(zmq.PUB))
        telemetry_port = telemetry.bind_to_random_port("tcp://127.0.0.1")

        def joins(name: str) -> tuple[Any, Any] | None:
            """Whether a join from a REQ socket with key ``name`` reaches the control socket: (identity, frame)."""
            req = secure(context.socket(zmq.REQ), keys, name, server_key)
            clients.append(req)
            req.connect(f"tcp://127.0.0.1:{control_port}")
            req.send(encode_join_request(JoinRequest("victim", f"inc-{name}", 2, "here")))
            if not control.poll(2000):
                return None
            identity, _, frame = control.recv_multipart(copy=False)
            return identity, frame

        def watches(name: str) -> bool:
            """Whether a SUB socket with key ``name`` receives what the telemetry socket publishes."""
            sub = secure(context.socket(zmq.SUB), keys, name, server_key)
            clients.append(sub)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{telemetry_port}")
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                telemetry.send(b"snapshot")
                if sub.poll(100):
                    return True
            return False

        assert joins("monitor") is None, "a monitor key joined as an actor"
        assert not watches("actor"), "an actor key read telemetry"
        assert watches("monitor") and watches("legacy")
        first, second, legacy = joins("actor"), joins("actor"), joins("legacy")
        assert first is not None and second is not None and legacy is not None
        assert security.refused == 2
        binding = PeerBinding(user_ids=True)
        victim, thief = (binding.connection(*first), binding.connection(*second))
        assert victim.user_id == thief.user_id == load_public_key(keys / "actor.key").decode()
        assert binding.bind("victim", "inc-actor", victim)
        assert not binding.bind("victim", "inc-thief", thief), (
            "the shared actor key took over a live actor's id"
        )
    finally:
        for client in (
            clients
        ):  # first: a refused client retries its handshake, which needs the authenticator
            client.close(linger=0)
        security.close()
        context.destroy(linger=0)


# --- end to end -------------------------------------------------------------------------------------


def learner_args(ports: Ports, runs_dir: Path, *extra: str) -> list[str]:
    """A CartPole learner for 1 actor x 2 envs that never reaches its budget; slow actor timeout. Async
    mode: the synthetic actors here join and never step (in sync mode a rollout would wait for them)."""
    return [
        "learner",
        "--env",
        "CartPole-v1",
        "--mode",
        "async",
        "--num-actors",
        "1",
        "--envs-per-actor",
        "2",
        "--rollout-length",
        "32",
        "--ppo-epochs",
        "2",
        "--num-minibatches",
        "2",
        "--total-env-steps",
        "100000000",
        "--checkpoint-every-updates",
        "0",
        "--eval-every-updates",
        "0",
        "--run-name",
        "auth",
        "--actor-timeout-s",
        "60",
        *common_flags(ports, runs_dir, *extra),
    ]


def valid_fields(reply: JoinReply) -> dict[str, np.ndarray]:
    """The arrays of a valid step (zeros, trainable) for the spec the learner sent in ``reply``."""
    assert reply.spec is not None
    fields = {
        name: np.zeros(shape, dtype) for name, (dtype, shape) in reply.spec.array_layout().items()
    }
    fields["trainable"] = np.ones_like(fields["trainable"])
    return fields


def request(sock: zmq.Socket, frame: bytes, timeout_s: float = 10.0) -> object:
    """Send one control request on a REQ socket and decode the reply (fails on silence)."""
    sock.send(frame)
    assert sock.poll(int(timeout_s * 1000)), "no reply from the learner"
    return decode_message(sock.recv(), max_bytes=MAX_BYTES)


def wait_snapshot(
    subscriber: TelemetrySubscriber, predicate, timeout_s: float, what: str, why=lambda: ""
) -> TelemetrySnapshot:
    """The first telemetry snapshot satisfying ``predicate``; fails with the latest one after ``timeout_s``."""
    deadline, latest = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        snapshot = subscriber.receive(timeout_s=1.0)
        if snapshot is not None:
            latest = snapshot
            if predicate(snapshot):
                return snapshot
    raise AssertionError(f"timed out waiting for {what}; latest {latest}\n{why()}")


def secure(sock: zmq.Socket, keys: Path, name: str, server: bytes) -> zmq.Socket:
    """Make ``sock`` a CURVE client with the key pair ``keys/name.key_secret``."""
    sock.curve_publickey, sock.curve_secretkey = load_keypair(keys / f"{name}.key_secret")
    sock.curve_serverkey = server
    return sock


@pytest.mark.slow
def test_a_second_connection_cannot_leave_step_or_join_for_an_actor(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    runs_dir, ports = tmp_path / "runs", new_ports()
    learner = e2e.start("learner", learner_args(ports, runs_dir))
    context = zmq.Context()
    subscriber = TelemetrySubscriber(ports.telemetry_address)
    try:
        victim = context.socket(zmq.REQ)
        victim.routing_id = new_routing_id()  # as an actor's control socket
        victim.connect(ports.control_address)
        joined = request(
            victim,
            encode_join_request(
                JoinRequest("victim", "inc-victim", 2, "here", shared_memory_host_id())
            ),
            timeout_s=90,
        )
        assert isinstance(joined, JoinReply) and joined.accepted and joined.step_ring is not None, (
            joined
        )
        ring = StepRing.attach(joined.step_ring, joined.spec)  # the victim's step ring
        ring.write(0, valid_fields(joined))
        slot_step = encode_step(StepMessage("victim", "inc-victim", 0, 0, {}, slot=0))

        spoof_control = context.socket(zmq.REQ)  # same protocol and host, another connection
        spoof_control.routing_id = (
            new_routing_id()
        )  # one of its own (without, it would be anonymous_connection)
        spoof_control.connect(ports.control_address)
        leave_reply = request(
            spoof_control, encode_leave(Leave("victim", "inc-victim"))
        )  # a stolen incarnation
        assert isinstance(leave_reply, HeartbeatReply) and leave_reply.status != "stop"
        join_reply = request(
            spoof_control, encode_join_request(JoinRequest("victim", "inc-thief", 2, "there"))
        )
        assert isinstance(join_reply, JoinReply) and not join_reply.accepted

        spoof_data = context.socket(zmq.PUSH)
        spoof_data.connect(f"tcp://127.0.0.2:0;{ports.data_address.removeprefix('tcp://')}")
        spoof_data.send_multipart(
            slot_step
        )  # another peer must not release the victim's slot either

        snapshot = wait_snapshot(
            subscriber,
            lambda s: s.rejected_messages.get("impersonation", 0) >= 3,
            30,
            "3 refused impersonations",
            learner.describe,
        )
        assert ring.released == 0, "another peer's step released the victim's ring slot"
        assert [a.actor_id for a in snapshot.actors] == ["victim"], (
            "the spoofed leave dropped the victim"
        )
        assert snapshot.global_step == 0, "a spoofed step reached the buffer"
        assert snapshot.actors[0].incarnation != "inc-victim", "telemetry published the incarnation"
        assert "inc-victim" not in snapshot.model_dump_json()

        # The victim's own step and leave still work.
        real_data = context.socket(zmq.PUSH)
        real_data.connect(ports.data_address)
        real_data.send_multipart(slot_step)
        rows = (
            joined.spec.steps_per_message * joined.spec.num_envs
        )  # one message: K vector steps of 2 envs
        wait_snapshot(
            subscriber,
            lambda s: s.global_step == rows,
            30,
            "the victim's own step",
            learner.describe,
        )
        assert ring.released == 1
        ring.close()
        reply = request(victim, encode_leave(Leave("victim", "inc-victim")))
        assert isinstance(reply, HeartbeatReply) and reply.status == "stop"
        wait_snapshot(
            subscriber, lambda s: not s.actors, 30, "the victim's own leave", learner.describe
        )
        assert "Traceback" not in learner.stderr()
    finally:
        subscriber.close()
        context.destroy(linger=0)
    learner.send_signal(15)
    assert learner.wait(timeout_s=60) == 0, learner.describe()


@pytest.mark.slow
def test_curve_only_authorised_keys_join_train_and_watch(e2e: E2EProcesses, tmp_path: Path) -> None:
    keys, authorised = tmp_path / "keys", tmp_path / "keys" / "authorized"
    for name in ("learner", "actor", "actor2", "monitor", "intruder"):
        generate_keypair(keys, name)
    authorised.mkdir()
    for name, role in (("actor", "actors"), ("actor2", "actors"), ("monitor", "monitors")):
        (authorised / role).mkdir(exist_ok=True)
        (authorised / role / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    server = load_public_key(keys / "learner.key")
    client_env = lambda name: {
        "OAKEMU_CURVE": "true",
        "OAKEMU_CURVE_SECRET_KEY": str(keys / f"{name}.key_secret"),
        "OAKEMU_CURVE_SERVER_KEY": str(keys / "learner.key"),
    }
    runs_dir, ports = tmp_path / "runs", new_ports()
    learner = e2e.start(
        "learner",
        learner_args(ports, runs_dir),
        env={
            "OAKEMU_CURVE": "true",
            "OAKEMU_CURVE_SECRET_KEY": str(keys / "learner.key_secret"),
            "OAKEMU_CURVE_AUTHORIZED_KEYS": str(authorised),
        },
    )
    actor_flags = ["--envs-per-actor", "2", *common_flags(ports, runs_dir, role="actor")]
    actor = e2e.start(
        "actor", ["actor", "--actor-id", "good", *actor_flags], env=client_env("actor")
    )
    intruder = e2e.start(
        "intruder", ["actor", "--actor-id", "intruder", *actor_flags], env=client_env("intruder")
    )
    context = zmq.Context()
    subscriber = TelemetrySubscriber(
        ports.telemetry_address,
        security=type(
            "S", (), {"apply": staticmethod(lambda sock: secure(sock, keys, "monitor", server))}
        )(),
    )
    try:
        why = lambda: learner.describe() + actor.describe() + intruder.describe()
        trained = wait_snapshot(
            subscriber, lambda s: s.iterations >= 2, 120, "2 updates with the authorised actor", why
        )
        assert [a.actor_id for a in trained.actors] == ["good"]
        counted = wait_snapshot(
            subscriber,
            lambda s: s.rejected_messages.get("unauthorized_key", 0) >= 1,
            30,
            "the intruder's refused handshakes",
            why,
        )
        assert "intruder" not in {a.actor_id for a in counted.actors}
        assert "still trying to reach the learner" in wait_log(
            intruder, "still trying to reach the learner", 30
        )
        assert "actor intruder joined" not in learner.stderr()

        # Monitors: without an authorised key (or without CURVE) nothing arrives.
        for env in (client_env("intruder"), {}):
            monitor = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "oakemu_services.cli",
                    "monitor",
                    "--connect",
                    ports.telemetry_address,
                    "--once",
                    "--json",
                    "--timeout",
                    "3",
                ],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env={**{k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}, **env},
            )
            assert monitor.returncode != 0 and "{" not in monitor.stdout, (
                env,
                monitor.stdout,
                monitor.stderr,
            )
        authorised_monitor = subprocess.run(
            [
                sys.executable,
                "-m",
                "oakemu_services.cli",
                "monitor",
                "--connect",
                ports.telemetry_address,
                "--once",
                "--json",
                "--timeout",
                "10",
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")},
                **client_env("monitor"),
            },
        )
        assert authorised_monitor.returncode == 0 and '"good"' in authorised_monitor.stdout, (
            authorised_monitor.stderr
        )

        # A second connection with the same actor key cannot speak for an actor (same address).
        joined = secure(context.socket(zmq.REQ), keys, "actor2", server)
        joined.routing_id = new_routing_id()
        joined.connect(ports.control_address)
        reply = request(joined, encode_join_request(JoinRequest("victim", "inc-v", 2, "here")))
        assert isinstance(reply, JoinReply) and reply.accepted
        other = secure(context.socket(zmq.REQ), keys, "actor2", server)
        other.routing_id = new_routing_id()
        other.connect(ports.control_address)
        before = counted.rejected_messages.get("impersonation", 0)
        reply = request(other, encode_leave(Leave("victim", "inc-v")))
        assert isinstance(reply, HeartbeatReply) and reply.status != "stop"
        reply = request(other, encode_join_request(JoinRequest("victim", "inc-thief", 2, "here")))
        assert isinstance(reply, JoinReply) and not reply.accepted
        after = wait_snapshot(
            subscriber,
            lambda s: s.rejected_messages.get("impersonation", 0) >= before + 2,
            30,
            "a refused leave and join from another connection with the same key",
            why,
        )
        assert "victim" in {a.actor_id for a in after.actors}
        # A monitor key cannot join as an actor: its handshake on the control socket is refused.
        refused = after.rejected_messages.get("unauthorized_key", 0)
        spy = secure(context.socket(zmq.REQ), keys, "monitor", server)
        spy.connect(ports.control_address)
        spy.send(encode_join_request(JoinRequest("spy", "inc-spy", 2, "here")))
        assert not spy.poll(3000), "the learner answered a monitor key on its control socket"
        final = wait_snapshot(
            subscriber,
            lambda s: s.rejected_messages.get("unauthorized_key", 0) > refused,
            30,
            "the monitor key's refused join",
            why,
        )
        assert "spy" not in {a.actor_id for a in final.actors}
        assert "Traceback" not in learner.stderr()
    finally:
        subscriber.close()
        context.destroy(linger=0)
    learner.send_signal(15)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    intruder.send_signal(15)
    assert intruder.wait(timeout_s=30) == 0, intruder.describe()


def wait_log(process, text: str, timeout_s: float) -> str:
    """The process's stderr once it contains ``text`` (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = process.stderr()
        if text in log:
            return log
        time.sleep(0.5)
    raise AssertionError(f"{process.name} never logged {text!r}:\n{process.describe()}")
