"""Implementations the harness times: the interface, and ours (``pallas_attn`` and its variants).

An :class:`Impl` says which workloads it serves and how to prepare them: ``prepare(batches, options)`` runs
OUTSIDE the timing (layout changes, sub-batch slicing, padding for an anchor's constraints) and returns a
:class:`Prepared`: one jitted function, one argument tuple per input set (the harness rotates between them), and a
``canonical`` function that maps the function's output to the workload's canonical layout for the correctness
check (prefill / ragged: packed ``[num_tokens, Hq, D]``; decode: ``[num_seqs, Hq, D]``; sparse: ``[num_tokens, H,
kv_lora_rank]``). The anchors live in :mod:`benchmarks.anchors`.

Names: ours are ``pallas_attn`` or ``pallas_attn/<variant>``:
  pallas_attn            the kernel for the workload's kind (varlen / paged decode / ragged paged / sparse MLA)
  pallas_attn/no_split   paged decode with ``num_splits=1`` (no split-KV), for the long-context and sweep cases
  pallas_attn/paged      a decode workload run through the ragged ``paged_attention`` (q_len = 1 each)
  pallas_attn/parts      a mixed ragged batch run as separate calls, one per request group (decodes through
                         ``paged_decode_attention``, the others through ``paged_attention``)
  pallas_attn/mosaic     varlen prefill with ``backend="mosaic"`` (the Hopper kernel; GPU only)
  pallas_attn/triton     varlen prefill / sparse MLA with ``backend="triton"`` (the default picks per GPU and shape)
  pallas_attn/<NAME>     a ``--variant NAME:key=value,...`` of the command line (:mod:`benchmarks.variants`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import Batch, Draw, Spec

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
    canonical: Callable[[Any], jax.Array]  # output -> canonical layout (for the correctness check only)
    note: str = ""  # shown in the JSON row (e.g. the split count or padding an anchor needed)


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    applies: Callable[[Spec], bool]
    prepare: Callable[[list[Batch], Options], Prepared]
    anchor: bool = True  # False for ours: "ratio to best anchor" compares against anchor rows only

    @property
    def ours(self) -> bool:
        return not self.anchor


def identity(x):
    return x


def _interpret_kw(options: Options) -> dict:
    # None lets pallas_attn resolve it (PALLAS_ATTN_INTERPRET, then the backend); the harness passes its choice.
    return {"interpret": options.interpret}


# --------------------------------------------------------------------------------------------------- ours
def _prepare_prefill(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    host = batches[0].host
    kw = dict(max_seqlen=int(host.seq_lens.max()), **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, k, v, cu: pallas_attn.varlen_attention(q, k, v, cu, **kw))
    args = [(b.arrays["q"], b.arrays["k"], b.arrays["v"], b.arrays["cu_seqlens"]) for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


def _decode_args(b: Batch):
    a = b.arrays
    return a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["context_lens"]


def _split_note(batch: Batch, options: Options, kwargs: dict) -> str:
    """The static split count the decode wrapper will use (the same call as ``ops/decode.py`` makes)."""
    s, host = batch.spec, batch.host
    try:
        from pallas_attn.core import config as config_lib
        cfg = kwargs.get("config") or config_lib.default_decode_config(s.head_dim, s.block_size, s.jnp_dtype.itemsize)
        splits, size = config_lib.resolve_splits(host.num_seqs * s.num_kv_heads,
                                                 host.block_tables.shape[1] * s.block_size, cfg.block_n,
                                                 kwargs.get("num_splits"), kwargs.get("split_size"))
    except Exception as e:  # noqa: BLE001 - a note must never fail a run (nor a baseline revision's layout)
        return f"splits=? ({type(e).__name__})"
    return f"splits={splits}" + (f" split_size={size}" if size else "")


def _config_note(options: Options) -> str:
    cfg = options.overrides.get("config")
    return "" if cfg is None else repr(cfg)


def _prepare_decode(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    overrides = {**options.overrides, **extra}
    kw = dict(**_interpret_kw(options), **overrides)
    fn = jax.jit(lambda q, kc, vc, bt, cl: pallas_attn.paged_decode_attention(q, kc, vc, bt, cl, **kw))
    note = " ".join(x for x in [_split_note(batches[0], options, overrides), _config_note(options)] if x)
    return Prepared(fn, [_decode_args(b) for b in batches], identity, note=note)


def _prepare_decode_as_ragged(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    kw = dict(max_query_len=1, **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, kc, vc, bt, sl, cu: pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, **kw))
    cu = jnp.arange(batches[0].host.num_seqs + 1, dtype=jnp.int32)
    args = [(*_decode_args(b), cu) for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


def _ragged_args(b: Batch):
    a = b.arrays
    return a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["cu_query_lens"]


def _prepare_ragged(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    kw = dict(max_query_len=batches[0].host.max_query_len, **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, kc, vc, bt, sl, cu: pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, **kw))
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
    ikw = _interpret_kw(options)

    def fn(q_parts, kc, vc, tables, lens, cus):
        outs = []
        for (is_decode, _, mql, _), q, bt, sl, cu in zip(plans, q_parts, tables, lens, cus):
            if is_decode:
                outs.append(pallas_attn.paged_decode_attention(q, kc, vc, bt, sl, **ikw, **options.overrides))
            else:
                outs.append(pallas_attn.paged_attention(q, kc, vc, bt, sl, cu, max_query_len=mql, **ikw,
                                                        **options.overrides))
        return tuple(outs)

    def args_for(b: Batch):
        a = b.arrays
        q_parts = tuple(a["q"][rows] for _, rows, _, _ in plans)
        tables = tuple(jnp.asarray(host.block_tables[idx]) for *_, idx in plans)
        lens = tuple(jnp.asarray(host.seq_lens[idx], jnp.int32) for *_, idx in plans)
        cus = tuple(jnp.asarray(np.concatenate([[0], np.cumsum(host.q_lens[idx])]), jnp.int32) for *_, idx in plans)
        return q_parts, a["k_cache"], a["v_cache"], tables, lens, cus

    return Prepared(jax.jit(fn), [args_for(b) for b in batches], lambda outs: jnp.concatenate(outs, axis=0),
                    note=f"{len(plans)} calls")


def _prepare_sparse(batches: list[Batch], options: Options, **extra) -> Prepared:
    import pallas_attn
    s = batches[0].spec
    kw = dict(kv_lora_rank=s.kv_lora_rank, **_interpret_kw(options), **options.overrides, **extra)
    fn = jax.jit(lambda q, kv, bt, ti: pallas_attn.sparse_mla_attention(q, kv, bt, ti, **kw))
    args = [(b.arrays["q"], b.arrays["kv_cache"], b.arrays["block_tables"], b.arrays["topk_indices"])
            for b in batches]
    return Prepared(fn, args, identity, note=_config_note(options))


PREPARE_BY_KIND = {"prefill": _prepare_prefill, "decode": _prepare_decode, "ragged": _prepare_ragged,
                   "sparse": _prepare_sparse}
FUNCTION_BY_KIND = {"prefill": "varlen_attention", "decode": "paged_decode_attention", "ragged": "paged_attention",
                    "sparse": "sparse_mla_attention"}  # the public function each kind's rows call


def _prepare_ours(batches: list[Batch], options: Options, **extra) -> Prepared:
    return PREPARE_BY_KIND[batches[0].spec.kind](batches, options, **extra)


def _on_gpu_prefill(spec: Spec) -> bool:
    """The Mosaic GPU prefill: compiled on a GPU only (its interpreter takes seconds for a few dozen tokens)."""
    from pallas_attn.core import backend
    return spec.kind == "prefill" and backend.on_gpu()


def _is_mixed(spec: Spec) -> bool:
    return spec.kind == "ragged" and len(spec.groups) > 1


OUR_IMPLS: list[Impl] = [
    Impl(OURS, lambda s: True, _prepare_ours, anchor=False),
    Impl(f"{OURS}/no_split", lambda s: s.kind == "decode" and s.id != "D1",
         lambda b, o: _prepare_decode(b, o, num_splits=1), anchor=False),
    Impl(f"{OURS}/paged", lambda s: s.kind == "decode" and not s.family, _prepare_decode_as_ragged, anchor=False),
    Impl(f"{OURS}/parts", _is_mixed, _prepare_ragged_parts, anchor=False),
    Impl(f"{OURS}/mosaic", _on_gpu_prefill, lambda b, o: _prepare_prefill(b, o, backend="mosaic"), anchor=False),
    Impl(f"{OURS}/triton", lambda s: s.kind in ("prefill", "sparse"),
         lambda b, o: (_prepare_sparse if b[0].spec.kind == "sparse" else _prepare_prefill)(b, o, backend="triton"),
         anchor=False),
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
