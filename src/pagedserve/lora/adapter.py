"""PEFT LoRA adapters read from disk and checked against the base model.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] per adapted module). Only safetensors are read: a pickled
`adapter_model.bin` is refused, never unpickled.

Every problem is a ValueError naming the adapter and what is wrong: a missing folder or file, a
rank above `max_lora_rank`, a target module the engine does not adapt, a tensor whose shape does
not fit the base model's projection, a PEFT feature not supported (DoRA, LoRA biases,
modules_to_save, fan_in_fan_out, per-module alphas, embed_tokens / lm_head adapters).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

# The projections of a decoder layer that adapters may target, by HF name: the attention's
# (Llama's q/k/v/o; latent attention's q_a / q_b / kv_a, DeepSeek's MLA) and a dense MLP's.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                     "kv_a_proj_with_mqa")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS
# HF names of attention projections that our layers keep under another name (LFM2's out_proj)
ALIASES = {"out_proj": "o_proj"}
# PEFT targets we know but do not apply: refused with the reason.
UNSUPPORTED_TARGETS = {
    "embed_tokens": "embedding adapters are not applied",
    "lm_head": "LM head adapters are not applied",
    "kv_b_proj": "latent attention (MLA) absorbs kv_b_proj into its query and output products, "
                 "so it takes no adapter (q_proj / q_a_proj / q_b_proj, kv_a_proj_with_mqa and "
                 "o_proj do)",
}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt")

_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                  r"(?:\.[\w-]+)?(?:\.weight)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


def owner(module: str) -> str:
    """The HF submodule of a decoder layer holding projection `module` ("self_attn" | "mlp")."""
    return "mlp" if module in MLP_TARGETS else "self_attn"


def projections(layer: Any) -> dict[str, Any]:
    """The adaptable projections of one of our decoder layers, by HF name: those of
    `TARGET_MODULES` its `self_attn` and `mlp` hold as modules (a mixture-of-experts block has
    no gate/up/down of its own; a linear-attention or convolution layer no `self_attn`)."""
    found = {}
    for name in TARGET_MODULES:
        module = getattr(getattr(layer, owner(name), None), name, None)
        if module is not None:
            found[name] = module
    return found


def target_dims(config: Any) -> dict[tuple[int, str], tuple[int, int]]:
    """(in_features, out_features) of every adaptable projection of the base model, by (decoder
    layer, HF module name): read off our model's modules for `config`, built on the meta device
    (no memory, no weights), so that hybrid stacks (attention in some layers only), latent
    attention, gated queries and per-layer head sizes come out as the model has them."""
    import torch

    from pagedserve.models.loader import _build_context
    from pagedserve.models.registry import get_model_class

    with _build_context(torch.device("meta"), torch.float32):
        model = get_model_class(config)(config)
    dims = {}
    for i, layer in enumerate(model.backbone().decoder_layers()):
        for name, module in projections(layer).items():
            dims[(i, name)] = (int(module.in_features), int(module.out_features))
    if not dims:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projection LoRA adapts "
                         f"({', '.join(TARGET_MODULES)} of its decoder layers)")
    return dims


@dataclass
class LoRAWeights:
    """One adapter in memory: per (layer, module) its A [r, in] and B [out, r] with the scaling
    (lora_alpha / r, or / sqrt(r) under rsLoRA) folded into B, on the CPU, in `dtype`."""

    name: str
    int_id: int
    rank: int  # the largest rank of its modules
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"lora_request {name!r}: {message}")


def _files(name: str, path: str) -> tuple[str, str]:
    if not path or not os.path.isdir(path):
        raise _fail(name, f"adapter folder {path!r} does not exist")
    config_path = os.path.join(path, CONFIG_FILE)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = [f for f in PICKLED_FILES if os.path.isfile(os.path.join(path, f))]
        if pickled:
            raise _fail(name, f"{pickled[0]} is a pickled checkpoint, which pagedserve never "
                        f"unpickles (it can run code): save the adapter as {WEIGHTS_FILE} "
                        "(PEFT's save_pretrained(..., safe_serialization=True))")
        raise _fail(name, f"{WEIGHTS_FILE} is missing in {path!r}")
    if not os.path.isfile(config_path):
        raise _fail(name, f"{CONFIG_FILE} is missing in {path!r}")
    return config_path, weights_path


def _read_config(name: str, config_path: str) -> dict[str, Any]:
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(name, f"{CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(name, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type!r} is not a LoRA adapter")
    checks = [
        (cfg.get("use_dora"), "DoRA (use_dora) is not supported"),
        (cfg.get("bias", "none") not in (None, "none"), f"LoRA biases (bias={cfg.get('bias')!r})"
         " are not supported"),
        (cfg.get("modules_to_save"), f"modules_to_save {cfg.get('modules_to_save')!r} are not "
         "supported (only LoRA products are applied)"),
        (cfg.get("fan_in_fan_out"), "fan_in_fan_out adapters (GPT-2 Conv1D) are not supported"),
        (cfg.get("alpha_pattern"), "per-module alphas (alpha_pattern) are not supported"),
    ]
    for bad, message in checks:
        if bad:
            raise _fail(name, message)
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for t in targets:
            short = str(t).rsplit(".", 1)[-1]
            if short in UNSUPPORTED_TARGETS:
                raise _fail(name, f"target module {short!r} is not supported: "
                            f"{UNSUPPORTED_TARGETS[short]}")
            if short not in TARGET_MODULES and short not in ALIASES:
                raise _fail(name, f"unknown target module {str(t)!r} (pagedserve adapts "
                            f"{', '.join(TARGET_MODULES)})")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _fail(name, f"{CONFIG_FILE}: {key} must be a positive number, got {value!r}")
    return cfg


def _parse_key(name: str, key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of a tensor name; ValueError for anything else."""
    m = _KEY.match(key)
    if m is None:
        raise _fail(name, f"tensor {key!r} is not a LoRA weight (modules_to_save and other "
                    "extra weights are not supported)")
    module, part = m.group("module"), m.group("part")
    short = module.rsplit(".", 1)[-1]
    if short in UNSUPPORTED_TARGETS:
        raise _fail(name, f"target module {short!r} ({key}) is not supported: "
                    f"{UNSUPPORTED_TARGETS[short]}")
    if part.startswith("lora_embedding"):
        raise _fail(name, f"target module {short!r} ({key}) is not supported: embedding "
                    "adapters are not applied")
    lm = _LAYER.search(module)
    target = None if lm is None else (
        ALIASES.get(lm.group(3), lm.group(3)) if lm.group(2) == "self_attn" else lm.group(3))
    if target is None or target not in TARGET_MODULES or owner(target) != lm.group(2):
        raise _fail(name, f"unknown target module {module!r} (pagedserve adapts "
                    f"{', '.join(TARGET_MODULES)} of the decoder layers)")
    layer = int(lm.group(1))
    if layer >= num_layers:
        raise _fail(name, f"tensor {key!r} is for layer {layer}; the base model has "
                    f"{num_layers} layers (an adapter of another base model?)")
    return layer, target, part[-1]


