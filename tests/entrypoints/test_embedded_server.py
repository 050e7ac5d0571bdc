"""Smoke test: `pagedserve serve gemma-3-270m` serves the embedded Gemma 3 270M (~15 s to load)."""

import pytest

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_serve_gemma_answers_like_the_offline_engine_and_chats_in_gemma_turns(
        logs, embedded_llm):
    import openai

    from pagedserve import SamplingParams

    prompt = "The capital of France is"
    ref = embedded_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                                use_tqdm=False)[0]
    server = ServerProcess.start("gemma-3-270m", "--max-model-len", "512", "--dtype", "float32",
                                 "--disable-access-log", log_dir=logs, timeout=240)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        assert model == "gemma-3-270m"
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                         temperature=0)
        assert resp.choices[0].text == ref.outputs[0].text != ""
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
            temperature=0)
        # The default Gemma turn format: the answer is text, not a new turn marker.
        text = chat.choices[0].message.content
        assert text and "<start_of_turn>" not in text and "<end_of_turn>" not in text
    finally:
        code = server.stop()
    assert code == 0, server.log_text()[-3000:]
