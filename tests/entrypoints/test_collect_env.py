"""`pagedserve collect-env` and `--require-kernels` on the CLI."""

from __future__ import annotations

import re

from pagedserve.entrypoints.cli import main
from pagedserve.kernels import extension


def test_collect_env_reports_versions_cpu_flags_and_each_extensions_origin(capsys):
    assert main(["collect-env"]) == 0
    out = capsys.readouterr().out
    for title in ("versions", "CPU", "kernels", "threads", "environment", "torch build"):
        assert f"== {title} ==" in out
    for key in ("torch", "transformers", "ISA flags", "prebuilt", "compiler", "ISA path chosen",
                "dtype auto on CPU", "torch threads"):
        assert re.search(rf"^{re.escape(key)} +: \S", out, re.MULTILINE), key
    for ext in extension.all_extensions():
        line = next(li for li in out.splitlines() if li.startswith(ext.prefix + " "))
        origin = ext.origin or "unavailable"
        assert origin in line


def test_require_kernels_is_an_error_naming_the_reason(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(extension.DISABLE_ENV, "1")
    code = main(["generate", "hi", "--model", str(tmp_path / "never-read"), "--require-kernels"])
    err = capsys.readouterr().err
    assert code == 1 and "require_kernels" in err and "disabled by" in err
