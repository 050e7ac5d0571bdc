"""`pagedserve.models.loader`: safetensors reading, strict weight loading, dummy weights, dtypes."""

import json
import os

import pytest
import torch
import transformers

from pagedserve.kernels import cpu_gemm
from pagedserve.models import loader
from pagedserve.models.loader import iter_safetensors, load_model, resolve_dtype
from pagedserve.platforms import cpu as platforms_cpu
from test_gemma3 import tiny_gemma3_text
from test_gpt2 import tiny_gpt2
from test_llama import VOCAB, tiny_llama
from test_qwen2 import tiny_qwen2


def test_iter_safetensors_reads_sharded_checkpoints(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_config(tiny_llama())
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one = dict(iter_safetensors(tmp_path / "one"))
    sharded = dict(iter_safetensors(tmp_path / "sharded"))
    assert one.keys() == sharded.keys() and len(one) > 0
    for name in one:
        assert torch.equal(one[name], sharded[name]), name
    # And the model loads from the shards.
    load_model(hf.config, weights=iter_safetensors(tmp_path / "sharded"), dtype=torch.float32)


def test_iter_safetensors_without_checkpoint(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(FileNotFoundError):
        next(iter_safetensors(tmp_path))


def test_load_weights_is_strict(hf_pair):
    hf, model, _ = hf_pair(tiny_llama())
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        model.load_weights([(n, t) for n, t in state.items() if n != "model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.extra.weight"):
        model.load_weights([*state.items(), ("model.layers.0.self_attn.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    # Untied head: lm_head.weight is required.
    with pytest.raises(ValueError, match="lm_head.weight"):
        model.load_weights([(n, t) for n, t in state.items() if n != "lm_head.weight"])
    # Rotary inv_freq buffers of old checkpoints are ignored.
    model.load_weights([*state.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_tied_head_accepts_lm_head_present_or_absent(hf_pair):
    hf, model, _ = hf_pair(tiny_qwen2())  # tied: save_pretrained omits lm_head.weight
    state = dict(hf.state_dict())
    without = {n: t for n, t in state.items() if n != "lm_head.weight"}
    with_head = {**without, "lm_head.weight": without["model.embed_tokens.weight"]}
    for weights in (without, with_head):
        other = load_model(hf.config, weights=weights.items(), dtype=torch.float32)
        assert other.lm_head.weight is other.model.embed_tokens.weight
        assert torch.equal(other.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize(
    "config",
    [
        tiny_llama(),
        transformers.MistralConfig(**tiny_llama().to_dict() | {"sliding_window": 4}),
        tiny_qwen2(),
        transformers.Qwen3Config(**tiny_qwen2().to_dict() | {"head_dim": 32}),
        tiny_gemma3_text(),
        transformers.OPTConfig(vocab_size=300, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                               num_attention_heads=4, word_embed_proj_dim=32),
        tiny_gpt2(),
    ],
    ids=lambda c: c.model_type,
)
def test_dummy_weights_are_deterministic_and_finite(config, paged_runner):
    dtype_before = torch.get_default_dtype()
    a = load_model(config, weights=None, dtype=torch.float32, seed=0)
    b = load_model(config, weights=None, dtype=torch.float32, seed=0)
    c = load_model(config, weights=None, dtype=torch.float32, seed=1)
    assert torch.get_default_dtype() == dtype_before
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)
    (logits,) = paged_runner(a).step([(0, list(range(1, 10)))])
    assert logits.shape == (9, config.vocab_size) and torch.isfinite(logits).all()


def test_bfloat16_loading_runs_and_tracks_hf_bfloat16(hf_pair, paged_runner, prompts):
    _, _, folder = hf_pair(tiny_llama(), std=0.1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = load_model(hf.config, weights=iter_safetensors(folder), dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ps = prompts(VOCAB)
    for p, logits in zip(ps, paged_runner(model).step(list(enumerate(ps)))):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p])).logits[0].float()
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        # Same bf16 arithmetic as HF (bit-identical on the CPU we tried); allow a little kernel noise.
        assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_eos_token_id_list_in_config(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_config(tiny_llama(eos_token_id=[1, 2], bos_token_id=0))
    hf.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.eos_token_id == [1, 2]
    load_model(config, weights=iter_safetensors(tmp_path), dtype=torch.float32)


def test_load_model_rejects_non_float_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_llama(), weights=None, dtype=torch.int64)


def test_resolve_dtype(monkeypatch):
    config = tiny_llama(dtype="float16")
    assert resolve_dtype("float32", config, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", config, "cpu") == torch.bfloat16
    assert resolve_dtype("float16", config, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", config, "cpu")
    monkeypatch.setattr(platforms_cpu, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", config, "cpu") == torch.bfloat16
    monkeypatch.setattr(platforms_cpu, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm, "kernel_available", lambda: True)  # AVX2: our bf16 kernels
    assert resolve_dtype("auto", config, "cpu") == torch.bfloat16
    monkeypatch.setattr(cpu_gemm, "kernel_available", lambda: False)  # no kernels: bf16 is emulated
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    # On CUDA, auto means the checkpoint's dtype.
    assert resolve_dtype("auto", config, "cuda") == torch.float16
    assert resolve_dtype("auto", tiny_llama(dtype="bfloat16"), torch.device("cuda", 0)) == torch.bfloat16


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux /proc/cpuinfo")
def test_cpu_has_native_bf16_reads_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    expected = ("avx512_bf16" in flags.split() or "amx_bf16" in flags.split()) and (
        torch.backends.cpu.get_cpu_capability() == "AVX512"
    )
    assert platforms_cpu.cpu_has_native_bf16() == expected


def test_building_a_model_skips_torch_random_init_and_restores_it(monkeypatch):
    """Start-up: the constructors' random fills (overwritten by every load) are skipped, and
    torch.nn.init is torch's own again afterwards, also after a failed build."""
    calls = []
    real = torch.nn.init.kaiming_uniform_

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    a = load_model(tiny_llama(), weights=None, dtype=torch.float32, seed=3)
    assert calls == [] and torch.nn.init.kaiming_uniform_ is spy
    b = load_model(tiny_llama(), weights=None, dtype=torch.float32, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name  # every parameter written: uninitialised memory never shows
    torch.nn.Linear(4, 4)
    assert calls == [1]
    with pytest.raises(ValueError):
        load_model(tiny_llama(), weights=[("bogus", torch.zeros(1))], dtype=torch.float32)
    assert torch.nn.init.kaiming_uniform_ is spy and torch.nn.init.normal_ is not loader._keep
