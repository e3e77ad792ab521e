"""Block sizes, warps, stages and the split-KV heuristic: tuning knobs, never semantics (docs/design.md#conventions).

Each kernel takes one static ``config`` argument; ``None`` asks the ``default_*_config`` function here, which reads
the measured table for the device kind and head dim (docs/performance.md#tuned-tables) and falls back to defaults
measured on the H200. Every config validates itself.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_attn.core import backend, tuned


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _check_pow2(name: str, value: int, lo: int = 1, hi: int = 1 << 16) -> None:
    if not (lo <= value <= hi and value & (value - 1) == 0):
        raise ValueError(f"{name}={value} must be a power of two in [{lo}, {hi}]")


def _check_launch(cfg) -> None:
    """The Triton launch parameters every config carries."""
    _check_pow2("block_n", cfg.block_n, lo=16)
    _check_pow2("num_warps", cfg.num_warps, hi=16)
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages={cfg.num_stages} must be >= 1")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Varlen prefill: a tile has ``block_m`` rows = ``block_m // heads_per_program`` tokens × ``heads_per_program``
    query heads of one KV group (they share every K/V tile); ``block_n`` keys per KV tile."""
    block_m: int = 64
    block_n: int = 64
    heads_per_program: int | None = None  # None: the whole GQA group when it is a power of two ≤ 8, else 1
    num_warps: int = 4
    num_stages: int = 2
    approx_exp2: bool = True  # compiled only: PTX ex2.approx instead of libdevice exp2f (interpret: exact exp2)

    def __post_init__(self):
        _check_launch(self)
        _check_pow2("block_m", self.block_m, lo=16)
        if self.heads_per_program is not None:
            _check_pow2("heads_per_program", self.heads_per_program)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Varlen prefill on the Mosaic GPU backend (Hopper): ``block_kv`` keys per K/V shared-memory slot,
    ``max_concurrent_steps`` slots in the ring the memory warpgroup fills ahead of the compute warpgroups, and
    ``p_chunks`` column blocks in which a step's exponentials are summed and packed to the P · V operand (each block
    before the next block's exponentials: fewer float32 registers live at once).

    The defaults are the kernel measured on the H200 (docs/performance.md#varlen-prefill-mosaic-gpu). At head dim 128
    two 128-key slots are what fits the 227 KB of shared memory beside Q/O; smaller heads leave room for more or
    wider slots, and head dim 256 takes two 64-key slots (:func:`default_mosaic_prefill_config`)."""
    block_kv: int = 128
    max_concurrent_steps: int = 2
    p_chunks: int = 2  # at 2 the step's registers fit without spills; 1 (all of P at once) spilled and ran slower

    def __post_init__(self):
        # Whole 64-key swizzle tiles; 256 keys need more than the compute warpgroups' 160 registers a thread
        # (ptxas: at least 154 for one instruction of the step alone), so 128 is the widest slot.
        _check_pow2("block_kv", self.block_kv, lo=64, hi=128)
        if not 2 <= self.max_concurrent_steps <= 8:  # one slot would leave nothing to load ahead
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be in [2, 8]")
        _check_pow2("p_chunks", self.p_chunks, lo=2, hi=self.block_kv // 8)  # blocks of whole 8-column tiles


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Paged decode and ragged paged attention: ``block_n`` keys per KV tile (each key's page read through the block
    table: a tile may cover part of a page or several), ``block_q`` query tokens per program for ragged batches."""
    block_n: int = 64
    block_q: int | None = None  # ragged kernel only; None: from max_query_len and the GQA group
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_launch(self)
        if self.block_q is not None:
            _check_pow2("block_q", self.block_q)


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Top-k sparse MLA: ``block_n`` selected keys per tile, ``block_h`` heads per program (the M dim),
    ``value_splits`` programs sharing one token's value dims."""
    block_n: int = 64
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 2
    # >1: programs split the value dims (each recomputes QKᵀ) to relieve registers; slower than 1 on the standard
    # shapes (docs/performance.md#ideas-measured-and-dropped), never a default.
    value_splits: int = 1

    def __post_init__(self):
        _check_launch(self)
        _check_pow2("block_h", self.block_h, lo=16)
        _check_pow2("value_splits", self.value_splits, hi=8)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Dense MLA over a paged latent cache (:func:`pallas_attn.mla_attention`): ``block_n`` keys per tile (each
    key's page read through the block table), ``block_h`` heads and ``block_q`` new tokens per program (None: as
    many of a request's tokens as keep the tile at ``MLA_TILE_ROWS`` rows); the M dim of both dots is
    ``block_q × block_h``, so every latent tile is read once for all of them."""
    block_n: int = 64
    block_h: int = 32
    block_q: int | None = None
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        _check_launch(self)
        _check_pow2("block_h", self.block_h, lo=1)
        if self.block_q is not None:
            _check_pow2("block_q", self.block_q)


MLA_TILE_ROWS = 32  # tokens × heads of a dense MLA tile when block_q is not given (default_mla_config)


# Measured winners (pallas_attn/core/tuned.py, written by `pallas-attn bench --sweep --write-tables`), keyed by
# (device kind, padded head dim); sparse by (device kind, num_q_heads): docs/performance.md#tuned-tables.
PREFILL_TABLE: dict[tuple[str, int], PrefillConfig] = {k: PrefillConfig(**v) for k, v in tuned.PREFILL.items()}
DECODE_TABLE: dict[tuple[str, int], DecodeConfig] = {k: DecodeConfig(**v) for k, v in tuned.DECODE.items()}
CHUNK_TABLE: dict[tuple[str, int], DecodeConfig] = {  # paged_attention's prefill-chunk pass
    k: DecodeConfig(**v) for k, v in tuned.CHUNK.items()}
SPARSE_TABLE: dict[tuple[str, int], SparseConfig] = {k: SparseConfig(**v) for k, v in tuned.SPARSE.items()}


def _tuned(table: dict, key: int):
    """The measured entry for this device, or None."""
    return table.get((backend.device_kind(), key))


def narrow_tiles(head_dim: int, dtype_bytes: int) -> bool:
    """float32 inputs or heads of 256 and wider: a 128-row float32 accumulator (plus its operands) would not fit the
    register file, so every kernel falls back to smaller tiles (:func:`wide_heads`: smaller still)."""
    return dtype_bytes >= 4 or next_pow2(head_dim) >= 256


def wide_heads(head_dim: int) -> bool:
    """Heads padded to 512 (264..512 dims): tiles of their own, below."""
    return next_pow2(head_dim) >= 512


# Shared memory for the K and V tiles a Triton kernel keeps: an H200 block has 227 KiB, and Q plus Triton's
# layout-conversion scratch need the rest.
KV_SMEM_BUDGET = 128 * 1024


def kv_smem_bytes(block_n: int, head_dim: int, dtype_bytes: int, num_stages: int) -> int:
    """Bytes of the K and V tiles ``[block_n, next_pow2(head_dim)]`` in shared memory: one pair, and one more per
    stage past the second (Triton's pipeliner keeps ``num_stages - 1`` pairs in flight). At D 512 bf16 a 32-key
    pair is 64 KiB (ptxas on the decode kernel, 2 stages: 83 KB of shared memory with Q's 16 rows)."""
    return 2 * max(1, num_stages - 1) * block_n * next_pow2(head_dim) * dtype_bytes


def _fit_block_n(block_n: int, head_dim: int, dtype_bytes: int, num_stages: int) -> int:
    """``block_n`` halved (not below 16) until its K/V tiles fit :data:`KV_SMEM_BUDGET`."""
    while block_n > 16 and kv_smem_bytes(block_n, head_dim, dtype_bytes, num_stages) > KV_SMEM_BUDGET:
        block_n //= 2
    return block_n


def _page_block_n(block_n: int, block_size: int) -> int:
    """At least one page per key tile, up to 128 keys: a page of 48 gets 64-key tiles. Tiles read each key's page
    through the block table, so neither a page nor a tile need divide the other."""
    return max(block_n, min(next_pow2(block_size), 128))


# Heads padded to 512, every kernel (ptxas for sm_90, tools/offline_compile.py): a K or V tile of 32 keys × 512 bf16
# is 32 KiB, and the float32 accumulator of a 32-row tile takes 64 KiB of registers. So 32 query rows (prefill,
# prefill chunks), 32-key tiles (float32: 16), 8 warps, 2 stages (one K/V pair in flight): 186-254 registers, no
# spills, 83-100 KB of shared memory. 64-row tiles spill (wgmma at 8 warps: 255 registers and 0.5-1 KB of stack
# per thread), and so do 4 warps on the ragged kernel's 32-row verification tiles. float32 prefill: 16 × 16 tiles,
# 4 warps, 1 stage (245 registers, 64 KB).
WIDE_BLOCK_ROWS = 32


def _wide_block_n(dtype_bytes: int) -> int:
    return 32 if dtype_bytes <= 2 else 16


def default_prefill_config(head_dim: int, dtype_bytes: int = 2) -> PrefillConfig:
    padded = next_pow2(head_dim)
    hit = _tuned(PREFILL_TABLE, padded)
    if hit is not None:
        return hit
    if wide_heads(head_dim):  # WIDE_BLOCK_ROWS
        if dtype_bytes >= 4:
            return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
        return PrefillConfig(block_m=WIDE_BLOCK_ROWS, block_n=32, num_warps=8, num_stages=2)
    if narrow_tiles(head_dim, dtype_bytes):
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    if padded >= 128:  # the sweep's winner at D 128 (docs/performance.md#varlen-prefill-triton)
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)


def default_decode_config(head_dim: int, block_size: int, dtype_bytes: int = 2) -> DecodeConfig:
    padded = next_pow2(head_dim)
    hit = _tuned(DECODE_TABLE, padded)
    if hit is not None:
        return hit
    if wide_heads(head_dim):  # WIDE_BLOCK_ROWS: the tile is the same whatever the page
        return DecodeConfig(block_n=_wide_block_n(dtype_bytes), num_warps=8, num_stages=2)
    # block_n 128 / 4 warps / 2 stages: the sweep's winner at D 128 (docs/performance.md#paged-decode); a page of 128
    # or more in float32 gets 64-key tiles (128 would keep 256 KiB of K/V at D 256).
    block_n = 32 if narrow_tiles(head_dim, dtype_bytes) else 128 if padded <= 128 else 64
    block_n = _fit_block_n(_page_block_n(block_n, block_size), head_dim, dtype_bytes, num_stages=2)
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2)


def chunk_rows(head_dim: int, dtype_bytes: int) -> int:
    """Rows (tokens × padded group) of a prefill-chunk query block in :func:`pallas_attn.paged_attention`: 128 as
    in prefill (each K/V tile read serves twice the rows of a 64-row block), 64 with narrow tiles, 32 for heads
    padded to 512 (:data:`WIDE_BLOCK_ROWS`)."""
    if wide_heads(head_dim):
        return WIDE_BLOCK_ROWS
    return 64 if narrow_tiles(head_dim, dtype_bytes) else 128


def default_backward_config(head_dim: int) -> PrefillConfig:
    """The varlen backward's tiles (:mod:`pallas_attn.kernels.triton.prefill_bwd`): ``block_m`` query rows of one
    head and ``block_n`` keys, narrower as the head grows: the dK / dV program holds two ``[block_n, D]`` float32
    accumulators beside its K / V tile. Chosen so that neither kernel spills at P1's shapes
    (``tools/offline_compile.py``; 64 × 64 tiles on 8 warps spill at head dim 128); not yet timed on a GPU."""
    padded = next_pow2(head_dim)
    if padded <= 64:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if padded <= 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=32 if padded <= 256 else 16, block_n=32 if padded <= 256 else 16, num_warps=8,
                         num_stages=2)


def default_chunk_config(head_dim: int, block_size: int, dtype_bytes: int = 2) -> DecodeConfig:
    """The prefill-chunk pass of :func:`pallas_attn.paged_attention` (queries longer than 16 tokens in a mixed
    batch): compute-bound like prefill, so 8 warps over :func:`chunk_rows`-row query blocks; narrow tiles (float32,
    256-wide heads) take 4 warps; heads padded to 512 take :data:`WIDE_BLOCK_ROWS`' tiles."""
    hit = _tuned(CHUNK_TABLE, next_pow2(head_dim))
    if hit is not None:
        return hit
    if wide_heads(head_dim):  # float32: one stage (244 registers, 128 KB)
        return DecodeConfig(block_n=_wide_block_n(dtype_bytes), num_warps=8, num_stages=2 if dtype_bytes <= 2 else 1)
    if narrow_tiles(head_dim, dtype_bytes):
        block_n = _fit_block_n(_page_block_n(32, block_size), head_dim, dtype_bytes, num_stages=2)
        return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2)
    # 128-row blocks, block_n 128, 8 warps: the fastest on M1's chunks (docs/performance.md#mixed-batches). 3 stages:
    # at 255 registers a thread ptxas spills less around the page guard than with 2 (M1 -2.5%).
    return DecodeConfig(block_n=128, num_warps=8, num_stages=3)


