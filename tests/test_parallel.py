"""pallas_attn.parallel on 2 devices: tensor-parallel heads for every kernel, context-parallel decode.

pytest runs in a single-device process, so the 2-device checks run in ONE child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (CPU, interpret mode); it prints a ``CHECK <name> ok|FAIL``
line per check and every test below asserts its own line. On a machine with >= 2 GPUs the ``gpu``-marked test runs
the same checks in-process, compiled.

Standalone: ``XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.test_parallel``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import (
    DecodeConfig,
    mla_attention,
    paged_attention,
    paged_decode_attention,
    parallel,
    reference,
    sparse_mla_attention,
    varlen_attention,
)
from pallas_attn.testing import assert_attention_close, make_paged_kv, random_packed, relative_l2

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = DecodeConfig(block_n=16)
RTOL = 1e-5  # float32: sharded vs single-device (relative L2)


# ------------------------------------------------------------------------------------------------ the checks
def _same(name, got, want, *, exact=True, rtol=RTOL):
    """got == want bit for bit (exact) or within relative L2 ``rtol``; LSE compared where both finite / both -inf."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: not bit-identical")
    else:
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=f"{name}: finiteness differs")
        np.testing.assert_array_equal(got[~fin], want[~fin], err_msg=f"{name}: -inf rows differ")
        err = relative_l2(got[fin], want[fin])
        assert err < rtol, f"{name}: relative L2 {err:.2e} >= {rtol:.0e}"


def _mesh(name):
    return jax.make_mesh((2,), (name,))


def check_tp_varlen(rng):
    lens = [40, 17, 1, 0]
    q, cu = random_packed(rng, lens, 8, 64, jnp.float32, pad_to=64)
    k, _ = random_packed(rng, lens, 4, 64, jnp.float32, pad_to=64)
    v, _ = random_packed(rng, lens, 4, 64, jnp.float32, pad_to=64)
    kw = dict(max_seqlen=64, return_lse=True)
    out, lse = parallel.tensor_parallel(varlen_attention, _mesh("tp"), "tp", **kw)(q, k, v, cu)
    one, one_lse = varlen_attention(q, k, v, cu, **kw)
    assert out.sharding.spec[1] == "tp", out.sharding  # heads stay sharded: one global array
    n = int(cu[-1])
    _same("varlen out", np.asarray(out)[:n], np.asarray(one)[:n])
    _same("varlen lse", np.asarray(lse)[:n], np.asarray(one_lse)[:n])
    assert_attention_close(np.asarray(out)[:n], reference.varlen_attention(q, k, v, cu)[:n], dtype=jnp.float32)


def check_tp_varlen_grad(rng):
    """Training under tensor parallelism: the gradients of the head-sharded call equal the one-device ones."""
    lens = [33, 16, 1]
    q, cu = random_packed(rng, lens, 4, 16, jnp.float32, pad_to=56)
    k, _ = random_packed(rng, lens, 2, 16, jnp.float32, pad_to=56)
    v, _ = random_packed(rng, lens, 2, 16, jnp.float32, pad_to=56)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kw = dict(max_seqlen=64)
    mesh = _mesh("tp")
    sharded = parallel.tensor_parallel(varlen_attention, mesh, "tp", **kw)
    grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, cu) * w), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
    with jax.set_mesh(mesh):  # the loss reduces the head-sharded output
        grads = grad(sharded)
    n = int(cu[-1])
    for name, got, want in zip(("dq", "dk", "dv"), grads, grad(lambda *a: varlen_attention(*a, **kw))):
        _same(f"varlen {name}", np.asarray(got)[:n], np.asarray(want)[:n], exact=False)


def _decode_inputs(rng, ctx, bs=16, hq=8, hkv=4, d=64, dtype=jnp.float32):
    k_cache, v_cache, tables = make_paged_kv(rng, ctx, bs, hkv, d, dtype)
    q = jnp.asarray(rng.standard_normal((len(ctx), hq, d), np.float32), dtype)
    return q, k_cache, v_cache, tables, jnp.asarray(ctx, jnp.int32)


def check_tp_decode(rng):
    args = _decode_inputs(rng, [70, 5, 0, 33])
    for split, exact in ((dict(split_size=32), True), (dict(), False)):
        kw = dict(return_lse=True, config=SMALL, **split)
        out, lse = parallel.tensor_parallel(paged_decode_attention, _mesh("tp"), "tp", **kw)(*args)
        one, one_lse = paged_decode_attention(*args, **kw)
        _same(f"decode out {split}", out, one, exact=exact)
        _same(f"decode lse {split}", lse, one_lse, exact=exact)
    assert_attention_close(out, reference.paged_decode_attention(*args), dtype=jnp.float32)


