"""Users' encoders for the tests of ``policy_module`` (imported by path, as a user's package would be)."""

from __future__ import annotations

import math

import torch
from torch import nn


class TwoLayerEncoder(nn.Module):
    """A working encoder: flatten, Linear to 32, ReLU (the documented interface)."""

    def __init__(self, observation_layout: dict) -> None:
        super().__init__()
        shape, _ = observation_layout[""]
        self.out_features = 32
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 32), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WrongWidth(TwoLayerEncoder):
    """Says 16 features and returns 32."""

    def __init__(self, observation_layout: dict) -> None:
        super().__init__(observation_layout)
        self.out_features = 16


class NoWidth(nn.Module):
    """No ``out_features`` attribute."""

    def __init__(self, observation_layout: dict) -> None:
        super().__init__()


class FailsInForward(TwoLayerEncoder):
    """Raises on every forward pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")
