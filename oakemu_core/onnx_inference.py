"""Actor inference with ONNX Runtime: the actor-critic's forward pass (observations -> policy-head
output, values) run by an ``onnxruntime`` CPU session instead of torch (issue 11, actors close to
the emulator; ``--actor-inference onnxruntime``, optional extra ``onnx``).

Measured on one core (Nature CNN, a batch of 8 Breakout observations): torch 2.8-3.3 ms per forward,
ONNX Runtime 1.6-1.8 ms; the Breakout actor loop rose from 0.40-0.41 to 0.52-0.56 of the raw env
rate. The graph is exported once per actor start (about 1 s); each new policy version only swaps
the weights into the exported graph and builds a new session (20-40 ms), because ONNX Runtime
prepares constant weights for its kernels (feeding the weights as graph inputs instead ran at
4.5 ms, slower than torch). Sampling, log-probs and masks stay in torch
(:meth:`oakemu_core.models.ActorCritic.act`).
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["OnnxForward", "MAX_PROBE_DEVIATION"]

MAX_PROBE_DEVIATION = 1e-4
"""Largest |ONNX Runtime - torch| on a probe batch accepted when the graph is built."""


class OnnxForward:
    """``model.forward`` as an ONNX Runtime CPU session, with the same contract for one
    observation array: ``(B, *shape)`` tensor of the model's observation dtype ->
    ``(head output (B, param_size) float32, values (B,) float32)`` CPU tensors.

    Args:
        model: an :class:`oakemu_core.models.ActorCritic` on the CPU with its current weights.
        threads: ONNX Runtime intra-op threads (1, as torch in an actor).

    Raises:
        ImportError: ``onnxruntime`` or ``onnx`` is not installed (extra ``onnx``).
        ValueError: the model takes a dict of observations (not supported), or the exported graph
            does not reproduce the model's output on a probe batch within
            :data:`MAX_PROBE_DEVIATION`, or a parameter did not become a graph weight.
    """

    def __init__(self, model: Any, *, threads: int = 1) -> None:
        import onnx
        import onnxruntime

        if model.is_dict:
            raise ValueError("actor_inference='onnxruntime': dict observations are not supported; "
                             "use actor_inference='torch'")
        self._onnx = onnx
        self._onnxruntime = onnxruntime
        self._options = onnxruntime.SessionOptions()
        self._options.intra_op_num_threads = threads
        self._options.inter_op_num_threads = 1
        shape, _ = model.observation_layout[""]
        probe = self._probe(model, shape)
        # The exporter merges weights of equal value (zero biases, say) into one graph weight, whose
        # name then stands for several parameters: export a copy whose weights all differ.
        distinct = copy.deepcopy(model)
        with torch.no_grad():
            for tensor in distinct.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(torch.rand_like(tensor) + 0.5)
        exported = io.BytesIO()
        with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer notes
            warnings.simplefilter("ignore")
            torch.onnx.export(distinct, (probe,), exported, input_names=["observations"],
                              output_names=["head", "values"], do_constant_folding=False, dynamo=False,
                              dynamic_axes={"observations": {0: "batch"}, "head": {0: "batch"}, "values": {0: "batch"}})
        self._graph = onnx.load_from_string(exported.getvalue())
        weight_names = {initializer.name for initializer in self._graph.graph.initializer}
        missing = [name for name, _ in model.named_parameters() if name not in weight_names]
        if missing:  # a renamed weight would never be updated: refuse instead of acting with stale ones
            raise ValueError(f"actor_inference='onnxruntime': parameters {missing[:4]} are not graph weights")
        self.load(model)
        with torch.no_grad():
            expected = model(probe)
        got = self(probe)
        deviation = max(float((a - b).abs().max()) for a, b in zip(got, expected))
        if not deviation <= MAX_PROBE_DEVIATION:
            raise ValueError(f"actor_inference='onnxruntime': the exported graph differs from the model by "
                             f"{deviation:.3g} on a probe batch (limit {MAX_PROBE_DEVIATION:g})")

    @staticmethod
    def _probe(model: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """A batch of 2 deterministic observations of the model's dtype."""
        dtype = model._torch_dtypes[""]
        generator = torch.Generator().manual_seed(0)
        if dtype.is_floating_point:
            return torch.randn((2, *shape), generator=generator).to(dtype)
        return torch.randint(0, 2 if dtype == torch.bool else 100, (2, *shape), generator=generator).to(dtype)

    def load(self, model: Any) -> None:
        """Put ``model``'s current weights (parameters and normaliser statistics) into the graph and
        build a new session (call after every weights update of ``model``)."""
        state = model.state_dict()
        for initializer in self._graph.graph.initializer:
            if initializer.name in state:
                array = state[initializer.name].detach().to("cpu").numpy()
                initializer.CopyFrom(self._onnx.numpy_helper.from_array(np.ascontiguousarray(array), initializer.name))
        self._session = self._onnxruntime.InferenceSession(
            self._graph.SerializeToString(), self._options, providers=["CPUExecutionProvider"])

    def __call__(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head, values = self._session.run(None, {"observations": observations.numpy()})
        return torch.from_numpy(head), torch.from_numpy(values)
