"""The Serve app's ingress: our OpenAI server's completions and chat completions routes (the
same request models, validation, chat templates, tokenizing, streaming and error shapes:
`OpenAIServingCompletion` / `OpenAIServingChat`) over `ServeEngineClient`, which sends each
request to an engine replica through a Serve handle (the request router picks the replica by
the cache index).

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming too), GET /v1/models,
GET /health, GET /version, GET /v1/cache_index (the index's per-replica counters). A replica
that dies: the requests on it that produced nothing move to another replica, the others end
with `EngineDeadError` (a 503) saying so. LoRA adapters are not served through this app (a
request naming one is a 404 as for any unknown model).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from argparse import Namespace
from types import SimpleNamespace

from fastapi import Request  # NOTE: at module level: FastAPI resolves the routes' annotations

from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)

logger = logging.getLogger(__name__)

MAX_MOVES = 2  # times a request that produced nothing moves on from replicas that died

_ERRORS = {"value": ValueError, "queue_full": QueueFullError, "shutdown": EngineShutdownError,
           "dead": EngineDeadError, "step": EngineStepError}


class ServeEngineClient:
    """The calls the serving layer makes on an async engine (`tokenizer`, `engine`'s sizes and
    defaults, `add_request` -> `RequestStream`), answered by engine replicas behind `handle`.

    NOTE: the prompt is tokenized here (the ingress), so that the request router can route by
    its tokens; the replica gets the ids and never tokenizes it again.
    """

    def __init__(self, handle, model: str, engine_kwargs: dict, info: dict) -> None:
        from pagedserve.config import EngineArgs
        from pagedserve.engine.generation_config import diff_sampling_params
        from pagedserve.engine.processor import Processor
        from pagedserve.models.source import resolve_model
        from pagedserve.reasoning import make_reasoning_parser

        args = EngineArgs(model=model, **engine_kwargs)
        source = resolve_model(args.model, args.load_format)  # config and tokenizer, no weights
        tokenizer = source.load_tokenizer(args.tokenizer)
        self._handle = handle
        self.processor = Processor(tokenizer)
        name = getattr(args, "reasoning_parser", None)
        self.engine = SimpleNamespace(
            source=source, args=args, tokenizer=tokenizer,
            max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
            reasoner=make_reasoning_parser(name, tokenizer) if name else None,
            default_sampling_params=diff_sampling_params(
                source, args.generation_config, args.override_generation_config))
        self._calls: dict[str, tuple[asyncio.Task, object]] = {}  # request id -> pump, call

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    async def add_request(self, request_id: str, prompt: str | None, params,
                          prompt_token_ids: list[int] | None = None,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request=None) -> RequestStream:
        """Send a request to a replica; return its stream once the replica's engine accepted it
        (its refusal raises here, as `AsyncLLMEngine.add_request`)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not served by the Ray Serve app")
        if request_id in self._calls:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        ids = self.processor.prompt_ids(prompt, prompt_token_ids)
        request = {"request_id": request_id, "prompt": prompt, "prompt_token_ids": ids,
                   "params": params, "priority": priority,
                   "cache_salt": getattr(params, "cache_salt", None), "lora_id": None}
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        call = self._handle.options(stream=True).generate.remote(request)
        task = asyncio.ensure_future(self._pump(stream, call, request))
        self._calls[request_id] = (task, call)
        try:
            await stream.wait_accepted()
        except BaseException:
            stream.close()
            raise
        return stream

    async def _pump(self, stream: RequestStream, call, request: dict) -> None:
        """The replica's items into the stream. A replica that dies before the request produced
        anything: the request goes to another replica (nobody saw its loss), at most
        `MAX_MOVES` times; after its first output: `EngineDeadError` (a 503) saying so."""
        from ray.exceptions import RayActorError

        moves = 0
        try:
            while True:
                try:
                    await self._drain(stream, call)
                    return
                except RayActorError as e:
                    if stream._closed:  # the client left meanwhile
                        return
                    if stream.started or moves >= MAX_MOVES:
                        logger.warning("request %s lost with its replica: %s",
                                       stream.request_id, e)
                        stream._fail(EngineDeadError(
                            f"the engine replica running the request died ({_short(e)}); the "
                            "request is lost"))
                        return
                    moves += 1
                    logger.warning("request %s moved from a replica that died (%s)",
                                   stream.request_id, _short(e))
                    call = self._handle.options(stream=True).generate.remote(request)
                    self._calls[stream.request_id] = (asyncio.current_task(), call)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Serve could not reach a replica, or the replica's own failure
            logger.warning("request %s failed in its replica: %s", stream.request_id, e)
            stream._fail(EngineStepError(f"the engine replica failed: {_short(e)}"))
        finally:
            self._calls.pop(stream.request_id, None)

    @staticmethod
    async def _drain(stream: RequestStream, call) -> None:
        async for item in call:
            if isinstance(item, tuple):
                if item[0] == "accepted":
                    stream._accept()
                else:
                    stream._fail(_ERRORS.get(item[1], EngineStepError)(item[2]))
                    return
            else:
                stream._put(item)
        if not stream.finished:
            stream._fail(EngineStepError("the engine replica ended the request early"))

    # RequestStream's owner calls ------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        pass  # the pump ends by itself after the final output

    def _abort(self, request_id: str) -> None:
        entry = self._calls.pop(request_id, None)
        if entry is not None:
            task, call = entry
            call.cancel()  # the replica's generator is cancelled: it aborts the request
            task.cancel()


def _short(exc: BaseException) -> str:
    """A Ray error in one line for the client (a task error's cause, not its traceback)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def build_ingress_app(client: ServeEngineClient, server_options: dict, cache_index=None):
    """The FastAPI app of the ingress (see the module docstring)."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    import pagedserve
    from pagedserve.entrypoints.openai.api_server import _add_error_handlers, settings_from_args
    from pagedserve.entrypoints.openai.offload import CPUPool, json_response
    from pagedserve.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        ModelCard,
        ModelList,
        VersionResponse,
    )
    from pagedserve.entrypoints.openai.request_io import parse_body, respond
    from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

    settings = settings_from_args(Namespace(**server_options), client)
    pool = CPUPool()
    completions = OpenAIServingCompletion(client, settings, pool)
    chat = OpenAIServingChat(client, settings, pool)
    app = FastAPI(title="pagedserve (Ray Serve)", version=pagedserve.__version__)
    app.state.settings = settings
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        request = await parse_body(raw, CompletionRequest, pool)
        return await respond(raw, completions.create(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        request = await parse_body(raw, ChatCompletionRequest, pool)
        return await respond(raw, chat.create(request))

    @app.get("/v1/models")
    async def list_models():
        llm = client.engine
        return json_response(ModelList(data=[
            ModelCard(id=name, root=llm.source.name, max_model_len=llm.max_model_len)
            for name in settings.served_model_names]))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return json_response(VersionResponse(version=pagedserve.__version__))

    @app.get("/v1/cache_index")
    async def cache_index_stats():
        from fastapi.responses import JSONResponse

        return JSONResponse({} if cache_index is None else await cache_index.stats.remote())

    return app
