"""Multi-LoRA serving (vLLM's names): many PEFT adapters over one base model, mixed in one batch.

- request.py  `LoRARequest` (lora_name, lora_int_id, lora_path) and `LoRAConfig` (the engine's
              limits); plain data, no torch
- adapter.py  PEFT folders read and checked (adapter_config.json + adapter_model.safetensors)
              against the base model's projection shapes: `read_adapter` / `check_adapter`
- slots.py    the worker's bounded slot table (max_loras, LRU) over a CPU cache (max_cpu_loras)
- layers.py   forward hooks on q/k/v/o and gate/up/down: the per-step token -> slot mapping and
              the gathered shrink / expand of every adapter's tokens on top of the base product
- engine.py   the driver's side: a request's adapter checked once, the scheduler's key
- serving.py  the server's adapters: --lora-modules, /v1/models cards, load / unload routes
"""

from pagedserve.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
