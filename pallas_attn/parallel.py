"""More than one GPU: tensor-parallel heads and context-parallel decode, on JAX's own SPMD machinery.

Nothing here is a new kernel. Every public kernel is a pure, jittable function of arrays, so it runs unchanged inside
:func:`jax.shard_map`; this module only supplies the :class:`~jax.sharding.PartitionSpec` s and the one cross-device
reduction (the split-KV merge of :func:`pallas_attn.merge_attention_states`, one level up).

**Tensor parallelism** (:func:`tensor_parallel`): a mesh axis of ``n`` devices splits the heads. Each device holds
``num_kv_heads / n`` KV heads and the ``num_q_heads / n`` query heads of their GQA groups (query head ``h`` reads KV
head ``h // group``, so contiguous chunks of both line up); per-request metadata (``cu_seqlens``, block tables,
lengths, top-k indices) is replicated. No communication: each head is computed exactly as on one device.

==========================  =======================================================================================
kernel                      sharded arguments (others replicated)
==========================  =======================================================================================
``varlen_attention``        ``q``, ``k``, ``v`` on axis 1 (heads)
``paged_decode_attention``  ``q`` on axis 1, ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]`` on axis 2
``paged_attention``         same as decode
``sparse_mla_attention``    ``q`` on axis 1 only: one shared latent head, the latent cache is replicated
``mla_attention``           same as sparse MLA (DeepSeek-V3 on 8 GPUs: 16 of its 128 heads on each)
==========================  =======================================================================================

Outputs (and LSEs) come back sharded on their head axis, i.e. one global array equal to the single-device result.
The split-KV heuristic counts ``num_seqs × num_kv_heads`` programs per device, so with ``num_splits=None`` a device
holding fewer heads may choose more segments than one device would (last-bit differences); pass ``num_splits`` or
``split_size`` for results bit-identical to the single-device call.

**Context parallelism** (:func:`context_parallel_decode`): the paged K/V of long requests is spread over the devices
of a mesh axis. Each device has its own page pool (``k_cache [n, num_blocks, block_size, Hkv, D]`` sharded on axis
0), its own block-table slice covering a contiguous, page-aligned range of each request's logical pages
(``block_tables [n, num_seqs, max_blocks_local]``) and the number of keys it holds per request (``seq_lens [n,
num_seqs]``). Each device runs :func:`pallas_attn.paged_decode_attention` with ``return_lse=True`` on its slice; the
partial states are then merged across devices, either by an all-gather of ``(out, lse)`` followed by
:func:`pallas_attn.merge_attention_states` (``merge="all_gather"``, the default: the same fixed-order fold as
split-KV) or by a ``pmax``/``psum`` of rescaled numerators and denominators (``merge="psum"``: ``n`` times less
traffic). A device holding no key of a request returns LSE ``-inf`` for it and is ignored by the merge.
:func:`split_context_pages` and :func:`shard_paged_cache` build those per-device inputs from one global cache.

Example (2 host devices on CPU: ``XLA_FLAGS=--xla_force_host_platform_device_count=2``; on 2 GPUs as is)::

    import jax, jax.numpy as jnp, numpy as np
    from pallas_attn import paged_decode_attention, parallel
    from pallas_attn.testing import make_paged_kv

    mesh = jax.make_mesh((2,), ("tp",))
    rng = np.random.default_rng(0)
    ctx = [70, 5, 0]
    k_cache, v_cache, tables = make_paged_kv(rng, ctx, 16, 4, 64, jnp.float32, table_padding="neg")
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    lens = jnp.asarray(ctx, jnp.int32)

    # tensor parallel: 2 KV heads (and 4 query heads) per device
    decode_tp = parallel.tensor_parallel(paged_decode_attention, mesh, "tp", num_splits=1)
    out_tp = decode_tp(q, k_cache, v_cache, tables, lens)        # == paged_decode_attention(q, ..., num_splits=1)

    # context parallel: each request's pages cut in 2 contiguous chunks, one pool per device
    cp = jax.make_mesh((2,), ("cp",))
    shards = parallel.split_context_pages(tables, lens, block_size=16, n_dev=2)
    kc = parallel.shard_paged_cache(k_cache, shards.page_map)    # [2, local_blocks, 16, 4, 64]
    vc = parallel.shard_paged_cache(v_cache, shards.page_map)
    out_cp = parallel.context_parallel_decode(q, kc, vc, shards, mesh=cp)  # shards: tables, lengths, block_size
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from pallas_attn.core import softmax, validation
from pallas_attn.ops import common
from pallas_attn.ops.common import renamed_argument
from pallas_attn.ops.decode import paged_decode_attention
from pallas_attn.ops.merge import merge_attention_states
from pallas_attn.ops.mla import mla_attention
from pallas_attn.ops.paged import paged_attention
from pallas_attn.ops.sparse_mla import sparse_mla_attention
from pallas_attn.ops.varlen import varlen_attention

__all__ = ["ContextShards", "context_parallel_decode", "cross_device_merge", "shard_paged_cache", "split_context_pages",
           "tensor_parallel", "tensor_parallel_specs"]


# ----------------------------------------------------------------------------------------- tensor parallelism
def _placed(mesh: Mesh, axis: str, arrays, specs):
    """Move each array to its spec's sharding (a no-op when it already has it). Needed with ``Explicit`` mesh axes
    (``jax.make_mesh``'s default), where shard_map refuses inputs whose sharding differs from ``in_specs``."""
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis] != AxisType.Explicit:  # Auto: shard_map reshards itself
        return list(arrays)
    return [jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]


