"""The OpenAI-compatible HTTP server: `build_app(engine, args)` (FastAPI) and `run_server(args)`
(uvicorn, with graceful shutdown on SIGINT/SIGTERM).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET
/v1/responses/{id}, POST /v1/responses/{id}/cancel), Anthropic's POST /v1/messages and
/v1/messages/count_tokens, vLLM's operations routes (`vllm_routes`), GET /v1/models, GET /health,
the pooling routes of `serving_pooling` (POST /v1/embeddings, /pooling, /score, /rerank, ...),
GET|POST /ping, GET /version, POST /tokenize, POST /detokenize, GET /metrics, and with
`--enable-debug-endpoints` (tests and diagnosis only) GET /debug/engine, POST
/debug/profile/start and /debug/profile/stop (per-section step timings), GET /debug/memory and
POST /debug/memory/trim (RSS by mapping, malloc's arenas, object counts), POST
/debug/tracemalloc/start and GET /debug/tracemalloc/snapshot. Every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}`; request validation errors are 400s, bodies
over `--max-request-bytes` are 413s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from argparse import Namespace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai import debug_memory as debug_mem
from pagedserve.entrypoints.openai.auth import APIKeyMiddleware
from pagedserve.entrypoints.openai.cli_args import load_chat_template
from pagedserve.entrypoints.openai.errors import APIError, status_phrase
from pagedserve.entrypoints.openai.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    RequestSizeLimitMiddleware,
)
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.entrypoints.openai.offload import CPUPool, json_response
from pagedserve.entrypoints.openai.request_io import (  # noqa: F401 (re-exported)
    parse_body,
    parse_json,
    respond,
    run_until_disconnect,
    validation_error,
)
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    VersionResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    add_responses_routes,
)
from pagedserve.entrypoints.openai.serving_engine import ServerSettings
from pagedserve.entrypoints.openai.serving_messages import (
    OpenAIServingMessages,
    add_messages_routes,
)
from pagedserve.entrypoints.openai.serving_pooling import add_pooling_routes
from pagedserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedserve.entrypoints.openai.vllm_routes import (
    LoadTracker,
    RequestIdMiddleware,
    add_cors,
    add_operations_routes,
    add_vllm_routes,
)

logger = logging.getLogger("pagedserve.server")

DEFAULT_MAX_QUEUED_REQUESTS = 4096


def settings_from_args(args: Namespace, engine: AsyncLLMEngine) -> ServerSettings:
    """ServerSettings from parsed CLI arguments (missing attributes take their defaults)."""
    names = getattr(args, "served_model_name", None) or [engine.engine.source.name]
    if isinstance(names, str):
        names = [names]
    api_key = getattr(args, "api_key", None) or os.environ.get("PAGEDSERVE_API_KEY") or None
    if isinstance(api_key, list):  # several --api-key values: any of them (vLLM's)
        api_key = api_key if len(api_key) > 1 else api_key[0]
    return ServerSettings(
        served_model_names=list(names),
        max_n=getattr(args, "max_n", 16),
        api_key=api_key,
        protect_metrics=not getattr(args, "no_protect_metrics", False),
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
        enable_force_include_usage=getattr(args, "enable_force_include_usage", False),
        chat_template=load_chat_template(getattr(args, "chat_template", None)),
        tool_call_parser=(getattr(args, "tool_call_parser", None)
                          if getattr(args, "enable_auto_tool_choice", False) else None),
        response_role=getattr(args, "response_role", "assistant"),
        default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None),
        chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),
        exclude_tools_when_tool_choice_none=getattr(args, "exclude_tools_when_tool_choice_none",
                                                    False),
        stream_interval=getattr(args, "stream_interval", 1),
        log_requests=getattr(args, "enable_log_requests", False),
        log_outputs=getattr(args, "enable_log_outputs", False),
        max_log_len=getattr(args, "max_log_len", None),
    )


def build_app(engine: AsyncLLMEngine, args: Namespace) -> FastAPI:
    """The FastAPI app serving `engine` (started by the app's lifespan, stopped at its end)."""
    settings = settings_from_args(args, engine)
    from pagedserve.lora.serving import add_lora_routes, served_loras

    settings.loras = served_loras(engine, args, settings.served_model_names)  # --enable-lora
    prefix = getattr(args, "metrics_prefix", "pagedserve") + ":"
    num_engines = getattr(engine.engine, "num_engines", 1)
    if num_engines > 1:  # data parallelism: per-core series with vLLM's `engine` label
        from pagedserve.entrypoints.openai.metrics import EngineMetrics

        metrics = EngineMetrics(settings.model_name, num_engines, prefix=prefix)
    else:
        metrics = ServerMetrics(settings.model_name, prefix=prefix)
    metrics.set_cache_config(_cache_config(engine.engine))
    engine.add_listener(metrics)
    pool = CPUPool()
    completions = OpenAIServingCompletion(engine, settings, pool)
    chat = OpenAIServingChat(engine, settings, pool)
    tokenization = OpenAIServingTokenization(chat)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.started:
            engine.start()
        yield
        await engine.shutdown()
        pool.shutdown()

    docs = {} if not getattr(args, "disable_fastapi_docs", False) else {
        "openapi_url": None, "docs_url": None, "redoc_url": None}  # --disable-fastapi-docs
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, **docs)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings
    _add_error_handlers(app)
    if settings.api_key:
        open_paths = {"/health", "/ping"} | (set() if settings.protect_metrics else {"/metrics"})
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key,
                           open_paths=frozenset(open_paths))
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdMiddleware)
    # NOTE: added last, so it runs first: a huge body is refused before authentication reads
    # anything else.
    app.add_middleware(RequestSizeLimitMiddleware,
                       max_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
    # NOTE: outermost: preflights are answered before authentication, and every answer (401 and
    # 413 too) carries the CORS headers a browser needs to read it.
    add_cors(app, args)

    load = LoadTracker(app, getattr(args, "enable_server_load_tracking", False))

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        with load.track() as done:
            request = await parse_body(raw, CompletionRequest, pool)
            return done(await respond(raw, completions.create(request)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        with load.track() as done:
            request = await parse_body(raw, ChatCompletionRequest, pool)
            return done(await respond(raw, chat.create(request)))

    # OpenAI's Responses API (serving_responses.py); kept only with the store enabled
    add_responses_routes(app, OpenAIServingResponses(chat, enable_store=getattr(
        args, "enable_responses_api_store", False)), load, pool, parse_body, respond)

    # Anthropic's Messages API (serving_messages.py)
    add_messages_routes(app, OpenAIServingMessages(chat), load, pool, parse_body, respond)

    add_vllm_routes(app, engine, settings, completions, chat, pool,
                    tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint",
                                                    False))
    add_operations_routes(app, engine, args)  # /sleep, /pause, /abort_requests, ... (vLLM's)
    add_pooling_routes(app, engine, settings, pool)  # embeddings, pooling, score, rerank

    if settings.loras is not None and getattr(args, "allow_runtime_lora_updating", False):
        add_lora_routes(app, settings.loras, parse_body, APIError)

    @app.get("/v1/models")
    async def list_models():
        llm = engine.engine
        cards = [ModelCard(id=name, root=llm.source.name, max_model_len=llm.max_model_len)
                 for name in settings.served_model_names]
        if settings.loras is not None:  # each adapter, its parent the base model (vLLM's)
            cards += [ModelCard(id=name, root=lora.lora_path, parent=settings.model_name,
                                max_model_len=llm.max_model_len)
                      for name, lora in settings.loras.by_name.items()]
        return json_response(ModelList(data=cards))

    @app.get("/health")
    async def health():
        if engine.errored:
            return APIError("the engine has stopped after an error", 503).response()
        if not engine.accepting:
            return APIError("the server is not accepting requests", 503).response()
        lost = getattr(engine, "lost_engines", None)
        if lost:  # data parallelism: the other engine cores serve on
            return Response(json.dumps({
                "status": "degraded",
                "lost_engines": [{"engine": i, "reason": reason,
                                  "restarted": bool(engine.engine.restart_lost_cores)}
                                 for i, reason in sorted(lost.items())]}),
                media_type="application/json")
        return Response(status_code=200)

    # NOTE: one function per method: a route of two methods gives both one operation id, which
    # FastAPI warns about ("Duplicate Operation ID") when it builds /openapi.json.
    @app.get("/ping")
    async def ping():
        """vLLM's (SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @app.post("/ping")
    async def ping_post():
        """vLLM's (SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @app.get("/version")
    async def version():
        return json_response(VersionResponse(version=pagedserve.__version__))

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        request = await parse_body(raw, TokenizeRequest, pool)
        return await pool.run(lambda: json_response(tokenization.tokenize(request)))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        request = await parse_body(raw, DetokenizeRequest, pool)
        return await pool.run(lambda: json_response(tokenization.detokenize(request)))

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    if getattr(args, "enable_debug_endpoints", False):
        @app.get("/debug/engine")
        async def debug_engine():
            """The block pools and queues, after `LLMEngine.check_invariants()` (run on the
            engine thread between steps); 500 naming the broken invariant otherwise."""
            try:
                state = await engine.call_in_engine_thread(_engine_state)
            except RuntimeError as e:
                raise APIError(f"engine invariant check failed: {e}", 500) from e
            return Response(json.dumps(state), media_type="application/json")

        profiler_box: dict[str, Any] = {}

        async def _profile_call(fn) -> Response:
            """`fn(llm)` on the engine thread, its dict as JSON; its ValueError as a 400."""
            try:
                state = await engine.call_in_engine_thread(fn)
            except ValueError as e:
                raise APIError(str(e), 400) from e
            return Response(json.dumps(state), media_type="application/json")

        @app.post("/debug/profile/start")
        async def debug_profile_start():
            """Start timing every engine step by section (`pagedserve bench serve --profile`)."""
            from pagedserve.engine.profiler import StepProfiler

            def attach(llm):
                old = profiler_box.pop("profiler", None)
                if old is not None:
                    old.detach()
                profiler_box["profiler"] = StepProfiler().attach(llm)
                return {"started": True}

            return await _profile_call(attach)

        @app.post("/debug/profile/stop")
        async def debug_profile_stop(wall_s: float | None = None):
            """Stop profiling; the per-section seconds and the printed table."""
            def detach(llm):
                prof = profiler_box.pop("profiler", None)
                if prof is None:
                    raise ValueError("no profile is running: POST /debug/profile/start first")
                prof.detach()
                return {
                    "kinds": {k: dict(v) for k, v in prof.kinds.items()},
                    "breakdown": prof.breakdown("all", wall_s),
                    "report": prof.report(wall_s),
                }

            return await _profile_call(detach)

        # --- memory (scripts/soak.py; docs/reliability.md "Soak") ---------------------------

        @app.get("/debug/memory")
        async def debug_memory(objects: int = 0):
            """RSS by kind of mapping, glibc malloc's arenas and, with `objects=N`, the N most
            common types of the objects the garbage collector tracks."""
            state = debug_mem.memory_report(*_memory_tensors(engine.engine), objects=objects)
            return Response(json.dumps(state), media_type="application/json")

        @app.post("/debug/memory/trim")
        async def debug_memory_trim():
            """`gc.collect()` + glibc `malloc_trim(0)` on the engine thread between steps (the
            loader does the trim after loading): how much of RSS malloc was holding freed."""
            state = await engine.call_in_engine_thread(lambda _llm: debug_mem.trim())
            return Response(json.dumps(state), media_type="application/json")

        @app.post("/debug/tracemalloc/start")
        async def debug_tracemalloc_start(frames: int = 1):
            """Start tracing Python allocations (`tracemalloc`, `frames` deep) and keep a
            first snapshot to compare against; restarts a running trace."""
            try:
                profiler_box["tracemalloc"] = debug_mem.tracemalloc_start(frames)
            except ValueError as e:
                raise APIError(str(e), 400) from e
            return Response(json.dumps({"started": True, "frames": frames}),
                            media_type="application/json")

        @app.get("/debug/tracemalloc/snapshot")
        async def debug_tracemalloc_snapshot(top: int = 20, stop: bool = False):
            """The `top` allocation sites by growth since /debug/tracemalloc/start (Python
            objects and buffers only: tensor storage is not traced); `stop=true` ends it."""
            try:
                body = debug_mem.tracemalloc_snapshot(profiler_box.get("tracemalloc"), top, stop)
            except ValueError as e:
                raise APIError(str(e), 400) from e
            if stop:
                profiler_box.pop("tracemalloc", None)
            return Response(json.dumps(body), media_type="application/json")

    return app


def _cache_config(llm) -> dict[str, Any]:
    """The KV cache's configuration for `cache_config_info`."""
    kv = llm.kv_manager
    cpu = getattr(kv, "cpu_pool", None)
    return {
        "block_size": kv.block_size,
        "num_gpu_blocks": kv.num_blocks,
        "num_cpu_blocks": cpu.num_blocks if cpu is not None else 0,
        "enable_prefix_caching": getattr(kv, "enable_prefix_caching", False),
        "preemption_mode": getattr(llm.args, "preemption_mode", None),
    }


def _engine_state(llm) -> dict[str, Any]:
    """Check the engine's invariants and report its pools and queues (on the engine thread)."""
    if hasattr(llm, "engine_states"):  # engine cores in their own processes: summed over them
        states = llm.engine_states()
        total = {k: sum(st[k] for st in states) for k in
                 ("used_blocks", "num_blocks", "running", "waiting", "swapped", "groups",
                  "preemptions")}
        return {"invariants_ok": True, "used_cpu_blocks": 0, **total, "engines": states}
    llm.check_invariants()
    kv = llm.kv_manager
    cpu = getattr(kv, "cpu_pool", None)
    return {
        "invariants_ok": True,
        "used_blocks": llm.num_used_blocks(),
        "num_blocks": kv.num_blocks,
        "used_cpu_blocks": cpu.num_used if cpu is not None else 0,
        "running": len(llm.scheduler.running),
        "waiting": len(llm.scheduler.waiting),
        "swapped": len(llm.scheduler.swapped),
        "groups": len(llm.groups),
        "preemptions": llm.scheduler.num_preemptions,
    }


def _memory_tensors(llm) -> tuple[list, list]:
    """The KV cache tensors and the model's parameters and buffers held in this process (none
    when they live in worker processes), for `debug_memory.memory_report`."""
    kv = getattr(llm.executor, "kv_cache", None)
    kv_tensors = [t for pairs in (getattr(kv, "layers", None) or [],
                                  getattr(kv, "cpu_layers", None) or [])
                  for k, v in pairs for t in (k, v) if t is not None]  # MLA: V None
    model = getattr(llm, "model", None)
    params = [*model.parameters(), *model.buffers()] if model is not None else []
    return kv_tensors, params


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return APIError(detail, exc.status_code, headers=getattr(exc, "headers", None),
                        kind=status_phrase(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return APIError(f"internal server error: {exc!r}", 500).response()


# --- running -----------------------------------------------------------------------------------


def run_server(args: Namespace) -> int:
    """Load the model, serve it until SIGINT/SIGTERM, return the exit code (0 after a graceful
    shutdown)."""
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_namespace(args)
    if getattr(args, "disable_access_log_for_endpoints", None):
        _quiet_access_log(args.disable_access_log_for_endpoints)
    options = dict(
        max_queued_requests=getattr(args, "max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS),
        log_stats_interval=getattr(args, "log_stats_interval", 10.0) or None)
    if engine_args.data_parallel_size > 1 or engine_args.engine_core_process:
        # the engine cores in their own processes, this process the front end (vLLM v1's)
        from pagedserve.engine.async_mp_engine import AsyncMPEngine
        from pagedserve.engine.mp_engine import FrontEnd

        engine = AsyncMPEngine(FrontEnd(engine_args), **options)
    else:
        engine = AsyncLLMEngine(LLMEngine(engine_args), **options)
    app = build_app(engine, args)
    tls = {name: getattr(args, name) for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
                                                 "ssl_ciphers") if getattr(args, name, None)}
    if tls:
        tls["ssl_cert_reqs"] = getattr(args, "ssl_cert_reqs", 0)
    # NOTE: http="h11" with it: uvicorn's "auto" picks httptools when installed (ray[serve]
    # brings it), which ignores the h11 limit
    extra = {"h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
             "http": "h11"} if getattr(args, "h11_max_incomplete_event_size", None) else {}
    config = uvicorn.Config(
        app, host=args.host, port=args.port, lifespan="on", uds=getattr(args, "uds", None),
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_access_log", False),
        timeout_graceful_shutdown=getattr(args, "graceful_shutdown_timeout", 10),
        root_path=getattr(args, "root_path", None) or "", **tls, **extra,
    )
    server = GracefulServer(config, engine, app.state.settings.model_name,
                            drain_timeout=getattr(args, "shutdown_timeout", None))
    server.run()
    if engine.errored:
        logger.error("exiting: the engine died (%r)", engine._dead)
        return 1
    return 0 if server.started else 1


def _quiet_access_log(paths: str) -> None:
    """--disable-access-log-for-endpoints: no uvicorn access line for these paths."""
    skip = {p.strip() for p in paths.split(",") if p.strip()}

    class _Skip(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            args = record.args if isinstance(record.args, tuple) else ()
            path = str(args[2]).split("?", 1)[0] if len(args) > 2 else ""
            return path not in skip

    logging.getLogger("uvicorn.access").addFilter(_Skip())


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGINT/SIGTERM it ends the requests in flight (an
    error chunk for streams, 503 otherwise) while uvicorn stops accepting connections, and it
    exits normally afterwards instead of re-raising the signal (so the process exits 0).

    With `drain_timeout` (--shutdown-timeout S > 0), the first signal drains instead: new
    requests get 503 (and /health turns 503) while those in flight run on for up to S seconds;
    then the rest are ended as above and the server exits 0. A second signal ends them at once.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, model_name: str,
                 drain_timeout: float | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.model_name = model_name
        self.drain_timeout = drain_timeout if drain_timeout and drain_timeout > 0 else None
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        # NOTE: a dead engine (e.g. a tensor-parallel worker killed) cannot serve again: stop the
        # server, which then exits non-zero (see run_server).
        self.engine.add_death_listener(lambda exc: setattr(self, "should_exit", True))
        await super().startup(sockets)
        if self.started:
            scheme = "https" if self.config.ssl_certfile else "http"
            where = (f"unix:{self.config.uds}" if self.config.uds
                     else f"{scheme}://{self.config.host}:{self.config.port}")
            logger.info("pagedserve ready: model %r at %s (OpenAI API under /v1)",
                        self.model_name, where)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if (self.drain_timeout is not None and not self.draining and not self.should_exit
                and self._loop is not None):
            self.draining = True
            logger.info("draining (signal %d): refusing new requests, waiting up to %.1f s for "
                        "%d in flight", sig, self.drain_timeout, self.engine.num_in_flight)
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            logger.info("shutting down (signal %d): ending the requests in flight", sig)
            self._loop.call_soon_threadsafe(self.engine.begin_shutdown)

    def _start_drain(self) -> None:
        self.engine.stop_accepting()
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Wait for the requests in flight (at most `drain_timeout` s), then shut down."""
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.num_in_flight and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        left = self.engine.num_in_flight
        if left:
            logger.info("drain timeout: ending %d request(s) still in flight", left)
        else:
            logger.info("drained: every request in flight finished")
        self.engine.begin_shutdown()
        self.should_exit = True


__all__ = ["GracefulServer", "build_app", "parse_body", "run_server"]
