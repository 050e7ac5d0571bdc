"""`pagedserve bench serve`: an online serving benchmark against any OpenAI-compatible server.

The seeded ShareGPT-like trace of `bench throughput` (built with the tokenizer of `--model`,
default the embedded gemma-3-270m) is sent as prompt *text* (the trace's token ids decoded, special
tokens dropped), so a peer that tokenizes differently (llama.cpp's llama-server, vLLM) gets the
same requests. Requests arrive as a Poisson process of rate `--request-rate` (or all at once),
at most `--max-concurrency` in flight, streaming from `/v1/completions` with `max_tokens` =
the trace's output length and `ignore_eos`, greedy. Output tokens come from the final usage
chunk (`stream_options.include_usage`), else from the number of text chunks.

Reported: request throughput, output tokens/s, TTFT / TPOT / inter-token latency (mean, p50,
p99), and the vLLM paper's normalized latency (mean over requests of end-to-end latency divided
by output length).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One request's timings (seconds) and token counts."""

    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    requested_tokens: int = 0  # max_tokens asked for
    text: str = ""  # the streamed completion

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchResult:
    """A whole run; `report()` is the printed summary."""

    duration: float
    results: list[RequestResult]
    request_rate: float
    max_concurrency: int | None

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def num_failed(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def request_throughput(self) -> float:
        return len(self.ok) / self.duration

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration

    @property
    def normalized_latency(self) -> float:
        """Mean over requests of end-to-end latency / output tokens (s/token)."""
        values = [r.latency / r.output_tokens for r in self.ok if r.output_tokens]
        return sum(values) / len(values) if values else math.nan

    def report(self) -> str:
        ok = self.ok
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        lines = [
            f"requests: {len(ok)} ok, {self.num_failed} failed   request rate: {rate}   "
            f"max concurrency: {self.max_concurrency or 'unlimited'}",
            f"duration: {self.duration:.2f} s   input tokens: {sum(r.prompt_tokens for r in ok)}"
            f"   output tokens: {self.output_tokens}",
            f"request throughput: {self.request_throughput:.3f} req/s",
            f"output token throughput: {self.output_throughput:.1f} tok/s",
        ]
        for name, values in (
            ("TTFT", [r.ttft for r in ok]),
            ("TPOT", [r.tpot for r in ok if r.tpot is not None]),
            ("ITL", [v for r in ok for v in r.itl]),
        ):
            lines.append(f"{name:>5} ms: mean {_mean(values) * 1e3:9.2f}   p50 "
                         f"{percentile(values, 50) * 1e3:9.2f}   p99 "
                         f"{percentile(values, 99) * 1e3:9.2f}")
        lines.append(f"normalized latency: {self.normalized_latency * 1e3:.2f} ms/token "
                     "(mean of end-to-end latency / output tokens)")
        errors = sorted({r.error for r in self.results if r.error})
        if errors:
            lines.append("errors: " + "; ".join(errors[:3]))
        return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(client, url: str, model: str, prompt: str, output_len: int,
                       api_key: str | None = None,
                       extra_body: dict | None = None) -> RequestResult:
    """One streamed completion; timings measured at the arrival of chunks with text.
    `extra_body` adds server-specific fields (llama-server: `{"cache_prompt": false}`)."""
    payload = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    chunks = 0
    usage = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=_headers(api_key)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return RequestResult(False, str(obj["error"].get("message")))
                if obj.get("usage"):
                    usage = obj["usage"]
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    pieces.append(choices[0]["text"])
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return RequestResult(False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, "no text was streamed")
    return RequestResult(
        True,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else 0,
        output_tokens=int(usage["completion_tokens"]) if usage else chunks,
        ttft=first - start, latency=end - start, itl=itl, requested_tokens=output_len,
        text="".join(pieces),
    )


async def run_benchmark(base_url: str, requests: list[tuple[str, int]], *, model: str,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        seed: int = 0, api_key: str | None = None,
                        timeout: float = 600.0, extra_body: dict | None = None) -> BenchResult:
    """Send `requests` ((prompt text, output length) pairs) with Poisson arrivals."""
    import httpx

    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1,
                          max_keepalive_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(prompt: str, output_len: int) -> RequestResult:
            async with limit:
                return await send_request(client, url, model, prompt, output_len, api_key,
                                          extra_body)

        start = time.perf_counter()
        tasks = []
        for i, (prompt, output_len) in enumerate(requests):
            if i and not math.isinf(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.ensure_future(one(prompt, output_len)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return BenchResult(duration, list(results), request_rate, max_concurrency)


def trace_prompts(tokenizer, args) -> list[tuple[str, int]]:
    """The trace as (prompt text, output length) pairs."""
    from pagedserve.bench.trace import sharegpt_like_trace

    trace = sharegpt_like_trace(
        tokenizer, args.num_prompts, input_len_mean=args.input_len_mean,
        output_len_mean=args.output_len_mean, output_len_fixed=args.output_len_fixed,
        seed=args.seed, max_input_len=args.max_input_len, max_output_len=args.max_output_len,
    )
    return [(tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True), r.output_len)
            for r in trace]


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx

    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key), timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return data[0]["id"]


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {value}")
    return rate


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="gemma-3-270m",
                   help="model whose tokenizer builds the trace (default: the embedded "
                        "gemma-3-270m)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--served-model-name", default=None,
                   help="the request's model field (default: the first of /v1/models)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--extra-body", type=_json_object, default=None,
                   help='JSON merged into every request, e.g. \'{"cache_prompt": false}\' '
                        "for llama-server")
    p.add_argument("--profile", action="store_true",
                   help="per-section step timings from the server (a pagedserve server started "
                        "with --enable-debug-endpoints)")
    p.add_argument("--result-json", default=None, help="also write the figures to this file")


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _debug_post(args, path: str, **params) -> dict:
    import httpx

    resp = httpx.post(args.base_url.rstrip("/") + path, params=params,
                      headers=_headers(args.api_key), timeout=120)
    if resp.status_code == 404:
        raise ValueError("--profile needs a pagedserve server started with --enable-debug-endpoints")
    resp.raise_for_status()
    return resp.json()


