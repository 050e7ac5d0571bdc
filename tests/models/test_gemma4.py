"""Our Gemma 4 equals HF transformers in float32: (a) the dense 31B-like layout (full layers of
their own head size and KV heads, V = K, proportional RoPE), (b) the 26B-A4B-like MoE layout
(dense MLP + routed experts), (c) the E2B-like layout (per-layer inputs, KV sharing with
double-wide MLPs); the multimodal checkpoint's text path; chunking and batching bit-exact."""

import pytest
import torch
import transformers
from utils import PagedRunner

from pagedserve.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from pagedserve.models.gemma4_layers import kv_page_plan

VOCAB = 512
SLIDE, FULL = "sliding_attention", "full_attention"
ROPE = {SLIDE: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def tiny_gemma4_text(layout: str = "dense", **kw):
    """(a) "dense": sliding 4 KV heads x 32 (a row of 128), full 1 x 64 with V = K (a row of
    64: the sliding layers take two cache entries); (b) "moe": the same attention, experts
    beside the dense MLP; (c) "ple": one KV head of 32 sliding / 64 full (the sliding layers
    repeat theirs), per-layer inputs, the last 2 of 6 layers sharing K/V, double-wide MLPs."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, head_dim=32, global_head_dim=64,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
                layer_types=[SLIDE, SLIDE, FULL, FULL], max_position_embeddings=256,
                rope_parameters=ROPE, final_logit_softcapping=8.0, hidden_size_per_layer_input=0,
                pad_token_id=0)
    if layout == "moe":
        base.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                    num_hidden_layers=3, layer_types=[SLIDE, SLIDE, FULL])
    elif layout == "ple":
        base.update(num_key_value_heads=1, num_global_key_value_heads=None, attention_k_eq_v=False,
                    hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                    num_hidden_layers=6, layer_types=[SLIDE, SLIDE, FULL, SLIDE, SLIDE, FULL],
                    num_kv_shared_layers=2, use_double_wide_mlp=True)
    return transformers.Gemma4TextConfig(**{**base, **kw})


def _prepare(hf):
    """Gemma 4 norms scale by `w` (randomize_ draws Gemma norms around 0): around 1 here, and
    the layer scalars and router scales off 1 so that loading them is checked."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and p.ndim == 1 or name.endswith("router.scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("per_expert_scale"):
                p.copy_(1.0 + 0.3 * torch.rand(p.shape, generator=gen))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.7 + 0.6 * torch.rand(b.shape, generator=gen))


def test_kv_page_plan_fits_the_released_layouts():
    assert kv_page_plan([(16, 256), (4, 512)]) == (2048, [(2, 1), (1, 1)])  # 31B: 2 entries sliding
    assert kv_page_plan([(8, 256), (2, 512)]) == (1024, [(2, 1), (1, 1)])  # 26B-A4B
    assert kv_page_plan([(1, 256), (1, 512)]) == (512, [(1, 2), (1, 1)])  # E2B: one head twice
    assert kv_page_plan([(2, 256), (2, 512)]) == (512, [(1, 1), (2, 1)])  # E4B
    with pytest.raises(ValueError, match="global_head_dim"):
        kv_page_plan([(3, 96), (1, 128)])


def test_gemma4_dense_global_head_dim_and_k_eq_v(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma4_text(), std=0.15, prepare=_prepare)
    assert isinstance(model, Gemma4ForCausalLM)
    layers = model.model.layers
    assert [a.self_attn.v_proj is None for a in layers] == [False, False, True, True]
    assert [a.self_attn.head_dim for a in layers] == [32, 32, 64, 64]
    assert model.model.cache_entries_of == [[0, 1], [2, 3], [4], [5]]  # 128-wide rows: 2 entries
    assert model.kv_cache_spec.head_dim == 64 and len(model.kv_cache_spec.layers) == 6
    assert model.model.rotary_emb[FULL].rope_type == "proportional"
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma4_moe_block(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma4_text("moe"), std=0.15, prepare=_prepare)
    assert model.model.layers[0].experts.gate_proj.shape == (8, 32, 64)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma4_per_layer_inputs_and_kv_sharing(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma4_text("ple"), std=0.15, prepare=_prepare)
    m = model.model
    assert m.modes == [None, None, "store", "store", "reuse", "reuse"]
    assert m.cache_entries_of == [[0], [1], [2], [3], [3], [2]]  # the consumers read their producers'
    assert [layer.self_attn.repeat for layer in m.layers[:3]] == [2, 2, 1]
    assert m.layers[5].mlp.gate_proj.weight.shape[0] == 2 * 96  # double-wide on a shared layer
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma4_conditional_generation_text_path(hf_pair, check_hf, prompts):
    config = transformers.Gemma4Config(
        text_config=tiny_gemma4_text().to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=64),
        audio_config=None,
    )
    hf, model, _ = hf_pair(config, hf_class=transformers.Gemma4ForConditionalGeneration, std=0.15,
                           prepare=_prepare)
    assert isinstance(model, Gemma4ForConditionalGeneration)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


@pytest.mark.parametrize("layout", ["dense", "moe", "ple"])
def test_gemma4_chunking_and_batching_are_bit_exact(hf_pair, prompts, layout):
    _, model, _ = hf_pair(tiny_gemma4_text(layout), std=0.15, prepare=_prepare)
    ps = prompts(VOCAB, lengths=(11, 7))
    alone = [PagedRunner(model).step([(0, p)])[0] for p in ps]
    runner = PagedRunner(model, seed=3)
    first = runner.step([(0, ps[0][:4]), (1, ps[1][:3])])
    rest = runner.step([(0, ps[0][4:]), (1, ps[1][3:])])
    for i in range(2):
        assert torch.equal(torch.cat([first[i], rest[i]]), alone[i])


def test_gemma4_bidirectional_all_is_refused():
    from pagedserve.models.loader import load_model

    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(tiny_gemma4_text(use_bidirectional_attention="all"), weights=None, dtype=torch.float32)
