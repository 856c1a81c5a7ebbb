"""Tests for oakemu_core.storage.rollout_buffer: layout, validation, column writes, GAE, minibatches, sharing."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oakemu_core.storage.memory as memory_diagnostics
from oakemu_core import RolloutBuffer, RolloutMinibatch
from oakemu_core.algo.losses import normalize_advantages
from oakemu_core.policy.distributions import Categorical
from oakemu_core.shared_memory import SEGMENT_PREFIX
from oakemu_core.step_schema import build_schema, default_schema
from oakemu_core.storage.memory import SharedMemoryTooSmallError
from oakemu_core.storage.rollout_buffer import FlatBatch, StaleAdvantagesError
from tests.conftest import SHM_DIR, own_segments
from tests.storage.test_gae import reference_gae

GAMMA = 0.99
GAE_LAMBDA = 0.95
OBS_SHAPE = (2, 3)


@pytest.fixture
def buffer() -> Iterator[RolloutBuffer]:
    """T=4, N=3, uint8 observations (2, 3), discrete int64 actions."""
    with RolloutBuffer(4, 3, OBS_SHAPE, np.uint8, seed=0) as rollout_buffer:
        yield rollout_buffer


def step_arrays(
    num_envs: int, step: int = 0, obs_shape: tuple[int, ...] = OBS_SHAPE
) -> dict[str, np.ndarray]:
    """Valid arrays for one row of ``num_envs`` columns; values encode ``step`` and the column."""
    envs = np.arange(num_envs)
    return {
        "observations": np.full((num_envs, *obs_shape), step, np.uint8)
        + envs.reshape(-1, *[1] * len(obs_shape)).astype(np.uint8),
        "actions": (10 * step + envs).astype(np.int64),
        "log_probs": (-0.1 * (step + 1) - envs).astype(np.float32),
        "values": (step + 0.01 * envs).astype(np.float32),
        "rewards": np.full(num_envs, step, np.float32),
        "dones": np.zeros(num_envs, bool),
    }


def fill(rollout_buffer: RolloutBuffer, **extra) -> None:
    for step in range(rollout_buffer.rollout_length - rollout_buffer.step):
        arrays = step_arrays(
            rollout_buffer.num_envs, step, obs_shape=rollout_buffer.observation_shape
        )
        rollout_buffer.add(**arrays, **extra)


def gae_ready(rollout_buffer: RolloutBuffer) -> None:
    rollout_buffer.compute_gae(
        np.zeros(rollout_buffer.num_envs, np.float32),
        rollout_buffer.dones[-1].copy(),
        GAMMA,
        GAE_LAMBDA,
    )


# ---------------------------------------------------------------------------------- layout
def test_layout_shapes_dtypes_and_memory(buffer: RolloutBuffer) -> None:
    expected = {
        "observations": ((4, 3, 2, 3), np.uint8),
        "actions": ((4, 3), np.int64),
        "log_probs": ((4, 3), np.float32),
        "values": ((4, 3), np.float32),
        "rewards": ((4, 3), np.float32),
        "dones": ((4, 3), np.bool_),
        "bootstrap_values": ((4, 3), np.float32),
        "trainable": ((4, 3), np.bool_),
        "policy_versions": ((4, 3), np.int64),
        "policy_revisions": ((4, 3), np.int64),
        "advantages": ((4, 3), np.float32),
        "returns": ((4, 3), np.float32),
        "column_steps": ((3,), np.int64),
    }
    for name, (shape, dtype) in expected.items():
        array = getattr(buffer, name)
        assert array.shape == shape, name
        assert array.dtype == dtype, name
    for name, (shape, dtype) in expected.items():
        array = buffer.field(name)
        assert array.shape == shape and array.dtype == dtype, name
        assert not array.flags.writeable, name
    # Per row: obs 6 + action 8 + six float32 24 + two bools 2 + version 8 + revision 8 = 56
    # bytes, 12 rows; column_steps 3 x 8; meta: three int64 write counters, 24.
    assert buffer.memory_bytes == 56 * 12 + 24 + 24
    assert buffer.memory_bytes == sum(getattr(buffer, name).nbytes for name in expected) + 24
    assert buffer.schema.stored_bytes_per_row() == 56
    assert buffer.memory_gb == pytest.approx(buffer.memory_bytes / 1024**3)
    assert buffer.memory_bytes == RolloutBuffer.estimate_memory_bytes(4, 3, buffer.schema)
    assert buffer.memory_bytes == RolloutBuffer.estimate_memory_bytes(
        4, 3, default_schema(OBS_SHAPE, np.uint8)
    )
    assert buffer.schema == default_schema(OBS_SHAPE, np.uint8)
    with pytest.raises(KeyError, match="truncated.*not a stored field"):
        buffer.field("truncated")  # sent by actors, kept in dones + bootstrap_values
    with pytest.raises(KeyError, match="meta"):
        buffer.field("meta")
    assert (buffer.rollout_length, buffer.num_envs, buffer.total_size) == (4, 3, 12)
    assert buffer.observation_shape == OBS_SHAPE and buffer.observation_dtype == np.uint8
    assert buffer.action_shape == () and buffer.action_dtype == np.int64
    assert buffer.step == 0 and not buffer.is_full and buffer.trainable_size == 0


def test_uint8_frames_use_a_quarter_of_float32_memory() -> None:
    with (
        RolloutBuffer(2, 2, (4, 84, 84), np.uint8) as frames,
        RolloutBuffer(2, 2, (4, 84, 84), np.float32) as floats,
    ):
        assert frames.observations.dtype == np.uint8
        assert floats.observations.nbytes == 4 * frames.observations.nbytes


def test_views_are_read_only(buffer: RolloutBuffer) -> None:
    for name in (
        "observations",
        "actions",
        "rewards",
        "dones",
        "trainable",
        "advantages",
        "returns",
        "column_steps",
    ):
        with pytest.raises(ValueError, match="read-only"):
            getattr(buffer, name)[0] = 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 3), "rollout_length: expected a positive int"),
        ((4, -1), "num_envs: expected a positive int"),
    ],
)
def test_invalid_sizes_are_rejected(args: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutBuffer(*args, OBS_SHAPE, np.uint8)


# ---------------------------------------------------------------------------------- add
def test_add_writes_one_row_for_all_envs(buffer: RolloutBuffer) -> None:
    fill(buffer, policy_version=7)
    assert buffer.is_full and buffer.step == 4
    for step in range(4):
        expected = step_arrays(3, step)
        for name, array in expected.items():
            np.testing.assert_array_equal(getattr(buffer, name)[step], array, err_msg=name)
    assert buffer.trainable.all(), "trainable defaults to True"
    assert not buffer.bootstrap_values.any(), "bootstrap_values default to 0"
    assert (buffer.policy_versions == 7).all()
    np.testing.assert_array_equal(buffer.column_steps, [4, 4, 4])
    assert buffer.trainable_size == 12


def test_add_to_a_full_buffer_overflows_and_reset_reuses_memory(buffer: RolloutBuffer) -> None:
    fill(buffer)
    with pytest.raises(OverflowError, match="full"):
        buffer.add(**step_arrays(3))
    names = own_segments()
    address = buffer.observations.__array_interface__["data"][0]
    buffer.reset()
    assert buffer.step == 0 and not buffer.is_full and buffer.trainable_size == 0
    assert own_segments() == names
    assert buffer.observations.__array_interface__["data"][0] == address
    fill(buffer)
    assert buffer.is_full


WRONG_FIELDS = [
    ("observations", np.zeros((3, *OBS_SHAPE), np.float32), "dtype uint8", "dtype float32"),
    ("observations", np.zeros((3, 3, 2), np.uint8), r"shape \(3, 2, 3\)", r"shape \(3, 3, 2\)"),
    ("actions", np.zeros(3, np.int32), "dtype int64", "dtype int32"),
    ("actions", np.zeros((3, 1), np.int64), r"shape \(3,\)", r"shape \(3, 1\)"),
    ("log_probs", np.zeros(3, np.float64), "dtype float32", "dtype float64"),
    ("values", np.zeros(2, np.float32), r"shape \(3,\)", r"shape \(2,\)"),
    ("rewards", np.zeros(3, np.float16), "dtype float32", "dtype float16"),
    ("dones", np.zeros(3, np.uint8), "dtype bool", "dtype uint8"),
    ("trainable", np.ones(3, np.int64), "dtype bool", "dtype int64"),
    ("bootstrap_values", np.zeros(3, np.float64), "dtype float32", "dtype float64"),
    ("rewards", [0.0, 0.0, 0.0], "numpy array", "list"),
    ("dones", np.bool_(False), "numpy array", "bool"),
]


@pytest.mark.parametrize(("field", "bad", "expected", "received"), WRONG_FIELDS)
def test_add_rejects_wrong_fields_and_writes_nothing(
    buffer: RolloutBuffer, field: str, bad, expected: str, received: str
) -> None:
    arrays = step_arrays(3, step=5)
    arrays[field] = bad
    with pytest.raises(
        ValueError, match=rf"^{field}: expected .*{expected}.*received .*{received}"
    ):
        buffer.add(**arrays)
    assert buffer.step == 0
    assert not buffer.observations.any() and not buffer.actions.any() and not buffer.rewards.any()


@pytest.mark.parametrize(("field", "bad", "expected", "received"), WRONG_FIELDS)
def test_write_rejects_wrong_fields_and_writes_nothing(
    buffer: RolloutBuffer, field: str, bad, expected: str, received: str
) -> None:
    arrays = step_arrays(3, step=5)
    arrays[field] = bad
    with pytest.raises(
        ValueError, match=rf"^{field}: expected .*{expected}.*received .*{received}"
    ):
        buffer.write(0, np.array([2, 0, 1]), arrays)
    np.testing.assert_array_equal(buffer.column_steps, [0, 0, 0])
    assert not buffer.observations.any() and not buffer.actions.any() and not buffer.rewards.any()


def test_bootstrap_value_without_done_is_rejected(buffer: RolloutBuffer) -> None:
    bootstrap = np.array([0.0, 0.5, 0.0], np.float32)
    with pytest.raises(
        ValueError, match=r"bootstrap_values: expected 0 where dones is False.*\[1\]"
    ):
        buffer.add(**step_arrays(3), bootstrap_values=bootstrap)
    arrays = step_arrays(3)
    arrays["dones"] = np.array([False, True, False])
    buffer.add(**arrays, bootstrap_values=bootstrap)
    assert buffer.bootstrap_values[0, 1] == np.float32(0.5)


@pytest.mark.parametrize("version", [-1, True, 1.0, "3"])
def test_bad_policy_version_is_rejected(buffer: RolloutBuffer, version) -> None:
    with pytest.raises(ValueError, match="policy_version: expected a non-negative int"):
        buffer.add(**step_arrays(3), policy_version=version)
    with pytest.raises(ValueError, match="policy_revision: expected a non-negative int"):
        buffer.add(**step_arrays(3), policy_revision=version)
    with pytest.raises(ValueError, match="policy_revision: expected a non-negative int"):
        buffer.write(0, np.array([0]), step_arrays(1), policy_revision=version)
    assert buffer.step == 0 and buffer.column_steps.tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------------- columns
def test_write_fills_columns_independently(buffer: RolloutBuffer) -> None:
    first, second = np.array([2, 0]), np.array([1])
    for step in range(4):
        arrays = step_arrays(2, step)
        buffer.write(step, first, arrays, policy_version=3, policy_revision=2)
    np.testing.assert_array_equal(buffer.column_steps, [4, 0, 4])
    assert buffer.step == 0 and not buffer.is_full
    # arrays[i] goes to column columns[i]: column 2 got env 0's data, column 0 env 1's.
    np.testing.assert_array_equal(buffer.actions[:, 2], [0, 10, 20, 30])
    np.testing.assert_array_equal(buffer.actions[:, 0], [1, 11, 21, 31])
    for step in range(4):
        buffer.write(step, second, step_arrays(1, step), policy_version=4)
    assert buffer.is_full
    np.testing.assert_array_equal(buffer.policy_versions[0], [3, 4, 3])
    np.testing.assert_array_equal(buffer.policy_revisions[0], [2, 0, 2])


def _complete(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every writable field actors send (a validated write fills no default for them), plus one the buffer
    does not store."""
    lead = arrays["dones"].shape
    return {
        **arrays,
        "bootstrap_values": np.zeros(lead, np.float32),
        "truncated": np.zeros(lead, bool),
        "trainable": np.arange(math.prod(lead)).reshape(lead) % 2 == 0,
    }


