"""Our DeepSeek V2 / V3 (multi-head latent attention over a paged latent cache, grouped top-k
MoE with shared experts) equals HF."""

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedserve.models.loader import iter_safetensors, load_model

# this folder's conftest helpers, by path (the name `conftest` may be another folder's)
_spec = importlib.util.spec_from_file_location("models_conftest_helpers", Path(__file__).with_name("conftest.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
randomize_ = _helpers.randomize_

VOCAB = 300
# NOTE: until the MoE layer (layers/moe.py) is merged, only the dense (MLA alone) tests run
needs_moe = pytest.mark.skipif(importlib.util.find_spec("pagedserve.layers.moe") is None,
                               reason="layers/moe.py not merged yet")


def _mla(**over):
    """A tiny MLA shape: latent 48 + rope 16 = one 64-wide cache row per token."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=48, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
                tie_word_embeddings=False, n_routed_experts=8, moe_intermediate_size=16,
                num_experts_per_tok=2, n_shared_experts=1)
    base.update(over)
    return base


def test_deepseek_v2_lite_dense_mla(hf_pair, check_hf, prompts):
    """V2-Lite's attention (no q_lora_rank), every layer dense: MLA alone."""
    config = transformers.DeepseekV2Config(**_mla(q_lora_rank=None, first_k_dense_replace=2))
    hf, model, _ = hf_pair(config)
    assert isinstance(model, DeepseekV2ForCausalLM)
    assert (model.kv_cache_spec.num_kv_heads, model.kv_cache_spec.head_dim) == (1, 64)
    check_hf(hf, model, prompts(VOCAB))


@needs_moe
def test_deepseek_v2_group_limited_moe(hf_pair, check_hf, prompts):
    """V2: a dense first layer, then softmax routing limited to the best group, a shared expert,
    routed_scaling_factor."""
    config = transformers.DeepseekV2Config(**_mla(
        q_lora_rank=None, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5))
    hf, model, _ = hf_pair(config)
    assert type(model.model.layers[1].mlp).__name__ == "FusedMoE"
    assert model.model.layers[1].mlp.routing.group_rule == "max"
    check_hf(hf, model, prompts(VOCAB))


@needs_moe
def test_deepseek_v3_noaux_tc_moe_q_lora_yarn(tmp_path, check_hf, prompts):
    """V3: q_lora_rank, YaRN (mscale / mscale_all_dim: the softmax scale and the rope's attention
    factor), sigmoid routing with the correction bias over groups, renormalised and scaled."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 1.0}
    config = transformers.DeepseekV3Config(**_mla(
        q_lora_rank=32, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters=rope))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf)
    with torch.no_grad():  # a buffer randomize_ leaves at zero: large enough to change choices
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    hf.save_pretrained(tmp_path)
    hf.eval()
    model = load_model(transformers.AutoConfig.from_pretrained(tmp_path),
                       weights=iter_safetensors(tmp_path), dtype=torch.float32)
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert model.model.layers[0].self_attn.scale != (16 + 16) ** -0.5  # the mscale applies
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    check_hf(hf, model, prompts(VOCAB))


def test_deepseek_v3_dense_rotate_half_rope(hf_pair, check_hf, prompts):
    """V3 with `rope_interleave` off (the rotate-half layout) and q_lora_rank, every layer dense."""
    config = transformers.DeepseekV3Config(**_mla(q_lora_rank=32, first_k_dense_replace=2,
                                                  n_group=4, topk_group=2, rope_interleave=False))
    hf, model, _ = hf_pair(config)
    assert isinstance(model, DeepseekV3ForCausalLM) and not model.model.layers[0].self_attn.rope_interleave
    check_hf(hf, model, prompts(VOCAB, lengths=(11, 5)))


def test_v2_lite_latent_width_bf16_runs_on_the_attention_kernels(hf_pair, monkeypatch):
    """V2-Lite's real latent width (512 + a 64-wide rope key = one 576-wide cache row) and 16
    query heads on the one latent "head": bf16 prompts and decode steps run on the compiled
    attention kernels (never the torch per-row loop), and their logits track the float32
    model's within bf16 rounding."""
    from utils import PagedRunner

    from pagedserve.attention.backends import torch_ref
    from pagedserve.kernels.cpu_gemm import kernel_available

    if not kernel_available():
        pytest.skip("compiled CPU kernels unavailable")
    config = transformers.DeepseekV2Config(**_mla(
        q_lora_rank=None, first_k_dense_replace=2, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32))
    _, model32, folder = hf_pair(config, std=0.05)
    model16 = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                         dtype=torch.bfloat16)
    assert model16.kv_cache_spec.head_dim == 576

    def steps(model):
        runner = PagedRunner(model)
        outs = [runner.step([(0, [1, 17, 250, 3, 99, 42, 7]), (1, [5, 8])])]
        for tok in (11, 12, 13):
            outs.append(runner.step([(0, [tok]), (1, [tok + 100])]))
        return [torch.cat([o[-1:].float() for o in out]) for out in outs]  # last position's logits

    ref = steps(model32)

    def no_torch_loop(*args, **kwargs):
        raise AssertionError("the torch per-row attention ran")

    monkeypatch.setattr(torch_ref, "_attend_decode_rows", no_torch_loop)
    got = steps(model16)
    for step, (a, b) in enumerate(zip(got, ref)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() < 0.05 * scale, f"step {step}"


def test_mla_heads_in_one_call_equal_the_loop_over_heads(hf_pair, monkeypatch):
    """bf16 MLA: the absorbed per-head products in one compiled call (`ops.linear_heads`) give
    exactly the logits of the per-head loop, in prompts and decode steps."""
    from utils import PagedRunner

    from pagedserve.kernels.cpu_gemm import kernel_available
    from pagedserve.platforms.cpu import CpuOps

    if not kernel_available():
        pytest.skip("compiled CPU kernels unavailable")
    config = transformers.DeepseekV2Config(**_mla(q_lora_rank=None, first_k_dense_replace=2))
    _, _, folder = hf_pair(config, std=0.05)
    model = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                       dtype=torch.bfloat16)

    def steps():
        runner = PagedRunner(model)
        outs = [runner.step([(0, [1, 17, 250, 3, 99, 42, 7]), (1, [5, 8])])]
        for tok in (11, 12, 13):
            outs.append(runner.step([(0, [tok]), (1, [tok + 100])]))
        return [torch.cat(out) for out in outs]

    calls = []
    real = CpuOps.linear_heads
    monkeypatch.setattr(CpuOps, "linear_heads", lambda self, x, w: calls.append(1) or real(self, x, w))
    fused = steps()
    assert calls
    monkeypatch.setattr(CpuOps, "linear_heads", lambda self, x, w: None)
    for step, (a, b) in enumerate(zip(fused, steps())):
        assert torch.equal(a, b), f"step {step}"
