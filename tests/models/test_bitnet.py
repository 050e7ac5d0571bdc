"""Our BitNet b1.58 (Llama with sub-norms before o_proj / down_proj, a relu^2 gated MLP; with
`quant_method: "bitnet"` ternary packed projections and per-token 8-bit activation quantization)
equals HF transformers in float32: the logits within the tolerance (HF's BitLinear for the
ternary one), and the engine's greedy tokens with logprobs by the tie rule (x rounded to 8 bits
could move on the last bit of an activation)."""

import json

import pytest
import safetensors.torch
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.layers.bitlinear import BitLinear, pack_ternary, unpack_ternary
from pagedserve.models.bitnet import BitNetForCausalLM
from pagedserve.models.loader import iter_safetensors, load_model
from utils import assert_tie_rule, hf_greedy, ours_as_pairs

VOCAB = 300
BITNET = {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}


def bitnet_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.BitNetConfig(**kwargs)


def ternary_checkpoint(folder) -> None:
    """Rewrite the HF folder as the released checkpoints store it: each projection's weight
    ternarized by its mean |w| (HF's WeightQuant) and packed 4 to a byte, its `weight_scale`."""
    path = folder / "model.safetensors"
    state = safetensors.torch.load_file(path)
    out = {}
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            scale = 1.0 / w.abs().mean().clamp(min=1e-5)
            out[name] = pack_ternary((w * scale).round().clamp(-1, 1))
            out[name[: -len("weight")] + "weight_scale"] = scale.reshape(1).float()
        else:
            out[name] = w
    safetensors.torch.save_file(out, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": BITNET}))


def test_ternary_packing_round_trips():
    values = torch.randint(-1, 2, (8, 5)).float()
    packed = pack_ternary(values)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 5)
    assert torch.equal(unpack_ternary(packed, torch.float32), values)


def test_bitnet_unquantized_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(bitnet_config())
    assert isinstance(model, BitNetForCausalLM)
    assert model.model.layers[0].self_attn.attn_sub_norm.weight.shape == (64,)
    assert model.model.layers[0].mlp.ffn_sub_norm.weight.shape == (128,)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_bitnet_ternary_matches_hf_by_the_tie_rule(hf_pair, check_hf, prompts, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # (HF's BitLinear: torch.compile'd)
    _, _, folder = hf_pair(bitnet_config())
    ternary_checkpoint(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf.model.layers[0].self_attn.q_proj).__name__ == "BitLinear"
    model = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                       dtype=torch.float32)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, BitLinear) and set(q.weight.unique().tolist()) <= {-1.0, 0.0, 1.0}
    # the logits (prefill, chunks, decode): equal here (a rounded activation could flip on the
    # last bit of x; these prompts have none)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
    # greedy generation with logprobs through the engine, by the tie rule
    llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    for prompt in prompts(VOCAB, lengths=(9, 14), seed=3):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert_tie_rule(ours_as_pairs(out), hf_greedy(hf, prompt, 12), "bitnet ternary")


@pytest.mark.parametrize("setting,value", [("linear_class", "autobitlinear"), ("quantization_mode", "online"),
                                           ("use_rms_norm", True)])
def test_bitnet_refuses_other_quantization_settings(setting, value):
    config = bitnet_config()
    config.quantization_config = {**BITNET, setting: value}
    with pytest.raises(ValueError, match=setting):
        BitNetForCausalLM(config)