def test_a_validated_write_stores_what_a_checked_write_stores(buffer: RolloutBuffer) -> None:
    """One row into fancy-indexed columns, then a block of rows into a slice: the same buffer contents
    as the checked write."""
    with RolloutBuffer(4, 3, OBS_SHAPE, np.uint8, seed=0) as checked:
        one_row = _complete(step_arrays(2, 0))
        block = {
            name: np.stack([_complete(step_arrays(1, s))[name] for s in (0, 1, 2)])
            for name in one_row
        }
        buffer.write(
            0, np.array([2, 0]), one_row, policy_version=3, policy_revision=1, validated=True
        )
        checked.write(0, np.array([2, 0]), one_row, policy_version=3, policy_revision=1)
        buffer.write(0, slice(1, 2), block, rows=3, policy_version=5, validated=True)
        checked.write(0, np.array([1]), block, rows=3, policy_version=5)
        for name in [
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
            "column_steps",
        ]:
            np.testing.assert_array_equal(
                getattr(buffer, name), getattr(checked, name), err_msg=name
            )
        np.testing.assert_array_equal(buffer.column_steps, [1, 3, 1])
        np.testing.assert_array_equal(buffer.trainable[0], [False, True, True])  # env 1 -> column 0


def test_a_validated_write_checks_the_rows_and_writes_nothing_when_they_disagree(
    buffer: RolloutBuffer,
) -> None:
    buffer.write(0, slice(0, 2), _complete(step_arrays(2, 0)), policy_version=0, validated=True)
    before = {
        name: getattr(buffer, name).copy()
        for name in ("actions", "column_steps", "policy_versions")
    }
    with pytest.raises(ValueError, match="step_index=0"):  # column 1 already holds a row
        buffer.write(
            0, np.array([1, 2]), _complete(step_arrays(2, 0)), policy_version=7, validated=True
        )
    block = {name: np.stack([value] * 4) for name, value in _complete(step_arrays(2, 1)).items()}
    with pytest.raises(OverflowError, match="rollout_length 4"):  # rows 1..4 of a 4-row buffer
        buffer.write(1, slice(0, 2), block, rows=4, policy_version=7, validated=True)
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(buffer, name), value, err_msg=name)


