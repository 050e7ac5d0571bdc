"""Tensor parallelism of the older dense families (Phi-2, StableLM, StarCoder 2, GPT-NeoX, OLMo,
Nemotron, Arcee, Apertus, Helium; the blocks of most in layers/residual.py): two ranks (threads, one in-process all-reduce) give one rank's
logits; StableLM's per-head q/k norm rows and GPT-NeoX's regrouped fused q|k|v split by head."""

import pytest
import torch

from test_moe_parallel import _load, _two_rank_logits
from utils import PagedRunner


@pytest.mark.parametrize("family", ["phi", "stablelm", "starcoder2", "gpt_neox", "olmo", "nemotron", "arcee",
                                    "apertus", "helium"])
def test_two_ranks_give_one_ranks_logits(family, checkpoints):
    path = checkpoints(family)
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3]]
    single = _load(path)
    ref = PagedRunner(single).step(list(enumerate(prompts)))
    models, got = _two_rank_logits(path, prompts, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = single.model.layers[0].self_attn
    for rank, model in enumerate(models):
        attn = model.model.layers[0].self_attn
        rows = attn.k_proj.weight.shape[0]  # this rank's KV heads x head_dim
        assert rows * 2 == whole.k_proj.weight.shape[0]
        assert torch.equal(attn.k_proj.weight, whole.k_proj.weight[rows * rank:rows * (rank + 1)])
        if family == "stablelm":  # this rank's heads' rows of the per-head norms
            n = whole.q_norm.weight.shape[0] // 2
            assert torch.equal(attn.q_norm.weight, whole.q_norm.weight[n * rank:n * (rank + 1)])
