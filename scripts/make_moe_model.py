"""Write a random-weight mixture-of-experts model of realistic shape as an HF folder (bf16
safetensors, a byte-level BPE tokenizer with Qwen2's pre-tokenizer), and optionally convert it
with llama.cpp's converter and quantize it to Q4_K_M: the model of the MoE rows of
docs/benchmarks.md (issue 35).

Default shape: Qwen3-30B-A3B's layers (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
width 768, 8 routed per token, renormalized), 4 layers, Qwen3's 151,936-token vocabulary (the
tokenizer itself is small; the LM head's rows beyond it are zero, so never produced).

    python scripts/make_moe_model.py /tmp/moe-hf                        # the HF folder
    python scripts/make_moe_model.py /tmp/moe-hf --llama-cpp /work/llama.cpp
        # + /tmp/moe-hf/moe-bf16.gguf (convert_hf_to_gguf.py --outtype bf16) and
        #   /tmp/moe-hf/moe-Q4_K_M.gguf (llama-quantize ... Q4_K_M)

By hand, the same conversion: llama.cpp's converter refuses a tokenizer it does not know ("BPE
pre-tokenizer was not recognized"); ours has Qwen2's pre-tokenizer, so name it "qwen2":

    python - <<'EOF'
    import runpy, sys
    sys.path.insert(0, "/work/llama.cpp")
    sys.argv = ["convert_hf_to_gguf.py", "/tmp/moe-hf", "--outtype", "bf16",
                "--outfile", "/tmp/moe-hf/moe-bf16.gguf"]
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    runpy.run_path("/work/llama.cpp/convert_hf_to_gguf.py", run_name="__main__")
    EOF
    /work/llama.cpp/build/bin/llama-quantize /tmp/moe-hf/moe-bf16.gguf /tmp/moe-hf/moe-Q4_K_M.gguf Q4_K_M

Weights are N(0, 0.02) (norms 1), drawn one tensor at a time from `--seed`, so the folder is
written without holding the model in memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

QWEN2_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                     r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE of `vocab` tokens trained on the bench corpus, with Qwen2's
    pre-tokenizer (so llama.cpp's "qwen2" pre-tokenization is the same) and a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.bench.trace import corpus_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                          "assistant\n{% endif %}")
    fast.save_pretrained(folder)


def write_model(folder: Path, args) -> None:
    """config.json + model.safetensors (sharded by layer), weights drawn tensor by tensor."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    tok = json.loads((folder / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate_size=args.expert_width * 8, moe_intermediate_size=args.expert_width,
        num_experts=args.experts, num_experts_per_tok=args.routed, norm_topk_prob=True,
        max_position_embeddings=args.max_len, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    h, d, e, w = args.hidden, args.head_dim, args.experts, args.expert_width
    weight_map: dict[str, str] = {}

    def save(tensors: dict, name: str) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    # NOTE: the LM head's rows past the tokenizer are zero: their logit is 0 while the max of
    # the tokenizer's thousands of N(0, ~1) logits is far above it, so no engine ever produces a
    # token that has no text (a benchmark's streamed text would be empty).
    head = rand(args.vocab_size, h)
    head[1 + max(tok["model"]["vocab"].values()):] = 0  # (the specials are in the vocab)
    save({"model.embed_tokens.weight": rand(args.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
          "lm_head.weight": head}, "model-embed.safetensors")
    for i in range(args.layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rand(args.heads * d, h),
             p + "self_attn.k_proj.weight": rand(args.kv_heads * d, h),
             p + "self_attn.v_proj.weight": rand(args.kv_heads * d, h),
             p + "self_attn.o_proj.weight": rand(h, args.heads * d),
             p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rand(e, h)}
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            t[q + "gate_proj.weight"] = rand(w, h)
            t[q + "up_proj.weight"] = rand(w, h)
            t[q + "down_proj.weight"] = rand(h, w)
        save(t, f"model-layer{i:03d}.safetensors")
        print(f"layer {i + 1}/{args.layers} written", file=sys.stderr)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def convert(folder: Path, llama_cpp: Path, stem: str = "moe", flags: tuple[str, ...] = ()) -> None:
    """bf16 GGUF with llama.cpp's converter (pre-tokenizer named "qwen2"; `flags` added to its
    command line), then Q4_K_M: `<stem>-bf16.gguf`, `<stem>-Q4_K_M.gguf` in `folder`."""
    bf16, q4 = folder / f"{stem}-bf16.gguf", folder / f"{stem}-Q4_K_M.gguf"
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(llama_cpp)!r})\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outtype', 'bf16', "
        f"'--outfile', {str(bf16)!r}, *{list(flags)!r}]\n"
        "from conversion.base import TextModel\n"
        "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(bf16), str(q4), "Q4_K_M"],
                   check=True)
    print(f"wrote {bf16} ({bf16.stat().st_size / 1e9:.2f} GB) and {q4} ({q4.stat().st_size / 1e9:.2f} GB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the HF folder to write")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--routed", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=151936)
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
        convert(args.out, args.llama_cpp)


if __name__ == "__main__":
    main()
