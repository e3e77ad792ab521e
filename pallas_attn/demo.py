"""The demo: one mixed batch, every kernel, each checked against the reference, one table.

    python -m pallas_attn demo [--dtype bfloat16|float32] [--seed N] [--repeats N] [--plain]
    pallas-attn demo ...                      (the console script)

What it does, in the order of a serving step (metadata → cache write → kernel → output + LSE → merge):

1. `build_metadata` for one packed batch of the kinds a serving step mixes (`REQUESTS`): decodes, fresh
   prefills, a chunked prefill over a cached prefix, a verification of 6 draft tokens and an empty request.
   Pages come from a shuffled pool with free pages left over.
2. `allocate_kv_cache`, poisoned with NaN (a real pool holds stale data: a kernel that reads a slot it does
   not own returns NaN and fails its check), then `write_kv_cache` twice: the cached prefixes (the earlier
   steps) through the slot mapping of a "whole history" batch on the same pages, and this step's new tokens
   through `BatchMetadata.slot_mapping`.
3. Every kernel that exists runs on that batch: `varlen_attention` on the fresh prefills (packed, contiguous
   K/V), `paged_decode_attention` on the decode requests (single pass, split-KV, fixed split size),
   `paged_attention` on the whole mixed batch (single pass and split-KV, and over an e4m3 cache with per-tensor and
   with per-token scales), `merge_attention_states` on two
   halves of the decode keys obtained with `return_lse=True`, and `sparse_mla_attention` on a small MLA latent
   cache when `pallas_attn` has it.
4. Each output is compared with `pallas_attn.reference` (float32 oracles) by relative L2 over the real rows,
   against the tolerance of the input dtype in `pallas_attn.testing.TOLERANCES`.

Times are wall-clock after a warm-up call (which compiles). On CPU the kernels run in Pallas interpret mode,
whose times say nothing about GPU performance: the column is labelled "ms (interpret)" there. Use
`pallas-attn bench` on a GPU for performance. Exit status 1 when any check fails or any kernel raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn
from pallas_attn import reference
from pallas_attn.core import backend
from pallas_attn.core.metadata import BatchMetadata, bucket, cdiv
from pallas_attn.testing import TOLERANCES, random_packed, relative_l2

# The batch, in packing order: (kind, query_len, context_len). context_len = tokens cached before this step.
REQUESTS: tuple[tuple[str, int, int], ...] = (
    ("decode", 1, 68),
    ("prefill", 37, 0),  # fresh prefill: no cached prefix
    ("verify", 7, 52),  # the last accepted token + 6 draft tokens
    ("empty", 0, 0),  # a padding request: no rows, no pages
    ("chunked prefill", 24, 40),  # second chunk of a prompt whose first 40 tokens are cached
    ("decode", 1, 128),
    ("prefill", 19, 0),
    ("decode", 1, 15),
)
NUM_Q_HEADS = 8
NUM_KV_HEADS = 2  # GQA group of 4
HEAD_DIM = 64
BLOCK_SIZE = 16
FREE_BLOCKS = 5  # pages of the pool no request owns (poisoned)
SPLITS = 3  # split-KV segments of the split cases
SPLIT_SIZE = 128  # tokens per segment of the batch-invariant case: a multiple of the default block_n at every dtype
MERGE_AT = 64  # the merge case splits each decode's keys at this position (a multiple of BLOCK_SIZE)

# Sparse MLA: DeepSeek's latent layout, 576 = 512 latent + 64 rope dims, one KV head shared by all query heads.
MLA_HEADS = 16
MLA_DIM = 576
MLA_RANK = 512
MLA_TOPK = 32
MLA_REQUESTS: tuple[tuple[str, int, int], ...] = (  # (kind, query_len, context_len), as REQUESTS
    ("decode", 1, 100),
    ("verify", 7, 40),
    ("empty", 0, 0),
    ("decode", 1, 20),  # fewer keys than MLA_TOPK: some indices are -1
)

POISON = float("nan")  # every cache slot nobody wrote


# ------------------------------------------------------------------------------------------------ the batch


@dataclasses.dataclass(frozen=True)
class Batch:
    """The mixed batch after this step's cache write; every array is a device array."""

    kinds: tuple[str, ...]  # kind of each request (REQUESTS)
    md: BatchMetadata  # the step's metadata (numpy)
    q: jax.Array  # dtype[num_tokens, NUM_Q_HEADS, HEAD_DIM] packed new tokens; padding rows NaN
    k_new: jax.Array  # dtype[num_tokens, NUM_KV_HEADS, HEAD_DIM] this step's keys (already in the cache)
    v_new: jax.Array  # dtype[num_tokens, NUM_KV_HEADS, HEAD_DIM]
    k_cache: jax.Array  # dtype[num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache: jax.Array

    @property
    def num_real_tokens(self) -> int:
        return int(self.md.cu_query_lens[-1])

    def rows(self, i: int) -> slice:
        """Query rows of request `i`."""
        return slice(int(self.md.cu_query_lens[i]), int(self.md.cu_query_lens[i + 1]))

    def requests(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind]


