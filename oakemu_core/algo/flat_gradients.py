"""The gradients of a model's trained parameters as views into one flat buffer.

Zeroing the gradients, their global L2 norm and clipping by it are then one tensor op each,
whatever the number of parameters. ``torch.nn.utils.clip_grad_norm_`` computes the same norm (the
norm of the per-parameter norms) and the same coefficient ``min(1, max_norm / (norm + 1e-6))``
through several foreach ops and Python grouping per call: on a small MLP about 15 % of an SGD step
on the CPU (figures in ``docs/benchmarks.md``). The two norms agree up to float32
rounding, not bit for bit (the sums run in another order).

Backward keeps the views: autograd accumulates into a gradient that is already defined
(``grad += new``) instead of replacing it. Whatever replaces them (``optimizer.zero_grad()``
with ``set_to_none=True``, behaviour cloning's own update, a parameter moved to another memory
layout) is noticed at the next :meth:`FlatGradients.zero` and the views are made again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["FlatGradients"]

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_``."""


class FlatGradients:
    """One flat buffer holding the ``.grad`` of every parameter given.

    Args:
        parameters: the trained parameters (all of one dtype and device, each dense: contiguous or
            channels-last). Each ``.grad`` becomes a view with the parameter's own strides, so a
            fused optimizer pairs every gradient element with its weight.

    Raises:
        ValueError: no parameter, parameters of several dtypes or devices, or one whose memory is
            not dense.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.parameters = list(parameters)
        reason = self._unsupported_reason(self.parameters)
        if reason:
            raise ValueError(f"FlatGradients: {reason}")
        self._attach()

    @staticmethod
    def _unsupported_reason(parameters: list[torch.Tensor]) -> str | None:
        """Why ``parameters`` cannot share one buffer, or None when they can."""
        if not parameters:
            return "expected at least one parameter"
        if len({(parameter.dtype, parameter.device) for parameter in parameters}) > 1:
            return "the parameters have several dtypes or devices"
        for parameter in parameters:
            if not parameter.is_contiguous() and not (
                    parameter.dim() == 4 and parameter.is_contiguous(memory_format=torch.channels_last)):
                return f"a parameter of shape {tuple(parameter.shape)} is not dense (strides {parameter.stride()})"
        return None

    def _attach(self) -> None:
        first = self.parameters[0]
        self.buffer = torch.zeros(sum(parameter.numel() for parameter in self.parameters),
                                  dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for parameter in self.parameters:
            size = parameter.numel()
            view = self.buffer[offset:offset + size].as_strided(parameter.shape, parameter.stride())
            parameter.grad = view
            self.views.append(view)
            offset += size
        self._pointers = [view.data_ptr() for view in self.views]

    def zero(self) -> None:
        """Zero every gradient (one op); views replaced since the last call are made again first."""
        for parameter, view, pointer in zip(self.parameters, self.views, self._pointers):
            if parameter.grad is not view or view.data_ptr() != pointer or view.stride() != parameter.stride():
                self._attach()  # a fresh buffer is already zero
                return
        self.buffer.zero_()

    def clip_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` in place, where ``norm`` is
        the L2 norm over all of them (Pascanu et al. 2013, "On the difficulty of training recurrent
        neural networks"; ``torch.nn.utils.clip_grad_norm_``'s rule). Returns the norm before
        clipping, a 0-dim tensor on the buffer's device (inf or NaN when a gradient is not
        finite; the gradients are then NaN)."""
        norm = torch.linalg.vector_norm(self.buffer)
        self.buffer.mul_(torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))
        return norm