def check_tp_paged(rng):
    seq_lens, q_lens = [40, 30, 20, 0, 7], [1, 6, 20, 0, 7]
    k_cache, v_cache, tables = make_paged_kv(rng, seq_lens, 16, 4, 64, jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + 2, 8, 64), np.float32))
    args = (q, k_cache, v_cache, tables, jnp.asarray(seq_lens, jnp.int32), cu)
    for split, exact in ((dict(num_splits=2), True), (dict(), False)):
        kw = dict(max_query_len=32, return_lse=True, config=SMALL, **split)
        out, lse = parallel.tensor_parallel(paged_attention, _mesh("tp"), "tp", **kw)(*args)
        one, one_lse = paged_attention(*args, **kw)
        n = int(cu[-1])
        _same(f"paged out {split}", np.asarray(out)[:n], np.asarray(one)[:n], exact=exact)
        _same(f"paged lse {split}", np.asarray(lse)[:n], np.asarray(one_lse)[:n], exact=exact)
    ref = reference.paged_attention(*args[:6])
    assert_attention_close(np.asarray(out)[:n], np.asarray(ref)[:n], dtype=jnp.float32)


def check_tp_sparse(rng):
    seq_lens, heads, dqk, rank, topk = [30, 7, 64], 8, 80, 64, 24
    kv, _, bt = make_paged_kv(rng, seq_lens, 4, None, dqk, jnp.float32)
    idx = np.stack([rng.integers(0, n, topk) for n in seq_lens]).astype(np.int32)
    idx[0, ::3] = -1
    idx = jnp.asarray(idx)
    q = jnp.asarray(rng.standard_normal((3, heads, dqk), np.float32))
    kw = dict(kv_lora_rank=rank, return_lse=True)
    f = parallel.tensor_parallel(sparse_mla_attention, _mesh("tp"), "tp", **kw)
    out, lse = f(q, kv, bt, idx)
    one, one_lse = sparse_mla_attention(q, kv, bt, idx, **kw)
    _same("sparse out", out, one, exact=False)
    _same("sparse lse", lse, one_lse, exact=False)
    assert_attention_close(out, reference.sparse_mla_attention(q, kv, bt, idx, kv_lora_rank=rank), dtype=jnp.float32)
    # several tokens per request: cu_query_lens (keyword or positional)
    cu = jnp.asarray([0, 2, 3], jnp.int32)  # tokens 0, 1 -> request 0 (30 keys), token 2 -> request 1 (7 keys)
    bt2 = bt[:2]
    idx = idx.at[2].set(jnp.where(idx[2] >= 0, idx[2] % seq_lens[1], -1))  # top-k within the token's own request
    out_kw = f(q, kv, bt2, idx, cu_query_lens=cu)[0]
    out_pos = f(q, kv, bt2, idx, cu)[0]
    one = sparse_mla_attention(q, kv, bt2, idx, cu_query_lens=cu, **kw)[0]
    _same("sparse cu out", out_kw, one, exact=False)
    _same("sparse cu positional", out_pos, out_kw)


def _cp_case(rng, ctx, dtype=jnp.float32, bs=16):
    q, kc, vc, tables, lens = _decode_inputs(rng, ctx, bs=bs, hq=8, hkv=2, dtype=dtype)
    shards = parallel.split_context_pages(tables, lens, bs, 2)
    mesh = _mesh("cp")
    kc2 = parallel.shard_paged_cache(kc, shards.page_map, mesh=mesh, axis="cp")
    vc2 = parallel.shard_paged_cache(vc, shards.page_map, mesh=mesh, axis="cp")
    return (q, kc, vc, tables, lens), shards, (q, kc2, vc2, jnp.asarray(shards.block_tables),
                                                jnp.asarray(shards.seq_lens)), mesh


