"""POST /v1/responses and GET /v1/responses/{id} on the real server (the chain model, with
--reasoning-parser deepseek_r1 and --enable-responses-api-store) through the official openai
client: `responses.create` (text or message-list input, instructions, max_output_tokens,
function tools), `responses.create(stream=True)` (OpenAI's events in order, consecutive
sequence numbers, deltas adding up to the final items) and `responses.stream`; the store
(GET by id, previous_response_id, store=false); bad input as 400s naming the field. In process:
without the store flag `store` is ignored (as vLLM does) and GET is a 404."""

from __future__ import annotations

import json

import openai
import pytest

from app_utils import run_app

pytestmark = pytest.mark.timeout(300)

REASONING, CONTENT = "I think so", "Red car"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER}


def expected_usage(chain_checkpoint) -> tuple[int, int]:
    """(output tokens, reasoning tokens) the chain model's answer takes: its text and EOS, and the
    tokens before `</think>`. NOTE: counted with the checkpoint's own tokenizer, which the tests
    train (its merges, hence these counts, may differ from one machine to another)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chain_checkpoint)
    count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    return count(f"<think>{REASONING}</think>{CONTENT}") + 1, count(f"<think>{REASONING}")


def create(client, server, **kw):
    kw.setdefault("input", "hi")
    return client.responses.create(model=server.model, temperature=0, **kw)


def test_text_input_gets_a_reasoning_item_a_message_and_usage(reasoning_client, reasoning_server,
                                                              http_chain, chain_checkpoint):
    resp = create(reasoning_client, reasoning_server)
    assert resp.object == "response" and resp.status == "completed"
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and resp.output_text == CONTENT
    # usage: the same prompt as the chat request; the answer's tokens, those before </think>
    tokens = http_chain.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.usage.input_tokens == tokens.json()["count"]
    out, reasoning_tokens = expected_usage(chain_checkpoint)
    assert (resp.usage.output_tokens, resp.usage.output_tokens_details.reasoning_tokens) == (out, reasoning_tokens)
    assert resp.usage.total_tokens == resp.usage.input_tokens + out


def test_message_list_input_and_instructions_render_like_chat(reasoning_client,
                                                              reasoning_server, http_chain):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": [{"type": "input_text", "text": "again"}]}]
    resp = create(reasoning_client, reasoning_server, input=messages, instructions="Be brief.")
    assert resp.output_text == CONTENT and resp.instructions == "Be brief."
    chat = [{"role": "system", "content": "Be brief."}, *messages[:2],
            {"role": "user", "content": "again"}]
    tokens = http_chain.post("/tokenize", json={"messages": chat}).json()["count"]
    assert resp.usage.input_tokens == tokens


def test_max_output_tokens_cuts_the_response_short(reasoning_client, reasoning_server):
    resp = create(reasoning_client, reasoning_server, max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.max_output_tokens == 3
    (reasoning,) = resp.output  # still thinking: no message yet
    assert reasoning.type == "reasoning" and REASONING.startswith(reasoning.content[0].text)


def test_a_function_tool_is_called_after_the_reasoning(reasoning_client, reasoning_server):
    resp = create(reasoning_client, reasoning_server, tools=[TOOL], max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    reasoning, call = resp.output
    assert reasoning.content[0].text == REASONING
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id and resp.tools[0].name == "get_weather"
    # the call's result goes back as input items
    follow = create(reasoning_client, reasoning_server, tools=[TOOL], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tool_choice="none")
    assert follow.output_text == CONTENT


ORDER = ["response.created", "response.in_progress",
         "response.output_item.added", "response.content_part.added",
         "response.reasoning_text.delta", "response.reasoning_text.done",
         "response.content_part.done", "response.output_item.done",
         "response.output_item.added", "response.content_part.added",
         "response.output_text.delta", "response.output_text.done",
         "response.content_part.done", "response.output_item.done", "response.completed"]


def test_a_stream_sends_openais_events_in_order(reasoning_client, reasoning_server, chain_checkpoint):
    events = list(create(reasoning_client, reasoning_server, stream=True))
    # (a busy server may send several tokens in one delta: runs of deltas count once)
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]
            or not k.endswith(".delta")] == ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "completed" and final.output_text == CONTENT
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == (REASONING, CONTENT)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]
    assert final.usage.output_tokens == expected_usage(chain_checkpoint)[0]
    cut = list(create(reasoning_client, reasoning_server, stream=True, max_output_tokens=3))
    assert cut[-1].type == "response.completed"  # as vLLM, also when incomplete
    assert cut[-1].response.status == "incomplete" and cut[-1].response.usage.output_tokens == 3


def test_the_stream_helper_and_streamed_tool_calls(reasoning_client, reasoning_server):
    with reasoning_client.responses.stream(model=reasoning_server.model, input="hi",
                                           temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == CONTENT
    events = list(create(reasoning_client, reasoning_server, stream=True, tools=[TOOL],
                         tool_choice={"type": "function", "name": "get_weather"},
                         max_output_tokens=60))
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    (call,) = [i for i in events[-1].response.output if i.type == "function_call"]
    assert args == call.arguments and json.loads(args)["city"] in ("Paris", "Rome")


def test_stored_responses_can_be_read_back_and_continued(reasoning_client, reasoning_server):
    first = create(reasoning_client, reasoning_server)  # store: true is OpenAI's default
    assert first.store is True
    again = reasoning_client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == CONTENT
    follow = create(reasoning_client, reasoning_server, input="more",
                    previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    # the previous turn (hi -> Red car) is in the prompt: more tokens than "more" alone
    alone = create(reasoning_client, reasoning_server, input="more")
    assert follow.usage.input_tokens > alone.usage.input_tokens
    unstored = create(reasoning_client, reasoning_server, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        reasoning_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        create(reasoning_client, reasoning_server, previous_response_id="resp_nope")


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "model": "nope"}, "model"),
    ({"input": "hi", "n": 2}, "n"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(http_chain, body, param):
    r = http_chain.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    assert http_chain.get("/health").status_code == 200


def test_without_the_store_flag_store_is_ignored(chain_checkpoint):
    from pagedserve import LLMEngine
    from pagedserve.config import EngineArgs

    llm = LLMEngine(EngineArgs(model=str(chain_checkpoint), dtype="float32", num_kv_blocks=64,
                               max_model_len=128))

    async def main(client):
        r = await client.post("/v1/responses", json={"input": "hi", "temperature": 0})
        body = r.json()
        got = await client.get(f"/v1/responses/{body['id']}")
        return body, got

    body, got = run_app(llm, main)
    assert body["store"] is False  # as vLLM without VLLM_ENABLE_RESPONSES_API_STORE
    assert got.status_code == 404
    # no reasoning parser: the whole text is the message
    assert [i["type"] for i in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == "<think>I think so</think>Red car"
    assert llm.num_used_blocks() == 0


def test_auto_tool_calls_are_parsed_from_the_text_after_the_reasoning():
    # The chain model cannot write a hermes call (its tokens repeat): the builder is fed one.
    from types import SimpleNamespace

    from pagedserve.entrypoints.openai.reasoning import ReasoningPlan
    from pagedserve.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses, chat_tools
    from pagedserve.entrypoints.openai.tool_calls import plan_tools
    from pagedserve.entrypoints.openai.tool_parsers import make_tool_parser
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.reasoning import reasoning_parser_class

    tools, choice = chat_tools([TOOL], "auto")
    plan = plan_tools(tools, choice, make_tool_parser("hermes"))
    text = ('<think>use the tool</think>Let me look.<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}</tool_call>')
    out = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(
        0, text, [9] * 5 + [8] + [4] * 7, None, None, "stop")], True)
    serving = OpenAIServingResponses(SimpleNamespace(model_name="m"))
    body = serving._build(ResponsesRequest(input="hi", tools=[TOOL]), "resp_x", out, plan,
                          ReasoningPlan(reasoning_parser_class("deepseek_r1")(7, 8)))
    reasoning, message, call = body.output
    assert reasoning.content[0].text == "use the tool"
    assert message.content[0].text == "Let me look."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    assert body.usage.output_tokens_details.reasoning_tokens == 5
    assert (body.usage.input_tokens, body.usage.output_tokens) == (3, 13)


def test_text_format_json_schema_constrains_the_message_after_the_reasoning(reasoning_client,
                                                                            reasoning_server):
    resp = create(reasoning_client, reasoning_server, max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    reasoning, message = resp.output
    assert reasoning.content[0].text == REASONING
    assert json.loads(resp.output_text)["city"] in ("Paris", "Rome")
    assert resp.text.format.type == "json_schema"
