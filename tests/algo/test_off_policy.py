"""The decoupled PPO objective for rows acted by older policy versions (asynchronous mode):
the loss, the re-evaluation of a rollout with the current weights, and the learner that wires them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.algo.losses import ppo_losses
from oakemu_core.algo.ppo import PPOUpdater
from oakemu_core.algo.reevaluation import RolloutEvaluation
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.policy.distributions import DiagGaussian
from oakemu_core.policy.models import build_model
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from tests.algo.test_learner import cartpole, fill, make_learner  # noqa: F401 (cartpole is a fixture)
from tests.algo.test_ppo import (
    OBS_DIM,
    N,
    T,
    _fill,
    _fill_schema_buffer,
    _learner,
    _loss_inputs,
    _model,
    _trainable_rows,
)


def test_importance_weights_scale_each_rows_clipped_surrogate_and_its_gradient() -> None:
    new_log_probs, old_log_probs, advantages, *rest = _loss_inputs()
    weights = torch.tensor([0.5, 1.0, 2.0, 0.0], dtype=torch.float64)
    out = ppo_losses(
        new_log_probs,
        old_log_probs,
        advantages,
        *rest,
        clip_coef=0.2,
        clip_value_range=None,
        importance_weights=weights,
    )
    # Per row max(-A r, -A clip(r, 0.8, 1.2)) for r = 1.5, 0.85, 1.05, 0.5: -1.2, -0.85, 2.1, 0.8.
    assert out["policy_loss"].item() == pytest.approx(
        (0.5 * -1.2 + 1.0 * -0.85 + 2.0 * 2.1 + 0.0 * 0.8) / 4
    )
    out["policy_loss"].backward()
    # d/d log r of -w A r / 4 on unclipped rows (1 and 2), 0 on clipped ones (0) and weight 0 (3).
    np.testing.assert_allclose(
        new_log_probs.grad.numpy(), [0.0, -0.85 / 4, 2.0 * 2 * 1.05 / 4, 0.0], atol=1e-12
    )
    plain = ppo_losses(*_loss_inputs(), clip_coef=0.2, clip_value_range=None)
    assert plain["policy_loss"].item() == pytest.approx((-1.2 - 0.85 + 2.1 + 0.8) / 4)


def test_evaluate_rollout_gives_the_current_models_log_probs_and_values_row_by_row() -> None:
    model, behaviour = _model(0), _model(1)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [behaviour], np.random.default_rng(0))
        evaluation = PPOUpdater(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            device="cpu",
            ppo_epochs=1,
            num_minibatches=1,
            clip_coef=0.2,
            ent_coef=0.0,
            vf_coef=0.5,
            max_grad_norm=0.5,
        ).evaluate_rollout(buffer, chunk_rows=7)  # uneven chunks
        log_probs, values = evaluation.log_probs, evaluation.values
        assert evaluation.distribution_fields == {}
        assert (
            log_probs.shape == values.shape == (T, N)
            and log_probs.dtype == values.dtype == np.float32
        )
        with torch.no_grad():
            expected_log_probs, _, expected_values = model.evaluate_actions(
                torch.from_numpy(buffer.observations.reshape(T * N, OBS_DIM).copy()),
                torch.from_numpy(buffer.actions.reshape(T * N).copy()),
            )
        np.testing.assert_allclose(
            log_probs.reshape(-1), expected_log_probs.numpy(), rtol=1e-6, atol=1e-6
        )
        np.testing.assert_allclose(
            values.reshape(-1), expected_values.numpy(), rtol=1e-6, atol=1e-6
        )
        # The behaviour policy's stored figures are another model's: the re-evaluation changes them.
        assert np.abs(values - buffer.values).max() > 1e-3


def _sgd_updater(model, *, cap: float, lr: float = 0.1, **overrides) -> PPOUpdater:
    kwargs = dict(
        ppo_epochs=1,
        num_minibatches=1,
        clip_coef=0.2,
        clip_value_range=None,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=1e9,
        importance_weight_cap=cap,
    )
    kwargs.update(overrides)
    return PPOUpdater(model, torch.optim.SGD(model.parameters(), lr=lr), device="cpu", **kwargs)


def _sharp(model):
    """``model`` with its policy head's logits scaled up: log-probs far from another model's."""
    with torch.no_grad():
        model.actor.weight.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("cap", [1.0, 1e6])
def test_a_decoupled_update_matches_a_hand_written_sgd_step(cap: float) -> None:
    """Rows acted by another (older) model, some rows out of training; the proximal policy is the
    learner's own weights. The new weights equal w - lr * grad of
    ``mean(min(cap, pi_prox/mu) * max(-A r, -A clip(r)))`` with ``r = pi / pi_prox`` over the
    trainable rows, plus the value loss, written out here independently."""
    model, behaviour = _model(0), _sharp(_model(1))
    reference = copy.deepcopy(model)
    updater = _sgd_updater(model, cap=cap)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [behaviour], np.random.default_rng(3), versions=(4,))
        trainable = buffer.trainable.copy()
        trainable[::3, 1] = (
            False  # some rows out of training: the proximal figures must follow the flat rows
        )
        buffer.mark_untrainable(~trainable)
        proximal = updater.evaluate_rollout(buffer)
        obs, actions, behaviour_log_probs, advantages, returns = _trainable_rows(buffer, trainable)
        stats = updater.step(buffer, current_policy_version=5, proximal=proximal)

    logits, values = reference(obs)
    new_log_probs = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    proximal_log_probs = new_log_probs.detach()  # the reference still holds the learner's weights
    weights = torch.exp(proximal_log_probs - behaviour_log_probs).clamp(max=cap)
    ratio = torch.exp(new_log_probs - proximal_log_probs)
    policy_loss = (
        weights * torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    ).mean()
    value_loss = 0.5 * ((values - returns) ** 2).mean()
    (policy_loss + 0.5 * value_loss).backward()
    with torch.no_grad():
        for (name, p_ref), p_new in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(
                p_new, p_ref - 0.1 * p_ref.grad, rtol=1e-5, atol=1e-6, msg=name
            )
    assert stats.importance_weight_mean == pytest.approx(weights.mean().item(), rel=1e-5)
    assert stats.policy_loss == pytest.approx(policy_loss.item(), abs=1e-6)
    # The sharp behaviour policy makes the weights far from 1 both ways (so the cap matters).
    assert weights.min().item() < 0.5
    if cap == 1.0:
        assert weights.max().item() == 1.0
    else:
        assert weights.max().item() > 2.0


def test_the_clip_is_around_the_proximal_policy_not_the_acting_one() -> None:
    """lr 0: the policy does not move, so its ratio to the proximal policy (itself) stays 1 and
    nothing is clipped; plain PPO's ratio to the (sharper) acting policy is clipped on many rows."""
    behaviour = _sharp(_model(1))
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [behaviour], np.random.default_rng(4), versions=(0,))
        learner_model = _model(0)
        updater = _sgd_updater(learner_model, cap=1.0, lr=0.0, ppo_epochs=2, num_minibatches=4)
        decoupled = updater.step(
            buffer, current_policy_version=1, proximal=updater.evaluate_rollout(buffer)
        )
        plain = _sgd_updater(_model(0), cap=1.0, lr=0.0, ppo_epochs=2, num_minibatches=4).step(
            buffer, current_policy_version=1
        )
    assert decoupled.clip_fraction == 0.0 and decoupled.approx_kl == pytest.approx(0.0, abs=1e-6)
    assert plain.clip_fraction > 0.3 and plain.approx_kl > 0.1


