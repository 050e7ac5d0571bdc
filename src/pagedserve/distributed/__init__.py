"""Tensor parallelism: each worker's place among the ranks (`tp.TPContext`) and the process group
that joins them (`process_group`)."""
