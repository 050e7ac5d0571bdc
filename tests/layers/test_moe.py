"""The MoE layer's routing rules against HF's routers, operation for operation (float32), and
its experts against a plain per-token loop."""

import pytest
import torch
import transformers

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, MoERouting, expert_param_name, select_experts


def _hidden(t=24, h=32, seed=0):
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed))


def _same_choice(ours, ref_weights, ref_ids):
    """Equal (expert -> weight) sets per token, whatever the order of the k slots."""
    weights, ids = ours
    for t in range(ids.shape[0]):
        a = dict(zip(ids[t].tolist(), weights[t].tolist()))
        b = dict(zip(ref_ids[t].tolist(), ref_weights[t].float().tolist()))
        assert a.keys() == b.keys(), f"token {t}: experts {sorted(a)} != {sorted(b)}"
        for e in a:
            assert a[e] == pytest.approx(b[e], rel=1e-6, abs=1e-7), f"token {t} expert {e}"


@torch.no_grad()
def test_deepseek_v3_noaux_tc_routing_matches_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                        n_group=4, topk_group=2, norm_topk_prob=True,
                                        routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg)
    hf.weight.normal_(0, 0.3)
    hf.e_score_correction_bias.normal_(0, 0.5)  # large enough to change selections
    x = _hidden()
    _, ref_w, ref_ids = hf(x)
    routing = MoERouting.from_config(cfg, scoring="sigmoid", topk_method="noaux_tc")
    assert routing.scoring == "sigmoid" and routing.group_rule == "top2_sum" and routing.correction_bias
    logits = x @ hf.weight.T
    ours = select_experts(logits, routing, hf.e_score_correction_bias)
    _same_choice(ours, ref_w, ref_ids)
    # the bias is for selection only: without it other experts win for some tokens
    plain = select_experts(logits, routing, torch.zeros(16))
    assert not torch.equal(plain[1].sort(-1)[0], ours[1].sort(-1)[0])


@torch.no_grad()
def test_deepseek_v2_group_limited_greedy_matches_hf():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                        n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                        routed_scaling_factor=1.5)
    hf = DeepseekV2TopkRouter(cfg)
    hf.weight.normal_(0, 0.3)
    x = _hidden(seed=1)
    _, ref_w, ref_ids = hf(x)
    routing = MoERouting.from_config(cfg)
    assert routing.group_rule == "max" and routing.num_groups == 4 and not routing.renormalize
    _same_choice(select_experts(x @ hf.weight.T, routing), ref_w, ref_ids)


@torch.no_grad()
def test_gpt_oss_softmax_over_selected_logits_matches_hf():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = transformers.GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=4)
    hf = GptOssTopKRouter(cfg)
    hf.weight.normal_(0, 0.3)
    hf.bias.normal_(0, 0.3)
    x = _hidden(seed=2)
    _, ref_w, ref_ids = hf(x)
    routing = MoERouting(top_k=4, scoring="softmax_topk", router_bias=True)
    _same_choice(select_experts(x @ hf.weight.T + hf.bias, routing), ref_w, ref_ids)


def test_routing_errors_name_the_parameter():
    with pytest.raises(ValueError, match="scoring_func"):
        MoERouting.from_config(transformers.DeepseekV3Config(), scoring="tanh")
    with pytest.raises(ValueError, match="topk_method"):
        MoERouting.from_config(transformers.DeepseekV2Config(topk_method="random"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(8, 8, 4, MoERouting(top_k=5))
    with pytest.raises(ValueError, match="n_group"):
        FusedMoE(8, 8, 6, MoERouting(top_k=2, num_groups=4, topk_groups=2, group_rule="max"))
    with pytest.raises(ValueError, match="num_experts"):
        ExpertPlacement(6, TPContext(rank=0, world_size=4), expert_parallel=True)


@torch.no_grad()
def test_experts_equal_a_per_token_loop_with_bias_and_custom_activation():
    torch.manual_seed(0)

    def clamped_swiglu(gate, up):  # gpt-oss's shape of hook: (gate, up) -> h
        gate = gate.clamp(max=1.0)
        return gate * torch.sigmoid(1.7 * gate) * (up.clamp(-1.0, 1.0) + 1)

    moe = FusedMoE(16, 8, 6, MoERouting(top_k=2, renormalize=True), act=clamped_swiglu,
                   expert_bias=True, shared_intermediate_size=12, shared_gate=True)
    for p in moe.parameters():
        p.normal_(0, 0.5)
    x = torch.randn(9, 16)
    got = moe(x)
    weights, ids = select_experts(x @ moe.gate.weight.T, moe.routing)
    e = moe.experts
    for t in range(9):
        want = torch.zeros(16)
        for j in ids[t].sort()[0].tolist():  # ascending expert order
            w = weights[t][ids[t] == j][0]
            g = x[t] @ e.gate_proj[j].T + e.gate_proj_bias[j]
            u = x[t] @ e.up_proj[j].T + e.up_proj_bias[j]
            want += w * (clamped_swiglu(g, u) @ e.down_proj[j].T + e.down_proj_bias[j])
        sh = moe.shared_expert
        s = (torch.nn.functional.silu(x[t] @ sh.gate_proj.weight.T) * (x[t] @ sh.up_proj.weight.T)) \
            @ sh.down_proj.weight.T
        want += torch.sigmoid(x[t] @ moe.shared_expert_gate.weight[0]) * s
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_expert_names_map_to_stacked_slices_and_ranks():
    one = ExpertPlacement(8)
    assert expert_param_name("model.layers.0.mlp.experts.5.w1.weight", one) == \
        ("model.layers.0.mlp.experts.gate_proj", 5)
    assert expert_param_name("m.experts.2.down_proj.bias", one) == ("m.experts.down_proj_bias", 2)
    assert expert_param_name("model.layers.0.mlp.gate.weight", one) == "model.layers.0.mlp.gate.weight"
    ep = ExpertPlacement(8, TPContext(rank=1, world_size=2), expert_parallel=True)
    assert expert_param_name("m.experts.5.w3.weight", ep) == ("m.experts.up_proj", 1)
    assert expert_param_name("m.experts.2.w3.weight", ep) is None  # rank 0's
    assert expert_param_name("m.experts.gate_proj", ep) == ("m.experts.gate_proj", slice(4, 8))


@torch.no_grad()
def test_a_tokens_output_is_bitwise_independent_of_its_batch():
    """Sigmoid scores over 6 experts and a sigmoid-gated shared expert: shapes torch's CPU
    sigmoid computes partly in vectors, partly scalar -- the kernel's one formula keeps every
    token's bits whatever its batch (alone, reversed, among 36 others)."""
    from pagedserve.kernels import cpu_fp32

    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable")
    torch.manual_seed(0)
    moe = FusedMoE(64, 32, 6, MoERouting(top_k=2, scoring="sigmoid", renormalize=True,
                                         renormalize_eps=1e-20),
                   shared_intermediate_size=48, shared_gate=True)
    for p in moe.parameters():
        p.normal_(0, 0.2)
    x = torch.randn(37, 64)
    full = moe(x)
    assert torch.equal(moe(x.flip(0)).flip(0), full)
    for i in range(37):
        assert torch.equal(moe(x[i : i + 1])[0], full[i]), f"token {i}"
