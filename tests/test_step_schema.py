"""Tests for oakemu_core.step_schema: one declared schema drives storage (RolloutBuffer), the wire
(encode_step / decode_step), the actor's step buffers and PPO minibatches; value checks of masks
and Gaussian parameters; plain-value round trips."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from oakemu_core import PPOActorStepBuffers, RolloutBuffer
from oakemu_core.envs import EnvSpec
from oakemu_core.policy.distributions import Bernoulli, Categorical, DiagGaussian, MultiCategorical
from oakemu_core.policy.schemas import schema_for_env, schema_from_dict
from oakemu_core.step_schema import (
    SMALL_ARRAY_SIZE,
    StepField,
    StepSchema,
    build_schema,
    check_step_consistency,
    check_step_values,
    default_schema,
    resolve_schema,
)
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step
from tests.transport.test_wire import pack_step, step_header

MAX_BYTES = 1 << 22


def valid_fields(schema: StepSchema, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid arrays for every *sent* field of ``schema`` (n envs), derived from the schema only."""
    rng = np.random.default_rng(seed)
    fields: dict[str, np.ndarray] = {}
    for item in schema.sent:
        shape = (n, *item.shape)
        if item.dtype == np.bool_:
            array = (
                np.ones(shape, bool)
                if item.name in ("trainable", "action_mask")
                else np.zeros(shape, bool)
            )
        elif item.dtype.kind in "iu":
            high = (
                1
                if item.high is None
                else np.broadcast_to(item.high, item.shape).astype(np.int64) + 1
            )
            array = rng.integers(0, high, size=shape).astype(item.dtype)
        elif item.name in ("log_probs",):
            array = -rng.random(shape).astype(item.dtype)
        elif item.name in ("bootstrap_values",):
            array = np.zeros(shape, item.dtype)
        elif item.name == "action_std":
            array = (0.5 + rng.random(shape)).astype(item.dtype)
        else:
            array = rng.normal(size=shape).astype(item.dtype)
        fields[item.name] = array
    return fields


def decode(schema: StepSchema, fields: dict[str, np.ndarray], n: int) -> StepMessage:
    spec = StepSpec(n, schema)
    frames = encode_step(StepMessage("actor", "inc", 0, 0, fields), spec)
    return decode_step(frames, lambda *_: spec, max_bytes=MAX_BYTES)


def rejected(schema: StepSchema, fields: dict[str, np.ndarray], n: int) -> MessageRejected:
    """The rejection of a message with ``fields`` whose frames are built by hand (the encoder refuses
    wrong dtypes and shapes)."""
    spec = StepSpec(n, schema)
    frames = pack_step({**step_header(), "fields": fields}, spec)
    with pytest.raises(MessageRejected) as info:
        decode_step(frames, lambda *_: spec, max_bytes=MAX_BYTES)
    return info.value


