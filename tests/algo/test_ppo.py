"""Tests for oakemu_core.algo.ppo: loss terms against hand-computed numbers, the schedule, and the learner
on real RolloutBuffers (ratio check, learning on a bandit, early stop, counters)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from oakemu_core.algo.demonstrations import DemonstrationBatch
from oakemu_core.algo.flat_parameters import FlatAdam
from oakemu_core.algo.learner import (
    PPOLearner,
    PPOLearnerRuntimeState,
    PreparedRollout,
    RuntimeContext,
    ThreadSafeModel,
)
from oakemu_core.algo.losses import ppo_losses
from oakemu_core.algo.ppo import EmptyRolloutError, PPOUpdater, cpu_has_native_bfloat16
from oakemu_core.algo.schedules import LinearSchedule
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.algo.update_stats import explained_variance
from oakemu_core.policy.distributions import Categorical, DiagGaussian
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.rollout_buffer import FlatBatch, RolloutBuffer


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
    out = ppo_losses(*inputs, clip_coef=0.2, clip_value_range=0.2)
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

    unclipped = ppo_losses(*inputs, clip_coef=0.2, clip_value_range=None)
    assert unclipped["value_loss"].item() == pytest.approx(0.5 * (0.25 + 0.0025 + 1.0 + 0.09) / 4)
    # The value clip range is its own setting: +-0.1 gives clipped values 0.1, -0.05, 0.1, 0.0 and
    # squared errors max((0.25, 0.81), (0.0025, 0.0025), (1, 0.01), (0.09, 0.09)).
    narrow = ppo_losses(*inputs, clip_coef=0.2, clip_value_range=0.1)
    assert narrow["value_loss"].item() == pytest.approx(0.5 * (0.81 + 0.0025 + 1.0 + 0.09) / 4)
    assert narrow["policy_loss"].item() == pytest.approx(out["policy_loss"].item())


def test_ppo_policy_gradient_vanishes_on_clipped_rows() -> None:
    new_log_probs, *rest = _loss_inputs()
    out = ppo_losses(new_log_probs, *rest, clip_coef=0.2, clip_value_range=0.2)
    out["policy_loss"].backward()
    # d/d log r of -A r / 4 is -A r / 4 on unclipped rows; 0 where the clip is active.
    np.testing.assert_allclose(
        new_log_probs.grad.numpy(), [0.0, -0.85 / 4, 2 * 1.05 / 4, 0.0], atol=1e-12
    )


def test_explained_variance() -> None:
    targets = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(targets, targets) == 1.0
    assert explained_variance(torch.full((4,), 2.5), targets) == pytest.approx(0.0)
    # residual (0.5, -0.5, 0.5, -0.5): var 0.25; var(targets) 1.25.
    residual = torch.tensor([0.5, -0.5, 0.5, -0.5])
    assert explained_variance(targets + residual, targets) == pytest.approx(0.8)
    assert math.isnan(explained_variance(torch.zeros(3), torch.ones(3)))
    assert math.isnan(explained_variance(torch.zeros(0), torch.zeros(0)))


def test_explained_variance_matches_numpy_on_float32_tensors() -> None:
    rng = np.random.default_rng(11)
    values = rng.normal(size=1000).astype(np.float32)
    returns = (values + rng.normal(scale=0.3, size=1000)).astype(np.float32) * 40.0
    v64, r64 = values.astype(np.float64), returns.astype(np.float64)
    expected = 1.0 - np.var(r64 - v64) / np.var(r64)
    got = explained_variance(torch.from_numpy(values), torch.from_numpy(returns))
    assert got == pytest.approx(expected, rel=1e-12)


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
    state = PPOLearnerRuntimeState(
        iterations=3, rollouts_collected=4, policy_version=5, shuffle_rng_state={"a": 1}
    )
    assert PPOLearnerRuntimeState.from_dict(state.to_dict()) == state
    with pytest.raises(ValueError, match="policy_version"):
        PPOLearnerRuntimeState.from_dict({"iterations": 1, "rollouts_collected": 1})


# ---------------------------------------------------------------------------------------------
# Learner on real rollout buffers
# ---------------------------------------------------------------------------------------------
OBS_DIM, NUM_ACTIONS, T, N = 4, 2, 16, 4


def _model(seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    return build_model((OBS_DIM,), np.float32, NUM_ACTIONS)


def _learner(model: ActorCritic, **overrides) -> PPOUpdater:
    kwargs = dict(
        device="cpu",
        ppo_epochs=4,
        num_minibatches=4,
        clip_coef=0.2,
        clip_value_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        seed=0,
    )
    kwargs.update(overrides)
    lr = kwargs.pop("lr", 2.5e-3)
    fused = kwargs.pop("fused", None)
    return PPOUpdater(
        model, torch.optim.Adam(model.parameters(), lr=lr, eps=1e-5, fused=fused), **kwargs
    )


def _fill(
    buffer: RolloutBuffer,
    acting_models,
    rng: np.random.Generator,
    *,
    reward_fn=None,
    versions=(0,),
    done_probability: float = 0.1,
) -> None:
    """Random CartPole-like rows; row t is acted by ``acting_models[t % len]`` with version
    ``versions[t % len]``. Then GAE."""
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    for t in range(buffer.rollout_length):
        model = acting_models[t % len(acting_models)]
        obs = rng.normal(size=(buffer.num_envs, OBS_DIM)).astype(np.float32)
        bundle = model.act(obs, generator=generator)
        rewards = (
            reward_fn(bundle.actions) if reward_fn is not None else rng.normal(size=buffer.num_envs)
        ).astype(np.float32)
        dones = rng.random(buffer.num_envs) < done_probability
        buffer.add(
            obs,
            bundle.actions,
            bundle.log_probs,
            bundle.values,
            rewards,
            dones,
            policy_version=versions[t % len(versions)],
        )
    last_obs = rng.normal(size=(buffer.num_envs, OBS_DIM)).astype(np.float32)
    last_values = acting_models[0].predict_values(last_obs)
    buffer.compute_gae(last_values, buffer.dones[-1].copy(), 0.99, 0.95)


def test_first_minibatch_ratio_is_one_when_buffer_log_probs_come_from_the_model() -> None:
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(0), versions=(3,))
        stats = _learner(copy.deepcopy(model)).step(buffer, current_policy_version=3)
        assert stats.first_minibatch_ratio_max_abs_dev < 1e-5
        # The check can fail: log-probs from another model give ratios far from 1.
        other = _learner(_model(seed=1)).step(buffer, current_policy_version=3)
        assert other.first_minibatch_ratio_max_abs_dev > 1e-3


def test_ratio_check_only_counts_rows_of_the_current_policy_version() -> None:
    model, stale = _model(0), _model(1)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        # Even rows: the learner's weights (version 7); odd rows: other weights (version 6).
        _fill(buffer, [model, stale], np.random.default_rng(1), versions=(7, 6))

        def deviation(version: int) -> float:
            learner = _learner(copy.deepcopy(model))
            return learner.step(
                buffer, current_policy_version=version
            ).first_minibatch_ratio_max_abs_dev

        assert deviation(7) < 1e-5
        assert deviation(6) > 1e-3
        assert math.isnan(deviation(9))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_updates_on_a_bandit_raise_the_probability_of_the_rewarded_action(precision: str) -> None:
    model = _model()
    learner = _learner(model, lr=2.5e-3, learner_precision=precision)
    probe = np.random.default_rng(9).normal(size=(256, OBS_DIM)).astype(np.float32)

    def p_rewarded() -> float:
        with torch.no_grad():
            return torch.softmax(model(torch.from_numpy(probe))[0], -1)[:, 1].mean().item()

    before = p_rewarded()
    rng = np.random.default_rng(2)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        for update in range(6):
            buffer.reset()
            # One-step episodes: reward 1 for action 1, 0 for action 0.
            _fill(
                buffer,
                [model],
                rng,
                reward_fn=lambda a: (a == 1).astype(np.float32),
                versions=(update,),
                done_probability=1.0,
            )
            stats = learner.step(buffer, current_policy_version=update)
            assert stats.first_minibatch_ratio_max_abs_dev < (
                1e-5 if precision == "float32" else 1e-2
            )
    after = p_rewarded()
    assert 0.4 < before < 0.6
    assert after > before + 0.2, (before, after)


def _layer_output_dtypes(model: ActorCritic) -> dict[str, list[torch.dtype]]:
    """Collects the output dtype of every forward pass of the torso's convolution and linear layers
    (``"torso"``) and of the policy and value heads (``"heads"``)."""
    seen: dict[str, list[torch.dtype]] = {"torso": [], "heads": []}
    heads = {model.actor, model.critic}
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
            part = seen["heads" if module in heads else "torso"]
            module.register_forward_hook(
                lambda _m, _i, output, part=part: part.append(output.dtype)
            )
    return seen


class _Demonstrations:
    """A stand-in behaviour-cloning sampler: random frames and actions."""

    def sample(self, batch_size: int, rng: np.random.Generator) -> DemonstrationBatch:
        return DemonstrationBatch(
            rng.integers(0, 256, (batch_size, 2, 8, 8), dtype=np.uint8),
            rng.integers(0, 3, batch_size),
            None,
        )


@pytest.mark.parametrize(
    "precision, torso_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_the_update_runs_the_torso_in_its_precision_and_keeps_heads_and_state_float32(
    precision: str, torso_dtype: torch.dtype
) -> None:
    """A small CNN on 8x8 frames: every forward pass of an update (the proximal re-evaluation, the
    minibatches, behaviour cloning) runs the torso's conv and linear layers in the chosen precision
    and the heads in float32; weights, gradients and Adam's moments stay float32, the actor's API
    float32."""
    torch.manual_seed(0)
    model = build_model((2, 8, 8), np.uint8, 3)
    assert any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    with RolloutBuffer(8, 4, (2, 8, 8), np.uint8, seed=0) as buffer:
        for _ in range(buffer.rollout_length):
            frames = rng.integers(0, 256, (4, 2, 8, 8), dtype=np.uint8)
            bundle = model.act(frames, generator=generator)
            buffer.add(
                frames,
                bundle.actions,
                bundle.log_probs,
                bundle.values,
                rng.normal(size=4).astype(np.float32),
                np.zeros(4, bool),
            )
        buffer.compute_gae(np.zeros(4, np.float32), np.zeros(4, bool), 0.99, 0.95)
        learner = _learner(model, learner_precision=precision)
        seen = _layer_output_dtypes(model)
        proximal = learner.evaluate_rollout(buffer)
        assert set(seen["torso"]) == {torso_dtype}
        assert proximal.values.dtype == np.float32
        stats = learner.step(buffer, current_policy_version=0, bc_term=(0.5, _Demonstrations(), 4))
    assert set(seen["torso"]) == {torso_dtype}  # the minibatches and behaviour cloning too
    assert seen["heads"] and set(seen["heads"]) == {torch.float32}
    assert math.isfinite(stats.policy_loss) and math.isfinite(stats.value_loss)
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    moments = [state["exp_avg"] for state in learner.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    bundle = model.act(rng.integers(0, 256, (4, 2, 8, 8), dtype=np.uint8), generator=generator)
    assert bundle.log_probs.dtype == np.float32 and bundle.values.dtype == np.float32


@pytest.mark.parametrize("fused", [True, False])
def test_an_update_with_flat_adam_moves_the_weights_as_with_torch_adam(fused: bool) -> None:
    """Two updates (4 epochs x 4 minibatches each, gradient clipping) from the same weights on the
    same rollouts: FlatAdam's weights and Adam state end as torch.optim.Adam's within float32
    rounding, and both moved."""

    def trained(flat: bool) -> tuple[ActorCritic, dict]:
        model = _model(0)
        adam = FlatAdam if flat else torch.optim.Adam
        optimizer = adam(model.parameters(), lr=2.5e-3, eps=1e-5, fused=fused)
        learner = PPOUpdater(
            model,
            optimizer,
            device="cpu",
            ppo_epochs=4,
            num_minibatches=4,
            clip_coef=0.2,
            clip_value_range=0.2,
            vf_coef=0.5,
            max_grad_norm=0.5,
            seed=0,
        )
        for update in range(2):
            with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
                _fill(buffer, [model], np.random.default_rng(update))
                learner.step(buffer, current_policy_version=update)
        return model, optimizer.state_dict()

    (flat_model, flat_state), (model, state) = trained(True), trained(False)
    assert not torch.equal(model.critic.weight, _model(0).critic.weight)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            dict(flat_model.named_parameters())[name], parameter, rtol=1e-4, atol=1e-6, msg=name
        )
    for index, entry in state["state"].items():
        torch.testing.assert_close(
            flat_state["state"][index]["exp_avg_sq"], entry["exp_avg_sq"], rtol=1e-3, atol=1e-9
        )
        assert float(flat_state["state"][index]["step"]) == float(entry["step"]) == 32


def test_the_learner_steps_a_flat_adam_unless_behaviour_cloning_trains_the_policy_alone(
    tmp_path,
) -> None:
    from oakemu_core.algo.trainer import build_optimizer
    from oakemu_core.config import OakEmuConfig

    model = _model(0)
    plain = OakEmuConfig(env_id="CartPole-v1")
    assert isinstance(build_optimizer(plain, model, "cpu"), FlatAdam)
    bc_term = OakEmuConfig(
        env_id="CartPole-v1", bc_dataset=str(tmp_path), bc_coef=0.1
    )  # next to PPO's loss
    assert isinstance(build_optimizer(bc_term, _model(0), "cpu"), FlatAdam)
    pretrain = OakEmuConfig(env_id="CartPole-v1", bc_dataset=str(tmp_path), bc_pretrain_updates=5)
    optimizer = build_optimizer(pretrain, _model(0), "cpu")
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["eps"] == 1e-5


def test_a_bfloat16_update_moves_the_weights_as_the_float32_update_does() -> None:
    """Mixed precision changes the arithmetic, not the update: from the same weights on the same
    rollout, the two updates' weight changes point the same way (cosine > 0.99; an update from
    another rollout is the yardstick of how different unrelated updates are)."""

    def weight_change(precision: str, fill_seed: int) -> torch.Tensor:
        model = _model(0)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
            _fill(buffer, [model], np.random.default_rng(fill_seed))
            _learner(model, learner_precision=precision).step(buffer, current_policy_version=0)
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - start

    float32, bfloat16, other = (
        weight_change("float32", 1),
        weight_change("bfloat16", 1),
        weight_change("float32", 2),
    )
    assert not torch.equal(float32, bfloat16)  # the bfloat16 arithmetic did run
    assert torch.nn.functional.cosine_similarity(float32, bfloat16, dim=0) > 0.99
    assert torch.nn.functional.cosine_similarity(float32, other, dim=0) < 0.9


def _trainable_rows(buffer: RolloutBuffer, trainable: np.ndarray) -> tuple[torch.Tensor, ...]:
    """``(observations, actions, stored log-probs, advantages normalised over these rows (population
    std + 1e-8), returns)`` of the ``trainable`` rows, in row-major order, for hand-written updates."""
    advantages = buffer.advantages[trainable].astype(np.float64)
    advantages = ((advantages - advantages.mean()) / (advantages.std() + 1e-8)).astype(np.float32)
    return (
        torch.from_numpy(buffer.observations[trainable]),
        torch.from_numpy(buffer.actions[trainable]),
        torch.from_numpy(buffer.log_probs[trainable]),
        torch.from_numpy(advantages),
        torch.from_numpy(buffer.returns[trainable]),
    )


@pytest.mark.parametrize(("ent_coef", "max_grad_norm"), [(0.01, 1e9), (0.0, 1e9), (0.01, 0.05)])
def test_one_update_matches_a_hand_written_sgd_step(ent_coef: float, max_grad_norm: float) -> None:
    """ppo_epochs=1, one minibatch, plain SGD: the new weights equal w - lr * c * grad of the PPO
    loss written out here independently (normalised advantages over all trainable rows; at the
    first step the ratio is 1), with c = min(1, max_grad_norm / (||grad|| + 1e-6)) over all
    parameters' gradients (1 for 1e9; below 1 for 0.05). With ent_coef 0 the entropy is computed
    outside the autograd graph and still reported."""
    model = _model()
    reference = copy.deepcopy(model)
    lr, vf_coef = 0.1, 0.5
    learner = PPOUpdater(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        device="cpu",
        ppo_epochs=1,
        num_minibatches=1,
        clip_coef=0.2,
        clip_value_range=None,
        ent_coef=ent_coef,
        vf_coef=vf_coef,
        max_grad_norm=max_grad_norm,
    )
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [reference], np.random.default_rng(3))
        trainable = buffer.trainable.copy()
        trainable[::2, 0] = False  # some rows out of training
        buffer.mark_untrainable(~trainable)
        obs, actions, old_log_probs, advantages, returns = _trainable_rows(buffer, trainable)
        stats = learner.step(buffer, current_policy_version=0)
        values_np, returns_np = (
            buffer.values[trainable].astype(np.float64),
            buffer.returns[trainable].astype(np.float64),
        )

    logits, values = reference(obs)
    log_p = torch.log_softmax(logits, -1)
    new_log_probs = log_p.gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(new_log_probs - old_log_probs)
    policy_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
    value_loss = 0.5 * ((values - returns) ** 2).mean()
    entropy = -(log_p.exp() * log_p).sum(-1).mean()
    (policy_loss - ent_coef * entropy + vf_coef * value_loss).backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in reference.parameters()))
    scale = min(1.0, max_grad_norm / (norm + 1e-6))
    assert (scale < 0.5) == (max_grad_norm < 1)  # the small bound does clip
    with torch.no_grad():
        for (name, p_ref), p_new in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(
                p_new, p_ref - lr * scale * p_ref.grad, rtol=1e-5, atol=1e-6, msg=name
            )
    assert stats.policy_loss == pytest.approx(policy_loss.item(), abs=1e-6)
    assert stats.value_loss == pytest.approx(value_loss.item(), rel=1e-5)
    assert stats.entropy == pytest.approx(entropy.item(), rel=1e-5)
    assert stats.trainable_rows == int(trainable.sum()) and stats.minibatches == 1
    expected_ev = 1 - np.var(returns_np - values_np) / np.var(returns_np)
    assert stats.explained_variance == pytest.approx(expected_ev, rel=1e-6)


def test_target_kl_stops_after_the_first_epoch() -> None:
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(4))
        stats = _learner(copy.deepcopy(model), target_kl=1e-9, lr=1e-2).step(
            buffer, current_policy_version=0
        )
        assert (stats.epochs_completed, stats.minibatches, stats.early_stopped) == (1, 4, True)
        assert len(stats.epoch_seconds) == 1
        full = _learner(copy.deepcopy(model), target_kl=None).step(buffer, current_policy_version=0)
        assert (full.epochs_completed, full.minibatches, full.early_stopped) == (4, 16, False)
        assert len(full.epoch_seconds) == 4 and all(s > 0 for s in full.epoch_seconds)


@pytest.fixture
def served_minibatches(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Records, for every FlatBatch.minibatches call, the shuffled row order it uses and the sizes."""
    calls: list[dict] = []
    original = FlatBatch.minibatches

    def spy(self: FlatBatch, num_minibatches: int, generator: np.random.Generator):
        order = self.rows[copy.deepcopy(generator).permutation(self.size)]
        minibatches = original(self, num_minibatches, generator)
        calls.append({"order": order, "sizes": [len(m.actions) for m in minibatches]})
        return minibatches

    monkeypatch.setattr(FlatBatch, "minibatches", spy)
    return calls


