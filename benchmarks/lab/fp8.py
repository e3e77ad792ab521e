"""What an FP8 paged cache costs in accuracy, and its write's speed.

Accuracy: the relative L2 of attention over an FP8 cache against the same attention over the bf16 cache (the
decode kernel, for each format, scale mode and case): per-tensor scales from the tensor's largest magnitude, as a
calibration would set them (``amax / largest finite value of the format``), and per-(token, KV head) scales as
``write_kv_cache`` computes them (vLLM's ``per_token_head`` mode: one float32 scale per 128 bytes of a token's
head).

Cases: ``normal`` (K, V standard normal), ``outlier_channels`` (keys with 4 of 128 channels 20× larger, as real
models' keys have), ``token_scales`` (each token's keys and values scaled by 10^U(-2, 2): a dynamic range one
per-tensor scale must span), and ``needle`` (one key among ``--needle-keys`` holding 90% of one query's attention over
the bf16 cache; its value is the one-hot of channel 0, so ``out[0]`` over the value FP8 stored is the needle's
attention weight: FP8 must keep it within 5% of the bf16 cache's).

Speed: ``write_kv_cache`` of an 8k-token prefill chunk into a bf16 and an e4m3 cache (both scale modes), interleaved.

    python -m benchmarks.lab.fp8 [--needle-keys 131072]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import pallas_attn as pa
from benchmarks.lab import common
from pallas_attn import reference

FORMATS = (jnp.float8_e4m3fn, jnp.float8_e5m2)
BLOCK = 16


def _case(name: str, rng: np.random.Generator, needle_keys: int):
    """``(q [B, Hq, D], k_cache, v_cache [pages, BLOCK, Hkv, D] f32, block_tables, seq_lens)``."""
    hq, hkv, d = 32, 8, 128
    lens = [needle_keys] if name == "needle" else [4096] * 8
    pages = [-(-n // BLOCK) for n in lens]
    tables = np.full((len(lens), max(pages)), -1, np.int32)
    perm = rng.permutation(sum(pages))
    for b, (p, start) in enumerate(zip(pages, np.cumsum([0, *pages[:-1]]))):
        tables[b, :p] = perm[start:start + p]
    shape = (sum(pages), BLOCK, hkv, d)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    needle = None  # (page, slot) of the needle key
    if name == "outlier_channels":
        k[..., rng.choice(d, 4, replace=False)] *= 20
    elif name == "token_scales":
        token = 10.0 ** rng.uniform(-2, 2, shape[:3] + (1,))
        k, v = k * token, v * token
    elif name == "needle":
        pos = int(rng.integers(needle_keys))
        page, slot = tables[0, pos // BLOCK], pos % BLOCK
        q = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32)
        others = np.einsum("d,pbd->pb", q[0, 0], np.asarray(jnp.asarray(k[:, :, 0], jnp.bfloat16), np.float32))
        others[page, slot] = -np.inf
        needle_score = np.log(9 * np.exp(others.astype(np.float64) / np.sqrt(d)).sum())  # 90% over bf16
        k[page, slot, 0] = q[0, 0] * needle_score * np.sqrt(d) / (q[0, 0] @ q[0, 0])
        v[:, :, 0, 0] = 0.0
        v[page, slot, 0] = np.eye(d, dtype=np.float32)[0]
        needle = (int(page), int(slot))
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
            jnp.asarray(lens, jnp.int32), needle)


def accuracy(needle_keys: int) -> list[dict]:
    rows = []
    for case in ("normal", "outlier_channels", "token_scales", "needle"):
        q, k, v, bt, sl, needle = _case(case, np.random.default_rng(0), needle_keys)
        kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        base = np.asarray(pa.paged_decode_attention(q, kb, vb, bt, sl), np.float32)
        for fmt in FORMATS:
            ks, vs = reference.kv_scale_per_tensor(kb, fmt), reference.kv_scale_per_tensor(vb, fmt)
            k8, v8 = reference.quantize_kv(kb, ks, fmt), reference.quantize_kv(vb, vs, fmt)
            tensor = np.asarray(pa.paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs), np.float32)
            kt, vt = reference.kv_scales_per_token_head(kb, fmt), reference.kv_scales_per_token_head(vb, fmt)
            k8t, v8t = reference.quantize_kv(kb, kt, fmt), reference.quantize_kv(vb, vt, fmt)
            token = np.asarray(pa.paged_decode_attention(q, k8t, v8t, bt, sl, k_scale=kt, v_scale=vt), np.float32)
            stored = {"per_tensor": reference.dequantize_kv(v8, vs), "per_token_head": reference.dequantize_kv(v8t, vt)}
            for mode, out in (("per_tensor", tensor), ("per_token_head", token)):
                row = {"case": case, "format": jnp.dtype(fmt).name, "scale_mode": mode,
                       "rel_l2_vs_bf16_cache": float(np.linalg.norm(out - base) / np.linalg.norm(base))}
                if case == "needle":  # the weight: out[0] over the needle's value 1.0 as FP8 stored it
                    value = float(stored[mode][needle[0], needle[1], 0, 0])
                    row.update(needle_weight_bf16=float(base[0, 0, 0]), needle_weight_fp8=float(out[0, 0, 0]) / value)
                rows.append(row)
                print(row, flush=True)
    return rows


def write_speed(tokens: int = 8192, pool_tokens: int = 262144) -> dict:
    """µs of one ``write_kv_cache`` of ``tokens`` new rows (Hkv 8, D 128) into a bf16 pool and into e4m3 pools (scales
    as Python floats, as device scalars, and per token and head), the rows' slots a random permutation of the pool's;
    each through the public function, called back to back as a serving loop does."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((tokens, 8, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((tokens, 8, 128)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(pool_tokens)[:tokens], jnp.int32)
    pages = pool_tokens // BLOCK
    cases = {"bf16": (jnp.bfloat16, {}), "e4m3_python_scales": (jnp.float8_e4m3fn, dict(k_scale=0.02, v_scale=0.02)),
             "e4m3_device_scales": (jnp.float8_e4m3fn, dict(k_scale=jnp.float32(0.02), v_scale=jnp.float32(0.02))),
             "e4m3_per_token_head": (jnp.float8_e4m3fn, dict(zip(("k_scale", "v_scale"),
                                                                 pa.allocate_kv_scales(pages, BLOCK, 8))))}
    fns = []
    for dtype, scales in cases.values():
        state = {"caches": pa.allocate_kv_cache(pages, BLOCK, 8, 128, dtype), "scales": scales}

        def write(state=state):  # the pools (and scale caches) are donated: carry the written ones
            out = pa.write_kv_cache(*state["caches"], k, v, slots, **state["scales"])
            state["caches"] = out[:2]
            if len(out) == 4:
                state["scales"] = dict(k_scale=out[2], v_scale=out[3])
            return out

        fns.append(write)
    times = common.interleaved(fns, [()] * len(fns))
    us = {name: common.median(t) * 1e6 for name, t in zip(cases, times)}
    return {"tokens": tokens, "pool_tokens": pool_tokens, "us": us,
            "over_bf16": {name: t / us["bf16"] for name, t in us.items() if name != "bf16"}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--needle-keys", type=int, default=131072)
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args(argv)
    doc = {"accuracy": accuracy(args.needle_keys)}
    if not args.skip_speed:
        doc["write_kv_cache"] = write_speed()
        print(doc["write_kv_cache"])
    common.write_json("fp8.json", doc)


if __name__ == "__main__":
    main()
