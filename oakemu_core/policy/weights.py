"""A model's weights as numpy arrays and back, and an optimizer state loaded in its parameters' layout.

The actors receive the learner's weights as named float32 arrays (:func:`weights_to_arrays`,
:func:`load_weight_arrays`); a checkpoint's optimizer state is loaded by :func:`load_optimizer_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["load_model_state", "load_optimizer_state", "load_weight_arrays", "weights_to_arrays"]


def load_model_state(model: nn.Module, state: Mapping[str, Any], *, source: str) -> None:
    """``model.load_state_dict(state)``, where ``state`` comes from a checkpoint or folder ``source``.

    Raises:
        CheckpointError: the weights do not fit the model its settings describe (a checkpoint whose
            settings were changed, or written by another version): one line naming ``source`` and the
            first difference; nothing was loaded.
    """
    from oakemu_core.errors import CheckpointError

    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        detail = " ".join(str(error).split())
        raise CheckpointError(
            f"{source}: its weights do not fit the network its settings describe "
            f"({detail[:300]}{'...' if len(detail) > 300 else ''})"
        ) from None


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, then each per-parameter state tensor (Adam's moments)
    re-laid in its parameter's memory layout, values unchanged.

    A checkpoint written by a learner whose convolutions were channels-last
    (:meth:`ActorCritic.use_channels_last`) holds moments in that layout, and one written without
    holds them contiguous; ``load_state_dict`` keeps the saved layout. Fused Adam pairs a parameter
    and its moments element by element in storage order, so mismatched layouts would update the
    wrong elements.

    Raises:
        ValueError: ``state`` belongs to an optimizer with other parameter groups (raised by
            ``load_state_dict``, before anything is loaded).
    """
    optimizer.load_state_dict(state)
    for parameter, parameter_state in optimizer.state.items():
        for name, value in parameter_state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == parameter.shape
                and value.stride() != parameter.stride()
            ):
                parameter_state[name] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)


def weights_to_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """Snapshot of every entry of ``model.state_dict()`` (parameters and normaliser statistics) as
    CPU, C-contiguous float32 numpy arrays.

    The arrays are copies: later optimizer steps do not change them. Raises TypeError if an entry
    is not a floating-point tensor.
    """
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise TypeError(f"weights_to_arrays: {name} has non-float dtype {tensor.dtype}")
        # A fresh contiguous copy; not np.ascontiguousarray, which turns 0-d entries into (1,).
        arrays[name] = tensor.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()
    return arrays


def load_weight_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy named float32 arrays (as from :func:`weights_to_arrays`) into ``model``'s state.

    Everything is validated before anything is written, so a rejected set of weights leaves the
    model unchanged.

    Raises:
        ValueError: names missing or unexpected, or an array with the wrong shape or a dtype other
            than float32; the message names the entry, the expected and the received value.
    """
    state = model.state_dict()
    missing = sorted(set(state) - set(arrays))
    extra = sorted(set(arrays) - set(state))
    if missing or extra:
        raise ValueError(f"weights: missing names {missing}, unexpected names {extra}")
    for name, tensor in state.items():
        array = arrays[name]
        if not isinstance(array, np.ndarray):
            raise ValueError(
                f"weights[{name!r}]: expected a numpy array, got {type(array).__name__}"
            )
        if array.dtype != np.float32:
            raise ValueError(f"weights[{name!r}]: expected dtype float32, got {array.dtype}")
        if tuple(array.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weights[{name!r}]: expected shape {tuple(tensor.shape)}, got {tuple(array.shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(torch.from_numpy(np.array(arrays[name], dtype=np.float32, copy=True)))
