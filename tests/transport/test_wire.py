"""Tests for the wire codec and messages (oakemu_core.transport.codec / control / steps): round trips, every rejection reason, zero-copy decode, fuzzing."""

from __future__ import annotations

import math
import pickle
import threading
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oakemu_core.policy.distributions import Categorical, DiagGaussian
from oakemu_core.step_schema import build_schema, check_step_consistency, default_schema
from oakemu_core.transport import control, steps
from oakemu_core.transport.codec import PROTOCOL_VERSION, REJECTION_REASONS, MessageRejected
from oakemu_core.transport.control import (
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    WeightsMessage,
    decode_message,
    encode_heartbeat,
    encode_heartbeat_reply,
    encode_join_reply,
    encode_join_request,
    encode_leave,
    encode_weights,
)
from oakemu_core.transport.frame_stacks import StackedRows
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step

MAX_BYTES = 1 << 20
N = 8
ATARI_SCHEMA = build_schema({"": ((4, 84, 84), np.uint8)}, Categorical(4))
ATARI_SPEC = StepSpec(num_envs=N, schema=ATARI_SCHEMA)
SENT = tuple(f.name for f in ATARI_SCHEMA.sent)
ACTOR, INCARNATION = "actor-0", "9f1c2b"
FLOAT_FIELDS = ("log_probs", "values", "rewards", "bootstrap_values", "next_values")
BOOL_FIELDS = ("dones", "truncated", "trainable")


def test_the_atari_schema_sends_the_standard_fields() -> None:
    assert set(SENT) == {"observations", *FLOAT_FIELDS, *BOOL_FIELDS, "actions"}
    assert ATARI_SPEC.array_layout()["observations"] == (np.dtype(np.uint8), (N, 4, 84, 84))


def atari_step(seq: int = 0, seed: int = 0) -> StepMessage:
    """A valid Atari-like step: 8 envs of 4x84x84 uint8 frames, int64 actions."""
    rng = np.random.default_rng(seed)
    dones = np.array([0, 1, 0, 0, 1, 0, 0, 0], dtype=bool)
    truncated = np.array([0, 1, 0, 0, 0, 0, 0, 0], dtype=bool)
    return StepMessage(
        actor_id=ACTOR,
        incarnation=INCARNATION,
        seq=seq,
        policy_version=7,
        revision=2,
        fields={
            "observations": rng.integers(0, 256, size=(N, 4, 84, 84), dtype=np.uint8),
            "actions": rng.integers(0, 4, size=N, dtype=np.int64),
            "log_probs": -np.abs(rng.normal(size=N)).astype(np.float32),
            "values": rng.normal(size=N).astype(np.float32),
            "rewards": rng.normal(size=N).astype(np.float32),
            "dones": dones,
            "truncated": truncated,
            "bootstrap_values": np.where(truncated, 0.5, 0.0).astype(np.float32),
            "next_values": rng.normal(size=N).astype(np.float32),
            "trainable": np.ones(N, dtype=bool),
        },
        episode_returns=[12.0, 3.5],
        episode_lengths=[400, 77],
    )


def with_fields(msg: StepMessage, **changes: Any) -> StepMessage:
    """A copy of ``msg`` with some of its arrays replaced."""
    return replace(msg, fields={**msg.fields, **changes})


def known_spec(actor_id: str, incarnation: str) -> StepSpec | None:
    return ATARI_SPEC if (actor_id, incarnation) == (ACTOR, INCARNATION) else None


def step_header(**changes: Any) -> dict[str, Any]:
    """The header map of a step message (actor "actor", incarnation "inc", seq 0, arrays inline), built by hand."""
    return {
        "protocol": PROTOCOL_VERSION,
        "type": "step",
        "actor_id": "actor",
        "incarnation": "inc",
        "seq": 0,
        "policy_version": 0,
        "revision": 0,
        "slot": None,
        "episode_returns": [],
        "episode_lengths": [],
        **changes,
    }


def step_obj() -> dict[str, Any]:
    """A valid step message to alter into a malformed one: its header map, with its arrays under
    ``"fields"`` (frames by :func:`pack_step`)."""
    msg = atari_step()
    header = msgpack.unpackb(encode_step(msg, ATARI_SPEC)[0], raw=False)
    return {**header, "fields": dict(msg.fields)}


def put(obj: dict[str, Any], name: str, value: Any) -> None:
    """Set a field of :func:`step_obj`'s map: arrays live in ``obj["fields"]``, the rest at the top."""
    (obj["fields"] if name in SENT else obj)[name] = value


def wire_array(array: np.ndarray) -> dict[str, Any]:
    """An array map of a control message built by hand (independent of the encoder)."""
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def stack_frames(array: np.ndarray) -> list[bytes]:
    """The two frames of a stacked field with every row whole, built by hand: flags all 1, then the
    newest frame of every row and the older frames of every row (any dtype: its bytes)."""
    rows = np.ascontiguousarray(array).view(np.uint8).reshape(array.shape[0], array.shape[1], -1)
    return [b"\x01" * array.shape[0], rows[:, -1].tobytes() + rows[:, :-1].tobytes()]


