"""Fixtures of the LoRA tests: the tiny Llama checkpoint and PEFT adapters over it (random,
nonzero B), built once per session."""

from __future__ import annotations

import pytest

import tiny


@pytest.fixture(scope="session")
def lora_base(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory):
    """Three adapters of different ranks and targets over the tiny Llama: "r8" (every
    projection), "r16" (rsLoRA; q, v, down), "r4" (o, gate, up)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8": tiny.make_lora_adapter(root / "r8", lora_base, 8, seed=1),
        "r16": tiny.make_lora_adapter(root / "r16", lora_base, 16, seed=2, use_rslora=True,
                                      targets=("q_proj", "v_proj", "down_proj")),
        "r4": tiny.make_lora_adapter(root / "r4", lora_base, 4, seed=3,
                                     targets=("o_proj", "gate_proj", "up_proj")),
    }


@pytest.fixture(scope="session")
def lora_requests(adapters):
    from pagedserve import LoRARequest

    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(sorted(adapters.items()))}
