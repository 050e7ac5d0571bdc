"""The worker's adapters: a slot table of `max_loras` adapters on the compute device (what one
step may use), least recently used first out, over a CPU cache of `max_cpu_loras` loaded
adapters (least recently used dropped; read from disk again when needed)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from pagedserve.lora.adapter import LoRAWeights, check_adapter, target_dims
from pagedserve.lora.layers import LoRAStacks, StepMapping, install_hooks
from pagedserve.lora.request import LoRAConfig, LoRARequest

logger = logging.getLogger(__name__)


class LoRASlots:
    """One worker's adapters over its model (hooks installed at construction); the runner calls
    `prepare(rows)` before a step's forward and `finish()` after it.

    `stats`: disk loads, CPU-cache hits, slot loads (a copy into the device table), evictions
    (slot table and CPU cache)."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.dtype, self.device = dtype, device
        text = getattr(model, "config", None)
        self.dims = target_dims(text) if text is not None else None
        self.num_layers = len(model.backbone().decoder_layers())
        if self.dims is None:
            raise ValueError("enable_lora: the model keeps no HF config")
        self.stacks = LoRAStacks(config.max_loras, config.max_lora_rank, self.dims, dtype, device)
        install_hooks(model, self.stacks)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.free_slots = list(range(config.max_loras))
        self.cpu: OrderedDict[int, LoRAWeights] = OrderedDict()  # lora id -> weights, LRU first
        self.stats = {"disk_loads": 0, "cpu_hits": 0, "slot_loads": 0, "slot_evictions": 0,
                      "cpu_evictions": 0}

    def load(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights from the CPU cache, or read from disk into it."""
        weights = self.cpu.get(request.lora_int_id)
        if weights is not None:
            self.cpu.move_to_end(request.lora_int_id)
            self.stats["cpu_hits"] += 1
            return weights
        weights = check_adapter(request.lora_name, request.lora_path, dims=self.dims,
                                num_layers=self.num_layers, max_rank=self.config.max_lora_rank,
                                load=True, dtype=self.dtype)
        weights.int_id = request.lora_int_id
        self.stats["disk_loads"] += 1
        self.cpu[request.lora_int_id] = weights
        while len(self.cpu) > self.config.max_cpu_loras:
            self.cpu.popitem(last=False)
            self.stats["cpu_evictions"] += 1
        return weights

    def _slot(self, request: LoRARequest, needed: set[int]) -> int:
        lora_id = request.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        weights = self.load(request)
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next((i for i in self.slot_of if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.config.max_loras} "
                                   "adapters (the scheduler admits at most that many)")
            slot = self.slot_of.pop(victim)
            self.stats["slot_evictions"] += 1
        self.stacks.clear(slot)
        for key, (a, b) in weights.modules.items():
            self.stacks.put(slot, key, a.to(self.device), b.to(self.device))
        self.slot_of[lora_id] = slot
        self.stats["slot_loads"] += 1
        return slot

    def prepare(self, rows) -> bool:
        """Put this step's adapters in slots and build the token mapping (each row's
        `lora_request`, None: the base model); True when any row carries an adapter."""
        needed = {r.lora_request.lora_int_id for r in rows if r.lora_request is not None}
        if not needed:
            self.stacks.set_mapping(None)
            return False
        slots = [-1 if r.lora_request is None else self._slot(r.lora_request, needed)
                 for r in rows]
        self.stacks.set_mapping(StepMapping.build(slots, [r.end - r.start for r in rows],
                                                  self.config.max_loras, self.dtype, self.device,
                                                  bgmv=self.stacks.bgmv))
        return self.stacks.mapping is not None

    def finish(self) -> None:
        """After the step's forward: no adapter until the next `prepare`."""
        self.stacks.set_mapping(None)

    @torch.inference_mode()  # the stacks are inference tensors (made during a step)
    def remove(self, lora_id: int) -> bool:
        """Drop an adapter from the slot table and the CPU cache (an unloaded adapter)."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.stacks.clear(slot)
            self.free_slots.append(slot)
        return (self.cpu.pop(lora_id, None) is not None) or slot is not None

    def list_loras(self) -> list[int]:
        """Ids of the adapters in the slot table, least recently used first."""
        return list(self.slot_of)
