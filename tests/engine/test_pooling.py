"""The pooling runner offline (`LLM(runner="pooling")`): embeddings against HF `AutoModel` hidden
states, the sentence-transformers pooler, chunked prefill, the prefix cache, batching and
a small cache leaving embeddings bit-identical, no block or partial state outliving a request, and
bad input."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import tiny
from pagedserve import LLM, PoolingParams, SamplingParams
from test_llm_engine import prompts_of_lengths

ATOL = 1e-5


def pooling_llm(path, **kw):
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_model_len", 256)
    return LLM(str(path), dtype="float32", runner="pooling", **kw)


def hf_hidden(path, ids):
    """HF AutoModel's last hidden state (after the final norm), [T, H] float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def with_st_files(src, dst, mode: str, normalize: bool):
    """A copy of checkpoint `src` with sentence-transformers files: Pooling(`mode`) [+ Normalize]."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
           "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
           "pooling_mode_lasttoken": mode == "last"}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return dst


def run_all(llm):
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "opt", "gpt2"])
def test_default_embedding_is_the_normalized_last_hidden_state_of_hf(checkpoints, arch):
    path = checkpoints(arch)
    prompts = prompts_of_lengths([9, 23])
    outs = pooling_llm(path).embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = F.normalize(hf_hidden(path, p)[-1], dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        assert (got - ref).abs().max() <= ATOL
        assert out.prompt_token_ids == p and out.finished


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("last", False)])
def test_sentence_transformers_files_choose_the_pooling(checkpoints, tmp_path, mode, normalize):
    path = with_st_files(checkpoints("llama"), tmp_path / "st", mode, normalize)
    llm = pooling_llm(path)
    assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == (
        mode.upper(), normalize)
    prompt = prompts_of_lengths([17])[0]
    [out] = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    hidden = hf_hidden(path, prompt)
    ref = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[mode]
    if normalize:
        ref = F.normalize(ref, dim=-1)
    assert (torch.tensor(out.outputs.embedding) - ref).abs().max() <= ATOL


def test_an_unsupported_sentence_transformers_module_is_refused(checkpoints, tmp_path):
    path = with_st_files(checkpoints("llama"), tmp_path / "st", "mean", True)
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        pooling_llm(path)


def test_pooler_config_option_overrides_the_model_files(checkpoints, tmp_path):
    path = with_st_files(checkpoints("llama"), tmp_path / "st", "mean", True)
    llm = pooling_llm(path, pooler_config='{"pooling_type": "LAST", "normalize": false}')
    prompt = prompts_of_lengths([11])[0]
    [out] = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    assert (torch.tensor(out.outputs.embedding) - hf_hidden(path, prompt)[-1]).abs().max() <= ATOL
    with pytest.raises(ValueError, match="pooling_type"):
        pooling_llm(path, pooler_config='{"pooling_type": "MAX"}')


def test_token_embed_returns_every_prompt_position(checkpoints):
    path = checkpoints("qwen3")
    prompt = prompts_of_lengths([13])[0]
    [out] = pooling_llm(path).encode({"prompt_token_ids": prompt}, pooling_task="token_embed",
                                     use_tqdm=False)
    ref = F.normalize(hf_hidden(path, prompt), dim=-1)
    assert out.outputs.data.shape == ref.shape
    assert (out.outputs.data - ref).abs().max() <= ATOL


@pytest.mark.parametrize("mode", ["last", "mean", "cls", "token_embed"])
def test_chunked_prefill_and_batching_leave_embeddings_bit_identical(
        checkpoints, tmp_path, mode):
    st = "last" if mode == "token_embed" else mode
    path = with_st_files(checkpoints("llama"), tmp_path / "st", st, True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([21, 5, 26], seed=3)]

    def run(llm, ps):
        if mode == "token_embed":
            return [o.outputs.data for o in llm.encode(ps, pooling_task="token_embed",
                                                       use_tqdm=False)]
        return [torch.tensor(o.outputs.embedding) for o in llm.embed(ps, use_tqdm=False)]

    # One prompt at a time, whole, on a roomy cache without prefix caching: the reference.
    roomy = pooling_llm(path, enable_chunked_prefill=False, max_num_batched_tokens=256,
                        enable_prefix_caching=False)
    ref = [run(roomy, [p])[0] for p in prompts]
    # Steps of 8 tokens, 4-token blocks, a cache of 20 blocks: every prompt but one is split
    # over steps, and the end of one shares a step with the start of the next.
    tight = pooling_llm(path, max_num_batched_tokens=8, block_size=4, num_kv_blocks=20)
    got = run(tight, prompts)
    assert tight.engine.stats["steps"] >= sum(len(p["prompt_token_ids"]) for p in prompts) // 8
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert tight.engine.num_used_blocks() == 0
    assert tight.engine.executor.worker.runner.pooler.num_partial == 0


def test_prefix_cache_serves_last_token_pooling_and_is_skipped_for_mean(checkpoints, tmp_path):
    prefix = prompts_of_lengths([32], seed=5)[0]
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    for mode, cached in (("last", True), ("mean", False)):
        path = with_st_files(checkpoints("llama"), tmp_path / mode, mode, True)
        llm = pooling_llm(path, block_size=4)
        cold = pooling_llm(path, block_size=4, enable_prefix_caching=False)
        first = llm.encode({"prompt_token_ids": prompts[0]}, pooling_task="embed", use_tqdm=False)
        [second] = llm.encode({"prompt_token_ids": prompts[1]}, pooling_task="embed",
                              use_tqdm=False)
        assert (second.num_cached_tokens > 0) == cached
        [ref] = cold.encode({"prompt_token_ids": prompts[1]}, pooling_task="embed",
                            use_tqdm=False)
        assert torch.equal(second.outputs.data, ref.outputs.data)
        assert first[0].finished and llm.engine.num_used_blocks() == 0


def test_an_aborted_pooling_request_frees_its_blocks_and_partial_state(checkpoints, tmp_path):
    path = with_st_files(checkpoints("llama"), tmp_path / "st", "mean", True)
    llm = pooling_llm(path, max_num_batched_tokens=8, block_size=4)
    engine = llm.engine
    engine.add_request("a", None, PoolingParams(), prompt_token_ids=prompts_of_lengths([40])[0])
    engine.step()
    engine.step()
    pooler = engine.executor.worker.runner.pooler
    assert pooler.num_partial == 1 and engine.num_used_blocks() > 0
    assert engine.abort_request("a")
    engine.step()  # the runner hears of the finished request with the next step
    assert engine.num_used_blocks() == 0 and pooler.num_partial == 0
    [out] = llm.embed("hello there", use_tqdm=False)  # the engine keeps serving
    assert out.finished and pooler.num_partial == 0


def test_score_is_the_cosine_of_the_embeddings(checkpoints):
    llm = pooling_llm(checkpoints("llama"))
    texts = ["the cat sat", "a dog ran far away", "the cat sat on the mat"]
    embs = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    one_to_many = llm.score(texts[0], texts, use_tqdm=False)
    pairs = llm.score(texts, texts[::-1], use_tqdm=False)
    for out, e in zip(one_to_many, embs):
        assert out.outputs.score == pytest.approx(float(F.cosine_similarity(embs[0], e, dim=0)),
                                                  abs=1e-6)
    assert pairs[1].outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="data_1"):
        llm.score(texts[:2], texts, use_tqdm=False)


def test_dimensions_need_a_matryoshka_model(checkpoints, tmp_path):
    path = checkpoints("llama")
    llm = pooling_llm(path)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    mrl = tmp_path / "mrl"
    shutil.copytree(path, mrl)
    cfg = json.loads((mrl / "config.json").read_text())
    (mrl / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    llm = pooling_llm(mrl)
    prompt = prompts_of_lengths([9])[0]
    [out] = llm.embed({"prompt_token_ids": prompt}, pooling_params=PoolingParams(dimensions=16),
                      use_tqdm=False)
    ref = F.normalize(hf_hidden(path, prompt)[-1][:16], dim=-1)
    assert (torch.tensor(out.outputs.embedding) - ref).abs().max() <= ATOL
    with pytest.raises(ValueError, match=r"only supports \[16, 32\]"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


def test_bad_input_raises_value_errors_and_leaves_the_engine_serving(checkpoints):
    path = checkpoints("llama")
    llm = pooling_llm(path, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": [5] * 65}, use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'.*--runner generate"):
        llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task required"):
        llm.encode("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        llm.classify("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    assert llm.engine.num_used_blocks() == 0 and not llm.engine.has_unfinished_requests()
    [out] = llm.embed({"prompt_token_ids": [5] * 64}, use_tqdm=False)  # exactly max_model_len
    assert out.finished
    small = pooling_llm(path, max_model_len=64, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="needs 3 KV blocks; the cache has 2"):
        small.embed({"prompt_token_ids": [5] * 40}, use_tqdm=False)
    generate = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match="runner='generate'.*--runner pooling"):
        generate.embed("hello", use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt", "gpt2"])
def test_classify_equals_hf_sequence_classification(tmp_path, arch):
    from transformers import AutoModelForSequenceClassification

    path = tiny.make_classifier_checkpoint(tmp_path / arch, arch, num_labels=3)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128)
    assert llm.engine.runner == "pooling"  # auto: the checkpoint has no LM head
    prompts = prompts_of_lengths([7, 19], seed=4)
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].softmax(-1)
        assert out.outputs.num_classes == 3
        assert (torch.tensor(out.outputs.probs) - ref).abs().max() <= ATOL
    assert llm.engine.num_used_blocks() == 0


def test_a_one_label_classifier_scores_the_pair_encoded_together(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = tiny.make_classifier_checkpoint(tmp_path / "ce", "llama", num_labels=1)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128)
    outs = llm.score("the cat", ["sat on the mat", "a dog"], use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = tiny.tokenizer()
    for doc, out in zip(["sat on the mat", "a dog"], outs):
        with torch.no_grad():
            ref = hf(torch.tensor([tok("the cat", text_pair=doc).input_ids])).logits[0, 0]
        assert out.outputs.score == pytest.approx(float(ref.sigmoid()), abs=ATOL)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt2"])
def test_a_bare_base_model_checkpoint_is_served_by_the_pooling_runner(checkpoints, tmp_path,
                                                                       arch):
    from transformers import AutoModel

    base = AutoModel.from_pretrained(checkpoints(arch), dtype=torch.float32)
    base.save_pretrained(tmp_path / "bare")  # e.g. Qwen3Model: no lm_head, no "model." prefix
    tiny.tokenizer().save_pretrained(tmp_path / "bare")
    llm = LLM(str(tmp_path / "bare"), dtype="float32", num_kv_blocks=64, max_model_len=128)
    assert llm.engine.runner == "pooling"  # auto
    prompt = prompts_of_lengths([12])[0]
    [out] = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    ref = F.normalize(hf_hidden(checkpoints(arch), prompt)[-1], dim=-1)
    assert (torch.tensor(out.outputs.embedding) - ref).abs().max() <= ATOL
