"""Our gpt-oss (attention sinks, alternating sliding windows, clamped-SwiGLU experts with
biases, top-k-softmax router with bias, YaRN) equals HF, from dense and from MXFP4 experts."""

import json

import importlib.util
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from utils import PagedRunner

from pagedserve.layers.mxfp4 import dequantize_hf, hf_to_ggml_rows, pack_hf
from pagedserve.models.gpt_oss import GptOssForCausalLM
from pagedserve.models.loader import iter_safetensors, load_model

# this folder's conftest helpers, by path (the name `conftest` may be another folder's)
_spec = importlib.util.spec_from_file_location("models_conftest_helpers", Path(__file__).with_name("conftest.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
hf_logits = _helpers.hf_logits
randomize_ = _helpers.randomize_

pytest.importorskip("pagedserve.layers.moe")  # NOTE: until the MoE layer is merged

VOCAB = 300


def _config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


def test_gpt_oss_dense_experts(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(_config())
    assert isinstance(model, GptOssForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, None]
    assert layers[0].self_attn.sinks.abs().sum() > 0  # randomized, so they matter
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_mxfp4_layouts_round_trip():
    """HF's packing (value 2j low nibble of byte j) against ggml's (value j with j + 16)."""
    w = torch.randn(3, 5, 64) * torch.logspace(-2, 1, 64)
    blocks, scales = pack_hf(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    values = dequantize_hf(blocks, scales)
    assert (values - w).abs().max() <= w.abs().max() / 4  # within a code's step
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = hf_to_ggml_rows(blocks, scales)  # [3, 5, 34]
    ref = dequantize(rows.reshape(15, 34).numpy(), GGMLQuantizationType.MXFP4).reshape(3, 5, 64)
    assert torch.equal(torch.from_numpy(ref), values)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """(HF model whose experts are the dequantized MXFP4 values, the MXFP4 checkpoint folder)."""
    torch.manual_seed(0)
    config = _config()
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(experts, proj)  # [E, in, out]
                blocks, scales = pack_hf(w.transpose(1, 2))  # [E, out, in / 32, 16]
                w.copy_(dequantize_hf(blocks, scales).transpose(1, 2))
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf.save_pretrained(folder)
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            del tensors[name]
    tensors.update(packed)
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf.eval(), folder


def test_gpt_oss_mxfp4_experts_kept_as_blocks(mxfp4_pair, prompts):
    hf, folder = mxfp4_pair
    model = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                       dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_proj.dtype == torch.uint8 and experts.gate_proj.quant.format.name == "mxfp4"
    assert experts.down_proj.shape == (4, 64, 64 // 32 * 17)
    # The kernel quantizes activations to 8-bit blocks (as llama.cpp: ~0.5% per product, checked
    # in tests/kernels/test_cpu_mxfp4.py); the dequantized experts alone equal HF to 1e-5
    batch = prompts(VOCAB, lengths=(11, 6))
    outs = PagedRunner(model).step(list(enumerate(batch)))
    for out, p in zip(outs, batch):
        ref = hf_logits(hf, p)
        assert (out - ref).abs().max() < 0.05 * ref.abs().max()
        # each side's greedy token in the other's top 5 at every position (the tie rule's test)
        for a, b in zip(out, ref):
            assert int(a.argmax()) in b.topk(5).indices and int(b.argmax()) in a.topk(5).indices
