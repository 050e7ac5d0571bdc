"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the real
`anthropic` client on the shared test servers: the same greedy text as /v1/chat/completions for
the same conversation, streaming events that add up to it, stop sequences, max_tokens, tools
(forced and required: tool_use blocks), tool_result turns, token counts, Anthropic's error shape,
and with --reasoning-parser the reasoning as a thinking block."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

SYSTEM = "You are terse."
USER = "Name a colour."
# (the SDK no longer names temperature / top_p / top_k; the server still reads them)
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def create(claude, server, **kw):
    kw.setdefault("messages", [{"role": "user", "content": USER}])
    kw.setdefault("max_tokens", 12)
    return claude.messages.create(model=server.model, system=SYSTEM, extra_body=GREEDY, **kw)


def chat_text(client, server, max_tokens=12, **kw):
    resp = client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        **kw)
    return resp.choices[0]


def test_a_message_answers_as_the_chat_completion_of_the_same_conversation(claude, client,
                                                                          server):
    msg = create(claude, server)
    want = chat_text(client, server)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == server.model
    assert msg.id.startswith("msg_")
    [block] = msg.content
    assert block.type == "text" and block.text == want.message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason]
    assert msg.usage.output_tokens == 12 or msg.stop_reason == "end_turn"
    count = claude.messages.count_tokens(model=server.model, system=SYSTEM,
                                         messages=[{"role": "user", "content": USER}])
    assert count.input_tokens == msg.usage.input_tokens > 0


def test_the_stream_adds_up_to_the_whole_message(claude, server):
    whole = create(claude, server)
    with claude.messages.stream(model=server.model, system=SYSTEM, extra_body=GREEDY,
                                max_tokens=12,
                                messages=[{"role": "user", "content": USER}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_cuts_the_text_and_is_named(claude, server):
    text = create(claude, server, max_tokens=16).content[0].text
    words = [w for w in text.split() if len(w) > 2]
    if not words:
        pytest.skip(f"the random model wrote no word to stop at: {text!r}")
    stop = words[len(words) // 2]
    msg = create(claude, server, max_tokens=16, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_or_required_tool_answers_with_a_tool_use_block(claude, server, choice):
    msg = create(claude, server, max_tokens=120, tools=[WEATHER], tool_choice=choice)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses, msg.content
    assert all(u.name == "get_weather" and u.input["city"] in ("Paris", "Rome") for u in uses)
    assert all(u.id.startswith("toolu_") for u in uses)
    assert msg.stop_reason == "tool_use"
    with claude.messages.stream(model=server.model, system=SYSTEM, extra_body=GREEDY,
                                max_tokens=120, tools=[WEATHER], tool_choice=choice,
                                messages=[{"role": "user", "content": USER}]) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"


def test_a_tool_result_turn_is_rendered_into_the_prompt(claude, server):
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]}]
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "sunny and twenty five degrees"}]},
        {"type": "text", "text": "And so?"}]}
    short = claude.messages.count_tokens(model=server.model, tools=[WEATHER],
                                         messages=[*turn, {"role": "user", "content": "So?"}])
    long = claude.messages.count_tokens(model=server.model, tools=[WEATHER],
                                        messages=[*turn, result])
    assert long.input_tokens > short.input_tokens
    msg = claude.messages.create(model=server.model, max_tokens=4, tools=[WEATHER],
                                 tool_choice={"type": "none"}, messages=[*turn, result])
    assert msg.usage.input_tokens == long.input_tokens


def test_errors_are_anthropics(claude, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(claude, server, max_tokens=0)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        create(claude, server, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error"
    # a body without max_tokens (required) is Anthropic's 400 too
    r = httpx.post(server.url + "/v1/messages", json={"model": server.model, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_reasoning_comes_back_as_a_thinking_block(reasoning_server):
    claude = anthropic.Anthropic(base_url=reasoning_server.url, api_key="unused",
                                 max_retries=0, timeout=60)
    kw = dict(model=reasoning_server.model, max_tokens=30,
              messages=[{"role": "user", "content": "Which car?"}])
    msg = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in msg.content] == [("thinking", "I think so"), ("text", "Red car")]
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
    thought = "".join(e.delta.thinking for e in events
                      if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert (thought, text) == ("I think so", "Red car")
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert json.loads(stream.get_final_message().model_dump_json())["stop_reason"] == "end_turn"
