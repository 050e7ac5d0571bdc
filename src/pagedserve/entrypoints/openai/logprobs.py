"""The engine's logprobs (per position `{token_id: Logprob}`) in OpenAI's two formats."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.engine.detokenizer import decode_token
from pagedserve.entrypoints.openai.protocol import (
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
)
from pagedserve.outputs import Logprob

# JSON has no -inf; vLLM clamps to this.
LOGPROB_FLOOR = -9999.0


def clamp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_text(tokenizer: Any, token_id: int, entry: Logprob | None, as_id: bool = False) -> str:
    """A token's text in a logprobs answer; `token_id:N` with --return-tokens-as-token-ids."""
    if as_id:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode_token(tokenizer, token_id)


def append_completion_logprobs(
    into: CompletionLogProbs,
    tokenizer: Any,
    token_ids: list[int],
    positions: list[dict[int, Logprob] | None],
    offset: int,
    as_ids: bool = False,
) -> int:
    """Append tokens to an OpenAI completions `logprobs` object; return the next text offset.

    A position that is None (the first prompt token, with `echo`) gets a None logprob and top
    logprobs. `top_logprobs` holds every entry the engine returned, in its order (the chosen
    token first, then the top-k), keyed by token text, as vLLM does.
    """
    for token_id, pos in zip(token_ids, positions):
        if pos is None:
            text = token_text(tokenizer, token_id, None, as_ids)
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            entry = pos.get(token_id)
            text = token_text(tokenizer, token_id, entry, as_ids)
            into.token_logprobs.append(clamp(entry.logprob) if entry else None)
            into.top_logprobs.append({
                token_text(tokenizer, tid, e, as_ids): clamp(e.logprob) for tid, e in pos.items()
            })
        into.tokens.append(text)
        into.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    positions: list[dict[int, Logprob]],
    top_n: int,
    as_ids: bool = False,
) -> list[ChatLogProbsContent]:
    """Chat completions' `logprobs.content`: per token its text, logprob, UTF-8 bytes, and the
    first `top_n` entries of the engine's (the chosen token first, then the top-k; -1: all),
    as vLLM lists them."""
    content = []
    for token_id, pos in zip(token_ids, positions):
        entry = pos.get(token_id)
        text = token_text(tokenizer, token_id, entry, as_ids)
        top = []
        for tid, e in list(pos.items())[: None if top_n == -1 else top_n]:
            t = token_text(tokenizer, tid, e, as_ids)
            top.append(ChatLogProb(token=t, logprob=clamp(e.logprob), bytes=_bytes(t)))
        content.append(ChatLogProbsContent(
            token=text, logprob=clamp(entry.logprob) if entry else LOGPROB_FLOOR,
            bytes=_bytes(text), top_logprobs=top,
        ))
    return content


def prompt_logprobs_json(positions) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` extra: per prompt position {token id: {logprob, rank,
    decoded_token}}, the first None."""
    if positions is None:
        return None
    return [
        None if pos is None else {
            tid: {"logprob": clamp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for tid, e in pos.items()
        }
        for pos in positions
    ]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