def test_write_keeps_rows_contiguous(buffer: RolloutBuffer) -> None:
    buffer.write(0, np.array([0, 1]), step_arrays(2, 0))
    with pytest.raises(
        ValueError,
        match=r"columns: expected every column to hold step_index=1 rows, received columns \[2\] holding \[0\]",
    ):
        buffer.write(1, np.array([1, 2]), step_arrays(2, 1))
    np.testing.assert_array_equal(buffer.column_steps, [1, 1, 0]), "column 1 must not be written"
    with pytest.raises(ValueError, match="step_index=0"):
        buffer.write(0, np.array([0]), step_arrays(1, 0))
    with pytest.raises(ValueError, match="add: expected every column at the same step"):
        buffer.add(**step_arrays(3))
    with pytest.raises(OverflowError, match="step_index"):
        buffer.write(4, np.array([0]), step_arrays(1, 0))


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (np.array([0, 0]), "distinct"),
        (np.array([3]), r"indices in \[0, 3\)"),
        (np.array([-1]), r"indices in \[0, 3\)"),
        (np.array([0.0]), "1-D integer numpy array"),
        ([0], "1-D integer numpy array"),
        (np.array([[0]]), "1-D integer numpy array"),
    ],
)
def test_bad_columns_are_rejected(buffer: RolloutBuffer, columns, message: str) -> None:
    count = len(np.asarray(columns).reshape(-1))
    with pytest.raises(ValueError, match=f"columns: .*{message}"):
        buffer.write(0, columns, step_arrays(count))
    np.testing.assert_array_equal(buffer.column_steps, [0, 0, 0])


def test_reset_columns_discards_an_unfinished_segment(buffer: RolloutBuffer) -> None:
    for step in range(2):
        buffer.write(step, np.array([0, 1, 2]), step_arrays(3, step))
    buffer.reset_columns(np.array([1]))
    np.testing.assert_array_equal(buffer.column_steps, [2, 0, 2])
    assert not buffer.trainable[:, 1].any()
    assert buffer.trainable_size == 4
    for step in range(2):
        buffer.write(step, np.array([1]), step_arrays(1, step + 7))
    np.testing.assert_array_equal(buffer.actions[:2, 1], [70, 80])


def test_mark_untrainable_counts_only_rows_it_clears(buffer: RolloutBuffer) -> None:
    arrays = step_arrays(3)
    buffer.add(**arrays, trainable=np.array([True, False, True]))
    for step in range(1, 4):
        buffer.add(**step_arrays(3, step))
    mask = np.zeros((4, 3), bool)
    mask[0, :] = True  # one already untrainable row in here
    mask[3, 2] = True
    assert buffer.mark_untrainable(mask) == 3
    assert buffer.trainable_size == 12 - 4
    assert buffer.mark_untrainable(mask) == 0
    with pytest.raises(ValueError, match=r"mask: expected shape \(4, 3\) and dtype bool"):
        buffer.mark_untrainable(mask.astype(np.uint8))


