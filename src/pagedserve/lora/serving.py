"""The server's adapters (vLLM's): `--lora-modules name=path ...` loaded at start, each listed in
/v1/models (its `parent` the base model) and chosen by its name as a request's `model`; with
`--allow-runtime-lora-updating`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

NOTE: no `from __future__ import annotations` here: FastAPI resolves the routes' annotations, and
`Request` is imported inside `add_lora_routes` (the CLI imports this module without FastAPI)."""

import argparse
import itertools
import json
import logging
from typing import Any

from pagedserve.lora.request import LoRARequest

logger = logging.getLogger("pagedserve.server")


def lora_module(value: str) -> dict[str, str]:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON `{"name": ..., "path": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: bad JSON {value!r}: {e}") from e
        if not isinstance(parsed, dict) or not {"name", "path"} <= set(parsed):
            raise argparse.ArgumentTypeError(
                f"--lora-modules: {value!r} needs 'name' and 'path'")
        return {"name": str(parsed["name"]), "path": str(parsed["path"])}
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path, got {value!r}")
    return {"name": name, "path": path}


def add_lora_server_args(p: argparse.ArgumentParser) -> None:
    """`--lora-modules` and `--allow-runtime-lora-updating` (the engine's --enable-lora,
    --max-loras, --max-lora-rank, --max-cpu-loras come from EngineArgs)."""
    p.add_argument("--lora-modules", type=lora_module, nargs="+", default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora): name=path, or JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request names one as its model")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


class ServedLoRAs:
    """The adapters a server serves, by name; ids are handed out once, never reused."""

    def __init__(self, engine, base_names: list[str]) -> None:
        self.engine = engine  # the AsyncLLMEngine
        self.base_names = list(base_names)
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name else None

    def _request(self, name: Any, path: Any) -> LoRARequest:
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path must name a PEFT adapter folder")
        if name in self.by_name or name in self.base_names:
            raise ValueError(f"lora_name: the model {name!r} is already served")
        return LoRARequest(name, next(self._ids), path)

    def add_at_start(self, name: str, path: str) -> LoRARequest:
        """A --lora-modules adapter, checked before the engine starts (ValueError stops it)."""
        request = self._request(name, path)
        self.engine.engine.add_lora(request)
        self.by_name[name] = request
        logger.info("serving LoRA adapter %r from %s", name, path)
        return request

    async def load(self, name: Any, path: Any) -> LoRARequest:
        """Check and add an adapter while the server runs (ValueError naming the problem)."""
        request = self._request(name, path)
        await self.engine.call_in_engine_thread(lambda e: e.add_lora(request))
        self.by_name[name] = request
        return request

    async def unload(self, name: Any) -> bool:
        """Stop serving an adapter (requests running with it finish); False when unknown."""
        request = self.by_name.pop(name, None) if isinstance(name, str) else None
        if request is None:
            return False
        await self.engine.call_in_engine_thread(lambda e: e.remove_lora(request.lora_int_id))
        return True


def served_loras(engine, args, base_names: list[str]) -> ServedLoRAs | None:
    """The server's adapters from its arguments; None without --enable-lora (ValueError when
    --lora-modules or --allow-runtime-lora-updating are given without it)."""
    modules = getattr(args, "lora_modules", None) or []
    runtime = getattr(args, "allow_runtime_lora_updating", False)
    if not engine.engine.args.enable_lora:
        if modules or runtime:
            raise ValueError("--lora-modules / --allow-runtime-lora-updating need --enable-lora")
        return None
    served = ServedLoRAs(engine, base_names)
    for module in modules:
        served.add_at_start(module["name"], module["path"])
    return served


def add_lora_routes(app, served: ServedLoRAs, parse_body, api_error) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter
    {lora_name} (vLLM's; plain-text answers; 400 for a bad adapter, 404 for an unknown one)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse
    from pydantic import BaseModel

    class LoadLoRAAdapterRequest(BaseModel):
        lora_name: str
        lora_path: str

    class UnloadLoRAAdapterRequest(BaseModel):
        lora_name: str
        lora_int_id: int | None = None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        body = await parse_body(raw, LoadLoRAAdapterRequest)
        try:
            await served.load(body.lora_name, body.lora_path)
        except ValueError as e:
            raise api_error(str(e), 400, "lora_path" if "lora_request" in str(e) else "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        body = await parse_body(raw, UnloadLoRAAdapterRequest)
        if not await served.unload(body.lora_name):
            raise api_error(f"The lora adapter '{body.lora_name}' cannot be found.", 404,
                            "lora_name")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
