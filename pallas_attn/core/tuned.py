"""Measured launch configs: the tables ``pallas_attn.core.config`` consults before its built-in defaults.

Keys are ``(device kind, next_pow2(head_dim))`` (sparse: ``(device kind, num_q_heads)``); values are the config
dataclass's fields. Written by ``pallas-attn bench --sweep --write-tables`` (``benchmarks/sweep.py``): re-run the
sweep rather than editing by hand. Empty tables mean the built-in defaults, which already encode the H200 sweeps
(``docs/performance.md#tuned-tables``).
"""

PREFILL: dict[tuple[str, int], dict] = {}
DECODE: dict[tuple[str, int], dict] = {}
CHUNK: dict[tuple[str, int], dict] = {}
SPARSE: dict[tuple[str, int], dict] = {}
