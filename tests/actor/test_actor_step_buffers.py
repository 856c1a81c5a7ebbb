"""Tests for oakemu_core.actor.step_buffers: recording actions and step results, writing to a buffer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from oakemu_core import PPOActionBundle, PPOActorStepBuffers, RolloutBuffer
from oakemu_core.policy.distributions import Categorical, DiagGaussian
from oakemu_core.step_schema import build_schema

OBS_SHAPE = (2, 2)


@pytest.fixture
def steps() -> PPOActorStepBuffers:
    return PPOActorStepBuffers.create(
        num_envs=4, observation_shape=OBS_SHAPE, observation_dtype=np.uint8
    )


def bundle(actions: list[int], log_probs: list[float], values: list[float]) -> PPOActionBundle:
    return PPOActionBundle(
        np.array(actions, np.int64), np.array(log_probs, np.float32), np.array(values, np.float32)
    )


def test_create_allocates_zeroed_arrays(steps: PPOActorStepBuffers) -> None:
    expected = {
        "observations": ((4, 2, 2), np.uint8),
        "actions": ((4,), np.int64),
        "log_probs": ((4,), np.float32),
        "values": ((4,), np.float32),
        "rewards": ((4,), np.float32),
        "dones": ((4,), np.bool_),
        "trainable": ((4,), np.bool_),
        "truncated": ((4,), np.bool_),
        "bootstrap_values": ((4,), np.float32),
    }
    for name, (shape, dtype) in expected.items():
        array = getattr(steps, name)
        assert array.shape == shape and array.dtype == dtype, name
        assert not array.any(), name
    assert steps.num_envs == 4
    assert not steps.stores_rollout_step


def test_create_supports_continuous_actions() -> None:
    steps = PPOActorStepBuffers.create(
        num_envs=2,
        observation_shape=(3,),
        observation_dtype=np.float32,
        action_shape=(2,),
        action_dtype=np.float32,
    )
    assert steps.actions.shape == (2, 2) and steps.actions.dtype == np.float32
    with pytest.raises(ValueError, match="num_envs: expected a positive int"):
        PPOActorStepBuffers.create(num_envs=0, observation_shape=(3,), observation_dtype=np.float32)


def test_create_needs_exactly_one_description_of_the_fields() -> None:
    schema = build_schema({"": ((3,), np.float32)}, Categorical(2))
    with pytest.raises(
        ValueError, match="expected observation_shape and observation_dtype, or schema="
    ):
        PPOActorStepBuffers.create(num_envs=2)
    with pytest.raises(ValueError, match="either schema= or observation_shape"):
        PPOActorStepBuffers.create(
            num_envs=2, observation_shape=(3,), observation_dtype=np.float32, schema=schema
        )


def test_record_action_bundle_for_a_subset_of_envs(steps: PPOActorStepBuffers) -> None:
    steps.reset_action_selection()
    steps.record_action_bundle_for_env_ids(
        bundle([5, 6], [-0.5, -0.25], [1.5, 2.5]), env_ids=[3, 1], trainable=[True, False]
    )
    np.testing.assert_array_equal(steps.actions, [0, 6, 0, 5])
    np.testing.assert_array_equal(steps.log_probs, np.array([0, -0.25, 0, -0.5], np.float32))
    np.testing.assert_array_equal(steps.values, np.array([0, 2.5, 0, 1.5], np.float32))
    np.testing.assert_array_equal(steps.trainable, [False, False, False, True])
    assert steps.stores_rollout_step
    steps.reset_action_selection()
    assert not steps.trainable.any() and not steps.stores_rollout_step


def test_non_trainable_only_step_is_not_stored(steps: PPOActorStepBuffers) -> None:
    steps.reset_action_selection()
    steps.record_action_bundle_for_env_ids(
        bundle([1], [0.0], [0.0]), env_ids=np.array([0]), trainable=np.array([False])
    )
    assert not steps.stores_rollout_step


@pytest.mark.parametrize(
    ("action_bundle", "env_ids", "trainable", "message"),
    [
        (bundle([1, 2], [0, 0], [0, 0]), [0, 0], [True, True], "env_ids: expected distinct ids"),
        (bundle([1], [0], [0]), [4], [True], r"env_ids: expected ids in \[0, 4\)"),
        (bundle([1], [0], [0]), [1.0], [True], "env_ids: expected a 1-D sequence of ints"),
        (bundle([1, 2], [0, 0], [0, 0]), [0, 1], [True], "trainable: expected 2 bools"),
        (bundle([1, 2], [0, 0], [0, 0]), [0, 1], [1, 0], "trainable: expected 2 bools"),
        (
            bundle([1, 2, 3], [0, 0, 0], [0, 0, 0]),
            [0, 1],
            [True, True],
            r"action_bundle.actions: expected shape \(2,\)",
        ),
        (
            PPOActionBundle(
                np.array([1, 2], np.int32), np.zeros(2, np.float32), np.zeros(2, np.float32)
            ),
            [0, 1],
            [True, True],
            "action_bundle.actions: expected shape .2,. and dtype int64, received shape .2,. and dtype int32",
        ),
        (
            PPOActionBundle(
                np.array([1, 2], np.int64), np.zeros(2, np.float64), np.zeros(2, np.float32)
            ),
            [0, 1],
            [True, True],
            "action_bundle.log_probs: .*dtype float64",
        ),
    ],
)
def test_bad_action_bundles_are_rejected_before_writing(
    steps: PPOActorStepBuffers, action_bundle, env_ids, trainable, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        steps.record_action_bundle_for_env_ids(action_bundle, env_ids=env_ids, trainable=trainable)
    assert not steps.actions.any() and not steps.trainable.any()


def test_record_step_result_carries_truncation(steps: PPOActorStepBuffers) -> None:
    steps.record_step_result(0, 1.5, done=False)
    steps.record_step_result(1, -1.0, done=True)  # terminated
    steps.record_step_result(2, 0.5, done=True, truncated=True, bootstrap_value=3.25)
    np.testing.assert_array_equal(steps.rewards, np.array([1.5, -1.0, 0.5, 0.0], np.float32))
    np.testing.assert_array_equal(steps.dones, [False, True, True, False])
    np.testing.assert_array_equal(steps.truncated, [False, False, True, False])
    np.testing.assert_array_equal(steps.bootstrap_values, np.array([0, 0, 3.25, 0], np.float32))
    steps.reset_step_results()
    for name in ("rewards", "dones", "truncated", "bootstrap_values"):
        assert not getattr(steps, name).any(), name


def test_record_step_result_rejects_inconsistent_flags(steps: PPOActorStepBuffers) -> None:
    with pytest.raises(ValueError, match="truncated: expected done=True"):
        steps.record_step_result(0, 0.0, done=False, truncated=True)
    with pytest.raises(
        ValueError, match="bootstrap_value: expected 0 on a step that is not truncated"
    ):
        steps.record_step_result(0, 0.0, done=True, bootstrap_value=1.0)
    with pytest.raises(ValueError, match=r"env_id: expected an int in \[0, 4\)"):
        steps.record_step_result(4, 0.0, done=False)
    assert not steps.rewards.any() and not steps.dones.any()


def test_record_observations_checks_type(steps: PPOActorStepBuffers) -> None:
    frames = np.arange(16, dtype=np.uint8).reshape(4, 2, 2)
    steps.record_observations(frames)
    np.testing.assert_array_equal(steps.observations, frames)
    with pytest.raises(
        ValueError,
        match="observations: expected shape .4, 2, 2. and dtype uint8, received shape .4, 2, 2. and dtype float32",
    ):
        steps.record_observations(frames.astype(np.float32))


@pytest.fixture
def rollout_buffer() -> Iterator[RolloutBuffer]:
    with RolloutBuffer(2, 4, OBS_SHAPE, np.uint8) as buffer:
        yield buffer


def test_add_to_rollout_buffer_round_trip(
    steps: PPOActorStepBuffers, rollout_buffer: RolloutBuffer
) -> None:
    for step in range(2):
        steps.record_observations(np.full((4, 2, 2), step + 1, np.uint8))
        steps.reset_action_selection()
        steps.record_action_bundle_for_env_ids(
            bundle([step, step + 1, step + 2], [-1.0, -2.0, -3.0], [0.5, 0.25, 0.125]),
            env_ids=[0, 1, 2],
            trainable=[True, True, step == 0],
        )
        steps.reset_step_results()
        steps.record_step_result(0, 1.0, done=False)
        steps.record_step_result(1, 2.0, done=step == 1)
        steps.record_step_result(2, 3.0, done=True, truncated=True, bootstrap_value=0.75)
        steps.add_to_rollout_buffer(rollout_buffer, policy_version=10 + step)
    assert rollout_buffer.is_full
    np.testing.assert_array_equal(rollout_buffer.observations[1], np.full((4, 2, 2), 2, np.uint8))
    np.testing.assert_array_equal(rollout_buffer.actions, [[0, 1, 2, 0], [1, 2, 3, 0]])
    np.testing.assert_array_equal(
        rollout_buffer.trainable, [[True, True, True, False], [True, True, False, False]]
    )
    np.testing.assert_array_equal(
        rollout_buffer.dones, [[False, False, True, False], [False, True, True, False]]
    )
    np.testing.assert_array_equal(
        rollout_buffer.bootstrap_values[:, 2], np.array([0.75, 0.75], np.float32)
    )
    assert not rollout_buffer.bootstrap_values[:, [0, 1, 3]].any()
    np.testing.assert_array_equal(rollout_buffer.policy_versions, [[10] * 4, [11] * 4])
    # The truncated env bootstraps from 0.75 (gamma 0.5, lambda 1): A_1 = 3 + 0.5 * 0.75 - 0.125.
    rollout_buffer.compute_gae(np.zeros(4, np.float32), rollout_buffer.dones[-1].copy(), 0.5, 1.0)
    assert rollout_buffer.advantages[1, 2] == pytest.approx(3 + 0.5 * 0.75 - 0.125)


def test_add_to_a_mismatched_buffer_is_rejected(steps: PPOActorStepBuffers) -> None:
    with RolloutBuffer(2, 4, (2, 2), np.float32) as other:
        with pytest.raises(
            ValueError, match="observations: expected shape .4, 2, 2. and dtype float32"
        ):
            steps.add_to_rollout_buffer(other)
        assert other.step == 0


# ------------------------------------------------------------- the documented constructor
def test_the_seed_pages_seven_argument_constructor_works() -> None:
    """The documented constructor takes the seven arrays positionally; the truncation fields default."""
    n = 3
    buffers = PPOActorStepBuffers(
        np.zeros((n, 4), np.float32),
        np.zeros(n, np.int64),
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
        np.zeros(n, bool),
        np.ones(n, bool),
    )
    assert buffers.num_envs == n and buffers.extras == {}
    assert (
        buffers.truncated.dtype == np.bool_
        and buffers.truncated.shape == (n,)
        and not buffers.truncated.any()
    )
    assert buffers.bootstrap_values.dtype == np.float32 and not buffers.bootstrap_values.any()
    with RolloutBuffer(1, n, (4,), np.float32) as rollout_buffer:
        buffers.add_to_rollout_buffer(rollout_buffer, policy_version=2)
        assert rollout_buffer.step == 1 and (rollout_buffer.policy_versions == 2).all()


def masked_schema():
    return build_schema({"": ((2,), np.uint8)}, Categorical(3, masked=True))


def test_schema_extras_are_allocated_recorded_sent_and_stored() -> None:
    schema = masked_schema()
    buffers = PPOActorStepBuffers.create(num_envs=2, schema=schema)
    assert set(buffers.extras) == {"action_mask"}
    assert (
        buffers.extras["action_mask"].shape == (2, 3)
        and buffers.extras["action_mask"].dtype == np.bool_
    )
    masks = np.array([[True, False, True], [False, True, False]])
    buffers.record_action_masks(masks)
    np.testing.assert_array_equal(buffers.extras["action_mask"], masks)
    with pytest.raises(ValueError, match=r"action_mask: expected shape \(2, 3\) and dtype bool"):
        buffers.record_action_masks(masks.astype(np.int8))
    buffers.record_observations(np.full((2, 2), 7, np.uint8))
    bundle = PPOActionBundle(
        np.array([2, 1]), np.array([-0.5, -0.1], np.float32), np.zeros(2, np.float32)
    )
    buffers.reset_action_selection()
    buffers.record_action_bundle_for_env_ids(bundle, env_ids=[0, 1], trainable=[True, True])
    buffers.reset_step_results()
    buffers.record_step_result(0, 1.0, done=True, truncated=True, bootstrap_value=0.25)
    buffers.record_step_result(1, 0.5, done=False)
    next_values = np.array([3.0, 4.0], np.float32)
    sent = buffers.sent_fields(next_values, schema)
    assert set(sent) == {f.name for f in schema.sent}, "sent_fields follows the schema"
    assert (
        sent["action_mask"] is buffers.extras["action_mask"] and sent["next_values"] is next_values
    )
    np.testing.assert_array_equal(sent["truncated"], [True, False])
    with RolloutBuffer(1, 2, schema=schema) as rollout_buffer:
        buffers.add_to_rollout_buffer(rollout_buffer)
        np.testing.assert_array_equal(rollout_buffer.field("action_mask")[0], masks)
        np.testing.assert_array_equal(rollout_buffer.bootstrap_values[0], [0.25, 0.0])
    plain = PPOActorStepBuffers.create(
        num_envs=2, observation_shape=(2,), observation_dtype=np.uint8
    )
    with pytest.raises(ValueError, match="no action_mask field"):
        plain.record_action_masks(masks)


def test_gaussian_bundle_fields_are_checked_and_copied() -> None:
    schema = build_schema({"": ((3,), np.float32)}, DiagGaussian([-1.0, -1.0], [1.0, 1.0]))
    buffers = PPOActorStepBuffers.create(num_envs=3, schema=schema)
    assert set(buffers.extras) == {"action_mean", "action_std"}
    assert buffers.actions.shape == (3, 2) and buffers.actions.dtype == np.float32
    mean = np.arange(4, dtype=np.float32).reshape(2, 2)
    std = np.full((2, 2), 0.5, np.float32)
    bundle = PPOActionBundle(
        mean + 0.1,
        np.zeros(2, np.float32),
        np.zeros(2, np.float32),
        {"action_mean": mean, "action_std": std},
    )
    buffers.record_action_bundle_for_env_ids(bundle, env_ids=[2, 0], trainable=[True, False])
    np.testing.assert_array_equal(buffers.extras["action_mean"][[2, 0]], mean)
    np.testing.assert_array_equal(buffers.extras["action_std"][[2, 0]], std)
    bad_shape = PPOActionBundle(
        mean,
        np.zeros(2, np.float32),
        np.zeros(2, np.float32),
        {"action_mean": mean[:, :1], "action_std": std},
    )
    before = buffers.extras["action_mean"].copy()
    with pytest.raises(ValueError, match=r"action_bundle\.action_mean: expected shape \(2, 2\)"):
        buffers.record_action_bundle_for_env_ids(bad_shape, env_ids=[1, 0], trainable=[True, True])
    unknown = PPOActionBundle(
        mean, np.zeros(2, np.float32), np.zeros(2, np.float32), {"logits": mean}
    )
    with pytest.raises(ValueError, match=r"action_bundle\.logits: not a field"):
        buffers.record_action_bundle_for_env_ids(unknown, env_ids=[1, 0], trainable=[True, True])
    np.testing.assert_array_equal(buffers.extras["action_mean"], before)


def test_dict_observations_keep_each_key_dtype() -> None:
    schema = build_schema(
        {"image": ((1, 4, 4), np.uint8), "vector": ((2,), np.float32)}, Categorical(2)
    )
    buffers = PPOActorStepBuffers.create(num_envs=2, schema=schema)
    assert (
        buffers.observations["image"].dtype == np.uint8
        and buffers.observations["vector"].dtype == np.float32
    )
    obs = {"image": np.full((2, 1, 4, 4), 200, np.uint8), "vector": np.ones((2, 2), np.float32)}
    buffers.record_observations(obs)
    sent = buffers.sent_fields(np.zeros(2, np.float32), schema)
    assert (
        sent["observations.image"].dtype == np.uint8 and (sent["observations.image"] == 200).all()
    )
    with pytest.raises(ValueError, match=r"observations\['image'\]: expected .*uint8.*float32"):
        buffers.record_observations(dict(obs, image=obs["image"].astype(np.float32)))
    with pytest.raises(
        ValueError, match=r"observations: expected a dict with keys \['image', 'vector'\]"
    ):
        buffers.record_observations({"image": obs["image"]})
