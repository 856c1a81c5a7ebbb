"""Tests for oakemu_core.ppo: loss terms against hand-computed numbers, the schedule, and the learner
on real RolloutBuffers (ratio check, learning on a bandit, early stop, counters)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oakemu_core.ppo import LinearSchedule, PPORuntimeState, explained_variance, ppo_losses


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------
def _loss_inputs():
    ratios = torch.tensor([1.5, 0.85, 1.05, 0.5], dtype=torch.float64)
    new_log_probs = ratios.log().requires_grad_(True)
    old_log_probs = torch.zeros(4, dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -2.0, -1.0], dtype=torch.float64)
    new_values = torch.tensor([0.5, -0.05, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    old_values = torch.zeros(4, dtype=torch.float64)
    returns = torch.tensor([1.0, 0.0, 0.0, 0.3], dtype=torch.float64)
    entropy = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    return new_log_probs, old_log_probs, advantages, new_values, old_values, returns, entropy


def test_ppo_losses_match_hand_computed_values() -> None:
    inputs = _loss_inputs()
    out = ppo_losses(*inputs, clip_coef=0.2, clip_value_loss=True)
    # Per row max(-A r, -A clip(r, 0.8, 1.2)): -1.2, -0.85, 2.1, 0.8.
    assert out["policy_loss"].item() == pytest.approx((-1.2 - 0.85 + 2.1 + 0.8) / 4)
    # Clipped values V_old + clip(V - V_old, +-0.2) = 0.2, -0.05, 0.2, 0.0; squared errors
    # max((0.25, 0.64), (0.0025, 0.0025), (1, 0.04), (0.09, 0.09)).
    assert out["value_loss"].item() == pytest.approx(0.5 * (0.64 + 0.0025 + 1.0 + 0.09) / 4)
    assert out["entropy"].item() == pytest.approx(2.5)
    expected_kl = np.mean([(r - 1) - math.log(r) for r in (1.5, 0.85, 1.05, 0.5)])
    assert out["approx_kl"].item() == pytest.approx(expected_kl)
    assert out["clip_fraction"].item() == pytest.approx(0.5)  # rows 0 and 3 have |r - 1| > 0.2
    np.testing.assert_allclose(out["ratio"].numpy(), [1.5, 0.85, 1.05, 0.5])

    unclipped = ppo_losses(*inputs, clip_coef=0.2, clip_value_loss=False)
    assert unclipped["value_loss"].item() == pytest.approx(0.5 * (0.25 + 0.0025 + 1.0 + 0.09) / 4)


def test_ppo_policy_gradient_vanishes_on_clipped_rows() -> None:
    new_log_probs, *rest = _loss_inputs()
    out = ppo_losses(new_log_probs, *rest, clip_coef=0.2, clip_value_loss=True)
    out["policy_loss"].backward()
    # d/d log r of -A r / 4 is -A r / 4 on unclipped rows; 0 where the clip is active.
    np.testing.assert_allclose(new_log_probs.grad.numpy(), [0.0, -0.85 / 4, 2 * 1.05 / 4, 0.0], atol=1e-12)


def test_explained_variance() -> None:
    targets = np.array([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(targets, targets) == 1.0
    assert explained_variance(np.full(4, 2.5), targets) == pytest.approx(0.0)
    # residual (0.5, -0.5, 0.5, -0.5): var 0.25; var(targets) 1.25.
    assert explained_variance(targets + np.array([0.5, -0.5, 0.5, -0.5]), targets) == pytest.approx(0.8)
    assert math.isnan(explained_variance(np.zeros(3), np.ones(3)))
    assert math.isnan(explained_variance(np.zeros(0), np.zeros(0)))


def test_linear_schedule_and_its_state() -> None:
    schedule = LinearSchedule(1.0, 0.0, 4)
    seen = []
    for _ in range(6):
        seen.append(schedule.value())
        schedule.step()
    assert seen == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    restored = LinearSchedule(9.0, 9.0, 1)
    partial = LinearSchedule(2.5e-4, 0.0, 10)
    partial.step()
    partial.step()
    restored.load_state_dict(partial.state_dict())
    assert restored.value() == pytest.approx(2.5e-4 * 0.8)
    with pytest.raises(ValueError, match="total_updates"):
        LinearSchedule(1.0, 0.0, 0)
    with pytest.raises(ValueError, match="updates"):
        restored.load_state_dict({"start": 1.0, "end": 0.0, "total_updates": 3})


def test_runtime_state_dict_round_trip() -> None:
    state = PPORuntimeState(iterations=3, rollouts_collected=4, policy_version=5, shuffle_rng_state={"a": 1})
    assert PPORuntimeState.from_dict(state.to_dict()) == state
    with pytest.raises(ValueError, match="policy_version"):
        PPORuntimeState.from_dict({"iterations": 1, "rollouts_collected": 1})
