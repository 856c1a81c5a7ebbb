"""Tests for oakemu_core.storage.gae.compute_gae, against hand-computed numbers and a per-element reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oakemu_core.storage.gae import compute_gae

GAMMA = 0.99
GAE_LAMBDA = 0.95


def column(values: list[float], dtype: type = np.float32) -> np.ndarray:
    """A one-env ``(T, 1)`` array."""
    return np.array(values, dtype=dtype).reshape(-1, 1)


def reference_gae(rewards, values, dones, bootstrap_values, last_values, gamma, gae_lambda):
    """Plain per-element GAE, one env and one step at a time (independent of the implementation)."""
    num_steps, num_envs = len(rewards), len(rewards[0])
    advantages = [[0.0] * num_envs for _ in range(num_steps)]
    returns = [[0.0] * num_envs for _ in range(num_steps)]
    for env in range(num_envs):
        following_advantage = 0.0
        for t in reversed(range(num_steps)):
            next_value = (
                float(last_values[env]) if t == num_steps - 1 else float(values[t + 1][env])
            )
            continues = 0.0 if dones[t][env] else 1.0
            delta = (
                float(rewards[t][env])
                + gamma * (continues * next_value + float(bootstrap_values[t][env]))
                - float(values[t][env])
            )
            following_advantage = delta + gamma * gae_lambda * continues * following_advantage
            advantages[t][env] = following_advantage
            returns[t][env] = following_advantage + float(values[t][env])
    return np.array(advantages), np.array(returns)


def test_issue_case_1_one_env_four_steps() -> None:
    advantages, returns = compute_gae(
        rewards=column([0, 1, 0, 2]),
        values=column([0.5, 0.6, 0.7, 0.8]),
        dones=column([0, 1, 0, 0], bool),
        bootstrap_values=column([0, 0, 0, 0]),
        last_values=np.array([0.9], np.float32),
        gamma=GAMMA,
        gae_lambda=GAE_LAMBDA,
    )
    assert advantages.dtype == np.float32 and returns.dtype == np.float32
    assert advantages.shape == (4, 1) and returns.shape == (4, 1)
    np.testing.assert_array_equal(
        np.round(advantages[:, 0], 4), np.array([0.4702, 0.4000, 2.0586, 2.0910], np.float32)
    )
    np.testing.assert_array_equal(
        np.round(returns[:, 0], 4), np.array([0.9702, 1.0000, 2.7586, 2.8910], np.float32)
    )


def test_truncated_step_bootstraps_but_blocks_flow() -> None:
    """By hand, gamma 0.9 lambda 0.8: step 0 truncated with V(final obs) = 2."""
    common = dict(rewards=column([1, 1]), values=column([0.5, 0.5]), dones=column([1, 0], bool))
    truncated, _ = compute_gae(
        **common,
        bootstrap_values=column([2, 0]),
        last_values=np.zeros(1, np.float32),
        gamma=0.9,
        gae_lambda=0.8,
    )
    terminated, _ = compute_gae(
        **common,
        bootstrap_values=column([0, 0]),
        last_values=np.zeros(1, np.float32),
        gamma=0.9,
        gae_lambda=0.8,
    )
    # step 1: delta = 1 + 0.9 * 0 - 0.5 = 0.5; step 0 does not see step 1.
    np.testing.assert_allclose(truncated[:, 0], [1 + 0.9 * 2 - 0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(terminated[:, 0], [1 - 0.5, 0.5], rtol=1e-6)


def test_envs_are_independent() -> None:
    """Two envs side by side give what each gives alone."""
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=(6, 2)).astype(np.float32)
    values = rng.normal(size=(6, 2)).astype(np.float32)
    dones = np.array([[0, 1], [0, 0], [1, 0], [0, 0], [0, 1], [0, 0]], bool)
    bootstrap = np.zeros((6, 2), np.float32)
    last = np.array([0.3, -0.2], np.float32)
    both, _ = compute_gae(rewards, values, dones, bootstrap, last, GAMMA, GAE_LAMBDA)
    for env in range(2):
        alone, _ = compute_gae(
            rewards[:, env : env + 1],
            values[:, env : env + 1],
            dones[:, env : env + 1],
            bootstrap[:, env : env + 1],
            last[env : env + 1],
            GAMMA,
            GAE_LAMBDA,
        )
        np.testing.assert_array_equal(both[:, env], alone[:, 0])


@st.composite
def rollouts(draw):
    num_steps = draw(st.integers(1, 12))
    num_envs = draw(st.integers(1, 5))
    floats = st.floats(-10, 10, width=32, allow_nan=False)

    def matrix(elements):
        return np.array(
            draw(st.lists(elements, min_size=num_steps * num_envs, max_size=num_steps * num_envs))
        )

    rewards = matrix(floats).astype(np.float32).reshape(num_steps, num_envs)
    values = matrix(floats).astype(np.float32).reshape(num_steps, num_envs)
    terminated = matrix(st.booleans()).reshape(num_steps, num_envs)
    truncated = matrix(st.booleans()).reshape(num_steps, num_envs) & ~terminated
    final_values = matrix(floats).astype(np.float32).reshape(num_steps, num_envs)
    bootstrap = np.where(truncated, final_values, np.float32(0)).astype(np.float32)
    last_values = np.array(draw(st.lists(floats, min_size=num_envs, max_size=num_envs)), np.float32)
    gamma = draw(st.floats(0, 1))
    gae_lambda = draw(st.floats(0, 1))
    return rewards, values, terminated | truncated, bootstrap, last_values, gamma, gae_lambda


@settings(max_examples=75, deadline=None)
@given(rollouts())
def test_matches_per_element_reference(rollout) -> None:
    rewards, values, dones, bootstrap, last_values, gamma, gae_lambda = rollout
    advantages, returns = compute_gae(
        rewards, values, dones, bootstrap, last_values, gamma, gae_lambda
    )
    expected_advantages, expected_returns = reference_gae(
        rewards.tolist(),
        values.tolist(),
        dones.tolist(),
        bootstrap.tolist(),
        last_values.tolist(),
        gamma,
        gae_lambda,
    )
    np.testing.assert_allclose(advantages, expected_advantages, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(returns, expected_returns, rtol=1e-5, atol=1e-4)


def valid_inputs() -> dict:
    return dict(
        rewards=np.zeros((3, 2), np.float32),
        values=np.zeros((3, 2), np.float32),
        dones=np.zeros((3, 2), bool),
        bootstrap_values=np.zeros((3, 2), np.float32),
        last_values=np.zeros(2, np.float32),
        gamma=GAMMA,
        gae_lambda=GAE_LAMBDA,
    )


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("rewards", np.zeros(3, np.float32), r"rewards: expected a numpy array of shape \(T, N\)"),
        (
            "values",
            np.zeros((3, 3), np.float32),
            r"values: expected shape \(3, 2\), received \(3, 3\)",
        ),
        ("dones", np.zeros((3, 2), np.float32), "dones: expected dtype bool, received float32"),
        (
            "bootstrap_values",
            np.zeros((3, 2), np.int64),
            "bootstrap_values: expected a floating dtype",
        ),
        (
            "last_values",
            np.zeros(3, np.float32),
            r"last_values: expected shape \(2,\), received \(3,\)",
        ),
        ("values", [[0.0, 0.0]] * 3, "values: expected a numpy array"),
        ("gamma", 1.5, r"gamma: expected a value in \[0, 1\], received 1.5"),
        ("gae_lambda", -0.1, "gae_lambda: expected a value in"),
    ],
)
def test_invalid_inputs_are_rejected(field: str, bad, message: str) -> None:
    inputs = valid_inputs()
    inputs[field] = bad
    with pytest.raises(ValueError, match=message):
        compute_gae(**inputs)


def test_bootstrap_on_a_step_that_is_not_done_is_rejected() -> None:
    inputs = valid_inputs()
    inputs["bootstrap_values"][1, 0] = 0.5
    with pytest.raises(
        ValueError, match="bootstrap_values: expected 0 on every step that is not done"
    ):
        compute_gae(**inputs)
