"""Speculative decoding against a reference run, for the exactness tests: `OracleDrafts` drafts
the reference outputs' own continuation of each sequence's tokens, spoiled in turn (all right:
every draft accepted; the second wrong: one accepted; the first wrong: none), so that every
family's speculative rows are accepted in full, in part and not at all. (A tiny random model
does not repeat its prompt, so the n-gram proposer rarely finds drafts it would accept.)"""

from __future__ import annotations

from pagedserve import LLM
from pagedserve.core.proposers import Proposer
from utils import drive

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


class OracleDrafts(Proposer):
    """Drafts from `runs` (prompt + output token lists of a reference run), spoiled in turn; with
    `rng` (a `random.Random`), one row in two spoiled at a random draft instead."""

    def __init__(self, config, runs: list[list[int]], rng=None):
        super().__init__(config)
        self.runs, self.count, self.rng = runs, 0, rng

    def propose(self, batch):
        out = []
        for row in batch:
            tokens = list(row.seq.token_ids)
            n = len(tokens)
            run = next((r for r in self.runs if len(r) > n and r[:n] == tokens), None)
            drafts = [] if run is None else run[n:n + row.limit]
            self.count += 1
            if self.rng is None:
                spoil = (None, 1, 0)[self.count % 3]
            else:
                spoil = self.rng.randrange(len(drafts)) if drafts and self.rng.random() < 0.5 \
                    else None
            if spoil is not None and spoil < len(drafts):
                # (another token of the same run: a valid id, unlike the draft)
                drafts[spoil] = next((t for t in run if t != drafts[spoil]), drafts[spoil])
            out.append(drafts)
        return out


def speculating(path, requests, want, **options):
    """`requests` ((id, prompt ids, SamplingParams)) on an `LLM` of `path` (float32, block
    size 4 unless given, `options`) speculating with drafts from `want` (their reference
    outputs), driven to the end: (the final outputs in order, the engine)."""
    options.setdefault("block_size", 4)
    llm = LLM(path, dtype="float32", speculative_config=SPEC, **options)
    runs = [list(p) + list(c.token_ids) for (_, p, _), o in zip(requests, want)
            for c in o.outputs]
    llm.engine.spec.proposer = OracleDrafts(llm.engine.spec.config, runs)
    for rid, prompt, params in requests:
        llm.engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final = drive(llm.engine, 8000)  # (invariants every step; the pool ends empty)
    return [final[rid] for rid, _, _ in requests], llm.engine