def stored_row(fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a writer passes to the buffer: the sent fields (truncated / next_values are ignored)."""
    return dict(fields)


# ---------------------------------------------------------------------------------- one schema, three uses
def test_a_field_added_to_the_schema_reaches_storage_wire_step_buffers_and_minibatches() -> None:
    base = build_schema({"": ((4,), np.float32)}, Categorical(3))
    schema = base.with_field(StepField("my_extra", (3,), np.float32, minibatch=True))
    assert "my_extra" in schema and "my_extra" not in base
    n, steps = 2, 3

    # Storage: allocated as (T, N, 3) float32, counted in the memory estimate.
    with RolloutBuffer(steps, n, schema=schema) as buffer:
        assert (
            buffer.field("my_extra").shape == (steps, n, 3)
            and buffer.field("my_extra").dtype == np.float32
        )
        assert RolloutBuffer.estimate_memory_bytes(steps, n, schema) == (
            RolloutBuffer.estimate_memory_bytes(steps, n, base) + steps * n * 3 * 4
        )
        assert buffer.memory_bytes == RolloutBuffer.estimate_memory_bytes(steps, n, schema)

        # Required and validated on write, the message naming the field.
        row = valid_fields(schema, n)
        with pytest.raises(ValueError, match="^my_extra: required field missing"):
            buffer.write(0, np.arange(n), {k: v for k, v in row.items() if k != "my_extra"})
        with pytest.raises(
            ValueError, match=r"^my_extra: expected shape \(2, 3\) and dtype float32.*float64"
        ):
            buffer.write(0, np.arange(n), {**row, "my_extra": row["my_extra"].astype(np.float64)})
        with pytest.raises(
            ValueError, match=r"^my_extra: expected shape \(2, 3\).*received shape \(2, 2\)"
        ):
            buffer.add(**{**row, "my_extra": np.zeros((n, 2), np.float32)})
        assert buffer.step == 0

        # The wire: sent, round-tripped, and refused by reason when wrong.
        assert "my_extra" in StepSpec(n, schema).array_layout()
        sent_rows = []
        for t in range(steps):
            fields = valid_fields(schema, n, seed=t)
            fields["my_extra"] = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * t
            decoded = decode(schema, fields, n)
            np.testing.assert_array_equal(decoded.fields["my_extra"], fields["my_extra"])
            buffer.write(t, np.arange(n), decoded.fields)
            sent_rows.append(fields["my_extra"])
        error = rejected(schema, {**fields, "my_extra": fields["my_extra"].astype(np.float64)}, n)
        assert error.reason == "size" and "my_extra" in error.detail
        error = rejected(schema, {**fields, "my_extra": np.zeros((n, 4), np.float32)}, n)
        assert error.reason == "size" and "my_extra" in error.detail
        error = rejected(schema, {k: v for k, v in fields.items() if k != "my_extra"}, n)
        assert error.reason == "schema" and "frames" in error.detail
        error = rejected(base, fields, n)  # a peer on the old schema refuses it: one frame too many
        assert error.reason == "schema" and "frames" in error.detail
        nan = fields["my_extra"].copy()
        nan[0, 0] = np.nan
        assert rejected(schema, {**fields, "my_extra": nan}, n).reason == "schema"
        np.testing.assert_array_equal(buffer.field("my_extra"), np.stack(sent_rows))

        # Minibatches: carried by name, rows matching the stored ones.
        buffer.compute_gae(np.zeros(n, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)
        flat = buffer.flat_batch("cpu")
        np.testing.assert_array_equal(
            flat.fields["my_extra"].numpy(), buffer.field("my_extra").reshape(-1, 3)[flat.rows]
        )
        minibatches = buffer.get_minibatches(2, "cpu")
        assert all(
            m.fields["my_extra"].dtype == torch.float32 and m.fields["my_extra"].shape[1:] == (3,)
            for m in minibatches
        )
        served = np.concatenate([m.fields["my_extra"].numpy() for m in minibatches])
        assert sorted(map(tuple, served.tolist())) == sorted(
            map(tuple, np.concatenate(sent_rows).tolist())
        )

    # The actor's step buffers allocate it too, and send it.
    step_buffers = PPOActorStepBuffers.create(num_envs=n, schema=schema)
    assert step_buffers.extras["my_extra"].shape == (n, 3)
    assert "my_extra" in step_buffers.sent_fields(np.zeros(n, np.float32), schema)


def test_a_field_that_is_stored_but_not_in_minibatches_stays_out_of_them() -> None:
    schema = default_schema((2,), np.uint8).with_field(StepField("diagnostic", (), np.int32))
    with RolloutBuffer(2, 2, schema=schema) as buffer:
        for t in range(2):
            row = valid_fields(schema, 2, seed=t)
            buffer.add(**row)
        buffer.compute_gae(np.zeros(2, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)
        assert buffer.field("diagnostic").dtype == np.int32
        assert "diagnostic" not in buffer.get_minibatches(1, "cpu")[0].fields


def test_a_field_with_a_default_may_be_omitted() -> None:
    schema = default_schema((2,), np.uint8).with_field(
        StepField("weight", (), np.float32, default=1.5)
    )
    with RolloutBuffer(1, 2, schema=schema) as buffer:
        row = valid_fields(schema, 2)
        del row["weight"]
        buffer.add(**row)
        np.testing.assert_array_equal(buffer.field("weight"), [[1.5, 1.5]])


# ---------------------------------------------------------------------------------- dict observations
DICT_LAYOUT = {"image": ((1, 6, 6), np.uint8), "vector": ((2,), np.float32)}


def test_dict_observations_keep_their_dtypes_from_the_wire_to_the_minibatch() -> None:
    schema = build_schema(DICT_LAYOUT, Categorical(4))
    assert schema.observation_names == ("observations.image", "observations.vector")
    assert schema.is_dict_observation
    n, steps = 3, 4
    with RolloutBuffer(steps, n, schema=schema) as buffer:
        assert buffer.observation_dtype == {"image": np.uint8, "vector": np.float32}
        assert buffer.observation_shape == {"image": (1, 6, 6), "vector": (2,)}
        for t in range(steps):
            fields = valid_fields(schema, n, seed=t)
            fields["observations.image"] = np.full((n, 1, 6, 6), 250 - t, np.uint8)
            fields["observations.vector"] = np.stack(
                [np.arange(n) + 10 * t, -np.arange(n)], axis=1
            ).astype(np.float32)
            decoded = decode(schema, fields, n)
            assert decoded.fields["observations.image"].dtype == np.uint8
            buffer.write(t, np.arange(n), decoded.fields)
        observations = buffer.observations
        assert set(observations) == {"image", "vector"}
        assert observations["image"].dtype == np.uint8 and observations["image"].shape == (
            steps,
            n,
            1,
            6,
            6,
        )
        assert (
            buffer.field("observations.image").dtype == np.uint8
        )  # uint8 in shared memory, not float
        buffer.compute_gae(np.zeros(n, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)
        minibatch = buffer.get_minibatches(1, "cpu")[0]
        assert set(minibatch.observations) == {"image", "vector"}
        assert minibatch.observations["image"].dtype == torch.uint8
        assert minibatch.observations["vector"].dtype == torch.float32
        assert minibatch.fields["observations.image"] is minibatch.observations["image"]
        # The rows of each key stay together: image value 250 - t goes with vector[0] = env + 10 t.
        t_of_row = (minibatch.observations["vector"][:, 0].numpy() // 10).astype(int)
        np.testing.assert_array_equal(
            minibatch.observations["image"][:, 0, 0, 0].numpy(), 250 - t_of_row
        )
    # A float where the uint8 key belongs, and a missing key, are refused at the wire.
    fields = valid_fields(schema, n)
    error = rejected(
        schema, {**fields, "observations.image": fields["observations.image"].astype(np.float32)}, n
    )
    assert error.reason == "size" and "observations.image" in error.detail
    error = rejected(schema, {k: v for k, v in fields.items() if k != "observations.vector"}, n)
    assert error.reason == "schema" and "frames" in error.detail


def test_split_and_join_observations() -> None:
    schema = build_schema(DICT_LAYOUT, Categorical(2))
    obs = {"image": np.zeros((2, 1, 6, 6), np.uint8), "vector": np.zeros((2, 2), np.float32)}
    split = schema.split_observations(obs)
    assert set(split) == {"observations.image", "observations.vector"}
    assert schema.join_observations(split) == obs
    with pytest.raises(ValueError, match=r"missing keys \['vector'\]"):
        schema.split_observations({"image": obs["image"]})
    with pytest.raises(ValueError, match="expected a dict"):
        schema.split_observations(obs["image"])
    plain = default_schema((2,), np.uint8)
    assert not plain.is_dict_observation
    assert plain.split_observations(obs["vector"]) == {"observations": obs["vector"]}


# ---------------------------------------------------------------------------------- masks and Gaussian parameters
def test_a_mask_that_allows_nothing_is_rejected_at_the_wire_naming_the_env() -> None:
    schema = build_schema({"": ((2,), np.float32)}, Categorical(3, masked=True))
    fields = valid_fields(schema, 3)
    fields["actions"] = np.zeros(3, np.int64)
    mask = np.ones((3, 3), bool)
    mask[2] = False
    fields["action_mask"] = mask
    error = rejected(schema, fields, 3)
    assert error.reason == "value_range"
    assert (
        "action_mask" in error.detail
        and "env 2" in error.detail
        and "allows no action" in error.detail
    )


def test_a_multi_discrete_mask_must_allow_something_in_every_sub_action() -> None:
    schema = build_schema({"": ((2,), np.float32)}, MultiCategorical([2, 3], masked=True))
    assert schema["action_mask"].mask_segments == (2, 3)
    fields = valid_fields(schema, 2)
    fields["actions"] = np.array([[0, 0], [1, 2]], np.int64)
    fields["action_mask"] = np.array(
        [[True, True, True, True, True], [True, True, False, False, False]]
    )
    error = rejected(schema, fields, 2)
    assert (
        error.reason == "value_range" and "env 1" in error.detail and "entries 2..4" in error.detail
    )


@pytest.mark.parametrize(
    ("distribution", "actions", "mask"),
    [
        (
            Categorical(3, masked=True),
            np.array([1, 2]),
            np.array([[True, True, False], [True, True, False]]),
        ),
        (
            MultiCategorical([2, 3], masked=True),
            np.array([[0, 0], [0, 2]]),
            np.array([[True, False, True, True, True], [True, True, True, True, False]]),
        ),
        (
            Bernoulli(2, masked=True),
            np.array([[1, 0], [1, 1]], np.int8),
            np.array([[True, True, True, True], [True, True, True, False]]),
        ),  # env 1's bit 1 may not be 1
    ],
    ids=["categorical", "multi_categorical", "bernoulli"],
)
def test_an_action_its_mask_forbids_is_rejected(
    distribution, actions: np.ndarray, mask: np.ndarray
) -> None:
    schema = build_schema({"": ((2,), np.float32)}, distribution)
    fields = valid_fields(schema, 2)
    fields["actions"] = actions.astype(schema["actions"].dtype)
    fields["action_mask"] = mask
    error = rejected(schema, fields, 2)
    assert (
        error.reason == "value_range"
        and "actions: env 1" in error.detail
        and "forbids" in error.detail
    )
    # With the forbidden entry allowed, the same step is accepted.
    allowed = mask.copy()
    allowed[1] = True
    decode(schema, {**fields, "action_mask": allowed}, 2)


def test_gaussian_parameters_are_checked() -> None:
    schema = build_schema({"": ((3,), np.float32)}, DiagGaussian([-1.0, -1.0], [1.0, 1.0]))
    assert {"action_mean", "action_std"} <= {f.name for f in schema.minibatch}
    assert schema["action_mean"].shape == (2,) and "action_mask" not in schema
    fields = valid_fields(schema, 2)
    decode(schema, fields, 2)
    error = rejected(schema, {**fields, "action_mean": np.zeros((2, 3), np.float32)}, 2)
    assert error.reason == "size" and "action_mean" in error.detail
    error = rejected(schema, {**fields, "action_mean": np.zeros((2, 2), np.float64)}, 2)
    assert error.reason == "size" and "action_mean" in error.detail
    error = rejected(
        schema, {**fields, "action_std": np.array([[0.5, 0.5], [0.5, -0.1]], np.float32)}, 2
    )
    assert error.reason == "value_range" and "action_std" in error.detail
    inf_mean = fields["action_mean"].copy()
    inf_mean[0, 0] = np.inf
    assert rejected(schema, {**fields, "action_mean": inf_mean}, 2).reason == "schema"
    nan_actions = fields["actions"].copy()
    nan_actions[1, 1] = np.nan
    assert rejected(schema, {**fields, "actions": nan_actions}, 2).reason == "schema"


def test_check_step_consistency_rules() -> None:
    schema = build_schema({"": ((2,), np.float32)}, Categorical(3))
    fields = valid_fields(schema, 2)
    assert check_step_consistency(schema, fields) is None
    bad = {**fields, "truncated": np.array([True, False]), "dones": np.array([False, False])}
    assert "truncated" in check_step_consistency(schema, bad)
    bad = {**fields, "bootstrap_values": np.array([0.0, 1.0], np.float32)}
    assert "bootstrap_values" in check_step_consistency(schema, bad)
    ok = {
        **fields,
        "truncated": np.array([False, True]),
        "dones": np.array([False, True]),
        "bootstrap_values": np.array([0.0, 1.0], np.float32),
    }
    assert check_step_consistency(schema, ok) is None


def test_without_truncated_a_bootstrap_value_needs_a_done() -> None:
    """A local writer's step (no truncation flags: storage keeps them in dones + bootstrap_values)."""
    schema = default_schema((2,), np.uint8)
    fields = {
        "dones": np.array([False, True]),
        "bootstrap_values": np.array([0.0, 2.0], np.float32),
    }
    assert check_step_consistency(schema, fields) is None
    problem = check_step_consistency(schema, {**fields, "dones": np.array([False, False])})
    assert (
        problem.startswith("bootstrap_values: expected 0 where dones is False") and "[1]" in problem
    )


def test_local_step_values_are_checked_with_the_schema_checks_of_the_wire() -> None:
    schema = build_schema({"": ((2,), np.float32)}, Categorical(3, masked=True))
    assert [f.name for f in schema.action_fields] == ["actions", "action_mask"]
    fields = {
        name: value for name, value in valid_fields(schema, 2).items() if name != "next_values"
    }
    fields["actions"] = np.array([0, 2])
    check_step_values(schema, fields)
    check_step_values(
        schema, {**fields, "rewards": np.full(2, 3e38, np.float32)}
    )  # finite: no magnitude limit
    for bad, message in [
        ({"rewards": np.array([0.0, np.nan], np.float32)}, "^rewards: expected finite values"),
        ({"actions": np.array([0, 3])}, "^actions: expected values <= 2"),
        (
            {"action_mask": np.array([[True, True, True], [False, False, False]])},
            "^action_mask: env 1 allows no action",
        ),
        (
            {"action_mask": np.array([[True, True, True], [True, True, False]])},
            "^actions: env 1 took an action",
        ),
        (
            {"truncated": np.array([True, False])},
            "^truncated: every truncated env must also be done",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            check_step_values(schema, {**fields, **bad})
    gaussian = build_schema({"": ((2,), np.float32)}, DiagGaussian([-1.0], [1.0]))
    assert {f.name for f in gaussian.action_fields} == {"actions", "action_mean", "action_std"}


def test_resolve_schema_takes_exactly_one_description_of_the_fields() -> None:
    plain = resolve_schema("Owner", None, (2,), np.uint8)
    assert plain == default_schema((2,), np.uint8)
    assert resolve_schema("Owner", None, [2], np.uint8, (3,), np.float32) == default_schema(
        (2,), np.uint8, (3,), np.float32
    )
    schema = build_schema({"": ((2,), np.float32)}, Categorical(3))
    assert resolve_schema("Owner", schema, None, None) is schema
    with pytest.raises(
        ValueError, match="^Owner: expected observation_shape and observation_dtype, or schema="
    ):
        resolve_schema("Owner", None, (2,), None)
    with pytest.raises(ValueError, match="^Owner: pass either schema= or observation_shape"):
        resolve_schema("Owner", schema, (2,), np.uint8)
    for bad in ((-1,), (2.0,), "2", 2):
        with pytest.raises(
            ValueError, match="^observation_shape: expected a tuple of non-negative ints"
        ):
            resolve_schema("Owner", None, bad, np.uint8)


# ---------------------------------------------------------------------------------- building and plain form
def test_built_schemas_declare_the_standard_fields_once() -> None:
    schema = build_schema({"": ((4, 84, 84), np.uint8)}, Categorical(4))
    assert len(set(schema.names)) == len(schema.names)
    assert {f.name for f in schema.sent} == {
        "observations",
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "truncated",
        "bootstrap_values",
        "next_values",
        "trainable",
    }
    assert {f.name for f in schema.stored} == {
        "observations",
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "bootstrap_values",
        "trainable",
        "policy_versions",
        "policy_revisions",
        "advantages",
        "returns",
    }
    assert {f.name for f in schema.minibatch} == {
        "observations",
        "actions",
        "log_probs",
        "values",
        "policy_versions",
        "advantages",
        "returns",
    }
    assert schema["observations"].dtype == np.uint8 and schema["actions"].dtype == np.int64
    assert (
        schema.stored_bytes_per_row() == 4 * 84 * 84 + 8 + 6 * 4 + 2 + 8 + 8
    )  # ... version, revision
    assert schema.sent_bytes_per_env() == 4 * 84 * 84 + 8 + 5 * 4 + 3
    assert "observations" in schema.describe() and "[sent,stored,minibatch]" in schema.describe()
    # The env's schema: observation layout + the distribution of its action space.
    spec = EnvSpec.discrete("ALE/Breakout-v5", (4, 84, 84), np.uint8, 4, is_atari=True)
    assert schema_for_env(spec) == schema


@pytest.mark.parametrize(
    "schema",
    [
        default_schema((3,), np.float32),
        build_schema({"": ((4, 84, 84), np.uint8)}, Categorical(4)),
        build_schema(DICT_LAYOUT, MultiCategorical([2, 3], masked=True)),
        build_schema({"": ((3,), np.float32)}, DiagGaussian([-2.0, -1.0], [2.0, 1.0])),
        build_schema({"": ((3,), np.float32)}, Bernoulli(4, masked=True)).with_field(
            StepField("my_extra", (3,), np.float32, minibatch=True, low=-1.0, high=[1.0, 2.0, 3.0])
        ),
    ],
    ids=["default", "atari", "dict_masked_multi", "gaussian", "bernoulli_extra"],
)
def test_schema_plain_value_round_trip(schema: StepSchema) -> None:
    as_dict = schema.to_dict()
    again = schema_from_dict(msgpack.unpackb(msgpack.packb(as_dict)))
    assert again == schema and hash(again) == hash(schema)
    assert again.names == schema.names and again.distribution == schema.distribution
    for mine, theirs in zip(schema.fields, again.fields, strict=True):
        assert (mine.shape, mine.dtype, mine.sent, mine.stored, mine.minibatch, mine.default) == (
            theirs.shape,
            theirs.dtype,
            theirs.sent,
            theirs.stored,
            theirs.minibatch,
            theirs.default,
        )
        assert mine.mask_segments == theirs.mask_segments
        for bound in ("low", "high"):
            a, b = getattr(mine, bound), getattr(theirs, bound)
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def _changed(schema: StepSchema, field_name: str, /, **change: Any) -> dict[str, Any]:
    as_dict = schema.to_dict()
    as_dict["fields"] = [
        {**f, **change} if f["name"] == field_name else f for f in as_dict["fields"]
    ]
    return as_dict


MASKED = build_schema({"": ((3,), np.float32)}, Categorical(3, masked=True))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([], "expected a map"),
        ({"fields": []}, "expected a map"),
        ({"fields": [], "distribution": None}, "1-256 field maps"),
        ({**MASKED.to_dict(), "distribution": "categorical"}, "distribution must be a map"),
        ({**MASKED.to_dict(), "distribution": {"kind": "tuple"}}, "unknown kind"),
        (_changed(MASKED, "actions", dtype="|O"), "not allowed"),
        (_changed(MASKED, "actions", dtype="<U4"), "not allowed"),
        (_changed(MASKED, "actions", dtype=8), "not allowed"),
        (_changed(MASKED, "actions", shape=[-1]), "shape"),
        (_changed(MASKED, "actions", shape="()"), "shape"),
        (_changed(MASKED, "actions", shape=[1] * 33), "shape"),
        (_changed(MASKED, "actions", sent=1), "sent must be a bool"),
        (_changed(MASKED, "actions", default="0"), "default"),
        (_changed(MASKED, "action_mask", mask_segments=[0]), "mask_segments"),
        (
            _changed(MASKED, "action_mask", low=[0.0, 1.0]),
            "action_mask",
        ),  # cannot broadcast to (3,)
        (_changed(MASKED, "actions", name=""), "name"),
        (_changed(MASKED, "actions", name="log_probs"), "declared twice"),
        (_changed(MASKED, "returns", name="my_returns"), "missing standard fields"),
        ({**MASKED.to_dict(), "fields": [{"name": "x"}]}, "expected keys"),
        ({**MASKED.to_dict(), "fields": [*MASKED.to_dict()["fields"], 3]}, "expected keys"),
    ],
)
def test_malformed_schema_dicts_are_refused(bad: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schema_from_dict(bad)


def test_the_schema_reads_a_distribution_only_through_the_policy_layer() -> None:
    # step_schema sits below policy/: it parses a distribution with the parser it is given.
    plain = default_schema((3,), np.float32)
    assert StepSchema.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match="schema_from_dict"):
        StepSchema.from_dict(MASKED.to_dict())
    assert schema_from_dict(MASKED.to_dict()) == MASKED


def test_invalid_fields_and_schemas_are_refused_when_declared() -> None:
    with pytest.raises(ValueError, match="my_extra: expected a bool/int/uint/float dtype"):
        StepField("my_extra", (3,), np.complex64)
    with pytest.raises(ValueError, match="my_extra: expected at most 32 non-negative dimensions"):
        StepField("my_extra", (-1,), np.float32)
    base = default_schema((2,), np.uint8)
    with pytest.raises(ValueError, match="'rewards' declared twice"):
        base.with_field(StepField("rewards", (), np.float32))
    with pytest.raises(ValueError, match="missing standard fields"):
        StepSchema(tuple(f for f in base.fields if f.name != "advantages"))
    with pytest.raises(ValueError, match="at least one observation key"):
        build_schema({}, Categorical(2))
    with pytest.raises(
        ValueError, match="expected a distribution, or action_shape and action_dtype"
    ):
        build_schema({"": ((2,), np.uint8)}, None)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_value_checks_agree_for_a_few_values_and_for_many(dtype) -> None:
    """Arrays of at most SMALL_ARRAY_SIZE values are checked in plain Python, larger ones with
    numpy: the verdict (and the message) must not depend on which path ran."""
    item = StepField("x", (), dtype, low=-2.0, high=3.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        small = rng.integers(-4, 6, size=int(rng.integers(1, SMALL_ARRAY_SIZE + 1))).astype(dtype)
        large = np.concatenate(
            [small, np.zeros(SMALL_ARRAY_SIZE, dtype)]
        )  # same extremes (0 is in range)
        expected = None
        if small.min() < -2.0:
            expected = f"x: expected values >= -2.0, received min {small.min()!r}"
        elif small.max() > 3.0:
            expected = f"x: expected values <= 3.0, received max {small.max()!r}"
        assert item.check_values(small) == expected
        assert (item.check_values(large) is None) == (expected is None)


def test_step_consistency_agrees_for_a_few_envs_and_for_many() -> None:
    schema = build_schema({"": ((2,), np.float32)}, Categorical(3))
    rng = np.random.default_rng(1)
    for n in (4, SMALL_ARRAY_SIZE + 8):
        for _ in range(100):
            truncated = rng.random(n) < 0.2
            dones = truncated | (rng.random(n) < 0.2)
            bootstrap = np.where(truncated, 1.5, 0.0).astype(np.float32)
            arrays = {
                "truncated": truncated.copy(),
                "dones": dones.copy(),
                "bootstrap_values": bootstrap.copy(),
            }
            assert check_step_consistency(schema, arrays) is None
            bad_dones = arrays | {"dones": dones & ~truncated}
            assert (check_step_consistency(schema, bad_dones) is None) == (not truncated.any())
            bad_bootstrap = arrays | {
                "bootstrap_values": np.where(~truncated, 2.0, 1.5).astype(np.float32)
            }
            assert (check_step_consistency(schema, bad_bootstrap) is None) == bool(truncated.all())


def test_bounds_the_dtype_cannot_break_are_not_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    """uint8 frames in [0, 255] (every Atari observation) cost no pass over the data; a bound the
    dtype can break is still checked, on its side only."""
    vacuous = [
        StepField("observations", (4, 4), np.uint8, low=0, high=255),
        StepField("observations", (4, 4), np.int16, low=-(2**15), high=2**15 - 1),
        StepField("x", (4, 4), np.float32, low=-np.inf, high=np.inf),
    ]
    high_only = StepField("observations", (4, 4), np.uint8, low=0, high=200)
    low_only = StepField("observations", (4, 4), np.uint8, low=202, high=255)
    scans: list[str] = []
    real_any = np.any

    def counting_any(array, *args, **kwargs):
        scans.append("scan")
        return real_any(array, *args, **kwargs)

    monkeypatch.setattr(np, "any", counting_any)
    frames = np.full((SMALL_ARRAY_SIZE + 1, 4, 4), 201, np.uint8)  # large enough for the numpy path
    for item in vacuous:
        assert item.check_values(frames.astype(item.dtype)) is None
    assert scans == []
    assert "expected values <= 200" in high_only.check_values(frames)
    assert scans == ["scan"]  # the high side only: no uint8 is below 0
    assert "expected values >= 202" in low_only.check_values(frames)
    assert scans == ["scan", "scan"]
