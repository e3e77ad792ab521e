"""Benchmark harness for pallas_attn: the standard workloads, our kernels and the anchors, and the ceilings, measured
in one run (``python -m benchmarks.run``); ``benchmarks.report`` turns a results file into the README's table."""
