"""Our Gemma 4 equals HF transformers in float32: (a) the dense 31B-like layout (full layers of
their own head size and KV heads, V = K, proportional RoPE), (b) the 26B-A4B-like MoE layout
(dense MLP + routed experts), (c) the E2B-like layout (per-layer inputs, KV sharing with
double-wide MLPs); the multimodal checkpoint's text path; chunking and batching bit-exact."""

import numpy as np
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


def _write_gguf(hf, config, path):
    """The HF model as llama.cpp's converter writes a "gemma4" file (its keys; its tensor names,
    here from our reader's map turned around: the real converter's run is
    scripts/check_gguf_converter.py)."""
    import gguf

    from pagedserve.models import gguf_gemma4 as g

    names = {v: k for k, v in g._TOP.items()}
    block = {v: k for k, v in g._BLOCK.items()}
    special = {v: k for k, v in g._SPECIAL.items()}
    w = gguf.GGUFWriter(str(path), "gemma4")
    n, types = config.num_hidden_layers, config.layer_types
    full = next(i for i, t in enumerate(types) if t == FULL)
    w.add_block_count(n)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    ff = [config.intermediate_size * (2 if config.use_double_wide_mlp and i >= n - config.num_kv_shared_layers
                                      else 1) for i in range(n)]
    w.add_feed_forward_length(ff if len(set(ff)) > 1 else ff[0])
    w.add_head_count(config.num_attention_heads)
    kv = [config.per_layer_config[i].num_key_value_heads for i in range(n)]
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_key_length(config.per_layer_config[full].head_dim)
    w.add_value_length(config.per_layer_config[full].head_dim)
    w.add_key_length_swa(config.per_layer_config[0].head_dim)
    w.add_value_length_swa(config.per_layer_config[0].head_dim)
    w.add_rope_freq_base(config.rope_parameters[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(config.rope_parameters[SLIDE]["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_sliding_window(config.sliding_window)
    w.add_sliding_window_pattern([t == SLIDE for t in types])
    w.add_shared_kv_layers(config.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    w.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.top_k_experts)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    d = config.per_layer_config[full].head_dim
    rot = int(d * config.rope_parameters[FULL]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rot + [1e30] * (d // 2 - rot), dtype=np.float32))
    state = hf.state_dict()
    state.update({k: v for k, v in hf.named_buffers() if k.endswith("layer_scalar")})
    for name, t in state.items():
        if name == "lm_head.weight":
            continue
        t = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            leaf = rest.removesuffix(".weight")
            if rest.startswith("experts.gate_up_proj") or rest.startswith("experts.down_proj"):
                key = "ffn_gate_up_exps" if "gate_up" in rest else "ffn_down_exps"
                w.add_tensor(f"blk.{i}.{key}.weight", t)
            elif leaf in special:
                key, suffix = special[leaf]
                w.add_tensor(f"blk.{i}.{key}.{suffix}", t.reshape(-1))
            else:
                w.add_tensor(f"blk.{i}.{block[leaf]}.weight", t)
        else:
            w.add_tensor(f"{names[name.removesuffix('.weight')]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("layout", ["dense", "moe", "ple"])
def test_gemma4_gguf_equals_hf(hf_pair, prompts, tmp_path, layout):
    """A "gemma4" GGUF of each layout: config read back (head sizes, V = K, proportional RoPE's
    share, PLE, sharing, experts) and logits equal to HF's."""
    from conftest import check_against_hf
    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
    from pagedserve.models.loader import load_model

    config = tiny_gemma4_text(layout)
    hf, _, _ = hf_pair(config, std=0.15, prepare=_prepare)
    path = tmp_path / "gemma4.gguf"
    _write_gguf(hf, hf.config, path)
    cfg = load_gguf_config(path)
    assert cfg.attention_k_eq_v == config.attention_k_eq_v
    assert cfg.rope_parameters[FULL]["partial_rotary_factor"] == 0.25
    model = load_model(cfg, weights=iter_gguf_weights(path, cfg), dtype=torch.float32)
    check_against_hf(hf, model, prompts(VOCAB, lengths=(13, 5)))
