"""The driver's side of multi-LoRA serving: a request's adapter is checked once (its files and
tensor shapes against the base model, no weights read) before it is queued; the engine's
`add_lora` / `remove_lora` / `list_loras` (vLLM's)."""

from __future__ import annotations

from typing import Any

from pagedserve.lora.adapter import check_adapter, target_dims
from pagedserve.lora.request import LoRAConfig, LoRARequest


def cache_key(salt: str | None, lora: LoRARequest | None) -> str | tuple | None:
    """A sequence's prefix-cache salt: the request's cache_salt, and its adapter's id when it
    has one (`core.block_table.salt_root`): two adapters never share KV blocks."""
    return salt if lora is None else ("lora", lora.lora_int_id, salt)


class LoRAChecker:
    """The adapters the engine has accepted, by `lora_int_id` (each checked once)."""

    def __init__(self, config: LoRAConfig | None, model_config: Any) -> None:
        self.config = config
        self.known: dict[int, LoRARequest] = {}
        if config is not None:
            self.dims = target_dims(model_config)
            self.num_layers = int(model_config.num_hidden_layers)

    def check(self, lora_request: Any) -> LoRARequest | None:
        """`lora_request` when the engine can serve it (None stays None); ValueError naming the
        problem otherwise (adapters off, a bad adapter, an id already taken by another one)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.config is None:
            raise ValueError("lora_request: LoRA adapters need enable_lora=True (--enable-lora)")
        known = self.known.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                       lora_request.lora_path):
                raise ValueError(
                    f"lora_request: lora_int_id {lora_request.lora_int_id} is already adapter "
                    f"{known.lora_name!r} ({known.lora_path}); remove it first (remove_lora)")
            return known
        check_adapter(lora_request.lora_name, lora_request.lora_path, dims=self.dims,
                      num_layers=self.num_layers, max_rank=self.config.max_lora_rank)
        self.known[lora_request.lora_int_id] = lora_request
        return lora_request


def _remove_on_worker(worker, lora_id: int) -> bool:
    return worker.lora.remove(lora_id) if worker.lora is not None else False


class LoRAEngineMixin:
    """Mixed into `LLMEngine` (which sets `lora`, a `LoRAChecker`, and has `executor`)."""

    lora: LoRAChecker

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and remember it (its weights load on first use); ValueError for a
        bad one. True (vLLM's answer)."""
        self.lora.check(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` here and on the workers (its slot and CPU copy freed).
        Requests already running with it finish with it (it is read again if they need it).
        False when it was unknown."""
        known = self.lora.known.pop(lora_int_id, None)
        if known is None:
            return False
        if getattr(self.executor, "worker", None) is not None:  # in process: no messaging
            _remove_on_worker(self.executor.worker, lora_int_id)
        else:
            self.executor.collective_rpc(_remove_on_worker, (lora_int_id,))
        return True

    def list_loras(self) -> set[int]:
        """Ids of the adapters the engine knows."""
        return set(self.lora.known)
