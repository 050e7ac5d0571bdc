"""pagedserve on Ray Serve: `build_app(model, ...)` returns a Serve application of

- an ingress deployment (`ingress.py`: our OpenAI server's completions and chat completions
  routes, streaming too, over Serve handles), and
- an engine deployment (`replica.py`: each replica one engine with its own KV cache), whose
  replicas Serve starts and stops with load (`autoscaling_config`) or keeps at `num_replicas`,

routed by `CacheAffinityRouter` (`request_router.py`, Serve's request router in the ingress),
which asks the app's `CacheIndex` (`cache_index.py`: the data-parallel front end's `Router` and
`PrefixIndex`, fed by the KV cache events every replica reports each step) for the replica
holding the request's longest cached prefix, unless that replica's load exceeds the least
loaded one's by `load_threshold` tokens (`routing` as `--data-parallel-routing`: "prefix",
"least-load", "round-robin").

    from ray import serve
    from pagedserve.entrypoints.ray_serve import build_app

    app = build_app("path/to/model", engine_kwargs={"dtype": "float32"},
                    autoscaling_config={"min_replicas": 1, "max_replicas": 4,
                                        "target_ongoing_requests": 16})
    serve.run(app, name="pagedserve", route_prefix="/")

CLI: `pagedserve serve MODEL --ray-serve [--ray-serve-replicas N | --ray-serve-autoscaling
JSON]`. Needs `pip install 'pagedserve[serve]'` (ray[serve]).
"""

from __future__ import annotations

from pagedserve.engine.dp_router import DEFAULT_LOAD_THRESHOLD, ROUTING_POLICIES

ROUTER_CLASS = "pagedserve.entrypoints.ray_serve.request_router.CacheAffinityRouter"
DEFAULT_MAX_ONGOING_REQUESTS = 64  # per engine replica: it batches them (Serve's default is 5)
INGRESS_MAX_ONGOING_REQUESTS = 1024  # the ingress only waits on replicas
SERVER_OPTIONS = ("served_model_name", "max_n", "enable_prompt_tokens_details",
                  "return_tokens_as_token_ids", "enable_force_include_usage", "chat_template",
                  "response_role", "default_chat_template_kwargs",
                  "chat_template_content_format", "exclude_tools_when_tool_choice_none",
                  "stream_interval", "enable_auto_tool_choice", "tool_call_parser")


class Ingress:
    """The ingress deployment's class (Serve wraps it with `serve.ingress()`; its app is built
    per replica by `__serve_build_asgi_app__`)."""

    async def __init__(self, engine_handle, model: str, engine_kwargs: dict,
                       server_options: dict, app_name: str) -> None:
        from pagedserve.entrypoints.ray_serve.ingress import ServeEngineClient

        info = await engine_handle.info.remote()
        self._client = ServeEngineClient(engine_handle, model, engine_kwargs, info)
        self._server_options = server_options
        self._app_name = app_name

    async def __serve_build_asgi_app__(self):
        from pagedserve.entrypoints.ray_serve.actors import existing_cache_index
        from pagedserve.entrypoints.ray_serve.ingress import build_ingress_app

        try:
            index = existing_cache_index(self._app_name)
        except ValueError:
            index = None
        return build_ingress_app(self._client, self._server_options, index)


def build_app(model: str, *, engine_kwargs: dict | None = None, num_replicas: int | None = None,
              autoscaling_config: dict | None = None, routing: str = "prefix",
              load_threshold: int = DEFAULT_LOAD_THRESHOLD, name: str = "pagedserve",
              server_options: dict | None = None,
              max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
              ray_actor_options: dict | None = None,
              ingress_ray_actor_options: dict | None = None):
    """A Ray Serve application serving `model` (see the module docstring); run it with
    `serve.run(app, name=name)`.

    engine_kwargs: `EngineArgs` fields for every replica's engine (as `LLM(model, **kwargs)`).
    num_replicas / autoscaling_config: Serve's (one of them; neither: one replica).
    routing, load_threshold: `--data-parallel-routing`, `--data-parallel-load-threshold`.
    name: the app's name (the deployments' and the cache index actor's names derive from it:
    two apps on one cluster need two names).
    server_options: our server's options for the routes (served_model_name, chat_template, ...).
    ray_actor_options: each engine replica's (e.g. {"num_cpus": 4}).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedserve.config import EngineArgs
    from pagedserve.entrypoints.ray_serve.replica import EngineReplica

    if routing not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
    if load_threshold < 0:
        raise ValueError(f"load_threshold must be >= 0, got {load_threshold}")
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests}")
    engine_kwargs = dict(engine_kwargs or {})
    args = EngineArgs(model=model, **engine_kwargs)  # ValueError naming a bad option, here
    options = {k: v for k, v in (server_options or {}).items() if v is not None}
    unknown = sorted(set(options) - set(SERVER_OPTIONS))
    if unknown:
        raise ValueError(f"server_options: unknown option(s) {unknown} (known: "
                         f"{list(SERVER_OPTIONS)})")
    routing_state = {"policy": routing, "block_size": args.block_size, "threshold": load_threshold}
    scale = ({"autoscaling_config": autoscaling_config} if autoscaling_config is not None
             else {"num_replicas": num_replicas or 1})
    engine = serve.deployment(EngineReplica).options(
        name=f"{name}-engine", max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=ray_actor_options or {"num_cpus": 1},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"app_name": name, **routing_state}),
        **scale)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name=f"{name}-ingress", max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options=ingress_ray_actor_options or {"num_cpus": 0})
    return ingress.bind(engine.bind(model, engine_kwargs, name, routing_state), model,
                        engine_kwargs, options, name)
