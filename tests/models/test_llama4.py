"""Our Llama 4 text decoder (RoPE on interleaved pairs with the L2 q/k norm after it, NoPE layers
with the query temperature, sigmoid top-1 experts weighing their input plus a shared expert,
dense layers between) equals HF transformers in float32, alone and as the text decoder of
`Llama4ForConditionalGeneration`; chunked attention is served within one chunk only."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import MoERouting
from pagedserve.models.llama4 import (
    Llama4ForCausalLM, Llama4ForConditionalGeneration, attention_temperature)
from pagedserve.models.loader import iter_safetensors, load_model

VOCAB = 300
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def llama4_text(**overrides):
    """Layers 0..3: RoPE + dense, NoPE + experts, RoPE + experts, NoPE + dense; the temperature
    changes every 4 positions (floor_scale 4), chunks of 32 positions."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_local_experts=8, num_experts_per_tok=1, moe_layers=[1, 2], no_rope_layers=[1, 0, 1, 0],
                  attention_chunk_size=32, max_position_embeddings=128, floor_scale=4, attn_scale=0.5,
                  rope_parameters=LLAMA3_ROPE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Llama4TextConfig(**kwargs)


def vision():
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                pixel_shuffle_ratio=0.5)


def test_llama4_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(llama4_text())
    assert type(model) is Llama4ForCausalLM
    layers = model.model.layers
    assert [layer.self_attn.use_rope for layer in layers] == [True, False, True, False]
    assert [layer.self_attn.l2_norm is not None for layer in layers] == [True, False, True, False]
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True, True, False]
    assert layers[1].mlp.routing == MoERouting(top_k=1, scoring="sigmoid_topk", weight_on_input=True)
    assert layers[1].mlp.shared_expert is not None
    # prompts past position 4 (the temperature differs from 1) within one chunk of 32
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 30)))


def test_llama4_hf_defaults_variant_matches_hf(hf_pair, check_hf, prompts):
    """HF's derived layouts (NoPE every 4th layer, experts every 2nd), no q/k norm (Maverick),
    no temperature tuning, q/k/v/o biases, default RoPE."""
    config = llama4_text(no_rope_layers=None, moe_layers=None, interleave_moe_layer_step=2, use_qk_norm=False,
                         attn_temperature_tuning=False, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf, model, _ = hf_pair(config)
    layers = model.model.layers
    assert [layer.self_attn.use_rope for layer in layers] == [True, True, True, False]
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True, False, True]
    assert all(layer.self_attn.l2_norm is None for layer in layers)
    assert model.model.temperature is None and layers[0].self_attn.o_proj.bias is not None
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 30)))


def test_llama4_conditional_generation_text_decoder_matches_hf(hf_pair, check_hf, prompts):
    """The text decoder under `language_model.`; `vision_model.` and `multi_modal_projector.`
    skipped."""
    config = transformers.Llama4Config(text_config=llama4_text().to_dict(), vision_config=vision(),
                                       image_token_index=VOCAB - 1)
    hf, model, _ = hf_pair(config, hf_class=transformers.Llama4ForConditionalGeneration)
    assert type(model) is Llama4ForConditionalGeneration and not model.tied
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 30)))


def test_attention_temperature_is_hfs_and_exactly_one_below_the_floor_scale():
    pos = torch.tensor([0, 2, 3, 4, 7, 8, 100, 8191, 9000])
    want = torch.log1p(torch.floor((pos.float() + 1.0) / 8)) * 0.1 + 1.0  # HF's expression
    assert torch.equal(attention_temperature(pos, 8, 0.1)[:, 0, 0], want)
    assert torch.equal(attention_temperature(torch.arange(7), 8, 0.1), torch.ones(7, 1, 1))  # p + 1 < 8
    assert attention_temperature(torch.arange(8), 8, 0.1)[7, 0, 0] > 1