def test_gaussian_approx_kl_is_the_exact_kl_from_the_proximal_parameters() -> None:
    distribution = DiagGaussian([-1.0, -1.0], [1.0, 1.0])
    schema = build_schema({"": ((OBS_DIM,), np.float32)}, distribution)
    torch.manual_seed(0)
    acting = build_model({"": ((OBS_DIM,), np.float32)}, distribution)
    with torch.no_grad():
        acting.actor.log_std.copy_(torch.tensor([-0.5, 0.3]))
    torch.manual_seed(1)
    learner_model = build_model({"": ((OBS_DIM,), np.float32)}, distribution)
    with RolloutBuffer(T, N, schema=schema, seed=0) as buffer:
        _fill_schema_buffer(buffer, acting, np.random.default_rng(1), masked=False)
        updater = _learner(learner_model, lr=0.0, ppo_epochs=1)
        evaluation = updater.evaluate_rollout(buffer)
        assert set(evaluation.distribution_fields) == {"action_mean", "action_std"}
        assert evaluation.distribution_fields["action_mean"].shape == (T, N, 2)
        decoupled = updater.step(buffer, current_policy_version=1, proximal=evaluation)
        plain = _learner(copy.deepcopy(learner_model), lr=0.0, ppo_epochs=1).step(
            buffer, current_policy_version=1
        )
    assert decoupled.approx_kl == pytest.approx(
        0.0, abs=1e-6
    )  # lr 0: no move from the proximal policy
    assert plain.approx_kl > 0.05  # the exact KL from the acting policy's stored parameters


