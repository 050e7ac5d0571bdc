"""Our DBRX (bias-free LayerNorm blocks, the fused Wqkv split and clamped to clip_qkv, whole-head
RoPE, softmax top-k experts renormalized or not, the experts' [E * I, H] tensors restacked)
equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.dbrx import DbrxForCausalLM

VOCAB = 300


def dbrx_config(clip_qkv=0.8, normalize=1.0, **overrides):
    kwargs = dict(
        vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=3, max_seq_len=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_config={"kv_n_heads": 2, "clip_qkv": clip_qkv, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                    "moe_normalize_expert_weights": normalize})
    kwargs.update(overrides)
    return transformers.DbrxConfig(**kwargs)


@pytest.mark.parametrize("clip_qkv, normalize", [(0.8, 1.0), (100.0, None)], ids=["clipped-renormalized", "unclipped-unnormalized"])
def test_dbrx_matches_hf(hf_pair, check_hf, prompts, clip_qkv, normalize):
    hf, model, _ = hf_pair(dbrx_config(clip_qkv, normalize))
    assert isinstance(model, DbrxForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FusedMoE) and layer.mlp.routing.renormalize == (normalize is not None)
    assert layer.self_attn.clip_qkv == clip_qkv and layer.self_attn.num_kv_heads == 2
    assert layer.mlp.experts.down_proj.shape == (8, 64, 32)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_dbrx_refuses_other_normalizations():
    with pytest.raises(ValueError, match="moe_normalize_expert_weights"):
        DbrxForCausalLM(dbrx_config(normalize=2.0))


class _GGUFView:
    """The HF config with the flat names `moe_gguf.write_moe_gguf` reads (the converter's keys)."""

    def __init__(self, config):
        self._config = config
        ffn = config.ffn_config
        self.num_local_experts, self.num_experts_per_tok = ffn.moe_num_experts, ffn.moe_top_k
        self.intermediate_size = ffn.ffn_hidden_size

    def __getattr__(self, name):
        return getattr(self._config, name)


def _converter_state(state, config):
    """The experts' `[E * I, H]` tensors as conversion/dbrx.py writes them: `[E, I, H]` (w2
    permuted to `[E, H, I]`), named `....w1.weight`."""
    ffn = config.ffn_config
    out = {}
    for name, t in state.items():
        if ".ffn.experts.mlp." in name:
            t = t.view(ffn.moe_num_experts, ffn.ffn_hidden_size, config.d_model)
            out[name + ".weight"] = t.permute(0, 2, 1) if name.endswith(".w2") else t
        else:
            out[name] = t
    return out


def test_dbrx_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "dbrx" GGUF (the fused attn_qkv, norm_2 as attn_output_norm, the clamp as
    attention.clamp_kqv, the experts permuted by the converter) equals the HF folder."""
    import gguf
    import torch
    from moe_gguf import check_greedy_tie_rule, load_gguf_model, write_moe_gguf

    from pagedserve.models.loader import iter_safetensors

    hf, _, folder = hf_pair(dbrx_config())
    state = _converter_state(dict(iter_safetensors(folder)), hf.config)
    view = _GGUFView(hf.config)
    f32 = write_moe_gguf(tmp_path / "dbrx-f32.gguf", "dbrx", view, state)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, DbrxForCausalLM) and model.model.layers[0].self_attn.clip_qkv == 0.8
    check_hf(hf, model, prompts(VOCAB))
    # NOTE: kept quantized in float32, not bfloat16 as the other families: this tiny random DBRX
    # flips routing choices on bfloat16's rounding alone (HF's own bfloat16 run leaves its float32
    # greedy tokens past the tie rule)
    Q = gguf.GGMLQuantizationType
    q8 = write_moe_gguf(tmp_path / "dbrx-q8.gguf", "dbrx", view, state, types={".experts.": Q.Q8_0, "_proj": Q.F16})
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.float32)
    assert model.model.layers[-1].mlp.experts.gate_proj.dtype == torch.uint8
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "dbrx Q8_0")
