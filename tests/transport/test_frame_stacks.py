"""Stacked-frame deduplication (oakemu_core/transport/frame_stacks.py): an actor sends an env's newest frame
when the rest of its stack is its previous row's; the learner rebuilds byte-identical stacks, never from a
stale one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from oakemu_core.policy.distributions import Bernoulli, Categorical, DiagGaussian, MultiCategorical
from oakemu_core.step_schema import StepField, StepSchema, build_schema, default_schema
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.channels import StepReceiver
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.frame_stacks import (
    KEYFRAME_MESSAGES,
    StackedRows,
    StackHistories,
    stacked_fields,
)
from oakemu_core.transport.step_ring import StepRings
from oakemu_core.transport.steps import StepEncoder, StepMessage, StepSpec, decode_step, encode_step
from tests.test_step_schema import valid_fields

MAX_BYTES = 1 << 24
N = 3
SCHEMAS = {
    "default": default_schema((3,), np.float32),
    "atari": build_schema({"": ((4, 7, 5), np.uint8)}, Categorical(4)),
    "dict_masked_multi": build_schema(
        {"image": ((4, 6, 6), np.uint8), "vector": ((2,), np.float32)},
        MultiCategorical([2, 3], masked=True),
    ),
    "gaussian": build_schema({"": ((3,), np.float32)}, DiagGaussian([-2.0, -1.0], [2.0, 1.0])),
    "bernoulli_extra": build_schema({"": ((3,), np.float32)}, Bernoulli(4, masked=True)).with_field(
        StepField("my_extra", (3,), np.float32, minibatch=True, low=-1.0, high=[1.0, 2.0, 3.0])
    ),
    "emulator_rgb": build_schema({"": ((3, 4, 5, 3), np.uint8)}, Categorical(2)),
}


def test_which_fields_are_stacked() -> None:
    assert stacked_fields(SCHEMAS["atari"]) == {"observations"}
    assert stacked_fields(SCHEMAS["emulator_rgb"]) == {"observations"}
    assert stacked_fields(SCHEMAS["dict_masked_multi"]) == {"observations.image"}
    assert stacked_fields(SCHEMAS["default"]) == frozenset()
    single_frame = build_schema({"": ((1, 84, 84), np.uint8)}, Categorical(2))  # no stack
    assert stacked_fields(single_frame) == frozenset()
    assert stacked_fields(
        SCHEMAS["atari"].with_field(StepField("pixels", (4, 7, 5), np.uint8))
    ) == {"observations"}


def stream(
    schema: StepSchema, k: int, messages: int, seed: int = 0, resets: float = 0.1
) -> list[dict[str, np.ndarray]]:
    """Valid fields of ``messages`` consecutive messages of K steps: each stacked observation moves one
    new frame per step; now and then (``resets``: the chance per env and step) an env resets (its stack
    starts over with one frame repeated)."""
    rng = np.random.default_rng(seed)
    names = stacked_fields(schema)
    stacks = {name: rng.integers(0, 256, (N, *schema[name].shape), np.uint8) for name in names}
    out = []
    for seq in range(messages):
        steps = [valid_fields(schema, N, seed=seed + 1000 * seq + i) for i in range(k)]
        for step in steps:
            for item in schema.sent:  # within a float field's own bounds
                if item.dtype.kind == "f" and (item.low is not None or item.high is not None):
                    step[item.name] = np.clip(step[item.name], item.low, item.high).astype(
                        item.dtype
                    )
            for name in names:
                stack = stacks[name]
                stack[:, :-1] = stack[:, 1:].copy()
                stack[:, -1] = rng.integers(0, 256, stack.shape[2:], np.uint8)
                reset = rng.random(N) < resets
                stack[reset] = rng.integers(
                    0, 256, stack.shape[2:], np.uint8
                )  # every frame the first one
                step[name] = stack.copy()
        out.append(
            steps[0] if k == 1 else {name: np.stack([s[name] for s in steps]) for name in steps[0]}
        )
    return out


@pytest.mark.parametrize("k", [1, 3, 4, 6])  # K below, at and above a stack of 4
@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_space_kind_decodes_to_exactly_the_rows_sent(kind: str, k: int) -> None:
    """Deduplicated or whole, the decoded arrays are byte for byte the actor's, across env resets and
    key frames; deduplicated stacks go as newest frames where they can."""
    schema = SCHEMAS[kind]
    spec = StepSpec(N, schema, steps_per_message=k)
    encoder, histories = StepEncoder(spec), StackHistories()
    messages = KEYFRAME_MESSAGES + 3 if k == 1 else 8
    newest_only = 0
    for seq, fields in enumerate(stream(schema, k, messages)):
        msg = StepMessage("a", "inc", seq, 0, fields)
        frames = [bytes(frame) for frame in encoder.encode(msg)]
        decoded = decode_step(
            frames, lambda a, i: spec, max_bytes=MAX_BYTES, stacks_for=histories.previous
        )
        whole = decode_step(encode_step(msg, spec), lambda a, i: spec, max_bytes=MAX_BYTES)
        histories.remember("a", "inc", seq, decoded.fields, spec.stacked, block=k > 1)
        assert decoded.fields.keys() == whole.fields.keys() == fields.keys()
        for name, array in fields.items():
            got = decoded.fields[name]
            if name in spec.stacked:  # rebuilt where written, or as a private array
                assert isinstance(got, StackedRows)
                written = np.zeros(array.shape, np.uint8)
                got.write_into(written)
                assert written.tobytes() == array.tobytes(), (name, seq)
            for view in (got, whole.fields[name]):
                assert view.dtype == array.dtype and view.shape == array.shape, name
                assert np.asarray(view).tobytes() == array.tobytes(), (name, seq)
        assert len(frames) == spec.frame_count
        if spec.stacked:
            flags = np.frombuffer(
                frames[1 + [f.name for f in schema.sent].index(sorted(spec.stacked)[0])], bool
            )
            newest_only += int((~flags).sum())
            if seq % KEYFRAME_MESSAGES == 0:
                assert flags[:N].all()  # the first row of a key frame goes whole
    assert newest_only > 0 or not spec.stacked


@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_a_message_without_whole_rows_is_rebuilt_from_its_frames_and_the_stacks_before(
    k: int,
) -> None:
    """No reset, no key frame: every row goes as its newest frame and ``write_into`` builds each step's
    stacks from the previous message's last stacks and the message's frames, into rows holding garbage."""
    schema = SCHEMAS["emulator_rgb"]
    spec = StepSpec(N, schema, steps_per_message=k)
    encoder, histories = StepEncoder(spec), StackHistories()
    for seq, fields in enumerate(
        stream(schema, k, 4, seed=5, resets=0.0), start=1
    ):  # seq 1: no key frame
        frames = encoder.encode(StepMessage("a", "inc", seq, 0, fields))
        decoded = decode_step(
            frames, lambda a, i: spec, max_bytes=MAX_BYTES, stacks_for=histories.previous
        )
        histories.remember("a", "inc", seq, decoded.fields, spec.stacked, block=k > 1)
        assert np.frombuffer(frames[1], bool).any() == (
            seq == 1
        )  # only the first message sends whole stacks
        written = np.full(fields["observations"].shape, 7, np.uint8)
        decoded.fields["observations"].write_into(written)
        assert written.tobytes() == fields["observations"].tobytes(), seq


def test_an_atari_step_is_under_8_kb_on_the_wire() -> None:
    schema = build_schema({"": ((4, 84, 84), np.uint8)}, Categorical(4))
    spec = StepSpec(8, schema)
    encoder = StepEncoder(spec)
    fields = valid_fields(schema, 8)
    sizes = []
    for seq in range(2 * KEYFRAME_MESSAGES):
        fields["observations"] = np.concatenate(
            [fields["observations"][:, 1:], np.full((8, 1, 84, 84), seq % 256, np.uint8)], axis=1
        )
        sizes.append(
            sum(memoryview(f).nbytes for f in encoder.encode(StepMessage("a", "i", seq, 0, fields)))
        )
    assert sizes[0] > 8 * 4 * 84 * 84 and sizes[1] < 8 * (84 * 84 + 200)
    assert np.mean(sizes) / 8 <= 8000


def test_the_learner_never_rebuilds_from_a_stale_stack() -> None:
    """A missing message (rejected, lost) leaves no stack: newest-frame-only rows are rejected until the
    next key frame; a new incarnation (a rejoined actor) sends whole stacks first."""
    schema = SCHEMAS["atari"]
    spec = StepSpec(N, schema)
    encoder, histories = StepEncoder(spec), StackHistories()
    sent = stream(schema, 1, KEYFRAME_MESSAGES + 2, seed=3)
    frames = [
        encoder.encode(StepMessage("a", "inc", seq, 0, fields)) for seq, fields in enumerate(sent)
    ]

    def decode(seq: int, incarnation: str = "inc") -> StepMessage:
        message = decode_step(
            frames[seq], lambda a, i: spec, max_bytes=MAX_BYTES, stacks_for=histories.previous
        )
        histories.remember("a", incarnation, seq, message.fields, spec.stacked, block=False)
        return message

    decode(0)
    decode(1)
    for seq in range(3, KEYFRAME_MESSAGES):  # message 2 never arrived
        flags = np.frombuffer(frames[seq][1], bool)
        if not flags.all():
            with pytest.raises(MessageRejected) as info:
                decode(seq)
            assert info.value.reason == "schema" and "no stack" in info.value.detail
            assert info.value.sender == ("a", "inc", seq)
    recovered = decode(KEYFRAME_MESSAGES)  # the key frame: every env whole
    assert (
        np.asarray(recovered.fields["observations"]).tobytes()
        == sent[KEYFRAME_MESSAGES]["observations"].tobytes()
    )
    assert (
        np.asarray(decode(KEYFRAME_MESSAGES + 1).fields["observations"]).tobytes()
        == sent[KEYFRAME_MESSAGES + 1]["observations"].tobytes()
    )

    rejoined = StepEncoder(spec)  # a new channel of a new incarnation
    first = rejoined.encode(StepMessage("a", "inc-2", 5, 0, sent[5]))
    assert np.frombuffer(first[1], bool).all()
    assert histories.previous("a", "inc-2", 5) is None  # nothing known of the new incarnation
    histories.retain({("a", "inc-2")})
    assert histories.previous("a", "inc", KEYFRAME_MESSAGES + 2) is None and len(histories) == 0


def test_a_spoofed_message_never_becomes_the_stack_the_next_message_is_rebuilt_from() -> None:
    """The receiver remembers stacks only of messages from the actor's own peer, and forgets them with it."""
    schema = SCHEMAS["atari"]
    spec = StepSpec(N, schema)
    sent = stream(schema, 1, 3, seed=5)
    receiver = StepReceiver(
        StepRings(), lambda a, i: spec, lambda a, i, frame: frame.peer == "own", max_bytes=MAX_BYTES
    )
    encoder = StepEncoder(spec)

    def frames(fields: dict, seq: int, peer: str, encode=encoder.encode) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(buffer=f, peer=peer)
            for f in encode(StepMessage("a", "inc", seq, 0, fields))
        ]

    receiver.decode(frames(sent[0], 0, "own"))
    forged = {**sent[1], "observations": np.zeros_like(sent[1]["observations"])}
    receiver.decode(
        frames(forged, 1, "thief", encode=lambda m: encode_step(m, spec))
    )  # whole stacks, other peer
    assert receiver.stacks.previous("a", "inc", 1) is not None  # still the actor's message 0
    message = receiver.decode(frames(sent[1], 1, "own"))
    assert np.asarray(message.fields["observations"]).tobytes() == sent[1]["observations"].tobytes()
    receiver.retain(set())
    assert len(receiver.stacks) == 0