def test_update_statistics_read_the_device_batch_not_the_buffer_again(monkeypatch) -> None:
    """The explained variance comes from the values and returns of the flat batch the update trained
    on (on the device), equal to an independent numpy computation over the trainable rows; the
    buffer's CPU arrays are not read a second time for it."""
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(4))
        trainable = buffer.trainable.copy()
        values = buffer.values[trainable].astype(np.float64)
        returns = buffer.returns[trainable].astype(np.float64)

        def no_second_read(self):
            raise AssertionError("the update re-read the buffer's values and returns")

        monkeypatch.setattr(RolloutBuffer, "trainable_diagnostics", no_second_read)
        stats = _learner(model).step(buffer, current_policy_version=0)
    expected = 1.0 - np.var(returns - values) / np.var(returns)
    assert stats.explained_variance == pytest.approx(expected, rel=1e-9)


def _scheduled_learner(model: ActorCritic, schedule: LinearSchedule) -> PPOLearner:
    """The settings of :func:`_learner` in a :class:`PPOLearner` with ``schedule``."""
    config = PPOSettings(
        ppo_epochs=4,
        num_minibatches=4,
        clip_coef=0.2,
        clip_value_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        seed=0,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    return PPOLearner(RuntimeContext(config), ThreadSafeModel(model), None, optimizer, schedule)


def test_learning_rate_schedule_counters_and_state_restore(served_minibatches: list[dict]) -> None:
    model = _model()
    schedule = LinearSchedule(1e-3, 0.0, 10)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        learner = _scheduled_learner(model, schedule)
        _fill(buffer, [model], np.random.default_rng(5))
        rates = [learner.update(PreparedRollout(buffer)).learning_rate for v in (0, 1)]
        assert rates == pytest.approx([1e-3, 0.9e-3])
        assert (learner.iterations, learner.rollouts_collected, learner.policy_version) == (2, 2, 2)

        saved = learner.state()
        resumed = _scheduled_learner(_model(), LinearSchedule(1e-3, 0.0, 10))
        resumed.lr_schedule.load_state_dict(schedule.state_dict())
        resumed.restore_state(PPOLearnerRuntimeState.from_dict(saved.to_dict()))
        assert (resumed.iterations, resumed.rollouts_collected, resumed.policy_version) == (2, 2, 2)
        # The shuffle generator continues where it stopped: same next minibatch rows.
        served_minibatches.clear()
        learner.update(PreparedRollout(buffer))
        rows_original = [call["order"] for call in served_minibatches]
        served_minibatches.clear()
        third = resumed.update(PreparedRollout(buffer))
        rows_resumed = [call["order"] for call in served_minibatches]
        assert len(rows_original) == len(rows_resumed) == 4  # one shuffle per epoch
        for a, b in zip(rows_original, rows_resumed, strict=True):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(rows_original[0], rows_original[1]), "each epoch reshuffles"
        assert third.learning_rate == pytest.approx(0.8e-3)
        with pytest.raises(ValueError, match="counters"):
            resumed.restore_state(PPOLearnerRuntimeState(iterations=-1))


def test_empty_rollout_and_bad_hyperparameters_are_rejected(served_minibatches: list[dict]) -> None:
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(6))
        # Two trainable rows and four minibatches: each epoch trains on two one-row minibatches.
        keep = np.zeros((T, N), dtype=bool)
        keep[0, :2] = True
        buffer.mark_untrainable(~keep)
        stats = _learner(copy.deepcopy(model)).step(buffer, current_policy_version=0)
        assert (stats.minibatches, stats.trainable_rows) == (4 * 2, 2)
        assert [call["sizes"] for call in served_minibatches] == [[1, 1]] * 4
        buffer.mark_untrainable(np.ones((T, N), dtype=bool))
        with pytest.raises(EmptyRolloutError, match="trainable rows"):
            _learner(model).step(buffer, current_policy_version=0)
    with pytest.raises(ValueError, match="clip_coef"):
        _learner(model, clip_coef=0.0)
    with pytest.raises(ValueError, match="num_minibatches"):
        _learner(model, num_minibatches=0)
    with pytest.raises(ValueError, match="clip_value_range"):
        _learner(model, clip_value_range=-0.1)
    with pytest.raises(ValueError, match="precision"):
        _learner(model, learner_precision="float16")


@pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)
@pytest.mark.parametrize(("fused", "on_device"), [(False, False), (True, False), (True, True)])
def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights_finite(
    fused: bool, on_device: bool
) -> None:
    """Skipped on the host (the CPU's path), or by the fused kernel told through ``found_inf`` (an
    accelerator's path, forced here on the CPU, whose fused kernel takes the same hook)."""
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(0))
        learner = _learner(model, fused=fused)
        assert not learner._skips_on_device
        learner._skips_on_device = on_device
        learner.step(buffer, current_policy_version=0)  # finite: every step taken
        after_finite = copy.deepcopy(model.state_dict())
        adam = copy.deepcopy(learner.optimizer.state_dict()["state"])
        assert all(int(state["step"]) == 4 * 4 for state in adam.values())
        # Finite rewards whose returns overflow float32: the value loss becomes inf / NaN.
        buffer.reset()
        _fill(
            buffer,
            [model],
            np.random.default_rng(0),
            reward_fn=lambda actions: np.full(actions.shape, 3e38),
        )
        stats = learner.step(buffer, current_policy_version=0)
    assert stats.nonfinite_minibatches == stats.minibatches == 4 * 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for name, tensor in model.state_dict().items():  # every step was skipped: weights unchanged
        assert torch.equal(tensor, after_finite[name]) and not torch.equal(tensor, before[name]), (
            name
        )
    for key, state in learner.optimizer.state_dict()[
        "state"
    ].items():  # and Adam's moments and step count
        assert all(
            torch.equal(state[name], adam[key][name]) for name in ("step", "exp_avg", "exp_avg_sq")
        ), key
    # The skip applies to those minibatches only: a later plain step (behaviour cloning) still steps.
    assert not hasattr(learner.optimizer, "found_inf")
    learner.model(torch.zeros(1, OBS_DIM))[1].sum().backward()
    learner.optimizer.step()
    assert any(
        not torch.equal(tensor, after_finite[name]) for name, tensor in model.state_dict().items()
    )