_LATENT = (sparse_mla_attention, mla_attention)  # one shared latent head: only the queries' heads are split


def tensor_parallel_specs(kernel: Callable, axis: str = "tp", *, with_cu_query_lens: bool = False
                          ) -> tuple[tuple[P, ...], P]:
    """``(in_specs, out_spec)`` sharding ``kernel``'s heads over mesh axis ``axis`` (its positional arrays, in order).

    ``out_spec`` is the spec of the output and of the LSE (both ``[tokens, heads, ...]``, sharded on axis 1).
    ``with_cu_query_lens``: MLA (sparse or dense) only, append a replicated spec for the ``cu_query_lens``
    argument.
    """
    heads = P(None, axis)  # q / k / v / out [tokens, heads, D], lse [tokens, heads]
    cache = P(None, None, axis)  # [num_blocks, block_size, heads, D]
    rep = P()
    if kernel is varlen_attention:  # q, k, v, cu_seqlens
        return (heads, heads, heads, rep), heads
    if kernel is paged_decode_attention:  # q, k_cache, v_cache, block_tables, seq_lens
        return (heads, cache, cache, rep, rep), heads
    if kernel is paged_attention:  # q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens
        return (heads, cache, cache, rep, rep, rep), heads
    if kernel in _LATENT:  # q, kv_cache, block_tables, topk_indices / seq_lens[, cu_query_lens]
        return (heads, rep, rep, rep) + ((rep,) if with_cu_query_lens else ()), heads
    raise ValueError(f"tensor_parallel knows varlen_attention, paged_decode_attention, paged_attention, "
                     f"mla_attention and sparse_mla_attention; got {kernel!r}")


def _check_heads(kernel, args, n: int) -> None:
    q = args[0]
    if q.shape[1] % n:
        raise ValueError(f"num_q_heads={q.shape[1]} must be divisible by the {n} devices of the mesh axis")
    if kernel in (varlen_attention, paged_decode_attention, paged_attention):
        hkv = args[1].shape[1] if kernel is varlen_attention else args[1].shape[2]
        if hkv % n:
            raise ValueError(f"num_kv_heads={hkv} must be divisible by the {n} devices of the mesh axis "
                             f"(each device holds num_kv_heads / n KV heads and their query heads)")