def test_huge_importance_weights_stay_finite_at_the_cap() -> None:
    model = _model(0)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(6))
        evaluation = _sgd_updater(model, cap=1e6).evaluate_rollout(buffer)
        far = RolloutEvaluation(
            evaluation.log_probs + 200.0, evaluation.values
        )  # exp(200) overflows float32
        stats = _sgd_updater(model, cap=1e6, lr=0.0).step(
            buffer, current_policy_version=1, proximal=far
        )
    assert stats.importance_weight_mean == pytest.approx(1e6, rel=1e-4)
    assert np.isfinite(stats.policy_loss)
    with pytest.raises(ValueError, match="importance_weight_cap"):
        _sgd_updater(model, cap=float("inf"))


def test_proximal_log_probs_equal_to_the_behaviours_give_plain_ppo_bit_for_bit() -> None:
    behaviour = _model(0)
    plain_model, decoupled_model = copy.deepcopy(behaviour), copy.deepcopy(behaviour)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [_model(2)], np.random.default_rng(5))
        plain = PPOUpdater(
            plain_model,
            torch.optim.Adam(plain_model.parameters(), lr=1e-3),
            device="cpu",
            ppo_epochs=2,
            num_minibatches=4,
            clip_coef=0.2,
            ent_coef=0.01,
            vf_coef=0.5,
            max_grad_norm=0.5,
            seed=1,
        ).step(buffer, current_policy_version=0)
        decoupled = PPOUpdater(
            decoupled_model,
            torch.optim.Adam(decoupled_model.parameters(), lr=1e-3),
            device="cpu",
            ppo_epochs=2,
            num_minibatches=4,
            clip_coef=0.2,
            ent_coef=0.01,
            vf_coef=0.5,
            max_grad_norm=0.5,
            seed=1,
        ).step(
            buffer,
            current_policy_version=0,
            proximal=RolloutEvaluation(buffer.log_probs.copy(), buffer.values.copy()),
        )
    for p_plain, p_decoupled in zip(plain_model.parameters(), decoupled_model.parameters()):
        assert torch.equal(p_plain, p_decoupled)
    assert decoupled.importance_weight_mean == 1.0 and np.isnan(plain.importance_weight_mean)
    assert decoupled.policy_loss == plain.policy_loss


def test_replace_values_checks_its_input_and_makes_the_advantages_stale() -> None:
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [_model(0)], np.random.default_rng(0))
        assert buffer.advantages_are_current
        with pytest.raises(ValueError, match="values"):
            buffer.replace_values(np.zeros((T, N + 1), np.float32))
        with pytest.raises(ValueError, match="values"):
            buffer.replace_values(np.zeros((T, N), np.float64))
        with pytest.raises(ValueError, match="finite"):
            buffer.replace_values(np.full((T, N), np.nan, np.float32))
        assert buffer.advantages_are_current  # a rejected call changed nothing
        buffer.replace_values(np.full((T, N), 2.5, np.float32))
        assert not buffer.advantages_are_current
        assert (buffer.values == 2.5).all()


