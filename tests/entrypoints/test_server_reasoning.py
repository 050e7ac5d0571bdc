"""--reasoning-parser on the real server (deepseek_r1), through the openai client, on a model
that writes ``<think>I think so</think>Red car`` (tests/chain_model.py): the message carries the
reasoning in `reasoning` and `reasoning_content` and the rest in `content`; stream deltas carry
them apart and add up to the same; structured outputs and tool calls apply to the text after the
reasoning; include_reasoning=false drops it. In process: qwen3 with enable_thinking=false, and no
parser (the text stays in content, as before)."""

from __future__ import annotations

import json

import pytest

from app_utils import run_app
from conftest import CHAIN_TEXT

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "hi"}]
REASONING, CONTENT = "I think so", "Red car"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def chat(client, server, max_tokens=40, **kw):
    return client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                          max_tokens=max_tokens, **kw)


def test_the_message_carries_the_reasoning_apart_from_the_content(reasoning_client,
                                                                   reasoning_server):
    resp = chat(reasoning_client, reasoning_server)
    msg = resp.choices[0].message
    assert (msg.content, msg.reasoning, msg.reasoning_content) == (CONTENT, REASONING, REASONING)
    assert resp.choices[0].finish_reason == "stop"


def test_stream_deltas_carry_the_reasoning_apart_and_add_up(reasoning_client, reasoning_server):
    deltas = [c.choices[0].delta for c in chat(reasoning_client, reasoning_server, stream=True)
              if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    legacy = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, legacy, content) == (REASONING, REASONING, CONTENT)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning", None) for d in deltas[first_content + 1:])


def test_structured_outputs_apply_to_the_content_after_the_reasoning(reasoning_client,
                                                                      reasoning_server):
    for kw in ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
               {"response_format": {"type": "json_schema", "json_schema": {
                   "name": "w", "schema": WEATHER}}}):
        msg = chat(reasoning_client, reasoning_server, **kw).choices[0].message
        assert msg.reasoning == REASONING, kw  # the reasoning was not constrained
        if "extra_body" in kw:
            assert msg.content in ("yes", "no")
        else:
            assert json.loads(msg.content)["city"] in ("Paris", "Rome")


def test_tool_calls_are_read_from_the_text_after_the_reasoning(reasoning_client,
                                                                reasoning_server):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        resp = chat(reasoning_client, reasoning_server, tools=TOOLS, tool_choice=choice,
                    parallel_tool_calls=False, max_tokens=80)
        msg = resp.choices[0].message
        assert msg.reasoning == REASONING and not msg.content
        (call,) = msg.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    streamed = chat(reasoning_client, reasoning_server, tools=TOOLS, stream=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == REASONING
    args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert json.loads(args)["city"] in ("Paris", "Rome")


def test_include_reasoning_false_leaves_the_reasoning_out(reasoning_client, reasoning_server):
    msg = chat(reasoning_client, reasoning_server,
               extra_body={"include_reasoning": False}).choices[0].message
    assert msg.content == CONTENT and getattr(msg, "reasoning", None) is None
    deltas = [c.choices[0].delta for c in chat(reasoning_client, reasoning_server, stream=True,
                                                extra_body={"include_reasoning": False})
              if c.choices]
    assert "".join(d.content or "" for d in deltas) == CONTENT
    assert not any(getattr(d, "reasoning", None) for d in deltas)


def _engine(path, parser):
    from pagedserve import LLMEngine
    from pagedserve.config import EngineArgs

    return LLMEngine(EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64,
                                max_model_len=128, reasoning_parser=parser))


def test_qwen3_with_thinking_off_and_no_parser_leave_the_text_in_content(chain_checkpoint):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40}

    async def ask(client, **extra):
        r = await client.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    async def qwen3(client):
        on = await ask(client)
        off = await ask(client, chat_template_kwargs={"enable_thinking": False})
        return on, off

    on, off = run_app(_engine(chain_checkpoint, "qwen3"), qwen3)
    assert (on["reasoning"], on["content"]) == (REASONING, CONTENT)
    assert off["content"] == CHAIN_TEXT and "reasoning" not in off

    plain = run_app(_engine(chain_checkpoint, None), ask)
    assert plain["content"] == CHAIN_TEXT and "reasoning" not in plain


# Qwen3's way to switch thinking off: its template writes an empty think block into the prompt.
QWEN3_LIKE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n"
              "{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
              "<think>\n\n</think>\n\n{% endif %}Assistant:")


def test_a_template_that_closes_the_think_block_makes_everything_content(reasoning_client,
                                                                         reasoning_server):
    off = {"chat_template": QWEN3_LIKE, "chat_template_kwargs": {"enable_thinking": False}}
    msg = chat(reasoning_client, reasoning_server, extra_body=off).choices[0].message
    assert msg.content == CHAIN_TEXT and getattr(msg, "reasoning", None) is None
    # ... and the grammar starts at once: no thinking is left unconstrained
    constrained = chat(reasoning_client, reasoning_server, extra_body={
        **off, "structured_outputs": {"choice": ["yes", "no"]}}).choices[0].message
    assert constrained.content in ("yes", "no")
    on = chat(reasoning_client, reasoning_server, extra_body={
        "chat_template": QWEN3_LIKE, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.choices[0].message.reasoning == REASONING
