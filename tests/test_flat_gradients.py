"""FlatGradients: one buffer for every trained parameter's gradient, clipped by its global norm."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from oakemu_core.algo.flat_gradients import FlatGradients


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
    assert all(parameter.grad.data_ptr() >= gradients.buffer.data_ptr() for parameter in net.parameters())
    assert float(gradients.buffer.abs().sum()) > 0
    total = sum(float(parameter.grad.abs().sum()) for parameter in net.parameters())
    assert float(gradients.buffer.abs().sum()) == pytest.approx(total)  # backward wrote into the buffer
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
    expected = torch.linalg.vector_norm(torch.cat([parameter.grad.flatten() for parameter in net.parameters()]))
    torch.testing.assert_close(gradients.clip_norm_(1e9), expected)


def test_a_fused_adam_step_on_channels_last_weights_equals_one_on_plain_gradients() -> None:
    """Each view has its parameter's strides: a fused Adam step pairs every gradient element with
    its weight, as with the gradients backward makes itself."""
    torch.manual_seed(1)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).to(memory_format=torch.channels_last)
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
        FlatGradients([nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatGradients([])
