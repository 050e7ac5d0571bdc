"""Tiny random HF models, saved and reloaded through our loader, and a paged runner to compare them.

Fixtures:
- `hf_pair(config, ...)`: build the HF model for `config`, re-init its weights large enough that
  logits are not flat, `save_pretrained` (safetensors) to a temp folder, load ours from that folder;
  returns `(hf_model, our_model, folder)`.
- `check_hf(hf_model, model, prompts)`: our logits for every position equal HF's, both for one flat
  prefill batch of all prompts and for a chunked prefill + one-token decode steps run.
- `paged_runner(model)`: a `PagedRunner` (KV caches with shuffled block tables, NaN-filled so that
  reading an unwritten slot poisons the result).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from utils import PagedRunner

from pagedserve.models.loader import iter_safetensors, load_model

TOL = 1e-3


@torch.no_grad()
def randomize_(model: torch.nn.Module, std: float = 0.2, seed: int = 0) -> None:
    """Re-init every parameter: matrices N(0, std), biases N(0, 0.1), norm scales N(1, 0.1)
    (Gemma norms store offsets: N(0, 0.1))."""
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        offset_norm = is_norm and "Gemma" in type(module).__name__
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if is_norm and name == "weight":
                mean, s = (0.0, 0.1) if offset_norm else (1.0, 0.1)
            elif p.ndim == 1:
                mean, s = 0.0, 0.1
            else:
                mean, s = 0.0, std
            p.copy_(torch.randn(p.shape, generator=gen) * s + mean)


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:  # [L, V]
    return hf_model(input_ids=torch.tensor([tokens])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float) -> None:
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = (ours - ref).abs().max().item()
    assert diff < tol, f"{what}: max abs diff {diff:.3g} >= {tol}"


def check_against_hf(hf_model, model, prompts: list[list[int]], tol: float = TOL) -> None:
    refs = [hf_logits(hf_model, p) for p in prompts]
    # The logits must not be flat, or the comparison proves little.
    assert min(r.std().item() for r in refs) > 0.1, "reference logits too flat: raise the init std"

    # 1) One flat prefill batch of all prompts.
    outs = PagedRunner(model).step(list(enumerate(prompts)))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        _assert_close(out, ref, f"prefill prompt {i}", tol)

    # 2) Prefill a part of each prompt; then one mixed step where long remainders get a 4-token
    #    chunk and the others one token; then the rest one token per step, all sequences batched
    #    together (the shorter ones finish early).
    runner = PagedRunner(model, seed=1)
    fed = [0] * len(prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for sizes in ([3] * len(prompts), [4 if len(p) - 3 > 4 else 1 for p in prompts]):
        batch = [(i, p[fed[i] : fed[i] + n]) for (i, p), n in zip(enumerate(prompts), sizes) if fed[i] < len(p)]
        for (i, toks), out in zip(batch, runner.step(batch)):
            got[i].append(out)
            fed[i] += len(toks)
    while True:
        batch = [(i, [p[fed[i]]]) for i, p in enumerate(prompts) if fed[i] < len(p)]
        if not batch:
            break
        for (i, _), out in zip(batch, runner.step(batch)):
            got[i].append(out)
            fed[i] += 1
    for i, ref in enumerate(refs):
        _assert_close(torch.cat(got[i]), ref, f"incremental prompt {i}", tol)


@pytest.fixture
def check_hf():
    return check_against_hf


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture
def prompts():
    """Make prompts: `prompts(vocab_size, lengths=(13, 5, 9))`."""

    def make(vocab_size: int, lengths=(13, 5, 9), seed: int = 0):
        return random_prompts(lengths, vocab_size, seed)

    return make


@pytest.fixture
def hf_pair(tmp_path: Path):
    """`hf_pair(config, std=0.2, edit_config=None, hf_class=AutoModelForCausalLM, dtype=float32)`.

    `edit_config(dict) -> dict` rewrites the saved config.json before both models are loaded back
    from the folder (to test configs written in older styles); `prepare(hf_model)` edits the
    randomized HF model before it is saved (buffers `randomize_` leaves alone)."""

    def build(config, *, std=0.2, edit_config=None, hf_class=None, dtype=torch.float32, seed=0,
              prepare=None):
        hf_class = hf_class or transformers.AutoModelForCausalLM
        torch.manual_seed(seed)
        if hasattr(hf_class, "from_config"):  # an Auto class
            hf_model = hf_class.from_config(config, dtype=torch.float32)
        else:
            hf_model = hf_class(config).float()
        randomize_(hf_model, std=std, seed=seed)
        if prepare is not None:
            prepare(hf_model)
        folder = tmp_path / f"model_{seed}"
        hf_model.save_pretrained(folder)
        assert (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
        if edit_config is not None:
            path = folder / "config.json"
            path.write_text(json.dumps(edit_config(json.loads(path.read_text())), indent=2))
            hf_model = hf_class.from_pretrained(folder, dtype=torch.float32)
        hf_model.eval()
        loaded_config = transformers.AutoConfig.from_pretrained(folder)
        model = load_model(loaded_config, weights=iter_safetensors(folder), dtype=dtype)
        return hf_model, model, folder

    return build