def main(args: argparse.Namespace) -> int:
    import logging

    from pagedserve.models.source import resolve_model

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request

    tokenizer = resolve_model(args.model).load_tokenizer(args.tokenizer)
    requests = trace_prompts(tokenizer, args)
    model = args.served_model_name or served_model(args.base_url, args.api_key)
    print(f"server={args.base_url} model={model} prompts={len(requests)} "
          f"output tokens={sum(n for _, n in requests)}")

    async def go() -> BenchResult:
        import httpx

        async with httpx.AsyncClient(timeout=args.timeout) as client:  # warm-up
            warm = await send_request(client, args.base_url.rstrip("/") + "/v1/completions",
                                      model, requests[0][0], 4, args.api_key, args.extra_body)
        if not warm.ok:
            raise ValueError(f"the warm-up request failed: {warm.error}")
        if args.profile:
            _debug_post(args, "/debug/profile/start")
        return await run_benchmark(
            args.base_url, requests, model=model, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key,
            timeout=args.timeout, extra_body=args.extra_body,
        )

    result = asyncio.run(go())
    print(result.report())
    profile = None
    if args.profile:
        profile = _debug_post(args, "/debug/profile/stop", wall_s=result.duration)
        # `outside steps`: the server's HTTP handling and streaming, and idle time.
        print("server-side " + profile["report"])
    if args.result_json:
        ok = result.ok
        summary = {
            "base_url": args.base_url, "max_concurrency": args.max_concurrency,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "num_ok": len(ok), "num_failed": result.num_failed, "duration_s": result.duration,
            "output_tokens": result.output_tokens,
            "output_throughput": result.output_throughput,
            "ttft_p50_ms": percentile([r.ttft for r in ok], 50) * 1e3,
            "tpot_p50_ms": percentile([r.tpot for r in ok if r.tpot is not None], 50) * 1e3,
            "normalized_latency_ms": result.normalized_latency * 1e3,
            "profile": profile and profile["breakdown"],
            # per request, in trace order: for checking lengths and comparing engines' tokens
            "outputs": [{"ok": r.ok, "requested_tokens": r.requested_tokens,
                         "output_tokens": r.output_tokens, "text": r.text} for r in result.results],
        }
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if result.num_failed == 0 else 1