def tensor_parallel(kernel: Callable, mesh: Mesh, axis: str = "tp", **static_kwargs) -> Callable:
    """``kernel`` with its heads split over mesh axis ``axis``: same array signature, same result.

    Args:
      kernel: one of :func:`pallas_attn.varlen_attention`, :func:`pallas_attn.paged_decode_attention`,
        :func:`pallas_attn.paged_attention`, :func:`pallas_attn.mla_attention`,
        :func:`pallas_attn.sparse_mla_attention`.
      mesh: a :class:`jax.sharding.Mesh` holding ``axis`` (other axes, if any, replicate the work).
      axis: the mesh axis splitting the heads; ``num_q_heads`` and ``num_kv_heads`` must be divisible by its size.
      static_kwargs: the kernel's keyword arguments (``max_seqlen=``, ``max_query_len=``, ``num_splits=``,
        ``return_lse=``, ``config=``, ...), fixed for the returned function.

    Returns:
      A jitted ``f(*arrays)`` taking the kernel's positional arrays (MLA: optionally ``cu_query_lens`` as a fifth
      one or keyword) and returning its output (and LSE), sharded on the head axis.

    Example:
      >>> f = tensor_parallel(varlen_attention, jax.make_mesh((2,), ("tp",)), "tp", max_seqlen=128)
      >>> out = f(q, k, v, cu_seqlens)                       # each device: Hq/2 query heads, Hkv/2 KV heads
    """
    return_lse = bool(static_kwargs.get("return_lse", False))
    n = validation.check_mesh_axis(mesh, axis)
    call = functools.partial(kernel, **static_kwargs)

    @functools.cache
    def _mapped(with_cu: bool):
        in_specs, out_spec = tensor_parallel_specs(kernel, axis, with_cu_query_lens=with_cu)
        if with_cu:
            def body(q, kv, bt, idx, cu):
                return call(q, kv, bt, idx, cu_query_lens=cu)
        else:
            body = call
        # check_vma=False: pallas_call carries no varying-manual-axes rules; every output is sharded anyway.
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                               out_specs=(out_spec, out_spec) if return_lse else out_spec, check_vma=False)
        return jax.jit(lambda *xs: mapped(*_placed(mesh, axis, xs, in_specs)))

    def run(*arrays, cu_query_lens=None):
        if cu_query_lens is not None:
            if kernel not in _LATENT:
                raise TypeError("cu_query_lens= as a keyword is mla_attention's and sparse_mla_attention's; pass it "
                                "positionally")
            arrays = (*arrays, cu_query_lens)
        _check_heads(kernel, arrays, n)
        with_cu = kernel in _LATENT and len(arrays) == 5
        return _mapped(with_cu)(*arrays)

    run.__name__ = f"tensor_parallel_{getattr(kernel, '__name__', 'kernel')}"
    run.__doc__ = f"{run.__name__}: heads sharded over mesh axis {axis!r} ({n} devices)."
    return run


# ---------------------------------------------------------------------------------------- context parallelism
def cross_device_merge(out, lse, axis: str, *, merge: str = "all_gather"):
    """Merge partial attention states held by the devices of mesh axis ``axis`` (call inside ``shard_map``).

    Each device passes its ``out [..., D]`` (normalised over its own keys) and ``lse [...]`` (``-inf``: no key);
    every device gets the merged ``(out float32, lse)``, as if one device had attended to all keys, device 0's first.

    ``merge="all_gather"``: gather the ``n`` states and fold them with :func:`pallas_attn.merge_attention_states`
    (the split-KV reduction: fixed device order). ``merge="psum"``: ``m = pmax(lse)``, ``w = exp(lse - m)``,
    ``out = psum(w·out) / psum(w)``, ``lse = m + log psum(w)``: collectives of one state, not ``n``.
    """
    if merge == "all_gather":
        return merge_attention_states(jax.lax.all_gather(out, axis), jax.lax.all_gather(lse, axis))
    if merge != "psum":
        raise ValueError(f"{merge=} must be 'all_gather' or 'psum'")
    m = jax.lax.pmax(lse, axis)
    m_safe = softmax.safe_max(m)
    w = jnp.exp(lse - m_safe)  # 0 on a device without keys
    num = jax.lax.psum(jnp.where((w > 0)[..., None], w[..., None] * out.astype(jnp.float32), 0.0), axis)
    den = jax.lax.psum(w, axis)
    empty = den == 0.0
    merged = num / jnp.where(empty, 1.0, den)[..., None]
    return merged, jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, den)))


_OPTIONAL_INT = functools.partial(validation.check_static_int, optional=True)
_DEVICE_SCALE = functools.partial(validation.check_kv_scale, cache_rank=5)  # scale caches: [devices, pages, ...]
_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


