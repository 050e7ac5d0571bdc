"""The scheduler's step delta (core/step_delta.py) keeps the workers' mirrors equal to the
scheduler's own state: seeded random workloads with preemption (swap and recomputation), prefix
caching, n > 1 / best_of forks, n-gram speculative decoding and beam search, each step's message
decoded by a second mirror (pickled, as for a worker process) and checked, after every step,
against the driver's rows, and the worker's own mirror checked too; the run's tokens and logprobs
equal a roomy cache's run."""

import pickle
import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.beam_search import BeamSearchParams
from pagedserve.worker.step_message import StepDecoder, StepEncoder
from utils import shuffled_free_blocks


class MirrorCheck:
    """The engine's in-process executor, every step encoded, pickled and decoded by a mirror of
    its own, which must hold the scheduler's token lists and block tables for every scheduled
    row, as must the worker's mirror after the step. Counts the kinds of table delta seen."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoder, self.decoder = StepEncoder(), StepDecoder()
        self.kinds = dict.fromkeys(("append", "replace", "whole", "tokens", "freed"), 0)
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, step):
        msg = self.encoder.encode(step)
        known = set(self.decoder.tables)
        for seq_id, keep, new in msg.delta.tables:
            held = len(self.decoder.tables.get(seq_id, ()))
            kind = "whole" if keep == 0 and seq_id in known else \
                "append" if keep == held else "replace"
            self.kinds[kind] += 1
        self.kinds["tokens"] += len(msg.delta.tokens)
        self.kinds["freed"] += len(msg.delta.freed_seqs)
        decoded = self.decoder.decode(pickle.loads(pickle.dumps(msg)))
        assert self.decoder.mismatches(step) == [], self.steps
        assert decoded.rows == step.rows
        out = self.inner.execute(decoded)
        assert self.inner.worker.decoder.mismatches(step) == [], self.steps
        self.steps += 1
        return out


def workload(seed: int):
    """Prompts that share prefixes (prefix-cache hits) and repeat themselves (n-gram drafts),
    with a mix of greedy (logprobs, prompt logprobs) and seeded sampling with n / best_of."""
    rng = random.Random(seed)
    stems = [[1] + [rng.randrange(3, 300) for _ in range(7)] for _ in range(2)]
    prompts, params = [], []
    for i in range(6):
        motif = [rng.randrange(3, 300) for _ in range(rng.randint(2, 4))]
        ids = rng.choice(stems) + motif * rng.randint(2, 4)
        prompts.append({"prompt_token_ids": ids})
        kind = rng.randrange(4)
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(6, 14), ignore_eos=True,
                               logprobs=2)
        elif kind == 1:
            p = SamplingParams(n=2, temperature=1.0, seed=rng.randrange(100),
                               max_tokens=rng.randint(6, 12), ignore_eos=True, logprobs=1)
        elif kind == 2:
            p = SamplingParams(n=2, best_of=3, temperature=0.8, seed=rng.randrange(100),
                               max_tokens=8, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                               prompt_logprobs=1)
        params.append(p)
    return prompts, params


def summary(outs):
    return [(o.prompt_logprobs and [sorted(d.items()) for d in o.prompt_logprobs[1:]],
             [(c.token_ids, c.cumulative_logprob,
               c.logprobs and [sorted(d.items()) for d in c.logprobs]) for c in o.outputs])
            for o in outs]


def engine(path, check: bool, **kw):
    llm = LLM(path, dtype="float32", block_size=4, enable_prefix_caching=True, **kw)
    if check:
        shuffled_free_blocks(llm, 5)
        llm.engine.executor = MirrorCheck(llm.engine.executor)
    return llm


@pytest.mark.parametrize("mode,seed", [("swap", 0), ("recompute", 1)])
def test_random_workloads_keep_the_worker_mirror_equal_to_the_scheduler(checkpoints, mode, seed):
    path = str(checkpoints("llama"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    prompts, params = workload(seed)
    ref = engine(path, False, speculative_config=spec, kv_cache_memory=1 << 22).generate(prompts, params, use_tqdm=False)
    llm = engine(path, True, speculative_config=spec, num_kv_blocks=18, num_cpu_blocks=16,
                 preemption_mode=mode, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched, check = llm.engine.scheduler, llm.engine.executor
    # the workload must exercise what the delta carries
    assert sched.preemptions_by_mode[mode] > 0 and llm.engine.spec.num_drafts > 0
    assert sched.kv.prefix_hits > 0
    assert check.kinds["append"] and check.kinds["whole"] and check.kinds["replace"], check.kinds
    assert summary(outs) == summary(ref)
    llm.engine.step()  # delivers the last finished request ids
    assert check.decoder.seqs == {} and check.decoder.requests == {}


def test_beam_search_keeps_the_worker_mirror_equal_to_the_scheduler(checkpoints):
    # gemma3: sliding-window and full-attention groups (two columns per table row; the window's
    # blocks given back become null entries)
    path = str(checkpoints("gemma3"))
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 300) for _ in range(n)]}
               for n in (5, 9)]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    ref = engine(path, False, kv_cache_memory=1 << 22).beam_search(prompts, params)
    llm = engine(path, True, num_kv_blocks=20, num_cpu_blocks=8, preemption_mode="swap")
    outs = llm.beam_search(prompts, params)
    check = llm.engine.executor
    assert llm.engine.scheduler.num_preemptions > 0 and check.kinds["freed"] > 0, check.kinds
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in outs] == \
        [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in ref]
    llm.engine.step()
    assert check.decoder.seqs == {} and check.decoder.tables == {}
