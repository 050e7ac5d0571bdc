#!/usr/bin/env bash
# The data-parallel benchmarks of docs/benchmarks.md ("Scaling out"), on a quiet machine:
#  1. the single-engine server in one process against the same with the engine core apart
#     (--engine-core-process), and DP=2 x 1 thread against DP=1 x 2 threads, by `bench serve`;
#  2. `bench chat-trace`: prefix-cache hit rate / TTFT by routing, DP=2 vs one engine, a killed
#     core (hit rates at concurrency 1 are exact; TTFT at concurrency 6).
# Usage: scripts/bench_dp.sh [MODEL]   (default: the embedded Gemma 3 270M)
set -euo pipefail
MODEL=${1:-}
MODEL_FLAG=()
[ -n "$MODEL" ] && MODEL_FLAG=(--model "$MODEL")
PORT=${PORT:-8123}
OUT=${OUT:-/tmp/pagedserve-bench-dp}
mkdir -p "$OUT"

serve_and_bench() {  # name, then server flags
  local name=$1; shift
  pagedserve serve "${MODEL_FLAG[@]}" --port "$PORT" --disable-access-log "$@" \
    > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 0.5
  done
  pagedserve bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 64 \
    --max-concurrency 16 --max-input-len 256 --max-output-len 128 \
    --result-json "$OUT/$name.json" | tee "$OUT/$name.txt"
  kill -INT "$pid"; wait "$pid" || true
}

serve_and_bench in-process
serve_and_bench core-apart --engine-core-process
serve_and_bench dp1x2 --engine-core-process --cpu-threads 2
serve_and_bench dp2x1 --data-parallel-size 2

pagedserve bench chat-trace "${MODEL_FLAG[@]}" --conversations 24 --turns 3 --system-len 128 \
  --reply-tokens 32 --concurrency 1 --only single,prefix,least-load,round-robin \
  | tee "$OUT/chat-c1.txt"
pagedserve bench chat-trace "${MODEL_FLAG[@]}" --conversations 24 --turns 3 --system-len 128 \
  --reply-tokens 32 --concurrency 6 --kill-core | tee "$OUT/chat-c6.txt"
