"""Our Gemma 3n equals HF transformers in float32: AltUp (4 streams, a non-zero active index
too), Laurel, activation sparsity on some layers, per-layer inputs, KV sharing over the last
layers, sliding / full layers, per-layer MLP widths, final softcapping; the multimodal
checkpoint's text path (its image / audio token ids through their embedders); chunking and
batching bit-exact."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from utils import PagedRunner

from pagedserve.models.gemma3n import Gemma3nForCausalLM, Gemma3nForConditionalGeneration, gaussian_std_multiplier
from pagedserve.models.loader import iter_safetensors, load_model

VOCAB, PLE_VOCAB = 512, 480
SLIDE, FULL = "sliding_attention", "full_attention"


def tiny_gemma3n_text(**kw):
    """6 layers (sliding, sliding, full, sliding, sliding, full), the last 2 sharing K/V, 2 KV
    heads of 32, sparsity on the first 3 layers, MLP widths per layer, 4 AltUp streams."""
    base = dict(vocab_size=VOCAB, vocab_size_per_layer_input=PLE_VOCAB, hidden_size=64,
                intermediate_size=[96, 96, 128, 96, 64, 96], num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=5,
                layer_types=[SLIDE, SLIDE, FULL, SLIDE, SLIDE, FULL], max_position_embeddings=256,
                rope_parameters={SLIDE: {"rope_type": "default", "rope_theta": 10000.0},
                                 FULL: {"rope_type": "default", "rope_theta": 1_000_000.0}},
                final_logit_softcapping=8.0, hidden_size_per_layer_input=16, altup_num_inputs=4,
                altup_active_idx=0, laurel_rank=8, num_kv_shared_layers=2,
                activation_sparsity_pattern=[0.95, 0.6, 0.3, 0.0, 0.0, 0.0], pad_token_id=0)
    return transformers.Gemma3nTextConfig(**{**base, **kw})


def _prepare(hf):
    """Gemma 3n norms scale by `w` (randomize_ draws Gemma norms around 0): around 1 here; the
    AltUp output scales around 1 too (0 would drop the per-layer inputs)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and p.ndim == 1 or name.endswith("correct_output_scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def test_std_multiplier_is_hf_icdf_in_float32():
    for s in (0.95, 0.6, 0.3):
        ref = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(s, dtype=torch.float32))
        assert torch.equal(gaussian_std_multiplier(s), ref)
    with pytest.raises(ValueError, match="activation_sparsity_pattern"):
        gaussian_std_multiplier(1.0)


def test_gemma3n_altup_laurel_sparsity_ple_kv_sharing(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma3n_text(), std=0.15, prepare=_prepare)
    assert isinstance(model, Gemma3nForCausalLM)
    m = model.model
    assert m.modes == [None, None, "store", "store", "reuse", "reuse"]
    assert m.cache_entries_of == [[0], [1], [2], [3], [3], [2]]
    assert [layer.mlp.std_multiplier is not None for layer in m.layers] == [True] * 3 + [False] * 3
    assert m.layers[2].mlp.gate_proj.weight.shape[0] == 128
    # ids past the per-layer table (>= 480) are among the prompts: their PLE rows read row 0
    ps = prompts(VOCAB, lengths=(13, 5, 10)) + [[500, 3, 511, 490, 7, 481]]
    check_hf(hf, model, ps)


def test_gemma3n_nonzero_active_stream_and_no_correct_scale(hf_pair, check_hf, prompts):
    config = tiny_gemma3n_text(altup_active_idx=2, altup_num_inputs=3, altup_correct_scale=False,
                               num_kv_shared_layers=0, activation_sparsity_pattern=[0.0] * 5 + [0.8])
    hf, model, _ = hf_pair(config, std=0.15, prepare=_prepare)
    assert model.model.modes == [None] * 6
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def _mm_config(text):
    return transformers.Gemma3nConfig(
        text_config=text.to_dict(),
        vision_config=dict(hidden_size=24, vocab_size=8, vocab_offset=PLE_VOCAB),
        audio_config=dict(hidden_size=20, vocab_size=8, vocab_offset=PLE_VOCAB + 8),
    )


