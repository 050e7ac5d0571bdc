"""Load generators for the reliability checks (docs/reliability.md): overload, abort storms, the
bad-input corpus and the soak run. Each talks HTTP to a running server (loopback) and returns
plain numbers; tests call them with small counts, scripts/*.py with large ones and plot.

Every loop here is bounded: a fixed number of requests, each with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

PROMPT_WORDS = ["the", "module", "provides", "a", "function", "for", "reading", "and", "writing", "data", "to", "the", "file", "system", "with", "support", "for", "paths", "and", "streams", "of", "bytes"]


def random_prompt(rng: random.Random, max_words: int) -> str:
    """A prompt of 1..max_words words from a fixed vocabulary."""
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(1, max_words)))


# --- overload ----------------------------------------------------------------------------------


@dataclass
class OverloadResult:
    """What happened to `sent` concurrent requests: each is completed (200 with the requested
    number of tokens), refused (503 with Retry-After), or lost (anything else: a hang past the
    timeout, a dropped connection, a wrong status or body)."""

    sent: int = 0
    completed: int = 0
    refused: int = 0
    lost: int = 0
    lost_reasons: list[str] = field(default_factory=list)


async def overload(url: str, num_requests: int, *, max_tokens: int = 16,
                   timeout: float = 60.0, headers: dict | None = None) -> OverloadResult:
    """Fire `num_requests` completions at once (one connection each) and classify every one."""
    result = OverloadResult(sent=num_requests)
    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits,
                                 headers=headers) as client:
        async def one(i: int) -> None:
            body = {"prompt": f"The module {i}", "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0}
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                result.lost += 1
                result.lost_reasons.append(f"{type(e).__name__}: {e}")
                return
            if r.status_code == 200:
                usage = r.json().get("usage", {})
                if usage.get("completion_tokens") == max_tokens:
                    result.completed += 1
                    return
                result.lost_reasons.append(f"200 with usage {usage}")
            elif (r.status_code == 503 and r.headers.get("retry-after")
                  and r.json().get("error", {}).get("code") == 503):
                result.refused += 1
                return
            else:
                result.lost_reasons.append(f"{r.status_code}: {r.text[:200]}")
            result.lost += 1

        await asyncio.gather(*(one(i) for i in range(num_requests)))
    return result


# --- abort storms ------------------------------------------------------------------------------


@dataclass
class StormResult:
    """Outcomes of an abort storm: requests read to the end, and those whose client hung up
    (by where it hung up: before the first token, mid-decode, or after a wait)."""

    sent: int = 0
    completed: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0,
                                                             "wait": 0})
    refused: int = 0  # 503 (queue full): not an error, but not served
    errors: list[str] = field(default_factory=list)


async def abort_storm(url: str, num_requests: int, *, concurrency: int = 32,
                      abort_fraction: float = 1 / 3, seed: int = 0, max_prompt_words: int = 60,
                      max_tokens: tuple[int, int] = (8, 96), timeout: float = 60.0,
                      headers: dict | None = None) -> StormResult:
    """`num_requests` streaming completions, `concurrency` at a time; about `abort_fraction`
    of the clients disconnect at a random point: right after the response starts (the request
    is usually still in prefill or waiting), after a random number of chunks (mid-decode), or
    after a random sleep (anywhere, including while preempted under KV pressure)."""
    rng = random.Random(seed)
    plans = []
    for _ in range(num_requests):
        drop = rng.random() < abort_fraction
        plans.append((
            random_prompt(rng, max_prompt_words), rng.randint(*max_tokens),
            rng.choice(("prefill", "decode", "wait")) if drop else None,
            rng.randint(1, 20), rng.uniform(0.0, 0.5),
        ))
    result = StormResult(sent=num_requests)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers) as client:
        async def one(plan) -> None:
            prompt, n_tokens, drop, after_chunks, after_s = plan
            body = {"prompt": prompt, "max_tokens": n_tokens, "ignore_eos": True, "stream": True,
                    "temperature": 1.0, "n": 2 if n_tokens % 5 == 0 else 1}
            async with sem:
                try:
                    await _stream_one(client, body, drop, after_chunks, after_s, result)
                except httpx.HTTPError as e:
                    result.errors.append(f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one(p) for p in plans))
    return result


async def _stream_one(client, body, drop, after_chunks, after_s, result: StormResult) -> None:
    async def read(resp) -> bool:
        """True if the stream ended with [DONE] after no error event."""
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return True
            if '"error"' in data and json.loads(data).get("error"):
                result.errors.append(f"error event: {data[:200]}")
                return False
            chunks += 1
            if drop == "decode" and chunks >= after_chunks:
                return False  # hang up mid-decode
        result.errors.append("stream ended without [DONE]")
        return False

    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code == 503:
            result.refused += 1
            return
        if resp.status_code != 200:
            result.errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            return
        if drop == "prefill":
            result.dropped["prefill"] += 1
            return  # leaving the block closes the connection
        if drop == "wait":
            try:
                done = await asyncio.wait_for(read(resp), after_s)
            except TimeoutError:
                result.dropped["wait"] += 1
                return
        else:
            done = await read(resp)
        if done:
            result.completed += 1
        elif drop == "decode":
            result.dropped["decode"] += 1


# --- engine state ------------------------------------------------------------------------------


async def wait_idle(url: str, *, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """Poll `GET /debug/engine` (needs --enable-debug-endpoints) until nothing is running,
    waiting or swapped; return its last answer (the invariant check ran on it)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as client:
        while True:
            r = await client.get("/debug/engine")
            r.raise_for_status()
            state = r.json()
            idle = not (state["running"] or state["waiting"] or state["swapped"]
                        or state["groups"])
            if idle or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.1)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value} for the unlabelled-or-single-series gauges we read."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name.split("{")[0]] = float(value)
    return values


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- bad input -----------------------------------------------------------------------------------


@dataclass
class CorpusResult:
    tried: int = 0
    answered_4xx: int = 0
    crashes: int = 0  # 5xx, a dropped connection, or a server that stopped answering
    failures: list[str] = field(default_factory=list)


def run_corpus(url: str, cases, encode, *, timeout: float = 60.0) -> CorpusResult:
    """Send every case (name, path, body, status, mentions); check each answer is the expected
    4xx in OpenAI's error shape mentioning `mentions`, and that the server then answers a
    valid request."""
    result = CorpusResult()
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for name, path, body, status, mentions in cases:
            result.tried += 1
            try:
                r = client.post(path, content=encode(body),
                                headers={"content-type": "application/json"})
                after = client.post("/tokenize", json={"prompt": "still alive"})
            except httpx.HTTPError as e:
                result.crashes += 1
                result.failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if r.status_code >= 500 or after.status_code != 200:
                result.crashes += 1
            elif 400 <= r.status_code < 500:
                result.answered_4xx += 1
            problem = check_error(r, status, mentions)
            if problem:
                result.failures.append(f"{name}: {problem}")
    return result


def check_error(r: httpx.Response, status: int, mentions: str) -> str | None:
    """None if `r` is a `status` error in OpenAI's shape whose message mentions `mentions`."""
    if r.status_code != status:
        return f"status {r.status_code}, expected {status}: {r.text[:300]}"
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not OpenAI's error shape: {r.text[:300]}"
    if set(error) != {"message", "type", "param", "code"} or error["code"] != status:
        return f"not OpenAI's error shape: {error}"
    if mentions not in error["message"].lower():
        return f"message does not mention {mentions!r}: {error['message'][:300]}"
    return None
