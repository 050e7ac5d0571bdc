"""BitNet b1.58 (`BitNetForCausalLM`: Microsoft's bitnet-b1.58-2B-4T).

Llama's decoder, as in HF 5.x, with
- a sub-norm before each output projection: `attn_sub_norm` (RMSNorm over the heads' output,
  before `o_proj`) and `ffn_sub_norm` (RMSNorm over `act(gate(x)) * up(x)`, before `down_proj`);
- a gated MLP of `hidden_act` (relu^2 in the released model);
- with `quantization_config.quant_method: "bitnet"` (the released checkpoints: `linear_class`
  "bitlinear", offline), every decoder projection a ternary `layers.bitlinear.BitLinear`: weights
  {-1, 0, 1} packed 4 to a byte with one `weight_scale`, x quantized per token to 8 bits as HF
  does; the embedding and the LM head stay in the model dtype. Without a quantization config
  the projections are plain linear layers (HF's unquantized BitNet).
Other BitNet quantization settings (`autobitlinear`, online quantization, `use_rms_norm`,
`modules_to_not_convert`) are refused by name; so is tensor parallelism with ternary layers.
From GGUF: llama.cpp's "bitnet" (`models.gguf_classic`), run as llama.cpp runs it: the
converter's weights (ternary times their mean |w|) in plain linear layers, a SiLU-gated MLP,
no activation quantization. The original checkpoints' sub-norm names (`inner_attn_ln`,
`ffn_layernorm`, which the converter maps) load too.
NOTE: the layers run their modules (the fused decode kernel has no sub-norms).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.bitlinear import BitLinear, unpack_ternary
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.layers.weights import read_full
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bitnet_quantized(config: Any) -> bool:
    """Whether `config`'s projections are ternary (`quant_method: "bitnet"`, HF's `BitLinear`);
    ValueError naming a BitNet setting we do not serve."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method != "bitnet":
        raise ValueError(f"BitNet with quantization_config.quant_method {method!r} is not supported")
    if qc.get("linear_class", "bitlinear") != "bitlinear":
        raise ValueError(f"BitNet quantization_config.linear_class {qc.get('linear_class')!r} is not supported "
                         "(only 'bitlinear': packed ternary weights)")
    if qc.get("quantization_mode", "offline") != "offline":
        raise ValueError(f"BitNet quantization_config.quantization_mode {qc.get('quantization_mode')!r} "
                         "is not supported (only 'offline')")
    if qc.get("use_rms_norm"):
        raise ValueError("BitNet quantization_config.use_rms_norm is not supported")
    if qc.get("modules_to_not_convert"):
        raise ValueError("BitNet quantization_config.modules_to_not_convert is not supported")
    return True


def _packed(source: Any) -> bool:
    """Whether a checkpoint tensor (or lazy safetensors slice) is a packed uint8 projection."""
    if isinstance(source, torch.Tensor):
        return source.dtype == torch.uint8
    get_dtype = getattr(source, "get_dtype", None)  # (a lazy slice; GGUF blocks have none)
    return get_dtype is not None and get_dtype() == "U8"


class BitNetDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with the sub-norms before `o_proj` / `down_proj` and, quantized,
    ternary projections."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp)
        attn, mlp, eps = self.self_attn, self.mlp, config.rms_norm_eps
        self.self_attn.attn_sub_norm = RMSNorm(attn.o_proj.in_features, eps)
        self.mlp.ffn_sub_norm = RMSNorm(mlp.down_proj.in_features, eps)
        if bitnet_quantized(config):
            if tp.is_parallel:
                raise ValueError("BitNet's ternary layers are not supported with tensor parallelism")
            for module in (attn, mlp):
                module.fusable_linears = tuple  # (no fused q/k/v or gate/up buffer: ternary layers)
                for name in _PROJECTIONS:
                    old = getattr(module, name, None)
                    if old is not None:
                        setattr(module, name, BitLinear(old.in_features, old.out_features, old.bias is not None))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.unfused(x, rope, kv_cache, meta)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        h = self.input_layernorm(x)  # [T, H]
        t = h.shape[0]
        q = attn.q_proj(h).view(t, attn.num_heads, attn.head_dim)  # [T, Hq, D]
        k = attn.k_proj(h).view(t, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
        v = attn.v_proj(h).view(t, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
        q, k = norm_and_rotate(q, k, *rope, None, None, attn.ops, False)
        o = attn.attn(q, k, v, kv_cache, meta)  # [T, Hq * D]
        x = x + attn.o_proj(attn.attn_sub_norm(o.reshape(t, -1)))  # [T, H]
        h = self.post_attention_layernorm(x)  # [T, H]
        gated = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)  # [T, I]
        return x + mlp.down_proj(mlp.ffn_sub_norm(gated))


class BitNetModel(LlamaModel):
    """Llama's stack of BitNet layers."""

    layer_class = BitNetDecoderLayer


class BitNetForCausalLM(LlamaForCausalLM):
    """BitNet b1.58 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = BitNetModel

    # the original checkpoints' sub-norm names (1bitLLM's, which llama.cpp's converter maps)
    _SUB_NORM_NAMES = ((".self_attn.inner_attn_ln.", ".self_attn.attn_sub_norm."),
                       (".mlp.ffn_layernorm.", ".mlp.ffn_sub_norm."))

    def _rename(self, name: str) -> str | tuple | None:
        for old, new in self._SUB_NORM_NAMES:
            name = name.replace(old, new)
        return super()._rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's packed uint8 projections unpacked to their ternary values."""
        def unpacked():
            for name, source in weights:
                if name.endswith(".weight") and name.rsplit(".", 2)[-2] in _PROJECTIONS and _packed(source):
                    source = unpack_ternary(read_full(source), torch.float32)  # [N / 4, K] -> [N, K]
                yield name, source

        super().load_weights(unpacked())
