"""The `pagedserve` command: `generate`, `serve` and the `bench` benchmarks."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    QUANTIZATIONS,
    EXECUTOR_BACKENDS,
    LOAD_FORMATS,
)
from pagedserve.core.contiguous import KV_ALLOCATORS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand."""
    p.add_argument("--model", default=None,
                   help="HF folder, GGUF file or hub id (default: the embedded Gemma 3 270M)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="CPU weights: none (dequantize to --dtype), gguf (keep a GGUF file's "
                        "quantized tensors; the default for GGUF files) or int8 (per-channel, at load)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over steps (default on)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes (default on)")
    p.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    p.add_argument("--swap-space", type=float, default=4.0, help="CPU swap pool in GiB")
    p.add_argument("--num-cpu-blocks", type=int, default=None)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--kv-allocator", default="paged", choices=KV_ALLOCATORS,
                   help="KV memory manager: paged (production) or an Orca-style contiguous "
                        "reservation baseline, for benchmarks only")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="workers sharing every layer (Megatron-style tensor parallelism)")
    p.add_argument("--distributed-executor-backend", default=None, choices=EXECUTOR_BACKENDS,
                   help="uni: in this process; mp: worker processes on this machine; ray: Ray "
                        "actors (default: uni for one worker, mp for more)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join with the ray backend (default: a Ray instance "
                        "running on this machine, else a new local one)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and the KV cache "
                        "(CUDA; the KV cache gets what a profiled step leaves)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every step eagerly")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: triton on CUDA when available, else torch")
    p.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction,
                   default=False, help="load no tokenizer: token-id prompts, no output text")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from pagedserve.config import EngineArgs

    names = set(EngineArgs.field_names()) - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        for comp in out.outputs:
            print(out.prompt + comp.text if args.echo else comp.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
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
    from pagedserve.entrypoints.openai.api_server import run_server

    return run_server(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_kind == "throughput":
        from pagedserve.bench.throughput import main

        return main(args)
    if args.bench_kind == "preemption":
        from pagedserve.bench.preemption import main

        return main(args)
    if args.bench_kind == "serve":
        from pagedserve.bench.serve import main

        return main(args)
    if args.bench_kind == "memory":
        from pagedserve.bench.memory import main

        return main(args)
    if args.bench_kind == "paper":
        from pagedserve.bench.paper import main

        return main(args)
    if args.bench_kind == "latency":
        from pagedserve.bench.latency import main

        return main(args)
    raise ValueError(f"unknown benchmark {args.bench_kind!r}")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server options of `pagedserve serve` (the engine's come from `add_engine_args`)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF folder, GGUF file or hub id (default: the embedded Gemma 3 270M)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $PAGEDSERVE_API_KEY, else none)")
    p.add_argument("--no-protect-metrics", action="store_true",
                   help="leave /metrics open when --api-key is set")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model's name); the first is "
                        "the one reported in responses")
    p.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    p.add_argument("--max-queued-requests", type=int, default=4096,
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
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-access-log", action="store_true")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="seconds to wait for connections to close on SIGINT/SIGTERM")


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The seeded ShareGPT-like trace's options (shared by the benchmarks)."""
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-mean", type=float, default=161.0)
    p.add_argument("--output-len-mean", type=float, default=128.0)
    p.add_argument("--output-len-fixed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (offline)")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    add_engine_args(gen)
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
    add_engine_args(tp)
    tp.set_defaults(func=cmd_bench, max_num_seqs=16)

    pre = bench_sub.add_parser("preemption", help="swap vs recompute by block size (Fig. 19)")
    add_trace_args(pre)
    pre.add_argument("--swap-seqs", type=int, default=8,
                     help="sequences swapped / recomputed in part (a)")
    pre.add_argument("--block-sizes", type=int, nargs="+",
                     default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    pre.add_argument("--kv-blocks", type=int, default=None,
                     help="KV blocks (of 16 tokens) in part (b); default: one request's worth")
    pre.add_argument("--plot", default="preemption.png")
    add_engine_args(pre)
    pre.set_defaults(func=cmd_bench, num_prompts=24)

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
    add_engine_args(lat)
    lat.set_defaults(func=cmd_bench, max_num_seqs=None, skip_tokenizer_init=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
