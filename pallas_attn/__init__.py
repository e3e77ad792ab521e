"""pallas_attn: many requests of different lengths in one launch, each seeing only its own context.

Pallas GPU kernels for JAX (Triton, and Mosaic GPU on Hopper where it measured faster: prefill, its gradient, MLA;
docs/design.md#backends):
packed varlen prefill, paged decode with split-KV, ragged paged attention for mixed prefill / decode / verification
batches, dense and top-k sparse MLA over a paged latent cache. Every function is pure, works under ``jax.jit``, runs
compiled on a GPU and interpreted on CPU, and has a pure-jnp oracle of the same signature in
:mod:`pallas_attn.reference`.

Shape glossary (one name per axis, used everywhere):
  num_tokens   packed query rows (T)            num_seqs     requests in the batch (B)
  num_q_heads  query heads (Hq)                 num_kv_heads K/V heads (Hkv); Hq % Hkv == 0
  head_dim     D (multiple of 8, 16..512)       block_size   tokens per KV page (16·k up to 1024, or 1, 2, 4, 8)
  max_blocks   pages per block-table row        topk         selected keys per sparse query
  num_splits   split-KV segments per request

LSE convention: natural log, float32, ``-inf`` for a row that sees no key (its output is 0).
"""

from pallas_attn.checks import checked
from pallas_attn.core.backend import BackendUnavailableError
from pallas_attn.core.cache import allocate_kv_cache, allocate_kv_scales, quantize_latent, write_kv_cache
from pallas_attn.core.config import DecodeConfig, MLAConfig, MosaicPrefillConfig, PrefillConfig, SparseConfig
from pallas_attn.core.metadata import BatchMetadata, build_metadata
from pallas_attn.ops.decode import paged_decode_attention
from pallas_attn.ops.merge import merge_attention_states
from pallas_attn.ops.mla import mla_attention
from pallas_attn.ops.paged import paged_attention
from pallas_attn.ops.sparse_mla import sparse_mla_attention
from pallas_attn.ops.varlen import varlen_attention

try:  # installed: setuptools maps the top-level reference/ folder to pallas_attn.reference
    from pallas_attn import reference
except ImportError:  # a source checkout: load reference/ under the same name
    import importlib.util as _util
    import pathlib as _pathlib
    import sys as _sys

    _dir = _pathlib.Path(__file__).resolve().parent.parent / "reference"
    _spec = _util.spec_from_file_location("pallas_attn.reference", _dir / "__init__.py",
                                          submodule_search_locations=[str(_dir)])
    reference = _util.module_from_spec(_spec)
    _sys.modules["pallas_attn.reference"] = reference
    _spec.loader.exec_module(reference)

__all__ = [
    "BackendUnavailableError", "BatchMetadata", "DecodeConfig", "MLAConfig", "MosaicPrefillConfig", "PrefillConfig",
    "SparseConfig", "allocate_kv_cache", "allocate_kv_scales", "build_metadata", "checked", "merge_attention_states",
    "mla_attention", "paged_attention", "paged_decode_attention", "quantize_latent", "reference",
    "sparse_mla_attention", "varlen_attention", "write_kv_cache",
]
__version__ = "0.1.0"
