"""`EngineArgs` is the one source of the engine's options: every field is a flag of `generate`,
`serve` and the benchmarks that build an engine (name, type, default, help), each list of
choices is one constant, and values are validated once, in `EngineArgs`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from pagedserve.attention.backends import BACKEND_CHOICES
from pagedserve.config import (
    ATTENTION_BACKENDS,
    EXECUTOR_BACKENDS,
    LOAD_FORMATS,
    EngineArgs,
    option,
)
from pagedserve.core.scheduler import PREEMPTION_MODES
from pagedserve.entrypoints.cli import build_parser, main

ENGINE_COMMANDS = [["generate", "x"], ["serve"], ["bench", "throughput"], ["bench", "preemption"],
                   ["bench", "latency"]]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _engine_parser(command: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = parser
    for name in command[:2] if command[0] == "bench" else command[:1]:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return sub


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_engine_field_is_a_flag_with_its_default_and_help(command):
    parser = _engine_parser(command)
    by_dest = {a.dest: a for a in parser._actions}
    # the benchmarks measure the embedded Gemma unless told otherwise (cli.BENCH_MODEL)
    overridden = {"bench throughput": {"max_num_seqs", "model"}, "bench preemption": {"model"},
                  "bench latency": {"max_num_seqs", "skip_tokenizer_init", "model"}}.get(
                      " ".join(command[:2]), set())
    for f in fields(EngineArgs):
        action = by_dest[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help, f.name
        if f.name not in overridden:
            assert parser.get_default(f.name) == f.default, f.name
    if not overridden:  # no flags given: exactly the Python API's defaults
        assert EngineArgs.from_namespace(_parse(command)) == EngineArgs()


def test_flags_parse_to_the_field_types_and_keep_their_existing_spellings():
    args = _parse(["serve", "--block-size", "8", "--swap-space", "1.5", "-tp", "2",
                   "--distributed-executor-backend", "mp", "--no-enable-prefix-caching",
                   "--enforce-eager", "--skip-tokenizer-init", "--kv-cache-memory", "4096",
                   "--attention-backend", "torch", "--preemption-mode", "swap"])
    built = EngineArgs.from_namespace(args)
    assert (built.block_size, built.swap_space, built.tensor_parallel_size) == (8, 1.5, 2)
    assert built.distributed_executor_backend == "mp" and built.kv_cache_memory == 4096
    assert not built.enable_prefix_caching and built.enforce_eager and built.skip_tokenizer_init
    assert (built.attention_backend, built.preemption_mode) == ("torch", "swap")


def test_a_new_field_becomes_a_flag_without_touching_the_cli():
    @dataclass
    class MoreArgs(EngineArgs):
        quantization: str | None = option(None, "weight format", choices=("gguf", "int8"))
        threads: int = option(2, "threads")

    parser = argparse.ArgumentParser()
    MoreArgs.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "int8", "--threads", "3"])
    assert MoreArgs.from_namespace(args).quantization == "int8" and args.threads == 3
    with pytest.raises(ValueError, match="quantization must be one of"):
        MoreArgs.from_namespace(parser.parse_args(["--quantization", "fp4"]))


@pytest.mark.parametrize("field,bad", [("attention_backend", "flash"), ("preemption_mode", "never"),
                                       ("distributed_executor_backend", "slurm"),
                                       ("load_format", "pickle"), ("dtype", "int4")])
def test_bad_choices_are_one_value_error_naming_the_option_from_the_api_and_the_cli(
        field, bad, capsys):
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        EngineArgs(**{field: bad})
    assert main(["generate", "x", "--" + field.replace("_", "-"), bad]) == 2
    assert f"{field} must be one of" in capsys.readouterr().err


def test_each_list_of_choices_is_one_constant():
    meta = {f.name: f.metadata.get("choices") for f in fields(EngineArgs)}
    assert meta["attention_backend"] is ATTENTION_BACKENDS is BACKEND_CHOICES
    assert meta["preemption_mode"] is PREEMPTION_MODES
    assert meta["distributed_executor_backend"] is EXECUTOR_BACKENDS
    assert meta["load_format"] is LOAD_FORMATS


def test_no_benchmark_allocator_or_test_knob_among_the_public_options(capsys):
    names = set(EngineArgs.field_names())
    assert not names & {"kv_allocator", "shuffle_free_blocks_seed", "use_cpu_kernel"}
    with pytest.raises(SystemExit):
        _parse(["serve", "--kv-allocator", "contiguous-max"])
    capsys.readouterr()


def test_scheduler_config_follows_the_engine_options():
    config = EngineArgs().scheduler_config(max_model_len=4096)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    assert config.enable_chunked_prefill and config.preemption_mode == "auto"
    assert config.prompt_budget_per_decode_row == 32
    assert EngineArgs(prompt_budget_per_decode_row=0).scheduler_config(4096).prompt_budget_per_decode_row == 0
    # Without chunked prefill a whole prompt must fit one step.
    config = EngineArgs(enable_chunked_prefill=False).scheduler_config(max_model_len=4096)
    assert config.max_num_batched_tokens == 4096
    assert EngineArgs(max_num_batched_tokens=64).scheduler_config(128).max_num_batched_tokens == 64
