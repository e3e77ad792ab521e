"""What the public functions do with awkward inputs: empty batches, Python lists and numpy arrays, wrong static
arguments, differentiation, and ``checked`` inside ``jax.jit``.

* Empty batches (no request, no token, no page, no top-k slot) return zeros of the right shape and dtype (LSE
  ``-inf`` where rows exist), equal to the reference, plain and under ``checked``; no kernel runs.
* Lists, tuples and numpy arrays are converted (integer data to int32 where the argument is int32), and a new batch
  of the same shapes reuses the compiled program.
* Every trace-time mistake is a ``TypeError`` / ``ValueError`` naming the argument, what it got and what it needs.
* ``jax.grad`` / ``jax.jvp`` / ``jax.vjp`` of the inference-only kernels (all but ``varlen_attention``, whose
  gradients tests/test_gradients.py checks) raise ``NotImplementedError`` naming the function; a plain call lowers
  to the same program as without that guard.
* ``checked`` inside ``jax.jit``: raises at once, showing ``jax.jit(checkify.checkify(step))`` + ``err.throw()``;
  with that pattern it works and the error names the argument.

Runtime on CPU: ~20 s (most cases raise or return before any kernel; a few compile one tiny kernel each).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_attn import (
    DecodeConfig,
    PrefillConfig,
    SparseConfig,
    checked,
    merge_attention_states,
    paged_attention,
    paged_decode_attention,
    reference,
    sparse_mla_attention,
    varlen_attention,
)
from pallas_attn.ops import common, varlen as varlen_ops
from pallas_attn.testing import make_paged_kv, random_packed

PREFILL = PrefillConfig(block_m=16, block_n=16)
DECODE = DecodeConfig(block_n=16)
SPARSE = SparseConfig(block_n=16, block_h=16, num_warps=4)
BS, D, DQK, RANK = 4, 16, 80, 64  # block_size, head_dim; sparse: q / latent dim and value dims
I32 = jnp.int32


def _i32(*shape):
    return jnp.zeros(shape, I32)


def _rows(rng, n, heads, dim, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal((n, heads, dim)), dtype)


# ------------------------------------------------------------------------------------------- lists and numpy


def _small_batches(rng):
    """One small valid batch per kernel: (function, positional arrays, keyword arguments)."""
    q, cu = random_packed(rng, [5, 3], 2, D, jnp.float32, pad_to=10)
    k, _ = random_packed(rng, [5, 3], 1, D, jnp.float32, pad_to=10)
    kc, vc, bt = make_paged_kv(rng, [6, 3], BS, 1, D, jnp.float32)
    qd = _rows(rng, 2, 2, D)
    qp, cup = random_packed(rng, [1, 3], 2, D, jnp.float32, pad_to=5)
    kv, _, bts = make_paged_kv(rng, [6, 3], BS, None, DQK, jnp.float32)
    return {
        "varlen": (varlen_attention, (q, k, k, cu), dict(max_seqlen=8, config=PREFILL)),
        "decode": (paged_decode_attention, (qd, kc, vc, bt, jnp.array([6, 3], I32)), dict(config=DECODE)),
        "paged": (paged_attention, (qp, kc, vc, bt, jnp.array([6, 3], I32), cup),
                  dict(max_query_len=4, config=DECODE)),
        "sparse": (sparse_mla_attention, (_rows(rng, 2, 4, DQK), kv, bts, jnp.array([[0, 5, -1], [2, 0, 1]], I32)),
                   dict(kv_lora_rank=RANK, config=SPARSE)),
    }


def _as_host(x):
    """Integer arrays as nested Python lists, float arrays as numpy arrays."""
    x = np.asarray(x)
    return x.tolist() if x.dtype.kind == "i" else x


@pytest.mark.parametrize("kind", ["varlen", "decode", "paged", "sparse"])
def test_lists_and_numpy_arrays_are_accepted(kind, rng):
    fn, args, kw = _small_batches(rng)[kind]
    want = fn(*args, **kw, return_lse=True)
    host = tuple(_as_host(a) for a in args)
    assert isinstance(host[3], list)
    for got in (fn(*host, **kw, return_lse=True), checked(fn)(*host, **kw, return_lse=True)):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_list_batches_reuse_the_compiled_program(rng, monkeypatch):
    """The wrapper only converts: a new batch of the same shapes, given as lists, traces nothing new."""
    traces = []
    validate = varlen_ops._validate  # runs once per trace
    monkeypatch.setattr(varlen_ops, "_validate", lambda *a: traces.append(1) or validate(*a))
    fn, (q, k, v, _), kw = _small_batches(rng)["varlen"]
    for cu in ([0, 5, 8], [0, 5, 8]):  # warm up (a first run may change JAX's tracing context once)
        fn(q, k, v, cu, **kw)
    before = len(traces)
    for cu in ([0, 2, 9], (0, 10, 10), np.array([0, 1, 4], np.int64)):
        fn(q, k, v, cu, **kw)
    assert len(traces) == before


def test_wrappers_keep_signature_and_docs():
    for fn in (varlen_attention, paged_decode_attention, paged_attention, sparse_mla_attention,
               merge_attention_states):
        assert fn.__doc__ and fn.__wrapped__ is not None
        params = inspect.signature(fn).parameters
        assert list(params)[:2] in (["q", "k"], ["q", "k_cache"], ["q", "kv_cache"], ["outs", "lses"])
    assert inspect.signature(varlen_attention).parameters["max_seqlen"].kind is inspect.Parameter.KEYWORD_ONLY
    # The jitted function's ahead-of-time API, behind the same conversions and checks.
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 2, D), (3, BS, 1, D), (3, BS, 1, D))]
    out = paged_decode_attention.eval_shape(*shapes, [[0, 1], [2, -1]], [5, 3], config=DECODE)
    assert out.shape == (2, 2, D) and out.dtype == jnp.float32
    with pytest.raises(TypeError, match="num_splits must be a static Python int >= 1 or None; got num_splits=2.0"):
        paged_decode_attention.eval_shape(*shapes, [[0, 1], [2, -1]], [5, 3], num_splits=2.0)
    assert callable(varlen_attention.lower) and callable(paged_attention.trace)


# ------------------------------------------------------------------------------------------ trace-time errors
# name: (kind, positional index or keyword -> new value (DROP: left out), exception, message regex)
DROP = object()
BAD = {
    "list_of_strings": ("varlen", {3: ["0", "5", "8"]}, TypeError, r"cu_seqlens must be an array of numbers"),
    "ragged_block_tables": ("decode", {3: [[0, 1], [2]]}, TypeError, r"block_tables must be an array"),
    "float_list_for_int32": ("decode", {4: [6.0, 3.0]}, TypeError, r"seq_lens must be int32; got float32"),
    "cu_seqlens_without_entries": ("varlen", {3: []}, ValueError,
                                   r"cu_seqlens must be i32\[num_seqs \+ 1\] \(at least one entry: \[0\] for no "
                                   r"request\); got shape \(0,\)"),
    "max_seqlen_bool": ("varlen", {"max_seqlen": True}, TypeError,
                        r"max_seqlen must be a static Python int >= 1; got max_seqlen=True \(bool\)"),
    "max_seqlen_zero": ("varlen", {"max_seqlen": 0}, ValueError, r"got max_seqlen=0"),
    "max_seqlen_float": ("varlen", {"max_seqlen": 8.0}, TypeError, r"got max_seqlen=8.0 \(float\)"),
    "max_seqlen_jax_array": ("varlen", {"max_seqlen": jnp.int32(8)}, TypeError,
                             r"max_seqlen must be a static Python int >= 1; got a jax array int32\[\]: pass a Python "
                             r"int; it is static .* bucket it"),
    "max_query_len_numpy_array": ("paged", {"max_query_len": np.array(4)}, TypeError,
                                  r"max_query_len must be a static Python int >= 1; got a numpy array"),
    "max_query_len_negative": ("paged", {"max_query_len": -1}, ValueError, r"got max_query_len=-1"),
    "softmax_scale_nan": ("varlen", {"softmax_scale": float("nan")}, ValueError,
                          r"softmax_scale must be None or a finite Python float > 0; got softmax_scale=nan"),
    "softmax_scale_inf": ("decode", {"softmax_scale": np.inf}, ValueError, r"got softmax_scale=inf"),
    "softmax_scale_zero": ("paged", {"softmax_scale": 0.0}, ValueError, r"got softmax_scale=0.0"),
    "softmax_scale_negative": ("sparse", {"softmax_scale": -1.0}, ValueError, r"got softmax_scale=-1.0"),
    "softmax_scale_jax_array": ("varlen", {"softmax_scale": jnp.float32(0.25)}, TypeError,
                                r"softmax_scale must be None or a finite Python float > 0; got a jax array"),
    "causal_str": ("varlen", {"causal": "yes"}, TypeError, r"causal must be a static Python bool; got causal='yes'"),
    "causal_none": ("varlen", {"causal": None}, TypeError, r"got causal=None"),
    "return_lse_int": ("decode", {"return_lse": 1}, TypeError,
                       r"return_lse must be a static Python bool; got return_lse=1 \(int\)"),
    "interpret_str": ("paged", {"interpret": "cpu"}, TypeError,
                      r"interpret must be a static Python bool or None; got interpret='cpu'"),
    "num_splits_zero": ("decode", {"num_splits": 0}, ValueError,
                        r"num_splits must be a static Python int >= 1 or None; got num_splits=0"),
    "num_splits_bool": ("paged", {"num_splits": True}, TypeError, r"got num_splits=True \(bool\)"),
    "split_size_negative": ("decode", {"split_size": -16}, ValueError,
                            r"split_size must be a static Python int >= 1 or None; got split_size=-16"),
    "kv_lora_rank_float": ("sparse", {"kv_lora_rank": 64.0}, TypeError,
                           r"kv_lora_rank must be a static Python int >= 1; got kv_lora_rank=64.0"),
    "sparse_cu_query_lens_rank": ("sparse", {"cu_query_lens": [[0, 1, 2]]}, ValueError,
                                  r"cu_query_lens must be i32\[num_seqs \+ 1\] \(rank 1\); got shape \(1, 3\)"),
    "sparse_topk_rows": ("sparse", {3: [[0, 1]]}, ValueError,
                         r"topk_indices must be i32\[num_tokens=2, topk\]; got \(1, 2\)"),
    "missing_argument": ("paged", {"max_query_len": DROP}, TypeError, r"paged_attention\(\): missing a required"),
}


def _apply(batch, change):
    fn, args, kw = batch
    args, kw = list(args), dict(kw)
    for key, value in change.items():
        if isinstance(key, int):
            args[key] = value
        elif value is DROP:
            kw.pop(key)
        else:
            kw[key] = value
    return fn, args, kw


@pytest.mark.parametrize("name", BAD)
def test_trace_time_mistake_is_named(name, rng):
    kind, change, exc, match = BAD[name]
    fn, args, kw = _apply(_small_batches(rng)[kind], change)
    with pytest.raises(exc, match=match):
        fn(*args, **kw)
    with pytest.raises(exc, match=match):  # the same error through safe mode, before any value is checked
        checked(fn)(*args, **kw)


def test_traced_static_argument_is_named(rng):
    fn, (q, k, v, cu), kw = _small_batches(rng)["varlen"]
    with pytest.raises(TypeError, match=r"max_seqlen must be a static Python int >= 1; got a traced int32\[\]"):
        jax.jit(lambda m: fn(q, k, v, cu, max_seqlen=m))(8)
    with pytest.raises(TypeError, match=r"softmax_scale must be None or a finite Python float > 0; got a traced"):
        jax.jit(lambda s: fn(q, k, v, cu, max_seqlen=8, softmax_scale=s))(0.5)


def test_checked_sparse_seq_lens_shape(rng):
    fn, args, kw = _small_batches(rng)["sparse"]
    with pytest.raises(ValueError, match=r"seq_lens must be i32\[num_seqs\] with num_seqs = block_tables.shape\[0\] "
                                         r"= \(2,\); got \(3,\)"):
        checked(fn)(*args, **kw, seq_lens=[6, 3, 1])


def test_merge_attention_states_shapes(rng):
    outs = jnp.asarray(rng.standard_normal((2, 3, 2, D)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((2, 3, 2)), jnp.float32)
    out, lse = merge_attention_states(np.asarray(outs), np.asarray(lses).tolist())  # numpy and lists accepted
    ref_out, ref_lse = reference.merge_attention_states(outs, lses)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6)
    with pytest.raises(ValueError, match=r"lses must be f32\[num_splits, \.\.\.\] = outs.shape\[:-1\] = \(2, 3, 2\); "
                                         r"got \(2, 3\)"):
        merge_attention_states(outs, lses[..., 0])
    with pytest.raises(ValueError, match=r"need at least one split; got num_splits = 0"):
        merge_attention_states(outs[:0], lses[:0])
    square = outs[:, :2]  # [2, 2, 2, D]: lses [2, 2] would broadcast against [2, 2, 2]; it must not
    with pytest.raises(ValueError, match=r"outs.shape\[:-1\] = \(2, 2, 2\); got \(2, 2\)"):
        merge_attention_states(square, lses[:, :2][:, 0])


# ------------------------------------------------------------------------------------------------ empty batches
# name: rng -> (function, positional arrays, keyword arguments). Each batch has no key for any row.


def _varlen(num_tokens, cu, dtype=jnp.float32):
    def build(rng):
        q, k = _rows(rng, num_tokens, 2, D, dtype), _rows(rng, num_tokens, 1, D, dtype)
        return varlen_attention, (q, k, k, jnp.asarray(cu, I32)), dict(max_seqlen=8, config=PREFILL)
    return build


def _decode(num_seqs, max_blocks, num_blocks=3, lens=None):
    def build(rng):
        cache = _rows(rng, num_blocks * BS, 1, D).reshape(num_blocks, BS, 1, D)
        seq_lens = jnp.zeros((num_seqs,), I32) if lens is None else jnp.asarray(lens, I32)
        return (paged_decode_attention, (_rows(rng, num_seqs, 2, D), cache, cache, _i32(num_seqs, max_blocks),
                                         seq_lens), dict(config=DECODE))
    return build


def _paged(num_tokens, num_seqs, max_blocks=2, num_blocks=3, seq_len=3):
    def build(rng):
        cache = _rows(rng, num_blocks * BS, 1, D).reshape(num_blocks, BS, 1, D)
        return (paged_attention, (_rows(rng, num_tokens, 2, D), cache, cache, _i32(num_seqs, max_blocks),
                                  jnp.full((num_seqs,), seq_len, I32), _i32(num_seqs + 1)),
                dict(max_query_len=4, config=DECODE))
    return build


def _sparse(num_tokens, num_seqs, max_blocks=2, num_blocks=3, topk=4, with_cu=True):
    def build(rng):
        kv = _rows(rng, num_blocks * BS, 1, DQK).reshape(num_blocks, BS, DQK)
        kw = dict(kv_lora_rank=RANK, config=SPARSE)
        if with_cu:
            kw["cu_query_lens"] = _i32(num_seqs + 1)
        return (sparse_mla_attention, (_rows(rng, num_tokens, 4, DQK), kv, _i32(num_seqs, max_blocks),
                                       jnp.zeros((num_tokens, topk), I32)), kw)
    return build


EMPTY = {
    "varlen_no_request": _varlen(8, [0]),
    "varlen_no_token": _varlen(0, [0, 0]),
    "varlen_no_token_no_request": _varlen(0, [0]),
    "varlen_no_request_bf16": _varlen(8, [0], jnp.bfloat16),
    "decode_no_request": _decode(0, 1),
    "decode_no_request_no_column": _decode(0, 0),
    "decode_table_without_columns": _decode(2, 0),
    "decode_empty_pool": _decode(2, 2, num_blocks=0),
    "paged_no_request": _paged(4, 0),
    "paged_no_token": _paged(0, 2),
    "paged_no_token_no_request": _paged(0, 0),
    "paged_table_without_columns": _paged(4, 2, max_blocks=0, seq_len=0),
    "sparse_no_token": _sparse(0, 0),
    "sparse_no_token_decode": _sparse(0, 0, with_cu=False),
    "sparse_no_request": _sparse(3, 0),
    "sparse_no_topk_slot": _sparse(2, 2, topk=0),
    "sparse_table_without_columns": _sparse(2, 2, max_blocks=0),
}


def _reference(fn, args, kw):
    kw = {k: v for k, v in kw.items() if k not in ("config",)}
    return getattr(reference, fn.__name__)(*args, **kw, return_lse=True)


@pytest.mark.parametrize("name", EMPTY)
def test_empty_batch_gives_zeros(name, rng):
    fn, args, kw = EMPTY[name](rng)
    q = args[0]
    out, lse = fn(*args, **kw, return_lse=True)
    dim = RANK if fn is sparse_mla_attention else D
    assert out.shape == (q.shape[0], q.shape[1], dim) and out.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.asarray(lse) == -np.inf)
    ref_out, ref_lse = _reference(fn, args, kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    np.testing.assert_array_equal(np.asarray(fn(*args, **kw)), np.asarray(out))  # return_lse=False: out only

    # Safe mode: nothing to report; the same zeros.
    got, got_lse = checked(fn)(*args, **kw, return_lse=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(lse))


def test_empty_batch_under_jit_and_checkify(rng):
    fn, args, kw = EMPTY["paged_no_request"](rng)
    err, out = jax.jit(checkify.checkify(functools.partial(checked(fn), **kw)))(*args)
    err.throw()
    assert out.shape == args[0].shape and not np.any(np.asarray(out))


def test_empty_request_table_is_still_checked(rng):
    """No request, but a boundary vector that is not [0]: checked reports it like any other."""
    fn, args, kw = EMPTY["varlen_no_request"](rng)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0; got cu_seqlens\[0\]=3"):
        checked(fn)(*args[:3], jnp.array([3], I32), **kw)


def test_all_empty_requests(rng):
    """Requests that exist but hold nothing (a real kernel launch): zeros and -inf, as the reference."""
    q, cu = random_packed(rng, [0, 0, 0], 2, D, jnp.float32, pad_to=5)
    k, _ = random_packed(rng, [0, 0, 0], 1, D, jnp.float32, pad_to=5)
    out, lse = varlen_attention(q, k, k, cu, max_seqlen=8, config=PREFILL, return_lse=True)
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)
    fn, args, kw = _decode(3, 2, lens=[0, 0, 0])(rng)
    out, lse = checked(fn)(*args, **kw, return_lse=True)
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)


def test_corrupt_lengths_are_data_not_trace_errors(rng):
    """Lengths past an empty pool / a table without columns are data: the plain call clamps and masks them (zeros,
    as the reference), only safe mode reports them."""
    fn, args, kw = _decode(2, 2, num_blocks=0)(rng)
    args = (*args[:4], jnp.array([3, 5], I32))
    out, lse = fn(*args, **kw, return_lse=True)
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]=0 is not a page id in \[0, num_blocks=0\)"):
        checked(fn)(*args, **kw)
    fn, args, kw = _paged(4, 2, max_blocks=0)(rng)
    args = (*args[:5], jnp.array([0, 1, 3], I32))
    np.testing.assert_array_equal(np.asarray(fn(*args, **kw)), np.asarray(_reference(fn, args, kw)[0]))
    with pytest.raises(ValueError, match=r"block_tables is too narrow: request 0 has seq_lens=3"):
        checked(fn)(*args, **kw)


# ------------------------------------------------------------------------------------------- differentiation
DIFFERENTIATE = {
    "grad": lambda f, x: jax.grad(lambda x: f(x).sum())(x),
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "vjp": lambda f, x: jax.vjp(f, x),
}


@pytest.mark.parametrize("how", DIFFERENTIATE)
@pytest.mark.parametrize("kind", ["decode", "paged", "sparse"])
def test_differentiation_raises_naming_the_function(kind, how, rng):
    fn, args, kw = _small_batches(rng)[kind]
    of_q = lambda q: fn(q, *args[1:], **kw)
    with pytest.raises(NotImplementedError, match=rf"^{fn.__name__} has no backward pass yet; jax.grad"):
        DIFFERENTIATE[how](of_q, args[0])


def test_stop_gradient_lets_the_rest_differentiate(rng):
    """The workaround the error names: a kernel fed stop_gradient inputs is a constant to jax.grad."""
    fn, (q, k, v, cu), kw = _small_batches(rng)["varlen"]
    grad = jax.grad(lambda x: (fn(jax.lax.stop_gradient(x), k, v, cu, **kw) + x).sum())(q)
    np.testing.assert_array_equal(np.asarray(grad), np.ones(q.shape, np.float32))


def test_guard_costs_nothing_at_runtime(rng, monkeypatch):
    """A plain call traces one custom_jvp_call around the kernel and lowers to exactly the program it lowers to
    without the guard."""
    fn, args, kw = _small_batches(rng)["decode"]
    call = functools.partial(fn, **kw)
    inner = jax.make_jaxpr(call)(*args).eqns[0].params["jaxpr"]  # the jitted function's body
    assert [e.primitive.name for e in inner.eqns] == ["custom_jvp_call"]
    jax.clear_caches()  # trace afresh below (caches only: no semantics)
    guarded = jax.jit(call).lower(*args).as_text()
    monkeypatch.setattr(common, "no_backward", lambda name, f: f)
    jax.clear_caches()
    inner = jax.make_jaxpr(call)(*args).eqns[0].params["jaxpr"]
    assert "custom_jvp_call" not in [e.primitive.name for e in inner.eqns]
    assert jax.jit(call).lower(*args).as_text() == guarded
    jax.clear_caches()


# --------------------------------------------------------------------------------------- checked inside jit


def test_checked_inside_jit_without_checkify_raises_with_the_pattern(rng):
    fn, args, kw = _small_batches(rng)["varlen"]
    step = lambda *a: checked(fn)(*a, **kw)
    with pytest.raises(ValueError, match=r"checked\(varlen_attention\) was called inside jax.jit") as info:
        jax.jit(step)(*args)
    message = str(info.value)
    assert "jax.jit(checkify.checkify(step))" in message and "err.throw()" in message
    with pytest.raises(ValueError, match=r"checked\(paged_decode_attention\) was called inside jax.jit"):
        fn, args, kw = _small_batches(rng)["decode"]
        jax.jit(lambda *a: jax.lax.cond(True, lambda: checked(fn)(*a, **kw), lambda: fn(*a, **kw)))(*args)


def test_checked_inside_jit_of_checkify(rng):
    """The documented pattern: jax.jit(checkify.checkify(step)); good data gives the kernel's output, bad data an
    error naming the argument (and zeros: the kernel is skipped)."""
    fn, args, kw = _small_batches(rng)["varlen"]
    step = jax.jit(checkify.checkify(lambda *a: checked(fn)(*a, **kw, return_lse=True)))
    err, got = step(*args)
    err.throw()
    for w, g in zip(fn(*args, **kw, return_lse=True), got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    err, (out, _) = step(*args[:3], jnp.array([0, 9, 8], I32))
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing; request 1 has cu_seqlens\[1\]=9 > "
                                         r"cu_seqlens\[2\]=8"):
        err.throw()
    assert not np.any(np.asarray(out))
