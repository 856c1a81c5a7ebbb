"""Tests for oakemu_core.models: shapes, uint8 scaling, act/evaluate agreement, weights round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.models import ActorCritic, build_model, load_weight_arrays, weights_to_arrays

FRAME_SHAPE = (4, 84, 84)


@pytest.fixture(scope="module")
def cnn() -> ActorCritic:
    torch.manual_seed(0)
    return build_model(FRAME_SHAPE, np.uint8, 4)


@pytest.fixture()
def mlp() -> ActorCritic:
    torch.manual_seed(0)
    return build_model((4,), np.float32, 2)


def test_nature_cnn_layers_and_output_shapes(cnn: ActorCritic) -> None:
    convs = [m for m in cnn.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (32, (8, 8), (4, 4)),
        (64, (4, 4), (2, 2)),
        (64, (3, 3), (1, 1)),
    ]
    linears = [m for m in cnn.modules() if isinstance(m, torch.nn.Linear)]
    assert (linears[0].in_features, linears[0].out_features) == (64 * 7 * 7, 512)
    obs = torch.zeros((3, *FRAME_SHAPE), dtype=torch.uint8)
    logits, values = cnn(obs)
    assert logits.shape == (3, 4) and values.shape == (3,)
    assert logits.dtype == torch.float32


def test_mlp_is_cleanrl_64_64_tanh_with_orthogonal_init(mlp: ActorCritic) -> None:
    actor_linears = [m for m in mlp.actor if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in actor_linears] == [(4, 64), (64, 64), (64, 2)]
    assert sum(isinstance(m, torch.nn.Tanh) for m in mlp.actor) == 2
    # Orthogonal with gain g: W W^T = g^2 I for a wide (rows <= cols) matrix.
    w = actor_linears[-1].weight.detach()
    np.testing.assert_allclose((w @ w.T).numpy(), 0.01**2 * np.eye(2), atol=1e-7)
    w = actor_linears[1].weight.detach()
    np.testing.assert_allclose((w @ w.T).numpy(), 2.0 * np.eye(64), atol=1e-4)
    assert torch.count_nonzero(actor_linears[0].bias) == 0


def test_uint8_frames_are_scaled_by_255_inside_forward(cnn: ActorCritic) -> None:
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, size=(2, *FRAME_SHAPE), dtype=np.uint8)
    logits, values = cnn(torch.from_numpy(frames))
    # Reference: run the layers by hand on frames / 255.
    x = torch.from_numpy(frames).float() / 255.0
    hidden = cnn.network(x)
    torch.testing.assert_close(logits, cnn.actor(hidden), rtol=0, atol=0)
    torch.testing.assert_close(values, cnn.critic(hidden).squeeze(-1), rtol=0, atol=0)
    # Unscaled input would give different logits: the scaling is really applied.
    assert not torch.allclose(cnn.actor(cnn.network(torch.from_numpy(frames).float())), logits)


def test_wrong_dtype_or_shape_is_rejected(cnn: ActorCritic) -> None:
    with pytest.raises(ValueError, match="dtype"):
        cnn(torch.zeros((1, *FRAME_SHAPE), dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        cnn.act(np.zeros((1, 4, 84, 83), dtype=np.uint8))
    with pytest.raises(ValueError, match="observation_shape"):
        build_model((4, 84), np.uint8, 4)
    with pytest.raises(ValueError, match="num_actions"):
        build_model((4,), np.float32, 0)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_act_log_probs_equal_evaluate_actions(kind: str, mlp: ActorCritic, cnn: ActorCritic) -> None:
    model = mlp if kind == "mlp" else cnn
    rng = np.random.default_rng(2)
    if kind == "mlp":
        obs = rng.normal(size=(64, 4)).astype(np.float32)
    else:
        obs = rng.integers(0, 256, size=(8, *FRAME_SHAPE), dtype=np.uint8)
    bundle = model.act(obs, generator=torch.Generator().manual_seed(3))
    assert bundle.actions.dtype == np.int64 and bundle.actions.shape == (len(obs),)
    assert bundle.log_probs.dtype == np.float32 and bundle.values.dtype == np.float32
    log_probs, entropy, values = model.evaluate_actions(torch.from_numpy(obs), torch.from_numpy(bundle.actions))
    np.testing.assert_allclose(bundle.log_probs, log_probs.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(bundle.values, values.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.predict_values(obs), bundle.values, rtol=0, atol=1e-6)
    # Independent reference for log-prob and entropy: softmax by hand in float64.
    logits = model(torch.from_numpy(obs))[0].detach().double().numpy()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(log_probs.detach().numpy(), np.log(p[np.arange(len(obs)), bundle.actions]), atol=1e-5)
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
    before = arrays["actor.0.weight"].copy()
    with torch.no_grad():
        mlp.actor[0].weight.add_(1.0)
    np.testing.assert_array_equal(arrays["actor.0.weight"], before)


def test_load_weight_arrays_rejects_bad_sets_and_leaves_model_unchanged(mlp: ActorCritic) -> None:
    good = weights_to_arrays(mlp)
    snapshot = {k: v.copy() for k, v in good.items()}

    missing = dict(good)
    del missing["critic.4.bias"]
    with pytest.raises(ValueError, match="critic.4.bias"):
        load_weight_arrays(mlp, missing)

    extra = dict(good, bogus=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="bogus"):
        load_weight_arrays(mlp, extra)

    wrong_shape = {k: (np.zeros((3, 3), np.float32) if k == "actor.4.bias" else v + 1) for k, v in good.items()}
    with pytest.raises(ValueError, match=r"actor\.4\.bias.*shape"):
        load_weight_arrays(mlp, wrong_shape)

    wrong_dtype = {k: (v.astype(np.float64) if k == "actor.0.weight" else v + 1) for k, v in good.items()}
    with pytest.raises(ValueError, match=r"actor\.0\.weight.*float32.*float64"):
        load_weight_arrays(mlp, wrong_dtype)

    after = weights_to_arrays(mlp)
    for name, array in snapshot.items():
        np.testing.assert_array_equal(after[name], array)


def test_from_spec_uses_spec_fields_and_rejects_non_categorical_actions() -> None:
    class Spec:
        observation_shape = (3,)
        observation_dtype = np.dtype(np.float32)
        num_actions = 5
        action_shape = ()
        action_dtype = np.dtype(np.int64)

    model = ActorCritic.from_spec(Spec())
    assert model.num_actions == 5 and model.observation_shape == (3,)
    Spec.action_shape = (2,)
    with pytest.raises(ValueError, match="action_shape"):
        ActorCritic.from_spec(Spec())
