"""`pagedserve bench chat-trace`'s comparison: which engines it builds for which runs (the
engines themselves are tested in tests/engine/test_dp_engine.py)."""

import argparse

from pagedserve.bench import chat_trace as ct
from pagedserve.engine.dp_router import Router


class _FakeEngine:
    def __init__(self, changes):
        self.changes = changes
        self.router = Router(2, "prefix") if changes["data_parallel_size"] == 2 else None

    def shutdown(self):
        pass


def _args(**kw):
    parser = argparse.ArgumentParser()
    ct.add_bench_chat_trace_args(parser)
    args = parser.parse_args(["--conversations", "2", "--turns", "1"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_a_kv_budget_sizes_each_dp_core_and_the_dp1_runs_get_the_same_total(monkeypatch, capsys):
    built = []

    def engine(args, **changes):
        built.append(changes)
        return _FakeEngine(changes)

    def run(engine, trace, concurrency, **kw):
        if engine.router is not None and trace.num_requests > 2:  # the measured run, not warm-up
            engine.router.prefix_routed += 3
            engine.router.overloaded += 1
        return ct.TraceResult(trace.num_requests, [], 0.5, [0.1], 10, 1.0)

    monkeypatch.setattr(ct, "_engine", engine)
    monkeypatch.setattr(ct, "run_chat_trace", run)
    assert ct.main(_args(kv_cache_memory=1000, conversations=4,
                         only="single,prefix,round-robin,dp1x2,dp2x1")) == 0
    budgets = {(c["data_parallel_size"], c.get("data_parallel_routing"), c.get("cpu_threads")):
               c.get("kv_cache_memory") for c in built}
    assert budgets == {(1, None, None): 2000, (2, "prefix", None): None,
                       (2, "round-robin", None): None, (1, None, 2): 2000}
    out = capsys.readouterr().out
    assert "1000 bytes per core of the DP=2 runs; the DP=1 runs get 2000" in out
    # the prefix runs report where routing gave way to load
    assert "prefix: 3 turns sent to the core holding their longest prefix, 1 to the least" in out
    built.clear()
    ct.main(_args(kv_cache_memory=None, conversations=4, only="single"))
    assert "kv_cache_memory" not in built[0]  # no budget given: every engine its default
