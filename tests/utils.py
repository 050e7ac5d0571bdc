"""Helpers shared by tests: the HF greedy reference, vLLM's tie rule for comparing greedy runs,
`attention_metadata` (a step's metadata built by a backend) and `PagedRunner` (a model stepped on
paged KV caches without the engine)."""

from __future__ import annotations

import random

import torch

from pagedserve.attention.backends import make_backend
from pagedserve.attention.backends.base import AttentionBatch
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_cache_manager import KVCacheManager


def attention_metadata(backend: str = "torch", **batch) -> AttentionMetadata:
    """One step's attention metadata as a default instance of `backend` ("torch" | "triton")
    builds it; `batch`: the `AttentionBatch` fields (block_tables, seq_lens, query_lens,
    block_size, null_block; device, decode_rows, num_splits, ...)."""
    return make_backend(backend).build_metadata(AttentionBatch(**batch))


def shuffled_free_blocks(llm, seed: int):
    """Rebuild `llm`'s (idle) engine cache over a block pool whose free list is shuffled by `seed`
    (a test hook: outputs must not depend on which physical blocks a sequence gets)."""
    llm.engine.reconfigure_cache(lambda config: KVCacheManager.from_config(config, shuffle_seed=seed))
    return llm


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, k: int = 5):
    """Greedy tokens of HF `generate` for one prompt, and per position the top-k raw logprobs
    (dict token -> logprob, the chosen token included)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = []
    for step, tok in zip(out.logits, tokens):
        lp = torch.log_softmax(step[0].float(), dim=-1)
        vals, idx = torch.topk(lp, k)
        entry = dict(zip(idx.tolist(), vals.tolist()))
        entry[tok] = float(lp[tok])
        logprobs.append(entry)
    return tokens, logprobs


def ours_as_pairs(completion) -> tuple[list[int], list[dict[int, float]]]:
    """(tokens, per-position {token: logprob}) of a pagedserve CompletionOutput."""
    return list(completion.token_ids), [
        {t: lp.logprob for t, lp in pos.items()} for pos in (completion.logprobs or [])
    ]


def assert_tie_rule(ours, ref, name: str = "") -> None:
    """vLLM's rule: equal tokens up to the first difference; there, each side's token must be in
    the other's top-k logprobs, and the comparison stops."""
    (a_tok, a_lp), (b_tok, b_lp) = ours, ref
    for i, (x, y) in enumerate(zip(a_tok, b_tok)):
        if x == y:
            continue
        assert x in b_lp[i] and y in a_lp[i], (
            f"{name}: position {i}: ours {x} vs reference {y} is not a near-tie\n"
            f"ours {a_tok}\nref  {b_tok}"
        )
        return
    assert len(a_tok) == len(b_tok), f"{name}: lengths differ: {len(a_tok)} vs {len(b_tok)}"


def output_key(out) -> tuple:
    """Everything a request returned that must not change when KV moves around (preemption,
    swapping, prefix caching, chunking, batch composition): tokens, finish reasons, cumulative
    logprobs, per-token and prompt logprobs (values and ranks). Compared with `==`: exact."""
    def lp(entries):
        if entries is None:
            return None
        return [None if e is None else sorted((t, x.logprob, x.rank) for t, x in e.items())
                for e in entries]

    completions = getattr(out, "outputs", None)
    if completions is None:  # a beam search output
        return tuple((s.output_token_ids, s.cum_logprob, s.finish_reason) for s in out.sequences)
    return (tuple((c.token_ids, c.finish_reason, c.cumulative_logprob, lp(c.logprobs))
                  for c in completions), lp(out.prompt_logprobs))


def assert_same_outputs(ours, ref) -> None:
    """Same-engine runs are compared exactly (float32 on CPU is deterministic): see output_key."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert output_key(a) == output_key(b), f"request {i} differs"


def drive(engine, max_steps: int) -> dict:
    """Step `engine` until every request finished, at most `max_steps` steps (a hang fails),
    checking the block tables after every step; returns the final output of each request."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_invariants()
    assert not engine.has_unfinished_requests(), f"not finished after {max_steps} steps"
    assert engine.num_used_blocks() == 0
    return final