@pytest.mark.parametrize("k", [1, 2])
def test_a_deduplicated_rollout_is_byte_identical_to_the_whole_stack_rollout(k: int) -> None:
    """Through the assembler into shared memory (the stacks rebuilt in the buffer's rows), across env
    resets and rollout boundaries, one step or blocks of K per message."""
    schema = build_schema({"": ((4, 7, 5), np.uint8)}, Categorical(4))
    t = 4
    spec = StepSpec(N, schema, steps_per_message=k)
    sent = stream(schema, k, 3 * t // k, seed=7)
    results = []
    for dedup in (True, False):
        buffers = [RolloutBuffer(t, N, schema=schema) for _ in range(2)]
        try:
            assembler = RolloutAssembler(buffers, actor_timeout_s=1e9)
            assembler.join("a", "inc", spec, hostname="h", now=0.0)
            receiver = StepReceiver(
                StepRings(), assembler.spec_for, lambda *_: True, max_bytes=MAX_BYTES
            )
            encoder = StepEncoder(spec)
            rollouts = []
            for seq, fields in enumerate(sent):
                msg = StepMessage("a", "inc", seq, 0, fields)
                frames = encoder.encode(msg) if dedup else encode_step(msg, spec)
                message = receiver.decode(
                    [SimpleNamespace(buffer=bytes(f), peer="own") for f in frames]
                )
                assembler.ingest(message, current_policy_version=0, now=0.0)
                rollout = assembler.take_full_rollout()
                if rollout is not None:
                    rollouts.append(
                        {f.name: rollout.buffer.field(f.name).copy() for f in schema.stored}
                    )
                    assembler.release(rollout.slot)
            results.append(rollouts)
        finally:
            for buffer in buffers:
                buffer.close()
    assert len(results[0]) == len(results[1]) == 3
    for deduplicated, whole, index in zip(results[0], results[1], range(3)):
        for name in deduplicated:
            assert deduplicated[name].tobytes() == whole[name].tobytes(), name
        rows = np.concatenate(
            [fields["observations"] if k > 1 else fields["observations"][None] for fields in sent]
        )
        assert deduplicated["observations"].tobytes() == rows[index * t : (index + 1) * t].tobytes()


def test_a_block_row_may_build_on_the_row_before_it_in_the_block() -> None:
    schema = SCHEMAS["atari"]
    spec = StepSpec(N, schema, steps_per_message=4)
    fields = stream(schema, 4, 1, seed=11)[0]
    frames = StepEncoder(spec).encode(
        StepMessage("a", "i", 1, 0, fields)
    )  # seq 1: no key frame, no history
    flags = np.frombuffer(frames[1], bool).reshape(4, N)
    assert (
        flags[0].all() and not flags[1:].all()
    )  # row 0 whole (nothing before it), later rows build on it
    decoded = decode_step(frames, lambda a, i: spec, max_bytes=MAX_BYTES)
    assert np.asarray(decoded.fields["observations"]).tobytes() == fields["observations"].tobytes()
