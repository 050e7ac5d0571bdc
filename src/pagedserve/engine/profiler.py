"""Where a step's time goes: `--profile` of the benchmarks, and the server's step profile.

`StepProfiler.attach(engine)` instruments one in-process engine (tensor_parallel_size 1) from the
outside, so that nothing in the engine pays for profiling when it is off: it wraps the engine's
`step`, the scheduler's `schedule`, the runner's `execute`, the model's `compute_logits` and
`greedy_tokens`, the per-token bookkeeping (`on_token`, the scheduler's step observer: detokenization and stop strings) and
output building (`_make_output`), and hangs forward hooks on the model and on every attention
layer. Each step is cut into:

- `schedule`: the scheduler and block manager;
- `prepare inputs`: building the flat batch and the attention metadata (runner, before the
  forward) and picking the rows to sample;
- `attention`: the paged attention op of every layer (K/V write included); on CPU bf16
  decode-only steps the whole layer runs as one compiled call (`platforms.cpu_decode.fused_decode_layer`)
  that no hook can split, and attention is then part of `forward (rest)`;
- `forward (rest)`: the rest of the forward pass (projections, MLPs, norms, RoPE, embeddings);
- `lm head`: the logits of the sampled rows (LM head matmul, softcapping), or on plain-greedy
  CPU steps the LM head with the argmax fused (`greedy_tokens`: no logits);
- `sampling`: logits to host, penalties, top-k/p, the draw, logprobs;
- `detokenize`: incremental detokenization and stop checks;
- `outputs + engine`: `RequestOutput` building and the engine's other bookkeeping.
Wall time outside `LLMEngine.step` (the server's HTTP handling and streaming, the client's
waiting) is reported by the caller as `outside steps`.

NOTE: timings use `time.perf_counter` around synchronous CPU work. On CUDA the profiler
synchronises the device at every boundary, which slows the run it measures: use it to see shares,
not to quote speed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

import torch

SECTIONS = (
    "schedule", "prepare inputs", "attention", "forward (rest)", "lm head", "sampling",
    "detokenize", "outputs + engine",
)
# The engine's own Python, which must stay small next to the model's arithmetic.
ENGINE_OVERHEAD = ("schedule", "prepare inputs", "sampling", "detokenize", "outputs + engine")


class StepProfiler:
    """Accumulates per-section time over the steps of one engine; see the module docstring."""

    def __init__(self) -> None:
        # NOTE: sections add into `totals` (this step's); `_timed_step` folds them into the
        # per-kind sums ("decode": every scheduled sequence decodes one token; "mixed": the step
        # has prompt tokens; "all").
        self.totals: dict[str, float] = defaultdict(float)
        self.kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._kind = "decode"
        self._undo: list[Callable[[], None]] = []
        self._sync: Callable[[], None] = lambda: None
        self._marks: dict[str, float] = {}

    # --- attaching -------------------------------------------------------------------------

    def attach(self, engine: Any) -> "StepProfiler":
        """Instrument `engine` (an `LLMEngine` whose executor runs the model in this process)."""
        runner = getattr(engine.executor, "runner", None)
        if runner is None:
            raise ValueError("--profile needs the model in this process (tensor_parallel_size 1)")
        model = runner.model
        platform = getattr(runner, "platform", None)
        if platform is not None and not platform.is_host:
            self._sync = platform.synchronize

        self._wrap(engine, "step", self._timed_step)
        self._wrap(engine.scheduler, "schedule", self._section("schedule"))
        self._wrap(engine, "on_token", self._section("detokenize"))
        self._wrap(runner, "execute", self._timed_execute)
        self._wrap(model, "compute_logits", self._timed_logits)
        if hasattr(model, "greedy_tokens"):  # greedy steps: the LM head with the argmax fused
            self._wrap(model, "greedy_tokens", self._timed_logits)
        self._hook(model, "forward_start", "forward_end")
        from pagedserve.layers.attention import PagedAttention

        for module in model.modules():
            if isinstance(module, PagedAttention):
                self._hook(module, "attn_start", "attn_end", accumulate="attention")
        return self

    def detach(self) -> None:
        """Remove every wrapper and hook."""
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.totals.clear()
        self.kinds.clear()

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(obj, name)
        had_own = name in vars(obj)
        setattr(obj, name, make(original))

        def undo() -> None:
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def _hook(self, module: torch.nn.Module, start: str, end: str, accumulate: str | None = None):
        def pre(_module, _args):
            self._sync()
            self._marks[start] = time.perf_counter()

        def post(_module, _args, _out):
            self._sync()
            now = time.perf_counter()
            self._marks[end] = now
            if accumulate:
                self.totals[accumulate] += now - self._marks[start]

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        self._undo.append(lambda: [h.remove() for h in handles])

    # --- timed wrappers --------------------------------------------------------------------

    def _section(self, name: str) -> Callable[[Callable], Callable]:
        def make(fn: Callable) -> Callable:
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.totals[name] += time.perf_counter() - t0
            return timed
        return make

    def _timed_step(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._sync()
            self.totals.clear()
            self._kind = "idle"
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.totals["step"] = time.perf_counter() - t0
            self.totals["steps"] = 1
            for kind in (self._kind, "all"):
                acc = self.kinds[kind]
                for name, value in self.totals.items():
                    acc[name] += value
            return out
        return timed

    def _timed_execute(self, fn: Callable) -> Callable:
        def timed(step):
            self._marks.clear()
            attn_before = self.totals["attention"]
            t0 = time.perf_counter()
            out = fn(step)
            self._sync()
            t_end = time.perf_counter()
            self.totals["tokens"] += sum(row.num_tokens for row in step.rows)
            if step.rows:
                decode = all(row.num_tokens == 1 for row in step.rows)
                self._kind = "decode" if decode else "mixed"
            m = self._marks
            if "forward_start" not in m:  # nothing scheduled: swaps/copies only
                self.totals["prepare inputs"] += t_end - t0
                return out
            attention = self.totals["attention"] - attn_before
            forward = m["forward_end"] - m["forward_start"]
            logits_start = m.get("logits_start", m["forward_end"])
            logits_end = m.get("logits_end", logits_start)
            self.totals["prepare inputs"] += (m["forward_start"] - t0) + (logits_start - m["forward_end"])
            self.totals["forward (rest)"] += forward - attention
            self.totals["lm head"] += logits_end - logits_start
            self.totals["sampling"] += t_end - logits_end
            self.totals["execute"] += t_end - t0
            return out
        return timed

    def _timed_logits(self, fn: Callable) -> Callable:
        def timed(hidden):
            self._sync()
            self._marks["logits_start"] = time.perf_counter()
            out = fn(hidden)
            self._sync()
            self._marks["logits_end"] = time.perf_counter()
            return out
        return timed

    # --- report ----------------------------------------------------------------------------

    def breakdown(self, kind: str = "all", wall_s: float | None = None) -> dict[str, float]:
        """Seconds per section over the steps of `kind` ("all", "decode" or "mixed");
        `wall_s` (the run's wall time, with kind "all") adds `outside steps`."""
        t = self.kinds.get(kind, {})
        out = {name: t.get(name, 0.0) for name in SECTIONS if name != "outputs + engine"}
        accounted = t.get("schedule", 0.0) + t.get("execute", 0.0) + t.get("detokenize", 0.0)
        # Everything in `step` the other sections do not cover: outputs and bookkeeping.
        out["outputs + engine"] = max(0.0, t.get("step", 0.0) - accounted)
        if wall_s is not None:
            out["outside steps"] = max(0.0, wall_s - t.get("step", 0.0))
        return out

    def report(self, wall_s: float | None = None) -> str:
        """Tables in ms per step and % of wall time (of step time for the per-kind tables)."""
        lines = []
        for kind in ("all", "decode", "mixed"):
            t = self.kinds.get(kind)
            if not t or not t.get("steps"):
                continue
            steps, step_time = int(t["steps"]), t["step"]
            wall = wall_s if kind == "all" else None
            parts = self.breakdown(kind, wall)
            total = wall if wall is not None else step_time
            title = {"all": "all steps", "decode": "decode-only steps",
                     "mixed": "steps with prompt tokens"}[kind]
            lines.append(f"profile, {title}: {steps} steps, {int(t['tokens'])} tokens "
                         f"({t['tokens'] / steps:.1f} per step), {1e3 * step_time / steps:.2f} ms "
                         f"per step")
            lines.append(f"  {'section':<18} {'ms/step':>9} {'%':>7}")
            for name, seconds in parts.items():
                share = 100.0 * seconds / total if total else 0.0
                lines.append(f"  {name:<18} {1e3 * seconds / steps:9.2f} {share:6.1f}%")
            overhead = sum(parts[n] for n in ENGINE_OVERHEAD)
            lines.append(f"  engine Python (schedule, inputs, sampling, detokenize, outputs): "
                         f"{100.0 * overhead / step_time if step_time else 0.0:.1f}% of step time")
        return "\n".join(lines)


def matmul_ceiling(model: torch.nn.Module, batch: int, repeats: int = 20) -> dict[str, float]:
    """This machine's matmul ceiling on the model's own shapes: `torch.mm` of a [batch, K] input
    by every linear layer's [N, K] weight (LM head included), in the model's dtype, timed one
    after the other as a step runs them (weights streamed from memory, not cached). Returns the
    FLOPs of one step's products, the seconds torch.mm takes for them, and the GFLOP/s."""
    weights = [m.weight for m in model.modules()  # (quantized weights have no torch.mm)
               if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2
               and getattr(m.weight, "quant", None) is None]
    if not weights:
        raise ValueError("the model has no linear layers")
    dtype = weights[0].dtype
    xs = {k: torch.randn(batch, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
    flops = sum(2.0 * batch * w.shape[0] * w.shape[1] for w in weights)

    def one_pass() -> None:
        for w in weights:
            torch.mm(xs[w.shape[1]], w.t())

    with torch.inference_mode():
        one_pass()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        seconds = (time.perf_counter() - start) / repeats
    return {"flops": flops, "seconds": seconds, "gflops": flops / seconds / 1e9,
            "weight_bytes": float(sum(w.numel() * w.element_size() for w in weights))}


def ceiling_report(model: torch.nn.Module, batch: int, decode_step_s: float) -> str:
    """The model's achieved GFLOP/s in decode steps of `batch` tokens next to torch.mm's on the
    same shapes (`matmul_ceiling`)."""
    try:
        c = matmul_ceiling(model, batch)
    except ValueError:  # GGUF blocks everywhere (the embedded model): torch.mm has no kernel
        return "matmul ceiling: not measured (every linear weight is quantized; torch.mm has none)"
    achieved = c["flops"] / decode_step_s / 1e9
    return (f"matmul ceiling at batch {batch}: torch.mm on the model's shapes {c['gflops']:.1f} "
            f"GFLOP/s ({1e3 * c['seconds']:.1f} ms for one step's products, "
            f"{c['weight_bytes'] / c['seconds'] / 1e9:.1f} GB/s of weights); the model's decode "
            f"steps {achieved:.1f} GFLOP/s ({1e3 * decode_step_s:.1f} ms/step, whole step) = "
            f"{100 * achieved / c['gflops']:.0f}% of it")