def default_mosaic_prefill_config(head_dim: int) -> MosaicPrefillConfig:
    """The Mosaic prefill's slots: the measured default (two of 128 keys) up to head dim 128; at 256 two of 64 keys,
    which fit the 227 KB of shared memory beside the three warpgroups' Q/O (96 KiB + 128 KiB)."""
    return MosaicPrefillConfig(block_kv=64) if head_dim > 128 else MosaicPrefillConfig()


def default_sparse_config(num_heads: int) -> SparseConfig:
    hit = _tuned(SPARSE_TABLE, num_heads)
    return hit if hit is not None else SparseConfig(block_h=min(64, max(16, next_pow2(num_heads))))


def default_mla_config(num_heads: int, max_query_len: int) -> MLAConfig:
    """Up to ``MLA_TILE_ROWS`` heads per program and as many of a request's tokens as fill that many rows, on 8
    warps. At 576 / 512 dims a 64-row tile spills (a 64 × 512 float32 accumulator beside the 576-wide query), and
    so does a 16-row one on 4 warps; 16 or 32 rows on 8 warps do not (``tools/offline_compile.py``)."""
    block_h = min(MLA_TILE_ROWS, next_pow2(num_heads))
    block_q = min(next_pow2(max(1, max_query_len)), max(1, MLA_TILE_ROWS // block_h))
    return MLAConfig(block_h=block_h, block_q=block_q)


MAX_SPLITS = 64  # split-KV segments a heuristic plans at most (the merge reads each one's partial)


def choose_num_splits(num_programs: int, max_kv_len: int, block_n: int, *, num_sms: int | None = None,
                      min_split_tokens: int = 1024, max_splits: int = MAX_SPLITS, programs_per_sm: int = 2) -> int:
    """Split-KV heuristic: split only when ``num_programs`` (batch × kv heads × query blocks) cannot fill the GPU,
    and never into segments shorter than ``min_split_tokens`` keys (below that the merge pass costs more than the
    parallelism buys: docs/performance.md#split-kv-heuristic, docs/design.md#split-kv-and-the-merge).

    Several decode programs fit on one SM at once, so the batch alone "fills" the GPU at ``programs_per_sm`` programs
    per SM (2; 1 for a kernel whose shared memory takes a whole SM); below that, aim at about four programs per SM:
    ``splits ≈ 4·SMs / num_programs``, capped by the longest context's tile count and ``max_splits``. Returns 1 (the
    single-pass kernel, no merge) when the batch fills the machine.
    """
    sms = num_sms or backend.num_sms()
    if num_programs >= programs_per_sm * sms:
        return 1
    want = math.ceil(4 * sms / max(1, num_programs))
    cap = max(1, max_kv_len // max(min_split_tokens, block_n))
    return int(max(1, min(want, cap, max_splits)))


def balance_split_size(num_programs: int, max_kv_len: int, block_n: int, *, num_sms: int | None = None,
                       min_segment: int = 2048) -> int | None:
    """Split size for a batch that fills the GPU but may end on a tail: programs carry their request's whole
    context, so with lengths spread up to ``max_kv_len`` the last wave is a few long programs on an otherwise idle
    GPU. Cap a program at a quarter of an SM's expected share of the work (contexts averaging half the capacity:
    ``num_programs · max_kv_len / (2 · SMs)``), rounded down to a power of two and never below ``min_segment`` keys.
    Returns None (no split) when the segment would be shorter than ``min_segment`` or cover ``max_kv_len``
    (docs/performance.md#split-kv-heuristic).
    """
    sms = num_sms or backend.num_sms()
    share = num_programs * max_kv_len / (2 * sms)
    segment = 1 << int(math.floor(math.log2(max(1.0, share / 4))))
    segment = max(segment, block_n)
    if segment < min_segment or segment >= max_kv_len:
        return None
    return segment


def resolve_splits(num_programs: int, max_kv_len: int, block_n: int, num_splits: int | None,
                   split_size: int | None, *, programs_per_sm: int = 2, pow2_segments: bool = False,
                   tail_balance: bool = True) -> tuple[int, int | None]:
    """Static ``(num_splits, split_size)`` for a launch.

    * ``split_size`` given (tokens, a multiple of ``block_n``): fixed segments ``[s·split_size, (s+1)·split_size)``,
      ``num_splits = cdiv(max_kv_len, split_size)``; batch invariant.
    * ``num_splits`` given: each request's own tiles shared out evenly among that many segments.
    * neither: :func:`choose_num_splits` (``programs_per_sm`` passed on); when it splits, it uses fixed segments
      of equal length (so a long request gets more segments than a short one and the programs carry equal work),
      with ``pow2_segments`` rounded to the nearest power of two (a kernel of one program an SM runs its programs
      in waves: power-of-two counts fill them; docs/performance.md#split-kv-heuristic). A batch that already fills
      the GPU gets :func:`balance_split_size` segments when its capacity leaves a long tail, unless ``tail_balance``
      is off (a kernel that balances its own tail: the Mosaic kernel's programs looping over items dealt longest
      first).

    ``max_kv_len`` is the static capacity (``max_blocks * block_size``), not the data: heuristics never sync.
    """
    if split_size is not None:
        if num_splits is not None:
            raise ValueError(f"give num_splits or split_size, not both; got {num_splits=}, {split_size=}")
        if not isinstance(split_size, int) or split_size <= 0 or split_size % block_n:
            raise ValueError(f"{split_size=} must be a positive multiple of the KV tile block_n={block_n}")
        return max(1, math.ceil(max_kv_len / split_size)), split_size
    if num_splits is not None:
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"{num_splits=} must be a static int >= 1")
        return num_splits, None
    splits = choose_num_splits(num_programs, max_kv_len, block_n, programs_per_sm=programs_per_sm)
    if splits == 1:
        size = balance_split_size(num_programs, max_kv_len, block_n) if tail_balance else None
        return (1, None) if size is None else (math.ceil(max_kv_len / size), size)
    size = math.ceil(math.ceil(max_kv_len / splits) / block_n) * block_n
    if pow2_segments:  # the nearest power of two (log scale), no shorter than a tile, at most max_splits segments
        size = max(block_n, 1 << round(math.log2(size)))
        while math.ceil(max_kv_len / size) > MAX_SPLITS:
            size *= 2
    return max(1, math.ceil(max_kv_len / size)), size
