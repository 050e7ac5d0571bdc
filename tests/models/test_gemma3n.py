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


def _write_gguf(hf, config, path, q8: bool = False):
    """The HF model as llama.cpp's converter writes a "gemma3n" file: its keys (the sparsity as
    float32 icdf, -inf on dense layers), the stream projections stacked, the embeddings padded
    with zero rows to the vocabulary, `.weight` added to `correct_output_scale`; tensor names
    from our reader's map turned around (the real converter's run is
    scripts/check_gguf_converter.py). `q8`: every matrix whose rows split into 32-blocks as
    Q8_0, as the converter's `--outtype q8_0`."""
    import gguf
    import numpy as np

    from pagedserve.models import gguf_gemma3n as g

    top = {v: k for k, v in g._TOP.items()}
    block = {v: k for k, v in g._BLOCK.items()}
    n, types = config.num_hidden_layers, config.layer_types
    w = gguf.GGUFWriter(str(path), "gemma3n")
    w.add_block_count(n)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    ff = list(config.intermediate_size)
    w.add_feed_forward_length(ff if len(set(ff)) > 1 else ff[0])
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(config.rope_parameters[SLIDE]["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_sliding_window(config.sliding_window)
    w.add_final_logit_softcapping(config.final_logit_softcapping)
    w.add_altup_active_idx(config.altup_active_idx)
    w.add_altup_num_inputs(config.altup_num_inputs)
    w.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    w.add_shared_kv_layers(config.num_kv_shared_layers)
    w.add_activation_sparsity_scale([gaussian_std_multiplier(s).item() if s > 0 else float("-inf")
                                     for s in config.activation_sparsity_pattern])
    w.add_sliding_window_pattern([t == SLIDE for t in types])

    def add(name, t):
        if q8 and t.ndim >= 2 and t.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)

    state = {k: v.float().numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for stem, key in g._STACKED.items():
        mats = [state.pop(f"{key}.{k}.weight") for k in range(config.altup_num_inputs - 1)]
        add(f"{stem}.weight", np.stack(mats))
    for name, t in state.items():
        if name in ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight") and t.shape[0] < VOCAB:
            t = np.concatenate([t, np.zeros((VOCAB - t.shape[0], t.shape[1]), np.float32)])
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            add(f"blk.{i}.{block[rest.removesuffix('.weight')]}.weight", t)
        else:
            add(f"{top[name.removesuffix('.weight')]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma3n_gguf_equals_hf_and_q8_0_keeps_blocks(hf_pair, check_hf, prompts, tmp_path):
    """A "gemma3n" GGUF: config read back (streams, Laurel's rank, sparsity from its icdf,
    sharing, MLP widths; the per-layer table padded to the vocabulary), F32 logits equal to
    HF's; Q8_0 kept as blocks (the stacked stream projections split) gives HF's greedy tokens
    by the tie rule."""
    from utils import assert_tie_rule, hf_greedy

    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config

    config = tiny_gemma3n_text()
    hf, _, _ = hf_pair(config, std=0.15, prepare=_prepare)
    path = tmp_path / "gemma3n.gguf"
    _write_gguf(hf, hf.config, path)
    cfg = load_gguf_config(path)
    assert cfg.activation_sparsity_pattern == [0.95, 0.6, 0.3, 0.0, 0.0, 0.0]
    assert (cfg.laurel_rank, cfg.altup_num_inputs, cfg.num_kv_shared_layers) == (8, 4, 2)
    assert list(cfg.intermediate_size) == list(config.intermediate_size)
    assert cfg.vocab_size_per_layer_input == VOCAB  # (padded with zero rows, as the converter)
    model = load_model(cfg, weights=iter_gguf_weights(path, cfg), dtype=torch.float32)
    assert isinstance(model, Gemma3nForCausalLM)
    check_hf(hf, model, prompts(PLE_VOCAB, lengths=(13, 5, 10)))

    q8 = tmp_path / "gemma3n-q8.gguf"
    _write_gguf(hf, hf.config, q8, q8=True)
    model = load_model(cfg, weights=iter_gguf_weights(q8, cfg, keep_quantized=True), dtype=torch.float32,
                       quantization="gguf")
    proj = model.model.altup_projections[2].weight
    assert proj.dtype == torch.uint8 and proj.quant.format.name == "q8_0"
    for i, prompt in enumerate(prompts(PLE_VOCAB, lengths=(9, 6))):
        runner, toks, lps = PagedRunner(model, kv_dtype=torch.float32), [], []  # (its first weight: blocks)
        logits = runner.step([(0, prompt)])[0][-1]
        for _ in range(6):
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            vals, idx = torch.topk(lp, 5)
            toks.append(tok)
            lps.append({**dict(zip(idx.tolist(), vals.tolist())), tok: float(lp[tok])})
            logits = runner.step([(0, [tok])])[0][-1]
        assert_tie_rule((toks, lps), hf_greedy(hf, prompt, 6), f"gemma3n Q8_0 prompt {i}")
