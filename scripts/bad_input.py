"""The bad-input corpus (tests/entrypoints/bad_input_corpus.py) against a real server: cases
tried, answered with the expected 4xx, crashes (5xx, or a server that stopped answering).

    .venv/bin/python scripts/bad_input.py
"""

from _reliability import FIGURES, bar_chart, start_tiny_server
from bad_input_corpus import CASES, encode

from pagedserve.bench.reliability import run_corpus


def main() -> int:
    server = start_tiny_server("--log-stats-interval", "0")
    try:
        result = run_corpus(server.url, CASES, encode)
        alive = server.proc.poll() is None
    finally:
        server.stop()
    print(f"cases tried {result.tried}  answered 4xx {result.answered_4xx}  crashes "
          f"{result.crashes}  server alive afterwards {alive}")
    for f in result.failures:
        print("  mismatch:", f)
    bar_chart(FIGURES / "bad_input.png", "Bad-input corpus", ["tried", "answered 4xx",
                                                              "crashes"],
              [result.tried, result.answered_4xx, result.crashes])
    return 0 if result.crashes == 0 and alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
