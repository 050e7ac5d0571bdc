"""StarCoder 2 (`Starcoder2ForCausalLM`: 3B / 7B / 15B).

Differences from Llama, as in HF 5.x:
- LayerNorms with a bias (`norm_epsilon`) before attention and MLP, and at the end, in the
  sequential pre-norm block (`layers.residual`);
- `use_bias` on q / k / v / o and the MLP; a non-gated MLP (`c_fc`, `c_proj`:
  `layers.mlp.PlainMLP`, gelu_pytorch_tanh);
- `sliding_window` (when set) on every layer, as HF's mask; tied embeddings by default.
The modules take Llama's names (`up_proj`, `down_proj`); the checkpoint's are renamed at load.
From GGUF: llama.cpp's "starcoder2" (`models.gguf_classic`).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import LayerNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.models.base import RenamedCheckpoint
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of


class Starcoder2DecoderLayer(ResidualBlock):
    """StarCoder 2's sequential block of LayerNorms, biased projections and a plain MLP."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        head_dim, eps, bias = head_dim_of(config), config.norm_epsilon, bool(config.use_bias)
        attn = LlamaAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              head_dim, scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias,
                              o_bias=bias, tp=tp)
        mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias, tp=tp)
        super().__init__(attn, mlp, LayerNorm(config.hidden_size, eps=eps), LayerNorm(config.hidden_size, eps=eps),
                         parallel=False)


class Starcoder2Model(LlamaModel):
    """Llama's stack with StarCoder 2's layers and a final LayerNorm."""

    layer_class = Starcoder2DecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.norm_epsilon)


class Starcoder2ForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    """StarCoder 2 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Starcoder2Model
    tied_by_default = True
    checkpoint_renames = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers
