"""Tensor and expert parallelism for MoE models: each rank holds its part of the experts (every
expert's slice of the intermediate dimension, or with expert parallelism whole experts), and two
ranks give one rank's logits. The ranks run as two threads of this process with an all-reduce
over a barrier (the layers' collectives are only `TPContext.all_reduce` / `gather_to_first`);
`enable_expert_parallel` reaches the workers' model config."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedserve import LLM
from pagedserve.distributed.tp import TPContext
from pagedserve.models.loader import iter_safetensors, load_model
from pagedserve.models.source import resolve_model
import tiny
from utils import PagedRunner


class _Hub:
    """Two threads' collectives: every rank deposits, waits, and reads the same rank-ordered
    sum / concatenation."""

    def __init__(self, world: int):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return parts

    def all_reduce(self, rank, x):
        parts = self._exchange(rank, x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def gather(self, rank, x):
        parts = self._exchange(rank, x.contiguous())
        return torch.cat(parts, dim=-1) if rank == 0 else None


@dataclass(frozen=True)
class ThreadTP(TPContext):
    hub: Any = None

    def all_reduce(self, x):
        return self.hub.all_reduce(self.rank, x)

    def gather_to_first(self, x):
        return self.hub.gather(self.rank, x)


def _load(path, tp=TPContext(), expert_parallel=False):
    config = copy.deepcopy(resolve_model(str(path)).config)
    config.enable_expert_parallel = expert_parallel
    return load_model(config, weights=iter_safetensors(path, lazy=True), dtype=torch.float32, tp=tp)


def _two_rank_logits(path, prompts, expert_parallel):
    hub = _Hub(2)
    models = [_load(path, ThreadTP(r, 2, hub=hub), expert_parallel) for r in range(2)]
    out, errors = {}, []

    def run(rank):
        try:
            out[rank] = PagedRunner(models[rank]).step(list(enumerate(prompts)))
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return models, out[0]


@pytest.mark.parametrize("family,expert_parallel", [("qwen2_moe", False), ("qwen2_moe", True),
                                                    ("olmoe", False), ("mixtral", True),
                                                    ("granitemoe", True), ("glm4_moe", False),
                                                    ("ernie4_5_moe", False), ("lfm2_moe", False),
                                                    ("lfm2_moe", True), ("phimoe", False),
                                                    ("phimoe", True), ("dots1", False), ("llama4", False),
                                                    ("llama4", True), ("minimax_m2", False),
                                                    ("minimax_m2", True), ("qwen3_next", False),
                                                    ("qwen3_next", True), ("qwen3_5_moe", False),
                                                    ("glm4_moe_lite", False), ("glm4_moe_lite", True),
                                                    ("hunyuan_v1_moe", False), ("hunyuan_v1_moe", True)])
def test_two_ranks_give_one_ranks_logits(family, expert_parallel, checkpoints):
    path = checkpoints(family)
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, expert_parallel)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    moe = next(i for i, layer in enumerate(single.model.layers) if hasattr(layer.mlp, "experts"))
    whole = single.model.layers[moe].mlp.experts  # (the first layers of some families are dense)
    for rank, model in enumerate(models):
        experts = model.model.layers[moe].mlp.experts
        if expert_parallel:  # whole experts, this rank's half
            assert experts.gate_proj.shape == (4, *whole.gate_proj.shape[1:])
            assert torch.equal(experts.down_proj, whole.down_proj[4 * rank:4 * rank + 4])
        else:  # every expert, this rank's half of the intermediate dimension
            inter = whole.gate_proj.shape[1] // 2
            assert torch.equal(experts.up_proj, whole.up_proj[:, inter * rank:inter * (rank + 1)])
            assert torch.equal(experts.down_proj, whole.down_proj[:, :, inter * rank:inter * (rank + 1)])


def test_two_ranks_give_one_ranks_logits_with_short_convolutions(checkpoints):
    """LFM2: each rank holds half of the conv channels (of B, C, x and the depthwise kernel) and
    keeps only those in its state rows; out_proj sums the halves."""
    path = checkpoints("lfm2")
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = single.model.layers[0].conv.conv.weight
    for rank, model in enumerate(models):
        half = model.model.layers[0].conv.conv.weight
        assert torch.equal(half, whole[32 * rank:32 * (rank + 1)])


def test_two_ranks_give_one_ranks_logits_with_gated_delta_net_layers(checkpoints):
    """Qwen3.5: each rank holds half of the DeltaNet's key heads and their value heads (rows of
    the projections, channels of q, k and v in the conv, `A_log` / `dt_bias`) and keeps only
    those in its state; out_proj sums the halves."""
    path = checkpoints("qwen3_5")
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = single.model.layers[0].linear_attn
    for rank, model in enumerate(models):
        half = model.model.layers[0].linear_attn
        # channels [q | k | v] of 16, 16, 32: this rank's 8, 8 and 16 of each
        rows = torch.cat([torch.arange(8) + 8 * rank, 16 + torch.arange(8) + 8 * rank,
                          32 + torch.arange(16) + 16 * rank])
        assert torch.equal(half.conv1d.weight, whole.conv1d.weight[rows])
        assert torch.equal(half.A_log, whole.A_log[2 * rank:2 * rank + 2])
        assert half.state.numel * 2 == whole.state.numel


def _mamba_hybrid_checkpoint(path, family: str, groups: int = 2):
    """A tiny Bamba / Nemotron-H / Falcon-H1 (Mamba heads 4 of 16, `groups` groups of 8 states)
    saved to `path`, the rest of its weights random."""
    import transformers as tf

    common = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "bamba":
        cfg = tf.BambaConfig(**common, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4,
                             mamba_d_head=16, mamba_expand=1, mamba_d_state=8, mamba_n_groups=groups)
    elif family.startswith("nemotron_h"):  # "nemotron_h_moe": relu2 experts in a latent space
        blocks = ["linear_attention", "moe" if family.endswith("moe") else "mlp", "full_attention"]
        cfg = tf.NemotronHConfig(**common, head_dim=16, layers_block_type=blocks, mamba_num_heads=4,
                                 mamba_head_dim=16, ssm_state_size=8, n_groups=groups, n_routed_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                 moe_shared_expert_intermediate_size=48, moe_latent_size=32)
    else:
        cfg = tf.FalconH1Config(**common, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4,
                                mamba_d_state=8, mamba_n_groups=groups, mamba_rms_norm=True,
                                ssm_multipliers=[0.9, 1.2, 0.7, 1.4, 0.5], key_multiplier=0.6)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.15 if p.dim() >= 2 else 0.1)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("family,expert_parallel,groups", [
    ("granitemoehybrid", False, 2), ("granitemoehybrid", False, 1), ("bamba", False, 2), ("bamba", False, 1),
    ("nemotron_h", False, 2), ("nemotron_h_moe", False, 2), ("nemotron_h_moe", True, 2), ("falcon_h1", False, 2),
    ("falcon_h1", False, 1)])
def test_two_ranks_give_one_ranks_logits_with_mamba2(tmp_path, family, expert_parallel, groups):
    """Mamba2 hybrids: each rank holds half of the Mamba heads and whole groups (their x, B and C
    conv channels, dt / A / D, gated-norm groups) and keeps only those in its state; out_proj
    sums the halves. With one group both ranks hold it, and its gated norm sums its squares
    over both."""
    if family == "granitemoehybrid":
        path = tiny.make_checkpoint(tmp_path, family, mamba_n_groups=groups)
    else:
        path = _mamba_hybrid_checkpoint(tmp_path, family, groups)
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, expert_parallel)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = single.model.layers[0].mamba
    for rank, model in enumerate(models):
        half = model.model.layers[0].mamba
        assert torch.equal(half.A_log, whole.A_log[2 * rank:2 * (rank + 1)])
        # conv channels x (64), B (groups of 8), C: this rank's x half, then its group of B
        g = rank if groups == 2 else 0
        assert torch.equal(half.conv1d.weight[32:40], whole.conv1d.weight[64 + 8 * g:64 + 8 * (g + 1)])
        if family == "nemotron_h_moe":  # whole experts (4 of 8), or each expert's half
            experts = model.model.layers[1].mlp.experts.up_proj
            assert experts.shape[:2] == ((4, 32) if expert_parallel else (8, 16))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_one_ranks_logits_with_jamba(checkpoints, expert_parallel):
    """Jamba: each rank holds half of the Mamba 1 channels (x, z, conv, dt_proj's rows, A_log,
    D, the state); x_proj and out_proj sum their halves; the MoE layers split as any."""
    path = checkpoints("jamba")
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, expert_parallel)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = single.model.layers[0].mamba
    for rank, model in enumerate(models):
        half = model.model.layers[0].mamba
        n = whole.inter // 2
        assert torch.equal(half.A_log, whole.A_log[n * rank:n * (rank + 1)])
        assert torch.equal(half.dt_proj.bias, whole.dt_proj.bias[n * rank:n * (rank + 1)])


@pytest.mark.parametrize("family", ["olmo2"])
def test_two_ranks_give_one_ranks_logits_with_whole_projection_qk_norms(family, checkpoints):
    """OLMo 2's q/k norms span every head of a token: each rank normalizes its heads' slice by
    the mean of squares over both ranks' slices."""
    path = checkpoints(family)
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    ref = PagedRunner(_load(path)).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    q_norm = models[1].model.layers[0].self_attn.q_norm
    assert q_norm.weight.shape[0] * 2 == q_norm.full_size  # its half of the heads


