"""The pooling routes over HTTP (the app in process): /v1/embeddings through the official `openai`
client (float and base64), /pooling, /score, /rerank; equal to the offline `LLM.embed` on the same
engine; bad input and the wrong runner answer 400; the KV pool is empty afterwards."""

import asyncio

import httpx
import pytest
import torch

from app_utils import run_app
from pagedserve import LLM, PoolingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def pooling_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", runner="pooling", num_kv_blocks=64,
               max_model_len=MAX_MODEL_LEN)


def serve(llm, main):
    return run_app(llm.engine, main, served_model_name=["emb"])


def openai_client(http: httpx.AsyncClient):
    import openai

    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                              http_client=http)


def embeddings_of(llm, inputs):
    return [o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)]


def test_openai_client_embeddings_equal_offline_embed(pooling_llm):
    texts = ["the cat sat on the mat", "hello"]
    ref = embeddings_of(pooling_llm, texts)
    ids = pooling_llm.get_tokenizer()(texts[0]).input_ids

    async def main(http):
        client = openai_client(http)
        as_floats = await client.embeddings.create(model="emb", input=texts,
                                                   encoding_format="float")
        as_base64 = await client.embeddings.create(model="emb", input=texts)  # base64 on the wire
        by_ids = await client.embeddings.create(model="emb", input=[ids, ids[:3]])
        one = await client.embeddings.create(model="emb", input=ids)
        return as_floats, as_base64, by_ids, one

    as_floats, as_base64, by_ids, one = serve(pooling_llm, main)
    assert [d.embedding for d in as_floats.data] == ref
    assert [d.embedding for d in as_base64.data] == ref  # float32 bytes decode exactly
    assert by_ids.data[0].embedding == ref[0] and one.data[0].embedding == ref[0]
    assert by_ids.data[1].embedding == embeddings_of(pooling_llm, {"prompt_token_ids": ids[:3]})[0]
    n = sum(len(pooling_llm.get_tokenizer()(t).input_ids) for t in texts)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == n
    assert [d.index for d in as_floats.data] == [0, 1] and as_floats.model == "emb"
    assert pooling_llm.engine.num_used_blocks() == 0


def test_pooling_score_and_rerank_routes(pooling_llm):
    docs = ["a dog ran far away", "the cat sat on the mat", "cats sit"]
    query = "the cat sat"
    [q, *ds] = [torch.tensor(e) for e in embeddings_of(pooling_llm, [query, *docs])]
    cos = [float(torch.nn.functional.cosine_similarity(q, d, dim=0)) for d in ds]

    async def main(http):
        pooled = await http.post("/pooling", json={"input": [query]})
        tokens = await http.post("/pooling", json={"input": query, "task": "token_embed"})
        scores = [await http.post(path, json={"text_1": query, "text_2": docs})
                  for path in ("/score", "/v1/score")]
        pairs = await http.post("/v1/score", json={"queries": docs, "documents": docs[::-1]})
        reranks = [await http.post(path, json={"query": query, "documents": docs, "top_n": 2})
                   for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
        return pooled, tokens, scores, pairs, reranks

    pooled, tokens, scores, pairs, reranks = serve(pooling_llm, main)
    assert pooled.status_code == 200, pooled.text
    body = pooled.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert body["data"][0]["data"] == q.tolist()
    ntok = len(pooling_llm.get_tokenizer()(query).input_ids)
    assert torch.tensor(tokens.json()["data"][0]["data"]).shape == (ntok, q.shape[0])
    for r in scores:
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        assert got == pytest.approx(cos, abs=1e-6)
        assert r.json()["data"][0]["object"] == "score"
    assert pairs.json()["data"][1]["score"] == pytest.approx(1.0, abs=1e-6)
    # The one query is embedded once: usage counts it once (as vLLM).
    doc_tokens = sum(len(pooling_llm.get_tokenizer()(d).input_ids) for d in docs)
    assert scores[0].json()["usage"]["prompt_tokens"] == ntok + doc_tokens
    order = sorted(range(3), key=lambda i: cos[i], reverse=True)[:2]
    for r in reranks:
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert results[0]["document"]["text"] == docs[order[0]]
        assert results[0]["relevance_score"] == pytest.approx(cos[order[0]], abs=1e-6)
        assert r.json()["usage"]["total_tokens"] > 0
    assert pooling_llm.engine.num_used_blocks() == 0


def test_bad_pooling_input_answers_400_naming_the_problem(pooling_llm):
    async def main(http):
        client = openai_client(http)
        import openai

        errors = {}
        for name, kwargs in {
            "empty string": {"input": ""},
            "empty list": {"input": []},
            "too long": {"input": [[5] * (MAX_MODEL_LEN + 1)]},
            "dimensions": {"input": "hi", "dimensions": 16},
        }.items():
            try:
                await client.embeddings.create(model="emb", **kwargs)
            except openai.BadRequestError as e:
                errors[name] = e
        completion = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        chat = await http.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]})
        pooling_dims = await http.post("/pooling", json={"input": "hi", "dimensions": 4})
        wrong_model = await http.post("/v1/embeddings", json={"model": "x", "input": "hi"})
        ok = await client.embeddings.create(model="emb", input="still serving")
        return errors, completion, chat, pooling_dims, wrong_model, ok

    errors, completion, chat, pooling_dims, wrong_model, ok = serve(pooling_llm, main)
    assert set(errors) == {"empty string", "empty list", "too long", "dimensions"}
    assert "must not be empty" in errors["empty string"].message
    assert "maximum context length" in errors["too long"].message
    assert "matryoshka" in errors["dimensions"].message
    for r in (completion, chat):
        assert r.status_code == 400, r.text
        assert "--runner generate" in r.json()["error"]["message"]
    assert pooling_dims.status_code == 400 and wrong_model.status_code == 404
    assert len(ok.data[0].embedding) == 64
    assert pooling_llm.engine.num_used_blocks() == 0