def _not_adapted(layer: int, module: str, dims: dict[tuple[int, str], tuple[int, int]]) -> str:
    """Why (layer, module) takes no adapter here."""
    if any(m == module for _, m in dims):
        layers = sorted(i for i, m in dims if m == module)
        return (f"layer {layer} has no {module} (it is adapted in layers {layers}: the others "
                "are not attention layers, or their MLP is a mixture of experts)")
    names = sorted({m for _, m in dims}, key=TARGET_MODULES.index)
    return (f"target module {module!r} is not adapted in this model (a mixture of experts' "
            f"experts, or a projection it does not have: adapters take {', '.join(names)})")


def check_adapter(name: str, path: str, *, dims: dict[tuple[int, str], tuple[int, int]],
                  num_layers: int,
                  max_rank: int, load: bool = False,
                  dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Read (`load`) or only check (tensor headers, no data) the PEFT adapter at `path` against
    the base model's projections (`dims` from `target_dims`, `num_layers`); ValueError naming the
    problem. The result holds the tensors only when `load`."""
    from safetensors import safe_open

    config_path, weights_path = _files(name, path)
    cfg = _read_config(name, config_path)
    alpha, rslora = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    try:
        handle = safe_open(weights_path, framework="pt")
    except Exception as e:  # noqa: BLE001 - a corrupt file is the user's problem, named
        raise _fail(name, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    with handle as f:
        keys = list(f.keys())
        if not keys:
            raise _fail(name, f"{WEIGHTS_FILE} holds no tensors")
        for key in keys:
            layer, module, part = _parse_key(name, key, num_layers)
            shape = tuple(f.get_slice(key).get_shape())
            pairs.setdefault((layer, module), {})[part] = (key, shape)
        out = LoRAWeights(name, 0, 0)
        for (layer, module), parts in sorted(pairs.items()):
            if set(parts) != {"A", "B"}:
                missing = "lora_B" if "A" in parts else "lora_A"
                raise _fail(name, f"layer {layer} {module}: {missing} is missing")
            (key_a, a_shape), (key_b, b_shape) = parts["A"], parts["B"]
            if (layer, module) not in dims:
                raise _fail(name, _not_adapted(layer, module, dims))
            d_in, d_out = dims[(layer, module)]
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
                raise _fail(name, f"layer {layer} {module}: lora_A {list(a_shape)} and lora_B "
                            f"{list(b_shape)} are not a [r, in] / [out, r] pair")
            rank = a_shape[0]
            if rank > max_rank:
                raise _fail(name, f"rank {rank} ({module}) is more than max_lora_rank "
                            f"({max_rank}): raise max_lora_rank (--max-lora-rank)")
            if a_shape[1] != d_in or b_shape[0] != d_out:
                raise _fail(name, f"layer {layer} {module}: lora_A {list(a_shape)} / lora_B "
                            f"{list(b_shape)} do not fit the base model's {module} "
                            f"({d_in} -> {d_out}): an adapter of another base model?")
            out.rank = max(out.rank, rank)
            if load:
                scaling = alpha / (math.sqrt(rank) if rslora else rank)
                a = f.get_tensor(key_a).to(torch.float32)
                b = f.get_tensor(key_b).to(torch.float32) * scaling
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise _fail(name, f"layer {layer} {module}: non-finite LoRA weights")
                out.modules[(layer, module)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out
