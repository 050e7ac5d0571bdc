"""`pagedserve bench throughput --lora N`: the same trace with N random adapters (ranks 8 and 16,
built on the fly in PEFT's format, every projection adapted) spread round-robin over the
requests, against the base model alone on the same engine."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from pagedserve.bench.throughput import run_pagedserve
from pagedserve.lora.adapter import target_dims


def write_random_adapter(path: Path, config, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of `rank` with random A and B on every projection of `config`."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (d_in, d_out) in target_dims(config).items():
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * d_in**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(target_dims(config))}))
    return path


def compare(llm, trace, num_adapters: int, **sampling) -> str:
    """Throughput of `trace` on the base model, then with `num_adapters` adapters round-robin
    over its requests (the base run first and last: the machine may be noisy); the report."""
    from pagedserve.lora.request import LoRARequest

    engine = llm.engine
    with tempfile.TemporaryDirectory() as root:
        loras = [LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(
            Path(root) / f"a{i}", engine.model_config, 8 if i % 2 == 0 else 16, seed=i)))
            for i in range(num_adapters)]
        per_request = [loras[i % num_adapters] for i in range(len(trace))]
        # warm-up: every adapter read once (the CPU cache keeps max_cpu_loras of them)
        llm.generate([{"prompt_token_ids": trace[0].prompt_token_ids}] * num_adapters,
                     lora_request=loras, use_tqdm=False)
        base1 = run_pagedserve(llm, trace, **sampling)
        with_lora = run_pagedserve(llm, trace, lora_requests=per_request, **sampling)
        base2 = run_pagedserve(llm, trace, **sampling)
    base_tps = max(base1.output_tokens_per_s, base2.output_tokens_per_s)
    with_lora.name = f"{num_adapters} LoRAs"
    base1.name, base2.name = "base", "base again"
    stats = getattr(getattr(engine.executor, "worker", None), "lora", None)
    lines = [base1.line(), with_lora.line(), base2.line(),
             f"ratio {num_adapters} LoRAs / base (the faster base run) output tok/s: "
             f"{with_lora.output_tokens_per_s / base_tps:.2f}x"]
    if stats is not None:
        lines.append(f"adapter slots: {stats.stats}")
    return "\n".join(lines)
