"""A model's trained parameters and their gradients as views into flat buffers.

:class:`FlatGradients` gives every trained parameter a ``.grad`` that is a view of one flat
buffer. Zeroing the gradients, their global L2 norm and clipping by it are then one tensor op each,
whatever the number of parameters. ``torch.nn.utils.clip_grad_norm_`` computes the same norm (the
norm of the per-parameter norms) and the same coefficient ``min(1, max_norm / (norm + 1e-6))``
through several foreach ops and Python grouping per call: on a small MLP about 15 % of an SGD step
on the CPU (figures in ``docs/benchmarks.md``). The two norms agree up to float32
rounding, not bit for bit (the sums run in another order).

Backward keeps the views: autograd accumulates into a gradient that is already defined
(``grad += new``) instead of replacing it. Whatever replaces them (``optimizer.zero_grad()``
with ``set_to_none=True``, behaviour cloning's own update, a parameter moved to another memory
layout) is noticed at the next :meth:`FlatGradients.zero` and the views are made again.

:class:`FlatParameters` puts the parameters' values in one flat tensor too, and :class:`FlatAdam`
is ``torch.optim.Adam`` stepping that one tensor: the same update element by element, with the
optimizer's per-step work done once instead of once per parameter (fused Adam over the 12 tensors
of two 64-64 MLPs: 80 us a step on the CPU, over one flat tensor 36 us).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FlatAdam", "FlatGradients", "FlatParameters"]

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
                parameter.dim() == 4 and parameter.is_contiguous(memory_format=torch.channels_last)
            ):
                return f"a parameter of shape {tuple(parameter.shape)} is not dense (strides {parameter.stride()})"
        return None

    def _attach(self) -> None:
        first = self.parameters[0]
        self.buffer = torch.zeros(
            sum(parameter.numel() for parameter in self.parameters),
            dtype=first.dtype,
            device=first.device,
        )
        self.views: list[torch.Tensor] = []
        offset = 0
        for parameter in self.parameters:
            size = parameter.numel()
            view = self.buffer[offset : offset + size].as_strided(
                parameter.shape, parameter.stride()
            )
            parameter.grad = view
            self.views.append(view)
            offset += size
        self._pointers = [view.data_ptr() for view in self.views]

    def zero(self) -> None:
        """Zero every gradient (one op); views replaced since the last call are made again first."""
        for parameter, view, pointer in zip(self.parameters, self.views, self._pointers):
            if (
                parameter.grad is not view
                or view.data_ptr() != pointer
                or view.stride() != parameter.stride()
            ):
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


class FlatParameters(FlatGradients):
    """One flat tensor holding the values of every parameter given, and one their gradients.

    Each parameter's data becomes a view of :attr:`values` with its own strides (its values are
    kept), and its ``.grad`` a view of the gradient buffer (:class:`FlatGradients`), which is also
    ``values.grad``: an optimizer over ``[values]`` updates every parameter in one step.

    Args:
        parameters: the trained parameters (as :class:`FlatGradients`).

    Raises:
        ValueError: as :class:`FlatGradients`.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        parameters = list(parameters)
        reason = self._unsupported_reason(parameters)
        if reason:
            raise ValueError(f"FlatParameters: {reason}")
        first = parameters[0]
        self.size = sum(parameter.numel() for parameter in parameters)
        self.values = torch.nn.Parameter(
            torch.empty(self.size, dtype=first.dtype, device=first.device)
        )
        """The ``(size,)`` tensor an optimizer steps; its ``.grad`` is the gradient buffer."""
        self.parameters = parameters
        self._offsets = [0]
        for parameter in parameters[:-1]:
            self._offsets.append(self._offsets[-1] + parameter.numel())
        with torch.no_grad():
            for index, parameter in enumerate(parameters):
                view = self.segment(self.values.data, index)
                view.copy_(parameter)
                parameter.data = view
        self._value_pointers = [parameter.data_ptr() for parameter in parameters]
        super().__init__(parameters)

    def segment(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s elements of a ``(size,)`` tensor laid out as :attr:`values`, as a
        view with the parameter's shape and strides."""
        offset, parameter = self._offsets[index], self.parameters[index]
        return flat[offset : offset + parameter.numel()].as_strided(
            parameter.shape, parameter.stride()
        )

    def _attach(self) -> None:
        super()._attach()
        self.values.grad = self.buffer

    def zero(self) -> None:
        """Zero every gradient (one op), after checking the parameters still live in :attr:`values`.

        Raises:
            RuntimeError: a parameter's data was replaced (moved to another device or layout, or
                loaded with ``assign=True``) since: an optimizer over :attr:`values` would no longer
                train it.
        """
        for parameter, pointer in zip(self.parameters, self._value_pointers):
            if parameter.data_ptr() != pointer:
                raise RuntimeError(
                    f"FlatParameters: the data of a parameter of shape {tuple(parameter.shape)} "
                    "was replaced after its optimizer was built; build the optimizer last"
                )
        if self.values.grad is not self.buffer:
            self._attach()
            return
        super().zero()

    def per_parameter_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer ``state_dict`` over ``[values]`` as the one an optimizer over the parameters
        would give: state entries ``0 .. n-1`` (each ``(size,)`` tensor cut into the parameters'
        views, each 0-d tensor such as Adam's ``step`` copied), one group listing them."""

        def cut(value: Any, index: int) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.dim() == 1 and value.numel() == self.size:
                return self.segment(value, index)
            return value.clone()

        (group,) = state["param_groups"]
        entries = state["state"].get(group["params"][0])
        per_parameter: dict[int, dict[str, Any]] = {}
        if entries is not None:
            for index in range(len(self.parameters)):
                per_parameter[index] = {name: cut(value, index) for name, value in entries.items()}
        return {
            "state": per_parameter,
            "param_groups": [{**group, "params": list(range(len(self.parameters)))}],
        }

    def flat_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Inverse of :meth:`per_parameter_state`: a per-parameter optimizer ``state_dict`` (a
        checkpoint's) as the one of an optimizer over ``[values]``. Tensors shaped as their
        parameter are laid into ``(size,)`` tensors (zeros where a parameter has no state yet);
        a 0-d tensor (Adam's ``step``) becomes the largest of the parameters'.

        Raises:
            ValueError: ``state`` is not of one group of this many parameters, or a state tensor is
                not shaped as its parameter.
        """
        groups = state["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.parameters):
            raise ValueError(
                f"optimizer state: expected one group of {len(self.parameters)} parameters, "
                f"got {[len(group['params']) for group in groups]}"
            )
        (group,) = groups
        entries = [state["state"].get(key) for key in group["params"]]
        flat: dict[str, Any] = {}
        for index, entry in enumerate(entries):
            for name, value in (entry or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape != self.parameters[index].shape:
                        raise ValueError(
                            f"optimizer state: {name} of parameter {index} has shape {tuple(value.shape)}, "
                            f"the parameter {tuple(self.parameters[index].shape)}"
                        )
                    if name not in flat:
                        flat[name] = torch.zeros(
                            self.size, dtype=value.dtype, device=self.values.device
                        )
                    self.segment(flat[name], index).copy_(value)
                elif isinstance(value, torch.Tensor):
                    flat[name] = (
                        value.clone() if name not in flat else torch.maximum(flat[name], value)
                    )
                else:
                    flat.setdefault(name, value)
        return {"state": {0: flat} if flat else {}, "param_groups": [{**group, "params": [0]}]}


class FlatAdam(torch.optim.Adam):
    """``torch.optim.Adam`` over the :class:`FlatParameters` of ``parameters``: one tensor to step.

    Its checkpoints are those of ``torch.optim.Adam(parameters)``: :meth:`state_dict` gives and
    :meth:`load_state_dict` takes the per-parameter format. :meth:`zero_grad` zeroes in place
    (the parameters' gradients stay views of :attr:`flat`'s buffer).

    Every parameter takes every step. Where torch's Adam skips a parameter whose gradient is None
    (outside the loss), this one steps it with a zero gradient: its moments decay and the step count
    it shares with the others rises, which changes its bias correction later. Equal when every
    step's loss depends on every parameter (PPO's); for steps that train part of the model
    (behaviour-cloning pre-training trains no critic) use ``torch.optim.Adam``.

    Args:
        parameters: the trained parameters, in their final device and memory layout.
        *args, **kwargs: ``torch.optim.Adam``'s settings (``lr``, ``betas``, ``eps``, ``fused``, ...).

    Raises:
        ValueError: as :class:`FlatParameters`, or an Adam setting's own.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        self.flat = FlatParameters(parameters)
        super().__init__([self.flat.values], *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient in place (``set_to_none`` is not followed: the gradients are views)."""
        self.flat.zero()

    def state_dict(self) -> dict[str, Any]:
        """Adam's state in the per-parameter format (:meth:`FlatParameters.per_parameter_state`)."""
        return self.flat.per_parameter_state(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load Adam's state of the per-parameter format (:meth:`FlatParameters.flat_state`)."""
        super().load_state_dict(self.flat.flat_state(state_dict))
