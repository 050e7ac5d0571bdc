"""Bad adapters are refused with a ValueError naming the problem, before any request is queued,
and the engine keeps serving: a missing folder or file, a pickled .bin (never unpickled), a rank
above max_lora_rank, an unknown or unsupported target module, a shape of another base model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.lora.adapter import check_adapter, target_dims

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def write_adapter(path, tensors, **config):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    return path


def key(layer, module, part, owner="self_attn"):
    return f"base_model.model.model.layers.{layer}.{owner}.{module}.lora_{part}.weight"


@pytest.fixture(scope="module")
def llm(lora_base):
    return LLM(str(lora_base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


def bad_cases(tmp_path, adapters):
    q = {key(0, "q_proj", "A"): torch.randn(4, 64), key(0, "q_proj", "B"): torch.randn(64, 4)}
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    no_config = tmp_path / "no_config"
    write_adapter(no_config, q)
    (no_config / "adapter_config.json").unlink()
    yield "does not exist", str(tmp_path / "nowhere")
    yield "never unpickles", str(pickled)
    yield "adapter_config.json is missing", str(no_config)
    yield "more than max_lora_rank", str(adapters["r16"])  # rank 16 > 8
    yield "unknown target module 'fc1'", str(write_adapter(tmp_path / "fc1", q,
                                                           target_modules=["fc1"]))
    yield "unknown target module", str(write_adapter(tmp_path / "fc1_tensor", {
        "base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.randn(4, 64),
        "base_model.model.model.layers.0.mlp.fc1.lora_B.weight": torch.randn(128, 4)},
        target_modules="fc1"))
    yield "'lm_head' is not supported", str(write_adapter(tmp_path / "head", {
        "base_model.model.lm_head.lora_A.weight": torch.randn(4, 64),
        "base_model.model.lm_head.lora_B.weight": torch.randn(512, 4)},
        target_modules=["lm_head"]))
    yield "do not fit the base model's q_proj", str(write_adapter(tmp_path / "shape", {
        key(0, "q_proj", "A"): torch.randn(4, 32), key(0, "q_proj", "B"): torch.randn(64, 4)}))
    yield "the base model has 2 layers", str(write_adapter(tmp_path / "deep", {
        key(5, "q_proj", "A"): torch.randn(4, 64), key(5, "q_proj", "B"): torch.randn(64, 4)}))
    yield "lora_B is missing", str(write_adapter(tmp_path / "half",
                                                 {key(0, "q_proj", "A"): torch.randn(4, 64)}))
    yield "DoRA", str(write_adapter(tmp_path / "dora", q, use_dora=True))


def test_bad_adapters_are_value_errors_naming_the_problem_and_the_engine_keeps_serving(
        llm, tmp_path, adapters, lora_requests):
    good = LoRARequest("good", 50, str(adapters["r8"]))
    for i, (message, path) in enumerate(bad_cases(tmp_path, adapters)):
        bad = LoRARequest(f"bad{i}", 100 + i, path)
        with pytest.raises(ValueError, match=message) as err:
            llm.generate([{"prompt_token_ids": [1, 5, 9]}] * 2, PARAMS,
                         lora_request=[good, bad], use_tqdm=False)
        assert f"bad{i}" in str(err.value)
        assert not llm.engine.has_unfinished_requests()  # nothing of the batch was queued
    out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], PARAMS, lora_request=good,
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert llm.engine.num_used_blocks() == 0


def test_lora_requests_are_checked(llm, lora_base, adapters):
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, str(adapters["r8"]))
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate("hi", PARAMS, lora_request="r8", use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 for 2 prompts"):
        llm.generate(["a", "b"], PARAMS, lora_request=[None], use_tqdm=False)
    llm.generate("hi", PARAMS, lora_request=LoRARequest("same", 60, str(adapters["r8"])),
                 use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 60 is already adapter 'same'"):
        llm.generate("hi", PARAMS, lora_request=LoRARequest("other", 60, str(adapters["r4"])),
                     use_tqdm=False)
    plain = LLM(str(lora_base), dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", PARAMS, lora_request=LoRARequest("a", 1, str(adapters["r8"])),
                       use_tqdm=False)


def test_engine_options_are_checked(lora_base):
    from pagedserve import EngineArgs

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2)


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora(tmp_path, lora_base):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(lora_base)
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    tensors = {key(1, "q_proj", "A"): a, key(1, "q_proj", "B"): b}
    for rslora, scale in ((False, 8 / 4), (True, 8 / 2)):
        path = write_adapter(tmp_path / f"s{rslora}", tensors, use_rslora=rslora)
        w = check_adapter("s", str(path), dims=target_dims(cfg), num_layers=2, max_rank=8,
                          load=True)
        got_a, got_b = w.modules[(1, "q_proj")]
        assert torch.equal(got_a, a) and torch.allclose(got_b, b * scale)
        assert w.rank == 4 and list(w.modules) == [(1, "q_proj")]
    shutil.rmtree(tmp_path)