@renamed_argument("context_lens", "seq_lens")
def context_parallel_decode(q, k_cache, v_cache, block_tables, seq_lens=None, *, mesh: Mesh, axis: str = "cp",
                            merge: str = "all_gather", softmax_scale: float | None = None, softcap: float = 0.0,
                            sinks=None, k_scale=None, v_scale=None, num_splits: int | None = None,
                            split_size: int | None = None, return_lse: bool = False, interpret: bool | None = None,
                            config=None):
    """Decode with each request's paged K/V spread over the ``n`` devices of mesh axis ``axis``.

    Args:
      q: ``[num_seqs, num_q_heads, head_dim]``, replicated (every device needs every query).
      k_cache, v_cache: ``[n, num_blocks, block_size, num_kv_heads, head_dim]``: device ``d``'s own page pool is
        ``k_cache[d]`` (shard the arrays on axis 0; :func:`shard_paged_cache` builds them).
      block_tables: ``i32[n, num_seqs, max_blocks_local]``: row ``[d, b]`` lists, in order, the pages (ids in device
        ``d``'s pool) of device ``d``'s contiguous slice of request ``b``'s context. Or the
        :class:`ContextShards` of :func:`split_context_pages` itself, with ``seq_lens`` left out: its tables and
        lengths are used, and its ``block_size`` must be the cache's (``ValueError`` otherwise: tables cut for
        another page size address the wrong keys).
      seq_lens: ``i32[n, num_seqs]`` keys of request ``b`` held on device ``d`` (0 allowed). Its former name
        ``context_lens=`` still works for one release, with a ``DeprecationWarning``.
      mesh, axis: the mesh and its context-parallel axis (size ``n``; an axis the mesh lacks raises ``ValueError``).
      merge: ``"all_gather"`` (gather ``n`` partial ``(out, lse)``, then :func:`pallas_attn.merge_attention_states`
        on every device) or ``"psum"`` (``pmax`` + two ``psum`` s of rescaled partials).
      softmax_scale, softcap, k_scale, v_scale, num_splits, split_size, interpret, config: passed to each device's
        :func:`pallas_attn.paged_decode_attention` (split-KV inside a device composes with the split across them).
        An FP8 cache's per-(token, head) scale caches are sharded as the caches are: ``f32[n, num_blocks_local,
        block_size, num_kv_heads]`` (:func:`shard_paged_cache` of the global ones); scalar scales are shared.
      sinks: ``f32[num_q_heads]`` or None: applied once, to the merged state (each device's is sink-free). A window
        and ALiBi need absolute key positions, which a device's slice does not carry: they are not taken here.
      return_lse: also return the global ``f32[num_seqs, num_q_heads]`` LSE.

    Returns:
      ``out [num_seqs, num_q_heads, head_dim]`` in q's dtype, replicated (and ``lse``). Keys are attended in the
      order device 0, 1, ...: the result equals single-device attention over the concatenated slices.
    """
    validation.check_mesh_axis(mesh, axis)
    if isinstance(block_tables, ContextShards):
        shards = block_tables
        if seq_lens is not None:
            raise TypeError("context_parallel_decode() got a ContextShards as block_tables and seq_lens too: pass the "
                            "shards alone (their seq_lens are used), or shards.block_tables and shards.seq_lens")
        cache_block_size = np.shape(k_cache)[2] if np.ndim(k_cache) == 5 else None
        if shards.block_size is not None and cache_block_size is not None and shards.block_size != cache_block_size:
            raise ValueError(f"block_tables (a ContextShards) were cut for block_size={shards.block_size} by "
                             f"split_context_pages, but k_cache has block_size={cache_block_size} (axis 2 of "
                             f"[n, num_blocks, block_size, num_kv_heads, head_dim]); cut them with the cache's block "
                             f"size")
        block_tables, seq_lens = shards.block_tables, shards.seq_lens
    elif seq_lens is None:
        raise TypeError("context_parallel_decode() missing seq_lens: pass seq_lens, or a ContextShards as "
                        "block_tables")
    return _context_parallel_decode(q, k_cache, v_cache, block_tables, seq_lens, mesh=mesh, axis=axis, merge=merge,
                                    softmax_scale=softmax_scale, softcap=softcap, sinks=sinks, k_scale=k_scale,
                                    v_scale=v_scale, num_splits=num_splits, split_size=split_size,
                                    return_lse=return_lse, interpret=interpret, config=config)


