#!/usr/bin/env bash
# The CUDA path's device check (issue 10), from the source tree, in well under 8 minutes on an H200:
#   1. `pytest -m gpu` (the CUDA runner tests, and the Triton kernels' tests on CUDA);
#   2. the machine's own ceilings: a device-to-device copy's bandwidth and a bf16 8192^3 matmul's
#      TFLOP/s (the bounds below use the datasheet's 4.8 TB/s and 790 TFLOP/s);
#   3. `bench latency` on a Llama-3-8B-shaped config (bf16, dummy weights), input 128, output 128,
#      at batch 1, 16, 64 and 256: decode tokens/s, the roofline at batch 1, TFLOP/s at 256, and
#      at batch 1 and 256 the top CUDA kernels of an 8-token run (`--profile-kernels`).
# Needs torch with CUDA, triton, transformers, tokenizers, safetensors, numpy, pytest; no server,
# GGUF or Ray packages. Logs go to $OUT (the device tool's folder) when set, else a temp folder.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NOTE: the CPU float32 reference of the tests runs on torch's ops: building the C++ CPU
# kernels for the device machine's torch would cost a minute of device time.
export PAGEDSERVE_DISABLE_CPU_KERNELS=${PAGEDSERVE_DISABLE_CPU_KERNELS:-1}
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
ITERS=${ITERS:-2}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(0))"

echo "== pytest -m gpu"
timeout ${PYTEST_TIMEOUT:-200} $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 90 \
    tests/gpu tests/attention tests/worker tests/kernels/test_triton_layers.py \
    2>&1 | tee "$LOGS/pytest_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== ceilings"
timeout 60 $PY - <<'PYEOF' 2>&1 | tee "$LOGS/ceilings.log"
import torch
dev = torch.device("cuda")
def timed(fn, n=10):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(n):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n
src = torch.empty(1 << 32, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
s = timed(lambda: dst.copy_(src))
print(f"copy: {2 * src.numel() / s / 1e12:.3f} TB/s (read + write of {src.numel() / 1e9:.3g} GB)")
del src, dst
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev); b = torch.randn_like(a)
s = timed(lambda: a @ b)
print(f"bf16 matmul 8192^3: {2 * 8192 ** 3 / s / 1e12:.1f} TFLOP/s")
PYEOF

MODEL=$(mktemp -d)/llama-3-8b-shaped
$PY - "$MODEL" <<'PYEOF'
import json, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
with open(os.path.join(sys.argv[1], "config.json"), "w") as f:
    json.dump(config, f)
PYEOF

for B in 1 256 16 64; do
    echo "== bench latency, batch $B"
    PROFILE=0; [ "$B" -eq 1 ] || [ "$B" -eq 256 ] && PROFILE=8
    timeout ${BENCH_TIMEOUT:-120} $PY -m pagedserve.entrypoints.cli bench latency --model "$MODEL" \
        --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128 --batch-size "$B" \
        --num-iters "$ITERS" --num-iters-warmup 1 --profile-kernels "$PROFILE" \
        2>&1 | tee "$LOGS/latency_b$B.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== summary (Llama-3-8B shape, bf16, input 128, output 128)"
for B in 1 16 64 256; do
    f="$LOGS/latency_b$B.log"
    echo "batch $B: $(grep -m1 'decode:' "$f" | sed 's/^ *//')"
done
echo "batch 1 roofline: $(grep -m1 'bandwidth roofline' "$LOGS/latency_b1.log" | sed 's/^ *//')"
echo "batch 256 compute: $(grep -m1 '% of peak' "$LOGS/latency_b256.log" | sed 's/^ *//')"
echo "targets: >= 60% of the bandwidth roofline at batch 1, >= 40% of peak at batch 256"
exit $status
