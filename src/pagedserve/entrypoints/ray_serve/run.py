"""`pagedserve serve MODEL --ray-serve`: the Serve app of `build_app` from the serve flags, run on
the Ray cluster at --ray-address or $RAY_ADDRESS (else a local one) until SIGINT / SIGTERM."""

from __future__ import annotations

import json
import logging
import signal
import threading
from argparse import Namespace

logger = logging.getLogger(__name__)

APP_NAME = "pagedserve"


def engine_kwargs_from_args(args: Namespace) -> dict:
    """The `EngineArgs` fields the flags set to other than their defaults (the replicas' engine
    options; the data-parallel ones stay with the ingress's router)."""
    from pagedserve.config import EngineArgs

    ours = EngineArgs.from_namespace(args)
    default = EngineArgs()
    skip = {"model", "ray_address", "data_parallel_size", "data_parallel_backend",
            "data_parallel_routing", "data_parallel_load_threshold", "data_parallel_restart_lost"}
    return {name: getattr(ours, name) for name in EngineArgs.field_names()
            if name not in skip and getattr(ours, name) != getattr(default, name)}


def app_from_args(args: Namespace):
    """`build_app`'s application for the parsed serve flags."""
    from pagedserve.entrypoints.ray_serve import SERVER_OPTIONS, build_app

    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size does not apply with --ray-serve: use "
                         "--ray-serve-replicas or --ray-serve-autoscaling")
    autoscaling = None
    if args.ray_serve_autoscaling is not None:
        try:
            autoscaling = json.loads(args.ray_serve_autoscaling)
        except ValueError as e:
            raise ValueError(f"--ray-serve-autoscaling must be a JSON object: {e}") from None
        if not isinstance(autoscaling, dict):
            raise ValueError("--ray-serve-autoscaling must be a JSON object, got "
                             f"{args.ray_serve_autoscaling!r}")
    if args.ray_serve_cpus_per_replica <= 0:
        raise ValueError("--ray-serve-cpus-per-replica must be > 0, got "
                         f"{args.ray_serve_cpus_per_replica}")
    server = {name: getattr(args, name) for name in SERVER_OPTIONS
              if getattr(args, name, None) is not None}
    return build_app(
        args.model, engine_kwargs=engine_kwargs_from_args(args),
        num_replicas=args.ray_serve_replicas, autoscaling_config=autoscaling,
        routing=args.data_parallel_routing, load_threshold=args.data_parallel_load_threshold,
        name=APP_NAME, server_options=server,
        ray_actor_options={"num_cpus": args.ray_serve_cpus_per_replica})


def run_ray_serve(args: Namespace) -> int:
    """Deploy the app, serve until SIGINT / SIGTERM, then shut Serve down; returns 0."""
    import ray
    from ray import serve

    app = app_from_args(args)  # the flags' ValueErrors before anything starts
    ray.init(address=getattr(args, "ray_address", None), ignore_reinit_error=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info("serving %s on Ray Serve at http://%s:%d", args.model, args.host, args.port)
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        stop.wait()
    except KeyboardInterrupt:  # SIGINT while Serve was starting
        pass
    finally:
        serve.shutdown()
    return 0
