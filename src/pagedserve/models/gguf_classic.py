"""GGUF files of the older dense families, as llama.cpp's convert_hf_to_gguf.py writes them:
Phi-2 ("phi2"), StableLM ("stablelm"), StarCoder 2 ("starcoder2"), GPT-NeoX ("gptneox").
`models.gguf_config` reads their common keys (sizes, LayerNorm epsilon,
RoPE base) and calls `config_hook` for the rest; `models.gguf_loader` maps their tensors by
`BLOCK_NAMES` onto our module names (the families' models take Llama's names), never permuting
Q/K rows (their converters do not).

phi2 (conversion/phi.py's Phi2Model): `feed_forward_length` is always 4 x hidden (the MLP's
width comes from `ffn_up`'s rows), `rope.dimension_count` the rotated part of each head, no RoPE
base (llama.cpp's default, 10000), q/k/v as `attn_q/k/v` or, from the original checkpoints, one
`attn_qkv`; the LM head's bias as `output.bias`.

stablelm (conversion/stablelm.py): `use_parallel_residual` (then no `ffn_norm`), the rotated part
as `rope.dimension_count`, q/k/v biases and the per-head q/k norms (stacked `[heads, head_dim]`
as `attn_q_norm` / `attn_k_norm`) when the file has them.

starcoder2 (conversion/starcoder.py: the base class's keys): biases when the file has them. NOTE:
no sliding window -- the converter writes none and llama.cpp attends to the whole context; so
do we (HF's StarCoder 2 configs say 4096: the two agree on sequences up to that).

gptneox (conversion/gptneox.py): `use_parallel_residual`, the rotated part as
`rope.dimension_count`, one KV head per head; `attn_qkv` regrouped by the converter into `[q; k;
v]` rows (HF's are per head), split by rows at load.
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("phi2", "stablelm", "starcoder2", "gptneox")
HF_MODEL_TYPE = {"phi2": "phi", "stablelm": "stablelm", "starcoder2": "starcoder2", "gptneox": "gpt_neox"}
HF_ARCHITECTURE = {"phi": "PhiForCausalLM", "stablelm": "StableLmForCausalLM",
                   "starcoder2": "Starcoder2ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}
# LayerNorm families: `attention.layer_norm_epsilon`, read as `layer_norm_eps`
LAYER_NORM_ARCHS = ("phi2", "stablelm", "starcoder2", "gptneox")
# their `rope.dimension_count` is the rotated part of a head, not the head
PARTIAL_ROPE_ARCHS = ("phi2", "stablelm", "gptneox")

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GATED = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PLAIN = {"ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_POST_NORM = {"ffn_norm": "post_attention_layernorm"}
BLOCK_NAMES = {
    "phi2": {**_ATTN, **_PLAIN, "attn_qkv": "self_attn.qkv_proj"},
    "stablelm": {**_ATTN, **_QK_NORMS, **_GATED, **_POST_NORM},
    "starcoder2": {**_ATTN, **_PLAIN, **_POST_NORM},
    "gptneox": {**_ATTN, **_PLAIN, **_POST_NORM, "attn_qkv": "self_attn.qkv_proj"},
}


def _rows(header: GGUFHeader, name: str) -> int | None:
    info = header.tensor(name)
    return None if info is None else int(info.shape[0])


def _rotary(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """`partial_rotary_factor` from `rope.dimension_count` (None: the whole head)."""
    dims = header.arch_key("rope.dimension_count")
    cfg["partial_rotary_factor"] = int(dims) / cfg["head_dim"] if dims else 1.0


def _phi2(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    _rotary(header, cfg)
    width = _rows(header, "blk.0.ffn_up.weight")
    if width is not None:
        cfg["intermediate_size"] = width
    cfg["qk_layernorm"] = False  # (llama.cpp's phi2 has no q/k norm tensors)


def _has(header: GGUFHeader, suffix: str) -> bool:
    return any(t.name.endswith(suffix) for t in header.tensors)


def _stablelm(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    _rotary(header, cfg)
    cfg["use_parallel_residual"] = bool(header.arch_key("use_parallel_residual", True))
    cfg["use_qkv_bias"] = _has(header, ".attn_q.bias")
    cfg["qk_layernorm"] = _has(header, ".attn_q_norm.weight")


def _starcoder2(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["norm_epsilon"] = cfg.pop("layer_norm_eps")
    cfg["use_bias"] = _has(header, ".attn_q.bias")
    cfg["sliding_window"] = None


def _gptneox(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    dims = header.arch_key("rope.dimension_count")
    cfg["rotary_pct"] = int(dims) / cfg["head_dim"] if dims else 1.0  # (GPTNeoXConfig's name)
    cfg["use_parallel_residual"] = bool(header.arch_key("use_parallel_residual", True))
    cfg["attention_bias"] = _has(header, ".attn_qkv.bias")
    cfg.pop("num_key_value_heads", None)


_HOOKS = {"phi2": _phi2, "stablelm": _stablelm, "starcoder2": _starcoder2, "gptneox": _gptneox}


def config_hook(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """The architecture's own config fields, into `cfg` in place."""
    _HOOKS[header.architecture](header, cfg)
