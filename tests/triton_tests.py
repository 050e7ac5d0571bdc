"""Setup shared by the Triton kernel tests (tests/attention/test_triton_attn.py,
tests/kernels/test_triton_layers.py): on CUDA the kernels are compiled and the tests are `gpu`
tests too (`pytest -m gpu`, scripts/gpu_check.sh); without CUDA they run under Triton's
interpreter with the rest of the suite.

NOTE: import this module before triton (or any module with a @triton.jit kernel): the
interpreter is chosen when triton is first imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_marks() -> list:
    """The calling test module's `pytestmark`; skips the module where triton is missing, or was
    imported before the interpreter could be chosen (its kernels would need a GPU)."""
    pytest.importorskip("triton")
    from pagedserve.attention.backends import triton_attn

    if DEVICE == "cpu" and not triton_attn._interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: the kernels need a GPU",
                    allow_module_level=True)
    return [pytest.mark.gpu] if DEVICE == "cuda" else []
