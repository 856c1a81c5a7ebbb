"""Actor inference with ONNX Runtime: the actor-critic's forward pass (observations -> policy-head
output, values) run by an ``onnxruntime`` CPU session instead of torch (``--actor-inference
onnxruntime``, optional extra ``onnx``).

The graph is exported once per actor start; each new policy version swaps the weights into the
exported graph as constants and builds a new session, because ONNX Runtime prepares constant
weights for its kernels (weights fed as graph inputs run slower than torch). Timings:
``docs/benchmarks.md``. Sampling, log-probs and masks stay in torch
(:meth:`oakemu_core.policy.models.ActorCritic.act`).
"""

from __future__ import annotations

import copy
import importlib.util
import io
import warnings
from typing import Any

import numpy as np
import torch

from oakemu_core.errors import ConfigError

__all__ = ["OnnxForward", "PROBE_TOLERANCE", "check_available"]

PROBE_TOLERANCE = 1e-4
"""Relative and absolute tolerance between ONNX Runtime and torch on a probe batch when the graph is
built (float32 rounding of values in the hundreds stays well inside it)."""


def check_available() -> None:
    """Check that ``onnxruntime`` and ``onnx`` can be imported, before an actor joins or ``oakemu
    train`` starts anything.

    Raises:
        oakemu_core.errors.ConfigError: one of them is missing (the message names the extra).
    """
    missing = [name for name in ("onnxruntime", "onnx") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"actor_inference='onnxruntime' needs {' and '.join(missing)}: pip install "
            "'oakemu-rl[onnx]', or use --actor-inference torch"
        )


class OnnxForward:
    """``model.forward`` as an ONNX Runtime CPU session, with the same contract for one
    observation array: ``(B, *shape)`` tensor of the model's observation dtype ->
    ``(head output (B, param_size) float32, values (B,) float32)`` CPU tensors.

    Args:
        model: an :class:`oakemu_core.policy.models.ActorCritic` on the CPU with its current weights.
        threads: ONNX Runtime intra-op threads (1, as torch in an actor).

    Raises:
        ImportError: ``onnxruntime`` or ``onnx`` is not installed (extra ``onnx``).
        ValueError: the model takes a dict of observations (not supported), or the exported graph
            does not reproduce the model's output on a probe batch within
            :data:`PROBE_TOLERANCE`, or a parameter did not become a graph weight.
    """

    def __init__(self, model: Any, *, threads: int = 1) -> None:
        if model.is_dict:
            raise ValueError(
                "actor_inference='onnxruntime': dict observations are not supported; "
                "use actor_inference='torch'"
            )
        import onnx
        import onnxruntime

        self._onnx = onnx
        self._onnxruntime = onnxruntime
        self._options = onnxruntime.SessionOptions()
        self._options.intra_op_num_threads = threads
        self._options.inter_op_num_threads = 1
        probe = model.probe_observations()
        # The exporter merges weights of equal value (zero biases, say) into one graph weight, whose
        # name then stands for several parameters: export a copy whose weights all differ.
        backend = model.__dict__.pop("_inference_backend", None)  # a session cannot be deep-copied
        try:
            distinct = copy.deepcopy(model)
        finally:
            if backend is not None:
                model.__dict__["_inference_backend"] = backend
        with torch.no_grad():
            for tensor in distinct.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(torch.rand_like(tensor) + 0.5)
        exported = io.BytesIO()
        with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer notes
            warnings.simplefilter("ignore")
            torch.onnx.export(
                distinct,
                (probe,),
                exported,
                input_names=["observations"],
                output_names=["head", "values"],
                do_constant_folding=False,
                dynamo=False,
                dynamic_axes={
                    "observations": {0: "batch"},
                    "head": {0: "batch"},
                    "values": {0: "batch"},
                },
            )
        self._graph = onnx.load_from_string(exported.getvalue())
        weight_names = {initializer.name for initializer in self._graph.graph.initializer}
        missing = [name for name, _ in model.named_parameters() if name not in weight_names]
        if (
            missing
        ):  # a renamed weight would never be updated: refuse instead of acting with stale ones
            raise ValueError(
                f"actor_inference='onnxruntime': parameters {missing[:4]} are not graph weights"
            )
        self.load(model)
        model.check_inference_backend(
            self,
            what="actor_inference='onnxruntime' (the exported graph)",
            tolerance=PROBE_TOLERANCE,
        )

    def load(self, model: Any) -> None:
        """Put ``model``'s current weights (parameters and normaliser statistics) into the graph and
        build a new session (call after every weights update of ``model``)."""
        state = model.state_dict()
        for initializer in self._graph.graph.initializer:
            if initializer.name in state:
                array = state[initializer.name].detach().to("cpu").numpy()
                initializer.CopyFrom(
                    self._onnx.numpy_helper.from_array(
                        np.ascontiguousarray(array), initializer.name
                    )
                )
        self._session = self._onnxruntime.InferenceSession(
            self._graph.SerializeToString(), self._options, providers=["CPUExecutionProvider"]
        )

    def __call__(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head, values = self._session.run(None, {"observations": observations.numpy()})
        return torch.from_numpy(head), torch.from_numpy(values)