def _mm_reference(hf, embedders, ids):
    """HF's `Gemma3nModel.forward` text path (no timm here for the whole model): the token
    embedders' rows at their ids, then the text model from those embeddings, softcapped."""
    with torch.no_grad():
        t = torch.tensor([ids])
        lm = hf.model
        emb = lm.embed_tokens(t)
        for e in embedders:
            hit = (t >= e.vocab_offset) & (t < e.vocab_offset + e.vocab_size)
            rows = e(input_ids=torch.where(hit, t, e.vocab_offset))
            emb = torch.where(hit.unsqueeze(-1), rows, emb)
        h = lm(inputs_embeds=emb, per_layer_inputs=lm.get_per_layer_inputs(t)).last_hidden_state
        logits = hf.lm_head(h)[0].float()
        cap = hf.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap


def test_gemma3n_conditional_generation_text_path(hf_pair, prompts, tmp_path):
    """The multimodal checkpoint (HF names: `model.language_model.`, towers and embedders
    beside) loads its text decoder; image / audio token ids go through their embedders."""
    text = tiny_gemma3n_text()
    hf, _, folder = hf_pair(text, std=0.15, prepare=_prepare)
    config = _mm_config(text)
    torch.manual_seed(1)
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nMultimodalEmbedder

    embedders = [Gemma3nMultimodalEmbedder(config.vision_config, text).float(),
                 Gemma3nMultimodalEmbedder(config.audio_config, text).float()]
    for e in embedders:
        with torch.no_grad():
            for name, p in e.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.2 * torch.randn(p.shape))
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in load_file(folder / "model.safetensors").items()}
    for name, e in zip(("embed_vision", "embed_audio"), embedders):
        state.update({f"model.{name}.{k}": v.clone() for k, v in e.state_dict().items()})
    state["model.vision_tower.timm_model.conv_stem.weight"] = torch.zeros(2, 2)
    state["model.audio_tower.conformer.0.ffw_layer_start.weight"] = torch.zeros(2, 2)
    mm = tmp_path / "mm"
    mm.mkdir()
    save_file(state, mm / "model.safetensors")
    d = config.to_dict()
    d["architectures"] = ["Gemma3nForConditionalGeneration"]
    (mm / "config.json").write_text(json.dumps(d))
    model = load_model(transformers.AutoConfig.from_pretrained(mm), weights=iter_safetensors(mm), dtype=torch.float32)
    assert isinstance(model, Gemma3nForConditionalGeneration)
    ps = prompts(PLE_VOCAB, lengths=(13, 5)) + [[3, PLE_VOCAB + 1, 9, PLE_VOCAB + 12, PLE_VOCAB + 7, 4]]
    outs = PagedRunner(model).step(list(enumerate(ps)))
    for p, out in zip(ps, outs):
        ref = _mm_reference(hf, embedders, p)
        assert ref.std() > 0.1
        assert (out - ref).abs().max().item() < 1e-3


def test_gemma3n_chunking_and_batching_are_bit_exact(hf_pair, prompts):
    _, model, _ = hf_pair(tiny_gemma3n_text(), std=0.15, prepare=_prepare)
    ps = prompts(VOCAB, lengths=(11, 7))
    alone = [PagedRunner(model).step([(0, p)])[0] for p in ps]
    runner = PagedRunner(model, seed=3)
    first = runner.step([(0, ps[0][:4]), (1, ps[1][:3])])
    rest = runner.step([(0, ps[0][4:]), (1, ps[1][3:])])
    for i in range(2):
        assert torch.equal(torch.cat([first[i], rest[i]]), alone[i])


def test_gemma3n_sparsity_under_tensor_parallelism_is_refused():
    from pagedserve.distributed.tp import TPContext

    with pytest.raises(ValueError, match="activation_sparsity_pattern"):
        Gemma3nForCausalLM(tiny_gemma3n_text(), tp=TPContext(rank=0, world_size=2))