@common.front(arrays=("q", "k_cache", "v_cache", "sinks"), int_arrays=("block_tables", "seq_lens"),
              statics=dict(softmax_scale=validation.check_softmax_scale, softcap=validation.check_softcap,
                           num_splits=_OPTIONAL_INT,
                           split_size=_OPTIONAL_INT, return_lse=validation.check_static_bool,
                           interpret=_OPTIONAL_BOOL),
              scalars=dict(k_scale=_DEVICE_SCALE, v_scale=_DEVICE_SCALE))
@functools.partial(jax.jit, static_argnames=("mesh", "axis", "merge", "softmax_scale", "softcap", "num_splits",
                                             "split_size", "return_lse", "interpret", "config"))
def _context_parallel_decode(q, k_cache, v_cache, block_tables, seq_lens, sinks=None, k_scale=None, v_scale=None, *,
                             mesh, axis, merge, softmax_scale, softcap, num_splits, split_size, return_lse, interpret,
                             config):
    n = mesh.shape[axis]
    for name, x, rank in (("k_cache", k_cache, 5), ("v_cache", v_cache, 5), ("block_tables", block_tables, 3),
                          ("seq_lens", seq_lens, 2)):
        if x.ndim != rank or x.shape[0] != n:
            raise ValueError(f"{name} must have a leading device axis of size {n} (mesh axis {axis!r}) and rank "
                             f"{rank}; got {tuple(x.shape)}")
    if merge not in ("all_gather", "psum"):
        raise ValueError(f"{merge=} must be 'all_gather' or 'psum'")
    if sinks is not None:
        validation.check_head_vector("sinks", sinks, q.shape[1])
    kernel = functools.partial(paged_decode_attention, softmax_scale=softmax_scale, softcap=softcap,
                               num_splits=num_splits, split_size=split_size, return_lse=True, interpret=interpret,
                               config=config)

    mode = validation.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    scales = (k_scale, v_scale) if mode else ()

    def local(q, kc, vc, bt, lens, *scales):
        kv_scales = dict(zip(("k_scale", "v_scale"), scales))  # empty without FP8
        if mode == "token":  # scale caches: this device's pages, as the caches
            kv_scales = {name: x[0] for name, x in kv_scales.items()}
        out, lse = kernel(q, kc[0], vc[0], bt[0], lens[0], **kv_scales)  # this device's slice: a partial state
        merged, m_lse = cross_device_merge(out, lse, axis, merge=merge)
        return merged.astype(q.dtype), m_lse

    shard = P(axis)
    in_specs = (P(), shard, shard, shard, shard) + ((shard,) * 2 if mode == "token" else (P(),) * len(scales))
    args = _placed(mesh, axis, (q, k_cache, v_cache, block_tables, seq_lens, *scales), in_specs)
    out, lse = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), check_vma=False)(*args)
    if sinks is not None:  # once, on the merged state
        out = softmax.apply_sink(out.astype(jnp.float32), lse, sinks).astype(q.dtype)
    return (out, lse) if return_lse else out


# -------------------------------------------------------------------------------------------- host helpers
@dataclasses.dataclass(frozen=True)
class ContextShards:
    """Per-device inputs of :func:`context_parallel_decode`, built by :func:`split_context_pages`.

    block_tables: ``i32[n, num_seqs, max_blocks_local]`` page ids in each device's own pool (padding ``-1``).
    seq_lens: ``i32[n, num_seqs]`` keys of each request held by each device (``context_lens``: its former name,
      kept one release as a property that warns).
    page_map: ``i32[n, num_blocks_local]`` global page id of each local page (``-1``: unused pool slot).
    starts: ``i32[n, num_seqs]`` first global position of each device's slice (for checks and reporting).
    block_size: the page size the pages were cut for; :func:`context_parallel_decode` given these shards checks it
      against the cache's (None: unknown, not checked).

    Pass the shards themselves as :func:`context_parallel_decode`'s ``block_tables`` to have it checked.
    """
    block_tables: np.ndarray
    seq_lens: np.ndarray
    page_map: np.ndarray
    starts: np.ndarray
    block_size: int | None = None

    @property
    def context_lens(self) -> np.ndarray:
        """Deprecated alias of :attr:`seq_lens`."""
        warnings.warn("ContextShards.context_lens is deprecated, read ContextShards.seq_lens (the same array); "
                      "context_lens will be removed in the next release", DeprecationWarning, stacklevel=2)
        return self.seq_lens