def pack_step(obj: dict[str, Any], spec: StepSpec = ATARI_SPEC) -> list[bytes]:
    """The frames of :func:`step_obj`'s map, built by hand (independent of the encoder, no checks):
    the header, then each field of ``obj["fields"]`` in the spec's order (a stacked field as
    :func:`stack_frames`, raw bytes as they are), then any field the spec does not know."""
    fields = dict(obj["fields"])
    frames = [msgpack.packb({key: value for key, value in obj.items() if key != "fields"})]
    for item in spec.schema.sent:
        if item.name in fields:
            value = fields.pop(item.name)
            if isinstance(value, bytes):
                frames.append(value)
            else:
                frames.extend(
                    stack_frames(value) if item.name in spec.stacked else [value.tobytes()]
                )
    return frames + [
        value if isinstance(value, bytes) else value.tobytes() for value in fields.values()
    ]


def rejection(frames: Any, decoder: str = "step") -> MessageRejected:
    """The rejection of a step message (its frames; one bytes object: a message of that one frame) or
    of a control frame."""
    with pytest.raises(MessageRejected) as info:
        if decoder == "step":
            decode_step(
                frames if isinstance(frames, list) else [frames], known_spec, max_bytes=MAX_BYTES
            )
        else:
            decode_message(frames, max_bytes=MAX_BYTES)
    assert info.value.reason in REJECTION_REASONS
    return info.value


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------


