"""Write a random-weight Qwen3.5-MoE of a released model's layer shape as an HF folder (bf16
safetensors, the bench tokenizer of scripts/make_moe_model.py), and optionally convert it with
llama.cpp's converter (`--no-mtp`: no multi-token-prediction layers) and quantize it to Q4_K_M:
the Gated DeltaNet rows of docs/benchmarks.md (issue 35's hybrid families).

Default shape: Qwen3.5-35B-A3B's layers (hidden 2048; Gated DeltaNet layers of 16 key / 32 value
heads of 128 and a convolution of 4; gated attention layers of 16 query / 2 KV heads of 256 every
4th layer; 256 experts of width 512, 8 routed, and a shared expert of 512), 4 layers, Qwen3.5's
248,320-token vocabulary (the LM head's rows past the small tokenizer are zero, never produced).

    python scripts/make_qwen35_model.py /tmp/qwen35-hf --llama-cpp /work/llama.cpp
        # + /tmp/qwen35-hf/qwen35-bf16.gguf and /tmp/qwen35-hf/qwen35-Q4_K_M.gguf

Weights are N(0, 0.02) (norms at their identity), drawn one tensor at a time from `--seed`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_moe_model import convert, write_tokenizer  # noqa: E402  (the same tokenizer and conversion)


def write_model(folder: Path, args) -> None:
    """config.json + model.safetensors, drawn with `--seed`."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    tok = json.loads((folder / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    config = Qwen3_5MoeTextConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=args.experts, num_experts_per_tok=args.routed,
        moe_intermediate_size=args.expert_width, shared_expert_intermediate_size=args.expert_width,
        layer_types=layer_types, max_position_embeddings=args.max_len, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"])
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(args.seed)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            t = torch.zeros(p.shape)  # zero-centred (1 + w) norms: the identity
        elif "norm" in name:
            t = torch.ones(p.shape)
        elif name.endswith("A_log"):
            t = torch.log(torch.rand(p.shape, generator=gen) * 15 + 1)  # HF's init range
        elif name.endswith("dt_bias"):
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * 0.02
        state[name] = t.to(torch.bfloat16)
    vocab = 1 + max(tok["model"]["vocab"].values())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name][vocab:] = 0
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the HF folder to write")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--routed", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=248320)
    p.add_argument("--tokenizer-vocab", type=int, default=8000, help="tokens the BPE learns")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="a llama.cpp tree (converter, build/bin/llama-quantize): also write the "
                        "bf16 and Q4_K_M GGUF files into the folder")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out, args.tokenizer_vocab)
    write_model(args.out, args)
    print(f"wrote {args.out}")
    if args.llama_cpp is not None:
        convert(args.out, args.llama_cpp, stem="qwen35", flags=("--no-mtp",))


if __name__ == "__main__":
    main()
