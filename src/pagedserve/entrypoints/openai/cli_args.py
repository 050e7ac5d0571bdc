"""The OpenAI server's own flags that vLLM users expect (added to `pagedserve serve` by
`entrypoints/cli.py`), and loading `--chat-template`."""

from __future__ import annotations

import argparse
import codecs
import json


# vLLM's on/off server flags: (flag, what it switches on).
SWITCHES = (
    ("--enable-request-id-headers",
     "answer every request with an X-Request-Id header (the client's own X-Request-Id when it "
     "sent one)"),
    ("--return-tokens-as-token-ids", "logprobs name tokens as 'token_id:N' instead of their text"),
    ("--enable-force-include-usage",
     "streams end with a usage chunk even without stream_options.include_usage"),
    ("--enable-prompt-tokens-details",
     "usage reports prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache)"),
    ("--enable-server-load-tracking", "count the completions / chat requests in progress; GET /load"),
    ("--enable-responses-api-store",
     "keep /v1/responses answers (store: true, OpenAI's default; the newest 1024) for GET "
     "/v1/responses/{id} and previous_response_id (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1, "
     "also read); without it store is ignored, as in vLLM"),
    ("--enable-tokenizer-info-endpoint",
     "serve GET /tokenizer_info (the tokenizer's configuration and chat template; remote "
     "tokenizers such as lm-evaluation-harness's use it)"),
)


def add_openai_server_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server flags, with vLLM's names and meanings."""
    p.add_argument("--chat-template", default=None,
                   help="the chat template for /v1/chat/completions: a file, or the jinja2 "
                        "source itself (default: the tokenizer's, else a documented default)")
    p.add_argument("--root-path", default=None,
                   help="the path prefix the server is mounted under behind a proxy")
    for flag, help_text in SWITCHES:
        p.add_argument(flag, action="store_true", help=help_text)
    # CORS (FastAPI's CORSMiddleware), with vLLM 0.32's flags and defaults: JSON lists; no
    # origin allowed unless configured, every method and header of an allowed origin.
    p.add_argument("--allowed-origins", type=json_list, default=[],
                   help="CORS: allowed origins, a JSON list, e.g. '[\"https://app.example\"]' "
                        "or '[\"*\"]' (default: none -- no cross-origin browser access, as vLLM)")
    for flag, what in (("--allowed-methods", "methods"), ("--allowed-headers", "headers")):
        p.add_argument(flag, type=json_list, default=["*"],
                       help=f"CORS: allowed {what}, a JSON list (default: [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests")
    p.add_argument("--metrics-prefix", choices=("pagedserve", "vllm"), default="pagedserve",
                   help="name the Prometheus metrics pagedserve:... (default) or vllm:..., so that "
                        "dashboards built for vLLM read them unchanged")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM/SIGINT, refuse new requests (503) and let those in flight "
                        "finish for up to this many seconds before aborting the rest "
                        "(default: end them at once)")
    p.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"),
                   default="auto",
                   help="how message contents reach the chat template: auto / string (text parts "
                        "joined into a string) or openai (a list of {type: text, text} parts)")
    p.add_argument("--response-role", default="assistant",
                   help="the role of the answers of /v1/chat/completions when the request adds "
                        "the generation prompt (default: assistant)")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help="chat template arguments every chat request gets unless it sets them, a "
                        "JSON object, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="with tool_choice 'none', leave the tools out of the chat template")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="streamed answers send a chunk every this many tokens (and at the end; "
                        "default 1: every token)")
    p.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="serve no /docs, /redoc or /openapi.json")
    from pagedserve.lora.serving import add_lora_server_args

    add_lora_server_args(p)  # --lora-modules, --allow-runtime-lora-updating


def json_list(value: str) -> list[str]:
    """A `--allowed-*` value: a JSON list of strings (vLLM's format, e.g. '["https://a.b"]')."""
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}") from e
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def json_object(value: str) -> dict:
    """A JSON-object flag's value (e.g. --default-chat-template-kwargs)."""
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a template (holds
    `{`, `}` or a newline; escapes such as `\\n` are decoded, as vLLM does). ValueError for a
    value that looks like a path but cannot be read."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it could "
                             f"not be read: {e}") from e
    return codecs.decode(value, "unicode_escape")