def assert_steps_equal(a: StepMessage, b: StepMessage) -> None:
    for name in (
        "actor_id",
        "incarnation",
        "seq",
        "policy_version",
        "revision",
        "episode_returns",
        "episode_lengths",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert a.fields.keys() == b.fields.keys()
    for name in a.fields:
        x, y = a.fields[name], b.fields[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_step_round_trip_atari() -> None:
    msg = atari_step(seq=41)
    decoded = decode_step(encode_step(msg, ATARI_SPEC), known_spec, max_bytes=MAX_BYTES)
    assert isinstance(decoded, StepMessage)
    assert_steps_equal(msg, decoded)
    assert decoded.seq == 41


def test_step_round_trip_vector_obs_and_non_contiguous_inputs() -> None:
    spec = StepSpec(num_envs=3, schema=default_schema((4,), np.float32, (2,), np.float32))
    big = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    msg = StepMessage(
        actor_id="a",
        incarnation="b",
        seq=0,
        policy_version=0,
        fields={
            "observations": big[:, ::2],  # strided view, not C-contiguous
            "actions": np.asfortranarray(np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)),
            "log_probs": np.array([-0.1, -0.2, -0.3], dtype=np.float32),
            "values": np.zeros(3, np.float32),
            "rewards": np.ones(3, np.float32),
            "dones": np.zeros(3, bool),
            "truncated": np.zeros(3, bool),
            "bootstrap_values": np.zeros(3, np.float32),
            "next_values": np.zeros(3, np.float32),
            "trainable": np.array([True, False, True]),
        },
    )
    decoded = decode_step(encode_step(msg, spec), lambda a, i: spec, max_bytes=MAX_BYTES)
    np.testing.assert_array_equal(
        decoded.fields["observations"], [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20, 22]]
    )
    np.testing.assert_array_equal(decoded.fields["actions"], [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(decoded.fields["trainable"], [True, False, True])
    assert decoded.num_envs == 3
    assert decoded.episode_returns == [] and decoded.episode_lengths == []


def test_control_round_trips() -> None:
    join = JoinRequest(actor_id=ACTOR, incarnation=INCARNATION, num_envs=8, hostname="box-1")
    assert decode_message(encode_join_request(join), max_bytes=MAX_BYTES) == join

    beat = Heartbeat(
        ACTOR,
        INCARNATION,
        seq=12,
        policy_version=3,
        env_steps_per_second=1520.5,
        policy_lag=1.25,
        episodes=9,
    )
    assert decode_message(encode_heartbeat(beat), max_bytes=MAX_BYTES) == beat

    for status in ("ok", "rejoin", "stop"):
        reply = HeartbeatReply(status=status, policy_version=4)
        assert decode_message(encode_heartbeat_reply(reply), max_bytes=MAX_BYTES) == reply

    leave = Leave(ACTOR, INCARNATION)
    assert decode_message(encode_leave(leave), max_bytes=MAX_BYTES) == leave


def test_a_join_request_names_the_precision_of_the_actors_forward_passes() -> None:
    """Protocol 7: float32 unless the actor says bfloat16; another name is refused on both sides, and
    a request without the field (an older actor) is a schema rejection."""
    join = JoinRequest(ACTOR, INCARNATION, 8, "box-1")
    assert (
        decode_message(encode_join_request(join), max_bytes=MAX_BYTES).inference_precision
        == "float32"
    )
    rounded = replace(join, inference_precision="bfloat16")
    assert decode_message(encode_join_request(rounded), max_bytes=MAX_BYTES) == rounded
    with pytest.raises(ValueError, match="inference_precision: expected one of"):
        encode_join_request(replace(join, inference_precision="float16"))
    obj = msgpack.unpackb(encode_join_request(join), raw=False)
    with pytest.raises(
        MessageRejected, match="value_range: inference_precision: expected one of .* got 'int8'"
    ):
        decode_message(msgpack.packb({**obj, "inference_precision": "int8"}), max_bytes=MAX_BYTES)
    del obj["inference_precision"]
    with pytest.raises(
        MessageRejected, match=r"schema: .*missing fields \['inference_precision'\]"
    ):
        decode_message(msgpack.packb(obj), max_bytes=MAX_BYTES)


def test_join_reply_and_weights_round_trip() -> None:
    weights = {
        "conv.weight": np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2),
        "conv.bias": np.array([0.5, -0.5], dtype=np.float32),
        "steps": np.array(3, dtype=np.int64),  # 0-d
    }
    env_config = {
        "env_id": "ALE/Breakout-v5",
        "max_episode_steps": 27000,
        "clip_rewards": True,
        "seed": 1,
        "lr": 2.5e-4,
        "none": None,
    }
    reply = JoinReply(True, "", 2, ATARI_SPEC, env_config, 5, weights)
    decoded = decode_message(encode_join_reply(reply), max_bytes=MAX_BYTES)
    assert isinstance(decoded, JoinReply)
    assert (decoded.accepted, decoded.reason, decoded.actor_index, decoded.policy_version) == (
        True,
        "",
        2,
        5,
    )
    assert decoded.spec == ATARI_SPEC
    assert decoded.env_config == env_config
    assert list(decoded.weights) == list(weights)  # order kept (load_state_dict)
    for name, array in weights.items():
        assert (
            decoded.weights[name].dtype == array.dtype
            and decoded.weights[name].shape == array.shape
        )
        np.testing.assert_array_equal(decoded.weights[name], array)

    refused = decode_message(
        encode_join_reply(JoinReply(False, "full", -1, None, {}, 5)), max_bytes=MAX_BYTES
    )
    assert (
        refused.accepted,
        refused.reason,
        refused.actor_index,
        refused.spec,
        refused.weights,
    ) == (False, "full", -1, None, {})

    message = decode_message(encode_weights(WeightsMessage(6, weights)), max_bytes=MAX_BYTES)
    assert isinstance(message, WeightsMessage) and (message.policy_version, message.revision) == (
        6,
        0,
    )
    np.testing.assert_array_equal(message.weights["conv.weight"], weights["conv.weight"])
    within = decode_message(
        encode_weights(WeightsMessage(6, weights, revision=3)), max_bytes=MAX_BYTES
    )
    assert (within.policy_version, within.revision) == (6, 3)
    with pytest.raises(ValueError, match="revision"):
        encode_weights(WeightsMessage(6, weights, revision=-1))
    for revision in (-1, 1.5, None):
        frame = msgpack.packb(
            {
                "protocol": PROTOCOL_VERSION,
                "type": "weights",
                "policy_version": 6,
                "revision": revision,
                "weights": {},
            }
        )
        with pytest.raises(MessageRejected, match="revision"):
            decode_message(frame, max_bytes=MAX_BYTES)


def test_step_spec_dict_round_trip_and_validation() -> None:
    schema = default_schema((3, 2), np.dtype(">f4"), (2,), np.int32)
    spec = StepSpec(4, schema)
    as_dict = spec.to_dict()
    assert as_dict == {"num_envs": 4, "steps_per_message": 1, "schema": schema.to_dict()}
    fields = {f["name"]: f for f in as_dict["schema"]["fields"]}
    assert (fields["observations"]["shape"], fields["observations"]["dtype"]) == ([3, 2], ">f4")
    assert (fields["actions"]["shape"], fields["actions"]["dtype"]) == ([2], "<i4")
    decoded = StepSpec.from_dict(msgpack.unpackb(msgpack.packb(as_dict)))
    assert decoded == spec and decoded.array_layout() == spec.array_layout()
    assert decoded.array_layout()["observations"] == (np.dtype(">f4"), (4, 3, 2))
    atari = StepSpec.from_dict(msgpack.unpackb(msgpack.packb(ATARI_SPEC.to_dict())))
    assert atari == ATARI_SPEC and atari.schema.distribution == Categorical(4)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_envs"):
            StepSpec(bad, schema)
    with pytest.raises(ValueError, match="observations"):
        default_schema((4,), object)
    with pytest.raises(ValueError, match="actions"):
        default_schema((4,), np.float32, action_shape=(-1,))

    def field_changed(name: str, **change: Any) -> dict[str, Any]:
        changed = [{**f, **change} if f["name"] == name else f for f in as_dict["schema"]["fields"]]
        return {**as_dict, "schema": {**as_dict["schema"], "fields": changed}}

    for bad_spec in (
        field_changed("observations", dtype="|O"),  # never parsed by np.dtype
        field_changed("observations", dtype="<U4"),
        field_changed("observations", shape=[-1]),
        field_changed("actions", sent="yes"),
        {**as_dict, "extra": 1},
        {**as_dict, "num_envs": 0},
        {**as_dict, "num_envs": "4"},
        {"num_envs": 4},
        {**as_dict, "schema": {"fields": [], "distribution": None}},
        [4],
    ):
        with pytest.raises(MessageRejected) as info:
            StepSpec.from_dict(bad_spec)
        assert info.value.reason == "schema", bad_spec


def test_encoder_errors_name_the_field() -> None:
    msg = atari_step()
    with pytest.raises(TypeError, match="observations"):
        encode_step(with_fields(msg, observations=np.empty(N, dtype=object)), ATARI_SPEC)
    with pytest.raises(TypeError, match="rewards"):
        encode_step(with_fields(msg, rewards=[0.0] * N), ATARI_SPEC)
    with pytest.raises(TypeError, match="rewards.*float32.*float64"):
        encode_step(with_fields(msg, rewards=np.zeros(N)), ATARI_SPEC)
    with pytest.raises(ValueError, match=r"actions: expected shape \[8\], received \[8, 1\]"):
        encode_step(with_fields(msg, actions=np.zeros((N, 1), np.int64)), ATARI_SPEC)
    with pytest.raises(ValueError, match="fields: expected"):
        encode_step(with_fields(msg, rewards_raw=np.zeros(N, np.float32)), ATARI_SPEC)
    with pytest.raises(ValueError, match="spec"):
        encode_step(msg)  # arrays inline need the spec (frame order, stacked fields)
    with pytest.raises(ValueError, match="episode_lengths"):
        encode_step(replace(msg, episode_lengths=[1]), ATARI_SPEC)
    with pytest.raises(ValueError, match="seq"):
        encode_step(replace(msg, seq=-1), ATARI_SPEC)
    with pytest.raises(ValueError, match="status"):
        encode_heartbeat_reply(HeartbeatReply("maybe", 0))
    with pytest.raises(TypeError, match="env_config"):
        encode_join_reply(JoinReply(True, "", 0, ATARI_SPEC, {"x": [1, 2]}, 0))


def test_encoding_is_thread_safe() -> None:
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for seq in range(30):
                msg = atari_step(seq=seq, seed=seed)
                assert_steps_equal(
                    msg, decode_step(encode_step(msg, ATARI_SPEC), known_spec, max_bytes=MAX_BYTES)
                )
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# zero copy
# ---------------------------------------------------------------------------------------------


def test_decoded_arrays_are_read_only_views_of_the_received_frames() -> None:
    """Each array is a view of its own frame (no copy), read-only; a stacked field is rebuilt where it
    is written, or into a private read-only array."""
    msg = atari_step()
    frames = [
        bytes(frame) for frame in encode_step(msg, ATARI_SPEC)
    ]  # as received: one buffer per frame
    decoded = decode_step(frames, known_spec, max_bytes=MAX_BYTES)
    assert set(decoded.fields) == set(SENT)
    for name in SENT:
        array = decoded.fields[name]
        if name in ATARI_SPEC.stacked:
            assert isinstance(array, StackedRows)
            rebuilt = np.asarray(array)
            assert not rebuilt.flags.writeable and np.asarray(array) is rebuilt  # made once
            copied = np.array(array, copy=True)  # a copy asked for is private and writable
            assert (
                copied is not rebuilt and copied.flags.writeable and np.array_equal(copied, rebuilt)
            )
            assert not any(
                np.shares_memory(rebuilt, np.frombuffer(frame, np.uint8)) for frame in frames
            )
            continue
        assert not array.flags.writeable, name
        root = array
        while isinstance(root, np.ndarray):
            root = root.base
        root = root.obj if isinstance(root, memoryview) else root
        assert isinstance(root, bytes) and len(root) == array.nbytes and root in frames, (
            name
        )  # a view, not a copy
    with pytest.raises(ValueError):
        decoded.fields["rewards"].flags.writeable = True  # bytes-backed: cannot be made writeable


def test_encoder_passes_the_array_buffer_without_copying() -> None:
    """Frames of plain fields are views of the message's arrays; a stack's data is a fresh buffer."""
    msg = atari_step()
    frames = encode_step(msg, ATARI_SPEC)
    assert len(frames) == ATARI_SPEC.frame_count == 1 + len(SENT) + 1
    values = frames[2 + SENT.index("values")]  # the header and the observations' flags come first
    assert isinstance(values, memoryview) and np.shares_memory(
        np.frombuffer(values, np.float32), msg.fields["values"]
    )
    assert isinstance(frames[2], bytearray) and bytes(frames[1]) == b"\x01" * N


# ---------------------------------------------------------------------------------------------
# rejections
# ---------------------------------------------------------------------------------------------


def test_unaltered_step_obj_is_accepted() -> None:
    """Baseline for the crafted frames below: only the alteration makes them fail."""
    assert_steps_equal(
        atari_step(), decode_step(pack_step(step_obj()), known_spec, max_bytes=MAX_BYTES)
    )


def test_another_dtype_is_a_frame_of_another_length() -> None:
    """No dtype travels: a frame of the wrong dtype has the wrong byte length, named with the expected one."""
    obj = step_obj()
    put(obj, "rewards", np.zeros(N, dtype=np.float64))
    error = rejection(pack_step(obj))
    assert error.reason == "size"
    assert (
        "rewards" in error.detail
        and f"expected {4 * N} bytes" in error.detail
        and f"received {8 * N}" in error.detail
    )


@pytest.mark.parametrize(
    ("field", "array"),
    [
        ("observations", np.zeros((N, 4, 84, 84), dtype=np.float32)),
        ("actions", np.zeros(N, dtype=np.int32)),
        ("observations", np.zeros((N, 4, 84, 83), dtype=np.uint8)),
        ("observations", np.zeros((N - 1, 4, 84, 84), dtype=np.uint8)),
        ("log_probs", np.zeros(N + 1, dtype=np.float32)),
        ("dones", np.zeros(N - 1, dtype=bool)),
    ],
)
def test_frames_of_the_wrong_length_are_size_errors(field: str, array: np.ndarray) -> None:
    obj = step_obj()
    put(obj, field, array)
    error = rejection(pack_step(obj))
    assert error.reason == "size" and field in error.detail


@pytest.mark.parametrize(
    "field",
    ["actor_id", "seq", "policy_version", "revision", "episode_returns", "protocol", "slot"],
)
def test_missing_header_field(field: str) -> None:
    obj = step_obj()
    del obj[field]
    error = rejection(pack_step(obj))
    assert error.reason == ("protocol" if field == "protocol" else "schema")
    assert field in error.detail


@pytest.mark.parametrize("field", ["rewards", "trainable", "observations"])
def test_a_missing_frame_is_rejected(field: str) -> None:
    obj = step_obj()
    del obj["fields"][field]
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and f"expected {ATARI_SPEC.frame_count}" in error.detail


def test_extra_frames_and_header_fields() -> None:
    obj = step_obj()
    obj["fields"]["rewards_raw"] = np.zeros(N, np.float32)
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and f"received {ATARI_SPEC.frame_count + 1}" in error.detail
    obj = step_obj()
    obj["rewards_raw"] = 1.0  # in the header
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and "rewards_raw" in error.detail
    obj = step_obj()
    obj["fields"] = {}  # the header alone, no slot
    assert rejection(pack_step(obj)).reason == "schema"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", "3"),
        ("seq", -1),
        ("seq", True),
        ("seq", 2.0),
        ("policy_version", None),
        ("revision", -1),
        ("revision", 1.0),
        ("revision", None),
        ("actor_id", 7),
        ("actor_id", ""),
        ("incarnation", "x" * 1000),
        ("episode_returns", "12"),
        ("episode_lengths", [1.5, 2]),
        ("episode_lengths", [1]),  # not as long as episode_returns
        ("episode_returns", [1.0] * (N + 1)),
    ],
)
def test_wrong_typed_fields(field: str, value: Any) -> None:
    obj = step_obj()
    put(obj, field, value)
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and field.split("_")[0] in error.detail