def test_llama4_input_weighted_top1_routing_is_hfs_moe_block():
    """Our MoE block equals HF's `Llama4TextMoe` (sigmoid of the top logit scaling the
    expert's input, shared expert added) on random weights: the expert layout split too."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from pagedserve.layers.moe import FusedMoE
    from pagedserve.layers.weights import load_named_weights
    from pagedserve.models.llama4 import split_fused_experts

    config = llama4_text()
    torch.manual_seed(0)
    ref = Llama4TextMoe(config)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ours = FusedMoE(64, 32, 8, MoERouting(top_k=1, scoring="sigmoid_topk", weight_on_input=True),
                    shared_intermediate_size=32)
    names = {"router.weight": "gate.weight"}
    load_named_weights(ours, split_fused_experts((f"x.{k}", v) for k, v in ref.state_dict().items()),
                       rename=lambda n: names.get(n[2:], n[2:]))
    x = torch.randn(40, 64)
    with torch.no_grad():
        want, _ = ref(x)
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - ref.shared_expert(x)).abs().max() > 0.1  # the routed experts matter


def test_llama4_serves_within_one_attention_chunk(hf_pair, monkeypatch):
    """`max_model_len` past attention_chunk_size is a ValueError naming both, from load_model and
    from the engine before it loads the model; the engine defaults to the chunk; a step past the
    chunk is refused."""
    import pagedserve.engine.llm_engine as llm_engine
    from pagedserve import LLM
    from tiny import tokenizer
    from utils import PagedRunner

    _, model, folder = hf_pair(llama4_text())
    tokenizer().save_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"max_model_len \(33\) exceeds Llama 4's attention_chunk_size \(32\)"):
        load_model(config, weights=None, dtype=torch.float32, max_model_len=33)
    load_model(config, weights=None, dtype=torch.float32, max_model_len=32)
    with monkeypatch.context() as m:  # refused before any worker loads the model
        m.setattr(llm_engine, "make_executor", lambda *a, **k: pytest.fail("the model was loaded"))
        with pytest.raises(ValueError, match=r"max_model_len \(64\).*attention_chunk_size \(32\)"):
            LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)
    assert LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22).engine.max_model_len == 32
    with pytest.raises(ValueError, match="attention_chunk_size"):
        PagedRunner(model).step([(0, list(range(33)))])
    # without chunked layers (layer_types all full attention) the position limit alone
    full = llama4_text(layer_types=["full_attention"] * 4)
    assert Llama4ForCausalLM.context_limit(full) is None
    load_model(full, weights=None, dtype=torch.float32, max_model_len=128)


def test_llama4_config_values_we_do_not_implement_are_named():
    with pytest.raises(ValueError, match="num_experts_per_tok 2"):
        load_model(llama4_text(num_experts_per_tok=2), weights=None, dtype=torch.float32)
    config = llama4_text()
    config.layer_types = ["sliding_attention"] * 4  # (HF's config refuses it; a config.json may not)
    with pytest.raises(ValueError, match="layer_types"):
        load_model(config, weights=None, dtype=torch.float32)
    config = llama4_text()
    config.attention_chunk_size = None
    with pytest.raises(ValueError, match="attention_chunk_size"):
        load_model(config, weights=None, dtype=torch.float32)


def test_llama4_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "llama4" GGUF (experts split and transposed as its converter does, Q/K not
    permuted, Scout's Llama 3 RoPE -- low and high frequency factors 1 -- as `rope_freqs`)
    equals the HF folder. The file keeps no NoPE layout, chunk, temperature or q/k norm flag:
    llama.cpp's fixed values (every 4th layer NoPE, 8192, 8192 / 0.1, the norm) are this
    checkpoint's."""
    from moe_gguf import check_gguf_family

    from pagedserve.models.gguf_loader import load_gguf_config

    scout_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    config = llama4_text(no_rope_layers=None, moe_layers=None, interleave_moe_layer_step=2,
                         attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, rope_parameters=scout_rope)
    hf, _, folder = hf_pair(config)
    check_gguf_family("llama4", hf, folder, tmp_path, prompts(VOCAB), check_hf)
    ours = load_gguf_config(tmp_path / "llama4-f32.gguf", cache_dir=tmp_path / "cache")
    assert ours.moe_layers == [1, 3] and ours.no_rope_layers == [1, 1, 1, 0] and ours.use_qk_norm
    assert ours.intermediate_size == 32 and ours.intermediate_size_mlp == 96
    assert ours.rope_parameters["high_freq_factor"] == 1.0 and ours.rope_parameters["factor"] == 16.0


@pytest.mark.parametrize("variant", ["128-experts", "sliding-window-0"])
def test_llama4_gguf_config_follows_llama_cpp_s_fixed_rules(tmp_path, variant):
    """llama.cpp's rules for what the file does not say: 128 experts (Maverick) have no q/k
    norm; `attention.sliding_window` 0 makes every layer full attention with RoPE."""
    from moe_gguf import write_moe_gguf

    from pagedserve.models.gguf_loader import load_gguf_config

    experts = 128 if variant == "128-experts" else 8
    config = llama4_text(num_local_experts=experts, no_rope_layers=None, moe_layers=None,
                         interleave_moe_layer_step=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    state = transformers.Llama4ForCausalLM(config).state_dict()
    extra = (lambda writer: writer.add_sliding_window(0)) if variant == "sliding-window-0" else None
    path = write_moe_gguf(tmp_path / "m.gguf", "llama4", config, state, extra=extra)
    ours = load_gguf_config(path, cache_dir=tmp_path / "cache")
    if variant == "128-experts":
        assert not ours.use_qk_norm and ours.num_local_experts == 128
        assert ours.no_rope_layers == [1, 1, 1, 0] and Llama4ForCausalLM.context_limit(ours) == 8192
    else:
        assert ours.use_qk_norm and ours.no_rope_layers == [1] * 4
        assert ours.layer_types == ["full_attention"] * 4 and Llama4ForCausalLM.context_limit(ours) is None