# ---------------------------------------------------------------------------------- GAE
def one_env_case(last_dones: list[int]) -> tuple[RolloutBuffer, np.ndarray, np.ndarray]:
    rollout_buffer = RolloutBuffer(4, 1, (1,), np.uint8)
    rewards, values, dones = [0, 1, 0, 2], [0.5, 0.6, 0.7, 0.8], [0, 1, 0, 0]
    for t in range(4):
        rollout_buffer.add(
            np.zeros((1, 1), np.uint8),
            np.zeros(1, np.int64),
            np.zeros(1, np.float32),
            np.array([values[t]], np.float32),
            np.array([rewards[t]], np.float32),
            np.array([bool(dones[t])]),
        )
    return rollout_buffer, np.array([0.9], np.float32), np.array(last_dones, bool)


def test_issue_case_1_through_the_buffer() -> None:
    rollout_buffer, last_values, last_dones = one_env_case([0])
    with rollout_buffer:
        rollout_buffer.compute_gae(last_values, last_dones, GAMMA, GAE_LAMBDA)
        np.testing.assert_array_equal(
            np.round(rollout_buffer.advantages[:, 0], 4),
            np.array([0.4702, 0.4000, 2.0586, 2.0910], np.float32),
        )
        np.testing.assert_array_equal(
            np.round(rollout_buffer.returns[:, 0], 4),
            np.array([0.9702, 1.0000, 2.7586, 2.8910], np.float32),
        )


def test_issue_case_1_with_last_dones_1_raises() -> None:
    rollout_buffer, last_values, last_dones = one_env_case([1])
    with (
        rollout_buffer,
        pytest.raises(ValueError, match=r"last_dones: expected to equal dones\[-1\]"),
    ):
        rollout_buffer.compute_gae(last_values, last_dones, GAMMA, GAE_LAMBDA)


def test_compute_gae_needs_a_full_buffer_and_exact_types(buffer: RolloutBuffer) -> None:
    buffer.add(**step_arrays(3))
    with pytest.raises(ValueError, match="compute_gae: expected a full buffer"):
        buffer.compute_gae(np.zeros(3, np.float32), np.zeros(3, bool), GAMMA, GAE_LAMBDA)
    fill(buffer)
    with pytest.raises(ValueError, match="last_values: expected shape .3,. and dtype float32"):
        buffer.compute_gae(np.zeros(3, np.float64), np.zeros(3, bool), GAMMA, GAE_LAMBDA)
    with pytest.raises(ValueError, match="last_dones: expected shape .3,. and dtype bool"):
        buffer.compute_gae(np.zeros(3, np.float32), np.zeros(3, np.int64), GAMMA, GAE_LAMBDA)


# ---------------------------------------------------------------------------------- minibatches
def id_buffer(num_steps: int, num_envs: int, trainable: np.ndarray | None = None) -> RolloutBuffer:
    """A full buffer whose values and actions equal the flat row index ``t * N + env``."""
    rollout_buffer = RolloutBuffer(num_steps, num_envs, (2,), np.uint8, seed=1)
    for t in range(num_steps):
        ids = t * num_envs + np.arange(num_envs)
        rollout_buffer.add(
            np.stack([ids, ids], axis=1).astype(np.uint8),
            ids.astype(np.int64),
            -ids.astype(np.float32),
            ids.astype(np.float32),
            np.ones(num_envs, np.float32),
            np.zeros(num_envs, bool),
            None if trainable is None else trainable[t],
        )
    gae_ready(rollout_buffer)
    return rollout_buffer


def test_issue_case_3_ten_rows_into_four_minibatches() -> None:
    with id_buffer(5, 2) as rollout_buffer:
        minibatches = rollout_buffer.get_minibatches(4, "cpu")
        assert sorted(len(minibatch.values) for minibatch in minibatches) == [2, 2, 3, 3]
        ids = np.concatenate([minibatch.values.numpy() for minibatch in minibatches])
        assert sorted(ids.tolist()) == list(range(10))


def test_issue_case_3_five_rows_into_five_and_six_minibatches() -> None:
    trainable = np.zeros((5, 2), bool)
    trainable[:, 0] = True
    with id_buffer(5, 2, trainable) as rollout_buffer:
        assert rollout_buffer.trainable_size == 5
        minibatches = rollout_buffer.get_minibatches(5, "cpu")
        assert [len(minibatch.values) for minibatch in minibatches] == [1] * 5
        assert sorted(float(minibatch.values[0]) for minibatch in minibatches) == [0, 2, 4, 6, 8]
        with pytest.raises(
            ValueError, match="num_minibatches: expected at most the 5 trainable rows, received 6"
        ):
            rollout_buffer.get_minibatches(6, "cpu")
        for bad in (0, -1, True):
            with pytest.raises(ValueError, match="num_minibatches: expected a positive int"):
                rollout_buffer.get_minibatches(bad, "cpu")


def test_minibatch_contents_match_the_buffer_rows() -> None:
    trainable = np.random.default_rng(4).random((6, 4)) < 0.7
    with id_buffer(6, 4, trainable) as rollout_buffer:
        minibatches = rollout_buffer.get_minibatches(3, "cpu")
        # Actions hold the flat row index t * N + env, so each minibatch tells which rows it served.
        rows = [minibatch.actions.numpy() for minibatch in minibatches]
        assert (
            sorted(np.concatenate(rows).tolist()) == np.flatnonzero(trainable.reshape(-1)).tolist()
        )
        for minibatch, minibatch_rows in zip(minibatches, rows, strict=True):
            assert isinstance(minibatch, RolloutMinibatch)
            assert minibatch.observations.dtype == torch.uint8
            assert minibatch.observations.shape == (len(minibatch_rows), 2)
            np.testing.assert_array_equal(minibatch.observations[:, 0].numpy(), minibatch_rows)
            np.testing.assert_array_equal(
                minibatch.log_probs.numpy(), -minibatch_rows.astype(np.float32)
            )
            np.testing.assert_array_equal(
                minibatch.values.numpy(), minibatch_rows.astype(np.float32)
            )
            np.testing.assert_array_equal(
                minibatch.advantages.numpy(), rollout_buffer.advantages.reshape(-1)[minibatch_rows]
            )
            np.testing.assert_array_equal(
                minibatch.returns.numpy(), rollout_buffer.returns.reshape(-1)[minibatch_rows]
            )
            for tensor in minibatch[2:6]:
                assert tensor.dtype == torch.float32
            # fields carries every minibatch field of the schema, the named ones are the same tensors.
            assert set(minibatch.fields) == {f.name for f in rollout_buffer.schema.minibatch}
            assert minibatch.fields["actions"] is minibatch.actions
            assert minibatch.fields["observations"] is minibatch.observations
            assert minibatch.fields["policy_versions"].dtype == torch.int64
            np.testing.assert_array_equal(
                minibatch.fields["policy_versions"].numpy(),
                rollout_buffer.policy_versions.reshape(-1)[minibatch_rows],
            )