def test_enable_expert_parallel_reaches_the_workers_model_config(checkpoints, monkeypatch):
    """The engine flag travels in the workers' config (their models read it); the engine's own
    config is left as it was. (The numerics: the threaded test above. An end-to-end mp run of
    qwen3_moe with TP=2 + expert parallelism gave the single process's tokens, ~23 s: not here.)"""
    import pagedserve.worker.mp_executor as mp_executor

    seen = []

    class Stop(Exception):
        pass

    def fake(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(mp_executor, "MultiprocExecutor", fake)
    path = str(checkpoints("qwen3_moe"))
    for flag in (True, False):
        with pytest.raises(Stop):
            LLM(path, tensor_parallel_size=2, enable_expert_parallel=flag, dtype="float32",
                kv_cache_memory=1 << 22)
    assert [getattr(c.source.config, "enable_expert_parallel", False) for c in seen] == [True, False]


def test_experts_that_do_not_split_are_refused_naming_the_option(checkpoints):
    config = copy.deepcopy(resolve_model(str(checkpoints("mixtral"))).config)
    config.enable_expert_parallel = True
    from pagedserve.models.mixtral import MixtralForCausalLM

    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible by tensor_parallel_size \(3\)"):
        with torch.device("meta"):
            MixtralForCausalLM(config, tp=TPContext(0, 3))


@pytest.mark.parametrize("family,expert_parallel", [("gemma4", False), ("gemma4_e", False),
                                                    ("gemma4_moe", False), ("gemma4_moe", True)])
def test_gemma4_two_ranks_give_one_ranks_logits(family, expert_parallel, checkpoints):
    """Gemma 4 under TP=2: each rank the half of its sliding layers' KV heads (one cache entry
    instead of two), the full layers' one KV head replicated, the experts (beside the dense MLP)
    halved or split whole; PLE projections replicated."""
    path = checkpoints(family)
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    ref = PagedRunner(_load(path)).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, expert_parallel)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if family == "gemma4":  # the sliding layers: two entries on one rank, one on each of two
        assert _load(path).model.cache_entries_of == [[0, 1], [2], [3, 4], [5]]
        assert models[0].model.cache_entries_of == [[0], [1], [2], [3]]
