"""How an extension is found (pagedserve.kernels.extension): the wheel's prebuilt library when it
fits (same sources, same torch), else a JIT build that logs its start and progress, else a WARNING
with the reason and the cost; `require_kernels()` turns the last into an error."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedserve.kernels import build, extension
from pagedserve.kernels.extension import LazyExtension, require_kernels


def _ext(**kw) -> LazyExtension:
    """A fresh (unloaded) extension over the real grammar sources, probe answering 1."""
    return LazyExtension("pagedserve_grammar_kernels", ["grammar_mask.cpp"], [], cflags=[],
                         probe=lambda: 1, describe=lambda code: "scalar", **kw)


@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    """A fake wheel folder: build_info.json written by the test, load_library recorded."""
    monkeypatch.setattr(extension, "PREBUILT_DIR", tmp_path)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))

    def write(torch_version: str, digest: str) -> list:
        (tmp_path / build.BUILD_INFO).write_text(json.dumps({
            "torch": torch_version, "extensions": {
                "pagedserve_grammar_kernels": {"file": "lib.so", "digest": digest}}}))
        return loaded
    return write


def test_a_fitting_prebuilt_library_is_loaded_without_a_build(prebuilt, monkeypatch, tmp_path):
    ext = _ext()
    loaded = prebuilt(torch.__version__, ext.digest())
    monkeypatch.setattr(ext, "_jit", lambda: pytest.fail("JIT build despite a prebuilt library"))
    assert ext.isa() == 1 and ext.origin == "prebuilt"
    assert loaded == [str(tmp_path / "lib.so")] and ext.library == tmp_path / "lib.so"


def test_a_prebuilt_library_for_another_torch_is_refused_with_an_error(prebuilt, caplog):
    ext = _ext()
    loaded = prebuilt("2.0.1+cpu", ext.digest())
    with caplog.at_level(logging.ERROR, logger=extension.logger.name):
        assert ext._load_prebuilt() is False
    assert loaded == []
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    text = record.getMessage()
    assert "compiled against torch 2.0.1+cpu" in text and torch.__version__ in text
    assert "pip install torch==2.0.1" in text and ext.torch_mismatch in text


def test_a_local_version_suffix_is_the_same_torch(prebuilt):
    """2.13.0+cpu and 2.13.0+cu128 builds share the C++ ABI: the library is loaded."""
    ext = _ext()
    loaded = prebuilt(torch.__version__.split("+")[0] + "+cu999", ext.digest())
    assert ext._load_prebuilt() is True and len(loaded) == 1


def test_a_prebuilt_library_from_other_sources_is_not_loaded(prebuilt):
    ext = _ext()
    loaded = prebuilt(torch.__version__, "0" * 40)
    assert ext._load_prebuilt() is False and loaded == []


def test_a_source_checkout_has_no_prebuilt_library(prebuilt):
    assert _ext()._load_prebuilt() is False  # no build_info.json in the folder


def test_a_jit_build_logs_its_start_and_its_progress(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    ext = _ext()
    monkeypatch.setattr(extension, "PREBUILT_DIR", tmp_path / "none")
    monkeypatch.setattr(extension, "PROGRESS_EVERY_S", 0.05)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        (tmp_path / "grammar_mask.o").write_bytes(b"")
        import time
        time.sleep(0.3)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level(logging.INFO, logger=extension.logger.name):
        assert ext.isa() == 1
    text = [r.getMessage() for r in caplog.records]
    assert any("building CPU kernels for this machine, once, ~" in t for t in text)
    assert any("building pagedserve_grammar_kernels: 1/1 sources compiled" in t for t in text)
    assert ext.origin == "jit" and calls[0]["extra_cflags"][:2] == list(build.BASE_CFLAGS)


def test_a_failed_load_warns_once_with_the_reason_and_the_cost(monkeypatch, caplog):
    ext = _ext(fallback_cost="~3x slower decoding")

    def broken():
        raise RuntimeError("no compiler\nthe whole log")

    monkeypatch.setattr(ext, "_build", broken)
    with caplog.at_level(logging.WARNING, logger=extension.logger.name):
        assert ext.isa() == 0 and ext.isa() == 0
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("pagedserve_grammar_kernels unavailable (no compiler); running "
                                   "the torch fallback: ~3x slower decoding")
    assert ext.failure == "no compiler" and ext.origin is None


def test_require_kernels_names_every_extension_that_cannot_load(monkeypatch):
    monkeypatch.setenv(extension.DISABLE_ENV, "1")
    with pytest.raises(build.KernelsUnavailableError) as info:
        require_kernels()
    for ext in extension.all_extensions():
        assert f"{ext.prefix}: disabled by ${extension.DISABLE_ENV}" in str(info.value)


def test_require_kernels_passes_where_they_load(monkeypatch):
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    if any(not e.isa() for e in extension.all_extensions()):
        pytest.skip("the kernels cannot load on this machine")
    require_kernels()
