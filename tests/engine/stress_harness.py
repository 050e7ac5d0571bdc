"""Differential stress harness for the scheduler: random workloads under random cache
configurations, every request's output compared EXACTLY with its run on a roomy cache.

A seed fixes everything: `make_workload(seed)` draws the requests (n, best_of, beam search,
logprobs, prompt_logprobs, stop strings and token ids, min_tokens, ignore_eos, sampling seeds,
prompts sharing prefixes, arrival steps, aborts) and the engine configuration (block size, KV pool
from barely-fits to roomy, token budget, chunked prefill, prefix caching, preemption mode, CPU pool,
max_num_seqs, shuffled free list). `Harness.run(seed)` drives `LLMEngine` step by step and raises
`StressFailure` on the first broken promise:

- oracle: float32 on CPU is deterministic, and the engine's float32 kernels (kernels/cpu_fp32.py)
  make a row's result independent of its step's other rows and of chunking, so every request
  that was not aborted must
  return exactly (tokens, texts, finish/stop reasons, cumulative and per-token logprobs,
  prompt_logprobs, beam scores) what it returns on the roomy oracle configuration;
- liveness: the workload finishes within a step bound derived from its lengths, and never goes 64
  steps in a row without computing a token while requests are in flight;
- invariants: `engine.check_invariants()` after every step; free device blocks (outside the prefix
  cache) are filled with NaN between steps, so reading a block nobody wrote shows;
- nothing lost or leaked: every admitted request ends in exactly one finished output or was
  aborted, nothing is reported after it finished or was aborted, both pools are empty at the end;
- admission: a request is rejected (ValueError) only when it cannot fit (wider than
  max_num_seqs, or one of its sequences alone needs more KV than the pool holds), and one that
  cannot fit is rejected (naming max_num_seqs / max_tokens);
- the oracle compares output lengths and finish reasons first (a request cut short by the pool
  reports "length" with fewer tokens than the oracle: the truncation of issue 25).

Workload shapes beyond the random ones (issue 25), drawn from a second random stream so that the
first stream's workloads stay as they were: "turns" (a pool between what one sequence of the
widest request needs alone and what all its sequences need together: the group runs them in
turns), "priority" (scheduling_policy="priority" with random request priorities), and
"prefill-ahead" (a high-priority long prompt arriving while a sharing group decodes, prefilled in
small chunks on a tight pool: a prefilling group ahead of a decoding sharing group in queue order,
which preempts it after its decode rows and copy-on-write copies were scheduled).

Models: a 1-layer tiny Llama, and (`tiny_hybrid`, `hybrid_workload`) a tiny Gemma 3 mixing
sliding-window and full layers, whose sliding group gives its blocks back as the window moves.

Used by tests/engine/test_stress.py (a fixed set of seeds) and scripts/stress.py (for minutes).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.spec_decode import SpecDecoder, SpeculativeConfig
from pagedserve import BeamSearchParams, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from spec_oracle import OracleDrafts

MAX_MODEL_LEN = 96
# The oracle: everything fits, nothing is preempted, no prefix cache, whole prompts in one step.
ORACLE_CONFIG = dict(block_size=16, num_kv_blocks=512, max_num_batched_tokens=4096,
                     enable_chunked_prefill=False, enable_prefix_caching=False,
                     preemption_mode="recompute", num_cpu_blocks=0, max_num_seqs=256,
                     shuffle_free_blocks_seed=None, scheduling_policy="fcfs")
STOP_STRINGS = ["e", "a", "th", "in", " ", "s ", "\n", "er", "qz"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tiny_llama(path: Path) -> Path:
    """The harness's model: a 1-layer tiny Llama (hidden 64), saved once at `path`."""
    import tiny  # tests/tiny.py

    if not (path / "config.json").exists():
        tiny.make_checkpoint(path, "llama", num_hidden_layers=1)
    return path