def test_flat_batch_is_built_once_and_serves_every_trainable_row_once_per_epoch() -> None:
    trainable = np.random.default_rng(7).random((5, 4)) < 0.6
    trainable[0, 0] = True
    with id_buffer(5, 4, trainable) as rollout_buffer:
        flat = rollout_buffer.flat_batch("cpu")
        assert isinstance(flat, FlatBatch)
        np.testing.assert_array_equal(flat.rows, np.flatnonzero(trainable.reshape(-1)))
        assert flat.size == int(trainable.sum()) == rollout_buffer.trainable_size
        np.testing.assert_array_equal(flat.fields["actions"].numpy(), flat.rows)
        assert rollout_buffer.flat_batch("cpu") is flat, "cached until the buffer changes"
        assert rollout_buffer.observation_uploads == 1
        generator = np.random.default_rng(0)
        orders = []
        for _epoch in range(3):
            minibatches = flat.minibatches(3, generator)
            served = np.concatenate([m.actions.numpy() for m in minibatches])
            assert sorted(served.tolist()) == flat.rows.tolist(), "every row exactly once per epoch"
            sizes = [len(m.actions) for m in minibatches]
            assert max(sizes) - min(sizes) <= 1
            orders.append(served.tolist())
        assert orders[0] != orders[1], "each epoch reshuffles"
        assert rollout_buffer.observation_uploads == 1, "epochs only index the uploaded batch"
        with pytest.raises(ValueError, match="num_minibatches: expected at most"):
            flat.minibatches(flat.size + 1, generator)
        with pytest.raises(ValueError, match="num_minibatches: expected a positive int"):
            flat.minibatches(0, generator)
        np.testing.assert_array_equal(
            flat.fields["advantages"].numpy(), rollout_buffer.advantages.reshape(-1)[flat.rows]
        )


def test_the_whole_batch_is_every_trainable_row_in_stored_order() -> None:
    trainable = np.ones((6, 4), bool)
    trainable[2, 1] = trainable[5, 3] = False
    with id_buffer(6, 4, trainable) as rollout_buffer:
        flat = rollout_buffer.flat_batch("cpu")
        whole = flat.whole()
        expected = [t * 4 + env for t in range(6) for env in range(4) if trainable[t, env]]
        assert whole.actions.tolist() == expected
        assert whole.values.tolist() == [float(i) for i in expected]
        assert whole.log_probs.tolist() == [-float(i) for i in expected]
        assert set(whole.fields) == set(flat.fields)


def test_minibatches_are_shuffled_and_reproducible() -> None:
    with id_buffer(10, 10) as rollout_buffer:
        first = rollout_buffer.get_minibatches(1, "cpu", generator=np.random.default_rng(5))[
            0
        ].values.numpy()
        again = rollout_buffer.get_minibatches(1, "cpu", generator=np.random.default_rng(5))[
            0
        ].values.numpy()
        other = rollout_buffer.get_minibatches(1, "cpu", generator=np.random.default_rng(6))[
            0
        ].values.numpy()
        np.testing.assert_array_equal(first, again)
        assert not np.array_equal(first, np.sort(first)), (
            "100 rows in their stored order: not shuffled"
        )
        assert not np.array_equal(first, other)


