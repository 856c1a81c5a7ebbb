"""Step rings (oakemu_core/transport/step_ring.py): the arrays of a step message in shared memory, checked by the
learner like inline ones; flow control by the release counter; the learner's registry of rings."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq

from oakemu_core.algo.handshake import RunProgress
from oakemu_core.algo.ingest_loop import IngestLoop
from oakemu_core.config import OakEmuConfig
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.batching import auto_steps_per_message
from oakemu_core.transport.channels import StepReceiver
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import (
    JoinReply,
    JoinRequest,
    StepRingOffer,
    decode_message,
    encode_join_reply,
    encode_join_request,
)
from oakemu_core.transport.frame_stacks import wire_bytes_per_env
from oakemu_core.transport.step_ring import (
    DEPARTED_RINGS_KEPT,
    StepRing,
    StepRings,
    StepRingUnavailable,
    ring_slots,
    shared_memory_host_id,
)
from oakemu_core.transport.step_source import SocketStepSource
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step
from tests.e2e_helpers import (
    E2EProcesses,
    common_flags,
    e2e_fixture,  # noqa: F401
    free_ports,
    new_ports,
    only_run_dir,
    python_path_with_site_hook,
    update_records,
    wait_for,
)
from tests.transport.test_wire import (
    ACTOR,
    ATARI_SCHEMA,
    ATARI_SPEC,
    INCARNATION,
    MAX_BYTES,
    N,
    atari_step,
    known_spec,
)

BLOCK_SPEC = StepSpec(num_envs=N, schema=ATARI_SCHEMA, steps_per_message=4)


@pytest.fixture
def ring() -> Iterator[StepRing]:
    made = StepRing.create(ATARI_SPEC, 3)
    yield made
    made.close()


def block_step(seq: int) -> StepMessage:
    """A valid 4-step block: four different Atari steps stacked, ``(4, N, ...)`` per field."""
    steps = [atari_step(seq=seq, seed=10 * seq + i) for i in range(4)]
    fields = {name: np.stack([s.fields[name] for s in steps]) for name in steps[0].fields}
    return replace(steps[0], fields=fields, episode_returns=[1.0], episode_lengths=[9])


def via_ring(ring: StepRing, actor: StepRing, msg: StepMessage) -> StepMessage:
    """What the actor sends (arrays into the slot, a frame without them) and what the learner decodes."""
    slot = actor.write(msg.seq, msg.fields)
    frame = encode_step(replace(msg, fields={}, slot=slot))
    return decode_step(
        frame,
        lambda a, i: ring.spec if (a, i) == (ACTOR, INCARNATION) else None,
        max_bytes=MAX_BYTES,
        ring_for=lambda a, i: ring,
    )


@pytest.mark.parametrize("spec", [ATARI_SPEC, BLOCK_SPEC], ids=["one-step", "four-step-block"])
def test_a_message_through_the_ring_decodes_to_the_arrays_of_the_inline_message(
    spec: StepSpec,
) -> None:
    learner_ring = StepRing.create(spec, 2)
    actor_ring = StepRing.attach(learner_ring.offer(), spec)
    try:
        for seq in range(5):  # more messages than slots: slots are reused after release
            msg = atari_step(seq=seq, seed=seq) if spec is ATARI_SPEC else block_step(seq)
            inline = decode_step(encode_step(msg, spec), lambda a, i: spec, max_bytes=MAX_BYTES)
            ringed = via_ring(learner_ring, actor_ring, msg)
            assert ringed.slot == seq % 2 and inline.slot is None
            assert ringed.fields.keys() == inline.fields.keys()
            for name, array in inline.fields.items():
                assert ringed.fields[name].dtype == array.dtype
                np.testing.assert_array_equal(ringed.fields[name], array, err_msg=name)
            assert (
                ringed.seq,
                ringed.policy_version,
                ringed.revision,
                ringed.episode_returns,
                ringed.episode_lengths,
            ) == (
                inline.seq,
                inline.policy_version,
                inline.revision,
                inline.episode_returns,
                inline.episode_lengths,
            )
            assert not ringed.fields["observations"].flags.writeable  # a view of the slot
            learner_ring.release(seq)
    finally:
        actor_ring.close()
        learner_ring.close()


def test_the_actor_may_not_rewrite_a_slot_the_learner_has_not_released(ring: StepRing) -> None:
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    fields = atari_step().fields
    try:
        for seq in range(3):
            assert actor.is_free(seq)
            actor.write(seq, fields)
        assert not actor.is_free(3)
        with pytest.raises(RuntimeError, match="in use"):
            actor.write(3, fields)
        ring.release(0)  # the learner is done with message 0: its slot takes message 3
        assert actor.released == 1 and actor.is_free(3) and not actor.is_free(4)
        ring.release(2)  # every message below 3 is done
        ring.release(1)  # an older release never lowers the counter
        assert actor.released == 3 and actor.is_free(5) and not actor.is_free(6)
    finally:
        actor.close()


def test_slot_views_share_memory_so_a_held_message_must_be_copied(ring: StepRing) -> None:
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    try:
        first = via_ring(ring, actor, atari_step(seq=0, seed=1))
        owned = first.owned()
        before = owned.fields["observations"].copy()
        ring.release(0)
        for seq in range(1, 4):  # seq 3 reuses slot 0
            via_ring(ring, actor, atari_step(seq=seq, seed=50 + seq))
            ring.release(seq)
        assert not np.array_equal(
            first.fields["observations"], before
        )  # the view sees the new message
        np.testing.assert_array_equal(owned.fields["observations"], before)  # the copy does not
        inline = atari_step()
        assert inline.owned() is inline  # inline arrays own their frame: no copy needed
    finally:
        actor.close()


def test_the_assembler_copies_a_held_ring_message_out_of_its_slot() -> None:
    buffers = [RolloutBuffer(2, N, schema=ATARI_SCHEMA) for _ in range(2)]
    assembler = RolloutAssembler(buffers, actor_timeout_s=5.0)
    ring = StepRing.create(ATARI_SPEC, 2)
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    try:
        assembler.join(ACTOR, INCARNATION, ATARI_SPEC, hostname="h", now=0.0)
        for seq in range(4):  # fills both buffers (2 rows x N columns each)
            assembler.ingest(
                via_ring(ring, actor, atari_step(seq=seq, seed=seq)),
                current_policy_version=7,
                now=0.0,
            )
            ring.release(seq)
        held = via_ring(ring, actor, atari_step(seq=4, seed=4))  # no free column: held
        assembler.ingest(held, current_policy_version=7, now=0.0)
        assert assembler.pending_rows == 1
        ring.release(4)
        expected = atari_step(seq=4, seed=4).fields
        via_ring(ring, actor, atari_step(seq=6, seed=99))  # seq 6 rewrites slot 0, where seq 4 was
        rollout = assembler.take_full_rollout()
        assert rollout is not None
        assembler.release(rollout.slot)  # frees columns: the held message is written now
        assert assembler.pending_rows == 0
        np.testing.assert_array_equal(
            buffers[rollout.slot].observations[0], expected["observations"]
        )
        np.testing.assert_array_equal(buffers[rollout.slot].actions[0], expected["actions"])
    finally:
        actor.close()
        ring.close()
        for buffer in buffers:
            buffer.close()


def rejected(frame: bytes, ring_for) -> MessageRejected:
    with pytest.raises(MessageRejected) as info:
        decode_step(frame, known_spec, max_bytes=MAX_BYTES, ring_for=ring_for)
    return info.value


def test_slot_messages_the_learner_cannot_place_are_rejected(ring: StepRing) -> None:
    frame = encode_step(replace(atari_step(seq=4), fields={}, slot=1))  # seq 4 % 3 slots = 1
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    actor.write(0, atari_step().fields)
    actor.write(1, atari_step().fields)
    try:
        assert "no step ring" in rejected(frame, lambda a, i: None).detail
        assert "no step ring" in rejected(frame, None).detail  # decode_step's default: no rings
        wrong_slot = encode_step(replace(atari_step(seq=4), fields={}, slot=2))
        assert "slot" in rejected(wrong_slot, lambda a, i: ring).detail
        other = StepRing.create(BLOCK_SPEC, 3)  # a ring of another spec
        try:
            assert "slot" in rejected(frame, lambda a, i: other).detail
        finally:
            other.close()
        with_fields = encode_step(
            replace(atari_step(seq=4), slot=None), ATARI_SPEC
        )  # arrays inline ...
        tampered = msgpack.unpackb(with_fields[0], raw=False)
        tampered["slot"] = 1  # ... and a slot as well
        reason = rejected(
            [msgpack.packb(tampered, use_bin_type=True), *with_fields[1:]], lambda a, i: ring
        )
        assert reason.reason == "schema" and "header alone in a slot message" in reason.detail
        assert (
            decode_step(frame, known_spec, max_bytes=MAX_BYTES, ring_for=lambda a, i: ring).slot
            == 1
        )
    finally:
        actor.close()


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("values", np.nan, "schema"),  # floats must be finite
        ("dones", 2, "schema"),  # bool bytes 0/1
        ("actions", 4, "value_range"),  # 4 actions: 0..3
    ],
)
def test_slot_contents_get_the_checks_of_inline_arrays(
    ring: StepRing, name: str, value: float, reason: str
) -> None:
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    try:
        actor.write(0, atari_step().fields)
        raw = actor._slot_views[0][
            name
        ]  # the actor's writable view: bytes a buggy actor could leave
        if raw.dtype == bool:
            raw.view(np.uint8)[3] = value
        else:
            raw[3] = value
        frame = encode_step(replace(atari_step(seq=0), fields={}, slot=0))
        assert rejected(frame, lambda a, i: ring).reason == reason
    finally:
        actor.close()


def test_checked_fields_are_copied_before_the_check_and_frames_are_used_in_place(
    ring: StepRing,
) -> None:
    """What the learner checks is what it writes: an actor (or anything) writing the slot after the
    check cannot slip a NaN or an impossible action into the buffer. Frames, where every byte is a
    valid pixel, are not copied."""
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    try:
        message = via_ring(ring, actor, atari_step(seq=0, seed=3))
        expected = atari_step(seq=0, seed=3).fields
        actor._slot_views[0]["values"][:] = np.nan  # written after the learner's check
        actor._slot_views[0]["actions"][:] = 99
        np.testing.assert_array_equal(message.fields["values"], expected["values"])
        np.testing.assert_array_equal(message.fields["actions"], expected["actions"])
        assert np.shares_memory(message.fields["observations"], ring._slot_views[0]["observations"])
        assert [f.name for f in ATARI_SCHEMA.sent if f.any_bits_valid] == ["observations"]
    finally:
        actor.close()


def test_write_refuses_fields_of_another_shape(ring: StepRing) -> None:
    actor = StepRing.attach(ring.offer(), ATARI_SPEC)
    try:
        one_step = atari_step().fields
        block = StepRing.create(BLOCK_SPEC, 2)
        try:
            with pytest.raises(
                ValueError, match="shape"
            ):  # np.copyto would broadcast it into all 4 steps
                block.write(0, one_step)
        finally:
            block.close()
        with pytest.raises(KeyError):
            actor.write(0, {name: a for name, a in one_step.items() if name != "values"})
        with pytest.raises(TypeError):
            actor.write(0, {**one_step, "actions": one_step["actions"].astype(np.float32)})
    finally:
        actor.close()


def test_every_message_the_learner_reads_frees_its_slot_but_only_on_its_own_peers_word() -> None:
    """The learner's data path (``Learner._handle_data``) on a 2-slot ring. Messages rejected at decode
    (a NaN value) or at ingest (steps of a departed actor) must free their slots too, else two in a
    row leave the actor unable to write its next message, and its unfinished segment holds up every
    buffer behind it. A message from another peer must not free anything: the slots it names may
    still be queued."""
    from oakemu_services.learner import Learner

    buffers = [RolloutBuffer(16, N, schema=ATARI_SCHEMA) for _ in range(2)]
    rings = StepRings()
    try:
        assembler = RolloutAssembler(buffers, actor_timeout_s=60.0)
        assembler.join(ACTOR, INCARNATION, ATARI_SPEC, hostname="h", now=0.0)
        offer = rings.offer(ACTOR, INCARNATION, ATARI_SPEC, 16)
        assert offer.slots == 2
        queue: list[tuple[list, str]] = []

        class Frames:  # the PULL socket; each frame says which peer sent it and whether more follow
            parts: list = []

            def recv(self, flags: int, copy: bool) -> SimpleNamespace:
                if not self.parts:
                    if not queue:
                        raise zmq.Again()
                    frames, peer = queue.pop(0)
                    self.parts = [
                        SimpleNamespace(buffer=frame, peer=peer, more=i < len(frames) - 1)
                        for i, frame in enumerate(frames)
                    ]
                return self.parts.pop(0)

        peers = SimpleNamespace(allows=lambda actor_id, incarnation, frame: frame.peer == "own")
        assembler.published.advance(7)
        receiver = StepReceiver(rings, assembler.spec_for, peers.allows, max_bytes=MAX_BYTES)
        learner = SimpleNamespace(  # the learner's data path: its step source and ingest loop
            assembler=assembler,
            steps=SocketStepSource(Frames(), receiver, peers),
            loop=IngestLoop(
                assembler,
                SimpleNamespace(),
                peer_limits=SimpleNamespace(check_step=lambda message: None),
                total_env_steps=1,
                rejections=SimpleNamespace(event=lambda *args: None),
                notices=SimpleNamespace(event=lambda *args, **kwargs: None),
                progress=RunProgress(),
            ),
        )
        actor = StepRing.attach(offer, ATARI_SPEC)

        def send(seq: int, *, nan: bool = False, peer: str = "own") -> None:
            fields = atari_step(seq=seq, seed=seq).fields
            if nan:
                fields = {**fields, "values": np.full(N, np.nan, np.float32)}
            assert actor.is_free(seq), (
                f"the actor waits for a slot at seq {seq} (released {actor.released})"
            )
            queue.append(
                (
                    encode_step(
                        replace(atari_step(seq=seq), fields={}, slot=actor.write(seq, fields))
                    ),
                    peer,
                )
            )
            Learner._handle_data(learner, now=0.0)

        send(0)
        assert actor.released == 1
        send(1, nan=True, peer="thief")  # refused at decode, from another peer: nothing freed
        send(1, peer="thief")  # refused at the peer check
        assert actor.released == 1 and assembler.counters.accepted["step"] == 1
        for seq in (1, 2):  # refused at decode, from the actor's own peer
            send(seq, nan=True)
            assert actor.released == seq + 1
        send(3)
        assert actor.released == 4 and assembler.counters.accepted["step"] == 2
        assert assembler.leave(ACTOR, INCARNATION)
        for seq in (4, 5, 6):  # late steps of a departed actor: refused at ingest
            send(seq)
            assert actor.released == seq + 1
        assert assembler.counters.dropped["late_step_messages"] == 3
        actor.close()
    finally:
        rings.close()
        for buffer in buffers:
            buffer.close()


def test_attach_refuses_a_segment_that_is_not_the_offered_ring(ring: StepRing) -> None:
    offer = ring.offer()
    with pytest.raises(StepRingUnavailable):
        StepRing.attach(replace(offer, token="0" * 16), ATARI_SPEC)
    with pytest.raises(StepRingUnavailable):
        StepRing.attach(replace(offer, slots=4), ATARI_SPEC)
    with pytest.raises(StepRingUnavailable):
        StepRing.attach(offer, StepSpec(num_envs=N - 1, schema=ATARI_SCHEMA))  # another layout
    with pytest.raises(StepRingUnavailable):
        StepRing.attach(
            replace(offer, name="oakemu_1_abc_stepring"), ATARI_SPEC
        )  # e.g. another /dev/shm


def test_the_registry_unlinks_departed_rings_but_keeps_a_few_readable() -> None:
    rings = StepRings()
    shm = Path("/dev/shm")
    try:
        offers = [
            rings.offer(f"actor-{i}", "inc", ATARI_SPEC, 128)
            for i in range(DEPARTED_RINGS_KEPT + 2)
        ]
        assert all((shm / offer.name).exists() for offer in offers)
        assert offers[0].slots == ring_slots(1, 128) == 16
        rings.retain({("actor-0", "inc")})
        assert (shm / offers[0].name).exists() and rings.get("actor-0", "inc") is not None
        assert not any(
            (shm / offer.name).exists() for offer in offers[1:]
        )  # departed: names gone at once
        assert len(rings) == 1
        readable = [i for i in range(1, len(offers)) if rings.get(f"actor-{i}", "inc") is not None]
        assert readable == list(
            range(len(offers) - DEPARTED_RINGS_KEPT, len(offers))
        )  # the newest stay mapped
        same = rings.offer(
            "actor-0", "inc", ATARI_SPEC, 128
        )  # a join retried with the same incarnation
        assert same == offers[0] and (shm / same.name).exists()  # offered its ring again
        again = rings.offer(
            "actor-0", "inc", ATARI_SPEC, 64
        )  # ... unless the ring would differ (slots)
        assert (
            not (shm / offers[0].name).exists()
            and (shm / again.name).exists()
            and again.slots != same.slots
        )
        assert rings.discard("actor-0", "inc") and not (shm / again.name).exists()
        assert not rings.discard("actor-0", "inc")
    finally:
        rings.close()
    assert not [offer.name for offer in [*offers, again] if (shm / offer.name).exists()]


def test_ring_slots_bound_the_vector_steps_in_flight() -> None:
    assert ring_slots(1, 128) == 16
    assert ring_slots(4, 128) == 4  # Breakout with a ring: K = 4
    assert ring_slots(1, 32) == 4  # a short rollout: an eighth of it
    assert ring_slots(8, 1024) == 2  # LunarLander: K = 8, 16 vector steps
    assert ring_slots(32, 64) == 1  # one message is more than an eighth of a segment
    assert ring_slots(4, 32) == 1  # the rl-zoo's CartPole: K = 4, an eighth of the rollout
    assert ring_slots(16, 1024) == 2  # a message under an eighth of the rollout: two slots at least
    assert ring_slots(1, 16) == 2
    # Synchronous mode: ingest time adds no lag, so up to 16 vector steps of the segment.
    assert (
        ring_slots(4, 32, synchronous=True) == 4
    )  # CartPole: the actor no longer waits for every message
    assert ring_slots(1, 128, synchronous=True) == 16
    assert ring_slots(8, 1024, synchronous=True) == 2
    assert ring_slots(32, 64, synchronous=True) == 2  # two slots at least
    assert ring_slots(1, 8, synchronous=True) == 8  # not more than a segment


def test_a_synchronous_learner_offers_rings_of_its_mode() -> None:
    rings = StepRings()
    try:
        assert rings.offer("a", "i", ATARI_SPEC, 32).slots == ring_slots(1, 32) == 4
        assert (
            rings.offer("b", "i", ATARI_SPEC, 32, synchronous=True).slots
            == ring_slots(1, 32, synchronous=True)
            == 16
        )
    finally:
        rings.close()


def test_an_atari_actor_sends_blocks_through_the_sockets_as_with_a_ring() -> None:
    # What a socket actor's step puts on the wire: the newest 84 x 84 frame of its stack, not the stack.
    wire = wire_bytes_per_env(ATARI_SCHEMA)
    assert wire == ATARI_SCHEMA.sent_bytes_per_env() - 3 * 84 * 84
    assert auto_steps_per_message(wire, 128, num_envs=8) == 4
    assert auto_steps_per_message(wire, 128, num_envs=8, target_bytes=None) == 4
    # The byte bound (the memory a message holds in the queues) still keeps raw 210 x 160 RGB frames at K = 1.
    assert auto_steps_per_message(210 * 160 * 3, 128, num_envs=8) == 1
    assert auto_steps_per_message(210 * 160 * 3, 128, num_envs=8, target_bytes=None) == 4
    config = OakEmuConfig()
    assert config.resolved_steps_per_message(wire, 8) == 4
    assert config.resolved_steps_per_message(wire, 8, step_ring=True) == 4
    assert (
        OakEmuConfig(steps_per_message=2).resolved_steps_per_message(wire, 8, step_ring=True) == 2
    )


def test_join_messages_carry_the_host_id_and_the_ring_offer() -> None:
    request = JoinRequest("a", "inc", 8, "host", host_id="boot-1")
    assert decode_message(encode_join_request(request), max_bytes=MAX_BYTES) == request
    offer = StepRingOffer(name="oakemu_12_abc_stepring", token="0123456789abcdef", slots=4)
    reply = JoinReply(True, "", 0, ATARI_SPEC, {"seed": 1}, 3, {}, step_ring=offer)
    decoded = decode_message(encode_join_reply(reply), max_bytes=MAX_BYTES)
    assert decoded.step_ring == offer
    assert (
        decode_message(
            encode_join_reply(replace(reply, step_ring=None)), max_bytes=MAX_BYTES
        ).step_ring
        is None
    )


@pytest.mark.parametrize(
    "offer",
    [
        StepRingOffer(name="/etc/passwd", token="0123456789abcdef", slots=4),  # not one of ours
        StepRingOffer(name="oakemu_12_abc_stepring", token="xyz", slots=4),
        StepRingOffer(name="oakemu_12_abc_stepring", token="0123456789abcdef", slots=65),
        StepRingOffer(name="oakemu_12_abc_stepring", token="0123456789abcdef", slots=0),
    ],
)
def test_a_join_reply_with_a_bad_ring_offer_is_rejected(offer: StepRingOffer) -> None:
    reply = JoinReply(True, "", 0, ATARI_SPEC, {"seed": 1}, 3, {}, step_ring=offer)
    with pytest.raises(MessageRejected) as info:
        decode_message(encode_join_reply(reply), max_bytes=MAX_BYTES)
    assert info.value.reason == "schema"


def test_the_host_id_names_the_kernel_and_the_shared_memory_mount(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("1234-abcd\n")
    (tmp_path / "shm").mkdir()
    host_id = shared_memory_host_id(tmp_path / "boot_id", tmp_path / "shm")
    assert host_id == f"1234-abcd/{(tmp_path / 'shm').stat().st_dev}"
    # Another /dev/shm mount (a container's own tmpfs) has another device number, so another id.
    assert shared_memory_host_id(tmp_path / "boot_id", Path("/proc")) != host_id
    assert shared_memory_host_id(tmp_path / "missing", tmp_path / "shm") == ""
    assert shared_memory_host_id(tmp_path / "boot_id", tmp_path / "no-shm") == ""


UNREACHABLE_RING_HOOK = """
import os
if os.environ.get("RINGTEST_UNREACHABLE"):
    from oakemu_core.transport import step_ring

    def _unreachable(offer, spec):  # as from another container: its own /dev/shm
        raise step_ring.StepRingUnavailable(f"no segment {offer.name} here")

    step_ring.StepRing.attach = staticmethod(_unreachable)
