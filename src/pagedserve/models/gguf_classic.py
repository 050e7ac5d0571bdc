"""GGUF files of the older dense families, as llama.cpp's convert_hf_to_gguf.py writes them:
Phi-2 ("phi2"), StableLM ("stablelm"), StarCoder 2 ("starcoder2"), GPT-NeoX ("gptneox"), OLMo
("olmo"), Arcee ("arcee"), Nemotron ("nemotron"), Apertus ("apertus"). `models.gguf_config` reads
their common keys (sizes, norm epsilon, RoPE base and scaling) and calls `config_hook` for the
rest; `models.gguf_loader` maps their tensors by `BLOCK_NAMES` onto our module names (the
families' models take Llama's names), un-permutes the Q/K rows of `PERMUTED_QK` (OLMo's and
Arcee's converters are Llama's), takes 1 off Nemotron's norm weights (`ONE_PLUS_NORMS`) and adds
what the file keeps as metadata (`extra_weights`: Apertus's xIELU scalars).

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

olmo (conversion/olmo.py): no norm tensors (OLMo's have no weights), `attention.clamp_kqv`, Q/K
weights permuted as Llama's. Its converter leaves q/k *biases* unpermuted: a file with them is
refused (HF's OLMo configs have none).

arcee (conversion/llama.py's ArceeModel): Llama's file (Q/K weights and biases permuted) with a
non-gated `ffn_up` / `ffn_down`.

nemotron (conversion/nemotron.py): layernorm1p's weights stored as 1 + w, the rotated part as
`rope.dimension_count`, `attention.layer_norm_epsilon`.

apertus (conversion/llama.py's ApertusModel, Q/K not permuted): per-head q/k norms, Llama 3's
RoPE as a `rope_freqs` tensor, and each layer's xIELU scalars as `xielu.alpha_p` / `alpha_n` /
`beta` / `eps` arrays (the checkpoint's raw parameters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("phi2", "stablelm", "starcoder2", "gptneox", "olmo", "arcee", "nemotron", "apertus")
HF_MODEL_TYPE = {"phi2": "phi", "stablelm": "stablelm", "starcoder2": "starcoder2", "gptneox": "gpt_neox",
                 "olmo": "olmo", "arcee": "arcee", "nemotron": "nemotron", "apertus": "apertus"}
HF_ARCHITECTURE = {"phi": "PhiForCausalLM", "stablelm": "StableLmForCausalLM",
                   "starcoder2": "Starcoder2ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
                   "olmo": "OlmoForCausalLM", "arcee": "ArceeForCausalLM", "nemotron": "NemotronForCausalLM",
                   "apertus": "ApertusForCausalLM"}
# LayerNorm families: `attention.layer_norm_epsilon`, read as `layer_norm_eps`
LAYER_NORM_ARCHS = ("phi2", "stablelm", "starcoder2", "gptneox", "olmo", "nemotron")
# their `rope.dimension_count` is the rotated part of a head, not the head
PARTIAL_ROPE_ARCHS = ("phi2", "stablelm", "gptneox", "nemotron")
PERMUTED_QK = ("olmo", "arcee")  # Q/K rows in llama.cpp's pairs (LlamaModel.permute)
ONE_PLUS_NORMS = ("nemotron",)  # norm weights stored as 1 + w

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
    "olmo": {**_GATED, **{k: v for k, v in _ATTN.items() if k != "attn_norm"}},
    "arcee": {**_ATTN, **_PLAIN, **_POST_NORM},
    "nemotron": {**_ATTN, **_PLAIN, **_POST_NORM},
    "apertus": {**_ATTN, **_QK_NORMS, **_PLAIN, **_POST_NORM},
}
# jais2 (conversion/jais.py's Jais2Model: the base class's keys and `rope.dimension_count`, Q/K
# not permuted): LayerNorms with biases, a non-gated relu^2 MLP (llama.cpp's only activation)
ARCHITECTURES += ("jais2",)
HF_MODEL_TYPE["jais2"] = "jais2"
HF_ARCHITECTURE["jais2"] = "Jais2ForCausalLM"
LAYER_NORM_ARCHS += ("jais2",)
BLOCK_NAMES["jais2"] = {**_ATTN, **_PLAIN, **_POST_NORM}
# bitnet (conversion/bitnet.py: the base class's keys, Q/K not permuted): the projections' weights
# already ternary times their mean |w| (the converter's weight_quant), the sub-norms; llama.cpp
# runs a SiLU-gated MLP whatever the checkpoint's `hidden_act`, and no activation quantization
ARCHITECTURES += ("bitnet",)
HF_MODEL_TYPE["bitnet"] = "bitnet"
HF_ARCHITECTURE["bitnet"] = "BitNetForCausalLM"
BLOCK_NAMES["bitnet"] = {**_ATTN, **_GATED, **_POST_NORM, "attn_sub_norm": "self_attn.attn_sub_norm",
                         "ffn_sub_norm": "mlp.ffn_sub_norm"}
_XIELU = ("alpha_p", "alpha_n", "beta", "eps")


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


def _olmo(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    if _has(header, ".attn_q.bias"):
        raise ValueError(f"{header.path.name}: olmo with q/k biases is not supported (llama.cpp's converter "
                         "permutes the q/k weights but not their biases)")
    cfg["attention_bias"] = _has(header, ".attn_output.bias")
    clip = header.arch_key("attention.clamp_kqv")
    cfg["clip_qkv"] = float(clip) if clip is not None else None


def _arcee(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = _has(header, ".attn_q.bias")
    cfg["mlp_bias"] = _has(header, ".ffn_up.bias")
    cfg["hidden_act"] = "relu2"


def _nemotron(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    _rotary(header, cfg)
    cfg["norm_eps"] = cfg.pop("layer_norm_eps")
    cfg["attention_bias"] = _has(header, ".attn_q.bias")
    cfg["mlp_bias"] = _has(header, ".ffn_up.bias")


def _apertus(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = _has(header, ".attn_q.bias")
    cfg["hidden_act"] = "xielu"
    n = cfg["num_hidden_layers"]
    for key in _XIELU:
        values = header.metadata.get(f"xielu.{key}")  # (no architecture prefix: llama.cpp's key)
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{header.path.name}: apertus xielu.{key} must hold one value per layer ({n})")
    # one RoPE dict (ApertusConfig puts its own Llama 3 defaults where none is given)
    scaling = cfg.pop("rope_scaling", None) or {"rope_type": "default"}
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta", 10000.0), **scaling}


def _jais2(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = _has(header, ".attn_q.bias")
    cfg["mlp_bias"] = _has(header, ".ffn_up.bias")
    cfg["hidden_act"] = "relu2"


_HOOKS = {"phi2": _phi2, "stablelm": _stablelm, "starcoder2": _starcoder2, "gptneox": _gptneox,
          "olmo": _olmo, "arcee": _arcee, "nemotron": _nemotron, "apertus": _apertus}
_HOOKS["jais2"] = _jais2


def _bitnet(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    if _has(header, ".scale"):
        raise ValueError(f"{header.path.name}: bitnet with per-projection `.scale` tensors is not supported")
    cfg["hidden_act"] = "silu"  # (llama.cpp's BitNet graph: LLM_FFN_SILU)
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "linear" and scaling.get("factor") == 1.0:
        del cfg["rope_scaling"]  # (the converter's "linear, factor 1": none)


_HOOKS["bitnet"] = _bitnet


def config_hook(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """The architecture's own config fields, into `cfg` in place."""
    _HOOKS[header.architecture](header, cfg)


def extra_weights(header: GGUFHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a file keeps as metadata, under HF names: Apertus's xIELU scalars per layer
    (`alpha_p` / `alpha_n` as `[1]`, `beta` / `eps` as scalars, as HF's activation holds them)."""
    if header.architecture != "apertus":
        return
    for key in _XIELU:
        for i, value in enumerate(header.metadata[f"xielu.{key}"]):
            t = torch.tensor(float(value), dtype=torch.float32)
            yield f"model.layers.{i}.mlp.act_fn.{key}", t.reshape(1) if key.startswith("alpha") else t
