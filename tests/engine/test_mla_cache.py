"""Each family's KV cache on its own layer spec (issue 36): DeepSeek's latent attention caches
one latent row per token per layer and no V tensor -- swap, copy-on-write and prefix caching move
only that -- and gpt-oss's sliding and full layers, all with sinks, form two groups."""

from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_spec import FullAttentionSpec, MLASpec, SlidingWindowSpec
from pagedserve.models.registry import get_model_class
from pagedserve.worker.kv_cache import KVCache, bytes_per_block, kv_layout
from test_llm_engine import prompts_of_lengths
from tiny import config_for
from utils import assert_same_outputs, drive

LATENT = 32 + 16  # the tiny DeepSeek V2: kv_lora_rank + qk_rope_head_dim


def _spec(arch: str):
    """The model's KV cache spec, built on the meta device (no weights)."""
    config = config_for(arch)
    with torch.device("meta"):
        return get_model_class(config)(config).kv_cache_spec


def test_deepseek_caches_only_its_latent_no_v_tensor():
    spec = _spec("deepseek_v2")
    assert spec.layer_specs() == (MLASpec(LATENT),) * 2
    f32, bs = 4, 4
    # one latent per token per layer: half of what a K and a V "head" of the latent took
    assert bytes_per_block(spec, bs, torch.float32) == LATENT * bs * f32 * 2
    kv = KVCache(spec, num_blocks=6, block_size=bs, dtype=torch.float32,
                 device=torch.device("cpu"), num_cpu_blocks=3)
    pairs = kv.layers + kv.cpu_layers
    assert all(v is None for _, v in pairs), "an MLA layer's cache has a V tensor"
    held = sum(t.nbytes for pair in kv.slots for t in pair if t is not None)
    assert held == (6 + 1) * bytes_per_block(spec, bs, torch.float32)  # the null block too
    # swap out, clobber, swap in, copy-on-write: the latents come back bit for bit
    for k, _ in kv.slots:
        k[:6].copy_(torch.randn(6, bs, 1, LATENT))
    before = [k.clone() for k, _ in kv.slots]
    kv.swap_out([(1, 0), (4, 2)])
    kv.fill_blocks([1, 4], float("nan"))
    kv.swap_in([(0, 1), (2, 4)])
    kv.copy_blocks([(4, 5)])
    for k0, (k, _) in zip(before, kv.slots):
        assert torch.equal(k[:5], k0[:5]) and torch.equal(k[5], k0[4])


def test_gpt_oss_sliding_and_full_layers_with_sinks_form_two_groups():
    spec = _spec("gpt_oss")  # layer_types [sliding (window 6), full], 2 KV heads of 16
    assert spec.layer_specs() == (SlidingWindowSpec(2, 16, sinks=True, window=6),
                                  FullAttentionSpec(2, 16, sinks=True))
    layout = kv_layout(spec)
    assert [(g.name, g.layers, g.spec.sinks) for g in layout.groups] == [
        ("sliding-6", (0,), True), ("full", (1,), True)]
    assert layout.width == 2 and layout.column_windows() == (6, None)
    one = kv_layout(spec, hybrid=False)  # disable_hybrid_kv_cache_manager: one full group
    assert one.width == 1 and one.groups[0].window is None and one.groups[0].spec.sinks


def test_deepseek_swap_preemption_with_copy_on_write_is_exact(checkpoints):
    """Latent blocks swapped out and in (one tensor a slot, V None), forks sharing a prompt's
    last block copied on write: tokens and logprobs of the three requests run together on a
    tight cache equal those of each run alone on the same engine (no preemption)."""
    path = str(checkpoints("deepseek_v2"))
    prompts = prompts_of_lengths([13, 6, 15], seed=5)
    lp = dict(logprobs=2, ignore_eos=True, max_tokens=8)
    params = [SamplingParams(temperature=0.0, **lp),
              SamplingParams(n=2, temperature=0.8, seed=1, **lp),
              SamplingParams(temperature=0.0, **lp)]
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=9, num_cpu_blocks=64,
              preemption_mode="swap", enable_prefix_caching=False)
    engine, ref = llm.engine, []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"alone{i}", None, p, prompt_token_ids=prompt)
        ref.append(drive(engine, 200)[f"alone{i}"])
    assert engine.scheduler.preemptions_by_mode["swap"] == 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", None, p, prompt_token_ids=prompt)
    final = drive(engine, 200)  # (checks the block tables each step and the pool empty at the end)
    assert engine.scheduler.preemptions_by_mode["swap"] > 0
    assert_same_outputs([final[f"r{i}"] for i in range(3)], ref)
