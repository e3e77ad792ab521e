"""Reference oracles: the definitions of "correct" for the `pallas_attn` kernels.

Every kernel is tested against the function of the same name here, never against another kernel. These are
plain, slow, float32 jnp implementations written to be read: a Python loop over requests, pages gathered with
plain indexing, masks from absolute positions. They read lengths and page tables on the host, so (apart from
`merge_attention_states` and `varlen_attention_dense`) they are not jittable; that is fine for an oracle. Each one
returns float32 `out`, or `(out, lse)` with `return_lse=True`; a query row that sees no key gives `out = 0`,
`lse = -inf`.

    varlen_attention        packed prefill over contiguous K/V, causal or not, GQA
    varlen_attention_dense  the same, jittable and differentiable: one masked [T, T] attention (the gradients' oracle)
    paged_decode_attention  one query per request over a paged KV cache
    paged_attention         ragged queries over a paged KV cache (decode, verification, chunked/fresh prefill)
    sparse_mla_attention    top-k sparse attention over a shared MLA latent cache (576 = 512 + 64)
    mla_attention           dense attention over the same latent cache (DeepSeek-V3 decode and multi-token steps)
    merge_attention_states  split-KV merge of (out, lse) states; pure jnp
    quantize_kv, dequantize_kv  what an FP8 paged cache stores for a value and reads back (per-tensor scale,
                            or per token and head)
    kv_scales_per_token_head  the per-(token, head) scales write_kv_cache computes
    kv_scale_per_tensor     a per-tensor scale calibrated on a tensor's largest magnitude

Shape glossary: T num_tokens, B num_seqs, Hq num_q_heads, Hkv num_kv_heads, D head_dim, block_size,
max_blocks, topk, S num_splits.
"""

from .attention import (
    FP8_DTYPES,
    dequantize_kv,
    dequantize_latent,
    fp8_latent_width,
    kv_scale_per_tensor,
    kv_scales_per_token_head,
    merge_attention_states,
    mla_attention,
    paged_attention,
    paged_decode_attention,
    quantize_kv,
    quantize_latent,
    sparse_mla_attention,
    varlen_attention,
    varlen_attention_dense,
)

__all__ = [
    "FP8_DTYPES",
    "dequantize_kv",
    "dequantize_latent",
    "fp8_latent_width",
    "kv_scale_per_tensor",
    "kv_scales_per_token_head",
    "merge_attention_states",
    "mla_attention",
    "paged_attention",
    "paged_decode_attention",
    "quantize_kv",
    "quantize_latent",
    "sparse_mla_attention",
    "varlen_attention",
    "varlen_attention_dense",
]
