"""A non-gated MLP, `down(act(up(x)))`: the feed-forward of Phi-1.5 / Phi-2, StarCoder 2,
GPT-NeoX (Pythia), Nemotron, Arcee and Apertus (the gated one is `models.llama.LlamaMLP`)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class PlainMLP(nn.Module):
    """`down_proj(act(up_proj(x)))`, biases optional (up column-parallel, down row-parallel: its
    bias added once, after the ranks' sum). `act`: an HF activation name, or a module (Apertus's
    xIELU, whose parameters the checkpoint holds under `mlp.act_fn.`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str | nn.Module, bias: bool = False,
                 *, tp: TPContext = SINGLE):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp)
        self.act_fn = get_activation(act) if isinstance(act, str) else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act_fn(self.up_proj(x)))  # ([T, I / N] between)