@renamed_argument("context_lens", "seq_lens")
def split_context_pages(block_tables, seq_lens, block_size: int, n_dev: int) -> ContextShards:
    """Cut each request's logical pages into ``n_dev`` contiguous, page-aligned chunks (host side, numpy).

    ``seq_lens`` (``i32[num_seqs]``) counts every key of each request, as :func:`pallas_attn.paged_decode_attention`'s;
    its former name ``context_lens=`` still works for one release, with a ``DeprecationWarning``. Request ``b`` with
    ``P = ceil(seq_lens[b] / block_size)`` pages gives device ``d`` pages ``[s_d, s_{d+1})`` with chunk sizes as even
    as possible, the larger chunks first (``np.array_split``); a request of fewer than ``n_dev`` pages leaves the last
    devices with 0 keys, and length 0 leaves every device empty. Each device's pool holds the distinct global pages
    its chunks use (shared prefix pages stay shared), in first-use order.
    """
    tables = np.asarray(block_tables)
    lens = np.asarray(seq_lens).astype(np.int64)
    if tables.ndim != 2 or lens.shape != (tables.shape[0],):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs]; got "
                         f"{tables.shape} and {lens.shape}")
    if n_dev < 1:
        raise ValueError(f"{n_dev=} must be >= 1")
    num_seqs = tables.shape[0]
    pages = -(-lens // block_size)
    if (pages > tables.shape[1]).any():
        raise ValueError(f"a context needs {int(pages.max())} pages but block_tables has {tables.shape[1]} columns")
    base, extra = pages // n_dev, pages % n_dev
    counts = base[None, :] + (np.arange(n_dev)[:, None] < extra[None, :])  # [n, B] pages per device
    first = np.concatenate([np.zeros((1, num_seqs), np.int64), np.cumsum(counts, 0)[:-1]])  # [n, B] first page
    starts = first * block_size
    local_lens = np.clip(lens[None, :] - starts, 0, counts * block_size)
    width = max(1, int(counts.max(initial=0)))
    local_tables = np.full((n_dev, num_seqs, width), -1, np.int64)
    pools = []
    for d in range(n_dev):
        ids: dict[int, int] = {}
        for b in range(num_seqs):
            for j in range(counts[d, b]):
                page = int(tables[b, first[d, b] + j])
                local_tables[d, b, j] = ids.setdefault(page, len(ids))
        pools.append(list(ids))
    page_map = np.full((n_dev, max(1, max(len(p) for p in pools))), -1, np.int64)
    for d, pool in enumerate(pools):
        page_map[d, : len(pool)] = pool
    return ContextShards(local_tables.astype(np.int32), local_lens.astype(np.int32), page_map.astype(np.int32),
                         starts.astype(np.int32), block_size=int(block_size))


def shard_paged_cache(cache, page_map, *, mesh: Mesh | None = None, axis: str = "cp") -> jax.Array:
    """Per-device page pools ``[n, num_blocks_local, *cache.shape[1:]]`` copied from one global ``cache``.

    ``page_map`` is :attr:`ContextShards.page_map`; unused slots (``-1``) are zero. With ``mesh``, the result is
    placed with device ``d``'s pool on device ``d`` of ``axis`` (a test/benchmark helper: a real server writes each
    device's pool in place).
    """
    page_map = jnp.asarray(page_map, jnp.int32)
    pools = jnp.take(cache, jnp.maximum(page_map, 0), axis=0)
    valid = (page_map >= 0).reshape(*page_map.shape, *([1] * (cache.ndim - 1)))
    pools = jnp.where(valid, pools, jnp.zeros((), cache.dtype))
    if mesh is not None:
        validation.check_mesh_axis(mesh, axis)
        pools = jax.device_put(pools, NamedSharding(mesh, P(axis)))
    return pools
