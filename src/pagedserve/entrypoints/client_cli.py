"""`pagedserve chat` and `pagedserve complete`: vLLM's interactive clients of a running
OpenAI-compatible server (ours or any other), through the official `openai` client.

Both take `--url` (default http://localhost:8000/v1), `--model-name` (default: the first model
`/v1/models` lists), `--api-key` (default: $OPENAI_API_KEY, else "EMPTY") and `-q/--quick TEXT`
(send one message / prompt, print the streamed answer, exit). Without `--quick` they read lines
from stdin until EOF. `chat` keeps the conversation (with `--system-prompt` first); `complete`
takes `--max-tokens`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_client_args(p: argparse.ArgumentParser, kind: str) -> None:
    """The flags of `pagedserve chat` (kind "chat") or `pagedserve complete`."""
    p.add_argument("--url", default="http://localhost:8000/v1",
                   help="URL of the running OpenAI-compatible server (default: %(default)s)")
    p.add_argument("--model-name", default=None,
                   help="the model to ask (default: the first model /v1/models lists)")
    p.add_argument("--api-key", default=None,
                   help="API key (default: $OPENAI_API_KEY, else none)")
    if kind == "chat":
        p.add_argument("--system-prompt", default=None,
                       help="a system message put first in the conversation")
        p.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                       help="send one message, print the answer, then exit")
    else:
        p.add_argument("--max-tokens", type=int, default=None,
                       help="most tokens generated per completion")
        p.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                       help="send one prompt, print its completion, then exit")


def _client(args: argparse.Namespace):
    from openai import OpenAI

    client = OpenAI(api_key=args.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
                    base_url=args.url)
    model = args.model_name or client.models.list().data[0].id
    print(f"Using model: {model}", flush=True)
    return client, model


def _print_stream(stream, chat: bool) -> str:
    """Print a streamed answer as it comes; return its text."""
    out = []
    for chunk in stream:
        if not chunk.choices:
            continue
        text = chunk.choices[0].delta.content if chat else chunk.choices[0].text
        if text:
            out.append(text)
            print(text, end="", flush=True)
    print(flush=True)
    return "".join(out)


def _lines(prompt: str):
    """Lines from stdin until EOF (or Ctrl-C)."""
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            return


def cmd_chat(args: argparse.Namespace) -> int:
    client, model = _client(args)
    conversation = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    messages = [args.quick] if args.quick is not None else None
    if messages is None:
        print("Please enter a message for the chat model:", flush=True)
        messages = _lines("> ")
    for message in messages:
        conversation.append({"role": "user", "content": message})
        stream = client.chat.completions.create(model=model, messages=conversation,
                                                stream=True)
        conversation.append({"role": "assistant", "content": _print_stream(stream, True)})
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    client, model = _client(args)
    kwargs = {"model": model, "stream": True}
    if args.max_tokens:
        kwargs["max_tokens"] = args.max_tokens
    prompts = [args.quick] if args.quick is not None else None
    if prompts is None:
        print("Please enter prompt to complete:", flush=True)
        prompts = _lines("> ")
    for prompt in prompts:
        _print_stream(client.completions.create(prompt=prompt, **kwargs), False)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run `chat` or `complete`; an unreachable server is a one-line error (exit 1)."""
    try:
        import openai
    except ImportError:
        print("error: pagedserve chat / complete need the openai package: pip install openai",
              file=sys.stderr)
        return 1

    # No per-request INFO lines around the answers: the HTTP clients' loggers (openai's, httpx's,
    # and the httpx2 / httpcore that newer openai releases log through) and any other library's.
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("openai", "httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return cmd_chat(args) if args.command == "chat" else cmd_complete(args)
    except openai.APIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
