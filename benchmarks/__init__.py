"""Benchmark harness for pallas_attn: DESIGN.md §4 workloads, anchors and ceilings measured in one run."""
