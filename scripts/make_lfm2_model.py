"""Write a random-weight LFM2 of a released model's shape as an HF folder (bf16 safetensors, the
bench tokenizer of scripts/make_moe_model.py), and optionally convert it with llama.cpp's
converter and quantize it: the LFM2 rows of docs/benchmarks.md (issue 35).

Default shape: LFM2-1.2B (hidden 2048, 16 layers of which 6 attention -- 32 query / 8 KV heads of
64 -- and 10 gated short convolutions of length 3, MLP width 8192 after LFM2's adjustment, a
65,536-token tied vocabulary).

    python scripts/make_lfm2_model.py /tmp/lfm2-hf --llama-cpp /work/llama.cpp
        # + /tmp/lfm2-hf/model-bf16.gguf and /tmp/lfm2-hf/model-Q4_K_M.gguf

Weights are N(0, 0.02) (norms 1) from `--seed`; the embedding rows past the tokenizer are zero
(their logit 0 is never the largest, so no engine produces a token without text).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_moe_model import convert, write_tokenizer  # noqa: E402  (the same tokenizer and conversion)

LFM2_1_2B_ATTENTION = (2, 5, 8, 10, 12, 14)


def write_model(folder: Path, args) -> None:
    """config.json + model.safetensors, drawn with `--seed`."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    tok = json.loads((folder / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = Lfm2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, conv_L_cache=3, max_position_embeddings=args.max_len,
        layer_types=["full_attention" if i in args.attention else "conv" for i in range(args.layers)],
        bos_token_id=None, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
        tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = Lfm2ForCausalLM(config)
    gen = torch.Generator().manual_seed(args.seed)
    state = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * 0.02
        state[name] = t.to(torch.bfloat16)
    state["model.embed_tokens.weight"][1 + max(tok["model"]["vocab"].values()):] = 0
    state.pop("lm_head.weight", None)  # tied
    from safetensors.torch import save_file

    config.architectures = ["Lfm2ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the HF folder to write")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--attention", type=int, nargs="*", default=list(LFM2_1_2B_ATTENTION),
                   help="indices of the attention layers (the others are short convolutions)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=12288, help="before LFM2's 2/3 adjustment")
    p.add_argument("--vocab-size", type=int, default=65536)
    p.add_argument("--tokenizer-vocab", type=int, default=8000, help="tokens the BPE learns")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="a llama.cpp tree: also write the bf16 and Q4_K_M GGUF files")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out, args.tokenizer_vocab)
    write_model(args.out, args)
    print(f"wrote {args.out}")
    if args.llama_cpp is not None:
        convert(args.out, args.llama_cpp, stem="model")


if __name__ == "__main__":
    main()
