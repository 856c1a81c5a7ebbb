"""FlatGradients: one buffer for every trained parameter's gradient, clipped by its global norm;
FlatParameters / FlatAdam: the values in one tensor too, stepped by torch's Adam as one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from oakemu_core.algo.flat_parameters import FlatAdam, FlatGradients
from oakemu_core.algo.ppo import PPOUpdater
from oakemu_core.policy.models import build_model


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _loss(net: nn.Module, scale: float = 1.0) -> torch.Tensor:
    inputs = torch.linspace(-2, 2, 40).reshape(8, 5)
    return scale * net(inputs).square().sum()


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
def test_clipping_matches_torch_clip_grad_norm(max_norm: float) -> None:
    """Same norm and same clipped gradients as torch.nn.utils.clip_grad_norm_ on a copy, whether
    the bound clips (1e-3) or not (1e9)."""
    net, reference = _net(), _net()
    gradients = FlatGradients(net.parameters())
    gradients.zero()
    _loss(net).backward()
    norm = gradients.clip_norm_(max_norm)
    _loss(reference).backward()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for parameter, expected_parameter in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected_parameter.grad, rtol=1e-6, atol=1e-9)
    assert (float(norm) > max_norm) == (max_norm == 1e-3)


def test_every_gradient_is_a_view_of_the_buffer_and_zero_clears_them() -> None:
    net = _net()
    gradients = FlatGradients(net.parameters())
    _loss(net).backward()
    assert all(
        parameter.grad.data_ptr() >= gradients.buffer.data_ptr() for parameter in net.parameters()
    )
    assert float(gradients.buffer.abs().sum()) > 0
    total = sum(float(parameter.grad.abs().sum()) for parameter in net.parameters())
    assert float(gradients.buffer.abs().sum()) == pytest.approx(
        total
    )  # backward wrote into the buffer
    gradients.zero()
    assert all(float(parameter.grad.abs().sum()) == 0 for parameter in net.parameters())


def test_gradients_set_to_none_elsewhere_are_attached_again() -> None:
    """optimizer.zero_grad() (set_to_none) drops the views: zero() makes them again, so the norm is
    that of the new backward's gradients, not of a stale buffer."""
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    gradients = FlatGradients(net.parameters())
    optimizer.zero_grad(set_to_none=True)
    gradients.zero()
    _loss(net, 2.0).backward()
    expected = torch.linalg.vector_norm(
        torch.cat([parameter.grad.flatten() for parameter in net.parameters()])
    )
    torch.testing.assert_close(gradients.clip_norm_(1e9), expected)


def test_a_fused_adam_step_on_channels_last_weights_equals_one_on_plain_gradients() -> None:
    """Each view has its parameter's strides: a fused Adam step pairs every gradient element with
    its weight, as with the gradients backward makes itself."""
    torch.manual_seed(1)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).to(
        memory_format=torch.channels_last
    )
    reference = copy.deepcopy(conv)
    images = torch.randn(5, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    gradients = FlatGradients(conv.parameters())
    for net, flat in ((conv, gradients), (reference, None)):
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01, fused=True)
        for _ in range(3):
            if flat is not None:
                flat.zero()
            else:
                optimizer.zero_grad(set_to_none=True)
            net(images).square().sum().backward()
            optimizer.step()
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert conv[0].weight.grad.stride() == conv[0].weight.stride()
    for parameter, expected in zip(conv.parameters(), reference.parameters()):
        torch.testing.assert_close(parameter, expected)


def test_a_non_finite_gradient_gives_a_non_finite_norm() -> None:
    net = _net()
    gradients = FlatGradients(net.parameters())
    gradients.zero()
    _loss(net, float("inf")).backward()
    assert not torch.isfinite(gradients.clip_norm_(0.5))


def test_parameters_of_two_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="several dtypes or devices"):
        FlatGradients(
            [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
        )
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatGradients([])


def _conv_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).to(
        memory_format=torch.channels_last
    )


def _train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 2) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        images = torch.randn(5, 3, 8, 8, generator=generator).contiguous(
            memory_format=torch.channels_last
        )
        optimizer.zero_grad(set_to_none=True)
        net(images).square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("fused", [True, False])
