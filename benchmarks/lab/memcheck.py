"""Every kernel, compiled, on corrupt inputs: the run for `compute-sanitizer --tool memcheck`.

Lengths past a table's capacity, negative and huge page ids, decreasing or out-of-range `cu_*`, top-k indices past
a request's keys or the pool. Each case only has to run: memcheck reports any read or write outside an array, and
`tests/test_isolation.py` checks the outputs of the same cases in interpret mode.

    compute-sanitizer --tool memcheck --print-limit 20 python -m benchmarks.lab.memcheck
"""

import jax.numpy as jnp
import numpy as np

import pallas_attn as pa
from pallas_attn.testing import make_paged_kv


def _paged_cases(rng, seq_lens, block_tables, num_blocks):
    return {
        "len_past_capacity": (seq_lens.at[1].set(10_000), block_tables),
        "len_int32_max": (seq_lens.at[1].set(2**31 - 1), block_tables),
        "len_negative": (seq_lens.at[0].set(-5), block_tables),
        "page_negative": (seq_lens, block_tables.at[1, 0].set(-7)),
        "page_past_pool": (seq_lens, block_tables.at[1, 3].set(num_blocks + 100)),
        "page_huge": (seq_lens, block_tables.at[1, 2].set(2**31 - 1)),
        "table_all_garbage": (seq_lens.at[1].set(2**31 - 1),
                              block_tables.at[1].set(jnp.asarray(rng.integers(-2**31, 2**31 - 1, 12), jnp.int32))),
    }


def main():
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    lens = [70, 130, 1, 64]
    k_cache, v_cache, block_tables = make_paged_kv(rng, lens, 16, 2, 128, bf16, max_blocks=12)
    seq_lens = jnp.asarray(lens, jnp.int32)
    cases = _paged_cases(rng, seq_lens, block_tables, k_cache.shape[0])

    q = jnp.asarray(rng.standard_normal((4, 8, 128)), bf16)
    for name, (s, t) in cases.items():
        for num_splits in (1, 4):
            pa.paged_decode_attention(q, k_cache, v_cache, t, s, num_splits=num_splits).block_until_ready()
        print("paged_decode_attention", name, "ok", flush=True)

    q_lens = [1, 6, 40, 1]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((56, 8, 128)), bf16)
    for name, (s, t) in cases.items():
        for max_query_len in (64, 8):  # a prefill chunk's launch, and the decode tiles alone
            pa.paged_attention(q, k_cache, v_cache, t, s, cu, max_query_len=max_query_len).block_until_ready()
        print("paged_attention", name, "ok", flush=True)
    for name, c in {"decreasing": [0, 1, 7, 3, 48], "past_T": [0, 1, 7, 47, 9999], "negative": [-50, 1, 7, 47, 48],
                    "start_past_zero": [5, 5, 7, 47, 48]}.items():
        pa.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, jnp.asarray(c, jnp.int32),
                           max_query_len=64).block_until_ready()
        print("paged_attention cu", name, "ok", flush=True)

    x = jnp.asarray(rng.standard_normal((1024, 8, 128)), bf16)
    y = jnp.asarray(rng.standard_normal((1024, 2, 128)), bf16)
    for backend in ("triton", "mosaic"):
        for name, c in {"decreasing": [0, 500, 100, 1000], "past_T": [0, 300, 600, 99999],
                        "negative": [-7, 300, 600, 1000], "start_past_zero": [100, 300, 600, 1000],
                        "past_max_seqlen": [0, 900, 950, 1024]}.items():
            pa.varlen_attention(x, y, y, jnp.asarray(c, jnp.int32), max_seqlen=512,
                                backend=backend).block_until_ready()
            print("varlen_attention", backend, name, "ok", flush=True)

    lens = [700, 300, 129]
    kv_cache, _, block_tables = make_paged_kv(rng, lens, 64, None, 576, bf16, max_blocks=16)
    q = jnp.asarray(rng.standard_normal((3, 128, 576)), bf16)
    topk = jnp.asarray(rng.integers(-1, 700, (3, 256)), jnp.int32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    for backend in ("triton", "mosaic"):
        for name, (t, i, s) in {
            "past_seq_len": (block_tables, topk.at[1, :3].set(jnp.asarray([300, 383, 1023])), seq_lens),
            "past_capacity": (block_tables, topk.at[1, 0].set(5000), None),
            "below_minus_one": (block_tables, topk.at[0, 0].set(-99), seq_lens),
            "page_negative": (block_tables.at[0, 2].set(-3), topk, seq_lens),
            "page_past_pool": (block_tables.at[0, 4].set(kv_cache.shape[0] + 9), topk, None),
            "page_huge": (block_tables.at[0, 1].set(2**31 - 1), topk, seq_lens),
        }.items():
            pa.sparse_mla_attention(q, kv_cache, t, i, seq_lens=s, backend=backend).block_until_ready()
            print("sparse_mla_attention", backend, name, "ok", flush=True)
    print("all cases ran", flush=True)


if __name__ == "__main__":
    main()
