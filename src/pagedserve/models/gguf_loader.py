"""Load models from GGUF files: the config, the tokenizer and HF-named float32 weights.

A GGUF file holds everything a model needs, under llama.cpp's names: the config as metadata keys,
the tokenizer as metadata arrays, and the weights as (mostly quantized) tensors. This module turns
them into what the rest of pagedserve reads for a Hugging Face checkpoint:

- `load_gguf_config(path)`: a `transformers.PretrainedConfig`;
- `load_gguf_tokenizer(path)`: a transformers tokenizer;
- `iter_gguf_weights(path, config)`: `(hf_safetensors_name, float32 tensor)` pairs, dequantized,
  with llama.cpp's layout changes undone (Q/K row permutation, Gemma's `1 + w` norms);
(The embedded Gemma 3 270M GGUF is `pagedserve.models.embedded`; the header reader is
`pagedserve.models.gguf_reader`; the metadata -> HF config mapping `pagedserve.models.gguf_config`.)

Config and tokenizer are converted once per GGUF file and cached on disk (see `gguf_cache_dir`),
since building the tokenizer through transformers takes seconds.

Nothing here unpickles anything: GGUF tensors are raw bytes read through a read-only memory map.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_reader import (  # noqa: F401 - re-exported
    GGUFHeader,
    GGUFTensorInfo,
    _read_quantized,
    _read_tensor_f32,
    read_gguf_header,
)

from pagedserve.models.gguf_config import (  # noqa: F401 - SUPPORTED_ARCHITECTURES re-exported
    SUPPORTED_ARCHITECTURES,
    _check_supported,
    build_gguf_config_dict,
)
from pagedserve.models import gguf_classic, gguf_mamba
from pagedserve.models import gguf_granite_swa, gguf_hy_v3, gguf_laguna, gguf_minicpm3, gguf_starcoder
from pagedserve.models import gguf_falcon, gguf_mimo2
from pagedserve.models.gguf_families import ARCHITECTURES as FAMILY_ARCHITECTURES
from pagedserve.models.gguf_hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES

logger = logging.getLogger(__name__)


CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"
"""Environment variable naming pagedserve's cache root (default `~/.cache/pagedserve`)."""

# NOTE: bump when the cached config/tokenizer would change for the same GGUF file (new config
# fields, a fixed mapping): the version is part of the cache key, so old entries are ignored.
_CACHE_FORMAT_VERSION = 1