def test_flat_adam_trains_as_torch_adam_over_the_parameters(fused: bool) -> None:
    """Same weights after every step as torch.optim.Adam over the parameters, channels-last
    convolution included; the parameters keep their values, layout and identity, and live in
    the flat tensor."""
    net, reference = _conv_net(), _conv_net()
    before = [parameter.detach().clone() for parameter in net.parameters()]
    optimizer = FlatAdam(net.parameters(), lr=0.01, eps=1e-5, fused=fused)
    for parameter, expected in zip(net.parameters(), before):
        assert torch.equal(parameter, expected)
    flat = optimizer.flat
    start, end = flat.values.data_ptr(), flat.values.data_ptr() + flat.size * 4
    assert all(start <= parameter.data_ptr() < end for parameter in net.parameters())
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01, eps=1e-5, fused=fused)
    for _ in range(3):
        _train(net, optimizer, 1)
        _train(reference, reference_optimizer, 1)
        for parameter, expected in zip(net.parameters(), reference.parameters()):
            torch.testing.assert_close(parameter, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(net[0].weight, before[0])


def test_flat_adam_state_is_torch_adams_and_resumes_either_way() -> None:
    """state_dict() is the per-parameter format of torch.optim.Adam (same moments and step);
    loading it into a plain Adam, or a plain Adam's into a FlatAdam, trains on identically."""
    net, reference = _conv_net(), _conv_net()
    optimizer = FlatAdam(net.parameters(), lr=0.01, eps=1e-5, fused=True)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01, eps=1e-5, fused=True)
    assert optimizer.state_dict()["state"] == {}  # nothing stepped yet: nothing to save
    _train(net, optimizer, 2)
    _train(reference, reference_optimizer, 2)
    state, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert sorted(state["state"]) == sorted(expected["state"]) == list(range(4))
    for index, entry in expected["state"].items():
        assert sorted(state["state"][index]) == sorted(entry)
        for name, value in entry.items():
            torch.testing.assert_close(state["state"][index][name], value, rtol=1e-6, atol=1e-9)
    # a FlatAdam resumed from torch's state, and a torch Adam resumed from FlatAdam's
    resumed_flat, resumed_plain = copy.deepcopy(reference), copy.deepcopy(net)
    flat_optimizer = FlatAdam(resumed_flat.parameters(), lr=0.5, eps=1e-5, fused=True)
    flat_optimizer.load_state_dict(copy.deepcopy(expected))
    plain_optimizer = torch.optim.Adam(resumed_plain.parameters(), lr=0.5, eps=1e-5, fused=True)
    plain_optimizer.load_state_dict(copy.deepcopy(state))
    assert flat_optimizer.param_groups[0]["lr"] == 0.01  # the saved group's settings
    for model, model_optimizer in (
        (resumed_flat, flat_optimizer),
        (resumed_plain, plain_optimizer),
        (reference, reference_optimizer),
    ):
        _train(model, model_optimizer, 2, seed=3)
    for flat_parameter, plain_parameter, expected_parameter in zip(
        resumed_flat.parameters(), resumed_plain.parameters(), reference.parameters()
    ):
        torch.testing.assert_close(flat_parameter, expected_parameter, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(plain_parameter, expected_parameter, rtol=1e-5, atol=1e-7)


def test_flat_adam_refuses_a_state_of_other_parameters() -> None:
    optimizer = FlatAdam(_net().parameters(), lr=0.01)
    other_net = _conv_net()
    other = torch.optim.Adam(other_net.parameters(), lr=0.01)
    _train(other_net, other, 1)
    with pytest.raises(
        ValueError,
        match=r"exp_avg of parameter 0 has shape \(4, 3, 3, 3\), the parameter \(16, 5\)",
    ):
        optimizer.load_state_dict(other.state_dict())
    bigger = torch.optim.Adam(
        nn.Sequential(nn.Linear(5, 16), nn.Linear(16, 3), nn.Linear(3, 1)).parameters()
    )
    with pytest.raises(ValueError, match="expected one group of 4 parameters, got \\[6\\]"):
        optimizer.load_state_dict(bigger.state_dict())


def test_zero_grad_keeps_the_views_so_the_step_trains() -> None:
    """zero_grad(set_to_none=True), as behaviour cloning calls it, zeroes in place: the next
    backward lands in the flat gradient the optimizer reads."""
    net = _net()
    optimizer = FlatAdam(net.parameters(), lr=0.1)
    before = optimizer.flat.values.detach().clone()
    optimizer.zero_grad(set_to_none=True)
    assert all(parameter.grad is not None for parameter in net.parameters())
    _loss(net).backward()
    optimizer.step()
    assert not torch.equal(optimizer.flat.values, before)
    assert torch.equal(
        torch.cat([parameter.detach().flatten() for parameter in net.parameters()]),
        optimizer.flat.values.detach(),
    )


def test_a_parameter_whose_data_is_replaced_is_refused_at_the_next_zero() -> None:
    net = _net()
    optimizer = FlatAdam(net.parameters(), lr=0.1)
    optimizer.zero_grad()
    net[0].weight.data = net[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="was replaced after its optimizer was built"):
        optimizer.zero_grad()


def test_ppo_updater_refuses_a_flat_adam_over_other_parameters() -> None:
    model = build_model((4,), np.float32, 2)
    with pytest.raises(ValueError, match="not over the model's trained parameters"):
        PPOUpdater(model, FlatAdam(_net().parameters(), lr=0.1), device="cpu")
    PPOUpdater(model, FlatAdam(model.parameters(), lr=0.1), device="cpu")  # its own: accepted
