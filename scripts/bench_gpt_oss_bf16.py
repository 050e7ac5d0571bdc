"""gpt-oss in bf16 on CPU, in process: a 1,024-token prompt's prefill time and greedy decode
tokens/s at 1 and 8 streams (128-token prompts, 64 new tokens), for one of three paths:

- `old`: attention sinks through the torch loop (one `_attend_one` per token) and the layers'
  modules on decode steps (what the engine did before the sinks reached the bf16 decode kernel);
- `kernel`: every token one row of the bf16 decode kernel with the sinks, modules on decode;
- `fused`: that, and decode steps' attention half in one compiled call (the default).

    python scripts/bench_gpt_oss_bf16.py --make /tmp/gpt-oss-24l   # once: a random model
    for m in old kernel fused; do python scripts/bench_gpt_oss_bf16.py /tmp/gpt-oss-24l --path $m; done

`--make` writes a random-weight gpt-oss of 24 layers (gpt-oss-20b's layer count, alternating
128-token windows) at a small width (hidden 512, 8 query / 4 KV heads of 64, 32 experts of 512,
4 routed), where the per-layer costs the paths differ in are visible; `--wide` gives gpt-oss-20b's
width instead (hidden 2880, 64 / 8 heads, 4 experts of 2880) at 2 layers.
"""

from __future__ import annotations

import argparse
import time


def make(path: str, wide: bool) -> None:
    import torch
    import transformers

    if wide:
        shape = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64,
                     num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2)
    else:
        shape = dict(hidden_size=512, intermediate_size=512, num_hidden_layers=24, num_attention_heads=8,
                     num_key_value_heads=4, num_local_experts=32, num_experts_per_tok=4)
    layers = shape["num_hidden_layers"]
    cfg = transformers.GptOssConfig(vocab_size=32000, head_dim=64, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                    max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    print(f"wrote {path}")


def bench(path: str, mode: str) -> None:
    import torch

    from pagedserve import LLM, SamplingParams
    from pagedserve.attention.backends import torch_ref
    from pagedserve.platforms import cpu_decode

    if mode in ("old", "kernel"):
        cpu_decode.fused_decode_attention = lambda *a: None
    if mode == "old":
        torch_ref._sinks_on_decode_kernel = lambda *a, **k: None
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory=1 << 30)
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(0, 32000, (n,), generator=gen).tolist()}

    llm.generate([prompt(3)], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate([prompt(1024)], SamplingParams(max_tokens=1), use_tqdm=False)
    parts = [f"prefill of 1024 tokens {time.perf_counter() - t:.2f} s"]
    for n in (1, 8):
        reqs = [prompt(128) for _ in range(n)]
        llm.generate(reqs, SamplingParams(max_tokens=2), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                            use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
        parts.append(f"C={n} {n * 64 / dt:.1f} tok/s")
    print(f"{mode}: " + " | ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="an HF gpt-oss folder")
    ap.add_argument("--make", action="store_true", help="write a random model there first")
    ap.add_argument("--wide", action="store_true", help="with --make: gpt-oss-20b's width, 2 layers")
    ap.add_argument("--path", choices=("old", "kernel", "fused"), default="fused")
    args = ap.parse_args()
    if args.make:
        make(args.model, args.wide)
        return
    bench(args.model, args.path)


if __name__ == "__main__":
    main()
