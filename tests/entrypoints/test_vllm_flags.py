"""Every vLLM 0.32 `serve` flag is handled (entrypoints/vllm_flags.py): supported by a flag of
ours, accepted with one INFO line, or refused naming what is missing -- never argparse's
"unrecognized arguments"; `--help=all` / `--help=GROUP`, `--version` and `--config`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from pagedserve.entrypoints.cli import build_parser, main
from pagedserve.entrypoints.vllm_flags import (
    IGNORED,
    REFUSED,
    SUPPORTED,
    VLLM_FLAGS,
    check_vllm_flags,
    config_file_args,
)

SNAPSHOT = Path(__file__).parent / "data" / "vllm_0_32_serve_flags.txt"


def _vllm_flags() -> list[tuple[str, list[str], str]]:
    rows = []
    for line in SNAPSHOT.read_text().splitlines():
        if line and not line.startswith("#"):
            group, flags, shape = line.split("\t")
            rows.append((group, flags.split(), shape))
    return rows


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)).choices["serve"]


def test_every_vllm_flag_is_in_the_table_with_its_group_and_shape():
    rows = _vllm_flags()
    assert len(rows) == 317
    for group, flags, shape in rows:
        entry = VLLM_FLAGS.get(flags[0])
        assert entry is not None, f"{flags[0]} is not in entrypoints/vllm_flags.py's table"
        assert (entry.group, list(entry.flags), entry.shape) == (group, flags, shape)
        assert entry.how == SUPPORTED or entry.reason, f"{flags[0]}: no reason given"


def test_supported_flags_are_ours_and_the_others_have_placeholders(serve_parser):
    options = serve_parser._option_string_actions
    for flag in VLLM_FLAGS.values():
        for spelling in flag.flags:
            assert spelling in options, f"{spelling} is not a flag of `pagedserve serve`"
            placeholder = options[spelling].dest == flag.dest
            # supported: a real flag of ours; otherwise the table's placeholder (or, once another
            # change makes one of them real, the table must say "supported")
            assert placeholder == (flag.how != SUPPORTED), (spelling, flag.how)
        assert options[flag.flags[0]].help, flag.name


def _argv(flag, shape: str) -> list[str]:
    value = {"flag": [], "bool": [], "optional": [], "help": []}.get(shape, ["1"])
    return [flag, *value]


def test_each_ignored_or_refused_flag_parses_and_then_logs_or_is_refused(serve_parser, caplog):
    for flag in VLLM_FLAGS.values():
        if flag.how in (SUPPORTED, "only"):
            continue
        for spelling in flag.flags:
            args = serve_parser.parse_args(_argv(spelling, flag.shape))  # no SystemExit
            caplog.clear()
            if flag.how == IGNORED:
                with caplog.at_level(logging.INFO, logger="pagedserve.flags"):
                    check_vllm_flags(args)
                assert caplog.messages == [f"{flag.name} has no effect here: {flag.reason}"]
            else:
                with pytest.raises(ValueError, match=flag.name) as e:
                    check_vllm_flags(args)
                assert flag.reason in str(e.value)
    assert check_vllm_flags(serve_parser.parse_args([])) is None  # none given: nothing to say


def test_only_flags_take_what_pagedserve_does(serve_parser):
    check_vllm_flags(serve_parser.parse_args(["--logprobs-mode", "raw_logprobs",
                                              "--tokenizer-mode", "hf"]))
    with pytest.raises(ValueError, match="--logprobs-mode processed_logits"):
        check_vllm_flags(serve_parser.parse_args(["--logprobs-mode", "processed_logits"]))
    with pytest.raises(ValueError, match="--model-impl transformers"):
        check_vllm_flags(serve_parser.parse_args(["--model-impl", "transformers"]))


def test_refusal_and_unknown_flags_through_the_command(capsys):
    assert main(["serve", "--grpc"]) == 2
    assert "--grpc is not supported here: no gRPC front end" in capsys.readouterr().err
    assert main(["serve", "--headless"]) == 2
    assert "--headless is not supported here: several nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a flag vLLM does not have either stays argparse's error
        main(["serve", "--no-such-flag"])


def test_help_all_group_and_word_and_version(capsys):
    assert main(["serve", "--help=all"]) == 0
    everything = capsys.readouterr().out
    for group in ("Frontend:", "CacheConfig:", "SchedulerConfig:", "pagedserve:"):
        assert group in everything
    assert "--kv-cache-memory-bytes" in everything and "--headless" in everything
    assert main(["serve", "--help=cacheconfig"]) == 0
    cache = capsys.readouterr().out
    assert cache.startswith("CacheConfig:") and "--block-size" in cache and "--port" not in cache
    assert main(["serve", "--help=max-model"]) == 0
    assert "--max-model-len" in capsys.readouterr().out
    assert main(["serve", "--help=nothing-like-this"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")


def test_config_file_is_vllms_yaml_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: my-model\nmax-model-len: 1024\nenable_prefix_caching: false\n"
                      "api-key: [k1, k2]\ndisable-log-stats: true\nport: 9000\n")
    argv = config_file_args(["serve", "--config", str(config), "--port", "8001"])
    args = build_parser().parse_args(argv)
    assert args.model_tag == "my-model" and args.max_model_len == 1024
    assert args.enable_prefix_caching is False and args.api_key == ["k1", "k2"]
    assert args.disable_log_stats and args.port == 8001  # the command line wins
    argv = config_file_args(["serve", "other", f"--config={config}"])
    assert build_parser().parse_args(argv).model_tag == "other"
    config.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        config_file_args(["serve", "--config", str(config)])


def test_vllm_spellings_and_values_of_our_flags():
    args = build_parser().parse_args([
        "serve", "--kv-cache-memory-bytes", "1G", "--num-gpu-blocks-override", "64",
        "--dtype", "half", "--max-model-len", "2k", "--api-key", "k1", "k2",
        "--served-model-name", "a", "b", "--max-num-queued-reqs", "7",
        "--disable-uvicorn-access-log", "--device-memory-utilization", "0.5"])
    from pagedserve.config import EngineArgs

    engine = EngineArgs.from_namespace(args)
    assert (engine.kv_cache_memory, engine.num_kv_blocks) == (1 << 30, 64)
    assert (engine.dtype, engine.max_model_len, engine.gpu_memory_utilization) == ("float16", 2000, 0.5)
    assert args.api_key == ["k1", "k2"] and args.served_model_name == ["a", "b"]
    assert args.max_queued_requests == 7 and args.disable_access_log
    assert EngineArgs(dtype="float").dtype == "float32"


def test_vllm_cpu_environment_variables_are_aliases(monkeypatch):
    from pagedserve.config import EngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    args = EngineArgs()
    assert args.kv_cache_memory == 3 << 30 and args.cpu_threads_bind == "0"
    assert EngineArgs(kv_cache_memory=1024).kv_cache_memory == 1024  # the option wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        EngineArgs()


def test_refused_engine_values_name_the_option():
    from pagedserve.config import EngineArgs

    assert EngineArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"  # fp8 KV blocks (CPU)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="convert='classify'"):
        EngineArgs(convert="classify")
    assert EngineArgs(convert="embed").runner == "pooling"
    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        EngineArgs(structured_outputs_config='{"backend": "outlines"}')
    args = EngineArgs(structured_outputs_config='{"disable_any_whitespace": true}')
    assert args.structured_outputs_disable_any_whitespace