def test_minibatches_serve_the_raw_advantages_of_trainable_rows_only() -> None:
    """Advantages leave the buffer as GAE computed them, trainable rows only; the update's one
    normalisation (per minibatch, ``oakemu_core.algo.losses.normalize_advantages``) over all of
    them gives mean 0 and std 1 from the trainable rows' statistics alone."""
    trainable = np.ones((4, 3), bool)
    trainable[0, :] = False
    with id_buffer(4, 3, trainable) as rollout_buffer:
        raw = np.concatenate(
            [m.advantages.numpy() for m in rollout_buffer.get_minibatches(2, "cpu")]
        )
        np.testing.assert_allclose(np.sort(raw), np.sort(rollout_buffer.advantages[trainable]))
        served = normalize_advantages(rollout_buffer.flat_batch("cpu").fields["advantages"])
        assert abs(float(served.mean())) < 1e-6
        assert float(served.std(correction=0)) == pytest.approx(1.0, abs=1e-5)
        expected = rollout_buffer.advantages[trainable]
        expected = (expected - expected.mean()) / expected.std()
        np.testing.assert_allclose(served.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_observations_upload_once_until_the_buffer_changes() -> None:
    with id_buffer(4, 3) as rollout_buffer:
        assert rollout_buffer.observation_uploads == 0
        rollout_buffer.get_minibatches(2, "cpu")
        rollout_buffer.get_minibatches(3, "cpu")
        assert rollout_buffer.observation_uploads == 1
        rollout_buffer.mark_untrainable(np.eye(4, 3, dtype=bool))
        rollout_buffer.get_minibatches(2, "cpu")
        assert rollout_buffer.observation_uploads == 2
        rollout_buffer.reset()
        for t in range(4):
            arrays = step_arrays(3, t, obs_shape=(2,))
            arrays["observations"] = np.full((3, 2), 200 + t, np.uint8)
            rollout_buffer.add(**arrays)
        gae_ready(rollout_buffer)
        minibatch = rollout_buffer.get_minibatches(1, "cpu")[0]
        assert rollout_buffer.observation_uploads == 3
        assert minibatch.observations.min() >= 200, "the cache must not serve the previous rollout"


def test_stale_advantages_are_refused(buffer: RolloutBuffer) -> None:
    fill(buffer)
    with pytest.raises(StaleAdvantagesError, match="compute_gae"):
        buffer.get_minibatches(1, "cpu")
    gae_ready(buffer)
    assert buffer.advantages_are_current
    buffer.mark_untrainable(np.zeros((4, 3), bool))
    buffer.get_minibatches(1, "cpu")  # a mask change keeps the advantages valid
    buffer.reset_columns(np.array([0]))
    with pytest.raises(StaleAdvantagesError):
        buffer.get_minibatches(1, "cpu")


def test_continuous_actions_keep_their_shape_and_dtype() -> None:
    with RolloutBuffer(
        2, 2, (3,), np.float32, action_shape=(2,), action_dtype=np.float32
    ) as rollout_buffer:
        for t in range(2):
            rollout_buffer.add(
                np.zeros((2, 3), np.float32),
                np.full((2, 2), t + 0.5, np.float32),
                np.zeros(2, np.float32),
                np.zeros(2, np.float32),
                np.zeros(2, np.float32),
                np.zeros(2, bool),
            )
        gae_ready(rollout_buffer)
        minibatch = rollout_buffer.get_minibatches(1, "cpu")[0]
        assert minibatch.actions.shape == (4, 2) and minibatch.actions.dtype == torch.float32
        with pytest.raises(ValueError, match=r"actions: expected shape \(2, 2\) and dtype float32"):
            rollout_buffer.reset()
            rollout_buffer.add(
                np.zeros((2, 3), np.float32),
                np.zeros(2, np.int64),
                np.zeros(2, np.float32),
                np.zeros(2, np.float32),
                np.zeros(2, np.float32),
                np.zeros(2, bool),
            )


# ---------------------------------------------------------------------------------- diagnostics
def test_trainable_diagnostics(buffer: RolloutBuffer) -> None:
    assert buffer.trainable_diagnostics() is None
    trainable = np.array([True, False, True])
    for step in range(4):
        buffer.add(**step_arrays(3, step), trainable=trainable)
    gae_ready(buffer)
    diagnostics = buffer.trainable_diagnostics()
    assert diagnostics is not None
    mask = np.tile(trainable, (4, 1))
    np.testing.assert_array_equal(diagnostics.values, buffer.values[mask])
    np.testing.assert_array_equal(diagnostics.returns, buffer.returns[mask])
    np.testing.assert_array_equal(diagnostics.advantages, buffer.advantages[mask])
    assert diagnostics.values.shape == (8,)


def test_estimate_memory_pressure(buffer: RolloutBuffer) -> None:
    diagnostics = {
        diagnostic.resource: diagnostic for diagnostic in buffer.estimate_memory_pressure(2)
    }
    assert {"cpu", "shm"} <= set(diagnostics)
    assert diagnostics["shm"].required_bytes == buffer.memory_bytes
    assert diagnostics["cpu"].required_bytes > buffer.memory_bytes
    for diagnostic in diagnostics.values():
        assert diagnostic.ok == (diagnostic.required_bytes <= diagnostic.available_bytes)
        assert str(diagnostic.required_bytes) in diagnostic.message
    assert any(key.startswith("cuda") for key in diagnostics) == torch.cuda.is_available()
    with pytest.raises(ValueError, match="num_minibatches: expected a positive int"):
        buffer.estimate_memory_pressure(0)


def test_too_small_shm_is_reported_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        memory_diagnostics, "shm_free_bytes", lambda path="/dev/shm": 64 * 1024 * 1024
    )
    with pytest.raises(
        SharedMemoryTooSmallError, match=r"need 231\d{6} bytes .* 67108864 bytes .*shm_size"
    ):
        RolloutBuffer(128, 64, (4, 84, 84), np.uint8)
    # the leak fixture checks that no segment was created


# ---------------------------------------------------------------------------------- sharing and life cycle
def test_owner_close_unlinks_every_segment() -> None:
    before = own_segments()
    rollout_buffer = RolloutBuffer(2, 2, (1,), np.uint8)
    names = sorted(own_segments() - before)
    assert len(names) == 14, "12 stored fields + column_steps + meta"
    assert all((SHM_DIR / name).exists() for name in names)
    assert len({name.split("_")[2] for name in names}) == 1, "one token per buffer"
    rollout_buffer.close()
    rollout_buffer.close()
    assert not any((SHM_DIR / name).exists() for name in names)
    with pytest.raises(RuntimeError, match="closed"):
        _ = rollout_buffer.observations
    with pytest.raises(RuntimeError, match="closed"):
        rollout_buffer.add(**step_arrays(2, obs_shape=(1,)))


def test_a_buffer_itself_cannot_be_pickled(buffer: RolloutBuffer) -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(buffer)


def test_construction_sweeps_segments_of_dead_owners(dead_pid: int) -> None:
    stale = SHM_DIR / f"{SEGMENT_PREFIX}{dead_pid}_0123456789ab_observations"
    stale.write_bytes(b"left by a killed learner")
    try:
        with RolloutBuffer(1, 1, (1,), np.uint8):
            assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_buffer_left_open_is_unlinked_at_interpreter_exit(run_python) -> None:
    result = run_python(
        """
        import numpy as np
        from oakemu_core.storage.rollout_buffer import RolloutBuffer
        import os
        kept = RolloutBuffer(2, 2, (3,), np.uint8)
        print(" ".join(sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"oakemu_{os.getpid()}_"))))
        """
    )
    assert result.returncode == 0, result.stderr
    names = result.stdout.split()
    assert len(names) == 14
    assert not any((SHM_DIR / name).exists() for name in names)


# ---------------------------------------------------------------------------------- issue case 4
def reference_normalise(
    advantages: list[list[float]], trainable: list[list[bool]]
) -> list[list[float]]:
    """Per-element normalisation over trainable rows (population std), 0 elsewhere."""
    selected = [a for row_a, row_t in zip(advantages, trainable) for a, t in zip(row_a, row_t) if t]
    if not selected:
        return [[0.0] * len(row) for row in advantages]
    mean = sum(selected) / len(selected)
    std = (sum((a - mean) ** 2 for a in selected) / len(selected)) ** 0.5
    return [
        [(a - mean) / (std + 1e-8) if t else 0.0 for a, t in zip(row_a, row_t)]
        for row_a, row_t in zip(advantages, trainable)
    ]


