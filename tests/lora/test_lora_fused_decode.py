"""A decode step with adapters runs the fused CPU decode layer (kernels.cpu_decoder_layer with
`lora`, chosen in platforms.cpu_decode) and gives exactly the logits of the unfused layers with
their LoRA hooks, for every model family that may use it; tokens of the base model beside the
adapters keep their base logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from utils import PagedRunner

from pagedserve.kernels import cpu_decoder_layer, cpu_gemm
from pagedserve.kernels.extension import kernels_disabled
from pagedserve.lora.adapter import target_dims
from pagedserve.lora.layers import LoRAStacks, StepMapping, install_hooks
from pagedserve.models.loader import load_model
from pagedserve.platforms import cpu_decode

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              max_position_embeddings=256)
SLOTS, MAX_RANK = 3, 16


def configs():
    yield "llama", transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    yield "qwen2 (qkv bias)", transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=1)
    yield "gemma3 (sandwich norms, window)", transformers.Gemma3TextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])


# slot -> (rank, adapted projections): slot 1 adapts only o / gate, so a step without it leaves
# those groups' A and B out of the fused call
ADAPTERS = {0: (8, ("q_proj", "v_proj", "down_proj", "up_proj")),
            1: (4, ("o_proj", "gate_proj")),
            2: (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))}


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


def _adapted(config):
    torch.manual_seed(0)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    dims = target_dims(config)
    stacks = LoRAStacks(SLOTS, MAX_RANK, dims, torch.bfloat16, torch.device("cpu"))
    install_hooks(model, stacks)
    g = torch.Generator().manual_seed(1)
    for slot, (rank, modules) in ADAPTERS.items():
        for layer in range(config.num_hidden_layers):
            for module in modules:
                d_in, d_out = dims[(layer, module)]
                a = (torch.randn(rank, d_in, generator=g) * d_in ** -0.5).to(torch.bfloat16)
                b = (torch.randn(d_out, rank, generator=g) * 0.2).to(torch.bfloat16)
                stacks.put(slot, (layer, module), a, b)
    return model, stacks


def _run(model, stacks, prompts, seq_slots, steps):
    """Prefill every prompt, then `steps` decode-only steps of all of them (greedy), sequence i
    on adapter slot `seq_slots[i]` (-1: the base model)."""
    runner = PagedRunner(model, seed=3)

    def step(batch):
        stacks.set_mapping(StepMapping.build([seq_slots[i] for i, _ in batch],
                                             [len(t) for _, t in batch], SLOTS, torch.bfloat16,
                                             torch.device("cpu"), bgmv=stacks.bgmv))
        try:
            return [out[-1] for out in runner.step(batch)]
        finally:
            stacks.set_mapping(None)

    last = step(list(enumerate(prompts)))
    logits = []
    for _ in range(steps):
        last = step([(i, [int(lg.argmax())]) for i, lg in enumerate(last)])
        logits.append(torch.stack(last))
    return logits


def _count_fused_calls(monkeypatch) -> list[bool]:
    """Record, per call of the fused layer, whether it ran with adapters (its `lora`)."""
    calls = []
    real = cpu_decoder_layer.decoder_layer

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None and kwargs.get("lora") is not None)
        return out

    monkeypatch.setattr(cpu_decode, "decoder_layer", counting)
    return calls


@pytest.mark.parametrize("seq_slots", [(0, 2, -1, 0), (2, -1, 1, 0)],
                         ids=["slot 1 unused", "every slot"])
@pytest.mark.parametrize("name,config", list(configs()), ids=[n for n, _ in configs()])
def test_fused_decode_layer_with_adapters_equals_the_hooked_modules_bit_for_bit(
        kernel, name, config, seq_slots, monkeypatch):
    model, stacks = _adapted(config)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 3, 11, 5)]
    calls = _count_fused_calls(monkeypatch)
    fused = _run(model, stacks, prompts, seq_slots, steps=6)
    assert calls and all(calls), "the fused layer did not run with the adapters on decode steps"
    assert len(calls) == 6 * config.num_hidden_layers  # decode steps only, never prefill
    monkeypatch.setattr(cpu_decode, "fused_decode_layer", lambda *a: None)
    modules = _run(model, stacks, prompts, seq_slots, steps=6)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"{name}: decode step {step} differs"
    # the adapters do change their sequences, and only theirs
    base = _run(model, stacks, prompts, (-1,) * len(prompts), steps=6)
    for i, slot in enumerate(seq_slots):
        same = all(torch.equal(f[i], b[i]) for f, b in zip(fused, base))
        assert same == (slot < 0), f"{name}: sequence {i} (slot {slot})"
