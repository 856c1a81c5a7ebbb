"""Running observation statistics kept in a model: :class:`RunningNormalizer`."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RunningNormalizer"]


class RunningNormalizer(nn.Module):
    """Running mean / variance of an observation key; ``forward`` returns
    ``clip((x - mean) / sqrt(var + eps), -clip, clip)`` (SB3 ``VecNormalize``, clip 10).

    Statistics are buffers (``mean``, ``var``, ``count``), merged with each batch by the parallel
    algorithm of Chan et al. 1979 (as SB3's ``RunningMeanStd``).
    """

    def __init__(self, shape: tuple[int, ...], *, clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.tensor(1e-4))
        self.clip = clip
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp((x - self.mean) / torch.sqrt(self.var + self.eps), -self.clip, self.clip)

    @torch.no_grad()
    def update(self, batch: torch.Tensor) -> None:
        """Merge a ``(B, *shape)`` batch into the statistics."""
        batch = batch.to(self.mean.device, torch.float64)
        batch_mean, batch_var, batch_count = (
            batch.mean(0),
            batch.var(0, unbiased=False),
            batch.shape[0],
        )
        mean, var, count = self.mean.double(), self.var.double(), self.count.double()
        delta = batch_mean - mean
        total = count + batch_count
        new_mean = mean + delta * batch_count / total
        m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
        self.mean.copy_(new_mean.float())
        self.var.copy_((m2 / total).float())
        self.count.copy_(total.float())
