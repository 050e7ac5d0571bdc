"""The bad-input corpus: requests every POST endpoint must answer with a 4xx in OpenAI's error
shape naming the problem (used by test_bad_input.py and scripts/bad_input.py).

Each case is (name, path, body, status, mentions): `body` is raw bytes or a JSON-able object;
`status` the expected status; `mentions` a word the error message must contain (lower case).
The limits they probe are the shared test server's (server_utils.SERVER_FLAGS): max_model_len
512, a vocabulary of 512 tokens, --max-logprobs 20, --max-n 16, --max-request-bytes 8 MiB,
and the fixed stop-string bounds (16 strings, 1,000 characters each).
"""

from __future__ import annotations

import json

C, H, T, D = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
R = "/v1/responses"
OK = {"prompt": "The module", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"messages": MSG, "max_tokens": 2}


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


CASES: list[tuple[str, str, object, int, str]] = [
    # --- not JSON, or not the JSON we take --------------------------------------------------
    ("malformed json (completions)", C, b'{"prompt": "x",', 400, "json"),
    ("malformed json (chat)", H, b'{"messages": [', 400, "json"),
    ("malformed json (tokenize)", T, b"{prompt: x}", 400, "json"),
    ("malformed json (detokenize)", D, b'{"tokens": [1,}', 400, "json"),
    ("empty body", C, b"", 400, "json"),
    ("body is a list", C, b"[1, 2]", 400, "object"),
    ("body is a string", H, b'"hello"', 400, "object"),
    ("invalid utf-8 (completions)", C, b'{"prompt": "\xff\xfe\xfa"}', 400, "json"),
    ("invalid utf-8 (chat)", H, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
     400, "json"),
    ("NaN temperature", C, b'{"prompt": "x", "temperature": NaN}', 400, "nan"),
    ("Infinity top_p", C, b'{"prompt": "x", "top_p": Infinity}', 400, "infinity"),
    ("-Infinity presence_penalty", H,
     b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": -Infinity}', 400,
     "infinity"),
    ("float overflowing to inf", C, b'{"prompt": "x", "temperature": 1e400}', 400, "range"),
    ("integer with 5,000 digits", C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
     400, "json"),
    ("deeply nested json (50,000 levels)", C, _nested(50_000), 400, "nested"),
    ("deeply nested json in chat content", H, json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": json.loads(
            "[" * 200 + "]" * 200)}]}]}).encode(), 400, "content"),
    ("body over --max-request-bytes", C,
     json.dumps({"prompt": "a" * (8 * 1024 * 1024 + 10)}).encode(), 413, "larger"),
    # --- completions: types, missing fields, numbers ----------------------------------------
    ("missing prompt", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt is a number", C, {"prompt": 5}, 400, "prompt"),
    ("prompt is an object", C, {"prompt": {"text": "x"}}, 400, "prompt"),
    ("prompt list mixes ints and strings", C, {"prompt": [[1, "a"]]}, 400, "prompt"),
    ("temperature is a string", C, {**OK, "temperature": "hot"}, 400, "temperature"),
    ("stream is a list", C, {**OK, "stream": [True]}, 400, "stream"),
    ("negative max_tokens", C, {**OK, "max_tokens": -5}, 400, "max_tokens"),
    ("huge max_tokens", C, {**OK, "max_tokens": 10**18}, 400, "context length"),
    ("negative n", C, {**OK, "n": -3}, 400, "n"),
    ("huge n", C, {**OK, "n": 10**12, "temperature": 1}, 400, "n"),
    ("n beyond --max-n", C, {**OK, "n": 17, "temperature": 1}, 400, "max-n"),
    ("best_of below n", C, {**OK, "n": 3, "best_of": 2, "temperature": 1}, 400, "best_of"),
    ("presence_penalty out of range", C, {**OK, "presence_penalty": 100}, 400,
     "presence_penalty"),
    ("negative top_k", C, {**OK, "top_k": -7}, 400, "top_k"),
    ("huge seed", C, {**OK, "seed": 2**80}, 400, "seed"),
    ("empty prompt", C, {**OK, "prompt": ""}, 400, "prompt"),
    ("1 MB prompt", C, {**OK, "prompt": "ab " * 350_000}, 400, "context length"),
    ("negative token id", C, {**OK, "prompt": [1, -4]}, 400, "vocabulary"),
    ("token id beyond the vocabulary", C, {**OK, "prompt": [1, 10**9]}, 400, "vocabulary"),
    ("prompt + max_tokens beyond max_model_len", C, {"prompt": [5] * 300, "max_tokens": 300},
     400, "context length"),
    ("logprobs beyond --max-logprobs", C, {**OK, "logprobs": 21}, 400, "max-logprobs"),
    ("negative logprobs", C, {**OK, "logprobs": -1}, 400, "logprobs"),
    ("17 stop strings", C, {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop string of 1,001 characters", C, {**OK, "stop": "x" * 1001}, 400, "stop"),
    ("stop is a number", C, {**OK, "stop": 5}, 400, "stop"),
    ("stop_token_ids beyond the vocabulary", C, {**OK, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids"),
    ("logit_bias key not a token id", C, {**OK, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("min_tokens above max_tokens", C, {**OK, "min_tokens": 10}, 400, "min_tokens"),
    # --- chat ------------------------------------------------------------------------------
    ("missing messages", H, {"max_tokens": 2}, 400, "messages"),
    ("messages is a string", H, {"messages": "hi"}, 400, "messages"),
    ("message without role", H, {"messages": [{"content": "hi"}]}, 400, "role"),
    # Any role string is passed to the template (as vLLM does); a role that is no string is not.
    ("role is a number", H, {"messages": [{"role": 5, "content": "hi"}]}, 400, "role"),
    ("content is a number", H, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("content is an object", H, {"messages": [{"role": "user", "content": {"a": 1}}]}, 400,
     "content"),
    ("20,000 messages", H, {"messages": MSG * 20_000, "max_tokens": 2}, 400, "context length"),
    ("chat negative max_tokens", H, {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("chat top_logprobs beyond --max-logprobs", H, {**CHAT, "logprobs": True,
                                                     "top_logprobs": 50}, 400, "max-logprobs"),
    ("chat n beyond --max-n", H, {**CHAT, "n": 100, "temperature": 1}, 400, "max-n"),
    ("chat 17 stop strings", H, {**CHAT, "stop": ["a"] * 17}, 400, "stop"),
    ("chat temperature NaN as a string", H, {**CHAT, "temperature": "NaN"}, 400, "temperature"),
    # --- tokenize / detokenize ---------------------------------------------------------------
    ("tokenize without prompt or messages", T, {}, 400, "prompt"),
    ("tokenize prompt is a number", T, {"prompt": 5}, 400, "prompt"),
    ("tokenize role is a list", T, {"messages": [{"role": ["x"], "content": "x"}]}, 400,
     "role"),
    ("detokenize missing tokens", D, {}, 400, "tokens"),
    ("detokenize negative token", D, {"tokens": [1, -1]}, 400, "tokens"),
    ("detokenize tokens are strings", D, {"tokens": ["a"]}, 400, "tokens"),
    # --- responses ---------------------------------------------------------------------------
    ("responses missing input", R, {"max_output_tokens": 2}, 400, "input"),
    ("responses input is a number", R, {"input": 5}, 400, "input"),
    ("responses empty input list", R, {"input": []}, 400, "input"),
    ("responses unknown item type", R, {"input": [{"type": "computer_call"}]}, 400, "items"),
    ("responses image content", R, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400, "input_image"),
    ("responses max_output_tokens 0", R, {"input": "hi", "max_output_tokens": 0}, 400,
     "max_output_tokens"),
    ("responses web search tool", R, {"input": "hi", "tools": [{"type": "web_search"}]}, 400,
     "function tools"),
    ("responses background", R, {"input": "hi", "background": True}, 400, "background"),
]


def encode(body: object) -> bytes:
    """A case's body as the bytes to send."""
    return body if isinstance(body, bytes) else json.dumps(body).encode()