def write_history(k_cache, v_cache, md: BatchMetadata, rng: np.random.Generator, dtype):
    """Writes random K/V for the cached prefix (positions `0 .. context_lens[i] - 1`) of every request.

    The prefixes are what earlier steps wrote; a "whole history" batch on the same pages (each request's prefix
    as one fresh prefill) gives their slot mapping.
    """
    hist = pallas_attn.build_metadata(md.context_lens, np.zeros_like(md.context_lens), md.block_size,
                                      num_blocks=k_cache.shape[0], block_tables=md.block_tables)
    k, _ = random_packed(rng, hist.query_lens, k_cache.shape[2], k_cache.shape[3], dtype, pad_to=hist.num_tokens)
    v, _ = random_packed(rng, hist.query_lens, v_cache.shape[2], v_cache.shape[3], dtype, pad_to=hist.num_tokens)
    return pallas_attn.write_kv_cache(k_cache, v_cache, k, v, jnp.asarray(hist.slot_mapping))


def make_paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
    """A pool of `num_blocks` pages, every slot poisoned (NaN) until written."""
    k_cache, v_cache = pallas_attn.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return jnp.full_like(k_cache, POISON), jnp.full_like(v_cache, POISON)


def build_batch(rng: np.random.Generator, dtype, seed: int) -> Batch:
    kinds = tuple(kind for kind, _, _ in REQUESTS)
    query_lens = np.array([q for _, q, _ in REQUESTS])
    context_lens = np.array([c for _, _, c in REQUESTS])
    pages = int(cdiv(query_lens + context_lens, BLOCK_SIZE).sum())
    md = pallas_attn.build_metadata(query_lens, context_lens, BLOCK_SIZE, num_blocks=pages + FREE_BLOCKS,
                                    seed=seed)
    md.validate()
    k_cache, v_cache = make_paged_cache(pages + FREE_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    k_cache, v_cache = write_history(k_cache, v_cache, md, rng, dtype)
    # This step's new tokens: packed rows, NaN padding (their slot is -1, so the write skips them).
    q, _ = random_packed(rng, query_lens, NUM_Q_HEADS, HEAD_DIM, dtype, pad_to=md.num_tokens)
    k_new, _ = random_packed(rng, query_lens, NUM_KV_HEADS, HEAD_DIM, dtype, pad_to=md.num_tokens)
    v_new, _ = random_packed(rng, query_lens, NUM_KV_HEADS, HEAD_DIM, dtype, pad_to=md.num_tokens)
    k_cache, v_cache = pallas_attn.write_kv_cache(k_cache, v_cache, k_new, v_new, jnp.asarray(md.slot_mapping))
    return Batch(kinds, md, q, k_new, v_new, k_cache, v_cache)


# ------------------------------------------------------------------------------------------------ the checks


@dataclasses.dataclass
class Result:
    """One row of the table."""

    kernel: str
    case: str
    shapes: str
    dtype: str
    mode: str
    ms: float | None = None
    err: float | None = None
    tol: float | None = None
    error: str | None = None  # the exception, when the kernel raised
    error_trace: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.err is not None and bool(self.err <= self.tol)  # NaN fails

    @property
    def status(self) -> str:
        return "ERROR" if self.error is not None else ("PASS" if self.passed else "FAIL")


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel call and its check: `run()` returns the output, `ref()` the reference's, compared over `valid`."""

    kernel: str
    case: str
    shapes: str
    run: Callable[[], jax.Array]
    ref: Callable[[], jax.Array]
    valid: int | None = None  # compare the first `valid` rows (None: all); later rows are padding
    timed: Callable[[], object] | None = None  # what to time, when not `run` (the merge alone)


def _shape(name: str, x) -> str:
    return f"{name}[{','.join(str(d) for d in x.shape)}]"


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls, after one warm-up call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_case(case: Case, dtype, mode: str, repeats: int) -> Result:
    tol = TOLERANCES[np.dtype(dtype)]
    result = Result(case.kernel, case.case, case.shapes, np.dtype(dtype).name, mode, tol=tol)
    try:
        out = jax.block_until_ready(case.run())
        result.ms = _time_ms(case.timed or case.run, repeats)
        result.err = relative_l2(out, case.ref(), case.valid)
    except Exception as exc:  # a demo reports a broken kernel in its table instead of dying on the first one
        result.error = f"{type(exc).__name__}: {exc}"
        result.error_trace = traceback.format_exc()
    return result


def varlen_cases(b: Batch) -> list[Case]:
    """Fresh prefills packed with contiguous K/V (their prompt is all of their context), plus the empty request."""
    picked = b.requests("prefill") + b.requests("empty")
    lens = [b.rows(i).stop - b.rows(i).start for i in picked]
    total = sum(lens)
    pad = bucket(total, 16) - total

    def pack(x):  # the picked requests' rows, then padding rows (NaN)
        parts = [x[b.rows(i)] for i in picked] + [jnp.full((pad, *x.shape[1:]), POISON, x.dtype)]
        return jnp.concatenate(parts)

    q, k, v = pack(b.q), pack(b.k_new), pack(b.v_new)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    max_seqlen = bucket(max(lens))
    shapes = f"{_shape('q', q)} {_shape('kv', k)}"
    cases = []
    for causal in (True, False):
        name = f"lens {lens}, {'causal' if causal else 'bidirectional'}"
        cases.append(Case(
            "varlen_attention", name, shapes,
            run=lambda causal=causal: pallas_attn.varlen_attention(q, k, v, cu, max_seqlen=max_seqlen,
                                                                    causal=causal),
            ref=lambda causal=causal: reference.varlen_attention(q, k, v, cu, causal=causal),
            valid=total,
        ))
    return cases


def decode_inputs(b: Batch):
    """The decode requests (and the empty one, seq_len 0 → output 0) as a decode batch: q [B, Hq, D]."""
    picked = b.requests("decode") + b.requests("empty")
    # The empty request has no query row: give it one (any finite values) and seq_len 0.
    q = jnp.stack([b.q[b.rows(i).start] if b.rows(i).stop > b.rows(i).start else jnp.ones_like(b.q[0])
                   for i in picked])
    tables = jnp.asarray(b.md.block_tables[picked])
    seq_lens = jnp.asarray(b.md.seq_lens[picked])  # every key each query sees, the new token included
    return q, tables, seq_lens


def decode_cases(b: Batch) -> list[Case]:
    q, tables, seq_lens = decode_inputs(b)
    shapes = f"{_shape('q', q)} {_shape('cache', b.k_cache)}"
    ref = lambda: reference.paged_decode_attention(q, b.k_cache, b.v_cache, tables, seq_lens)  # noqa: E731
    lens = f"seq_lens {np.asarray(seq_lens).tolist()}"
    variants = (
        (f"{lens}, num_splits=1", dict(num_splits=1)),
        (f"{lens}, num_splits={SPLITS}", dict(num_splits=SPLITS)),
        (f"{lens}, split_size={SPLIT_SIZE}", dict(split_size=SPLIT_SIZE)),
    )
    return [
        Case("paged_decode_attention", name, shapes,
             run=lambda kw=kw: pallas_attn.paged_decode_attention(q, b.k_cache, b.v_cache, tables, seq_lens, **kw),
             ref=ref)
        for name, kw in variants
    ]


def paged_cases(b: Batch) -> list[Case]:
    md = b.md
    args = (b.q, b.k_cache, b.v_cache, jnp.asarray(md.block_tables), jnp.asarray(md.seq_lens),
            jnp.asarray(md.cu_query_lens))
    shapes = f"{_shape('q', b.q)} {_shape('cache', b.k_cache)}"
    ref = lambda: reference.paged_attention(*args)  # noqa: E731
    return [
        Case("paged_attention", f"all {md.num_seqs} requests, {name}", shapes,
             run=lambda splits=splits: pallas_attn.paged_attention(*args, max_query_len=md.max_query_len,
                                                                   num_splits=splits),
             ref=ref, valid=b.num_real_tokens)
        for name, splits in (("num_splits=1", 1), (f"num_splits={SPLITS}", SPLITS))
    ]


def fp8_cases(b: Batch) -> list[Case]:
    """`paged_attention` on the whole batch over e4m3 copies of the cache (`reference.quantize_kv`: what
    `write_kv_cache` stores), with per-tensor scales (the cache's largest magnitude at the top of the format) and
    with per-(token, head) scale caches; the slots no request owns stay NaN, and so do their scales."""
    md, fmt = b.md, jnp.float8_e4m3fn
    tables, seq_lens, cu = (jnp.asarray(x) for x in (md.block_tables, md.seq_lens, md.cu_query_lens))
    cases = []
    for name, scale_of in (("per-tensor scales", lambda c: reference.kv_scale_per_tensor(c, fmt)),
                           ("per-token scales", lambda c: reference.kv_scales_per_token_head(c, fmt))):
        ks, vs = scale_of(b.k_cache), scale_of(b.v_cache)
        k8, v8 = reference.quantize_kv(b.k_cache, ks, fmt), reference.quantize_kv(b.v_cache, vs, fmt)
        args = (b.q, k8, v8, tables, seq_lens, cu)
        cases.append(Case(
            "paged_attention", f"e4m3 cache, {name}", f"{_shape('q', b.q)} {_shape('cache', k8)}",
            run=lambda args=args, ks=ks, vs=vs: pallas_attn.paged_attention(
                *args, max_query_len=md.max_query_len, num_splits=SPLITS, k_scale=ks, v_scale=vs),
            ref=lambda args=args, ks=ks, vs=vs: reference.paged_attention(*args, k_scale=ks, v_scale=vs),
            valid=b.num_real_tokens))
    return cases


def merge_cases(b: Batch) -> list[Case]:
    """Each decode's keys split at `MERGE_AT` into two kernel calls (`return_lse=True`), then merged.

    The second half reads the same pages through the block table shifted by `MERGE_AT // BLOCK_SIZE` pages; a
    request shorter than `MERGE_AT` has an empty second half (LSE -inf), which the merge must ignore.
    """
    q, tables, seq_lens = decode_inputs(b)
    shift = MERGE_AT // BLOCK_SIZE
    tables_hi = jnp.concatenate([tables[:, shift:], jnp.full((tables.shape[0], shift), -1, tables.dtype)], axis=1)
    lens_lo = jnp.minimum(seq_lens, MERGE_AT)
    lens_hi = seq_lens - lens_lo
    states = {}

    def halves():
        if "outs" not in states:
            lo = pallas_attn.paged_decode_attention(q, b.k_cache, b.v_cache, tables, lens_lo, num_splits=1,
                                                    return_lse=True)
            hi = pallas_attn.paged_decode_attention(q, b.k_cache, b.v_cache, tables_hi, lens_hi, num_splits=1,
                                                    return_lse=True)
            states["outs"], states["lses"] = jnp.stack([lo[0], hi[0]]), jnp.stack([lo[1], hi[1]])
        return states["outs"], states["lses"]

    def merge():
        return pallas_attn.merge_attention_states(*halves())

    shapes = f"outs[2,{','.join(str(d) for d in q.shape)}] lses[2,{','.join(str(d) for d in q.shape[:2])}]"
    return [Case("merge_attention_states", f"decode keys [0,{MERGE_AT}) + [{MERGE_AT},seq_len)", shapes,
                 run=lambda: merge()[0],
                 ref=lambda: reference.paged_decode_attention(q, b.k_cache, b.v_cache, tables, seq_lens),
                 timed=merge)]


def sparse_cases(rng: np.random.Generator, dtype, seed: int) -> list[Case]:
    """Top-k sparse MLA over a small latent cache `[num_blocks, BLOCK_SIZE, 576]`.

    The latent rows go through the same metadata and `write_kv_cache` path as K/V, with one "KV head" of 576
    dims (the value cache the write also fills is not needed: MLA reads its values from the latent rows).
    Each query token picks up to `MLA_TOPK` distinct positions it may see (causal), the rest -1.
    """
    sparse = pallas_attn.sparse_mla_attention
    query_lens = np.array([q for _, q, _ in MLA_REQUESTS])
    context_lens = np.array([c for _, _, c in MLA_REQUESTS])
    seq_lens = query_lens + context_lens
    pages = int(cdiv(seq_lens, BLOCK_SIZE).sum())
    # The whole context in one write: every request as a fresh prefill of seq_len tokens.
    md_all = pallas_attn.build_metadata(seq_lens, np.zeros_like(seq_lens), BLOCK_SIZE, num_blocks=pages + 2,
                                        seed=seed + 1)
    md = pallas_attn.build_metadata(query_lens, context_lens, BLOCK_SIZE, num_blocks=pages + 2,
                                    block_tables=md_all.block_tables)
    lat_cache, spare = make_paged_cache(pages + 2, BLOCK_SIZE, 1, MLA_DIM, dtype)
    latent, _ = random_packed(rng, seq_lens, 1, MLA_DIM, dtype, pad_to=md_all.num_tokens)
    lat_cache, _ = pallas_attn.write_kv_cache(lat_cache, spare, latent, latent, jnp.asarray(md_all.slot_mapping))
    kv_cache = lat_cache[:, :, 0, :]  # [num_blocks, BLOCK_SIZE, 576]
    tables = jnp.asarray(md.block_tables)

    # Top-k positions of each real query row: distinct positions <= its own, padded with -1.
    topk = np.full((md.num_tokens, MLA_TOPK), -1, np.int64)
    for i in range(len(MLA_REQUESTS)):
        for j in range(int(query_lens[i])):
            pos = int(context_lens[i]) + j
            chosen = rng.permutation(pos + 1)[:MLA_TOPK]
            topk[md.cu_query_lens[i] + j, : chosen.size] = chosen
    topk = jnp.asarray(topk, jnp.int32)

    q, _ = random_packed(rng, query_lens, MLA_HEADS, MLA_DIM, dtype, pad_to=md.num_tokens)
    cu = jnp.asarray(md.cu_query_lens)
    total = int(md.cu_query_lens[-1])
    cases = [Case(
        "sparse_mla_attention", f"q_lens {query_lens.tolist()}, top-{MLA_TOPK}",
        f"{_shape('q', q)} {_shape('latent', kv_cache)}",
        run=lambda: sparse(q, kv_cache, tables, topk, cu_query_lens=cu, kv_lora_rank=MLA_RANK),
        ref=lambda: reference.sparse_mla_attention(q, kv_cache, tables, topk, cu_query_lens=cu, kv_lora_rank=MLA_RANK),
        valid=total,
    )]
    # Decode form: one query per request (cu_query_lens=None); the empty request's row has every index -1.
    dec = [i for i, (kind, _, _) in enumerate(MLA_REQUESTS) if kind in ("decode", "empty")]
    # The empty request has no query row: give it a row of ones whose indices are all -1 (output 0).
    q_dec = jnp.stack([q[md.cu_query_lens[i]] if query_lens[i] else jnp.ones_like(q[0]) for i in dec])
    topk_dec = jnp.stack([topk[md.cu_query_lens[i]] if query_lens[i] else jnp.full_like(topk[0], -1) for i in dec])
    tables_dec = tables[np.array(dec)]
    cases.append(Case(
        "sparse_mla_attention", f"decode, cu_query_lens=None, top-{MLA_TOPK}",
        f"{_shape('q', q_dec)} {_shape('latent', kv_cache)}",
        run=lambda: sparse(q_dec, kv_cache, tables_dec, topk_dec, kv_lora_rank=MLA_RANK),
        ref=lambda: reference.sparse_mla_attention(q_dec, kv_cache, tables_dec, topk_dec, kv_lora_rank=MLA_RANK),
    ))
    return cases


def collect_cases(b: Batch, rng: np.random.Generator, dtype, seed: int) -> tuple[list[Case], list[str]]:
    """Every case of every kernel this version of `pallas_attn` has, and a line for each kernel it lacks."""
    cases = varlen_cases(b) + decode_cases(b) + paged_cases(b) + fp8_cases(b) + merge_cases(b)
    skipped = []
    if hasattr(pallas_attn, "sparse_mla_attention"):
        cases += sparse_cases(rng, dtype, seed)
    else:
        skipped.append("sparse_mla_attention (not in this version of pallas_attn)")
    return cases, skipped


# ------------------------------------------------------------------------------------------------ the output


COLUMNS = ("kernel", "case", "shapes", "dtype", "mode", "TIME", "rel. L2 err", "tol", "result")


def _cells(r: Result) -> tuple[str, ...]:
    return (r.kernel, r.case, r.shapes, r.dtype, r.mode,
            "-" if r.ms is None else f"{r.ms:.1f}",
            "-" if r.err is None else f"{r.err:.2e}",
            f"{r.tol:.0e}", r.status)


def format_plain(results: Sequence[Result], time_label: str) -> str:
    """The table as aligned plain text."""
    header = tuple(time_label if c == "TIME" else c for c in COLUMNS)
    rows = [header] + [_cells(r) for r in results]
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(results: Sequence[Result], time_label: str, plain: bool) -> None:
    """The table with rich when it is installed (and `plain` is False), else as plain text."""
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plain(results, time_label))
        return
    table = Table()
    for c in COLUMNS:
        table.add_column(time_label if c == "TIME" else c,
                         justify="right" if c in ("TIME", "rel. L2 err", "tol") else "left",
                         overflow="fold")
    style = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold red"}
    for r in results:
        cells = list(_cells(r))
        cells[-1] = f"[{style[r.status]}]{cells[-1]}[/]"
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would assume 80 columns and fold every cell
        console = Console(width=200)
    console.print(table)


