"""No test asserts a duration or a speed ratio: speed is measured by benchmarks, never by timed
assertions (issue 39). Read from the tests' sources: an `assert` fails this check when what it
tests comes from a clock (`time.time()`, `perf_counter()`, `monotonic()`, `process_time()`, their
`_ns` forms), through local variables, or through a helper of the same file that returns such a
value. Hang guards (a deadline in a `while` or an `if`) are not asserts and are not flagged; an
assert that is only a generous hang guard goes in `HANG_GUARDS`, with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "thread_time",
          "time_ns", "perf_counter_ns", "monotonic_ns", "process_time_ns", "thread_time_ns"}

# A file that neither calls a clock nor imports one from `time` has nothing to scan (most do not).
_MAY_READ_A_CLOCK = re.compile(r"\b(?:time|perf_counter|monotonic|process_time|thread_time)"
                               r"(?:_ns)?\s*\(|from time import")

# "path::function" -> why its timed assert is only a hang guard (far above any real run).
HANG_GUARDS: dict[str, str] = {}


def _clock_names(tree: ast.Module) -> set[str]:
    """The bare names a module bound to a clock (`from time import perf_counter as pc`)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "time"
            for alias in node.names if alias.name in CLOCKS}


def _is_clock_call(node: ast.AST, bare: set[str], timers: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):  # time.perf_counter(), or self._elapsed()
        return (func.attr in CLOCKS and isinstance(func.value, ast.Name)
                and func.value.id == "time") or func.attr in timers
    return isinstance(func, ast.Name) and (func.id in bare or func.id in timers)


def _target_names(target: ast.AST) -> set[str]:
    """The names an assignment binds (`a`, `a, b`, `self.x` as "self.x")."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {ast.unparse(target)}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(t) for t in target.elts))
    return set()


class _Timed:
    """Which expressions of one module carry a clock's value."""

    def __init__(self, tree: ast.Module) -> None:
        self.bare = _clock_names(tree)
        self.timers: set[str] = set()  # the module's functions that return a clock's value
        functions = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        changed = True
        while changed:  # (a timer calling a timer)
            changed = False
            for fn in functions:
                if fn.name in self.timers:
                    continue
                tainted = self.tainted_names(fn)
                if any(isinstance(n, ast.Return) and n.value is not None
                       and self.carries(n.value, tainted) for n in ast.walk(fn)):
                    self.timers.add(fn.name)
                    changed = True

    def carries(self, expr: ast.AST, tainted: set[str]) -> bool:
        for node in ast.walk(expr):
            if _is_clock_call(node, self.bare, self.timers):
                return True
            if isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node) in tainted:
                return True
        return False

    def tainted_names(self, scope: ast.AST) -> set[str]:
        """The names assigned (directly or through others) from a clock within `scope`."""
        tainted: set[str] = set()
        changed = True
        while changed:
            changed = False
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                    targets, value = [node.target], node.value
                else:
                    continue
                if value is None or not self.carries(value, tainted):
                    continue
                names = set().union(*(_target_names(t) for t in targets)) - tainted
                if names:
                    tainted |= names
                    changed = True
        return tainted


def _own_nodes(scope: ast.AST):
    """The nodes of `scope`, those of the functions defined inside it excepted."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
            todo.extend(ast.iter_child_nodes(node))


def timed_asserts(source: str, name: str = "<test>") -> list[str]:
    """"function:line" of every assert in `source` whose test carries a clock's value."""
    tree = ast.parse(source, name)
    timed = _Timed(tree)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in [tree] + scopes:
        tainted = timed.tainted_names(scope)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Assert) and timed.carries(node.test, tainted):
                found.append(f"{getattr(scope, 'name', '<module>')}:{node.lineno}")
    return sorted(set(found))


def test_the_scanner_finds_timed_asserts():
    source = '''
import time
from time import perf_counter as pc

def _per_call(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0

def test_ratio():
    ratio = _per_call(a) / _per_call(b)
    assert ratio < 10

def test_elapsed():
    start = pc()
    run()
    elapsed = pc() - start
    assert elapsed < 0.1, elapsed

def test_inline():
    t = time.monotonic()
    assert time.monotonic() - t < 1

def test_guard_only():
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        pass
    assert done()
    assert count == 3
'''
    assert timed_asserts(source) == ["test_elapsed:18", "test_inline:22", "test_ratio:12"]


def test_no_test_asserts_a_duration_or_a_speed_ratio():
    found, guards = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        source = path.read_text()
        if not _MAY_READ_A_CLOCK.search(source):
            continue
        for hit in timed_asserts(source, rel):
            key = f"{rel}::{hit.split(':')[0]}"
            (guards.add(key) if key in HANG_GUARDS else found.append(f"{rel}::{hit}"))
    assert found == [], "count the work done (calls made, items copied) instead: " + str(found)
    assert guards == set(HANG_GUARDS), "stale HANG_GUARDS entries"
