"""`pagedserve bench step-overhead`: what one engine step costs outside the model, per phase.

The real `LLMEngine` (scheduler, KV block manager, step input, step update with incremental
detokenization, output building) drives N running decode sequences; the model is replaced by a
fake executor that returns a random token per sampled row at once, so every millisecond measured
is the engine's own. By default the model is a tiny random Llama (hidden 128, 3 layers, a 1k BPE
vocabulary trained on the bench corpus) with dummy weights, which never run.

For each N it prints ms per step and us per sequence of: schedule, step input (the rest of
`LLMEngine.step` around the phases: building the step input, bookkeeping), the fake model,
update (the step update: appending tokens, stops, incremental detokenization) and outputs
(building the `RequestOutput`s), each timed by wrappers over `steps` steps, and the total: the
whole `LLMEngine.step` timed over `steps` more steps without the wrappers (whose own cost, a
few calls per sequence, the phases include). `--profile` adds a cProfile of the measured
steps at the largest N (top functions by own time).

The file also runs as a script against another checkout (to profile a version without this
benchmark): `PYTHONPATH=/other/src python src/pagedserve/bench/step_overhead.py --sizes 256`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

DEFAULT_SIZES = (64, 256, 1024, 4096)
PHASES = ("schedule", "step input", "model (fake)", "update", "outputs")


def add_bench_step_overhead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                   help="running decode sequences to measure at")
    p.add_argument("--steps", type=int, default=32, help="decode steps measured per size")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--bench-model", default=None,
                   help="HF folder whose config and tokenizer to use (weights are never read); "
                        "default: a tiny random Llama built in a temp folder")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the measured steps at the largest size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="which step to report: the median one, or the fastest (on a machine "
                        "shared with other work, the fastest is the closest to an idle one)")


def tiny_llama_folder(path: Path) -> Path:
    """A tiny Llama config (hidden 128, 3 layers, 1k vocabulary) and a BPE tokenizer trained on
    the bench corpus, saved as an HF folder without weights (load it with load_format="dummy")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from pagedserve.bench.trace import corpus_text

    if (path / "config.json").exists():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024 - 8, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()[:200_000]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


class FakeExecutor:
    """Stands in for the model: every sampled row gets a random token of the vocabulary, with
    a fixed logprob (and `logprobs` random top tokens when the request asks), at once. The
    tokens come from a pool drawn once (a few list reads a row: the model costs next to
    nothing). The step travels the executors' step protocol first, as the in-process
    executor's does (a `StepEncoder` delta decoded into the worker's persistent batch): its cost
    is in "model (fake)"."""

    POOL = 1 << 16

    def __init__(self, real, vocab: int, seed: int) -> None:
        from pagedserve.worker.step_message import StepDecoder, StepEncoder

        self.real = real
        rng = random.Random(seed)
        self.pool = [rng.randint(3, vocab - 1) for _ in range(self.POOL)]
        self.next = 0
        self.encoder, self.decoder = StepEncoder(), StepDecoder()

    def execute(self, step):
        from pagedserve.core.step_output import SampleResult, SeqStepOutput

        step = self.decoder.decode(self.encoder.encode(step))
        pool, mask, i = self.pool, self.POOL - 1, self.next
        out = []
        for row in step.rows:
            samples = []
            if row.do_sample:
                k = row.params.logprobs
                for _ in row.samples:
                    top = None
                    if k is not None:
                        top = [(pool[(i + j) & mask], -1.5) for j in range(1, k + 1)]
                        i += k
                    samples.append(SampleResult(pool[i & mask], -1.0, 1, top))
                    i += 1
            out.append(SeqStepOutput(row.seq_id, samples))
        self.next = i & mask
        return out

    def __getattr__(self, name):
        return getattr(self.real, name)


