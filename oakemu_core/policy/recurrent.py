"""The recurrent core of an actor-critic: an LSTM or a GRU carrying one state per env.

A state is one float32 row per env, ``(B, S)``: for an LSTM the hidden and the cell state side by side
(``S = 2 H``: ``[h, c]``), for a GRU the hidden state (``S = H``); an episode starts from zeros. The
actors step the core one row at a time (:meth:`RecurrentCore.sequence` with ``L = 1``); the learner
recomputes whole sequences from the state stored at their first row, zeroing the state before a row
whose previous row ended an episode (``resets``), as CleanRL's ``ppo_atari_lstm.py`` does.

Initialisation as CleanRL's: orthogonal weights (gain 1), zero biases.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RecurrentCore"]


class RecurrentCore(nn.Module):
    """An LSTM or GRU layer of ``hidden`` units over ``in_features`` features.

    Args:
        kind: ``"lstm"`` or ``"gru"``.
        in_features: features per row from the encoders.
        hidden: units (the features the torsos read).

    Raises:
        ValueError: another kind.
    """

    def __init__(self, kind: str, in_features: int, hidden: int) -> None:
        super().__init__()
        if kind not in ("lstm", "gru"):
            raise ValueError(f"recurrent: expected 'lstm' or 'gru', received {kind!r}")
        self.kind = kind
        self.hidden = hidden
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(in_features, hidden)
        for name, parameter in self.rnn.named_parameters():
            if "bias" in name:
                nn.init.constant_(parameter, 0.0)
            else:
                nn.init.orthogonal_(parameter, 1.0)

    @property
    def state_size(self) -> int:
        """Floats per env in a state: ``2 * hidden`` (LSTM) or ``hidden`` (GRU)."""
        return 2 * self.hidden if self.kind == "lstm" else self.hidden

    def _unpack(self, state: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "lstm":
            h, c = state.split(self.hidden, dim=-1)
            return h.unsqueeze(0).contiguous(), c.unsqueeze(0).contiguous()
        return state.unsqueeze(0).contiguous()

    def _pack(self, state: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.kind == "lstm":
            h, c = state
            return torch.cat([h[0], c[0]], dim=-1)
        return state[0]  # type: ignore[index]

    def sequence(
        self, features: torch.Tensor, state: torch.Tensor, resets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``L`` rows of ``B`` sequences through the core.

        Args:
            features: ``(L * B, F)`` float, time-major (row ``t * B + b`` is step ``t`` of sequence ``b``).
            state: ``(B, S)`` float32, the state before step 0 of each sequence.
            resets: ``(L, B)`` bool, True where the state is zeroed before that step (the previous step
                ended an episode); None: no reset.

        Returns:
            ``(outputs (L * B, hidden), final state (B, S))``. Between reset steps the layer runs the
            rows as one call (cuDNN / oneDNN), so a sequence without resets is one call.

        Raises:
            ValueError: shapes that do not fit.
        """
        batch = state.shape[0]
        if state.dim() != 2 or state.shape[1] != self.state_size:
            raise ValueError(
                f"state: expected shape (B, {self.state_size}), got {tuple(state.shape)}"
            )
        if features.dim() != 2 or batch == 0 or features.shape[0] % batch:
            raise ValueError(
                f"features: expected (L * {batch}, F) rows, got {tuple(features.shape)}"
            )
        steps = features.shape[0] // batch
        x = features.reshape(steps, batch, -1)
        if resets is not None and tuple(resets.shape) != (steps, batch):
            raise ValueError(
                f"resets: expected shape ({steps}, {batch}), got {tuple(resets.shape)}"
            )
        state = state.to(x.dtype)
        starts = [0]
        if resets is not None and steps:
            starts = [0, *(int(t) for t in torch.nonzero(resets[1:].any(dim=1)).flatten() + 1)]
        outputs = []
        for index, start in enumerate(starts):
            end = starts[index + 1] if index + 1 < len(starts) else steps
            if resets is not None:
                state = state * (~resets[start]).unsqueeze(1).to(state.dtype)
            out, packed = self.rnn(x[start:end], self._unpack(state))
            state = self._pack(packed)
            outputs.append(out)
        return torch.cat(outputs).reshape(steps * batch, self.hidden), state
