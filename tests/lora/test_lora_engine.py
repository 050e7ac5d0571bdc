"""Multi-LoRA serving end to end on the tiny Llama (float32): adapters and the base model mixed in
one batch match HF + PEFT (vLLM's tie rule); a request's tokens and logprobs with its adapter do
not depend on what else is in its batch, on eviction and reload, on preemption, on the message
path to worker processes; the prefix cache never shares KV across adapters; adapters come and go
while requests run."""

from __future__ import annotations

import pickle
import random

import pytest

import tiny
from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.worker.step_message import StepDecoder, StepEncoder
from utils import assert_tie_rule, drive, hf_greedy, ours_as_pairs, output_key

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
            for n in lengths]


def make(base, **kw):
    opts = dict(dtype="float32", block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16)
    opts.update(kw)
    return LLM(str(base), **opts)


@pytest.fixture(scope="module")
def llm(lora_base):
    return make(lora_base)


def keys(outs):
    return [output_key(o) for o in outs]


def test_two_adapters_and_the_base_model_in_one_batch_match_hf_peft(llm, lora_base, adapters,
                                                                     lora_requests):
    ps = prompts([5, 9, 7, 12], seed=1)
    loras = [lora_requests["r8"], None, lora_requests["r16"], lora_requests["r8"]]
    outs = llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
    refs = {None: tiny.load_hf(lora_base)}
    for name in ("r8", "r16"):
        refs[name] = tiny.load_hf_with_adapter(lora_base, adapters[name])
    for p, lora, out in zip(ps, loras, outs):
        ref = hf_greedy(refs[lora and lora.lora_name], p["prompt_token_ids"], GREEDY.max_tokens)
        assert_tie_rule(ours_as_pairs(out.outputs[0]), ref, lora and lora.lora_name)
    # the adapters change the continuation (the comparison above is not base vs base)
    base_only = llm.generate(ps, GREEDY, use_tqdm=False)
    assert base_only[0].outputs[0].token_ids != outs[0].outputs[0].token_ids
    assert base_only[2].outputs[0].token_ids != outs[2].outputs[0].token_ids
    assert output_key(base_only[1]) == output_key(outs[1])


def test_a_request_with_its_adapter_is_exact_whatever_else_is_in_its_batch(llm, lora_requests):
    target = prompts([11], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)
    alone = llm.generate(target, params, lora_request=lora_requests["r8"], use_tqdm=False)
    others = prompts([3, 17, 6, 9, 25], seed=8)
    mixed_loras = [lora_requests["r16"], None, lora_requests["r4"], lora_requests["r16"], None]
    mixed = llm.generate(others[:2] + target + others[2:], params,
                         lora_request=mixed_loras[:2] + [lora_requests["r8"]] + mixed_loras[2:],
                         use_tqdm=False)
    assert output_key(mixed[2]) == output_key(alone[0])
    # in a batch of nothing but other adapters' decode steps too (chunked prompts interleave)
    small = make(llm.engine.args.model, max_num_batched_tokens=8)
    again = small.generate(others[:3] + target, params,
                           lora_request=[lora_requests["r16"], lora_requests["r4"],
                                         lora_requests["r16"], lora_requests["r8"]],
                           use_tqdm=False)
    assert output_key(again[3]) == output_key(alone[0])


def test_eviction_and_reload_give_the_same_outputs(llm, lora_base, lora_requests):
    ps = prompts([6, 8, 7, 9, 5, 10], seed=3)
    loras = [lora_requests[n] for n in ("r8", "r16", "r4", "r8", "r4", "r16")]
    ref = llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
    # one slot, one CPU copy: every switch evicts and reads the next adapter from disk again
    tight = make(lora_base, max_loras=1, max_cpu_loras=1)
    got = tight.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
    assert keys(got) == keys(ref)
    stats = tight.engine.executor.worker.lora.stats
    assert stats["slot_evictions"] >= 2 and stats["disk_loads"] >= 3
    # (requests of the adapter in the slot run first: the scheduler passes over the others)
    again = tight.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
    assert keys(again) == keys(ref) and stats["disk_loads"] > 3  # evicted ones read again
    # two slots over a CPU cache of three: evictions come back from CPU memory
    cached = make(lora_base, max_loras=2, max_cpu_loras=3)
    for _ in range(2):  # the second time, the adapter evicted from its slot is in CPU memory
        assert keys(cached.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)) == keys(ref)
    stats = cached.engine.executor.worker.lora.stats
    assert stats["disk_loads"] == 3 and stats["cpu_hits"] >= 1


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once(lora_base, lora_requests):
    llm = make(lora_base, max_loras=2)
    engine = llm.engine
    for i, name in enumerate(("r8", "r16", "r4", "r8")):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=[1, 5, 9, 11],
                           lora_request=lora_requests[name])
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        running = {g.lora_request.lora_int_id for g in engine.scheduler.running}
        assert len(running) <= 2
        seen.append(running)
    assert engine.num_used_blocks() == 0
    assert any(lora_requests["r4"].lora_int_id in s for s in seen)  # its turn came