"""


@pytest.mark.slow
def test_local_actors_use_rings_and_others_fall_back_to_inline_arrays(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    """A learner and three actor processes on one machine: one takes the ring it is offered, one is
    configured for the sockets only, one cannot attach its ring (as in another container). All three
    train; the learner frees the unused ring at the first inline message; nothing is left in /dev/shm."""
    path = python_path_with_site_hook(tmp_path, UNREACHABLE_RING_HOOK)
    runs_dir = tmp_path / "runs"
    ports = new_ports()
    budget = 12 * 32 * 12
    learner = e2e.start(
        "learner",
        [
            "learner",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "3",
            "--envs-per-actor",
            "4",
            "--rollout-length",
            "32",
            "--total-env-steps",
            str(budget),
            "--checkpoint-every-updates",
            "0",
            "--run-name",
            "rings",
            *common_flags(ports, runs_dir),
        ],
        env={"PYTHONPATH": path},
    )
    actor_flags = ["actor", "--envs-per-actor", "4", *ports.flags("actor")]
    ringed = e2e.start("ringed", [*actor_flags, "--actor-id", "ringed"], env={"PYTHONPATH": path})
    sockets = e2e.start(
        "sockets",
        [*actor_flags, "--actor-id", "sockets", "--step-transport", "sockets"],
        env={"PYTHONPATH": path},
    )
    unreachable = e2e.start(
        "unreachable",
        [*actor_flags, "--actor-id", "unreachable"],
        env={"PYTHONPATH": path, "RINGTEST_UNREACHABLE": "1"},
    )
    assert learner.wait(timeout_s=300) == 0, learner.describe()
    wait_for(lambda: e2e.alive() == [], 30, "actors to exit after the learner")
    assert "step arrays go through shared memory" in ringed.stderr() + ringed.stdout(), (
        ringed.describe()
    )
    assert (
        "shared memory"
        not in sockets.stderr() + sockets.stdout() + unreachable.stderr() + unreachable.stdout()
    )
    assert "step arrays go inline" in unreachable.stderr() + unreachable.stdout(), (
        unreachable.describe()
    )
    learner_log = learner.stderr() + learner.stdout()
    assert "actor unreachable sends its step arrays inline" in learner_log, learner.describe()
    assert "actor sockets sends" not in learner_log  # it was never offered a ring
    episodes = [
        json.loads(line)
        for line in (only_run_dir(runs_dir) / "episodes.jsonl").read_text().splitlines()
    ]
    assert {e["actor_id"] for e in episodes} == {"ringed", "sockets", "unreachable"}
    assert update_records(only_run_dir(runs_dir))[-1]["global_step"] >= budget


def test_a_rejoin_that_changes_k_or_the_ring_gets_fresh_sockets_sized_for_them() -> None:
    """An actor's step block and send queue follow the join: a learner restarted without room for a
    ring (or with other settings) must not leave inline 4-step blocks behind a queue sized for a ring."""
    from oakemu_services.actor import Actor

    data, control, weights = free_ports(3)
    config = OakEmuConfig(
        envs_per_actor=N, data_port=data, control_port=control, weights_port=weights
    )
    actor = Actor(config, threading.Event())
    ring = SimpleNamespace(slots=4, close=lambda: None)
    try:
        actor._open_channel(StepSpec(num_envs=N, schema=ATARI_SCHEMA), None)  # no ring: K = 1
        first = actor.channel.socket
        assert actor.block.steps == 1 and first.getsockopt(zmq.SNDHWM) == 2
        actor._open_channel(BLOCK_SPEC, ring)  # a rejoin with a ring: K = 4, four slots
        assert actor.channel.socket is not first and first.closed
        assert (
            actor.steps_per_message == 4
            and actor.block.steps == 4
            and actor.channel.socket.getsockopt(zmq.SNDHWM) == 4
        )
        ringed = actor.channel.socket
        actor._open_channel(BLOCK_SPEC, ring)  # the same again: the same sockets
        assert actor.channel.socket is ringed
        actor._open_channel(BLOCK_SPEC, None)  # a learner without room for a ring: K = 4 inline
        assert (
            actor.channel.socket is not ringed and actor.channel.socket.getsockopt(zmq.SNDHWM) == 1
        )
    finally:
        actor.close()


def test_an_actor_acts_the_next_message_only_once_its_ring_slot_is_free() -> None:
    """Rows wait in the ring, not in the actor: with one slot, the steps of message 1 are acted only
    after the learner has released message 0's slot (policy lag)."""
    import time

    from oakemu_services.actor import Actor

    data, control, weights = free_ports(3)
    config = OakEmuConfig(
        envs_per_actor=N, data_port=data, control_port=control, weights_port=weights
    )
    stop = threading.Event()
    actor = Actor(config, stop)
    events: list[tuple[str, int, float]] = []
    released = [-1]  # the highest seq the learner has released

    class OneSlotRing:
        slots = 1

        def is_free(self, seq: int) -> bool:
            return seq - (released[0] + 1) < self.slots

        def close(self) -> None:
            pass

    def release_later(seq: int) -> None:
        time.sleep(0.5)  # the actor reaches its wait long before
        events.append(("release", seq, time.monotonic()))
        released[0] = seq

    def step(**_: object) -> SimpleNamespace:
        events.append(("step", actor.seq, time.monotonic()))
        return SimpleNamespace(
            buffers=SimpleNamespace(num_envs=N, sent_fields=lambda *_: {}),
            next_values=None,
            policy_version=0,
            policy_revision=0,
            env_step=SimpleNamespace(episode_returns=[], episode_lengths=[]),
        )

    def send_step(message: StepMessage) -> None:
        events.append(("send", message.seq, time.monotonic()))
        threading.Thread(target=release_later, args=(message.seq,), daemon=True).start()
        if message.seq == 2:
            stop.set()

    try:
        actor._open_channel(
            StepSpec(num_envs=N, schema=ATARI_SCHEMA), OneSlotRing()
        )  # as a join does
        actor.join = lambda: None
        actor.seq, actor.client.incarnation = 0, "inc"
        actor.stepper = SimpleNamespace(step=step, schema=None, policy_version=0)
        actor.send_step = send_step
        actor.weights_sub = actor.context.socket(zmq.SUB)  # never receives: no newer weights
        actor.next_heartbeat = float("inf")
        assert actor.run() == 0
        order = [(kind, seq) for kind, seq, _ in events if kind != "release"]
        assert order == [
            ("step", 0),
            ("send", 0),
            ("step", 1),
            ("send", 1),
            ("step", 2),
            ("send", 2),
        ]
        times = {(kind, seq): at for kind, seq, at in events}
        for seq in (1, 2):  # each message's steps come after the release of the one before
            assert times[("step", seq)] >= times[("release", seq - 1)]
        assert actor.channel.slot_waits == 2
    finally:
        actor.close()
