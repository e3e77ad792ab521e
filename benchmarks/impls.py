"""Implementations the harness times: the interface, and ours (``pallas_attn`` and its variants).

An :class:`Impl` says which workloads it serves and how to prepare them: ``prepare(batches, options)`` runs
OUTSIDE the timing (layout changes, sub-batch slicing, padding for an anchor's constraints) and returns a
:class:`Prepared`: one jitted function, one argument tuple per input set (the harness rotates between them), and a
``canonical`` function that maps the function's output to the workload's canonical layout for the correctness
check (prefill / ragged: packed ``[num_tokens, Hq, D]``; decode: ``[num_seqs, Hq, D]``; sparse and mla:
``[num_tokens, H, kv_lora_rank]``; a training step, ``prefill-bwd``: the packed gradients ``(dq [T, Hq, D],
dk [T, Hkv, D], dv [T, Hkv, D])``). The anchors live in :mod:`benchmarks.anchors`.

A training step is any implementation's forward wrapped by :func:`with_grads`: the timed function returns the
output and, through ``jax.vjp``, the gradients for q, k and v under the workload's cotangent ``d_out``
(:func:`forward_and_grads`), so ours and every anchor run the same definition.

Names: ours are ``pallas_attn`` or ``pallas_attn/<variant>``:
  pallas_attn            the kernel for the workload's kind (varlen / paged decode / ragged paged / sparse MLA /
                         dense MLA; a training step: varlen forward + its custom_vjp backward)
  pallas_attn/no_split   paged decode with ``num_splits=1`` (no split-KV), for the long-context and sweep cases
  pallas_attn/paged      a decode workload run through the ragged ``paged_attention`` (q_len = 1 each)
  pallas_attn/parts      a mixed ragged batch run as separate calls, one per request group (decodes through
                         ``paged_decode_attention``, the others through ``paged_attention``)
  pallas_attn/mosaic     ``backend="mosaic"``, the Hopper kernels (GPU only): varlen prefill (in a training step
                         forward and backward: ``backward_backend="mosaic"``), paged decode and ragged batches
                         whose cache the Mosaic paged kernel takes (q's dtype or FP8, head dim 64 / 128 / 256),
                         dense MLA (L1, L2)
  pallas_attn/triton     varlen prefill / training step / sparse and dense MLA with ``backend="triton"`` (the
                         default picks per GPU and shape)
  pallas_attn/<NAME>     a ``--variant NAME:key=value,...`` of the command line (:mod:`benchmarks.variants`)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import FEATURE_KWARGS, FP8_KWARGS, PACKED_KINDS, Batch, Draw, Spec

OURS = "pallas_attn"


@dataclasses.dataclass
class Options:
    """Run-wide settings handed to every ``prepare``.

    interpret: run Pallas kernels (ours and JAX's) interpreted (CPU smoke runs).
    tiny: the ``--tiny`` shapes are in use (anchors pick smaller block sizes).
    overrides: keyword arguments for our kernel (``config=``, ``num_splits=``), used by the sweep.
    """
    interpret: bool
    tiny: bool = False
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Prepared:
    fn: Callable  # jitted: fn(*args) -> output pytree
    args: list[tuple]  # one argument tuple per input set
    canonical: Callable[[Any], Any]  # output -> canonical layout (for the correctness check only)
    note: str = ""  # shown in the JSON row (e.g. the split count or padding an anchor needed)
    check_args: tuple | None = None  # what the correctness check calls fn with; None: args[0]


@dataclasses.dataclass(frozen=True)
class Impl:
    """One row per workload it serves.

    applies: the workloads it is meant for; features: the model-family keywords it can run
    (:attr:`Spec.features`; ours: those its public function takes). A workload using a feature outside them is
    not run (``--list`` shows it as unsupported), never run without it. limits: the shape limits a workload it is
    meant for passes (``{"head_dim 576 > 512"}``); such a workload is not run either, and ``--list`` names the limit
    the same way. spec_for: the workload as this row runs it
    (a ``--variant`` may turn a feature on); twin_impl: the implementation its rows are measured against on the
    same workload (``ratio_to_twin``), if any.
    """
    name: str
    applies: Callable[[Spec], bool]
    prepare: Callable[[list[Batch], Options], Prepared]
    anchor: bool = True  # False for ours: "ratio to best anchor" compares against anchor rows only
    features: Callable[[Spec], frozenset[str]] = lambda spec: frozenset()
    limits: Callable[[Spec], frozenset[str]] = lambda spec: frozenset()
    spec_for: Callable[[Spec], Spec] = lambda spec: spec
    twin_impl: Callable[[Spec], str | None] = lambda spec: None

    @property
    def ours(self) -> bool:
        return not self.anchor

    def unsupported(self, spec: Spec) -> frozenset[str]:
        """The model-family keywords the workload (as this row runs it) uses and this implementation cannot, and the
        shape limits it passes."""
        return (self.spec_for(spec).features - self.features(spec)) | self.limits(spec)

    def serves(self, spec: Spec) -> bool:
        return self.applies(spec) and not self.unsupported(spec)


def identity(x):
    return x


def takes(function_name: str) -> Callable[[Spec], frozenset[str]]:
    """The model-family keywords a public function of pallas_attn takes (an older revision, under ``--baseline``,
    may take none; a function gains them without a change here)."""
    def features(spec: Spec) -> frozenset[str]:
        import pallas_attn
        function = getattr(pallas_attn, function_name, None)
        if function is None:  # a --baseline revision older than the function: its row records the error
            return frozenset()
        params = inspect.signature(function).parameters
        return frozenset(k for k in (*FEATURE_KWARGS, *FP8_KWARGS) if k in params)

    return features


def _features(batch: Batch) -> dict:
    """The arrays among the workload's feature arguments (sinks, slopes), passed to the jitted call as data."""
    kw = batch.spec.feature_kwargs(batch.arrays)
    return {k: v for k, v in kw.items() if isinstance(v, jax.Array)}


def _static_features(spec: Spec) -> dict:
    """The static feature arguments (window_size, softcap), bound into the jitted call."""
    return {k: v for k, v in spec.feature_kwargs({}).items() if v is not None}


def _interpret_kw(options: Options) -> dict:
    # None lets pallas_attn resolve it (PALLAS_ATTN_INTERPRET, then the backend); the harness passes its choice.
    return {"interpret": options.interpret}


# ------------------------------------------------------------------------------------------- training step
def forward_and_grads(attend: Callable, q, k, v, d_out):
    """One training step of an attention call: ``attend(q, k, v)`` and its gradients for q, k and v under the
    cotangent ``d_out`` (``jax.vjp``'s pullback): the forward and the backward that ``jax.grad`` of a loss through
    the call runs, without the loss. Returns ``(out, (dq, dk, dv))`` in ``attend``'s layouts."""
    out, pullback = jax.vjp(attend, q, k, v)
    return out, pullback(d_out)


def with_grads(forward: Prepared, batches: list[Batch], *, cotangent: Callable = identity,
               grads: Callable = identity) -> Prepared:
    """The training step of a forward :class:`Prepared` whose ``fn(q, k, v, *rest)`` takes q, k and v first.

    The timed function is :func:`forward_and_grads` of ``forward.fn`` on the workload's ``d_out [T, Hq, D]``, which
    ``cotangent`` maps to ``forward.fn``'s output layout (outside the timing, like the forward's own layout work);
    ``grads`` maps the gradients from ``forward.fn``'s input layouts to the packed ``(dq [T, Hq, D], dk [T, Hkv, D],
    dv [T, Hkv, D])`` (the check only). The check runs the same function on :func:`benchmarks.checks.
    check_cotangent`: ``d_out`` on the rows whose gradients the reference computes, zero elsewhere."""
    from benchmarks import checks
    attend = forward.fn

    @jax.jit
    def fn(q, k, v, d_out, *rest):
        return forward_and_grads(lambda q, k, v: attend(q, k, v, *rest), q, k, v, d_out)

    def step_args(args: tuple, d_out) -> tuple:
        return (*args[:3], cotangent(d_out), *args[3:])

    args = [step_args(a, b.arrays["d_out"]) for a, b in zip(forward.args, batches)]
    return Prepared(fn, args, lambda res: grads(res[1]), note=forward.note,
                    check_args=step_args(forward.args[0], checks.check_cotangent(batches[0])))


# --------------------------------------------------------------------------------------------------- ours
def _prepare_prefill(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    host = batches[0].host
    kw = dict(max_seqlen=int(host.seq_lens.max()), causal=host.spec.causal, **_static_features(host.spec),
              **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, k, v, cu, feats: pallas_attn.varlen_attention(q, k, v, cu, **kw, **feats))
    args = [(b.arrays["q"], b.arrays["k"], b.arrays["v"], b.arrays["cu_seqlens"], _features(b)) for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


def _prepare_prefill_bwd(batches: list[Batch], options: Options, **extra) -> Prepared:
    """``varlen_attention``'s training step: its forward (the backend the call picks) and its custom_vjp backward
    (``backward_backend``: Triton by default); ``backward_config`` comes with ``extra`` or the sweep's overrides."""
    return with_grads(_prepare_prefill(batches, options, **extra), batches)


def _decode_args(b: Batch):
    a = b.arrays
    return a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["context_lens"], _features(b)


def _split_note(batch: Batch, options: Options, kwargs: dict) -> str:
    """The static split plan the decode wrapper will use, from the planners it calls itself
    (``ops/decode.py::split_plan``; under ``backend="mosaic"`` ``ops/paged.py::mosaic_plan``, whose looping
    programs the note marks ``persistent``)."""
    s, host = batch.spec, batch.host
    try:
        from pallas_attn.core import config as config_lib, masks
        from pallas_attn.ops import decode as decode_op, paged as paged_op
        q = jax.ShapeDtypeStruct((host.num_seqs, s.num_q_heads, s.head_dim), s.jnp_dtype)
        cache = jax.ShapeDtypeStruct((1, s.block_size, s.num_kv_heads, s.head_dim), s.kv_jnp_dtype)
        mods = masks.ScoreMods(window_left=s.window_left)
        given = dict(num_splits=kwargs.get("num_splits"), split_size=kwargs.get("split_size"))
        loop = False
        if kwargs.get("backend") == "mosaic":
            plan, _ = paged_op.mosaic_plan(q, cache, host.block_tables, mods, max_query_len=1, **given)
            splits, size, loop = plan
        else:
            cfg = kwargs.get("config") or config_lib.default_decode_config(s.head_dim, s.block_size,
                                                                           s.jnp_dtype.itemsize)
            splits, size = decode_op.split_plan(q, cache, host.block_tables, mods, cfg, **given)
    except Exception as e:  # noqa: BLE001 - a note must never fail a run (nor a baseline revision's layout)
        return f"splits=? ({type(e).__name__})"
    return f"splits={splits}" + (f" split_size={size}" if size else "") + (" persistent" if loop else "")


def _config_note(options: Options) -> str:
    return " ".join(repr(options.overrides[k]) for k in ("config", "backward_config")
                    if options.overrides.get(k) is not None)


def _prepare_decode(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    overrides = {**options.overrides, **extra}
    kw = dict(**_static_features(batches[0].spec), **_interpret_kw(options), **overrides)
    fn = jax.jit(lambda q, kc, vc, bt, cl, feats: pallas_attn.paged_decode_attention(q, kc, vc, bt, cl, **kw,
                                                                                      **feats))
    note = " ".join(x for x in [_split_note(batches[0], options, overrides), _config_note(options)] if x)
    return Prepared(fn, [_decode_args(b) for b in batches], identity, note=note)


def _prepare_decode_as_ragged(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    kw = dict(max_query_len=1, **_static_features(batches[0].spec), **_interpret_kw(options), **options.overrides,
              **extra)
    fn = jax.jit(lambda q, kc, vc, bt, sl, feats, cu: pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, **kw,
                                                                                   **feats))
    cu = jnp.arange(batches[0].host.num_seqs + 1, dtype=jnp.int32)
    args = [(*_decode_args(b), cu) for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


def _ragged_args(b: Batch):
    a = b.arrays
    return a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["cu_query_lens"], _features(b)


def _prepare_ragged(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    kw = dict(max_query_len=batches[0].host.max_query_len, **_static_features(batches[0].spec),
              **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, kc, vc, bt, sl, cu, feats: pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, **kw,
                                                                                   **feats))
    return Prepared(fn, [_ragged_args(b) for b in batches], identity, note=_config_note(options))


def request_groups(host) -> list[np.ndarray]:
    """Request indices of each of the spec's groups, in order."""
    sizes = [g.seq_lens.n if isinstance(g.seq_lens, Draw) else len(g.seq_lens) for g in host.spec.groups]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _prepare_ragged_parts(batches: list[Batch], options: Options) -> Prepared:
    """One call per request group: decodes through paged_decode_attention, the rest through paged_attention.
    Sub-batch slicing happens here, outside the timing; the parts' outputs are concatenated only for the check."""
    import pallas_attn
    host = batches[0].host
    groups = request_groups(host)
    plans = []  # (is_decode, row slice, max_query_len, request index array)
    for idx in groups:
        rows = slice(int(host.cu_query_lens[idx[0]]), int(host.cu_query_lens[idx[-1] + 1]))
        q_lens = host.q_lens[idx]
        plans.append((bool(np.all(q_lens == 1)), rows, int(q_lens.max()), idx))
    kw = dict(**_static_features(host.spec), **_interpret_kw(options), **options.overrides)

    def fn(q_parts, kc, vc, tables, lens, cus, feats):
        outs = []
        for (is_decode, _, mql, _), q, bt, sl, cu in zip(plans, q_parts, tables, lens, cus):
            if is_decode:
                outs.append(pallas_attn.paged_decode_attention(q, kc, vc, bt, sl, **kw, **feats))
            else:
                outs.append(pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, max_query_len=mql, **kw, **feats))
        return tuple(outs)

    def args_for(b: Batch):
        a = b.arrays
        q_parts = tuple(a["q"][rows] for _, rows, _, _ in plans)
        tables = tuple(jnp.asarray(host.block_tables[idx]) for *_, idx in plans)
        lens = tuple(jnp.asarray(host.seq_lens[idx], jnp.int32) for *_, idx in plans)
        cus = tuple(jnp.asarray(np.concatenate([[0], np.cumsum(host.q_lens[idx])]), jnp.int32) for *_, idx in plans)
        return q_parts, a["k_cache"], a["v_cache"], tables, lens, cus, _features(b)

    return Prepared(jax.jit(fn), [args_for(b) for b in batches], lambda outs: jnp.concatenate(outs, axis=0),
                    note=f"{len(plans)} calls")


def _prepare_sparse(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    s = batches[0].spec
    kw = dict(kv_lora_rank=s.kv_lora_rank, **_static_features(s), **_interpret_kw(options), **options.overrides,
              **extra)
    fn = jax.jit(lambda q, kv, bt, ti, feats: pallas_attn.sparse_mla_attention(q, kv, bt, ti, **kw, **feats))
    args = [(b.arrays["q"], b.arrays["kv_cache"], b.arrays["block_tables"], b.arrays["topk_indices"], _features(b))
            for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


def mla_cu_query_lens(batch: Batch):
    """``cu_query_lens`` as the MLA kinds pass it: None for a decode (one new token per request), else the array."""
    return None if batch.host.one_token_each else batch.arrays["cu_query_lens"]


def _prepare_mla(batches: list[Batch], options: Options, **extra) -> Prepared:
    """``mla_attention`` with default arguments; ``extra``: a row's own keyword arguments (a ``--variant``'s, or a
    ``backend=`` row's, as ``pallas_attn/triton`` passes one to the sparse kernel)."""
    import pallas_attn
    host = batches[0].host
    kw = dict(max_query_len=host.max_query_len, kv_lora_rank=host.spec.kv_lora_rank, **_interpret_kw(options),
              **options.overrides, **extra)
    fn = jax.jit(lambda q, kv, bt, sl, cu, feats: pallas_attn.mla_attention(q, kv, bt, sl, cu, **kw, **feats))
    args = [(b.arrays["q"], b.arrays["kv_cache"], b.arrays["block_tables"], b.arrays["seq_lens"], mla_cu_query_lens(b),
             _features(b)) for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


PREPARE_BY_KIND = {"prefill": _prepare_prefill, "prefill-bwd": _prepare_prefill_bwd, "decode": _prepare_decode,
                   "ragged": _prepare_ragged, "sparse": _prepare_sparse, "mla": _prepare_mla}
FUNCTION_BY_KIND = {"prefill": "varlen_attention", "prefill-bwd": "varlen_attention",
                    "decode": "paged_decode_attention", "ragged": "paged_attention", "sparse": "sparse_mla_attention",
                    "mla": "mla_attention"}  # the public function each kind calls


def _prepare_ours(batches: list[Batch], options: Options, **extra) -> Prepared:
    return PREPARE_BY_KIND[batches[0].spec.kind](batches, options, **extra)


def _prepare_mosaic(batches: list[Batch], options: Options) -> Prepared:
    """Every kernel of the row on Mosaic GPU: the forward's ``backend``, and a training step's backward too."""
    extra = dict(backward_backend="mosaic") if batches[0].spec.kind == "prefill-bwd" else {}
    return _prepare_ours(batches, options, backend="mosaic", **extra)


def _on_gpu_mosaic(spec: Spec) -> bool:
    """The Mosaic GPU kernels of varlen prefill and the paged functions: compiled on a GPU only (their interpreter
    takes seconds for a few dozen tokens); the paged one where it takes the cache (its head dims and page sizes:
    other shapes raise, which an error row would only repeat); dense MLA's where its head count and dims fit."""
    from pallas_attn.core import backend
    from pallas_attn.kernels.mosaic import paged as mosaic_paged, sparse_mla as mosaic_mla
    paged = (spec.kind in ("decode", "ragged") and spec.head_dim in mosaic_paged.HEAD_DIMS
             and spec.block_size % mosaic_paged.ROW_ALIGN == 0)
    mla = spec.kind == "mla" and mosaic_mla.supported(
        jax.ShapeDtypeStruct((1, spec.num_q_heads, spec.head_dim), jnp.bfloat16), spec.kv_lora_rank) is None
    return (spec.kind in PACKED_KINDS or paged or mla) and backend.on_gpu()


def _is_mixed(spec: Spec) -> bool:
    return spec.kind == "ragged" and len(spec.groups) > 1


def takes_for_kind(spec: Spec) -> frozenset[str]:
    """The model-family keywords the public function of the workload's kind takes."""
    return takes(FUNCTION_BY_KIND[spec.kind])(spec)


def _parts_features(spec: Spec) -> frozenset[str]:
    return takes("paged_decode_attention")(spec) & takes("paged_attention")(spec)


OUR_IMPLS: list[Impl] = [
    Impl(OURS, lambda s: True, _prepare_ours, anchor=False, features=takes_for_kind),
    Impl(f"{OURS}/no_split", lambda s: s.kind == "decode" and s.id != "D1",
         lambda b, o: _prepare_decode(b, o, num_splits=1), anchor=False, features=takes("paged_decode_attention")),
    Impl(f"{OURS}/paged", lambda s: s.kind == "decode" and not s.family, _prepare_decode_as_ragged, anchor=False,
         features=takes("paged_attention")),
    Impl(f"{OURS}/parts", _is_mixed, _prepare_ragged_parts, anchor=False, features=_parts_features),
    Impl(f"{OURS}/mosaic", _on_gpu_mosaic, _prepare_mosaic, anchor=False,
         features=takes_for_kind),
    Impl(f"{OURS}/triton", lambda s: s.kind in (*PACKED_KINDS, "sparse", "mla"),
         lambda b, o: _prepare_ours(b, o, backend="triton"), anchor=False, features=takes_for_kind),
]


def all_impls() -> list[Impl]:
    from benchmarks import anchors
    return OUR_IMPLS + anchors.ANCHORS


def select(impls: list[Impl], selectors: list[str] | None) -> list[Impl]:
    """``--impl a,b``: a selector matches a name exactly, or every ``name/...`` variant of it
    (``pallas_attn`` selects ``pallas_attn/no_split`` too; ``pallas_attn/paged`` only itself); ``none`` selects
    nothing (the ``--variant`` and ``--baseline`` rows still run)."""
    if not selectors:
        return impls
    if [s.lower() for s in selectors] == ["none"]:
        return []
    known = {i.name for i in impls}
    picked = [i for i in impls if any(i.name == s or i.name.startswith(s + "/") for s in selectors)]
    unknown = [s for s in selectors if not any(n == s or n.startswith(s + "/") for n in known)]
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; known: {sorted(known)}")
    return picked
