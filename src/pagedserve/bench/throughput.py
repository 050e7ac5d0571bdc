"""`pagedserve bench throughput`: offline throughput on a seeded trace, optionally side by side with
HF transformers' static batching on the same requests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedserve.engine.profiler import StepProfiler, ceiling_report
from pagedserve.bench.trace import TraceRequest, copy_trace, sharegpt_like_trace


@dataclass
class ThroughputResult:
    name: str
    elapsed_s: float
    num_requests: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def line(self) -> str:
        return (f"{self.name:>12}: {self.elapsed_s:8.2f} s  {self.requests_per_s:7.3f} req/s  "
                f"{self.output_tokens_per_s:8.1f} output tok/s  ({self.output_tokens} tokens)")


def run_pagedserve(llm, trace: list[TraceRequest], temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seed: int = 0, lora_requests=None) -> ThroughputResult:
    """Every request at once through the engine (continuous batching, ignore_eos); greedy, or
    sampled with request i seeded `seed + i`; `lora_requests`: one adapter (or None) each."""
    from pagedserve.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    sampled = temperature > 0.0
    params = [SamplingParams(temperature=temperature, top_p=top_p if sampled else 1.0,
                             top_k=top_k if sampled else 0, seed=seed + i if sampled else None,
                             max_tokens=r.output_len, ignore_eos=True)
              for i, r in enumerate(trace)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return ThroughputResult("pagedserve", elapsed, len(trace), produced)


def run_hf_static(hf_model, trace: list[TraceRequest], batch_size: int, pad_id: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0):
    """HF `generate` in static batches of `batch_size` in arrival order, each running until its
    longest request (what static batching costs); only the requested tokens count as output.
    Greedy, or sampled as ours when `temperature` > 0."""
    sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
                if temperature > 0.0 else dict(do_sample=False))
    produced = 0
    start = time.perf_counter()
    for i in range(0, len(trace), batch_size):
        batch = trace[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        steps = max(r.output_len for r in batch)
        with torch.inference_mode():
            hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                              min_new_tokens=steps, pad_token_id=pad_id, **sampling)
        produced += sum(r.output_len for r in batch)
    return ThroughputResult("hf-static", time.perf_counter() - start, len(trace), produced)


def load_hf_reference(source, dtype: torch.dtype):
    """The same model in HF transformers: from its folder, or built from the GGUF's config with
    the weights we dequantize (the same values HF's own GGUF loader produces)."""
    from transformers import AutoModelForCausalLM

    if source.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    state = {name: t.to(dtype) for name, t in source.iter_weights()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF reference: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def main(args) -> int:
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm import LLM

    lora = getattr(args, "lora", 0) or 0
    overrides = {}
    if lora:  # --lora N: an engine that serves N adapters at once (bench/lora.py)
        overrides = dict(enable_lora=True, max_loras=max(args.max_loras, lora),
                         max_lora_rank=max(args.max_lora_rank, 16),
                         max_cpu_loras=max(args.max_cpu_loras or 0, lora))
    llm = LLM.from_engine_args(EngineArgs.from_namespace(args, **overrides))
    engine = llm.engine
    if getattr(args, "trace", "sharegpt") == "copy":  # answers that quote their prompts
        trace = copy_trace(engine.tokenizer, args.num_prompts, input_len_mean=args.input_len_mean,
                           seed=args.seed, max_input_len=min(512, engine.max_model_len // 3))
    else:
        trace = sharegpt_like_trace(
            engine.tokenizer, args.num_prompts, input_len_mean=args.input_len_mean,
            output_len_mean=args.output_len_mean, output_len_fixed=args.output_len_fixed,
            seed=args.seed, max_input_len=min(1024, engine.max_model_len // 2),
            max_output_len=min(1024, engine.max_model_len // 2),
        )
    n_in = sum(len(r.prompt_token_ids) for r in trace)
    n_out = sum(r.output_len for r in trace)
    print(f"model={engine.source.name} dtype={engine.dtype} threads={torch.get_num_threads()} "
          f"tensor_parallel_size={args.tensor_parallel_size} "
          f"requests={len(trace)} input tokens={n_in} (mean {n_in / len(trace):.1f}) "
          f"output tokens={n_out} (mean {n_out / len(trace):.1f}) batch={args.max_num_seqs}")
    # A short warm-up so that both sides are measured warm.
    llm.generate([{"prompt_token_ids": trace[0].prompt_token_ids}], use_tqdm=False)
    if lora:
        from pagedserve.bench.lora import compare as compare_lora

        print(compare_lora(llm, trace, lora, run_pagedserve, seed=args.seed,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k))
        engine.shutdown()
        return 0
    if getattr(args, "structured", None) == "json":
        from pagedserve.bench.structured import compare

        print(compare(engine, trace, args.max_num_seqs, args.temperature, args.seed))
        engine.shutdown()
        return 0
    stats = getattr(engine.executor, "stats", None)
    if stats is not None:  # count the measured run only
        stats.reset()
    profiler = StepProfiler().attach(engine) if args.profile else None
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.temperature > 0.0:
        print(f"sampling: temperature={args.temperature} top_p={args.top_p} top_k={args.top_k} "
              f"(seeded per request)")
    ours = run_pagedserve(llm, trace, seed=args.seed, **sampling)
    print(ours.line())
    if engine.spec is not None:
        spec = engine.spec.summary()
        print("speculative decoding: {num_drafts} drafts, {num_draft_tokens} draft tokens, "
              "{num_accepted_tokens} accepted (acceptance rate {acceptance_rate:.2f}, mean "
              "acceptance length {mean_acceptance_length:.2f}), draft time share "
              "{draft_time_share:.3f}, {steps_off} steps off by the batch rule".format(**spec))
    if profiler is not None:
        profiler.detach()
        print(profiler.report(ours.elapsed_s))
        decode = profiler.kinds.get("decode", {})
        if decode.get("steps") and getattr(engine.executor, "runner", None) is not None:
            batch = round(decode["tokens"] / decode["steps"])
            print(ceiling_report(engine.executor.runner.model, batch,
                                 decode["step"] / decode["steps"]))
    if stats is not None:
        print(f"driver <-> workers: {stats.line()}")
    if args.baseline == "hf":
        hf = load_hf_reference(engine.source, engine.dtype)
        pad = engine.tokenizer.pad_token_id
        pad = pad if pad is not None else 0
        run_hf_static(hf, trace[:1], 1, pad)  # warm-up
        base = run_hf_static(hf, trace, args.max_num_seqs, pad, **sampling)
        print(base.line())
        print(f"ratio pagedserve / hf-static output tok/s: "
              f"{ours.output_tokens_per_s / base.output_tokens_per_s:.2f}x")
    engine.shutdown()
    return 0