def check_tp_mla(rng):
    """Dense MLA with its heads over 2 devices (the latent cache replicated): decode, then a multi-token step with
    cu_query_lens as a keyword or a fifth array."""
    seq_lens, heads = [30, 7, 64], 8
    kv, _, bt = make_paged_kv(rng, seq_lens, 16, None, 80, jnp.float32)
    sl = jnp.asarray(seq_lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, heads, 80), np.float32))
    kw = dict(kv_lora_rank=64, return_lse=True, num_splits=1)
    f = parallel.tensor_parallel(mla_attention, _mesh("tp"), "tp", **kw)
    out, lse = f(q, kv, bt, sl)
    one, one_lse = mla_attention(q, kv, bt, sl, **kw)
    _same("mla out", out, one)
    _same("mla lse", lse, one_lse)
    assert_attention_close(out, reference.mla_attention(q, kv, bt, sl, kv_lora_rank=64), dtype=jnp.float32)
    cu = jnp.asarray([0, 2, 3, 3], jnp.int32)  # two new tokens for request 0, one for request 1, none for 2
    f2 = parallel.tensor_parallel(mla_attention, _mesh("tp"), "tp", max_query_len=2, **kw)
    out_kw, out_pos = f2(q, kv, bt, sl, cu_query_lens=cu)[0], f2(q, kv, bt, sl, cu)[0]
    one = mla_attention(q, kv, bt, sl, cu, max_query_len=2, **kw)[0]
    _same("mla cu out", out_kw, one)
    _same("mla cu positional", out_pos, out_kw)


