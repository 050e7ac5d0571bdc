"""Check llama.cpp's real converter output for DeepSeek V2 (MLA), gpt-oss, Granite MoE Shared,
GLM-4.5 MoE, ERNIE 4.5 MoE, Phi-3.5-MoE, Llama 4 and MiniMax-M2 against HF.

Builds the tests' tiny random checkpoints (tests/tiny.py; gpt-oss also with MXFP4 experts as
OpenAI ships them), converts each with the llama.cpp tree's convert_hf_to_gguf.py (f32, q8_0; the
tiny BPE tokenizer's pre-tokenizer named "gpt-2", which the converter cannot recognise by hash),
loads every GGUF with pagedserve (`LLM(path.gguf)`, float32) and compares greedy tokens with HF
transformers on the source checkpoint by vLLM's tie rule (tests/utils.py). Needs a llama.cpp
tree (../shared/tools/build-llama-server.sh); CI does not run it.

    python scripts/check_llama_cpp_gguf.py --llama-cpp /work/llama.cpp [--out /tmp/gguf-check] \
        [--archs deepseek_v2 gpt_oss granitemoe glm4_moe ernie4_5_moe lfm2_moe phimoe llama4 minimax_m2]

Phi-3.5-MoE: the converter registers Microsoft's architecture name, `PhiMoEForCausalLM` (its
checkpoints' config.json), so the folder converted says that (transformers saves
`PhimoeForCausalLM`); it is served within the original context (`max_model_len` 64: LongRoPE's
short side, HF's choice for such short sequences). Its q8_0 file is compared with HF on the
weights Q8_0 rounds them to (`q8_0_reference`): sparsemixer weighs each of its two experts ~1,
so Q8_0's noise alone, flipping a near-tied second expert, moves the tiny model's tokens (HF's
own greedy tokens change with those weights).

Llama 4: llama.cpp's file keeps neither the NoPE layout, the attention chunk, the temperature's
floor scale / scale nor the MoE layer list (its fixed values, models/gguf_config.py): the tiny
checkpoint is built with those (`LLAMA4_AS_LLAMA_CPP`: every 4th layer NoPE, experts every 2nd,
chunks and floor scale 8192, scale 0.1, Scout's Llama 3 RoPE whose `rope_freqs` we read back).

MiniMax-M2: the converter reads the rotated part from config.json's `rotary_dim` (MiniMax's
released field; transformers saves `partial_rotary_factor` in `rope_parameters` instead) and the
gating from `scoring_func`: the folder converted says both, as MiniMax's config.json does. Its
q8_0 file is compared with HF on the Q8_0-rounded weights, as Phi-3.5-MoE's: the choice of 2 of
8 experts by sigmoid scores plus the selection bias has near ties that Q8_0's noise flips, and
its products over the blocks take x as it is (`gguf_activations="dtype"`): the default 8-bit x
(llama.cpp's) is noise of its own that the Q8_0-rounded HF model does not have.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree + "/gguf-py", tree]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # the tiny test tokenizer
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2  # (GLM's wants its special tokens)
import conversion.ernie as ernie
ernie.Ernie4_5Model.set_vocab = base.TextModel._set_vocab_gpt2  # (ERNIE's reads a SentencePiece model)
import conversion.phi as phi
phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2  # (Phi-3's too, unless GPT2Tokenizer)
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """`src` (a gpt-oss HF folder) with its experts as MXFP4 `_blocks` / `_scales` (and HF's
    reference folder beside it, experts replaced by the dequantized values): returns the
    reference folder."""
    import safetensors.torch
    import torch

    from pagedserve.layers.mxfp4 import dequantize_hf, pack_hf

    tensors = safetensors.torch.load_file(src / "model.safetensors")
    packed, ref = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_hf(w.transpose(1, 2))
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            ref[name] = dequantize_hf(blocks, scales).transpose(1, 2).contiguous()
    ref_dir = dst.with_name(dst.name + "-ref")
    for folder, state in ((dst, packed), (ref_dir, ref)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        safetensors.torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref_dir


# Llama 4 as llama.cpp reads it (see the module docstring)
LLAMA4_AS_LLAMA_CPP = dict(
    moe_layers=[1, 3], interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
    layer_types=["chunked_attention"] * 3 + ["full_attention"], attention_chunk_size=8192, floor_scale=8192,
    attn_scale=0.1, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192})


def q8_0_reference(hf):
    """`hf` with every 2-D weight but the routers' (Llama 4's `router`, MiniMax-M2's `mlp.gate`:
    the converter keeps ffn_gate_inp in F32) rounded as the converter's q8_0 stores it."""
    import gguf
    import torch

    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, w in hf.named_parameters():
            if w.dim() >= 2 and ".router." not in name and not name.endswith(".mlp.gate.weight"):
                rows = w.reshape(-1, w.shape[-1]).numpy()
                w.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, q8), q8)).reshape(w.shape))
    return hf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--out", default=None, help="work folder (default: a temp folder)")
    archs = ["deepseek_v2", "gpt_oss", "granitemoe", "glm4_moe", "ernie4_5_moe", "lfm2_moe", "phimoe", "llama4",
             "minimax_m2"]
    parser.add_argument("--archs", nargs="*", default=archs, choices=archs)
    args = parser.parse_args()
    import tiny
    import torch
    from utils import assert_tie_rule, hf_greedy, ours_as_pairs

    from pagedserve import LLM, SamplingParams

    out = Path(args.out or tempfile.mkdtemp(prefix="gguf-check-"))
    prompts = [[1, 17, 200, 33, 5, 90, 41], [1, 300, 2, 7, 77, 150, 9, 11, 12, 13, 400]]
    cases = []  # (name, HF reference folder, folder to convert, outtype)
    for arch in args.archs:
        src = tiny.make_checkpoint(out / arch, arch, **(LLAMA4_AS_LLAMA_CPP if arch == "llama4" else {}))
        if arch == "phimoe":  # (see the module docstring)
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["PhiMoEForCausalLM"]}))
        if arch == "minimax_m2":  # (see the module docstring)
            cfg = json.loads((src / "config.json").read_text())
            rotary = int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"])
            (src / "config.json").write_text(json.dumps({**cfg, "rotary_dim": rotary, "scoring_func": "sigmoid"}))
        cases += [(f"{arch}-{t}", src, src, t) for t in ("f32", "q8_0")]
    if "gpt_oss" in args.archs:
        ref = mxfp4_checkpoint(out / "gpt_oss", out / "gpt_oss-mxfp4")
        cases.append(("gpt_oss-mxfp4", ref, out / "gpt_oss-mxfp4", "f32"))
    failures = 0
    for name, ref_dir, folder, outtype in cases:
        gguf_path = out / f"{name}.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, args.llama_cpp, str(folder), "--outfile",
                        str(gguf_path), "--outtype", outtype], check=True, capture_output=True)
        hf = tiny.load_hf(ref_dir)
        if name in ("phimoe-q8_0", "minimax_m2-q8_0"):  # (see the module docstring)
            hf = q8_0_reference(hf)
        engine = {"max_model_len": 64} if name.startswith("phimoe") else {}
        if name == "minimax_m2-q8_0":  # (see the module docstring)
            engine["gguf_activations"] = "dtype"
        llm = LLM(str(gguf_path), dtype="float32", **engine)  # its config and tokenizer from the GGUF
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            try:
                assert_tie_rule(ours_as_pairs(o.outputs[0]), hf_greedy(hf, p, 12), name)
            except AssertionError as e:
                failures += 1
                print(f"FAIL {name}: {e}")
        print(f"{name}: checked ({gguf_path.stat().st_size} bytes)")
        del llm, hf
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print("all equal by the tie rule" if not failures else f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
