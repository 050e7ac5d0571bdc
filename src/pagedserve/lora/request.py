"""`LoRARequest` (which adapter a request runs with) and `LoRAConfig` (the engine's limits).
Pure Python, no torch: the scheduler and the step messages carry them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request, as vLLM's: `lora_name` (how the server lists it),
    `lora_int_id` (its identity, >= 1: adapters with the same id are the same adapter, the
    prefix cache and the slot table key on it) and `lora_path` (a PEFT folder holding
    adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, "
                             f"got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must name a PEFT adapter folder, "
                             f"got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's adapter limits: `max_loras` adapters in one batch (slots on the compute
    device), ranks up to `max_lora_rank`, `max_cpu_loras` adapters kept loaded in CPU memory
    (least recently used dropped first)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