@st.composite
def random_rollouts(draw):
    num_steps = draw(st.integers(1, 8))
    num_envs = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (num_steps, num_envs)
    terminated = rng.random(shape) < 0.2
    truncated = (rng.random(shape) < 0.2) & ~terminated
    return {
        "rewards": rng.normal(size=shape).astype(np.float32),
        "values": rng.normal(size=shape).astype(np.float32),
        "dones": terminated | truncated,
        "bootstrap_values": np.where(truncated, rng.normal(size=shape), 0).astype(np.float32),
        "trainable": rng.random(shape) < draw(st.sampled_from([0.3, 0.8, 1.0])),
        "last_values": rng.normal(size=num_envs).astype(np.float32),
        "gamma": draw(st.sampled_from([0.0, 0.9, 0.99, 1.0])),
        "gae_lambda": draw(st.sampled_from([0.0, 0.95, 1.0])),
    }


@settings(max_examples=40, deadline=None)
@given(random_rollouts())
def test_issue_case_4_random_rollout_matches_reference_loop(rollout) -> None:
    num_steps, num_envs = rollout["rewards"].shape
    with RolloutBuffer(num_steps, num_envs, (1,), np.uint8) as rollout_buffer:
        for t in range(num_steps):
            rollout_buffer.add(
                np.zeros((num_envs, 1), np.uint8),
                np.arange(num_envs, dtype=np.int64) + t * num_envs,
                np.zeros(num_envs, np.float32),
                rollout["values"][t],
                rollout["rewards"][t],
                rollout["dones"][t],
                rollout["trainable"][t],
                bootstrap_values=rollout["bootstrap_values"][t],
            )
        rollout_buffer.compute_gae(
            rollout["last_values"],
            rollout["dones"][-1].copy(),
            rollout["gamma"],
            rollout["gae_lambda"],
        )
        expected_advantages, expected_returns = reference_gae(
            rollout["rewards"].tolist(),
            rollout["values"].tolist(),
            rollout["dones"].tolist(),
            rollout["bootstrap_values"].tolist(),
            rollout["last_values"].tolist(),
            rollout["gamma"],
            rollout["gae_lambda"],
        )
        np.testing.assert_allclose(
            rollout_buffer.advantages, expected_advantages, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(rollout_buffer.returns, expected_returns, rtol=1e-5, atol=1e-5)
        expected_normalised = reference_normalise(
            rollout_buffer.advantages.tolist(), rollout["trainable"].tolist()
        )
        trainable = rollout["trainable"]
        if trainable.any():  # the update's normalisation, over the trainable rows
            normalised = normalize_advantages(
                torch.from_numpy(rollout_buffer.advantages[trainable])
            )
            np.testing.assert_allclose(
                normalised.numpy(),
                np.asarray(expected_normalised)[trainable],
                rtol=1e-4,
                atol=1e-4,
            )

        trainable_rows = int(rollout["trainable"].sum())
        if trainable_rows == 0:
            with pytest.raises(ValueError, match="num_minibatches"):
                rollout_buffer.get_minibatches(1, "cpu")
            return
        minibatches = rollout_buffer.get_minibatches(min(3, trainable_rows), "cpu")
        sizes = [len(minibatch.actions) for minibatch in minibatches]
        assert max(sizes) - min(sizes) <= 1
        served = sorted(int(a) for minibatch in minibatches for a in minibatch.actions)
        expected_rows = [
            t * num_envs + e
            for t in range(num_steps)
            for e in range(num_envs)
            if rollout["trainable"][t][e]
        ]
        assert served == expected_rows
        by_row = {
            int(a): float(adv) for m in minibatches for a, adv in zip(m.actions, m.advantages)
        }
        for row in expected_rows:
            assert by_row[row] == pytest.approx(
                expected_advantages[row // num_envs][row % num_envs], rel=1e-5, abs=1e-5
            )


def test_no_segments_of_this_process_are_left() -> None:
    before = own_segments()
    with RolloutBuffer(4, 3, OBS_SHAPE, np.uint8) as rollout_buffer:
        created = own_segments() - before
        # oakemu_<pid>_<token>_<array>: one segment per stored schema field plus the bookkeeping arrays.
        arrays = {name.split("_", 3)[3] for name in created}
        assert arrays == {f.name for f in rollout_buffer.schema.stored} | {"column_steps", "meta"}
        assert len(created) == 14
    assert own_segments() == before


# ---------------------------------------------------------------------------------- schema-driven fields
def masked_schema():
    """Plain uint8 (2,) observations, a categorical policy over 3 actions with action masks."""
    return build_schema({"": ((2,), np.uint8)}, Categorical(3, masked=True))


def test_constructor_needs_exactly_one_description_of_the_fields() -> None:
    with pytest.raises(
        ValueError, match="expected observation_shape and observation_dtype, or schema="
    ):
        RolloutBuffer(2, 2)
    with pytest.raises(ValueError, match="either schema= or observation_shape"):
        RolloutBuffer(2, 2, (2,), np.uint8, schema=masked_schema())


def test_schema_fields_are_stored_required_and_served_in_minibatches() -> None:
    schema = masked_schema()
    with RolloutBuffer(2, 2, schema=schema) as rollout_buffer:
        assert rollout_buffer.field("action_mask").shape == (2, 2, 3)
        assert rollout_buffer.field("action_mask").dtype == np.bool_
        arrays = step_arrays(2, 0, obs_shape=(2,))
        with pytest.raises(ValueError, match="^action_mask: required field missing"):
            rollout_buffer.add(**arrays)
        with pytest.raises(
            ValueError, match=r"^action_mask: expected shape \(2, 3\) and dtype bool.*dtype uint8"
        ):
            rollout_buffer.add(**arrays, action_mask=np.ones((2, 3), np.uint8))
        with pytest.raises(
            ValueError, match=r"^action_mask: expected shape \(2, 3\).*received shape \(2, 4\)"
        ):
            rollout_buffer.write(
                0, np.array([0, 1]), {**arrays, "action_mask": np.ones((2, 4), bool)}
            )
        with pytest.raises(ValueError, match=r"unknown fields \['my_extra'\]"):
            rollout_buffer.add(
                **arrays, action_mask=np.ones((2, 3), bool), my_extra=np.zeros(2, np.float32)
            )
        assert rollout_buffer.step == 0 and not rollout_buffer.field("action_mask").any()
        masks = [
            np.array([[True, False, True], [False, True, False]]),
            np.array([[True, True, False], [False, False, True]]),
        ]
        for t in range(2):
            arrays = step_arrays(2, t, obs_shape=(2,))
            arrays["actions"] = np.array([0, 1]) if t == 0 else np.array([1, 2])
            rollout_buffer.add(**arrays, action_mask=masks[t])
        np.testing.assert_array_equal(rollout_buffer.field("action_mask"), np.stack(masks))
        gae_ready(rollout_buffer)
        flat = rollout_buffer.flat_batch("cpu")
        np.testing.assert_array_equal(
            flat.fields["action_mask"].numpy(), np.stack(masks).reshape(4, 3)[flat.rows]
        )
        minibatch = rollout_buffer.get_minibatches(2, "cpu")[0]
        assert minibatch.fields["action_mask"].dtype == torch.bool and minibatch.fields[
            "action_mask"
        ].shape == (2, 3)


def test_add_takes_the_seed_keyword_action_masks_and_checks_masks_as_the_wire_does() -> None:
    """The SB3-style ``add(..., action_masks=)``; a mask that allows nothing and an action its mask
    forbids are refused by add as they are by decode_step (the same schema checks), nothing written."""
    from oakemu_core.transport.codec import MessageRejected
    from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step

    schema = masked_schema()
    arrays = step_arrays(2, 0, obs_shape=(2,))
    arrays["actions"] = np.array([0, 1])
    empty_row = np.array([[True, False, False], [False, False, False]])
    forbidden = np.array([[True, False, False], [True, False, False]])
    with RolloutBuffer(2, 2, schema=schema) as rollout_buffer:
        with pytest.raises(ValueError, match="^action_mask: env 1 allows no action"):
            rollout_buffer.add(**arrays, action_masks=empty_row)
        with pytest.raises(
            ValueError, match="^actions: env 1 took an action its action_mask forbids"
        ):
            rollout_buffer.add(**arrays, action_masks=forbidden)
        with pytest.raises(ValueError, match="^action_masks: received the masks twice"):
            rollout_buffer.add(**arrays, action_masks=forbidden, action_mask=forbidden)
        assert rollout_buffer.step == 0 and not rollout_buffer.field("action_mask").any()
        allowed = np.array([[True, False, False], [False, True, False]])
        rollout_buffer.add(**arrays, action_masks=allowed)
        np.testing.assert_array_equal(rollout_buffer.field("action_mask")[0], allowed)
    sent = {
        **arrays,
        "truncated": np.zeros(2, bool),
        "bootstrap_values": np.zeros(2, np.float32),
        "next_values": np.zeros(2, np.float32),
        "trainable": np.ones(2, bool),
    }
    for mask in (empty_row, forbidden):
        frame = encode_step(
            StepMessage("a", "a-1", 0, 0, {**sent, "action_mask": mask}), StepSpec(2, schema)
        )
        with pytest.raises(MessageRejected) as info:
            decode_step(frame, lambda *_: StepSpec(2, schema), max_bytes=1 << 20)
        assert info.value.reason == "value_range"


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("rewards", np.array([0.0, np.nan, 0.0], np.float32), "^rewards: expected finite values"),
        ("values", np.array([np.inf, 0.0, 0.0], np.float32), "^values: expected finite values"),
        ("actions", np.array([0, 3, 1]), r"^actions: expected values <= 2"),
        ("actions", np.array([0, -1, 1]), r"^actions: expected values >= 0"),
    ],
)
def test_add_refuses_impossible_values_as_the_wire_does(
    field: str, bad: np.ndarray, message: str
) -> None:
    with RolloutBuffer(
        2, 3, schema=build_schema({"": (OBS_SHAPE, np.uint8)}, Categorical(3))
    ) as rollout_buffer:
        arrays = {**step_arrays(3), "actions": np.array([0, 1, 2])}
        with pytest.raises(ValueError, match=message):
            rollout_buffer.add(**{**arrays, field: bad})
        assert rollout_buffer.step == 0
        # Finite numbers beyond the wire's magnitude limit are the caller's to store (the wire guards the network).
        rollout_buffer.add(**{**arrays, "rewards": np.full(3, 3e38, np.float32)})
        assert rollout_buffer.step == 1