def test_garbage_and_truncated_frames() -> None:
    """A broken header is garbage; an array frame cut short, grown, or a frame too many or too few is
    rejected by its length or the frame count, named."""
    frames = [bytes(frame) for frame in encode_step(atari_step(), ATARI_SPEC)]
    header, rest = frames[0], frames[1:]
    assert rejection(b"\xc1\x00\xff garbage").reason == "garbage"  # 0xc1 is never used in msgpack
    assert rejection([header[: len(header) // 2], *rest]).reason == "garbage"
    assert rejection([header[:-1], *rest]).reason == "garbage"
    assert rejection([header + b"\x00", *rest]).reason == "garbage"  # trailing data
    assert rejection(b"").reason == "garbage"
    assert rejection([]).reason == "garbage"
    rewards = 1 + 1 + SENT.index("rewards")  # the header and the observations' flags first
    for cut in (frames[rewards][:-1], frames[rewards] + b"\x00", frames[rewards] * 1000):
        error = rejection([*frames[:rewards], cut, *frames[rewards + 1 :]])
        assert error.reason == "size" and "rewards" in error.detail
    assert rejection(frames[:-1]).reason == "schema"  # the last frame missing
    assert rejection([*frames, frames[-1]]).reason == "schema"  # one too many
    assert rejection([frames[2], *frames[1:]]).reason in {
        "garbage",
        "schema",
    }  # a frame where the header goes


def test_a_stacked_fields_frames_must_match_its_flags() -> None:
    """The data frame of a stacked field holds exactly the newest frames plus the whole stacks its
    flags declare; flag bytes are 0 / 1; a newest-frame-only row has a stack to be rebuilt from."""
    frames = [bytes(frame) for frame in encode_step(atari_step(), ATARI_SPEC)]
    flags, data = frames[1], frames[2]
    for bad_data in (data[:-1], data + b"\x00", data[: N * 84 * 84]):
        error = rejection([frames[0], flags, bad_data, *frames[3:]])
        assert error.reason == "size" and "observations" in error.detail
    assert rejection([frames[0], flags[:-1], data, *frames[3:]]).reason == "size"
    assert rejection([frames[0], b"\x02" + flags[1:], data, *frames[3:]]).reason == "schema"
    one_frame_only = (
        b"\x00" + flags[1:]
    )  # env 0 sends its newest frame only: 3 * 84 * 84 bytes fewer
    without = data[: N * 84 * 84] + data[N * 84 * 84 + 3 * 84 * 84 :]
    error = rejection([frames[0], one_frame_only, without, *frames[3:]])
    assert error.reason == "schema" and "env 0" in error.detail and "no stack" in error.detail


def test_pickle_bytes_are_never_unpickled() -> None:
    for payload in (
        pickle.dumps(np.zeros(3)),
        pickle.dumps({"protocol": 1, "type": "step"}),
        pickle.dumps(atari_step(), protocol=0),
    ):
        assert rejection(payload).reason == "garbage"
        assert rejection(payload, decoder="message").reason == "garbage"


def test_a_pickled_payload_in_an_array_frame_is_only_bytes_of_the_wrong_length() -> None:
    obj = step_obj()
    put(obj, "rewards", pickle.dumps([1.0] * N))
    assert rejection(pack_step(obj)).reason == "size"


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_are_rejected(field: str, bad: float) -> None:
    obj = step_obj()
    values = np.zeros(N, np.float32)
    values[3] = bad
    put(obj, field, values)
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and field in error.detail


def test_nan_episode_return_and_float_observations() -> None:
    obj = step_obj()
    obj["episode_returns"] = [1.0, math.nan]
    assert rejection(pack_step(obj)).reason == "schema"

    spec = StepSpec(2, default_schema((3,), np.float32))
    obs = np.zeros((2, 3), np.float32)
    obs[1, 2] = np.inf
    zeros = np.zeros(2, np.float32)
    msg = StepMessage(
        "a",
        "b",
        0,
        0,
        {
            "observations": obs,
            "actions": np.zeros(2, np.int64),
            "log_probs": zeros,
            "values": zeros,
            "rewards": zeros,
            "dones": np.zeros(2, bool),
            "truncated": np.zeros(2, bool),
            "bootstrap_values": zeros,
            "next_values": zeros,
            "trainable": np.ones(2, bool),
        },
    )
    with pytest.raises(MessageRejected) as info:
        decode_step(encode_step(msg, spec), lambda a, i: spec, max_bytes=MAX_BYTES)
    assert info.value.reason == "schema" and "observations" in info.value.detail


def test_bool_bytes_other_than_zero_and_one() -> None:
    obj = step_obj()
    obj["fields"]["trainable"] = b"\x01\x02" + b"\x01" * (N - 2)
    error = rejection(pack_step(obj))
    assert error.reason == "schema" and "trainable" in error.detail


def test_truncated_without_done() -> None:
    obj = step_obj()
    put(obj, "truncated", np.array([0, 0, 1, 0, 0, 0, 0, 0], dtype=bool))  # env 2 not done
    error = rejection(pack_step(obj))
    # Finite, well-typed, but impossible: a rule between fields (step_schema.check_step_consistency).
    assert error.reason == "value_range" and "truncated" in error.detail


# Finite, well-typed values that no policy or env produces (formerly checked in ingest.py): they
# are rejected at the wire, the trust boundary, with reason "value_range" naming the field.
@pytest.mark.parametrize(
    ("field", "bad_value"),
    [
        ("actions", np.array([0, 4, 0, 0, 0, 0, 0, 0], np.int64)),  # 4 actions: 0..3
        ("actions", np.array([-1, 0, 0, 0, 0, 0, 0, 0], np.int64)),
        ("rewards", np.array([0.0, 3e38, 0, 0, 0, 0, 0, 0], np.float32)),
        ("values", np.array([-2e6, 0, 0, 0, 0, 0, 0, 0], np.float32)),
        ("next_values", np.array([0, 0, 0, 0, 0, 0, 0, 2e6], np.float32)),
        ("log_probs", np.array([0.5, -0.1, 0, 0, 0, 0, 0, 0], np.float32)),  # a probability above 1
        ("log_probs", np.array([-2e4, -0.1, 0, 0, 0, 0, 0, 0], np.float32)),
        (
            "bootstrap_values",
            np.array([1.0, 0, 0, 0, 0, 0, 0, 0], np.float32),
        ),  # env 0 not truncated
        (
            "bootstrap_values",
            np.array([0, 5e6, 0, 0, 0, 0, 0, 0], np.float32),
        ),  # env 1 truncated, but huge
    ],
)
def test_impossible_values_are_rejected_naming_the_field(field: str, bad_value: np.ndarray) -> None:
    frames = encode_step(with_fields(atari_step(), **{field: bad_value}), ATARI_SPEC)
    error = rejection(frames)
    assert error.reason == "value_range" and error.detail.startswith(field), error.detail


def test_extreme_but_possible_values_are_accepted() -> None:
    msg = with_fields(
        atari_step(),
        actions=np.array([0, 3, 0, 3, 0, 3, 0, 3], np.int64),
        rewards=np.full(N, 1e6, np.float32),
        log_probs=np.zeros(N, np.float32),  # a certain action
        bootstrap_values=np.array([0, -1e6, 0, 0, 0, 0, 0, 0], np.float32),  # env 1 truncated
    )
    decoded = decode_step(encode_step(msg, ATARI_SPEC), known_spec, max_bytes=MAX_BYTES)
    assert_steps_equal(msg, decoded)


def test_huge_episode_return_is_a_value_range_error() -> None:
    obj = step_obj()
    obj["episode_returns"] = [1.0, 1e13]
    error = rejection(pack_step(obj))
    assert error.reason == "value_range" and "episode_returns" in error.detail


def test_a_gaussian_log_density_may_be_positive() -> None:
    """A narrow Gaussian has density above 1: positive log probs are valid for Box actions only."""
    schema = build_schema({"": ((3,), np.float32)}, DiagGaussian([-2.0, -2.0], [2.0, 2.0]))
    spec = StepSpec(2, schema)
    zeros = np.zeros(2, np.float32)
    fields = {
        "observations": np.zeros((2, 3), np.float32),
        "actions": np.array([[5.0, -5.0], [0.1, 0.2]], np.float32),
        "log_probs": np.array([3.5, -1.0], np.float32),
        "values": zeros,
        "rewards": zeros,
        "dones": np.zeros(2, bool),
        "truncated": np.zeros(2, bool),
        "bootstrap_values": zeros,
        "next_values": zeros,
        "trainable": np.ones(2, bool),
        "action_mean": np.zeros((2, 2), np.float32),
        "action_std": np.full((2, 2), 0.01, np.float32),
    }
    decoded = decode_step(
        encode_step(StepMessage("a", "b", 0, 0, fields), spec),
        lambda a, i: spec,
        max_bytes=MAX_BYTES,
    )
    # Actions outside the Box are stored as sampled (the env boundary clips them).
    np.testing.assert_array_equal(decoded.fields["actions"], fields["actions"])
    with pytest.raises(MessageRejected) as info:
        decode_step(
            encode_step(
                StepMessage("a", "b", 0, 0, {**fields, "action_std": np.zeros((2, 2), np.float32)}),
                spec,
            ),
            lambda a, i: spec,
            max_bytes=MAX_BYTES,
        )
    assert info.value.reason == "value_range" and "action_std" in info.value.detail


def test_oversized_message_is_rejected_before_decoding() -> None:
    frames = encode_step(atari_step(), ATARI_SPEC)
    size = sum(memoryview(frame).nbytes for frame in frames)
    with pytest.raises(MessageRejected) as info:
        decode_step(frames, known_spec, max_bytes=size - 1)
    assert info.value.reason == "oversized"
    assert decode_step(frames, known_spec, max_bytes=size).seq == 0
    garbage = b"\xc1" * 100  # would be "garbage" if it were decoded
    with pytest.raises(MessageRejected) as info:
        decode_message(garbage, max_bytes=99)
    assert info.value.reason == "oversized"


def test_protocol_version_is_11() -> None:
    assert PROTOCOL_VERSION == 11 and step_obj()["protocol"] == 11


def test_stop_notice_round_trip_and_rejections() -> None:
    from oakemu_core.transport.control import StopNotice, encode_stop

    assert decode_message(
        encode_stop(StopNotice("env-step budget reached")), max_bytes=MAX_BYTES
    ) == StopNotice("env-step budget reached")
    assert decode_message(encode_stop(StopNotice("")), max_bytes=MAX_BYTES) == StopNotice("")
    with pytest.raises(ValueError, match="reason"):
        encode_stop(StopNotice("x" * 5000))
    for bad in ({"reason": 3}, {"reason": "x" * 5000}, {}, {"reason": "a", "extra": 1}):
        frame = msgpack.packb({"protocol": PROTOCOL_VERSION, "type": "stop", **bad})
        assert rejection(frame, decoder="message").reason == "schema"


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, "10", 10.0, None])
def test_wrong_protocol(version: Any) -> None:
    obj = step_obj()
    obj["protocol"] = version
    assert rejection(pack_step(obj)).reason == "protocol"
    beat = msgpack.unpackb(encode_heartbeat(Heartbeat("a", "b", 0, 0, 1.0, 0.0, 0)))
    beat["protocol"] = version
    assert rejection(msgpack.packb(beat), decoder="message").reason == "protocol"


def test_unknown_actor_and_spec_lookup_arguments() -> None:
    calls: list[tuple[str, str]] = []

    def spec_for(actor_id: str, incarnation: str) -> StepSpec | None:
        calls.append((actor_id, incarnation))
        return None

    frames = encode_step(atari_step(), ATARI_SPEC)
    with pytest.raises(MessageRejected) as info:
        decode_step(frames, spec_for, max_bytes=MAX_BYTES)
    assert info.value.reason == "unknown_actor" and ACTOR in info.value.detail
    assert calls == [(ACTOR, INCARNATION)]
    obj = step_obj()
    obj["incarnation"] = "old-incarnation"  # same actor, previous start
    assert rejection(pack_step(obj)).reason == "unknown_actor"


def test_wrong_message_type_for_each_decoder() -> None:
    assert rejection(encode_heartbeat(Heartbeat("a", "b", 0, 0, 1.0, 0.0, 0))).reason == "schema"
    assert rejection(encode_step(atari_step(), ATARI_SPEC)[0], decoder="message").reason == "schema"
    assert (
        rejection(
            msgpack.packb({"protocol": PROTOCOL_VERSION, "type": "nope"}), decoder="message"
        ).reason
        == "schema"
    )
    assert rejection(msgpack.packb([PROTOCOL_VERSION, "step"])).reason == "schema"  # not a map


@pytest.mark.parametrize(
    "frame",
    [
        b"\xdd\xff\xff\xff\xff",  # array header declaring 2**32-1 items
        b"\xdf\xff\xff\xff\xff",  # map header declaring 2**32-1 pairs
        b"\xc6\xff\xff\xff\xff\x00",  # bin header declaring 4 GiB
        b"\xdb\xff\xff\xff\xff",  # str header declaring 4 GiB
        msgpack.packb(msgpack.ExtType(5, b"abc")),  # ext types are not part of the protocol
        msgpack.packb({1: 2}),  # non-str map key
        b"\x91" * 5000,  # deeply nested arrays
    ],
)
def test_msgpack_level_limits(frame: bytes) -> None:
    assert rejection(frame).reason in {"garbage", "schema"}
    assert rejection(frame, decoder="message").reason in {"garbage", "schema"}


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"type": "heartbeat_reply", "status": "maybe", "policy_version": 0}, "schema"),
        (
            {
                "type": "heartbeat",
                "actor_id": "a",
                "incarnation": "b",
                "seq": 0,
                "policy_version": 0,
                "env_steps_per_second": math.nan,
                "policy_lag": 0.0,
                "episodes": 0,
            },
            "schema",
        ),
        (
            {"type": "join", "actor_id": "a", "incarnation": "b", "num_envs": 0, "hostname": "h"},
            "schema",
        ),
        ({"type": "leave", "actor_id": "a"}, "schema"),
        (
            {
                "type": "weights",
                "policy_version": 1,
                "revision": 0,
                "weights": {"w": {"dtype": "|O", "shape": [1], "data": b"x"}},
            },
            "dtype",
        ),
        (
            {
                "type": "weights",
                "policy_version": 1,
                "revision": 0,
                "weights": {"w": {"dtype": "<f4", "shape": [10**9], "data": b"xxxx"}},
            },
            "size",
        ),
        (
            {
                "type": "weights",
                "policy_version": 1,
                "revision": 0,
                "weights": {"w": wire_array(np.array([np.nan], np.float32))},
            },
            "schema",
        ),
        (
            {
                "type": "join_reply",
                "accepted": True,
                "reason": "",
                "actor_index": 0,
                "spec": None,
                "env_config": {},
                "policy_version": 0,
                "weights": {},
            },
            "schema",
        ),
        (
            {
                "type": "join_reply",
                "accepted": True,
                "reason": "",
                "actor_index": 0,
                "spec": {**ATARI_SPEC.to_dict(), "schema": {"fields": "<U1", "distribution": None}},
                "env_config": {},
                "policy_version": 0,
                "weights": {},
            },
            "schema",
        ),
        (
            {
                "type": "join_reply",
                "accepted": True,
                "reason": "",
                "actor_index": 0,
                "spec": {
                    **ATARI_SPEC.to_dict(),
                    "schema": {**ATARI_SCHEMA.to_dict(), "distribution": {"kind": "tuple"}},
                },
                "env_config": {},
                "policy_version": 0,
                "weights": {},
            },
            "schema",
        ),
        (
            {
                "type": "join_reply",
                "accepted": False,
                "reason": "",
                "actor_index": -1,
                "spec": None,
                "env_config": {"env_id": ["list"]},
                "policy_version": 0,
                "weights": {},
            },
            "schema",
        ),
    ],
)
def test_control_message_rejections(message: dict[str, Any], reason: str) -> None:
    frame = msgpack.packb({"protocol": PROTOCOL_VERSION, **message})
    assert rejection(frame, decoder="message").reason == reason


