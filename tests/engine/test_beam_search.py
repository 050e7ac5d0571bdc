"""Beam search inside the engine: equal to HF transformers, block sharing, documented semantics."""

import pytest
import torch

from pagedserve import LLM, BeamSearchParams
from pagedserve.core.beam_search import BeamState, select
from test_llm_engine import prompts_of_lengths


def hf_beams(model, prompt, k, max_tokens):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k,
                             num_return_sequences=k, do_sample=False, max_new_tokens=max_tokens,
                             length_penalty=0.0, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True,
                             early_stopping=False)
    return [s[len(prompt):].tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_beams_equal_hf_generate_num_beams(arch, k, checkpoints, hf_models):
    llm = LLM(str(checkpoints(arch)), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompts = prompts_of_lengths([5, 11], seed=k)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=k, max_tokens=8, ignore_eos=True,
                                            length_penalty=0.0))
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_scores = hf_beams(hf_models(arch), prompt, k, 8)
        assert [s.output_token_ids for s in out.sequences] == ref_tokens
        for s, ref in zip(out.sequences, ref_scores):
            assert abs(s.cum_logprob - ref) < 1e-3
        assert all(s.tokens[: len(prompt)] == prompt for s in out.sequences)
    assert llm.engine.num_used_blocks() == 0


def test_beams_share_blocks_and_copy_only_the_last_partial_block(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    engine = llm.engine
    group = engine.add_beam_request("b", None, BeamSearchParams(beam_width=3, max_tokens=6,
                                                                 ignore_eos=True),
                                    prompt_token_ids=prompts_of_lengths([10])[0])
    engine.step()  # prefill once, then fork into 3 beams
    tables = [list(engine.kv_manager.block_table(q.seq_id)) for q in group.seqs]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    scheduled = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    engine.step()  # each beam writes position 10: the shared partial block is copied twice
    full, partial = tables[0][:2], tables[0][2]
    copies = scheduled[-1].blocks_to_copy
    assert [src for src, _ in copies] == [partial, partial]  # the last holder writes in place
    written = [s.block_table for s in scheduled[-1].scheduled]
    assert all(t[:2] == full for t in written)  # the full prompt blocks stay shared
    assert sorted(t[2] for t in written) == sorted([partial] + [dst for _, dst in copies])
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_used_blocks() == 0


def test_beam_search_under_preemption_gives_the_same_beams(checkpoints):
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([6, 9, 7], seed=2)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True, length_penalty=0.0)
    ref = LLM(str(checkpoints("qwen3")), dtype="float32", block_size=4,
              kv_cache_memory=1 << 22).beam_search(prompts, params)
    for mode in ("recompute", "swap"):
        llm = LLM(str(checkpoints("qwen3")), dtype="float32", block_size=4, num_kv_blocks=14,
                  preemption_mode=mode, num_cpu_blocks=64)
        outs = llm.beam_search(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0, mode
        assert ([[s.output_token_ids for s in o.sequences] for o in outs]
                == [[s.output_token_ids for s in o.sequences] for o in ref]), mode
        assert llm.engine.num_used_blocks() == 0


def _state(k, **kw):
    return BeamState(BeamSearchParams(beam_width=k, max_tokens=kw.pop("max_tokens", 10), **kw))


def test_select_keeps_the_best_extensions_across_beams():
    state = _state(2)
    beams = [(-1.0, 1, [5]), (-1.5, 1, [6])]
    cands = [[(7, -0.1), (8, -3.0)], [(9, -0.2), (10, -0.3)]]
    chosen = select(state, beams, cands, eos_ids={0})
    assert [(e.parent, e.token) for e in chosen] == [(0, 7), (1, 9)]
    assert chosen[0].cum_logprob == pytest.approx(-1.1)


def test_eos_among_the_best_becomes_a_finished_hypothesis_kept_aside():
    state = _state(2, length_penalty=1.0)
    chosen = select(state, [(-1.0, 1, [5])], [[(0, -0.1), (7, -0.5), (8, -0.6)]], eos_ids={0})
    assert [e.token for e in chosen] == [7, 8]
    [hyp] = state.finished
    assert hyp.token_ids == [5, 0] and hyp.score == pytest.approx(-1.1 / 2)
    assert not state.done


def test_eos_ranked_below_the_width_is_ignored_and_ignore_eos_makes_it_a_token():
    state = _state(1)
    chosen = select(state, [(0.0, 0, [])], [[(7, -0.1), (0, -0.2)]], eos_ids={0})
    assert [e.token for e in chosen] == [7] and state.finished == []
    state = _state(2, ignore_eos=True)
    chosen = select(state, [(0.0, 0, [])], [[(0, -0.1), (7, -0.2)]], eos_ids={0})
    assert [e.token for e in chosen] == [0, 7] and state.finished == []


def test_search_stops_early_when_finished_hypotheses_cannot_be_beaten():
    state = _state(1, length_penalty=0.0)
    select(state, [(0.0, 0, [])], [[(0, -0.1), (7, -2.0)]], eos_ids={0})
    assert state.done  # the finished -0.1 beats every live beam already at -2.0


def test_invalid_beam_params_raise_value_errors():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5)


def test_beam_search_on_a_cache_holding_one_beam_returns_the_roomy_beams_or_is_refused(
        checkpoints):
    # 4 blocks of 4 slots: a 7-token prompt and 2 beams of 9 tokens fit only one beam at a time
    # (15 slots each): the beams take turns and come out as on a roomy cache (they used to be
    # cut short with "length"). 30 tokens cannot fit even one beam: refused, naming max_tokens.
    path = str(checkpoints("llama"))
    prompt = prompts_of_lengths([7])[0]
    params = BeamSearchParams(beam_width=2, max_tokens=9, ignore_eos=True)
    roomy = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64)
    ref = roomy.beam_search([{"prompt_token_ids": prompt}], params)[0]
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=4, preemption_mode="recompute")
    engine = llm.engine
    with pytest.raises(ValueError, match="max_tokens.*needs 9 KV blocks alone.*has 4"):
        engine.add_beam_request("big", None, BeamSearchParams(beam_width=2, max_tokens=30,
                                                              ignore_eos=True),
                                prompt_token_ids=prompt)
    out = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
    assert [(s.output_token_ids, s.cum_logprob) for s in out.sequences] == \
        [(s.output_token_ids, s.cum_logprob) for s in ref.sequences]
    assert all(len(s.output_token_ids) == 9 for s in out.sequences)
    assert engine.scheduler.num_turns > 0 and engine.num_used_blocks() == 0
