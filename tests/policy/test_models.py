"""Tests for oakemu_core.policy.models: per-key encoders, uint8 scaling, act/evaluate agreement (masked,
multi-discrete, Gaussian), observation normalisation, weights round trip."""

from __future__ import annotations

import copy
import math

import gymnasium
import numpy as np
import pytest
import torch

from oakemu_core.envs import EnvSpec
from oakemu_core.policy.distributions import (
    Categorical,
    DiagGaussian,
    MultiCategorical,
    distribution_for_env,
)
from oakemu_core.policy.models import (
    ActorCritic,
    RunningNormalizer,
    build_model,
    load_optimizer_state,
    load_weight_arrays,
    weights_to_arrays,
)

FRAME_SHAPE = (4, 84, 84)


@pytest.fixture(scope="module")
def cnn() -> ActorCritic:
    torch.manual_seed(0)
    return build_model(FRAME_SHAPE, np.uint8, 4)


@pytest.fixture()
def mlp() -> ActorCritic:
    torch.manual_seed(0)
    return build_model((4,), np.float32, 2)


def convs_of(module: torch.nn.Module) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    return [
        (m.out_channels, m.kernel_size, m.stride)
        for m in module.modules()
        if isinstance(m, torch.nn.Conv2d)
    ]


NATURE_CONVS = [(32, (8, 8), (4, 4)), (64, (4, 4), (2, 2)), (64, (3, 3), (1, 1))]


def test_nature_cnn_layers_and_output_shapes(cnn: ActorCritic) -> None:
    assert convs_of(cnn) == NATURE_CONVS
    linears = [m for m in cnn.modules() if isinstance(m, torch.nn.Linear)]
    assert (linears[0].in_features, linears[0].out_features) == (64 * 7 * 7, 512)
    obs = torch.zeros((3, *FRAME_SHAPE), dtype=torch.uint8)
    logits, values = cnn(obs)
    assert logits.shape == (3, 4) and values.shape == (3,)
    assert logits.dtype == torch.float32


def test_mlp_is_cleanrl_64_64_tanh_with_orthogonal_init(mlp: ActorCritic) -> None:
    actor_linears = [m for m in (*mlp.actor_torso, mlp.actor) if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in actor_linears] == [(4, 64), (64, 64), (64, 2)]
    assert sum(isinstance(m, torch.nn.Tanh) for m in mlp.actor_torso) == 2
    critic_linears = [m for m in (*mlp.critic_torso, mlp.critic) if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in critic_linears] == [(4, 64), (64, 64), (64, 1)]
    # Orthogonal with gain g: W W^T = g^2 I for a wide (rows <= cols) matrix.
    w = actor_linears[-1].weight.detach()
    np.testing.assert_allclose((w @ w.T).numpy(), 0.01**2 * np.eye(2), atol=1e-7)
    w = actor_linears[1].weight.detach()
    np.testing.assert_allclose((w @ w.T).numpy(), 2.0 * np.eye(64), atol=1e-4)
    w = critic_linears[-1].weight.detach()
    np.testing.assert_allclose((w @ w.T).numpy(), np.eye(1), atol=1e-6)
    assert torch.count_nonzero(actor_linears[0].bias) == 0


def test_uint8_frames_are_scaled_by_255_inside_forward(cnn: ActorCritic) -> None:
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, size=(2, *FRAME_SHAPE), dtype=np.uint8)
    logits, values = cnn(torch.from_numpy(frames))
    # Reference: run the layers by hand on frames / 255.
    encoder = cnn.encoders["obs_"]
    x = torch.from_numpy(frames).float() / 255.0
    hidden = encoder(x)
    torch.testing.assert_close(logits, cnn.actor(hidden), rtol=0, atol=0)
    torch.testing.assert_close(values, cnn.critic(hidden).squeeze(-1), rtol=0, atol=0)
    # Unscaled input would give different logits: the scaling is really applied.
    assert not torch.allclose(cnn.actor(encoder(torch.from_numpy(frames).float())), logits)