def test_a_request_waiting_for_a_slot_does_not_hold_back_the_requests_behind_it(
        lora_base, lora_requests):
    """As vLLM's scheduler: a waiting request whose adapter has no free slot is passed over;
    the base model's and the running adapters' requests behind it are admitted; it keeps its
    place and runs when a slot frees up."""
    llm = make(lora_base, max_loras=2)
    engine = llm.engine
    for i, name in enumerate(("r8", "r16", "r4", "r8", None)):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=[1, 5, 9, 11 + i],
                           lora_request=lora_requests[name] if name else None)
    engine.step()
    assert sorted(g.request_id for g in engine.scheduler.running) == ["0", "1", "3", "4"]
    assert [g.request_id for g in engine.scheduler.waiting] == ["2"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["0", "1", "2", "3", "4"] and engine.num_used_blocks() == 0


def test_the_prefix_cache_never_shares_blocks_across_adapters(llm, lora_requests):
    p = prompts([17], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.reset_prefix_cache()
    first = llm.generate(p, params, lora_request=lora_requests["r8"], use_tqdm=False)[0]
    other = llm.generate(p, params, lora_request=lora_requests["r16"], use_tqdm=False)[0]
    base = llm.generate(p, params, use_tqdm=False)[0]
    same = llm.generate(p, params, lora_request=lora_requests["r8"], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert same.num_cached_tokens == 16  # four full blocks of the same adapter
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_swap_and_sharing_keep_each_adapter_exact(llm, lora_base, lora_requests):
    ps = prompts([9, 14, 6, 11], seed=5)
    loras = [lora_requests["r8"], lora_requests["r16"], None, lora_requests["r4"]]
    params = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, best_of=3, temperature=0.8, seed=9, max_tokens=10,
                             ignore_eos=True)]
    ref = llm.generate(ps, params, lora_request=loras, use_tqdm=False)
    for mode in ("recompute", "swap"):
        small = make(lora_base, num_kv_blocks=14, preemption_mode=mode)
        got = small.generate(ps, params, lora_request=loras, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0, mode
        assert keys(got) == keys(ref), mode
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    alone = llm.beam_search(ps[:1], beams, lora_request=lora_requests["r16"])
    both = llm.beam_search(ps[:2], beams, lora_request=[lora_requests["r16"], None])
    assert output_key(both[0]) == output_key(alone[0])
    assert output_key(alone[0]) != output_key(llm.beam_search(ps[:1], beams)[0])


def test_chat_takes_a_lora_request(llm, lora_requests):
    conv = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with_lora = llm.chat(conv, params, lora_request=lora_requests["r8"], use_tqdm=False,
                         chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = llm.get_tokenizer()("hello there").input_ids
    direct = llm.generate({"prompt_token_ids": ids}, params, lora_request=lora_requests["r8"],
                          use_tqdm=False)
    assert with_lora[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


class LoopbackExecutor:
    """The in-process executor, every step encoded, pickled and decoded as for worker
    processes (the adapter travels once per request in the message)."""

    def __init__(self, inner) -> None:
        self.inner, self.encoder, self.decoder = inner, StepEncoder(), StepDecoder()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, step):
        decoded = self.decoder.decode(pickle.loads(pickle.dumps(self.encoder.encode(step))))
        assert decoded.rows == step.rows
        return self.inner.execute(decoded)


def test_adapters_travel_in_the_step_message(llm, lora_requests):
    ps = prompts([6, 10, 8], seed=6)
    loras = [lora_requests["r8"], None, lora_requests["r16"]]
    ref = llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
    direct = llm.engine.executor
    llm.engine.executor = looped = LoopbackExecutor(direct)
    try:
        assert keys(llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)) == keys(ref)
        llm.generate(ps[:1], GREEDY, use_tqdm=False)  # the ends travel with the next step
    finally:
        llm.engine.executor = direct
    assert looped.decoder.loras == {}  # forgotten with their requests


def test_adapters_are_added_and_removed_while_requests_run(llm, lora_base, lora_requests):
    ps = prompts([7, 9], seed=9)
    r8, r16 = lora_requests["r8"], lora_requests["r16"]
    ref = llm.generate(ps, GREEDY, lora_request=[r8, r16], use_tqdm=False)
    other = make(lora_base)
    engine = other.engine
    engine.add_request("a", None, GREEDY, prompt_token_ids=ps[0]["prompt_token_ids"],
                       lora_request=r8)
    for _ in range(3):
        engine.step()
    assert engine.add_lora(r16) and engine.list_loras() == {r8.lora_int_id, r16.lora_int_id}
    engine.add_request("b", None, GREEDY, prompt_token_ids=ps[1]["prompt_token_ids"],
                       lora_request=r16)
    engine.step()
    assert engine.remove_lora(r8.lora_int_id)  # "a" keeps running with it
    assert not engine.remove_lora(r8.lora_int_id)
    final = drive(engine, 100)
    assert [output_key(final[k]) for k in ("a", "b")] == keys(ref)
    assert engine.list_loras() == {r16.lora_int_id}


def test_structured_outputs_hold_per_request_with_adapters(llm, lora_requests):
    from pagedserve.structured_output import StructuredOutputsParams

    choices = ["yes", "no", "maybe not"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for s in range(4)]
    loras = [lora_requests["r8"], None, lora_requests["r16"], lora_requests["r4"]]
    outs = llm.generate(["a"] * 4, params, lora_request=loras, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    alone = llm.generate(["a"], params[2], lora_request=loras[2], use_tqdm=False)
    assert output_key(alone[0]) == output_key(outs[2])