def test_observations_are_uploaded_once_per_update_not_per_epoch() -> None:
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(7))
        assert buffer.observation_uploads == 0
        stats = _learner(copy.deepcopy(model), ppo_epochs=4, num_minibatches=4).step(
            buffer, current_policy_version=0
        )
        assert stats.epochs_completed == 4 and stats.minibatches == 16
        assert buffer.observation_uploads == 1
        # A second update of the unchanged buffer reuses the upload; a changed buffer uploads again.
        _learner(copy.deepcopy(model)).step(buffer, current_policy_version=0)
        assert buffer.observation_uploads == 1
        buffer.reset()
        _fill(buffer, [model], np.random.default_rng(8))
        _learner(copy.deepcopy(model)).step(buffer, current_policy_version=0)
        assert buffer.observation_uploads == 2


# ---------------------------------------------------------------------------------------------
# Other action distributions through the same update
# ---------------------------------------------------------------------------------------------
def _fill_schema_buffer(
    buffer: RolloutBuffer, model: ActorCritic, rng: np.random.Generator, *, masked: bool
) -> None:
    """Rows acted by ``model``, with the distribution's stored fields and (if masked) random masks."""
    generator = torch.Generator().manual_seed(0)
    width = model.distribution.mask_width
    for _ in range(buffer.rollout_length):
        obs = rng.normal(size=(buffer.num_envs, OBS_DIM)).astype(np.float32)
        extra: dict[str, np.ndarray] = {}
        if masked:
            mask = rng.random((buffer.num_envs, width)) < 0.5
            mask[np.arange(buffer.num_envs), rng.integers(0, width, buffer.num_envs)] = True
            extra["action_mask"] = mask
        bundle = model.act(obs, action_mask=extra.get("action_mask"), generator=generator)
        buffer.add(
            obs,
            bundle.actions,
            bundle.log_probs,
            bundle.values,
            rng.normal(size=buffer.num_envs).astype(np.float32),
            rng.random(buffer.num_envs) < 0.1,
            **bundle.distribution_fields,
            **extra,
        )
    buffer.compute_gae(np.zeros(buffer.num_envs, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)


def test_masked_policy_ratio_is_one_only_when_the_loss_uses_the_stored_masks() -> None:
    distribution = Categorical(5, masked=True)
    torch.manual_seed(0)
    model = build_model({"": ((OBS_DIM,), np.float32)}, distribution)
    with torch.no_grad():
        model.actor.bias.copy_(torch.tensor([3.0, -1.0, 0.0, 1.0, 2.0]))
    schema = build_schema({"": ((OBS_DIM,), np.float32)}, distribution)
    with RolloutBuffer(T, N, schema=schema, seed=0) as buffer:
        _fill_schema_buffer(buffer, model, np.random.default_rng(0), masked=True)
        assert not buffer.field("action_mask").all()
        stats = _learner(copy.deepcopy(model), ppo_epochs=1).step(buffer, current_policy_version=0)
        assert stats.first_minibatch_ratio_max_abs_dev < 1e-5
        assert math.isfinite(stats.entropy) and math.isfinite(stats.policy_loss)
        # Reference: the same rows evaluated without their masks give ratios far from 1.
        obs = torch.from_numpy(buffer.observations.reshape(-1, OBS_DIM).copy())
        actions = torch.from_numpy(buffer.actions.reshape(-1).copy())
        masks = torch.from_numpy(buffer.field("action_mask").reshape(-1, 5).copy())
        masked, _, _ = model.evaluate_actions(obs, actions, masks)
        np.testing.assert_allclose(masked.detach().numpy(), buffer.log_probs.reshape(-1), atol=1e-5)
        unmasked, _, _ = model.evaluate_actions(obs, actions)
        assert np.abs(unmasked.detach().numpy() - buffer.log_probs.reshape(-1)).max() > 1e-2


def test_gaussian_approx_kl_is_the_exact_kl_from_the_stored_parameters() -> None:
    distribution = DiagGaussian([-1.0, -1.0], [1.0, 1.0])
    schema = build_schema({"": ((OBS_DIM,), np.float32)}, distribution)
    torch.manual_seed(0)
    acting = build_model({"": ((OBS_DIM,), np.float32)}, distribution)
    torch.manual_seed(1)
    other = build_model({"": ((OBS_DIM,), np.float32)}, distribution)
    with torch.no_grad():
        other.actor.log_std.copy_(torch.tensor([-0.5, 0.3]))
        other.actor.mean.bias.copy_(torch.tensor([0.2, -0.4]))
    with RolloutBuffer(T, N, schema=schema, seed=0) as buffer:
        _fill_schema_buffer(buffer, acting, np.random.default_rng(1), masked=False)
        # lr 0: the policy does not move, so every minibatch's KL is that of the initial weights.
        same = _learner(copy.deepcopy(acting), lr=0.0, ppo_epochs=1).step(
            buffer, current_policy_version=0
        )
        assert same.approx_kl == pytest.approx(0.0, abs=1e-6)
        stats = _learner(copy.deepcopy(other), lr=0.0, ppo_epochs=2).step(
            buffer, current_policy_version=0
        )
        with torch.no_grad():
            mean, _ = other(torch.from_numpy(buffer.observations.reshape(-1, OBS_DIM).copy()))
        new = torch.distributions.Normal(
            mean[:, :2].double(), other.actor.log_std.exp().double().expand(T * N, 2)
        )
        old = torch.distributions.Normal(
            torch.from_numpy(buffer.field("action_mean").reshape(-1, 2).copy()).double(),
            torch.from_numpy(buffer.field("action_std").reshape(-1, 2).copy()).double(),
        )
        expected = torch.distributions.kl_divergence(old, new).sum(-1).mean().item()
        assert expected > 0.05
        # 64 rows in 4 equal minibatches: the mean of minibatch means is the mean over all rows.
        assert stats.approx_kl == pytest.approx(expected, rel=1e-4)
        # The ratio-based estimate would differ: the exact KL is what is reported.
        new_log_probs = new.log_prob(
            torch.from_numpy(buffer.actions.reshape(-1, 2).copy()).double()
        ).sum(-1)
        log_ratio = new_log_probs - torch.from_numpy(buffer.log_probs.reshape(-1).copy()).double()
        k3 = ((log_ratio.exp() - 1) - log_ratio).mean().item()
        assert abs(k3 - expected) > 1e-3


def _advantages_seen_by_the_loss(
    monkeypatch: pytest.MonkeyPatch, *, ppo_epochs: int, num_minibatches: int, seed: int
) -> tuple[list[torch.Tensor], np.ndarray]:
    """One update of a fresh learner: the advantages tensor each ``ppo_losses`` call received, in call
    order, and the buffer's raw advantages (flat, float64)."""
    import oakemu_core.algo.compiled_update as loss_module

    seen: list[torch.Tensor] = []
    original = loss_module.ppo_losses

    def recording(new_log_probs, old_log_probs, advantages, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(advantages)
        return original(new_log_probs, old_log_probs, advantages, *args, **kwargs)

    monkeypatch.setattr(loss_module, "ppo_losses", recording)
    model = _model()
    learner = PPOUpdater(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5),
        device="cpu",
        ppo_epochs=ppo_epochs,
        num_minibatches=num_minibatches,
        clip_coef=0.2,
        clip_value_range=None,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
    )
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(seed))
        raw = buffer.advantages.reshape(-1).astype(np.float64)
        learner.step(buffer, current_policy_version=0)
    return seen, raw


