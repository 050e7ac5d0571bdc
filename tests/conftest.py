"""Session-wide fixtures: the embedded Gemma 3 270M GGUF, and transformers' reading of it.

- `pagedserve_cache_dir` (autouse): every test runs with `$PAGEDSERVE_CACHE_DIR` pointing at one
  temp folder per session, so tests never write to `~/.cache/pagedserve`. Set the variable yourself
  to reuse a cache across sessions (the embedded GGUF and its converted tokenizer then persist).
- `embedded_gguf_path`: the embedded model's GGUF file (assembled on first use, ~1 s).
- `embedded_hf_reference`: transformers' own reading of that file (slow, ~20 s, built once):
  `.config` (the config dict transformers' GGUF loader derives) and `.state_dict` (float32 tensors
  under HF names, exactly what `from_pretrained(gguf_file=..., dtype=float32)` loads; the tied
  `lm_head.weight` is absent).
- `embedded_hf_model`: a `transformers` Gemma3ForCausalLM (float32, eval) holding those weights,
  for comparing logits against (another ~7 s to build).
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Test helpers (`tiny`, `utils`) live at the top of tests/ and are imported by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_GC_HEADROOM = 2 << 30  # collect once the process grew this much since the last collection
_rss_after_gc = [0]


def pytest_runtest_teardown(item, nextitem):
    """A full garbage collection whenever the process grew by `_GC_HEADROOM`: an engine sits
    in reference cycles (its executor, scheduler and observers point at each other), so a
    dropped one waits for the rare generation-2 collection; over the suite's ~2,000 tests those
    engines added up to more than 18 GiB. NOTE: by growth, not after every test: a full
    collection of the suite's heap costs ~0.1 s."""
    rss = _rss_bytes()
    if rss - _rss_after_gc[0] > _GC_HEADROOM:
        gc.collect()
        _rss_after_gc[0] = _rss_bytes()


@pytest.fixture(scope="session", autouse=True)
def pagedserve_cache_dir(tmp_path_factory) -> Path:
    """`$PAGEDSERVE_CACHE_DIR` for the session: the caller's if set, else a fresh temp folder."""
    existing = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if existing:
        yield Path(existing)
        return
    folder = tmp_path_factory.mktemp("pagedserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session")
def embedded_gguf_path(pagedserve_cache_dir) -> Path:
    """Path of the embedded Gemma 3 270M Q4_K_M GGUF."""
    from pagedserve.models.embedded import embedded_model_path

    return embedded_model_path()


@dataclass(frozen=True)
class HFReference:
    config: dict  # the config dict transformers' GGUF loader derives from the metadata
    state_dict: dict[str, torch.Tensor]  # HF name -> float32 tensor, as transformers loads it


@pytest.fixture(scope="session")
def embedded_hf_reference(embedded_gguf_path) -> HFReference:
    """transformers' reading of the embedded GGUF (config dict + float32 state dict)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedserve.models.gguf_loader import load_gguf_config

    # NOTE: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` needs
    # `accelerate`, which pagedserve does not depend on; for gemma3/llama/qwen2/qwen3 it loads the
    # tensors with exactly this call. The model only supplies the HF module tree (parameter names),
    # so an empty one on the meta device does.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_gguf_config(embedded_gguf_path))
    parsed = load_gguf_checkpoint(
        str(embedded_gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    return HFReference(config=dict(parsed["config"]), state_dict=parsed["tensors"])


@pytest.fixture(scope="session")
def embedded_hf_model(embedded_hf_reference):
    """A transformers Gemma3ForCausalLM (float32, eval mode) with the embedded GGUF's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**embedded_hf_reference.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(embedded_hf_reference.state_dict, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF reference model: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("HF reference model: lm_head is not tied to embed_tokens")
    return model.eval()


@pytest.fixture(scope="session")
def embedded_llm(pagedserve_cache_dir):
    """The embedded Gemma 3 270M in pagedserve, float32, loaded once per session."""
    from pagedserve import LLM

    return LLM("gemma-3-270m", dtype="float32", block_size=16, kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Build tiny checkpoints lazily, once per architecture per session."""
    cache = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = tiny.make_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    """HF transformers models of the tiny checkpoints (float32, eval), built once each."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tiny.load_hf(checkpoints(arch))
        return cache[arch]

    return get