def test_pooling_routes_on_a_generate_server_answer_400_naming_the_runner(small_engine):
    async def main(http):
        return [await http.post(path, json=body) for path, body in (
            ("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "hi"}))]

    for r in run_app(small_engine, main):
        assert r.status_code == 400, r.text
        assert "--runner pooling" in r.json()["error"]["message"]


def test_concurrent_embedding_requests_batch_and_equal_one_at_a_time(pooling_llm):
    texts = [f"sentence number {i} about cats" * (1 + i % 3) for i in range(8)]
    ref = embeddings_of(pooling_llm, texts)

    async def main(http):
        client = openai_client(http)
        outs = await asyncio.gather(*(client.embeddings.create(model="emb", input=t,
                                                                encoding_format="float")
                                      for t in texts))
        return [o.data[0].embedding for o in outs]

    assert serve(pooling_llm, main) == ref
    assert pooling_llm.engine.num_used_blocks() == 0
    assert PoolingParams().task is None


def test_serve_runner_pooling_over_real_http(tiny_llama, logs, pooling_llm):
    import openai

    from server_utils import ServerProcess

    proc = ServerProcess.start(str(tiny_llama), "--runner", "pooling", "--dtype", "float32",
                               "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
                               "--served-model-name", "emb", "--disable-access-log",
                               log_dir=logs)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        out = client.embeddings.create(model="emb", input=["hello", "the cat sat"])
        with pytest.raises(openai.BadRequestError, match="--runner generate"):
            client.completions.create(model="emb", prompt="hi", max_tokens=2)
    finally:
        assert proc.stop() == 0, proc.log_text()[-3000:]
    assert [d.embedding for d in out.data] == embeddings_of(pooling_llm, ["hello", "the cat sat"])
    assert "pooling runner: pooling_type=LAST normalize=True" in proc.log_text()


def test_classify_and_cross_encoder_score_routes(tmp_path):
    import tiny

    classifier = LLM(str(tiny.make_classifier_checkpoint(tmp_path / "cls", "llama", 3)),
                     dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    ref = [o.outputs.probs for o in classifier.classify(["hello", "the cat"], use_tqdm=False)]
    reranker = LLM(str(tiny.make_classifier_checkpoint(tmp_path / "ce", "llama", 1)),
                   dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    docs = ["sat on the mat", "a dog"]
    scores = [o.outputs.score for o in reranker.score("the cat", docs, use_tqdm=False)]

    async def classify(http):
        return (await http.post("/classify", json={"input": ["hello", "the cat"]}),
                await http.post("/score", json={"text_1": "a", "text_2": "b"}),
                await http.post("/pooling", json={"input": "hello"}))  # default task: classify

    async def rerank(http):
        return (await http.post("/v1/score", json={"text_1": "the cat", "text_2": docs}),
                await http.post("/rerank", json={"query": "the cat", "documents": docs}))

    classified, refused, pooled = run_app(classifier.engine, classify)
    assert pooled.json()["data"][0]["data"] == ref[0]
    assert classified.status_code == 200, classified.text
    data = classified.json()["data"]
    assert [d["probs"] for d in data] == ref
    assert data[0]["num_classes"] == 3 and data[0]["label"].startswith("LABEL_")
    assert refused.status_code == 400 and "one label" in refused.json()["error"]["message"]
    scored, reranked = run_app(reranker.engine, rerank)
    assert [d["score"] for d in scored.json()["data"]] == scores
    best = max(range(2), key=scores.__getitem__)
    assert reranked.json()["results"][0]["index"] == best
    assert reranker.engine.num_used_blocks() == classifier.engine.num_used_blocks() == 0


def test_chat_embeddings_render_the_conversation_without_a_generation_prompt(pooling_llm):
    from pagedserve.engine.chat_template import default_chat_format, render_chat

    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    tok = pooling_llm.get_tokenizer()
    text = render_chat(tok, messages, default_chat_format(tok), add_generation_prompt=False)
    ids = tok(text, add_special_tokens=False).input_ids
    ref = embeddings_of(pooling_llm, {"prompt_token_ids": ids})[0]

    async def main(http):
        return (await http.post("/v1/embeddings", json={"messages": messages}),
                await http.post("/pooling", json={"messages": messages}),
                await http.post("/v1/embeddings", json={"messages": messages, "input": "x"}))

    emb, pooled, both = serve(pooling_llm, main)
    assert emb.status_code == 200, emb.text
    assert emb.json()["data"][0]["embedding"] == ref == pooled.json()["data"][0]["data"]
    assert emb.json()["usage"]["prompt_tokens"] == len(ids)
    assert both.status_code == 400 and "either input or messages" in both.json()["error"]["message"]
