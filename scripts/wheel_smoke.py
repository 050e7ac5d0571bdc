"""Smoke test of an installed pagedserve wheel (CI, `.ci/run`), in two steps:

    python scripts/wheel_smoke.py reference DIR   # in the editable install's venv (JIT kernels)
    python -I scripts/wheel_smoke.py check DIR    # in a fresh venv holding only the wheel

`reference` writes a tiny random checkpoint (tests/tiny.py) to DIR/model and the greedy tokens
and logprobs of a few prompts in bfloat16 and float32 to DIR/reference.json. `check` asserts that
pagedserve is imported from the installed wheel (not the checkout), that every compiled extension
loads from the wheel's prebuilt libraries (no JIT build, no "torch fallback" warning, with
`require_kernels=True`), that the same generation gives exactly the same tokens and logprobs,
then times the embedded model's start-up: `pagedserve generate` to its first token and
`pagedserve serve` to a 200 on /health (printed; `--max-startup-s` fails the check beyond it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5], [1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 9]]


def generate(model: Path, dtype: str) -> list[dict]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, seed=0, kv_cache_memory=64 << 20, require_kernels=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(k): v.logprob for k, v in sorted(step.items())}
                          for step in o.outputs[0].logprobs]} for o in outs]


def run_generation(model: Path) -> dict:
    return {dtype: generate(model, dtype) for dtype in ("bfloat16", "float32")}


def reference(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny

    out.mkdir(parents=True, exist_ok=True)
    tiny.make_checkpoint(out / "model", "gemma3", seed=0)
    (out / "reference.json").write_text(json.dumps(run_generation(out / "model")))
    print(f"reference tokens written to {out / 'reference.json'}")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _first_token_s() -> tuple[float, float]:
    """Seconds (wall, and CPU of the process) from launching `pagedserve generate` to its first
    printed byte (the embedded model, one token: the start-up, then the first token)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["pagedserve", "generate", "The capital of France is",
                             "--model", "gemma-3-270m", "--max-tokens", "1", "--require-kernels"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = proc.stdout.read(1)
    elapsed, cpu = time.perf_counter() - t0, _cpu_s(proc.pid)
    proc.communicate(timeout=120)
    assert proc.returncode == 0 and first, f"pagedserve generate failed ({proc.returncode})"
    return elapsed, cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health_s() -> tuple[float, float]:
    """Seconds (wall, and CPU of the process) from launching `pagedserve serve` (the embedded
    model) to a 200 on /health."""
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(["pagedserve", "serve", "gemma-3-270m", "--port", str(port),
                             "--require-kernels"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < 180:
            if proc.poll() is not None:
                raise AssertionError(f"pagedserve serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0, _cpu_s(proc.pid)
            except OSError:
                time.sleep(0.05)
        raise AssertionError("no /health within 180 s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def check(out: Path, max_startup_s: float | None) -> None:
    records = _Records()
    logging.getLogger().addHandler(records)
    logging.getLogger().setLevel(logging.INFO)
    import pagedserve
    from pagedserve.kernels.extension import all_extensions

    here = Path(pagedserve.__file__).resolve()
    checkout = Path(__file__).resolve().parents[1]
    # NOTE: the wheel's venv may sit inside the checkout (.ci/run's .ci-wheel-venv): what must not
    # be imported is the checkout's source tree
    assert checkout / "src" not in here.parents, f"pagedserve imported from the checkout: {here}"
    assert "site-packages" in here.parts, f"pagedserve not from an installed wheel: {here}"
    for ext in all_extensions():
        assert ext.isa(), f"{ext.prefix} unavailable: {ext.failure}"
        assert ext.origin == "prebuilt", f"{ext.prefix} came from {ext.origin}, not the wheel"
        print(f"{ext.prefix}: prebuilt ({ext.library.name})")
    got = run_generation(out / "model")
    want = json.loads((out / "reference.json").read_text())
    for dtype in want:
        assert got[dtype] == want[dtype], f"{dtype}: the wheel's tokens/logprobs differ:\n" \
                                          f"{got[dtype]}\n!=\n{want[dtype]}"
    print("tiny-model generation: tokens and logprobs equal the editable install's "
          "(bfloat16, float32)")
    fallback = [m for m in records.messages if "fallback" in m or "unavailable" in m]
    assert not fallback, f"fallback warnings: {fallback}"
    startup = {"generate, first token": _first_token_s(), "serve, /health 200": _health_s()}
    for name, (seconds, cpu) in startup.items():
        print(f"start-up of the embedded model from the wheel: {name} in {seconds:.1f} s "
              f"({cpu:.1f} CPU s)")
    if max_startup_s is not None:
        slow = {k: v for k, (v, _) in startup.items() if v > max_startup_s}
        assert not slow, f"start-up over {max_startup_s} s: {slow}"
    print("wheel smoke test passed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["reference", "check"])
    p.add_argument("dir", type=Path)
    p.add_argument("--max-startup-s", type=float, default=None)
    args = p.parse_args()
    os.environ.pop("PAGEDSERVE_DISABLE_CPU_KERNELS", None)
    if args.mode == "reference":
        reference(args.dir.resolve())
    else:
        check(args.dir.resolve(), args.max_startup_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