def test_the_checked_write_applies_the_truncation_rules_when_truncated_is_given(
    buffer: RolloutBuffer,
) -> None:
    arrays = {**step_arrays(3), "truncated": np.array([False, True, False])}
    with pytest.raises(ValueError, match="^truncated: every truncated env must also be done"):
        buffer.write(0, np.arange(3), arrays)
    arrays["dones"] = np.array([False, True, False])
    with pytest.raises(ValueError, match="^truncated: expected shape"):
        buffer.write(0, np.arange(3), {**arrays, "truncated": np.zeros(2, bool)})
    buffer.write(
        0, np.arange(3), {**arrays, "bootstrap_values": np.array([0.0, 1.5, 0.0], np.float32)}
    )
    assert buffer.bootstrap_values[0].tolist() == [0.0, 1.5, 0.0] and buffer.dones[0].tolist() == [
        False,
        True,
        False,
    ]


def test_scale_rewards_multiplies_and_makes_advantages_stale(buffer: RolloutBuffer) -> None:
    fill(buffer)
    gae_ready(buffer)
    before = buffer.rewards.copy()
    buffer.scale_rewards(0.5)
    np.testing.assert_array_equal(buffer.rewards, before * np.float32(0.5))
    assert not buffer.advantages_are_current
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor: expected a finite positive float"):
            buffer.scale_rewards(bad)
