"""Long prompts on the embedded Gemma 3 270M (issue 36's capacity and prompt-throughput trace):
N prompts of L tokens (cut from the bench corpus) and M output tokens, all added at once, on
one engine at a KV budget; prints the sequences held at once (peak running), preemptions, and
prompt and output tokens per second of the run (tokens / wall time from the first step to the
last), as one line of JSON too.

    python scripts/bench_long_prompts.py                          # 8 x 8192 + 256, 256 MiB
    python scripts/bench_long_prompts.py --kv-cache-memory 2147483648 --num-prompts 16
    python scripts/bench_long_prompts.py --disable-hybrid-kv-cache-manager   # one group
    python scripts/bench_long_prompts.py --kv-cache-dtype fp8                # half the KV bytes

Runs against whatever `pagedserve` is importable (PYTHONPATH=/other/src for another checkout;
flags that checkout lacks are left out). Timings on a shared machine are noise: rerun it quiet.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prompt-budget-per-decode-row", type=int, default=None,
                    help="the engine's option (default: the engine's default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    ap.add_argument("--model", default=None, help="default: the embedded Gemma 3 270M")
    args = ap.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.trace import corpus_text
    from pagedserve.config import EngineArgs

    if args.model is None:  # NOTE: not None: no model now means the default chat model (SmolLM2)
        from pagedserve.models.embedded import embedded_model_path
        args.model = str(embedded_model_path())
    options = dict(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.prompt_len + args.output_len,
                   enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    if args.prompt_budget_per_decode_row is not None:
        options["prompt_budget_per_decode_row"] = args.prompt_budget_per_decode_row
    if args.disable_hybrid_kv_cache_manager:
        options["disable_hybrid_kv_cache_manager"] = True
    known = {f for f in EngineArgs.__dataclass_fields__}
    llm = LLM(**{k: v for k, v in options.items() if k in known})
    engine = llm.engine
    corpus = engine.tokenizer(corpus_text(), add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i in range(args.num_prompts):
        start = (i * 7919) % (len(corpus) - args.prompt_len)
        engine.add_request(str(i), None, params,
                           prompt_token_ids=corpus[start : start + args.prompt_len])
    peak = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    wall = time.perf_counter() - t0
    result = dict(
        hybrid=not args.disable_hybrid_kv_cache_manager and "disable_hybrid_kv_cache_manager" in known,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory, num_blocks=engine.num_kv_blocks,
        max_concurrency=getattr(engine, "max_concurrency", None), peak_running=peak,
        prompt_budget_per_decode_row=getattr(engine.scheduler.config, "prompt_budget_per_decode_row", None),
        preemptions=engine.scheduler.num_preemptions, steps=steps, seconds=round(wall, 1),
        prompt_tokens_per_s=round(engine.stats["prompt_tokens"] / wall, 1),
        output_tokens_per_s=round(engine.stats["generation_tokens"] / wall, 1))
    print(f"{args.num_prompts} prompts of {args.prompt_len} + {args.output_len}: peak running "
          f"{peak}, {result['preemptions']} preemptions, {wall:.0f} s; prompt "
          f"{result['prompt_tokens_per_s']} tokens/s, output {result['output_tokens_per_s']} "
          "tokens/s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
