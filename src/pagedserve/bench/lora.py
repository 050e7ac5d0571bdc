"""`pagedserve bench throughput --lora N`: the same trace with N random adapters (ranks 8 and 16,
built on the fly in PEFT's format, every projection adapted) spread round-robin over the
requests, against the base model alone on the same engine (alternated runs, best of each)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from pagedserve.lora.adapter import owner, target_dims


def write_random_adapter(path: Path, config, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of `rank` with random A and B on every projection of `config`."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    dims = target_dims(config)
    for (layer, module), (d_in, d_out) in dims.items():
        prefix = f"base_model.model.model.layers.{layer}.{owner(module)}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * d_in**-0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": sorted({module for _, module in dims})}))
    return path


def compare(llm, trace, num_adapters: int, run, rounds: int = 2, **sampling) -> str:
    """Throughput of `trace` on the base model and with `num_adapters` adapters round-robin over
    its requests, alternated for `rounds` rounds (the machine may be noisy: the best run of each
    is compared); the report. `run`: one timed run (`bench.throughput.run_pagedserve`, passed in
    by its caller)."""
    from pagedserve.lora.request import LoRARequest

    engine = llm.engine
    runs: dict[str, list] = {"base": [], f"{num_adapters} LoRAs": []}
    with tempfile.TemporaryDirectory() as root:
        loras = [LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(
            Path(root) / f"a{i}", engine.model_config, 8 if i % 2 == 0 else 16, seed=i)))
            for i in range(num_adapters)]
        per_request = [loras[i % num_adapters] for i in range(len(trace))]
        # warm-up: every adapter read once (the CPU cache keeps max_cpu_loras of them)
        llm.generate([{"prompt_token_ids": trace[0].prompt_token_ids}] * num_adapters,
                     lora_request=loras, use_tqdm=False)
        for _ in range(rounds):
            for name, chosen in zip(runs, (None, per_request)):
                result = run(llm, trace, lora_requests=chosen, **sampling)
                result.name = name
                runs[name].append(result)
    lines = [r.line() for pair in zip(*runs.values()) for r in pair]
    best = {name: max(r.output_tokens_per_s for r in rs) for name, rs in runs.items()}
    base, lora = best.values()
    lines.append(f"best of {rounds}: base {base:.1f} output tok/s, {num_adapters} LoRAs "
                 f"{lora:.1f}: ratio {lora / base:.2f}x")
    stats = getattr(getattr(engine.executor, "worker", None), "lora", None)
    if stats is not None:
        lines.append(f"adapter slots: {stats.stats}")
    return "\n".join(lines)
