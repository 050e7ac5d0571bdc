"""Our norms equal transformers' Llama and Gemma3 RMSNorm bit for bit."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.layers.norms import GemmaRMSNorm, RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ours_cls, ref_cls", [(RMSNorm, LlamaRMSNorm), (GemmaRMSNorm, Gemma3RMSNorm)])
def test_rms_norms_match_transformers(ours_cls, ref_cls, dtype):
    torch.manual_seed(0)
    ours, ref = ours_cls(48, eps=1e-5).to(dtype), ref_cls(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        w = torch.randn(48).to(dtype)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = (torch.randn(5, 48) * 3).to(dtype)
    assert torch.equal(ours(x), ref(x))
    assert ours(x).dtype == dtype


def test_gemma_norm_starts_as_identity_scale():
    x = torch.randn(3, 16)
    torch.testing.assert_close(GemmaRMSNorm(16)(x), RMSNorm(16)(x))
