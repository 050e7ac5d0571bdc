"""Tensor-parallel shards: every rank's parameters are its part of the checkpoint tensors (read
without materialising the rest), the parts tile the whole, KV heads are replicated when there are
fewer than ranks, dummy weights do not depend on the rank count, and models that cannot be split
are refused before any worker starts."""

import pytest
import torch

from pagedserve import LLM
from pagedserve.distributed.tp import TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.weights import copy_into, read_ranges
from pagedserve.models.loader import iter_safetensors, load_model
from pagedserve.models.source import resolve_model
from tiny import config_for

ARCHS = ["llama", "qwen2", "gemma3", "opt", "gpt2", "phi3", "gemma2", "granite", "glm4", "smollm3", "cohere", "ernie4_5",
         "hunyuan_v1_dense", "gemma4", "gemma4_moe"]


def load(path, rank=0, world_size=1, lazy=False):
    config = resolve_model(str(path)).config
    return load_model(config, weights=iter_safetensors(path, lazy=lazy), dtype=torch.float32,
                      tp=TPContext(rank, world_size))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_its_part_of_every_tensor_and_the_parts_tile_it(arch, checkpoints):
    path = checkpoints(arch)
    full = dict(load(path).named_parameters())
    ranks = [dict(load(path, r, 2, lazy=True).named_parameters()) for r in range(2)]
    sharded = 0
    for name, whole in full.items():
        specs = [getattr(shards[name], "shard", None) for shards in ranks]
        if specs[0] is None:  # replicated: every rank holds the whole tensor
            assert all(torch.equal(shards[name], whole) for shards in ranks), name
            continue
        sharded += 1
        covered = sorted(r for spec in specs for r in spec.ranges)
        assert covered[0][0] == 0 and covered[-1][1] == specs[0].full_size, name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), name  # no gap, no overlap
        for shards, spec in zip(ranks, specs):
            mine = shards[name].narrow(spec.dim, 0, spec.size)
            assert torch.equal(mine, read_ranges(whole, spec.dim, spec.ranges)), name
    assert sharded >= 8


def test_fused_qkv_shard_is_the_same_heads_of_q_k_and_v(checkpoints):
    path = checkpoints("gpt2")
    whole = load(path).transformer.h[0].attn.c_attn.weight  # [3h, h]: q | k | v
    part = load(path, 1, 2).transformer.h[0].attn.c_attn.weight  # [3h/2, h]
    h = whole.shape[1]
    expected = torch.cat([whole[i * h + h // 2:(i + 1) * h] for i in range(3)])
    assert torch.equal(part, expected)


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_rank_reads(checkpoints):
    path = checkpoints("gemma3")  # 4 query heads, 1 KV head
    whole = load(path)
    for rank in range(2):
        model = load(path, rank, 2)
        attn, ref = model.model.layers[0].self_attn, whole.model.layers[0].self_attn
        assert model.kv_cache_spec.num_kv_heads == 1 and attn.num_heads == 2
        assert torch.equal(attn.k_proj.weight, ref.k_proj.weight)
        assert torch.equal(attn.q_proj.weight, ref.q_proj.weight[rank * 64:(rank + 1) * 64])


def test_a_rank_reads_only_its_rows_of_the_checkpoint(checkpoints):
    path = checkpoints("llama")
    read = {}

    class Recorder:
        def __init__(self, name, lazy):
            self.name, self.lazy = name, lazy

        def get_shape(self):
            return self.lazy.get_shape()

        def __getitem__(self, index):
            out = self.lazy[index]
            read[self.name] = read.get(self.name, 0) + out.numel()
            return out

    config = resolve_model(str(path)).config
    model = load_model(config, weights=((n, Recorder(n, t)) for n, t in iter_safetensors(path, lazy=True)),
                       dtype=torch.float32, tp=TPContext(1, 2))
    params = dict(model.named_parameters())
    total = sum(t.numel() for _, t in iter_safetensors(path))
    assert read["model.layers.0.self_attn.q_proj.weight"] == params["model.layers.0.self_attn.q_proj.weight"].numel()
    assert read["model.embed_tokens.weight"] == params["model.embed_tokens.weight"].numel()
    assert sum(read.values()) < 0.6 * total


def test_vocab_shards_pad_the_last_rank_with_zero_rows():
    weight = torch.randn(301, 8)  # [V, E]
    last = VocabParallelEmbedding(301, 8, tp=TPContext(1, 2))
    assert last.weight.shape == (151, 8) and (last.vocab_start, last.vocab_stop) == (151, 301)
    last.weight.data.fill_(float("nan"))
    copy_into(last.weight, weight)
    assert torch.equal(last.weight[:150], weight[151:]) and torch.equal(last.weight[150], torch.zeros(8))


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_dummy_weights_are_the_same_model_whatever_the_rank_count(arch):
    config = config_for(arch)
    whole = dict(load_model(config, weights=None, dtype=torch.float32, seed=3).named_parameters())
    for name, param in load_model(config, weights=None, dtype=torch.float32, seed=3,
                                  tp=TPContext(1, 2)).named_parameters():
        spec = getattr(param, "shard", None)
        want = whole[name] if spec is None else read_ranges(whole[name], spec.dim, spec.ranges)
        assert torch.equal(param if spec is None else param.narrow(spec.dim, 0, spec.size), want), name


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "needs 'mp' or 'ray'"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend must be one of"),
])
def test_impossible_tensor_parallel_settings_are_value_errors_before_any_worker(options, message,
                                                                                checkpoints):
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory=1 << 22, **options)


def test_olmo2_shards_unless_a_kv_head_would_be_replicated():
    """Its k norm spans every KV head of a token: the ranks' slices must tile them (2 KV heads
    over 2 ranks), never repeat one (over 4 ranks); refused before any worker starts."""
    from pagedserve.worker.executor import check_shardable

    check_shardable(config_for("olmo2"), 1)
    check_shardable(config_for("olmo2"), 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) divisible by tensor_parallel_size \(4\)"):
        check_shardable(config_for("olmo2"), 4)