def gguf_cache_dir(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder caching the converted config/tokenizer of the GGUF at `path`.

    `<root>/gguf/<stem>-<key>/`, where root is `cache_dir`, else `$PAGEDSERVE_CACHE_DIR`, else
    `~/.cache/pagedserve`, and key hashes the resolved path, size, mtime, our cache format version
    and the transformers version (a re-downloaded or edited file, or an upgrade, gets a new entry).
    """
    import transformers

    path = Path(path).resolve()
    stat = path.stat()
    ident = f"{_CACHE_FORMAT_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return _cache_root(cache_dir) / "gguf" / f"{path.stem}-{key}"


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagedserve"


def _write_dir_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Create `target` by filling a temp folder next to it and renaming it into place.

    NOTE: readers only ever see a complete folder: an error removes the temp folder, and a killed
    process can only leave a `.tmp-*` folder behind, never a half-written `target`. If another
    process wins the race, its folder is kept and ours dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_config(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
):  # -> transformers.PretrainedConfig
    """The HF config of the model in the GGUF file at `path`, cached on disk.

    The first call reads the GGUF header, builds the config (`build_gguf_config_dict`) and saves
    `config.json` under `gguf_cache_dir(path, cache_dir)/config/`; later calls load that file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, or an unsupported architecture (named in the message).
    """
    from transformers import AutoConfig

    folder = gguf_cache_dir(path, cache_dir) / "config"
    if not (folder / "config.json").is_file():
        header = read_gguf_header(path)
        config = AutoConfig.for_model(**build_gguf_config_dict(header))
        _write_dir_atomically(folder, config.save_pretrained)
    config = AutoConfig.from_pretrained(folder)
    config.name_or_path = str(path)
    return config


def load_gguf_tokenizer(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None):
    """The HF tokenizer stored in the GGUF file at `path`, cached on disk.

    The first call converts it with transformers (its `gguf_file` support) and saves it with
    `save_pretrained` under `gguf_cache_dir(path, cache_dir)/tokenizer/`; later calls load that.
    The tokenizer class is the one `AutoTokenizer` picks for the model's config.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, or an unsupported architecture (named in the message).
    """
    from transformers import AutoTokenizer

    from pagedserve.models.tokenizer import drop_construction_copies

    path = Path(path)
    folder = gguf_cache_dir(path, cache_dir) / "tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        config = load_gguf_config(path, cache_dir)
        tokenizer = _convert_gguf_tokenizer(path, config)

        def save(tmp: Path) -> None:
            tokenizer.save_pretrained(tmp)
            index_added_tokens(tmp)

        _write_dir_atomically(folder, save)
        # the same tokenizer a reload gives (tested), without reloading it
        return drop_construction_copies(tokenizer)
    index_added_tokens(folder)  # a cache written before the index existed: once
    return drop_construction_copies(AutoTokenizer.from_pretrained(folder))


def index_added_tokens(folder: Path) -> None:
    """Copy the added tokens of a saved tokenizer's `tokenizer.json` into its
    `tokenizer_config.json` (`added_tokens_decoder`, transformers' own field), unless there.

    NOTE: start-up. Without that field transformers' `from_pretrained` parses the whole
    tokenizer.json (33 MB for Gemma 3's 262k tokens) one extra time on every load only to read
    the added tokens: ~1 CPU s of the embedded model's start (docs/benchmarks.md, "Start-up").
    The loaded tokenizer is the same (tested). The file is replaced atomically."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config or not (folder / "tokenizer.json").is_file():
        return
    tokens = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in tokens}
    tmp = config_path.with_name(f".{config_path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, config_path)
    except OSError as e:  # a read-only cache still loads, only slower
        logger.debug("could not index the added tokens of %s: %s", folder, e)
        tmp.unlink(missing_ok=True)


def _convert_gguf_tokenizer(path: Path, config):
    """Build the tokenizer from the GGUF with the class AutoTokenizer would choose for `config`.

    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` re-parses the whole GGUF (~11 s) only to
    rebuild the config we already have; picking the class ourselves as its last resort does
    (`TOKENIZER_MAPPING[type(config)]`, else `TokenizersBackend`) skips that.
    """
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    tokenizer_class = TOKENIZER_MAPPING.get(type(config), None) or TokenizersBackend
    if tokenizer_class.__name__ == "MistralCommonBackend":  # needs mistral-common files, not a GGUF
        tokenizer_class = TokenizersBackend
    # NOTE: transformers also reads tokenizer_config.json & co. from the GGUF's folder; load from a
    # folder holding only a link to the file so stray files next to it cannot leak in.
    with tempfile.TemporaryDirectory(prefix="pagedserve-gguf-") as tmp:
        link = Path(tmp) / path.name
        try:
            link.symlink_to(path.resolve())
            folder = tmp
        except OSError:  # no symlinks here: fall back to the file's own folder
            folder = str(path.resolve().parent)
        return tokenizer_class.from_pretrained(folder, gguf_file=path.name)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
                    "token_embd_norm": "model.embedding_norm"}  # (LFM2's final norm)
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# mixture of experts (layers/moe.py): the router, the experts stacked [E, out, in] (our stacked
# parameter names, as llama.cpp's converter calls the merged tensors), the shared expert
_MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# GGUF block tensor leaf -> HF leaf under `model.layers.N.`, per architecture (same as gguf-py's
# TensorNameMap for these architectures).
_BLOCK_NAMES = {
    "llama": {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES},  # Mixtral is "llama" with experts
    "qwen2moe": {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES},
    "qwen3moe": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES},
    "olmoe": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES},
    "granitemoe": {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES},
    "ernie4_5-moe": {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES},
    "ernie4_5": _LLAMA_BLOCK_NAMES,  # ERNIE 4.5 dense (Q/K not permuted: its RoPE is on pairs)
    # HunYuan: its q/k norms (after RoPE) keep HF's names; Q/K not permuted (rotate-half in both)
    "hunyuan-dense": {**_LLAMA_BLOCK_NAMES, "attn_q_norm": "self_attn.query_layernorm",
                      "attn_k_norm": "self_attn.key_layernorm"},
    "phimoe": {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES},  # (its norms' biases: .bias of the same)
    # GLM-4.5 MoE: its post-attention (pre-MLP) norm is llama.cpp's post_attention_norm
    "glm4moe": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES,
                "post_attention_norm": "post_attention_layernorm"},
    "qwen2": _LLAMA_BLOCK_NAMES,
    "qwen3": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES},
    # the Qwen VL text decoders: Qwen2's, Qwen3's, Qwen3-MoE's names (their experts split and
    # stacked by the converter as Qwen3-MoE's)
    "qwen2vl": _LLAMA_BLOCK_NAMES,
    "qwen3vl": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES},
    "qwen3vlmoe": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES},
    "gemma3": {
        **_LLAMA_BLOCK_NAMES,
        **_QK_NORM_NAMES,
        # NOTE: Gemma 3 has four norms per block; GGUF's ffn_norm is the *pre*-feedforward one.
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_BLOCK_NAMES["hunyuan-moe"] = {**_BLOCK_NAMES["hunyuan-dense"], **_MOE_BLOCK_NAMES}
# dense families of issue 35 (the fused tensors keep their HF names: the models split them)
_BLOCK_NAMES["phi3"] = {**_LLAMA_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_BLOCK_NAMES["gemma2"] = {k: v for k, v in _BLOCK_NAMES["gemma3"].items() if k not in _QK_NORM_NAMES}
_BLOCK_NAMES["gemma"] = _LLAMA_BLOCK_NAMES  # (Gemma 1: pre-norms only)
_BLOCK_NAMES["granite"] = _BLOCK_NAMES["smollm3"] = _BLOCK_NAMES["mistral3"] = _LLAMA_BLOCK_NAMES
# LFM2: the short convolution's tensors (the conv weight [C, L], as the model keeps it)
_BLOCK_NAMES["lfm2"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, "shortconv.conv": "conv.conv",
                        "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"}
_BLOCK_NAMES["lfm2moe"] = {**_BLOCK_NAMES["lfm2"], **_MOE_BLOCK_NAMES}
# Llama 4: Llama's names with experts (Q/K not permuted: its RoPE is on pairs, as llama.cpp's)
_BLOCK_NAMES["llama4"] = {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES}
# MiniMax-M2: q/k norms over the whole projections (same names), the selection bias as exp_probs_b
_BLOCK_NAMES["minimax-m2"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES}
# Seed-OSS: its pre-MLP norm is llama.cpp's post_attention_norm
_BLOCK_NAMES["seed_oss"] = {**_LLAMA_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm"}
_BLOCK_NAMES["glm4"] = {
    **_LLAMA_BLOCK_NAMES,
    "ffn_up": "mlp.gate_up_proj",
    # NOTE: GLM-4's post_attention_layernorm is the pre-MLP norm (GGUF ffn_norm)
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
# Cohere (Command-R, Cohere 2): one norm per block (attn_norm: the parallel block's input norm),
# Command R+'s per-head q/k norms
_BLOCK_NAMES["command-r"] = _BLOCK_NAMES["cohere2"] = {
    **{k: v for k, v in _LLAMA_BLOCK_NAMES.items() if k != "ffn_norm"}, **_QK_NORM_NAMES}
# OLMo 2 (and EXAONE 4.0: its norms have the same names; its q/k norms are per head)
_BLOCK_NAMES["olmo2"] = {
    **{k: v for k, v in _LLAMA_BLOCK_NAMES.items() if k not in ("attn_norm", "ffn_norm")},
    **_QK_NORM_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES["exaone4"] = _BLOCK_NAMES["olmo2"]
# the Mamba2 hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1): models/gguf_mamba.py
for _arch in gguf_mamba.ARCHITECTURES:
    _BLOCK_NAMES[_arch] = gguf_mamba.block_names(_arch, _LLAMA_BLOCK_NAMES, _MOE_BLOCK_NAMES)
# the older dense families (Phi-2, ...): models/gguf_classic.py
_BLOCK_NAMES.update(gguf_classic.BLOCK_NAMES)
# AfMoE: the attention's output gate, sandwich norms (ffn_norm the pre-MLP one), q/k norms, experts
_BLOCK_NAMES["afmoe"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES, "attn_gate": "self_attn.gate_proj",
                         "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_mlp_layernorm",
                         "post_ffw_norm": "post_mlp_layernorm"}
# EXAONE MoE: Llama's names (ffn_norm the pre-MLP norm), per-head q/k norms, experts
_BLOCK_NAMES["exaone-moe"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES}
# Cohere 2 MoE: Cohere 2's names (one norm per block), the dense prefix MLPs, experts
_BLOCK_NAMES["cohere2moe"] = {**{k: v for k, v in _LLAMA_BLOCK_NAMES.items() if k != "ffn_norm"}, **_MOE_BLOCK_NAMES}
# DBRX: its fused Wqkv (split by the model), the pre-MLP norm as attn_output_norm, experts
_BLOCK_NAMES["dbrx"] = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.Wqkv", "attn_output": "self_attn.o_proj",
                        "attn_output_norm": "post_attention_layernorm", **_MOE_BLOCK_NAMES}
# Q/K rows llama.cpp's converter permutes (its LlamaModel and subclasses), norms it stores as 1 + w
_PERMUTED_QK_ARCHS = ("llama", "granite", "granitemoe", "smollm3", "mistral3") + gguf_mamba.PERMUTED_QK \
    + gguf_classic.PERMUTED_QK
# Granite SWA / Granite MoE SWA: Llama's names, the sinks and the fused experts (models/gguf_granite_swa.py)
_BLOCK_NAMES["granite_swa"] = {**_LLAMA_BLOCK_NAMES, **gguf_granite_swa.BLOCK_NAMES}
_PERMUTED_QK_ARCHS += gguf_granite_swa.PERMUTED_QK
# Laguna: Llama's names, per-head q/k norms, the output gate, experts (models/gguf_laguna.py)
_BLOCK_NAMES["mimo2"] = {**_LLAMA_BLOCK_NAMES, **_MOE_BLOCK_NAMES, **gguf_mimo2.BLOCK_NAMES}  # MiMo-V2-Flash
_BLOCK_NAMES["hy_v3"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES}  # HunYuan V3
_BLOCK_NAMES["laguna"] = {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_BLOCK_NAMES, **gguf_laguna.BLOCK_NAMES}
_GEMMA_NORM_ARCHS = ("gemma3", "gemma2", "gemma") + gguf_classic.ONE_PLUS_NORMS  # (and Nemotron's layernorm1p)
# GGUF tensors with no HF counterpart, folded into the config instead.
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_to_hf_name(architecture: str, gguf_name: str) -> str | None:
    """The HF safetensors name of GGUF tensor `gguf_name`, or None if this module does not map it."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        if architecture in gguf_mamba.ARCHITECTURES:
            return gguf_mamba.hf_name(architecture, gguf_name)
        if architecture in gguf_hy_v3.ARCHITECTURES:
            return gguf_hy_v3.hf_name(gguf_name)
        return None
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    if architecture in gguf_mamba.ARCHITECTURES and (name := gguf_mamba.hf_name(architecture, gguf_name)) is not None:
        return name  # (A, D, dt_bias: no weight / bias leaf of their own)
    parts = stem.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        leaf = _BLOCK_NAMES.get(architecture, {}).get(".".join(parts[2:]))  # (LFM2's have dots)
        if leaf is not None and leaf.endswith("e_score_correction_bias"):  # a bias, stored as .bias
            return f"model.layers.{int(parts[1])}.{leaf}"
        if leaf is not None:
            return f"model.layers.{int(parts[1])}.{leaf}.{suffix}"
    return None


def _unpermute_qk(w: torch.Tensor, n_head: int, name: str) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of Q/K rows ([out, in] weight or [out] bias).

    llama.cpp reorders each head's rows from HF's rotate-half layout (first half, second half) to
    interleaved pairs: `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`. The inverse swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{name}: {rows} rows do not split into {n_head} heads of even size")
    rest = w.shape[1:]
    w = w.reshape(n_head, rows // n_head // 2, 2, *rest)  # [H, D/2, 2, ...]: GGUF's interleaved pairs
    w = w.transpose(1, 2)  # [H, 2, D/2, ...]: HF's two halves per head
    return w.reshape(rows, *rest).contiguous()  # [out, ...]


def iter_gguf_weights(path: str | os.PathLike[str], config, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield `(hf_name, tensor)` for every weight in the GGUF file, as float32 in HF layout.

    `keep_quantized`: 2-D tensors in a block format the CPU kernel reads (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
    Q5_K, Q6_K: `kernels.cpu_qlinear.GGML_FORMATS`) come as `layers.quantization.QuantizedTensor`
    (their blocks, copied out of the file) instead.

    Names are HF safetensors names (`model.layers.0.self_attn.q_proj.weight`, ...); shapes are
    HF's (`[out, in]` for linear weights). Quantized tensors are dequantized with `gguf`. llama.cpp's
    changes are undone: Q/K row permutation (GGUF architecture "llama", using
    `config.num_attention_heads` / `num_key_value_heads`) and Gemma 3's norms stored as `1 + w`.
    A tied LM head (no `output.weight`) is not yielded, as in HF checkpoints.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported architecture, or a tensor this module cannot map.
    """
    header = read_gguf_header(path)
    _check_supported(header)
    arch = header.architecture
    if arch in FAMILY_ARCHITECTURES:  # deepseek2, gpt-oss: models/gguf_families.py
        from pagedserve.models.gguf_families import iter_weights

        yield from iter_weights(header, config, keep_quantized)
        return
    if arch in gguf_minicpm3.ARCHITECTURES:
        yield from gguf_minicpm3.iter_weights(header, config, keep_quantized)
        return
    if arch in gguf_starcoder.ARCHITECTURES:
        yield from gguf_starcoder.iter_weights(header, config, keep_quantized)
        return
    if arch in gguf_falcon.ARCHITECTURES:
        yield from gguf_falcon.iter_weights(header, config, keep_quantized)
        return
    if arch in HYBRID_ARCHITECTURES:  # qwen3next, qwen35, qwen35moe: models/gguf_hybrid.py
        from pagedserve.models import gguf_hybrid

        yield from gguf_hybrid.iter_weights(header, config, keep_quantized)
        return
    if arch == "gemma4":  # models/gguf_gemma4.py
        from pagedserve.models import gguf_gemma4

        yield from gguf_gemma4.iter_weights(header, config, keep_quantized)
        return
    if arch == "gemma3n":  # models/gguf_gemma3n.py
        from pagedserve.models import gguf_gemma3n

        yield from gguf_gemma3n.iter_weights(header, config, keep_quantized)
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_head = int(getattr(text_config, "num_attention_heads", 0) or 0)  # (none: Mamba)
    n_kv_head = int(getattr(text_config, "num_key_value_heads", None) or n_head)

    hf_names = {}
    # multi-token-prediction blocks after the model's layers (GLM-4.5's `nextn_predict_layers`):
    # not run, not loaded
    n_blocks = int(getattr(text_config, "num_hidden_layers", 0) or 0)
    mtp = int(header.arch_key("nextn_predict_layers") or 0)
    for info in header.tensors:  # map everything first: fail before yielding anything
        if info.name in _SKIPPED:
            continue
        if mtp and info.name.startswith("blk.") and int(info.name.split(".")[1]) >= n_blocks:
            continue
        hf_name = gguf_to_hf_name(arch, info.name)
        if hf_name is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture {arch!r}")
        hf_names[info.name] = hf_name

    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        if info.name not in hf_names:
            continue
        quantized = _read_quantized(blob, info) if keep_quantized else None
        tensor = quantized.data if quantized is not None else _read_tensor_f32(blob, info)  # HF shape
        leaf = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        if arch in _PERMUTED_QK_ARCHS and leaf == "attn_q":
            tensor = _unpermute_qk(tensor, n_head, info.name)  # [H*D, hidden] or [H*D]
        elif arch in _PERMUTED_QK_ARCHS and leaf == "attn_k":
            tensor = _unpermute_qk(tensor, n_kv_head, info.name)  # [Hkv*D, hidden] or [Hkv*D]
        # NOTE: llama.cpp's Gemma converters store every RMSNorm weight as 1 + w (HF's Gemma norm
        # computes x * (1 + w)); this covers the q/k norms as well as the block and final norms.
        if arch in _GEMMA_NORM_ARCHS and info.name.endswith("norm.weight"):
            tensor = tensor - 1.0  # [dim]
        if leaf == "ffn_gate_inp_shexp" and tensor.dim() == 1:
            tensor = tensor.unsqueeze(0)  # [H] -> HF's [1, H] (shared_expert_gate)
        if arch in gguf_mamba.ARCHITECTURES and quantized is None:
            tensor = gguf_mamba.to_hf_layout(info.name, tensor, arch)  # A -> A_log, SSM shapes
        if quantized is not None:  # rows permuted above as whole rows of blocks
            quantized.data = tensor.contiguous()
            tensor = quantized
        yield hf_names[info.name], tensor
    if arch in gguf_classic.ARCHITECTURES:
        yield from gguf_classic.extra_weights(header)  # (Apertus's xIELU scalars: metadata)