def test_wrong_dtype_or_shape_is_rejected(cnn: ActorCritic) -> None:
    with pytest.raises(ValueError, match="dtype"):
        cnn(torch.zeros((1, *FRAME_SHAPE), dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        cnn(torch.zeros((1, 4, 84, 83), dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        cnn.act(np.zeros((1, 4, 84, 83), dtype=np.uint8))
    with pytest.raises(ValueError, match="dtype"):
        cnn.act(np.zeros((1, *FRAME_SHAPE), dtype=np.float32))
    with pytest.raises(ValueError, match="positive sizes"):
        build_model((4, 0), np.uint8, 4)
    with pytest.raises(ValueError, match="at least one observation key"):
        build_model({}, Categorical(2))
    with pytest.raises(ValueError, match="num_actions"):
        build_model((4,), np.float32, 0)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_act_log_probs_equal_evaluate_actions(
    kind: str, mlp: ActorCritic, cnn: ActorCritic
) -> None:
    model = mlp if kind == "mlp" else cnn
    rng = np.random.default_rng(2)
    if kind == "mlp":
        obs = rng.normal(size=(64, 4)).astype(np.float32)
    else:
        obs = rng.integers(0, 256, size=(8, *FRAME_SHAPE), dtype=np.uint8)
    bundle = model.act(obs, generator=torch.Generator().manual_seed(3))
    assert bundle.actions.dtype == np.int64 and bundle.actions.shape == (len(obs),)
    assert bundle.log_probs.dtype == np.float32 and bundle.values.dtype == np.float32
    assert bundle.distribution_fields == {}
    log_probs, entropy, values = model.evaluate_actions(
        torch.from_numpy(obs), torch.from_numpy(bundle.actions)
    )
    np.testing.assert_allclose(bundle.log_probs, log_probs.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(bundle.values, values.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.predict_values(obs), bundle.values, rtol=0, atol=1e-6)
    # Independent reference for log-prob and entropy: softmax by hand in float64.
    logits = model(torch.from_numpy(obs))[0].detach().double().numpy()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(
        log_probs.detach().numpy(), np.log(p[np.arange(len(obs)), bundle.actions]), atol=1e-5
    )
    np.testing.assert_allclose(entropy.detach().numpy(), -(p * np.log(p)).sum(-1), atol=1e-5)


def test_act_sampling_is_reproducible_and_follows_the_policy(mlp: ActorCritic) -> None:
    obs = np.zeros((4000, 4), dtype=np.float32)
    a1 = mlp.act(obs, generator=torch.Generator().manual_seed(7)).actions
    a2 = mlp.act(obs, generator=torch.Generator().manual_seed(7)).actions
    np.testing.assert_array_equal(a1, a2)
    with torch.no_grad():
        p1 = torch.softmax(mlp(torch.from_numpy(obs[:1]))[0], -1)[0, 1].item()
    # 4000 samples: the frequency of action 1 lies within 5 standard errors of its probability.
    assert abs(a1.mean() - p1) < 5 * np.sqrt(p1 * (1 - p1) / len(obs))


def test_greedy_act_takes_argmax(mlp: ActorCritic) -> None:
    rng = np.random.default_rng(4)
    obs = rng.normal(size=(32, 4)).astype(np.float32) * 5
    with torch.no_grad():
        expected = mlp(torch.from_numpy(obs))[0].argmax(-1).numpy()
    np.testing.assert_array_equal(mlp.act(obs, greedy=True).actions, expected)


def test_the_cached_device_follows_the_parameters(mlp: ActorCritic) -> None:
    import pickle

    assert mlp.device == torch.device("cpu")
    mlp.to("meta")
    assert mlp.device == torch.device("meta")
    mlp.to_empty(device="cpu")
    assert mlp.device == torch.device("cpu")
    meta = {
        name: torch.empty_like(tensor, device="meta") for name, tensor in mlp.state_dict().items()
    }
    mlp.load_state_dict(meta, assign=True)  # swaps the parameters themselves
    assert mlp.device == torch.device("meta")
    restored = pickle.loads(pickle.dumps(build_model((4,), np.float32, 2)))
    assert restored.__dict__.get("_device") is None and restored.device == torch.device("cpu")


def test_weights_round_trip(mlp: ActorCritic) -> None:
    arrays = weights_to_arrays(mlp)
    assert set(arrays) == set(mlp.state_dict())
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays.values())
    torch.manual_seed(123)
    other = build_model((4,), np.float32, 2)
    obs = np.random.default_rng(5).normal(size=(16, 4)).astype(np.float32)
    assert not np.allclose(other.predict_values(obs), mlp.predict_values(obs))
    # Read-only arrays (as decoded from the wire) load too.
    for a in arrays.values():
        a.flags.writeable = False
    load_weight_arrays(other, arrays)
    np.testing.assert_array_equal(other.predict_values(obs), mlp.predict_values(obs))
    # The snapshot is a copy: changing the model afterwards does not change it.
    before = arrays["actor_torso.0.weight"].copy()
    with torch.no_grad():
        mlp.actor_torso[0].weight.add_(1.0)
    np.testing.assert_array_equal(arrays["actor_torso.0.weight"], before)


def test_load_weight_arrays_rejects_bad_sets_and_leaves_model_unchanged(mlp: ActorCritic) -> None:
    good = weights_to_arrays(mlp)
    snapshot = {k: v.copy() for k, v in good.items()}

    missing = dict(good)
    del missing["critic.bias"]
    with pytest.raises(ValueError, match=r"critic\.bias"):
        load_weight_arrays(mlp, missing)

    extra = dict(good, bogus=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="bogus"):
        load_weight_arrays(mlp, extra)

    wrong_shape = {
        k: (np.zeros((3, 3), np.float32) if k == "actor.bias" else v + 1) for k, v in good.items()
    }
    with pytest.raises(ValueError, match=r"actor\.bias.*shape"):
        load_weight_arrays(mlp, wrong_shape)

    wrong_dtype = {
        k: (v.astype(np.float64) if k == "actor_torso.0.weight" else v + 1) for k, v in good.items()
    }
    with pytest.raises(ValueError, match=r"actor_torso\.0\.weight.*float32.*float64"):
        load_weight_arrays(mlp, wrong_dtype)

    after = weights_to_arrays(mlp)
    for name, array in snapshot.items():
        np.testing.assert_array_equal(after[name], array)


def test_models_are_built_from_an_env_spec_for_any_supported_action_space() -> None:
    discrete = EnvSpec.discrete("Test-v0", (3,), np.float32, 5)
    model = build_model(discrete.observation_layout, distribution_for_env(discrete))
    assert model.distribution == Categorical(5) and model.observation_layout == {
        "": ((3,), np.dtype(np.float32))
    }
    assert model.act(np.zeros((2, 3), np.float32)).actions.shape == (2,)
    box = EnvSpec(
        "Box-v0", {"": ((3,), np.float32)}, gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    )
    gaussian = build_model(box.observation_layout, distribution_for_env(box))
    assert isinstance(gaussian.distribution, DiagGaussian)
    assert gaussian.act(np.zeros((2, 3), np.float32)).actions.shape == (2, 2)
    tuple_space = EnvSpec(
        "Tuple-v0",
        {"": ((3,), np.float32)},
        gymnasium.spaces.Tuple((gymnasium.spaces.Discrete(2), gymnasium.spaces.Discrete(3))),
    )
    with pytest.raises(ValueError, match="action_space.*Tuple"):
        distribution_for_env(tuple_space)


# ---------------------------------------------------------------------------------- dict observations
DICT_LAYOUT = {
    "image": ((3, 48, 48), np.uint8),  # >= 36 x 36: the Nature CNN
    "minimap": ((2, 12, 12), np.uint8),  # too small for the Nature CNN (SB3 fails here)
    "state": ((5,), np.float32),  # a vector: flattened
}


def dict_observations(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, size=(batch, 3, 48, 48), dtype=np.uint8),
        "minimap": rng.integers(0, 256, size=(batch, 2, 12, 12), dtype=np.uint8),
        "state": rng.normal(size=(batch, 5)).astype(np.float32),
    }


def test_one_encoder_per_key_and_a_mixer() -> None:
    torch.manual_seed(0)
    model = build_model(DICT_LAYOUT, Categorical(3))
    assert set(model.encoders) == {"obs_image", "obs_minimap", "obs_state"}
    assert convs_of(model.encoders["obs_image"]) == NATURE_CONVS
    small = convs_of(model.encoders["obs_minimap"])
    assert small and all(kernel == (3, 3) for _, kernel, _ in small)
    assert isinstance(model.encoders["obs_state"], torch.nn.Flatten)
    mixer = [m for m in model.mixer.modules() if isinstance(m, torch.nn.Linear)]
    # Nature CNN 512 + small CNN 256 + 5 flattened floats.
    assert [(m.in_features, m.out_features) for m in mixer] == [(512 + 256 + 5, 256)]
    obs = dict_observations(4)
    head, values = model({key: torch.from_numpy(array) for key, array in obs.items()})
    assert head.shape == (4, 3) and values.shape == (4,)
    # Every key reaches the output: changing one key changes the values.
    for key in DICT_LAYOUT:
        changed = dict(obs, **{key: dict_observations(4, seed=1)[key]})
        assert not np.allclose(model.predict_values(changed), model.predict_values(obs)), key
    # uint8 keys are scaled to [0, 1]: the encoder output equals the encoder on x / 255.
    inputs = model._inputs({key: torch.from_numpy(array) for key, array in obs.items()})
    torch.testing.assert_close(inputs["image"], torch.from_numpy(obs["image"]).float() / 255.0)
    torch.testing.assert_close(inputs["state"], torch.from_numpy(obs["state"]))


@pytest.mark.parametrize("side", [5, 8, 12, 35, 36])
def test_small_images_get_an_encoder_that_fits(side: int) -> None:
    model = build_model({"": ((1, side, side), np.uint8)}, Categorical(2))
    convs = convs_of(model)
    assert convs == (NATURE_CONVS if side >= 36 else [(16, (3, 3), (1, 1)), (32, (3, 3), (1, 1))])
    bundle = model.act(np.zeros((2, 1, side, side), np.uint8))
    assert bundle.actions.shape == (2,) and np.isfinite(bundle.log_probs).all()


def test_dict_observations_are_checked_by_key() -> None:
    model = build_model(DICT_LAYOUT, Categorical(3))
    obs = dict_observations(2)
    with pytest.raises(ValueError, match="keys"):
        model.act({k: v for k, v in obs.items() if k != "state"})
    with pytest.raises(ValueError, match=r"observations\['image'\].*dtype"):
        model.act(dict(obs, image=obs["image"].astype(np.float32)))
    with pytest.raises(ValueError, match=r"observations\['state'\].*shape"):
        model.act(dict(obs, state=np.zeros((2, 4), np.float32)))
    with pytest.raises(ValueError, match="keys"):
        model.act(obs["image"])


# ---------------------------------------------------------------------------------- masks
def test_masked_act_never_picks_a_masked_action() -> None:
    torch.manual_seed(0)
    model = build_model({"": ((4,), np.float32)}, Categorical(5, masked=True))
    with torch.no_grad():  # a strong preference for action 0, which the masks often forbid
        model.actor.bias.copy_(torch.tensor([8.0, 0.0, 0.0, 0.0, 0.0]))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(3000, 4)).astype(np.float32)
    masks = rng.random((3000, 5)) < 0.4
    masks[np.arange(3000), rng.integers(0, 5, 3000)] = True  # at least one valid action per row
    generator = torch.Generator().manual_seed(1)
    for greedy in (False, True):
        bundle = model.act(obs, action_mask=masks, greedy=greedy, generator=generator)
        assert masks[np.arange(3000), bundle.actions].all(), (
            f"a masked action was taken (greedy={greedy})"
        )
        assert np.isfinite(bundle.log_probs).all() and (bundle.log_probs <= 0).all()
    # Where action 0 is allowed it is almost always taken: the mask changes nothing else.
    sampled = model.act(obs, action_mask=masks, generator=generator).actions
    assert (sampled[masks[:, 0]] == 0).mean() > 0.95
    log_probs, entropy, _ = model.evaluate_actions(
        torch.from_numpy(obs), torch.from_numpy(sampled), torch.from_numpy(masks)
    )
    assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
    with pytest.raises(ValueError, match="action_mask: this policy is masked"):
        model.act(obs)
    with pytest.raises(ValueError, match=r"action_mask: expected shape \(3000, 5\) bool"):
        model.act(obs, action_mask=masks[:, :4])
    with pytest.raises(ValueError, match=r"action_mask: expected shape \(3000, 5\) bool"):
        model.act(obs, action_mask=masks.astype(np.uint8))


def test_masked_multi_discrete_act_respects_each_sub_action_mask() -> None:
    torch.manual_seed(0)
    nvec = (3, 2, 4)
    model = build_model({"": ((2,), np.float32)}, MultiCategorical(nvec, masked=True))
    rng = np.random.default_rng(1)
    obs = rng.normal(size=(1000, 2)).astype(np.float32)
    masks = rng.random((1000, sum(nvec))) < 0.5
    offsets = np.concatenate([[0], np.cumsum(nvec)[:-1]])
    for offset, size in zip(offsets, nvec, strict=True):
        masks[np.arange(1000), offset + rng.integers(0, size, 1000)] = True
    bundle = model.act(obs, action_mask=masks, generator=torch.Generator().manual_seed(2))
    assert bundle.actions.shape == (1000, 3) and bundle.actions.dtype == np.int64
    for i, (offset, size) in enumerate(zip(offsets, nvec, strict=True)):
        assert ((bundle.actions[:, i] >= 0) & (bundle.actions[:, i] < size)).all()
        assert masks[np.arange(1000), offset + bundle.actions[:, i]].all(), f"sub-action {i}"


# ---------------------------------------------------------------------------------- Gaussian
def test_gaussian_act_returns_action_mean_and_std() -> None:
    torch.manual_seed(0)
    distribution = DiagGaussian([-2.0, -1.0], [2.0, 1.0])
    model = build_model({"": ((3,), np.float32)}, distribution)
    with torch.no_grad():
        model.actor.log_std.copy_(torch.tensor([math.log(0.5), math.log(2.0)]))
    obs = np.random.default_rng(3).normal(size=(500, 3)).astype(np.float32)
    bundle = model.act(obs, generator=torch.Generator().manual_seed(4))
    assert set(bundle.distribution_fields) == {"action_mean", "action_std"}
    mean, std = bundle.distribution_fields["action_mean"], bundle.distribution_fields["action_std"]
    assert mean.shape == std.shape == bundle.actions.shape == (500, 2)
    assert mean.dtype == std.dtype == bundle.actions.dtype == np.float32
    np.testing.assert_allclose(std, np.broadcast_to([0.5, 2.0], (500, 2)), rtol=1e-6)
    with torch.no_grad():
        head, _ = model(torch.from_numpy(obs))
    np.testing.assert_allclose(mean, head[:, :2].numpy(), rtol=1e-6)
    # log prob of the action as sampled (not clipped), against an independent reference.
    reference = torch.distributions.Normal(
        torch.from_numpy(mean).double(), torch.from_numpy(std).double()
    )
    expected = reference.log_prob(torch.from_numpy(bundle.actions).double()).sum(-1).numpy()
    np.testing.assert_allclose(bundle.log_probs, expected, rtol=1e-5, atol=1e-5)
    assert (np.abs(bundle.actions[:, 1]) > 1.0).any(), "std 2: some samples lie outside the Box"
    # The samples follow N(mean, std): standardised residuals have mean ~0 and std ~1.
    z = (bundle.actions - mean) / std
    assert abs(z.mean()) < 0.1 and abs(z.std() - 1.0) < 0.1
    greedy = model.act(obs, greedy=True)
    np.testing.assert_allclose(greedy.actions, mean, rtol=1e-6)


# ---------------------------------------------------------------------------------- normalisation
def test_running_normalizer_matches_numpy_mean_and_var() -> None:
    rng = np.random.default_rng(5)
    batches = [
        rng.normal(loc=3.0, scale=2.0, size=(n, 4)).astype(np.float32) * [1, 10, 0.1, 1]
        for n in (7, 50, 1, 200)
    ]
    normalizer = RunningNormalizer((4,))
    for batch in batches:
        normalizer.update(torch.from_numpy(batch))
    data = np.concatenate(batches).astype(np.float64)
    # The initial count of 1e-4 (a prior at mean 0, var 1, as SB3's RunningMeanStd) is negligible.
    np.testing.assert_allclose(normalizer.mean.numpy(), data.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(normalizer.var.numpy(), data.var(0), rtol=1e-5, atol=1e-5)
    assert float(normalizer.count) == pytest.approx(len(data) + 1e-4)
    x = torch.from_numpy(batches[0])
    expected = np.clip((batches[0] - data.mean(0)) / np.sqrt(data.var(0) + 1e-8), -10, 10)
    np.testing.assert_allclose(normalizer(x).numpy(), expected, rtol=1e-4, atol=1e-4)
    huge = torch.full((1, 4), 1e6)
    assert (normalizer(huge) == 10.0).all(), "clipped at 10"


def test_normalizer_statistics_travel_with_the_weights() -> None:
    torch.manual_seed(0)
    layout = {"image": ((1, 12, 12), np.uint8), "state": ((3,), np.float32)}
    learner = build_model(layout, Categorical(2), normalize_observations=True)
    assert set(learner.normalizers) == {"obs_state"}, "only float keys are normalised"
    rng = np.random.default_rng(6)
    batch = {
        "image": rng.integers(0, 256, (64, 1, 12, 12), dtype=np.uint8),
        "state": (rng.normal(size=(64, 3)) * 50 + 100).astype(np.float32),
    }
    learner.update_observation_statistics(batch)
    arrays = weights_to_arrays(learner)
    assert {
        "normalizers.obs_state.mean",
        "normalizers.obs_state.var",
        "normalizers.obs_state.count",
    } <= set(arrays)
    assert arrays["normalizers.obs_state.count"].shape == (), "0-d entries keep shape ()"
    assert arrays["normalizers.obs_state.count"].dtype == np.float32
    np.testing.assert_allclose(
        arrays["normalizers.obs_state.mean"], batch["state"].mean(0), rtol=1e-4
    )

    torch.manual_seed(1)
    actor = build_model(layout, Categorical(2), normalize_observations=True)
    assert not np.allclose(actor.predict_values(batch), learner.predict_values(batch))
    load_weight_arrays(actor, arrays)
    np.testing.assert_array_equal(actor.predict_values(batch), learner.predict_values(batch))
    np.testing.assert_array_equal(
        actor.normalizers["obs_state"].mean.numpy(), arrays["normalizers.obs_state.mean"]
    )
    assert actor.normalizers["obs_state"].count.shape == ()
    # The statistics are used: resetting them changes the values.
    actor.normalizers["obs_state"].mean.zero_()
    assert not np.allclose(actor.predict_values(batch), learner.predict_values(batch))
    # A model without normalisation has no statistics to load.
    plain = build_model(layout, Categorical(2))
    with pytest.raises(ValueError, match="unexpected names.*normalizers"):
        load_weight_arrays(plain, arrays)


def _same_cnn_pair(seed: int = 0) -> tuple[ActorCritic, ActorCritic]:
    torch.manual_seed(seed)
    standard = build_model((4, 84, 84), np.uint8, 4)
    channels_last = build_model((4, 84, 84), np.uint8, 4)
    channels_last.load_state_dict(standard.state_dict())
    return standard, channels_last.use_channels_last()


def test_a_channels_last_cnn_computes_what_the_standard_one_does() -> None:
    """Same weights, same outputs (float rounding apart) and gradients; the weights it hands the
    actors are the same contiguous arrays; only the conv weights change layout."""
    standard, channels_last = _same_cnn_pair()
    assert channels_last.channels_last and not standard.channels_last
    assert channels_last.has_convolutions and not build_model((4,), np.float32, 2).has_convolutions
    conv = channels_last.encoders["obs_"][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    frames = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8)
    for model in (standard, channels_last):
        head, values = model(frames)
        (head.square().sum() + values.sum()).backward()
    head_standard, values_standard = standard(frames)
    head_last, values_last = channels_last(frames)
    torch.testing.assert_close(head_last, head_standard, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values_last, values_standard, rtol=1e-5, atol=1e-5)
    for (name, p_standard), p_last in zip(
        standard.named_parameters(), channels_last.parameters(), strict=True
    ):
        torch.testing.assert_close(p_last.grad, p_standard.grad, rtol=1e-4, atol=1e-6, msg=name)
    arrays_standard, arrays_last = weights_to_arrays(standard), weights_to_arrays(channels_last)
    assert all(
        np.array_equal(arrays_last[k], arrays_standard[k]) and arrays_last[k].flags.c_contiguous
        for k in arrays_standard
    )


@pytest.mark.parametrize("saved_by", ["standard", "channels_last"])
def test_optimizer_state_is_relaid_like_its_parameters_on_load(saved_by: str) -> None:
    """A checkpoint's Adam moments come back in the layout of the parameters they belong to,
    whichever layout wrote them: the next fused Adam step then equals the uninterrupted one
    (with the saved layout kept, it moved a conv weight by up to 0.09 too much at this lr)."""
    frames = torch.randint(
        0, 256, (8, 4, 84, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )

    def adam_step(model: ActorCritic, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        head, values = model(frames)
        (head.square().mean() + values.square().mean()).backward()
        optimizer.step()

    writers = dict(zip(("standard", "channels_last"), _same_cnn_pair(), strict=True))
    writer = writers[saved_by]
    optimizer = torch.optim.Adam(writer.parameters(), lr=0.1, eps=1e-5, fused=True)
    for _ in range(2):
        adam_step(writer, optimizer)
    model_state = {k: v.clone() for k, v in writer.state_dict().items()}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    adam_step(writer, optimizer)  # the uninterrupted run

    reader = build_model((4, 84, 84), np.uint8, 4)
    if saved_by == "standard":
        reader.use_channels_last()
    reader.load_state_dict(model_state)
    resumed = torch.optim.Adam(reader.parameters(), lr=0.1, eps=1e-5, fused=True)
    load_optimizer_state(resumed, optimizer_state)
    for parameter in reader.parameters():
        assert resumed.state[parameter]["exp_avg"].stride() == parameter.stride()
    adam_step(reader, resumed)
    for (name, expected), got in zip(
        writer.state_dict().items(), reader.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