def check_split_context_pages(rng):
    ctx = [70, 5, 0, 16, 17, 200]
    tables = np.arange(len(ctx) * 16).reshape(len(ctx), 16)
    s = parallel.split_context_pages(tables, ctx, 16, 2)
    np.testing.assert_array_equal(s.seq_lens.sum(0), ctx)  # every key on exactly one device
    np.testing.assert_array_equal(s.seq_lens, [[48, 5, 0, 16, 16, 112], [22, 0, 0, 0, 1, 88]])
    np.testing.assert_array_equal(s.starts[1], [48, 16, 0, 16, 16, 112])
    for d in range(2):  # local tables map back to the right global pages, in order
        for b in range(len(ctx)):
            pages = -(-int(s.seq_lens[d, b]) // 16)
            first = int(s.starts[d, b]) // 16
            np.testing.assert_array_equal(s.page_map[d][s.block_tables[d, b, :pages]], tables[b, first:first + pages])
    s4 = parallel.split_context_pages(tables, ctx, 16, 4)
    np.testing.assert_array_equal(s4.seq_lens.sum(0), ctx)
    assert (s4.seq_lens[:, 1] == [5, 0, 0, 0]).all()


def check_cp_decode(rng):
    ctx = [70, 5, 0, 16, 17, 200]  # 5 / 16: fit on device 0 (device 1 has 0 keys); 0: both empty
    glob, shards, local, mesh = _cp_case(rng, ctx)
    assert (shards.seq_lens[1][[1, 2, 3]] == 0).all() and shards.seq_lens[1][4] == 1
    one, one_lse = paged_decode_attention(*glob, num_splits=1, return_lse=True, config=SMALL)
    ref, ref_lse = reference.paged_decode_attention(*glob, return_lse=True)
    for merge, split in (("all_gather", dict(num_splits=1)), ("all_gather", dict(num_splits=2)), ("all_gather", {}),
                         ("psum", {})):
        out, lse = parallel.context_parallel_decode(*local, mesh=mesh, axis="cp", merge=merge, return_lse=True,
                                                    config=SMALL, **split)
        tag = f"cp {merge} {split}"
        assert out.dtype == one.dtype and out.shape == one.shape, tag
        _same(f"{tag} out", out, one, exact=False)
        _same(f"{tag} lse", lse, one_lse, exact=False)
        assert_attention_close(out, ref, dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)
        assert np.all(np.asarray(out)[2] == 0) and np.all(np.asarray(lse)[2] == -np.inf), f"{tag}: context 0"


def check_cp_decode_sinks_softcap(rng):
    """A sink applied once to the state merged across 2 shards, not once per shard; soft-cap on every shard."""
    ctx = [70, 5, 0, 17]
    glob, _, local, mesh = _cp_case(rng, ctx)
    sinks = jnp.asarray(rng.uniform(-1, 2, glob[0].shape[1]), jnp.float32)
    kw = dict(sinks=sinks, softcap=2.0)
    ref, ref_lse = reference.paged_decode_attention(*glob, return_lse=True, **kw)
    for merge in ("all_gather", "psum"):
        out, lse = parallel.context_parallel_decode(*local, mesh=mesh, axis="cp", merge=merge, return_lse=True,
                                                    config=SMALL, num_splits=2, **kw)
        assert_attention_close(out, ref, dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)
        assert np.all(np.asarray(out)[2] == 0), f"{merge}: context 0 with a sink"


def check_cp_decode_bf16_bs8(rng):
    ctx = [300, 9, 0, 1]
    glob, _, local, mesh = _cp_case(rng, ctx, dtype=jnp.bfloat16, bs=8)
    out = parallel.context_parallel_decode(*local, mesh=mesh, axis="cp", config=SMALL)
    assert out.dtype == jnp.bfloat16
    assert_attention_close(out, reference.paged_decode_attention(*glob), dtype=jnp.bfloat16)
    one = paged_decode_attention(*glob, config=SMALL)
    assert relative_l2(out, one) < 1e-2


def check_cp_decode_fp8(rng):
    """An FP8 cache spread over 2 devices: every shard dequantises with the same scales (or its own pages' scale
    caches), the merge is unchanged."""
    ctx = [70, 5, 0, 17]
    (q, kc, vc, tables, lens), shards, _, mesh = _cp_case(rng, ctx)
    k8, v8 = (reference.quantize_kv(c, 0.02, jnp.float8_e4m3fn) for c in (kc, vc))
    scales = dict(k_scale=0.02, v_scale=0.02)
    ref = reference.paged_decode_attention(q, k8, v8, tables, lens, **scales)
    k8_2, v8_2 = (parallel.shard_paged_cache(c, shards.page_map, mesh=mesh, axis="cp") for c in (k8, v8))
    for merge in ("all_gather", "psum"):
        out = parallel.context_parallel_decode(q, k8_2, v8_2, shards, mesh=mesh, axis="cp", merge=merge,
                                               config=SMALL, **scales)
        assert_attention_close(out, ref, dtype=jnp.float32)
    # per-(token, head) scales: scale caches sharded with their pages
    ks, vs = (reference.kv_scales_per_token_head(c, jnp.float8_e5m2) for c in (kc, vc))
    k5, v5 = reference.quantize_kv(kc, ks, jnp.float8_e5m2), reference.quantize_kv(vc, vs, jnp.float8_e5m2)
    ref = reference.paged_decode_attention(q, k5, v5, tables, lens, k_scale=ks, v_scale=vs)
    k5_2, v5_2, ks_2, vs_2 = (parallel.shard_paged_cache(c, shards.page_map, mesh=mesh, axis="cp")
                              for c in (k5, v5, ks, vs))
    out = parallel.context_parallel_decode(q, k5_2, v5_2, shards, mesh=mesh, axis="cp", config=SMALL, k_scale=ks_2,
                                           v_scale=vs_2)
    assert_attention_close(out, ref, dtype=jnp.float32)
    try:
        parallel.context_parallel_decode(q, k8_2, v8_2, shards, mesh=mesh, axis="cp", k_scale=0.02)
    except ValueError as e:
        assert "needs k_scale= and v_scale=" in str(e), e
    else:
        raise AssertionError("an FP8 cache without v_scale was accepted")


CHECKS = {f.__name__.removeprefix("check_"): f for f in [
    check_tp_varlen, check_tp_varlen_grad, check_tp_decode, check_tp_paged, check_tp_sparse, check_tp_mla,
    check_split_context_pages, check_cp_decode, check_cp_decode_sinks_softcap, check_cp_decode_bf16_bs8,
    check_cp_decode_fp8]}


def run_checks(names=None) -> int:
    """Run the checks in this process (needs >= 2 devices); one ``CHECK name ok|FAIL`` line each; # failures."""
    assert len(jax.devices()) >= 2, f"needs 2 devices, have {jax.devices()}"
    failures = 0
    for name in names or CHECKS:
        try:
            CHECKS[name](np.random.default_rng(zlib.crc32(name.encode())))
            print(f"CHECK {name} ok", flush=True)
        except Exception:  # report every check, not just the first failure
            failures += 1
            print(f"CHECK {name} FAIL\n{traceback.format_exc()}", flush=True)
    return failures


# ------------------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def child_run():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    env.pop("PALLAS_ATTN_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_parallel"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc


@pytest.mark.parametrize("name", list(CHECKS))
def test_two_host_devices(child_run, name):
    lines = child_run.stdout.splitlines()
    status = [line for line in lines if line.startswith(f"CHECK {name} ")]
    assert status, f"check {name} did not report (rc={child_run.returncode}):\n{child_run.stdout}\n{child_run.stderr}"
    assert status[0] == f"CHECK {name} ok", child_run.stdout


def test_child_exit_code(child_run):
    assert child_run.returncode == 0, child_run.stdout + child_run.stderr


@pytest.mark.gpu
def test_two_gpus_in_process():
    if len(jax.devices()) < 2:
        pytest.skip("needs >= 2 devices")
    assert run_checks() == 0


def test_rejects_bad_inputs():
    """Single-device, host-side argument checks."""
    with pytest.raises(ValueError, match="tensor_parallel knows"):
        parallel.tensor_parallel_specs(reference.varlen_attention)
    with pytest.raises(ValueError, match="columns"):
        parallel.split_context_pages(np.zeros((1, 2), np.int32), [40], 16, 2)
    mesh = jax.make_mesh((1,), ("tp",))
    f = parallel.tensor_parallel(paged_decode_attention, mesh, "tp")
    assert f.__name__ == "tensor_parallel_paged_decode_attention"


def test_mesh_axis_and_block_size_are_checked(rng):
    """An axis the mesh lacks is a ValueError naming it and the mesh's axes; shards cut for another block size
    than the cache's are refused (their tables would address the wrong keys); the shards carry their block size."""
    q, kc, vc, tables, seq_lens = _decode_inputs(rng, [40, 3, 0], hq=4, hkv=2)
    tp, cp = jax.make_mesh((1,), ("tp",)), jax.make_mesh((1,), ("cp",))
    with pytest.raises(ValueError, match=r"axis='model' is not an axis of the mesh; its axes are \('tp',\)"):
        parallel.tensor_parallel(paged_decode_attention, tp, "model")
    shards = parallel.split_context_pages(tables, seq_lens, 16, 1)
    assert shards.block_size == 16
    with pytest.raises(ValueError, match=r"axis='model' is not an axis of the mesh; its axes are \('cp',\)"):
        parallel.shard_paged_cache(kc, shards.page_map, mesh=cp, axis="model")
    local = (q, parallel.shard_paged_cache(kc, shards.page_map), parallel.shard_paged_cache(vc, shards.page_map))
    with pytest.raises(ValueError, match=r"axis='model' is not an axis of the mesh; its axes are \('cp',\)"):
        parallel.context_parallel_decode(*local, shards, mesh=cp, axis="model")

    want = parallel.context_parallel_decode(*local, jnp.asarray(shards.block_tables), jnp.asarray(shards.seq_lens),
                                            mesh=cp, config=SMALL)
    got = parallel.context_parallel_decode(*local, shards, mesh=cp, config=SMALL)  # the shards themselves
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wrong = parallel.split_context_pages(tables, seq_lens, 32, 1)
    with pytest.raises(ValueError, match=r"cut for block_size=32 by split_context_pages, but k_cache has "
                                         r"block_size=16"):
        parallel.context_parallel_decode(*local, wrong, mesh=cp, config=SMALL)
    with pytest.raises(TypeError, match=r"got a ContextShards as block_tables and seq_lens too"):
        parallel.context_parallel_decode(*local, shards, shards.seq_lens, mesh=cp)
    with pytest.raises(TypeError, match=r"missing seq_lens: pass seq_lens, or a ContextShards as block_tables"):
        parallel.context_parallel_decode(*local, shards.block_tables, mesh=cp)


def test_context_lens_aliases_warn(rng):
    """``context_lens``, the former name of ``seq_lens``, still works for one release: it warns, naming the new
    name, and gives the same result; passing both raises."""
    lens = [40, 3, 0]
    q, kc, vc, tables, seq_lens = _decode_inputs(rng, lens, hq=4, hkv=2)
    shards = parallel.split_context_pages(tables, seq_lens, 16, 1)
    with pytest.warns(DeprecationWarning, match="pass seq_lens="):
        old = parallel.split_context_pages(tables, context_lens=seq_lens, block_size=16, n_dev=1)
    np.testing.assert_array_equal(old.seq_lens, shards.seq_lens)
    with pytest.warns(DeprecationWarning, match="read ContextShards.seq_lens"):
        np.testing.assert_array_equal(shards.context_lens, shards.seq_lens)
    with pytest.raises(TypeError, match="both seq_lens and its deprecated alias context_lens="):
        parallel.split_context_pages(tables, seq_lens, 16, 1, context_lens=seq_lens)

    mesh = jax.make_mesh((1,), ("cp",))
    local = (q, parallel.shard_paged_cache(kc, shards.page_map), parallel.shard_paged_cache(vc, shards.page_map),
             jnp.asarray(shards.block_tables))
    lens1 = jnp.asarray(shards.seq_lens)
    new = parallel.context_parallel_decode(*local, lens1, mesh=mesh, config=SMALL)
    with pytest.warns(DeprecationWarning, match="pass seq_lens="):
        old = parallel.context_parallel_decode(*local, context_lens=lens1, mesh=mesh, config=SMALL)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    with pytest.raises(TypeError, match="both seq_lens and its deprecated alias context_lens="):
        parallel.context_parallel_decode(*local, lens1, context_lens=lens1, mesh=mesh)


if __name__ == "__main__":
    sys.exit(1 if run_checks(sys.argv[1:] or None) else 0)