class PagedRunner:
    """Runs `model` step by step on a paged KV cache, like the engine would: NaN-filled caches
    (reading an unwritten slot poisons the output) with a zero null block, block tables drawn
    from a free list shuffled by `seed`, attention on `backend`; caches in the model's dtype,
    or `kv_dtype` (fp8 blocks)."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, seed: int = 0,
                 device: str = "cpu", backend: str = "torch", kv_dtype: torch.dtype | None = None):
        # the caches' storage dtype: the model's, or `kv_dtype` (fp8 blocks: kv_cache_dtype)
        dtype = kv_dtype or next(model.parameters()).dtype
        if hasattr(model, "bind_cache"):  # (a recurrent state's entries depend on both)
            model.bind_cache(block_size, dtype)
        spec = model.kv_cache_spec
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.device, self.attention = device, make_backend(backend)
        shape = (num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = []
        for _ in range(spec.num_layers):
            k = torch.full(shape, float("nan"), dtype=dtype, device=device)
            v = torch.full_like(k, float("nan"))
            k[num_blocks] = 0
            v[num_blocks] = 0
            self.kv_caches.append((k, v))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int]]],
             keep: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Feed `(seq_id, new_tokens)` for each sequence as one flat batch; logits `[n_new, V]` each,
        or, with `keep`, only those of the new tokens at `keep[i]` (`[len(keep[i]), V]`)."""
        ids, pos, tables, seq_lens, query_lens = [], [], [], [], []
        for seq_id, tokens in batch:
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[seq_id] = end
            ids += tokens
            pos += range(start, end)
            tables.append(list(table))
            seq_lens.append(end)
            query_lens.append(len(tokens))
        meta = self.attention.build_metadata(AttentionBatch(
            block_tables=tables,
            seq_lens=seq_lens,
            query_lens=query_lens,
            block_size=self.block_size,
            null_block=self.num_blocks,
            device=self.device,
        ))
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(pos, device=self.device), self.kv_caches, meta)
        assert hidden.shape[0] == len(ids)
        if keep is not None:
            parts = hidden.split(query_lens)
            hidden = torch.cat([part[rows] for part, rows in zip(parts, keep, strict=True)])
            query_lens = [len(rows) for rows in keep]
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def run_requests(path, requests, max_steps: int = 20000, **options):
    """An `LLM` on `path` (float32; `options` are engine options, block_size 16 unless given) fed
    `requests` -- (request id, prompt ids, SamplingParams or BeamSearchParams) -- and driven to
    the end: (their final outputs in order, the engine)."""
    from pagedserve import LLM, BeamSearchParams

    llm = LLM(path, dtype="float32", block_size=options.pop("block_size", 16), **options)
    for rid, prompt, params in requests:
        if isinstance(params, BeamSearchParams):
            llm.engine.add_beam_request(rid, None, params, prompt_token_ids=prompt)
        else:
            llm.engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final = drive(llm.engine, max_steps)
    return [final[rid] for rid, _, _ in requests], llm.engine


# byte offsets of the fp16 scales inside a K-quant block (d, and dmin where there is one)
K_QUANT_SCALES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def ggml_block_bytes(fmt: str, n: int, k: int, seed: int = 0):
    """uint8 numpy `[n, row_bytes]`: an `[n, k]` weight in ggml format `fmt` ("q8_0", "q4_0",
    "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"). gguf cannot quantize K-quants: those are random
    blocks with small scales (valid blocks); the others quantize N(0, 0.05) values."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[fmt.upper()]
    if fmt in K_QUANT_SCALES:
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
        for off in K_QUANT_SCALES[fmt]:
            scales = (rng.random((n, k // 256)) * 0.004 + 0.001).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // 256, 2)
        return raw.reshape(n, -1)
    return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


def families(default, every) -> list:
    """pytest parameters: the families of `default`, then the others of `every`, which run only
    with PAGEDSERVE_EVERY_FAMILY=1 (the suite keeps one family per mechanism by default, to stay
    within its time on 2 cores)."""
    import os

    import pytest

    skip = pytest.mark.skipif(not os.environ.get("PAGEDSERVE_EVERY_FAMILY"),
                              reason="PAGEDSERVE_EVERY_FAMILY=1 runs every family")
    return list(default) + [pytest.param(f, marks=skip) for f in every if f not in default]


def add_gguf_tensor(writer, name: str, data, qtype, quantize: bool = True) -> None:
    """`data` (a float32 numpy array) under `name` in a `gguf.GGUFWriter`: as `qtype`'s blocks when
    `quantize`, qtype is not F32 and data has 2+ dimensions (a matrix or an expert stack), else as
    it is (norms, biases, and what the caller keeps in float: embeddings, routers)."""
    import gguf
    import numpy as np

    if quantize and qtype != gguf.GGMLQuantizationType.F32 and data.ndim >= 2:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, data)


def finish_gguf(writer) -> None:
    """Write a `gguf.GGUFWriter`'s header, key-values and tensors to its file and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
