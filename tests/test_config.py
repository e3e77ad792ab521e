"""Default configs: tiles the kernels accept, whose K/V buffers fit an H200 block's shared memory, for every head dim
and page size (tools/offline_compile.py checks registers and shared memory with ptxas)."""

from __future__ import annotations

import pytest

from pallas_attn.core import config
from pallas_attn.core.config import DecodeConfig, PrefillConfig

HEAD_DIMS = (16, 64, 80, 96, 128, 192, 256, 264, 320, 512)
BLOCK_SIZES = (1, 16, 48, 128, 544, 1024)


@pytest.mark.parametrize("dtype_bytes", [2, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_tiles_fit_shared_memory(head_dim, dtype_bytes):
    prefill = config.default_prefill_config(head_dim, dtype_bytes)
    assert config.kv_smem_bytes(prefill.block_n, head_dim, dtype_bytes, prefill.num_stages) <= config.KV_SMEM_BUDGET
    for block_size in BLOCK_SIZES:
        for cfg in (config.default_decode_config(head_dim, block_size, dtype_bytes),
                    config.default_chunk_config(head_dim, block_size, dtype_bytes)):
            assert config.kv_smem_bytes(cfg.block_n, head_dim, dtype_bytes, cfg.num_stages) <= config.KV_SMEM_BUDGET


@pytest.mark.parametrize("head_dim, block_size, dtype_bytes, block_n", [
    (128, 16, 2, 128),  # the measured default
    (64, 48, 2, 128), (64, 48, 4, 64),  # a page of 48: a power-of-two tile past it
    (256, 128, 2, 128),  # 128 keys of bf16 at D 256: 128 KiB of K/V, within the budget
    (256, 544, 4, 64),  # float32: 128-key tiles would keep 256 KiB of K/V
    (512, 544, 2, 32), (320, 16, 4, 16),  # heads padded to 512: 32-key tiles (float32: 16) whatever the page
])
def test_default_decode_tiles(head_dim, block_size, dtype_bytes, block_n):
    assert config.default_decode_config(head_dim, block_size, dtype_bytes).block_n == block_n


def test_wide_heads_tiles():
    """Heads padded to 512: 32 query rows, 32-key tiles, 8 warps (ptxas: no spills, 83-100 KB of shared memory)."""
    assert config.default_prefill_config(320) == PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    assert config.default_prefill_config(512, 4) == PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert config.default_decode_config(512, 16) == DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    assert config.default_chunk_config(512, 48) == DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    assert config.default_chunk_config(320, 48, 4) == DecodeConfig(block_n=16, num_warps=8, num_stages=1)
    assert config.chunk_rows(264, 2) == config.chunk_rows(512, 4) == 32
    assert config.chunk_rows(256, 2) == 64 and config.chunk_rows(128, 2) == 128