def test_message_rejected_carries_reason_and_detail() -> None:
    error = MessageRejected("size", "observations: 3 bytes")
    assert (error.reason, error.detail) == ("size", "observations: 3 bytes")
    assert "size" in str(error) and "observations" in str(error)


# ---------------------------------------------------------------------------------------------
# fuzzing: nothing but MessageRejected escapes, and what is accepted matches the spec
# ---------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_both(frame: bytes) -> None:
    for decode in (
        lambda: decode_step([frame], known_spec, max_bytes=MAX_BYTES),
        lambda: decode_message(frame, max_bytes=MAX_BYTES),
    ):
        try:
            result = decode()
        except MessageRejected as error:
            assert error.reason in REJECTION_REASONS
        else:
            if isinstance(result, StepMessage):
                assert_matches_spec(result, ATARI_SPEC)


def assert_matches_spec(result: StepMessage, spec: StepSpec) -> None:
    """An accepted step has exactly the spec's arrays, dtypes and shapes, and passes its value checks."""
    assert result.fields.keys() == spec.array_layout().keys()
    for name, (dtype, shape) in spec.array_layout().items():
        array = result.fields[name]
        assert array.dtype == dtype and array.dtype.str == dtype.str and array.shape == shape, name
        assert spec.schema[name].check_values(array) is None, name
    assert check_step_consistency(spec.schema, result.fields) is None


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(frame: bytes) -> None:
    decode_both(frame)


