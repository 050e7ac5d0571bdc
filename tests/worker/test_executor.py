"""The in-process executor speaks the same step protocol as the multi-process ones: every step
goes through the delta encoder into the worker's persistent batch, which keeps one row object per
sequence across steps and forgets a request when it ends."""

from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.worker.executor import UniExecutor


def test_uni_executor_steps_through_the_delta_into_a_persistent_batch(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    engine = llm.engine
    executor = engine.executor
    assert isinstance(executor, UniExecutor)
    decoder = executor.worker.decoder
    messages = []
    encode = executor.encoder.encode
    executor.encoder.encode = lambda step: messages.append(encode(step)) or messages[-1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", None, params, prompt_token_ids=[1, 5, 9, 13, 17])
    engine.add_request("b", None, params, prompt_token_ids=[1, 7, 11])
    engine.step()  # the prompts
    rows = dict(decoder.rows)
    assert sorted(rows) == sorted(s.seq_id for g in engine.scheduler.running for s in g.seqs)
    engine.step()  # a decode step: the same row objects, moved on by one token
    assert all(decoder.rows[seq_id] is row for seq_id, row in rows.items())
    assert all(row.end - row.start == 1 for row in rows.values())
    # a decode step sends one token a sequence and no table unless a block was added
    assert all(len(new) == 1 for _, _, new in messages[-1].delta.tokens)
    assert messages[-1].delta.new_requests == [] and messages[-1].delta.new_seqs == []
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    # the next step tells the worker: its batch then holds only the new request
    engine.add_request("c", None, params, prompt_token_ids=[1, 3])
    engine.step()
    assert list(decoder.requests) == ["c"]
    assert sorted(decoder.rows) == [s.seq_id for g in engine.scheduler.running for s in g.seqs]
    # the same tokens as a fresh engine's (a request alone)
    ref = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    alone = ref.generate([{"prompt_token_ids": [1, 5, 9, 13, 17]}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs if o.request_id == "a"] == \
        [alone[0].outputs[0].token_ids]
