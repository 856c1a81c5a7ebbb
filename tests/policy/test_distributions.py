"""Tests for oakemu_core.policy.distributions: every family against an independent reference
(torch.distributions or numpy formulas written here), masks, modes, plain-value round trips and
the choice of family per Gymnasium space."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from oakemu_core.policy.distributions import (
    Bernoulli,
    Categorical,
    DiagGaussian,
    MultiCategorical,
    _gumbel_argmax,
    distribution_for_space,
    distribution_from_dict,
)  # the sampler's noise step, tested alone

B = 64


def logits(batch: int, width: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(batch, width)) * scale).float()


def random_mask(batch: int, width: int, seed: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, width)) < 0.5
    mask[np.arange(batch), rng.integers(0, width, batch)] = True  # at least one valid entry
    return torch.from_numpy(mask)


# ---------------------------------------------------------------------------------- categorical
def test_categorical_log_prob_entropy_and_mode_match_torch() -> None:
    head = logits(B, 6)
    policy = Categorical(6).policy(head)
    reference = torch.distributions.Categorical(logits=head.double())
    actions = torch.from_numpy(np.random.default_rng(2).integers(0, 6, B))
    torch.testing.assert_close(
        policy.log_prob(actions).double(), reference.log_prob(actions), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(policy.entropy().double(), reference.entropy(), rtol=1e-5, atol=1e-5)
    assert policy.log_prob(actions).shape == policy.entropy().shape == (B,)
    torch.testing.assert_close(policy.mode(), head.argmax(-1))
    assert policy.stored() == {} and policy.kl_from({}) is None


def test_gumbel_noise_of_an_exact_zero_uniform_never_picks_a_masked_action() -> None:
    # torch.rand returns exactly 0 about once in 2^24 draws; its noise must not sink the only legal
    # action below the masked ones (-inf noise would, and argmax would then pick a masked index).
    policy = Categorical(4).policy(
        torch.zeros(3, 4), torch.tensor([[False, True, False, False]] * 3)
    )
    uniform = torch.tensor(
        [[0.5, 0.0, 0.5, 0.9999999], [0.0, 0.0, 0.0, 0.0], [0.99, 0.0, 0.99, 0.99]]
    )
    assert _gumbel_argmax(policy.log_probs_all, uniform).tolist() == [1, 1, 1]
    # Unmasked, the largest noise wins: U closest to 1 gives the largest -log(-log U).
    plain = torch.zeros(2, 3)
    assert _gumbel_argmax(plain, torch.tensor([[0.1, 0.9, 0.5], [0.0, 0.2, 0.1]])).tolist() == [
        1,
        1,
    ]


def test_categorical_samples_follow_the_probabilities() -> None:
    head = torch.tensor([[2.0, 0.0, -1.0, 1.0]]).repeat(20000, 1)
    actions = Categorical(4).policy(head).sample(torch.Generator().manual_seed(0))
    assert actions.dtype == torch.int64 and actions.shape == (20000,)
    p = torch.softmax(head[0].double(), -1).numpy()
    frequencies = np.bincount(actions.numpy(), minlength=4) / 20000
    assert np.all(np.abs(frequencies - p) < 5 * np.sqrt(p * (1 - p) / 20000))
    again = Categorical(4).policy(head).sample(torch.Generator().manual_seed(0))
    torch.testing.assert_close(actions, again)


def test_masked_categorical_gives_masked_actions_probability_exactly_zero() -> None:
    head = logits(B, 6, scale=5.0)
    head[:, 0] = 50.0  # the most likely action is often masked
    mask = random_mask(B, 6)
    policy = Categorical(6, masked=True).policy(head, mask)
    all_actions = torch.arange(6).expand(B, 6)
    probabilities = torch.stack(
        [policy.log_prob(all_actions[:, a]).exp() for a in range(6)], dim=-1
    )
    assert (probabilities[~mask] == 0).all(), "masked actions: probability exactly 0"
    assert (probabilities[mask] > 0).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(B), rtol=1e-5, atol=1e-5)
    # Independent reference: softmax over the valid actions only (renormalised), in numpy.
    x, m = head.double().numpy(), mask.numpy()
    expected = np.where(m, np.exp(x - np.where(m, x, -np.inf).max(-1, keepdims=True)), 0.0)
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(probabilities.numpy(), expected, rtol=1e-5, atol=1e-6)
    # Entropy over the valid actions only, no NaN from 0 * log 0.
    reference_entropy = -np.where(m, expected * np.log(np.where(m, expected, 1.0)), 0.0).sum(-1)
    entropy = policy.entropy()
    assert torch.isfinite(entropy).all()
    np.testing.assert_allclose(entropy.numpy(), reference_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        entropy.double(),
        torch.distributions.Categorical(probs=torch.from_numpy(expected)).entropy(),
        rtol=1e-5,
        atol=1e-5,
    )
    # Masked actions are never sampled (many draws) and never the mode.
    draws = torch.stack([policy.sample(torch.Generator().manual_seed(s)) for s in range(200)])
    assert mask[torch.arange(B).expand(200, B), draws].all()
    assert mask[torch.arange(B), policy.mode()].all()
    # A row with one valid action: certain, entropy 0.
    single = torch.zeros(1, 6, dtype=torch.bool)
    single[0, 4] = True
    one = Categorical(6, masked=True).policy(head[:1], single)
    assert one.log_prob(torch.tensor([4])).item() == 0.0 and one.entropy().item() == 0.0
    assert one.sample().item() == 4


def test_masked_log_prob_has_finite_gradients() -> None:
    head = logits(8, 5).requires_grad_(True)
    mask = random_mask(8, 5)
    policy = Categorical(5, masked=True).policy(head, mask)
    actions = policy.sample(torch.Generator().manual_seed(0))
    (policy.log_prob(actions).sum() + policy.entropy().sum()).backward()
    assert torch.isfinite(head.grad).all()
    assert (head.grad[~mask] == 0).all(), "masked logits get no gradient"


# ---------------------------------------------------------------------------------- multi-categorical
NVEC = (3, 2, 4)


def test_multi_categorical_is_a_product_of_independent_categoricals() -> None:
    head = logits(B, sum(NVEC))
    distribution = MultiCategorical(NVEC)
    policy = distribution.policy(head)
    parts = [
        torch.distributions.Categorical(logits=p.double())
        for p in torch.split(head, list(NVEC), dim=-1)
    ]
    rng = np.random.default_rng(3)
    actions = torch.from_numpy(np.stack([rng.integers(0, n, B) for n in NVEC], axis=-1))
    expected = sum(part.log_prob(actions[:, i]) for i, part in enumerate(parts))
    torch.testing.assert_close(policy.log_prob(actions).double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        policy.entropy().double(), sum(p.entropy() for p in parts), rtol=1e-5, atol=1e-5
    )
    mode = policy.mode()
    assert mode.shape == (B, 3)
    for i, chunk in enumerate(torch.split(head, list(NVEC), dim=-1)):
        torch.testing.assert_close(mode[:, i], chunk.argmax(-1))
    sample = policy.sample(torch.Generator().manual_seed(1))
    assert sample.shape == (B, 3) and sample.dtype == torch.int64
    assert all(((sample[:, i] >= 0) & (sample[:, i] < n)).all() for i, n in enumerate(NVEC))


def test_multi_categorical_masks_apply_per_sub_action() -> None:
    head = logits(B, sum(NVEC), scale=4.0)
    mask = torch.cat([random_mask(B, n, seed=10 + i) for i, n in enumerate(NVEC)], dim=-1)
    policy = MultiCategorical(NVEC, masked=True).policy(head, mask)
    # Reference: each sub-action renormalised over its own valid values; log probs and entropies add.
    total_entropy = np.zeros(B)
    sub_masks, offset = [], 0
    for n in NVEC:
        x, m = head[:, offset : offset + n].double().numpy(), mask[:, offset : offset + n].numpy()
        p = np.where(m, np.exp(x - np.where(m, x, -np.inf).max(-1, keepdims=True)), 0.0)
        p /= p.sum(-1, keepdims=True)
        total_entropy += -np.where(m, p * np.log(np.where(m, p, 1.0)), 0.0).sum(-1)
        sub_masks.append((m, p))
        offset += n
    np.testing.assert_allclose(policy.entropy().numpy(), total_entropy, rtol=1e-5, atol=1e-5)
    draws = torch.stack(
        [policy.sample(torch.Generator().manual_seed(s)) for s in range(100)]
    )  # (100, B, 3)
    rows = np.arange(B)
    for i, (m, p) in enumerate(sub_masks):
        assert m[rows[None, :].repeat(100, 0), draws[..., i].numpy()].all(), (
            f"sub-action {i} took a masked value"
        )
    actions = draws[0]
    expected = sum(np.log(p[rows, actions[:, i].numpy()]) for i, (_, p) in enumerate(sub_masks))
    np.testing.assert_allclose(policy.log_prob(actions).numpy(), expected, rtol=1e-5, atol=1e-5)
    mode = policy.mode()
    assert all(m[rows, mode[:, i].numpy()].all() for i, (m, _) in enumerate(sub_masks))


# ---------------------------------------------------------------------------------- Bernoulli
def test_bernoulli_matches_torch() -> None:
    head = logits(B, 5)
    policy = Bernoulli(5).policy(head)
    reference = torch.distributions.Bernoulli(logits=head.double())
    bits = torch.from_numpy(np.random.default_rng(4).integers(0, 2, (B, 5)).astype(np.int8))
    torch.testing.assert_close(
        policy.log_prob(bits).double(),
        reference.log_prob(bits.double()).sum(-1),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        policy.entropy().double(), reference.entropy().sum(-1), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(policy.mode(), (head > 0).to(torch.int8))
    many = Bernoulli(5).policy(head[:1].repeat(20000, 1)).sample(torch.Generator().manual_seed(0))
    assert many.dtype == torch.int8 and set(many.unique().tolist()) <= {0, 1}
    p = torch.sigmoid(head[0].double()).numpy()
    assert np.all(np.abs(many.double().mean(0).numpy() - p) < 5 * np.sqrt(p * (1 - p) / 20000))


def test_bernoulli_masks_force_bits() -> None:
    head = logits(4, 3, scale=3.0)
    # Per bit: [may be 0, may be 1]. Bit 0 free; bit 1 forced to 1; bit 2 forced to 0.
    mask = torch.tensor([[True, True, False, True, True, False]]).repeat(4, 1)
    policy = Bernoulli(3, masked=True).policy(head, mask)
    draws = torch.cat([policy.sample(torch.Generator().manual_seed(s)) for s in range(300)])
    assert (draws[:, 1] == 1).all() and (draws[:, 2] == 0).all()
    assert draws[:, 0].unique().numel() == 2, "the free bit still varies"
    assert (policy.mode()[:, 1] == 1).all() and (policy.mode()[:, 2] == 0).all()
    free = torch.distributions.Bernoulli(logits=head[:, 0].double())
    # Forced bits contribute log 1 = 0 to the log prob and 0 to the entropy.
    bits = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 1, 0], [0, 1, 0]], dtype=torch.int8)
    torch.testing.assert_close(
        policy.log_prob(bits).double(), free.log_prob(bits[:, 0].double()), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(policy.entropy().double(), free.entropy(), rtol=1e-5, atol=1e-6)
    forbidden = torch.tensor([[1, 0, 0]] * 4, dtype=torch.int8)  # bit 1 = 0 is forbidden
    assert (policy.log_prob(forbidden) < -1e6).all()


# ---------------------------------------------------------------------------------- Gaussian
def gaussian_head(batch: int, dim: int, seed: int = 5) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=(batch, dim))
    log_std = np.broadcast_to(rng.normal(scale=0.5, size=dim), (batch, dim))
    return torch.from_numpy(np.concatenate([mean, log_std], axis=-1)).float()


def test_diag_gaussian_matches_torch_normal() -> None:
    distribution = DiagGaussian([-1.0, -2.0, -3.0], [1.0, 2.0, 3.0])
    head = gaussian_head(B, 3)
    policy = distribution.policy(head)
    mean, log_std = head[:, :3].double(), head[:, 3:].double()
    reference = torch.distributions.Normal(mean, log_std.exp())
    actions = torch.from_numpy(
        np.random.default_rng(6).normal(scale=3.0, size=(B, 3))
    ).float()  # also outside the Box
    torch.testing.assert_close(
        policy.log_prob(actions).double(),
        reference.log_prob(actions.double()).sum(-1),
        rtol=1e-5,
        atol=1e-4,
    )
    torch.testing.assert_close(
        policy.entropy().double(), reference.entropy().sum(-1), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(policy.mode(), head[:, :3])
    stored = policy.stored()
    assert set(stored) == {"action_mean", "action_std"}
    torch.testing.assert_close(stored["action_mean"], head[:, :3])
    torch.testing.assert_close(stored["action_std"].double(), log_std.exp(), rtol=1e-6, atol=1e-6)
    samples = distribution.policy(head[:1].repeat(20000, 1)).sample(
        torch.Generator().manual_seed(0)
    )
    z = ((samples.double() - mean[:1]) / log_std[:1].exp()).numpy()
    assert np.all(np.abs(z.mean(0)) < 0.05) and np.all(np.abs(z.std(0) - 1) < 0.05)


def test_diag_gaussian_exact_kl_matches_torch_kl_divergence() -> None:
    distribution = DiagGaussian([-1.0, -1.0], [1.0, 1.0])
    old = distribution.policy(gaussian_head(B, 2, seed=7))
    new = distribution.policy(gaussian_head(B, 2, seed=8))
    kl = new.kl_from(old.stored())
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(old.mean.double(), old.std.double()),
        torch.distributions.Normal(new.mean.double(), new.std.double()),
    ).sum(-1)
    assert kl.shape == (B,)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=1e-6)
    assert (kl > 0).all()
    torch.testing.assert_close(old.kl_from(old.stored()), torch.zeros(B), rtol=0, atol=1e-6)


def test_gaussian_log_std_is_clamped_and_env_actions_are_clipped() -> None:
    distribution = DiagGaussian([-1.0, 0.0], [1.0, 2.0])
    head = torch.tensor([[0.0, 0.0, -100.0, 100.0]])
    policy = distribution.policy(head)
    torch.testing.assert_close(policy.log_std, torch.tensor([[-20.0, 2.0]]))
    assert torch.isfinite(policy.log_prob(torch.tensor([[0.0, 1.0]]))).all()
    actions = np.array([[-3.0, 5.0], [0.5, -0.5]], np.float32)
    np.testing.assert_array_equal(distribution.env_actions(actions), [[-1.0, 2.0], [0.5, 0.0]])
    np.testing.assert_array_equal(
        actions, [[-3.0, 5.0], [0.5, -0.5]]
    )  # the stored action is not changed
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="finite"):
            distribution.env_actions(np.array([[0.0, bad]], np.float32))
    assert distribution.action_bounds() == (None, None)
    assert Categorical(3).env_actions(np.array([2])).tolist() == [2]


def test_heads_have_the_parameter_size() -> None:
    for distribution in (
        Categorical(4),
        MultiCategorical(NVEC),
        Bernoulli(3),
        DiagGaussian([-1.0] * 2, [1.0] * 2),
    ):
        head = distribution.make_head(16)
        out = head(torch.zeros(5, 16))
        assert out.shape == (5, distribution.param_size), distribution
    gaussian = DiagGaussian([-1.0] * 2, [1.0] * 2).make_head(16)
    assert [name for name, _ in gaussian.named_parameters()] == [
        "log_std",
        "mean.weight",
        "mean.bias",
    ]
    torch.testing.assert_close(
        gaussian(torch.zeros(1, 16))[0, 2:], torch.zeros(2)
    )  # log std 0: initial std 1


# ---------------------------------------------------------------------------------- construction
ALL = [
    Categorical(5),
    Categorical(5, masked=True),
    MultiCategorical([3, 4]),
    MultiCategorical([3, 4], masked=True),
    Bernoulli(6),
    Bernoulli(6, masked=True),
    DiagGaussian([-2.0, 0.0], [2.0, 1.0]),
]


@pytest.mark.parametrize("distribution", ALL, ids=repr)
def test_plain_value_round_trip(distribution) -> None:
    import msgpack

    as_dict = distribution.to_dict()
    again = distribution_from_dict(msgpack.unpackb(msgpack.packb(as_dict)))
    assert again == distribution and type(again) is type(distribution)
    assert again.to_dict() == as_dict
    assert (again.action_shape, again.action_dtype, again.param_size, again.mask_width) == (
        distribution.action_shape,
        distribution.action_dtype,
        distribution.param_size,
        distribution.mask_width,
    )
    assert hash(again) == hash(distribution)
    others = [d for d in ALL if d is not distribution]
    assert all(again != other for other in others)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "tuple"},
        {"kind": "categorical"},
        {"kind": "categorical", "num_actions": 0},
        {"kind": "multi_categorical", "nvec": []},
        {"kind": "bernoulli", "num_bits": "x"},
        {"kind": "diag_gaussian", "low": [1.0], "high": [0.0]},
        {},
    ],
)
def test_from_dict_refuses_malformed_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        distribution_from_dict(bad)


def test_distribution_for_each_gymnasium_space() -> None:
    assert distribution_for_space(spaces.Discrete(4)) == Categorical(4)
    assert distribution_for_space(spaces.Discrete(4), mask_width=4) == Categorical(4, masked=True)
    assert distribution_for_space(spaces.MultiDiscrete([3, 5])) == MultiCategorical([3, 5])
    assert distribution_for_space(spaces.MultiDiscrete([3, 5]), mask_width=8).mask_width == 8
    assert distribution_for_space(spaces.MultiBinary(4)) == Bernoulli(4)
    assert distribution_for_space(spaces.MultiBinary(4), mask_width=8) == Bernoulli(4, masked=True)
    box = distribution_for_space(
        spaces.Box(
            np.array([-1.0, 0.0], np.float32), np.array([1.0, 3.0], np.float32), dtype=np.float32
        )
    )
    assert (
        isinstance(box, DiagGaussian)
        and box.action_shape == (2,)
        and box.action_dtype == np.float32
    )
    np.testing.assert_array_equal(box.low, [-1.0, 0.0])
    np.testing.assert_array_equal(box.high, [1.0, 3.0])
    # action shapes and dtypes as stored
    assert (Categorical(4).action_shape, Categorical(4).action_dtype) == ((), np.dtype(np.int64))
    assert (Bernoulli(4).action_shape, Bernoulli(4).action_dtype) == ((4,), np.dtype(np.int8))
    low, high = MultiCategorical([3, 5]).action_bounds()
    assert low.tolist() == [0, 0] and high.tolist() == [2, 4]


@pytest.mark.parametrize(
    ("space", "mask_width", "message"),
    [
        (spaces.Tuple((spaces.Discrete(2), spaces.Discrete(3))), 0, "Tuple"),
        (spaces.Dict({"a": spaces.Discrete(2)}), 0, "Dict"),
        (spaces.Text(5), 0, "Text"),
        (spaces.Box(-1.0, 1.0, (2, 2), np.float32), 0, "Box"),  # 2-D Box
        (spaces.MultiDiscrete([[2, 2], [2, 2]]), 0, "MultiDiscrete"),
        (spaces.Discrete(4), 3, "width 4"),
        (spaces.MultiDiscrete([3, 5]), 7, "width 8"),
        (spaces.Box(-1.0, 1.0, (2,), np.float32), 2, "cannot be masked"),
    ],
)
def test_unsupported_spaces_and_wrong_mask_widths_are_refused_by_name(
    space, mask_width: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        distribution_for_space(space, mask_width=mask_width)
