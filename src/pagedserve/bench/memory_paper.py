"""The paper's side of `pagedserve bench memory`: the breakdown's categories, the allocators'
labels and the paper's figures (Fig. 2's token-state share, Fig. 15's sharing savings), shared by
the bench (bench/memory.py) and its charts (bench/memory_plots.py)."""

from __future__ import annotations

CATEGORIES = ("token states", "reservation", "internal frag", "external frag")
LABELS = {"paged": "pagedserve", "max": "Orca (Max)", "pow2": "Orca (Pow2)",
          "oracle": "Orca (Oracle)"}

# The paper's numbers (token-state share, Fig. 2; parallel-sampling savings, Fig. 15).
PAPER_TOKEN_SHARE = {"paged": "96.3%", "max": "20.4%", "pow2": "20.4-38.2%", "oracle": "38.2%"}
PAPER_PARALLEL_SAVINGS = {("alpaca", 2): "6.1%", ("alpaca", 6): "9.8%",
                          ("sharegpt", 2): "16.2%", ("sharegpt", 6): "30.5%"}
PAPER_BEAM_SAVINGS = {("alpaca", 2): "37.6%", ("alpaca", 6): "55.2%",
                      ("sharegpt", 2): "44.3%", ("sharegpt", 6): "66.3%"}