def test_advantages_are_normalised_per_minibatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each minibatch's advantages enter the loss with mean 0 and population std 1 (SB3 / CleanRL),
    not normalised once over the whole rollout (whose minibatch means would not be 0)."""
    seen, raw = _advantages_seen_by_the_loss(monkeypatch, ppo_epochs=2, num_minibatches=4, seed=5)
    raw = np.sort(raw)
    assert len(seen) == 2 * 4 and all(len(a) == T * N // 4 for a in seen)
    for advantages in seen:
        a = advantages.detach().double()
        assert abs(a.mean().item()) < 1e-5 and a.std(correction=0).item() == pytest.approx(
            1.0, abs=1e-4
        )
    # Each epoch's minibatches together are an affine image of the raw advantages per minibatch,
    # so their union is not the rollout-wide normalisation.
    whole = (raw - raw.mean()) / raw.std()
    first_epoch = np.sort(torch.cat(seen[:4]).detach().double().numpy())
    assert not np.allclose(first_epoch, whole, atol=1e-3)


def test_one_minibatch_sees_the_same_normalised_advantages_every_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one minibatch (every row, every epoch) the advantages are normalised once for the
    update: each epoch's loss gets the same tensor, mean 0 and population std 1 over the rows."""
    seen, raw = _advantages_seen_by_the_loss(monkeypatch, ppo_epochs=3, num_minibatches=1, seed=6)
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
    np.testing.assert_allclose(seen[0].double().numpy(), (raw - raw.mean()) / raw.std(), atol=1e-5)