_SMALL_STEP_SPEC = StepSpec(num_envs=2, schema=build_schema({"": ((2,), np.uint8)}, Categorical(2)))


@FUZZ
@given(st.data())
def test_fuzz_mutated_valid_frames(data: st.DataObject) -> None:
    halves = np.array([0.5, -0.5], np.float32)
    msg = StepMessage(
        "actor-0",
        "9f1c2b",
        1,
        2,
        {
            "observations": np.array([[1, 2], [3, 4]], np.uint8),
            "actions": np.array([0, 1], np.int64),
            "log_probs": np.array([-0.5, -0.25], np.float32),
            "values": halves,
            "rewards": halves,
            "dones": np.array([True, False]),
            "truncated": np.array([True, False]),
            "bootstrap_values": np.array([0.5, 0.0], np.float32),
            "next_values": halves,
            "trainable": np.array([True, True]),
        },
        [1.0],
        [3],
    )
    frames = [bytearray(frame) for frame in encode_step(msg, _SMALL_STEP_SPEC)]
    decode_step(
        frames, lambda a, i: _SMALL_STEP_SPEC, max_bytes=MAX_BYTES
    )  # the unmutated message is valid
    for _ in range(data.draw(st.integers(1, 4))):
        frame = frames[data.draw(st.integers(0, len(frames) - 1))]
        if frame:
            frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # one frame cut short
        index = data.draw(st.integers(0, len(frames) - 1))
        frames[index] = frames[index][: data.draw(st.integers(0, len(frames[index])))]
    if data.draw(st.booleans()):  # a frame dropped or repeated
        index = data.draw(st.integers(0, len(frames) - 1))
        frames = (
            frames[:index] + frames[index + 1 :]
            if data.draw(st.booleans())
            else frames[:index] + frames[index:]
        )
    try:
        result = decode_step(
            [bytes(frame) for frame in frames], lambda a, i: _SMALL_STEP_SPEC, max_bytes=MAX_BYTES
        )
    except MessageRejected as error:
        assert error.reason in REJECTION_REASONS
    else:
        assert_matches_spec(result, _SMALL_STEP_SPEC)
        assert all(math.isfinite(x) for x in result.fields["rewards"].tolist())


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_field_names = st.sampled_from(
    sorted({"protocol", "type", "dtype", "shape", "data", *steps._STEP_FIELDS, *SENT})
)


@FUZZ
@given(
    st.dictionaries(_field_names, _msgpack_values, max_size=8),
    st.sampled_from(sorted(control._CONTROL_DECODERS) + ["step"]),
)
def test_fuzz_structured_maps(obj: dict[str, Any], message_type: str) -> None:
    obj.setdefault("protocol", PROTOCOL_VERSION)
    obj.setdefault("type", message_type)
    decode_both(msgpack.packb(obj))