def tiny_hybrid(path: Path) -> Path:
    """The harness's model mixing sliding-window and full layers (issue 36): a 3-layer tiny
    Gemma 3 (sliding, full, sliding; window 8), saved once at `path`. Its pool block holds one
    layer: a table row has 3 columns (2 sliding lanes and 1 full)."""
    import tiny  # tests/tiny.py

    if not (path / "config.json").exists():
        tiny.make_checkpoint(path, "gemma3", num_hidden_layers=3, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"])
    return path


def tiny_conv(path: Path) -> Path:
    """The harness's model with short-convolution state (LFM2: a conv layer, its last 3 rows a
    sliding window of the cache, then an attention layer), saved once at `path`."""
    import tiny  # tests/tiny.py

    if not (path / "config.json").exists():
        tiny.make_checkpoint(path, "lfm2")
    return path


def tiny_recurrent(path: Path) -> Path:
    """The harness's model with a recurrent state (Qwen3.5: a Gated DeltaNet layer, its state in
    cache entries of the first logical block, then a gated attention layer), saved once."""
    import tiny  # tests/tiny.py

    if not (path / "config.json").exists():
        tiny.make_checkpoint(path, "qwen3_5", num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"])
    return path


def recurrent_workload(seed: int) -> Workload:
    """`hybrid_workload(seed)` for the model with a recurrent state (`tiny_recurrent`): each
    sequence also holds its state's blocks (7 at 1-token blocks, 1 from 8 on), so the pools
    grow by that much for a few sequences."""
    workload = hybrid_workload(seed)
    config = workload.config
    rng = random.Random(seed * 6151 + 35)
    if rng.random() < 0.5:
        # Follow-up turns: later requests whose prompt is an earlier one's, whole or cut, and
        # a few tokens more (a chat's next turn, a regenerated answer): with prefix caching
        # they start from a snapshot of the state (core/state_snapshots.py).
        workload.shapes = (*workload.shapes, "follow-ups")
        config["enable_prefix_caching"] = rng.random() < 0.9
        # (a prompt's last full block is snapshotted when its chunk ends there: chunked prefill)
        config["enable_chunked_prefill"] |= rng.random() < 0.7
        earlier = list(workload.requests)
        for j in range(rng.randint(1, 3)):
            base = rng.choice(earlier)
            cut = base.prompt if rng.random() < 0.5 else \
                base.prompt[: rng.randint(max(1, len(base.prompt) - 8), len(base.prompt))]
            prompt = cut + [rng.randrange(3, 500) for _ in range(rng.randint(0, 6))]
            # (after the base's prompt, roughly: its steps at the token budget, shared)
            after = 2 * cdiv(len(base.prompt), config["max_num_batched_tokens"])
            workload.requests.append(Request(f"{base.rid}-f{j}", prompt, base.params,
                                             base.arrive + after + rng.randint(0, 24)))
    state = cdiv(448, 64 * config["block_size"])  # (the state's values / a block's, one entry)
    widest = max(r.width for r in workload.requests)
    config["num_kv_blocks"] += widest * state
    if config["num_cpu_blocks"]:
        config["num_cpu_blocks"] += widest * state
    return workload


def make_engine(model: Path, tp: int = 1, draft: Path | None = None) -> LLMEngine:
    """One engine for many workloads (`Harness.run` reconfigures its cache each time); `draft`:
    a draft model for speculation (the engine loads it; `draft_spec_config_for` speculates)."""
    extra = dict(tensor_parallel_size=2, distributed_executor_backend="mp") if tp == 2 else {}
    if draft is not None:
        extra["speculative_config"] = {"model": str(draft), "num_speculative_tokens": 3}
    cache = {k: v for k, v in ORACLE_CONFIG.items() if k != "shuffle_free_blocks_seed"}
    return LLMEngine(EngineArgs(model=str(model), dtype="float32", device="cpu",
                                max_model_len=MAX_MODEL_LEN, **cache, **extra))


def reconfigure(engine: LLMEngine, config: dict) -> None:
    """`engine.reconfigure_cache(**config)`; a shuffled free list goes through a
    `kv_manager_factory` (a test hook, not an engine option)."""
    config = dict(config)
    shuffle = config.pop("shuffle_free_blocks_seed", None)
    factory = None if shuffle is None else (
        lambda c: KVCacheManager.from_config(c, shuffle_seed=shuffle))
    engine.reconfigure_cache(kv_manager_factory=factory, **config)


class StressFailure(AssertionError):
    """A broken promise; `kind` is one of: hang, mismatch, invariant, lost, leak, admission,
    exception."""

    def __init__(self, kind: str, message: str, cause: str | None = None) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        # Which of issue 16's failures this looks like ("1".."4"), or a new kind: a guess from
        # what the harness saw, for reports (`Harness.run` fills it in).
        self.cause = cause or kind


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams | BeamSearchParams
    arrive: int  # the step before which it is added
    abort_at: int | None = None  # the step before which it is aborted (None: never)
    priority: int = 0  # passed only under scheduling_policy="priority"

    @property
    def width(self) -> int:
        p = self.params
        if isinstance(p, BeamSearchParams):
            return p.beam_width
        return p.best_of or p.n

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def key(self) -> tuple:
        """What decides the request's output (its id, arrival and abort do not)."""
        return (tuple(self.prompt), type(self.params).__name__, repr(self.params))

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks that always suffice to run it alone, generously: every sequence its own
        full table and a block more. A request within this must be admitted."""
        return self.width * (cdiv(len(self.prompt) + self.max_tokens, block_size) + 1)

    def blocks_alone(self, block_size: int, groups=None, chunk: int = 0) -> int:
        """KV blocks one of its sequences needs alone (its last sampled token is never computed):
        the engine admits it exactly when this fits the pool. `groups`: (window or None, lanes)
        of each layer group of a model mixing sliding-window and full layers, computing at most
        `chunk` tokens a step: a sliding group needs the window before a chunk and the chunk."""
        final = min(MAX_MODEL_LEN, len(self.prompt) + self.max_tokens)
        rows = cdiv(final - 1, block_size)
        if groups is None:
            return rows
        return sum(lanes * (1 if window == "state" else rows if window is None
                            else min(rows, cdiv(min(window - 1 + chunk, final - 1), block_size)
                                     + 1))
                   for window, lanes in groups)

    def blocks_tight(self, block_size: int) -> int:
        """The fewest KV blocks that run it alone (and that the engine's admission rule, one
        block per sequence beyond the prompt's, accepts): the prompt's full blocks shared, each
        sequence its own blocks from there on."""
        p, bs = len(self.prompt), block_size
        shared = p // bs
        return max(shared + self.width * (cdiv(p + self.max_tokens, bs) - shared),
                   cdiv(p, bs) + self.width)


@dataclass
class Workload:
    seed: int
    config: dict
    requests: list[Request]
    shapes: tuple[str, ...] = ()  # of issue 25: "turns", "priority", "prefill-ahead"

    def describe(self) -> str:
        kinds = []
        for r in self.requests:
            p = r.params
            if isinstance(p, BeamSearchParams) or p.use_beam_search:
                kinds.append(f"beam{r.width}")
            elif r.width > 1:
                kinds.append(f"n{p.n}/bo{r.width}")
            else:
                kinds.append("greedy" if p.temperature == 0 else "sample")
        c = self.config
        return (f"bs={c['block_size']} kv={c['num_kv_blocks']} budget={c['max_num_batched_tokens']}"
                f" chunked={int(c['enable_chunked_prefill'])}"
                f" prefix={int(c['enable_prefix_caching'])}"
                f" {c['preemption_mode']} cpu={c['num_cpu_blocks']} seqs={c['max_num_seqs']}"
                f" {c.get('scheduling_policy', 'fcfs')}"
                + (f" shapes={','.join(self.shapes)}" if self.shapes else "")
                + f" reqs=[{' '.join(kinds)}]")


def _params(rng: random.Random, pressure: bool) -> SamplingParams | BeamSearchParams:
    max_tokens = rng.randint(6, 20) if pressure else rng.randint(1, 16)
    weights = [1, 1, 3, 3] if pressure else [3, 3, 3, 2]
    kind = rng.choices(["greedy", "sample", "parallel", "beam"], weights)[0]
    if kind == "beam":
        width = rng.randint(2, 4)
        length_penalty = rng.choice([1.0, 0.0, 0.5, 2.0])
        ignore_eos = rng.random() < 0.7
        if rng.random() < 0.5:
            return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    length_penalty=length_penalty)
        return SamplingParams(n=width, use_beam_search=True, temperature=0.0,
                              max_tokens=max_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty,
                              prompt_logprobs=rng.choice([None, None, 0, 2]))
    kw: dict = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.6)
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(2**31),
                  top_k=rng.choice([0, 0, 5, 50]), top_p=rng.choice([1.0, 1.0, 0.9]))
        if kind == "parallel":
            kw["n"] = rng.randint(1, 4)
            kw["best_of"] = kw["n"] + rng.choice([0, 0, 1, 2])
    kw["logprobs"] = rng.choice([None, None, 0, 1, 3])
    kw["prompt_logprobs"] = rng.choice([None, 0, 2] if pressure else [None, None, None, 0, 2])
    if rng.random() < 0.3:
        kw["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        kw["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(3, 500) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, max_tokens)
    return SamplingParams(**kw)


def make_workload(seed: int) -> Workload:
    """The requests and engine configuration of `seed` (deterministic)."""
    rng = random.Random(seed)
    # Half the workloads are built for memory pressure: several wide or long requests at once on
    # a pool that barely holds the largest (preemption with sharing, recomputation mid-prompt).
    pressure = rng.random() < 0.5
    prefixes = [[1] + [rng.randrange(3, 500) for _ in range(rng.randint(4, 36))]
                for _ in range(rng.randint(1, 2))]
    requests = []
    for i in range(rng.randint(3, 6) if pressure else rng.randint(1, 6)):
        if rng.random() < 0.5:  # a prompt sharing a prefix (often several full blocks)
            base = rng.choice(prefixes)
            prompt = base[: rng.randint(1, len(base))]
        else:
            prompt = [1]
        prompt = prompt + [rng.randrange(3, 500) for _ in range(rng.randint(0, 12))]
        if pressure and rng.random() < 0.3:  # a long prompt, computed in many chunks
            prompt = prompt + [rng.randrange(3, 500) for _ in range(rng.randint(16, 48))]
        arrive = 0 if i == 0 else rng.choice([0, 0, rng.randint(0, 4 if pressure else 12)])
        abort_at = arrive + rng.randint(0, 14) if rng.random() < 0.15 else None
        requests.append(Request(f"s{seed}-{i}", prompt, _params(rng, pressure), arrive, abort_at))

    bs = rng.choice([1, 2, 3, 4, 4, 8, 8, 16, 16, 32])
    tight = max(r.blocks_tight(bs) for r in requests)
    fits = max(r.blocks_needed(bs) for r in requests)
    total = sum(r.blocks_needed(bs) for r in requests)
    pool = "tiny" if pressure else rng.choice(["tiny", "small", "roomy"])
    num_kv_blocks = {"tiny": tight + rng.randint(0, 2),
                     "small": rng.randint(tight, max(tight, total // 2)),
                     "roomy": 2 * total}[pool]
    widest = max(r.width for r in requests)
    max_num_seqs = rng.choice([widest, widest + 1, 8, 256]) if rng.random() < 0.9 \
        else rng.randint(1, 4)  # sometimes narrower than a request: it must be rejected
    chunked = rng.random() < 0.75
    if not chunked:
        budget = rng.choice([MAX_MODEL_LEN, 2048])
    elif rng.random() < 0.9:  # a few tokens and up; at least one step of the widest decode
        budget = max(widest, rng.choice([1, 2, 3, 4, 5, 8, 16, 64, 2048]))
    else:  # sometimes below the widest request, or below max_num_seqs
        budget = rng.randint(1, 4)
    mode = rng.choice(["recompute", "swap", "auto"])
    cpu = rng.choice([0, 1, 2, 4, fits, 4 * total]) if mode != "recompute" else 0
    config = dict(block_size=bs, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=budget,
                  enable_chunked_prefill=chunked, enable_prefix_caching=rng.random() < 0.6,
                  preemption_mode=mode, num_cpu_blocks=cpu, max_num_seqs=max_num_seqs,
                  shuffle_free_blocks_seed=rng.choice([None, rng.randrange(1000)]),
                  scheduling_policy="fcfs")
    shapes = _issue25_shapes(random.Random(seed * 1_000_003 + 25), seed, pressure, config,
                             requests)
    return Workload(seed, config, requests, shapes)


def hybrid_workload(seed: int) -> Workload:
    """`make_workload(seed)` for the model of layer groups (`tiny_hybrid`: 3 pool blocks of one
    layer per logical block where the 1-layer Llama takes 1): its pools scaled by 2 or 3 (the
    sliding-window lanes hold less than a full one, so 2x is tighter), drawn from its own
    stream."""
    workload = make_workload(seed)
    rng = random.Random(seed * 7919 + 36)
    config = workload.config
    config["num_kv_blocks"] *= rng.choice([2, 3])
    config["num_cpu_blocks"] *= 3
    return workload


def _issue25_shapes(rng: random.Random, seed: int, pressure: bool, config: dict,
                    requests: list[Request]) -> tuple[str, ...]:
    """Turn the workload into one of issue 25's shapes (module docstring), in place; returns the
    shapes applied. Draws from its own stream `rng`."""
    shapes = []
    bs = config["block_size"]
    if rng.random() < 0.3:
        shapes.append("priority")
        config["scheduling_policy"] = "priority"
        for r in requests:
            r.priority = rng.choice([0, 0, 1, -1, 2])
    roll = rng.random()
    if roll < 0.15:
        # A sharing group decodes; a long prompt of higher priority arrives and is prefilled in
        # chunks of a few tokens ahead of it, on a pool that holds little more than both.
        shapes.append("prefill-ahead")
        if "priority" not in shapes:
            shapes.insert(0, "priority")
            config["scheduling_policy"] = "priority"
        width = rng.randint(2, 4)
        share = SamplingParams(n=width, temperature=1.0, seed=rng.randrange(2**31),
                               max_tokens=rng.randint(10, 20), ignore_eos=True,
                               logprobs=rng.choice([None, 1]))
        if rng.random() < 0.4:
            share = BeamSearchParams(beam_width=width, max_tokens=rng.randint(8, 14),
                                     ignore_eos=True)
        base = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(2, 2 * bs + 1))]
        long = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(30, 60))]
        long_params = SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 8),
                                     ignore_eos=True, logprobs=rng.choice([None, 2]))
        arrive = max((r.arrive for r in requests), default=0) + rng.randint(1, 3)
        requests += [
            Request(f"s{seed}-share", base, share, 0, priority=rng.choice([0, 1])),
            Request(f"s{seed}-ahead", long, long_params, arrive + rng.randint(1, 4),
                    priority=-2),
        ]
        widest = max(r.width for r in requests)
        config.update(enable_chunked_prefill=True,
                      max_num_batched_tokens=widest + rng.choice([1, 2, 4, 6]),
                      max_num_seqs=max(config["max_num_seqs"], widest + 1))
        tight = max(r.blocks_tight(bs) for r in requests)
        config["num_kv_blocks"] = tight + rng.randint(0, 2)
    elif pressure and roll < 0.55:
        # A pool that holds one sequence of the widest request alone, not all of them at once.
        alone = max(r.blocks_alone(bs) for r in requests)
        tight = max(r.blocks_tight(bs) for r in requests)
        if alone < tight:
            shapes.append("turns")
            config["num_kv_blocks"] = rng.randint(alone, tight - 1)
    return tuple(shapes)


# --- outputs ---------------------------------------------------------------------------------

def _lp(entries):
    if entries is None:
        return None
    return [None if d is None else sorted((t, v.logprob, v.rank, v.decoded_token)
                                          for t, v in d.items()) for d in entries]


def summarize(out) -> dict:
    """Everything a client sees of a finished RequestOutput, except timings and preemptions."""
    return dict(
        prompt_token_ids=list(out.prompt_token_ids),
        prompt_logprobs=_lp(out.prompt_logprobs),
        outputs=[dict(index=c.index, token_ids=list(c.token_ids), text=c.text,
                      cumulative_logprob=c.cumulative_logprob, logprobs=_lp(c.logprobs),
                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                 for c in out.outputs],
    )


def first_difference(got: dict, want: dict) -> str:
    """A short description of where two summaries differ."""
    if got["prompt_logprobs"] != want["prompt_logprobs"]:
        g, w = got["prompt_logprobs"], want["prompt_logprobs"]
        if g is None or w is None or len(g) != len(w):
            return (f"prompt_logprobs: {None if g is None else len(g)} entries, oracle "
                    f"{None if w is None else len(w)} (prompt {len(want['prompt_token_ids'])})")
        i = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        return f"prompt_logprobs[{i}]: {g[i]} vs oracle {w[i]}"
    if len(got["outputs"]) != len(want["outputs"]):
        return f"{len(got['outputs'])} outputs, oracle {len(want['outputs'])}"
    for a, b in zip(got["outputs"], want["outputs"]):  # lengths and finish reasons first
        if len(a["token_ids"]) != len(b["token_ids"]) or a["finish_reason"] != b["finish_reason"]:
            return (f"output {a['index']}: {len(a['token_ids'])} tokens, finish_reason "
                    f"{a['finish_reason']!r}; oracle {len(b['token_ids'])} tokens, "
                    f"{b['finish_reason']!r}")
    for a, b in zip(got["outputs"], want["outputs"]):
        for k in ("token_ids", "cumulative_logprob", "finish_reason", "stop_reason", "text",
                  "logprobs"):
            if a[k] != b[k]:
                if k == "logprobs" and a[k] and b[k] and len(a[k]) == len(b[k]):
                    i = next(i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y)
                    return f"output {a['index']} logprobs[{i}]: {a[k][i]} vs oracle {b[k][i]}"
                return f"output {a['index']} {k}: {a[k]!r} vs oracle {b[k]!r}"
    return "no difference"


# --- the driver ------------------------------------------------------------------------------

@dataclass
class RunStats:
    steps: int = 0
    bound: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    preemptions: dict = field(default_factory=dict)
    seconds: float = 0.0
    config_rejected: bool = False
    turns: int = 0  # sequences parked for their siblings (groups running in turns)
    undone_victims: int = 0  # victims preempted after being scheduled in the same step
    prefix_hits: int = 0  # prompt tokens the prefix cache served


# Speculative configurations (`Harness(engine, spec=...)`, `scripts/stress.py --spec`): drafts
# of 1 to 5 tokens from n-grams of 1 to 3 tokens; the oracle stays non-speculative.
SPEC_CONFIGS = [
    dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=mx, prompt_lookup_min=mn)
    for k, mx, mn in ((1, 1, 1), (3, 2, 1), (5, 3, 1), (4, 3, 2))
]


def spec_config_for(seed: int) -> dict:
    """The speculative configuration a seed runs under in speculative mode."""
    return SPEC_CONFIGS[seed % len(SPEC_CONFIGS)]


def draft_spec_config_for(draft: Path):
    """The configuration of a seed in draft-model speculative mode (an engine made with
    `make_engine(..., draft=draft)`): drafts of 1, 3 or 5 tokens from the draft model, and one
    seed in four an n-gram configuration on the same engine (its drafts' K/V written by the
    draft model too)."""
    configs = [dict(model=str(draft), num_speculative_tokens=k) for k in (1, 3, 5)]

    def config_for(seed: int) -> dict:
        return SPEC_CONFIGS[seed % len(SPEC_CONFIGS)] if seed % 4 == 3 else configs[seed % 3]

    return config_for


def oracle_spec_config_for(seed: int) -> dict:
    """The configuration of a seed in oracle-draft mode: 1 to 5 drafts a row, from the oracle's
    own outputs (`oracle_proposer`: most drafts accepted, some spoiled)."""
    return dict(method="ngram", num_speculative_tokens=(1, 3, 5, 4)[seed % 4], oracle=True)


def oracle_proposer(config, expected: dict, seed: int) -> OracleDrafts:
    """Drafts of the oracle's own continuation of a sequence's tokens (the workload's
    summaries), one row in two spoiled at a random draft (seeded): drafts accepted in full, in
    part and not at all. The n-gram proposer's drafts on a tiny random model are nearly all
    rejected; these reach the paths of accepted drafts (a recurrent state kept, blocks of
    accepted tokens cached)."""
    runs = [s["prompt_token_ids"] + o["token_ids"] for s in expected.values()
            for o in s["outputs"]]
    return OracleDrafts(config, runs, random.Random(seed))


def speculative_workload(workload: Workload) -> Workload:
    """`workload` for a speculating engine: beam searches (refused with speculation) become
    greedy requests of the same length; prompts end with their first tokens again, at the
    same length (so the n-gram proposer finds drafts from the first step on). Everything else is kept."""
    requests = []
    for r in workload.requests:
        params = r.params
        if isinstance(params, BeamSearchParams) or params.use_beam_search:
            params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                    ignore_eos=params.ignore_eos)
        m = min(len(r.prompt) // 2, 6)  # the same length: the pool sizes still hold
        prompt = r.prompt[: len(r.prompt) - m] + r.prompt[:m] if m else r.prompt
        requests.append(Request(r.rid, prompt, params, r.arrive, r.abort_at, r.priority))
    return Workload(workload.seed, workload.config, requests, workload.shapes)


class Harness:
    """Runs workloads on one engine (its cache rebuilt per workload); caches oracle outputs.
    With `spec` (a speculative_config, or a function of the seed giving one) the workload runs
    speculating and the oracle does not: outputs must still be exactly equal."""

    def __init__(self, engine: LLMEngine, spec=None) -> None:
        self.engine = engine
        self.spec = spec
        self._layout_groups()
        self.oracle_cache: dict[tuple, dict] = {}
        self._ids = 0
        self._stuck: list[tuple] = []  # of a hang: (request, preemptions, queue)
        self._mismatch: tuple = ({}, {})  # of a mismatch: (got, oracle) summaries
        self._mismatch_request: Request | None = None
        self._swapped: set[str] = set()  # requests seen swapped out, this workload
        self._recomputed: set[str] = set()  # requests seen waiting after a preemption

    def _add(self, req: Request, rid: str, priority: int = 0) -> None:
        if isinstance(req.params, BeamSearchParams):
            self.engine.add_beam_request(rid, None, req.params, prompt_token_ids=req.prompt,
                                         priority=priority)
        else:
            self.engine.add_request(rid, None, req.params, prompt_token_ids=req.prompt,
                                    priority=priority)

    def oracle(self, requests: list[Request]) -> dict[tuple, dict]:
        """Each request's summary on the roomy configuration (computed once per request key)."""
        todo = {r.key(): r for r in requests if r.key() not in self.oracle_cache}
        if todo:
            engine = self.engine
            engine.spec = None  # the oracle never speculates
            reconfigure(engine, ORACLE_CONFIG)
            ids = {}
            for key, r in todo.items():
                self._ids += 1
                ids[f"oracle-{self._ids}"] = key
                self._add(r, f"oracle-{self._ids}")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        self.oracle_cache[ids[out.request_id]] = summarize(out)
            missing = set(todo) - set(self.oracle_cache)
            if missing:
                raise StressFailure("lost", f"the oracle run lost {len(missing)} requests")
        return {r.key(): self.oracle_cache[r.key()] for r in requests}

    def _layout_groups(self) -> None:
        """A model of several layer groups: (window, None for full or "state" for a recurrent
        state, lanes) of each (admission's bound). NOTE: a recurrent state's lanes depend on the
        block size: read again after each reconfiguration."""
        layout = self.engine.kv_layout
        self.groups = None if layout.width == 1 and layout.groups[0].window is None else [
            ("state" if g.spec.rule() == ("state",) else g.window, g.lanes) for g in layout.groups]

    def run(self, workload: Workload) -> RunStats:
        """Run `workload` under its configuration; raise StressFailure on the first problem."""
        t0 = time.monotonic()
        spec = self.spec(workload.seed) if callable(self.spec) else self.spec
        if spec is not None:
            workload = speculative_workload(workload)
        expected = self.oracle(workload.requests)
        engine = self.engine
        config = workload.config
        stats = RunStats()
        oracle_drafts = isinstance(spec, dict) and spec.get("oracle", False)
        if oracle_drafts:
            spec = {k: v for k, v in spec.items() if k != "oracle"}
        engine.spec = None if spec is None else SpecDecoder(SpeculativeConfig.parse(spec))
        if oracle_drafts:
            engine.spec.proposer = oracle_proposer(engine.spec.config, expected, workload.seed)
        try:
            reconfigure(engine, config)
        except ValueError as e:
            # A budget below max_num_seqs may be refused (vLLM refuses it): the step could not
            # hold one decode token per sequence.
            if (config["max_num_batched_tokens"] < config["max_num_seqs"]
                    and "max_num_batched_tokens" in str(e)):
                stats.config_rejected = True
                return stats
            raise StressFailure("exception", f"reconfigure_cache({config}) raised {e}") from e
        self._layout_groups()
        try:
            self._drive(workload, expected, stats)
        except StressFailure as failure:
            failure.cause = self._classify(workload, failure, stats)
            self._reset()
            raise
        except Exception as e:  # the engine raised: report it with the seed
            self._reset()
            raise StressFailure("exception", f"{type(e).__name__}: {e}") from e
        stats.seconds = time.monotonic() - t0
        return stats

    def _classify(self, workload: Workload, failure: StressFailure, stats: RunStats) -> str:
        """Which of issue 16's four failures this looks like (a guess, for the report)."""
        budget = workload.config["max_num_batched_tokens"]
        if failure.kind == "admission" and "failure 4" in str(failure):
            return "4: wider than max_num_seqs accepted"
        if failure.kind == "hang":
            stuck = self._stuck
            if any(req.width > budget for req, _, _ in stuck):
                return "new: width > max_num_batched_tokens accepted, never decodes"
            if any(where == "swapped" for _, _, where in stuck):
                return "new: swapped group never swapped back in"
            if any(req.width > 1 and preempted for req, preempted, _ in stuck):
                return "1: multi-sequence group stuck after preemption"
            return "hang: other"
        if failure.kind == "mismatch":
            if "prompt_logprobs:" in str(failure) and "entries" in str(failure):
                return "3: prompt_logprobs count after recomputation"
            got, want = self._mismatch
            if not got["outputs"] and want["outputs"]:
                return "new: length-capped beam request returns no outputs"
            if any(a["finish_reason"] == "length" and len(a["token_ids"]) < len(b["token_ids"])
                   for a, b in zip(got["outputs"], want["outputs"])):
                return "new: finished early by length (capped) though the pool holds it"
            req = self._mismatch_request
            if req.width > 1 and req.rid in self._recomputed:
                return "new: multi-sequence group differs after recomputation (re-fork)"
            if req.width > 1 and req.rid in self._swapped:
                return "2: multi-sequence group swapped"
            if req.rid in self._recomputed:
                return "mismatch after recompute"
            if req.rid in self._swapped:
                return "mismatch after swap"
            return "mismatch: other"
        return failure.kind

    def _reset(self) -> None:
        """Abort whatever a failed workload left in flight (the next one needs an idle engine)."""
        engine = self.engine
        for rid in list(engine.groups):
            engine.abort_request(rid)
        for group in list(engine.scheduler.waiting) + list(engine.scheduler.running) + list(
                engine.scheduler.swapped):
            engine.abort_request(group.request_id)

    def _drive(self, workload: Workload, expected: dict, stats: RunStats) -> None:
        engine = self.engine
        config = workload.config
        reqs = {r.rid: r for r in workload.requests}
        # Generous but finite: every token of every sequence computed ten times over, plus the
        # arrival window.
        bound = 100 + max(r.arrive for r in reqs.values()) + 10 * sum(
            r.width * (len(r.prompt) + r.max_tokens) for r in reqs.values())
        stats.bound = bound
        in_flight: set[str] = set()
        self._swapped, self._recomputed = set(), set()
        finished: dict[str, dict] = {}
        aborted: set[str] = set()
        last_tokens: dict[str, list] = {}
        step = idle = 0
        progress = None
        pending = sorted(reqs.values(), key=lambda r: r.arrive)
        while pending or in_flight:
            while pending and pending[0].arrive <= step:
                r = pending.pop(0)
                self._admit(r, config, in_flight, stats)
            for r in reqs.values():
                if r.abort_at == step and r.rid in in_flight:
                    if not engine.abort_request(r.rid):
                        raise StressFailure("lost", f"abort_request({r.rid}) found no request "
                                                    "that had not finished")
                    in_flight.discard(r.rid)
                    aborted.add(r.rid)
            if not in_flight:
                if engine.has_unfinished_requests():
                    raise StressFailure("leak", "the engine has unfinished requests after every "
                                                "request finished or was aborted")
                step += 1
                continue
            outputs = engine.step()
            step += 1
            stats.steps += 1
            try:
                engine.check_invariants()
            except RuntimeError as e:
                raise StressFailure("invariant", f"after step {step}: {e}") from e
            self._poison_free_blocks()
            self._note_preempted()
            for out in outputs:
                rid = out.request_id
                if rid not in in_flight:
                    why = ("finished" if rid in finished else "aborted" if rid in aborted
                           else "unknown")
                    raise StressFailure("lost", f"step {step}: output for {why} request {rid}")
                self._check_stream(reqs[rid], out, last_tokens)
                if out.finished:
                    in_flight.discard(rid)
                    finished[rid] = summarize(out)
            sig = self._progress_signature(len(finished))
            idle = idle + 1 if sig == progress else 0
            progress = sig
            stats.preemptions = dict(engine.scheduler.preemptions_by_mode)
            if idle >= 64 or stats.steps > bound:
                where = {g.request_id: name for name in ("waiting", "running", "swapped")
                         for g in getattr(engine.scheduler, name)}
                self._stuck = [(reqs[rid], getattr(engine.groups.get(rid), "num_preemptions", 0),
                                where.get(rid)) for rid in in_flight]
                raise StressFailure("hang", self._hang_report(step, idle, bound, in_flight, reqs))
        stats.finished, stats.aborted = len(finished), len(aborted)
        stats.preemptions = dict(engine.scheduler.preemptions_by_mode)
        stats.turns = engine.scheduler.num_turns
        stats.undone_victims = engine.scheduler.num_undone_victims
        stats.prefix_hits = engine.kv_manager.prefix_hits
        self._check_end(engine)
        for rid, got in finished.items():
            want = expected[reqs[rid].key()]
            if got != want:
                self._mismatch, self._mismatch_request = (got, want), reqs[rid]
                raise StressFailure("mismatch", f"request {rid}: {first_difference(got, want)}")

    def _admit(self, r: Request, config: dict, in_flight: set, stats: RunStats) -> None:
        bs = config["block_size"]
        too_wide = r.width > config["max_num_seqs"]
        alone = r.blocks_alone(bs, self.groups, config["max_num_batched_tokens"])
        too_long = alone > config["num_kv_blocks"]
        # (a group wider than the token budget cannot decode in one step: it may be refused)
        fits = (not too_wide and not too_long and r.width <= config["max_num_batched_tokens"])
        priority = r.priority if config.get("scheduling_policy") == "priority" else 0
        try:
            self._add(r, r.rid, priority)
        except ValueError as e:
            if fits:
                raise StressFailure("admission", f"{r.rid} (width {r.width}, prompt "
                                                 f"{len(r.prompt)}, max_tokens {r.max_tokens}) "
                                                 f"fits but was rejected: {e}") from e
            if too_wide and "max_num_seqs" not in str(e):
                raise StressFailure("admission", f"{r.rid} (width {r.width} > max_num_seqs) "
                                                 f"rejected without naming max_num_seqs: {e}")
            stats.rejected += 1
            r.abort_at = None
            return
        if too_wide:
            raise StressFailure("admission", f"{r.rid}: width {r.width} > max_num_seqs="
                                             f"{config['max_num_seqs']} was accepted (it can never "
                                             "be scheduled; failure 4)")
        if too_long:
            raise StressFailure("admission", f"{r.rid}: one sequence alone needs "
                                             f"{alone} blocks > the pool's "
                                             f"{config['num_kv_blocks']}, but it was accepted "
                                             "(it would be cut short)")
        in_flight.add(r.rid)

    @staticmethod
    def _check_stream(r: Request, out, last_tokens: dict) -> None:
        """Streamed outputs of plain requests only grow (best_of and beams may reorder)."""
        if r.width != getattr(r.params, "n", 0) or getattr(r.params, "use_beam_search", True):
            return
        now = [list(c.token_ids) for c in out.outputs]
        before = last_tokens.get(r.rid)
        if before is not None:
            for a, b in zip(before, now):
                if b[: len(a)] != a:
                    raise StressFailure("mismatch", f"{r.rid}: streamed tokens went from {a} to "
                                                    f"{b}")
        last_tokens[r.rid] = now

    def _note_preempted(self) -> None:
        """Which requests were swapped out or requeued for recomputation (for `_classify`)."""
        sched = self.engine.scheduler
        self._swapped.update(g.request_id for g in sched.swapped)
        self._recomputed.update(g.request_id for g in sched.waiting if g.num_preemptions)

    def _poison_free_blocks(self) -> None:
        """NaN into every free device block that the prefix cache does not hold: a step that
        reads a block nobody wrote (or one freed under it) then produces NaN."""
        kv_cache = self.engine.kv_cache
        if kv_cache is None:  # tensor parallel: the cache lives in the workers
            return
        kv = self.engine.kv_manager
        cached = set(getattr(kv, "_block_key", ()))
        kv_cache.fill_blocks([b for b in kv.pool.free_blocks() if b not in cached], float("nan"))

    def _progress_signature(self, num_finished: int) -> tuple:
        engine = self.engine
        computed = sum(q.num_computed_tokens + q.num_tokens
                       for g in engine.groups.values() for q in g.seqs)
        return (num_finished, computed, engine.stats["prompt_tokens"],
                engine.stats["generation_tokens"], len(engine.groups))

    def _hang_report(self, step, idle, bound, in_flight, reqs) -> str:
        engine = self.engine
        sched = engine.scheduler
        where = {}
        for name in ("waiting", "running", "swapped"):
            for g in getattr(sched, name):
                where[g.request_id] = name
        parts = []
        for rid in sorted(in_flight):
            g = engine.groups.get(rid)
            seqs = "" if g is None else ",".join(
                f"{q.num_computed_tokens}/{q.num_tokens}" for q in g.seqs if not q.is_finished)
            parts.append(f"{rid}(width {reqs[rid].width}, {where.get(rid, '?')}, "
                         f"preempted {getattr(g, 'num_preemptions', '?')}x, computed/len {seqs})")
        why = f"{idle} steps without progress" if idle >= 64 else f"over the bound of {bound} steps"
        return f"step {step}: {why}; in flight: {'; '.join(parts)}"

    def _check_end(self, engine: LLMEngine) -> None:
        if engine.has_unfinished_requests() or engine.groups:
            raise StressFailure("lost", f"requests left in the engine: {sorted(engine.groups)}")
        kv = engine.kv_manager
        used = kv.pool.num_used
        cpu_used = kv.cpu_pool.num_used if kv.cpu_pool is not None else 0
        if used or cpu_used or kv.tables or kv.cpu_tables:
            raise StressFailure("leak", f"at the end {used} device and {cpu_used} CPU blocks are "
                                        f"in use, tables {sorted(kv.tables)} / "
                                        f"{sorted(kv.cpu_tables)}")


def repro(seed: int, tp: bool = False, spec: bool | str = False, hybrid: bool = False,
          conv: bool = False, recurrent: bool = False) -> str:
    """The command that reruns `seed`; `spec`: True or "ngram", "draft" or "oracle"; `hybrid`: on the
    model mixing sliding-window and full layers; `conv`: on the short-convolution one;
    `recurrent`: on the one with a recurrent state."""
    return (f"python scripts/stress.py --seed {seed}" + (" --tp" if tp else "")
            + (" --hybrid" if hybrid else "") + (" --conv" if conv else "")
            + (" --recurrent" if recurrent else "")
            + (f" --spec {'ngram' if spec is True else spec}" if spec else ""))
