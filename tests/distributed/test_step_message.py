"""The per-step driver -> worker message: every step of a real engine, sent through the delta
encoder, pickled, and rebuilt by a worker-side mirror, runs exactly as the scheduler's own objects
do (sampling, forks, beams, prompt logprobs, preemption), stays small, and leaves no state behind."""

import pickle
import random

from pagedserve import LLM, SamplingParams
from pagedserve.core.beam_search import BeamSearchParams
from pagedserve.worker.step_message import StepDecoder, StepEncoder
from utils import shuffled_free_blocks


class LoopbackExecutor:
    """The engine's in-process executor, but every step goes encoder -> pickle -> decoder, as it
    does to a worker process."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoder, self.decoder = StepEncoder(), StepDecoder()
        self.sizes: list[tuple[int, int]] = []  # (scheduled sequences, message bytes)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, step):
        payload = pickle.dumps(self.encoder.encode(step), protocol=pickle.HIGHEST_PROTOCOL)
        self.sizes.append((len(step.rows), len(payload)))
        decoded = self.decoder.decode(pickle.loads(payload))
        # The worker rebuilds exactly the step the driver encoded.
        assert decoded.rows == step.rows
        assert (decoded.blocks_to_swap_out, decoded.blocks_to_swap_in, decoded.blocks_to_copy) \
            == (step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
        return self.inner.execute(decoded)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
            for n in lengths]


def make(path, loopback: bool, shuffle_seed=None, **kw):
    llm = LLM(path, dtype="float32", block_size=4, **kw)
    if shuffle_seed is not None:
        shuffled_free_blocks(llm, shuffle_seed)
    if loopback:
        llm.engine.executor = LoopbackExecutor(llm.engine.executor)
    return llm


def summary(outs):
    return [(o.prompt_logprobs and [sorted(d.items()) for d in o.prompt_logprobs[1:]],
             [(c.token_ids, c.cumulative_logprob, c.logprobs and [sorted(d) for d in c.logprobs])
              for c in o.outputs]) for o in outs]


MIXED = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=1.0, seed=3, max_tokens=14, ignore_eos=True,
                   repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
    SamplingParams(n=2, best_of=3, temperature=0.8, seed=9, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, ignore_eos=True,
                   logit_bias={7: 5.0}, min_tokens=4),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
]


def test_mixed_requests_through_the_message_path_equal_the_direct_path_under_preemption(checkpoints):
    path = str(checkpoints("llama"))
    ps = prompts([9, 17, 6, 13, 22, 8], seed=1)
    for mode in ("swap", "recompute"):
        kw = dict(num_kv_blocks=20, num_cpu_blocks=12, preemption_mode=mode,
                  max_num_batched_tokens=16, shuffle_seed=3)
        ref = make(path, False, **kw).generate(ps, MIXED, use_tqdm=False)
        llm = make(path, True, **kw)
        outs = llm.generate(ps, MIXED, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, mode  # the test must preempt
        assert summary(outs) == summary(ref), mode


def test_beam_search_through_the_message_path_frees_pruned_beams(checkpoints):
    path = str(checkpoints("gemma3"))
    ps = prompts([7, 12], seed=2)
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    ref = make(path, False, kv_cache_memory=1 << 22).beam_search(ps, params)
    llm = make(path, True, kv_cache_memory=1 << 22)
    outs = llm.beam_search(ps, params)
    assert [[s.tokens for s in o.sequences] for o in outs] == \
        [[s.tokens for s in o.sequences] for o in ref]
    llm.engine.step()  # delivers the last finished request ids
    decoder = llm.engine.executor.decoder
    assert decoder.seqs == {} and decoder.tables == {} and decoder.requests == {}


def test_decode_steps_send_a_few_bytes_per_sequence_and_tables_only_when_they_change(checkpoints):
    llm = make(str(checkpoints("llama")), True, kv_cache_memory=1 << 22)
    engine = llm.engine
    for i, p in enumerate(prompts([30] * 16, seed=4)):
        engine.add_request(str(i), None, SamplingParams(temperature=0.0, max_tokens=9,
                                                        ignore_eos=True), **p)
    executor = engine.executor
    messages = []
    original = executor.encoder.encode
    executor.encoder.encode = lambda sched: messages.append(original(sched)) or messages[-1]
    while engine.has_unfinished_requests():
        engine.step()
    prefill, decodes = messages[0], messages[1:]
    assert len(prefill.delta.new_requests) == 16 and sum(len(t) for _, _, t in prefill.delta.tokens) == 16 * 30
    for msg in decodes:
        assert not msg.delta.new_requests and not msg.delta.new_seqs
        assert [len(t) for _, _, t in msg.delta.tokens] == [1] * len(msg.rows)  # just the new token
        # Blocks of 4 tokens: positions 32 and 36 open the 9th and the 10th block; the table
        # delta is that one block, appended.
        start = msg.rows[0][1]
        assert [(keep, len(new)) for _, keep, new in msg.delta.tables] == \
            ([(start // 4, 1)] * 16 if start % 4 == 0 else [])
    assert sum(1 for m in decodes if m.delta.tables) == 2
    per_seq = [size / n for n, size in executor.sizes[1:]]
    assert max(per_seq) < 64, per_seq  # bytes per decoding sequence, pickled (~40 measured)


def test_structured_outputs_through_the_message_path_equal_the_direct_path(checkpoints):
    import re

    from pagedserve.structured_output import StructuredOutputsParams as SO

    path = str(checkpoints("llama"))
    ps = prompts([9, 5, 12], seed=4)
    regex = r"[a-z]{2,5}-[0-9]{1,3}"
    params = [SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20,
                             structured_outputs=SO(regex=regex)),
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(choice=["x y"])),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True)]
    ref = make(path, False, kv_cache_memory=1 << 22).generate(ps, params, use_tqdm=False)
    outs = make(path, True, kv_cache_memory=1 << 22).generate(ps, params, use_tqdm=False)
    assert summary(outs) == summary(ref)
    assert all(re.fullmatch(regex, c.text) for c in outs[0].outputs)
    assert outs[1].outputs[0].text == "x y"


def test_pooling_requests_through_the_message_path_equal_the_direct_path(checkpoints):
    # Mean pooling over prompts split across steps: every chunk's row carries the request's
    # pooling (sent once per request), so workers skip the logits of the same rows.
    path = str(checkpoints("llama"))
    ps = prompts([9, 30, 17, 4], seed=2)
    opts = dict(runner="pooling", pooler_config='{"pooling_type": "MEAN"}',
                max_num_batched_tokens=8)
    direct = make(path, loopback=False, **opts).encode(ps, pooling_task="embed", use_tqdm=False)
    llm = make(path, loopback=True, **opts)
    looped = llm.encode(ps, pooling_task="embed", use_tqdm=False)
    assert all(a.outputs.data.equal(b.outputs.data) for a, b in zip(direct, looped))
    # forgotten with their requests (the last one's end travels with the next step)
    decoder = llm.engine.executor.decoder
    assert set(decoder.pooling) == set(decoder.requests) and len(decoder.pooling) <= 1


def test_speculative_rows_carry_their_drafts_through_the_message_path(checkpoints):
    # Repeating prompts: the n-gram proposer finds drafts; the decoded rows (drafts included)
    # are asserted equal to the driver's by LoopbackExecutor.
    path = str(checkpoints("llama"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    ps = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10, 11] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    ref = make(path, False).generate(ps, params, use_tqdm=False)
    llm = make(path, True, speculative_config=spec)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert llm.engine.spec.num_drafts > 0
    assert summary(outs) == summary(ref)