def test_after_epoch_sees_the_weights_each_epoch_left() -> None:
    """``after_epoch(k)`` runs after epochs 1 .. E-1 (not after the last, nor after an early stop)
    with the weights k epochs left: equal to those of an update of k epochs from the same start
    (one minibatch, so no shuffling)."""
    rng = np.random.default_rng(0)
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        start = _model()
        _fill(buffer, [start], rng)
        model = copy.deepcopy(start)
        seen: dict[int, dict[str, torch.Tensor]] = {}
        _learner(model, ppo_epochs=3, num_minibatches=1).step(
            buffer,
            current_policy_version=0,
            after_epoch=lambda k, kl, nonfinite, sgd_steps: seen.__setitem__(
                k, copy.deepcopy(model.state_dict())
            ),
        )
        assert sorted(seen) == [1, 2]
        for k in (1, 2):
            reference = copy.deepcopy(start)
            _learner(reference, ppo_epochs=k, num_minibatches=1).step(
                buffer, current_policy_version=0
            )
            for name, tensor in reference.state_dict().items():
                torch.testing.assert_close(seen[k][name], tensor, rtol=0, atol=0)
            assert any(
                not torch.equal(seen[k][name], tensor)
                for name, tensor in start.state_dict().items()
            )

        calls: list[
            tuple
        ] = []  # epoch 1 starts at the acting policy (KL 0); epoch 2 passes target_kl
        stats = _learner(
            copy.deepcopy(start), ppo_epochs=3, num_minibatches=1, target_kl=1e-6
        ).step(buffer, current_policy_version=0, after_epoch=lambda *args: calls.append(args))
        assert stats.early_stopped and stats.epochs_completed == 2
        assert [(k, nonfinite, sgd_steps) for k, _kl, nonfinite, sgd_steps in calls] == [(1, 0, 1)]
        assert abs(calls[0][1]) < 1e-6  # the first epoch's KL: measured before its only step


def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path) -> None:
    def flags(line: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {line}\n\n")
        return str(path)

    assert cpu_has_native_bfloat16(flags("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni")) is True
    assert cpu_has_native_bfloat16(flags("fpu sse2 amx_tile amx_bf16 amx_int8")) is True
    assert cpu_has_native_bfloat16(flags("fpu sse2 avx2 avx512f avx512_vnni")) is False
    assert cpu_has_native_bfloat16(str(tmp_path / "missing")) is None