def test_an_unknown_correction_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="off_policy_correction"):
        PPOSettings(off_policy_correction="vtrace")


@pytest.mark.parametrize("correction", ["decoupled", "none"])
def test_the_learner_reevaluates_rows_of_older_versions_only(cartpole, correction: str) -> None:  # noqa: F811
    env, _schema, buffer, model = cartpole
    learner = make_learner(
        model,
        PPOSettings(num_minibatches=2, ppo_epochs=1, off_policy_correction=correction),
    )
    stepper = PolicyStepper(env, copy.deepcopy(model))
    rows = buffer.total_size

    # Rows of the learner's own version (synchronous mode): nothing is re-evaluated.
    rollout = fill(buffer, stepper, learner.policy_version)
    acted_values = buffer.values.copy()
    prepared = learner.prepare(rollout)
    assert np.array_equal(buffer.values, acted_values)
    stats = learner.update(prepared)
    assert np.isnan(stats.importance_weight_mean)

    # The same actor weights, now one version behind the learner's.
    rollout = fill(buffer, stepper, learner.policy_version - 1)
    acted_values = buffer.values.copy()
    prepared = learner.prepare(rollout)
    if correction == "none":
        assert np.array_equal(buffer.values, acted_values)
        assert np.isnan(learner.update(prepared).importance_weight_mean)
        return
    with torch.no_grad():  # the learner's critic before its update
        _, _, critic_values = model.evaluate_actions(
            torch.from_numpy(buffer.observations.reshape(rows, -1).copy()),
            torch.from_numpy(buffer.actions.reshape(-1).copy()),
        )
    np.testing.assert_allclose(
        buffer.values.reshape(-1), critic_values.numpy(), rtol=1e-5, atol=1e-6
    )
    assert np.abs(buffer.values - acted_values).max() > 1e-4
    # GAE was recomputed from the replaced values: returns = advantages + values.
    np.testing.assert_allclose(
        buffer.returns, buffer.advantages + buffer.values, rtol=1e-5, atol=1e-5
    )
    stats = learner.update(prepared)
    assert 0.0 < stats.importance_weight_mean <= 1.0
    assert learner.corrections_skipped == 0


def test_rollouts_of_rounded_actors_are_reevaluated_even_when_all_rows_are_current(
    cartpole,
) -> None:  # noqa: F811
    """An actor with bfloat16 forward passes joined (the rollout says ``reevaluate``): a rollout whose rows
    are all of the learner's version is re-evaluated in float32 too, and trains with the decoupled
    objective (its behaviour log-probs are the rounded policy's)."""
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    stepper = PolicyStepper(env, copy.deepcopy(model))
    rollout = fill(buffer, stepper, learner.policy_version)
    buffer.replace_values(
        buffer.values + 0.5
    )  # as if the rounded critic were off: the learner's replace them
    acted_values = buffer.values.copy()
    prepared = learner.prepare(rollout, reevaluate=True)
    np.testing.assert_allclose(buffer.values, acted_values - 0.5, rtol=1e-5, atol=1e-5)
    stats = learner.update(prepared)
    assert np.isfinite(stats.importance_weight_mean)  # NaN when the update is not decoupled


def test_a_diverged_critic_trains_without_the_correction_instead_of_stopping(cartpole) -> None:  # noqa: F811
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    rollout = fill(buffer, PolicyStepper(env, copy.deepcopy(model)), 0)
    learner.learner_model.version = 1  # the rows are one version behind the learner
    acted_values = buffer.values.copy()
    with torch.no_grad():
        model.critic.weight.fill_(3e38)  # finite weights whose values overflow to inf
    prepared = learner.prepare(rollout)
    assert learner.corrections_skipped == 1
    assert np.array_equal(buffer.values, acted_values)
    assert np.isnan(learner.update(prepared).importance_weight_mean)