class PhaseTimer:
    """Wraps callables so that the time spent inside them adds up per phase."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += clock() - t0

        return timed


def build_engine(model: str, max_seqs: int, prompt_len: int, steps: int, seed: int):
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    block_size = 16
    # Every prompt prefilled in one step, then `steps` + 2 decode steps: no sequence ever
    # waits for a block or finishes while measured.
    per_seq = -(-(prompt_len + 2 * steps + 16) // block_size) + 1
    args = EngineArgs(model=model, load_format="dummy", dtype="float32", device="cpu",
                      block_size=block_size, num_kv_blocks=max_seqs * per_seq + 8,
                      max_num_seqs=max_seqs,
                      max_num_batched_tokens=max(2048, max_seqs * prompt_len),
                      enable_prefix_caching=False, preemption_mode="recompute",
                      max_model_len=prompt_len + 2 * steps + 64)
    engine = LLMEngine(args)
    engine.executor = FakeExecutor(engine.executor, engine.vocab_size, seed)
    return engine


def measure(engine, num_seqs: int, prompt_len: int, steps: int, seed: int,
            profile: bool = False, stat: str = "median") -> dict[str, float]:
    """Seconds of each phase in one decode step with `num_seqs` running sequences: the median
    step by total time (or the fastest, `stat="min"`)."""
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=1.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [1] + [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len - 1)]
        engine.add_request(f"r{num_seqs}-{i}", None, params, prompt_token_ids=prompt)
    # Prefill every prompt and one decode step: from here on every step decodes them all.
    while any(not engine.scheduler._is_decoding(g) for g in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()
    timer = PhaseTimer()
    sched, real = engine.scheduler, {}
    for obj, name, phase in ((sched, "schedule", "schedule"),
                             (sched, "update_from_output", "update"),
                             (engine, "_make_output", "outputs"),
                             (engine.executor, "execute", "model (fake)")):
        real[(obj, name)] = getattr(obj, name)
        setattr(obj, name, timer.wrap(phase, real[(obj, name)]))
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    samples = []
    for _ in range(steps):
        timer.seconds = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        engine.step()
        sample = dict(timer.seconds)
        sample["total"] = time.perf_counter() - t0
        sample["step input"] = sample["total"] - sum(v for k, v in sample.items()
                                                     if k not in ("step input", "total"))
        samples.append(sample)
    if profiler is not None:
        profiler.disable()
    for (obj, name), fn in real.items():
        setattr(obj, name, fn)
    # The whole step again without the phase timers (their own cost, a few calls per
    # sequence, left out): the "total" reported.
    totals = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
    totals.sort()
    if len(sched.running) != num_seqs:
        raise RuntimeError(f"{len(sched.running)} running sequences, expected {num_seqs}")
    for rid in list(engine.groups):
        engine.abort_request(rid)
    engine.step()  # the runner drops the aborted requests
    samples.sort(key=lambda r: r["total"])
    per_step = dict(samples[0] if stat == "min" else samples[len(samples) // 2])
    per_step["total"] = totals[0] if stat == "min" else totals[len(totals) // 2]
    if profiler is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
        per_step["_profile"] = buf.getvalue()
    return per_step


def main(args: argparse.Namespace) -> int:
    import platform

    import torch

    torch.set_num_threads(1)
    sizes = sorted(args.sizes)
    model = args.bench_model
    if model is None:
        model = str(tiny_llama_folder(Path(tempfile.mkdtemp(prefix="pagedserve-step-")) / "m"))
    engine = build_engine(model, max(sizes), args.prompt_len, args.steps, args.seed)
    print(f"engine step overhead (fake model), the {args.stat} of {args.steps} decode steps "
          f"per size, prompts of {args.prompt_len} tokens; "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    head = f"{'seqs':>6} " + " ".join(f"{p:>14}" for p in PHASES + ("total",))
    print(head + "   (ms/step | us/seq)")
    profile_text = None
    for n in sizes:
        r = measure(engine, n, args.prompt_len, args.steps, args.seed + n,
                    profile=args.profile and n == sizes[-1], stat=args.stat)
        profile_text = r.pop("_profile", profile_text)
        cells = [f"{r[p] * 1e3:6.2f}|{r[p] * 1e6 / n:6.1f}" for p in PHASES + ("total",)]
        print(f"{n:>6} " + " ".join(f"{c:>14}" for c in cells), flush=True)
    if profile_text:
        print(f"\ncProfile of the measured steps at {sizes[-1]} sequences (by own time):")
        print(profile_text)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_bench_step_overhead_args(parser)
    raise SystemExit(main(parser.parse_args()))