def describe_batch(b: Batch) -> str:
    md = b.md
    lines = [f"mixed batch: {len(b.kinds)} requests, {b.num_real_tokens} query rows (num_tokens={md.num_tokens} "
             f"with padding), Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}, block_size={md.block_size}, "
             f"pool {b.k_cache.shape[0]} pages (shuffled, {FREE_BLOCKS} free, unwritten slots NaN)"]
    for i, kind in enumerate(b.kinds):
        q_len = int(md.cu_query_lens[i + 1] - md.cu_query_lens[i])
        pages = md.block_tables[i, : int(cdiv(md.seq_lens[i], md.block_size))].tolist()
        lines.append(f"  {i}: {kind:<16} q_len={q_len:<3} cached={int(md.context_lens[i]):<4} "
                     f"seq_len={int(md.seq_lens[i]):<4} pages={pages}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry point


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a timing needs at least one call)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    default_dtype = "bfloat16" if backend.on_gpu() else "float32"
    parser = argparse.ArgumentParser(
        prog="pallas-attn demo",
        description="Run every pallas_attn kernel on one mixed batch, check each against the reference, "
                    "print a table. CPU: interpret mode (set PALLAS_ATTN_INTERPRET=0/1 to force).")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=default_dtype,
                        help=f"input dtype (default here: {default_dtype}; bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the page shuffle")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="timed calls per case after the warm-up (default 3 interpreted, 20 compiled)")
    parser.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns 0 when every check passes, 1 otherwise."""
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    interpret = backend.resolve_interpret(None)
    mode = "interpret" if interpret else "compiled"
    repeats = args.repeats if args.repeats is not None else (3 if interpret else 20)
    time_label = "ms (interpret)" if interpret else "ms"
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()

    batch = build_batch(rng, dtype, args.seed)
    print(f"pallas_attn {pallas_attn.__version__} on {backend.device_kind()} ({jax.default_backend()}), "
          f"jax {jax.__version__}, {mode} mode, {dtype.name}, seed {args.seed}")
    print(describe_batch(batch))
    print()

    cases, skipped = collect_cases(batch, rng, dtype, args.seed)
    results = [run_case(case, dtype, mode, repeats) for case in cases]

    print(f"every kernel vs pallas_attn.reference: relative L2 over the real rows, tolerance of {dtype.name} inputs")
    print_table(results, time_label, args.plain)
    for r in results:
        if r.error is not None:
            print(f"\n{r.kernel} / {r.case} raised:\n{r.error_trace}")
    for s in skipped:
        print(f"skipped: {s}")
    failed = [r for r in results if not r.passed]
    elapsed = time.perf_counter() - start
    if interpret:
        print("times: Pallas interpret mode on the host, a correctness run, not a measure of kernel speed")
    print(f"{len(results) - len(failed)}/{len(results)} checks passed in {elapsed:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
