"""Two small models served end to end, the way an engine runs them, against the same models written densely.

* **gpt-oss-shaped**: head_dim 64, a learned sink per query head and layer, a sliding window on alternate layers
  (full causal attention on the others).
* **Gemma-2-shaped**: head_dim 256, attention logits soft-capped at 50, a sliding window on alternate layers.

Both are 2-layer Llama-style decoders (RMSNorm, RoPE, grouped-query attention with 4 query heads over 2 KV heads, a
SwiGLU MLP, vocabulary 64) with random weights, in float32: the shapes and attention features of the two families,
not the rest of their blocks. The window is 8 tokens (the query and the 7 before it: gpt-oss'
``sliding_window=128`` at these lengths), so that it cuts the ~20-token prompts.

**Engine**: two prompts of different lengths packed into one token tensor and prefilled with ``varlen_attention``
(``cu_seqlens``) with each layer's features; every layer's K/V written by ``write_kv_cache`` into its own paged cache
(block size 16, non-contiguous pages, every page no request owns filled with NaN); then one token per request per
step through ``paged_decode_attention`` with the same features; or everything through ``paged_attention``, the
prompts in two chunks. **Dense**: each request alone, its whole sequence
recomputed for every new token, with attention as the definitions of docs/design.md#model-family-features read:
plain softmax over masked, soft-capped scores, the sink one more logit with no value. No kernel, no reference.

Greedy decoding must pick the same tokens, and the logits of every step agree to a relative L2 of 1e-4.

**Without the Pallas Triton backend** (deprecated by JAX, to be removed): both models in bf16, every kernel on
Mosaic GPU, the same greedy tokens.

**FP8 caches**: the same engine over e4m3 / e5m2 caches (per-tensor scales calibrated on the prompt, or per-token
scale caches) against the float32 cache, along the float32 cache's tokens; how often greedy decoding diverges over
more weights and prompts: ``python -m tests.test_models`` (``fp8_agreement``, docs/performance.md#fp8-kv-caches).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn.testing import relative_l2


# ------------------------------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    head_dim: int
    windows: tuple[int, ...]  # per layer: sliding window in tokens (the query and the keys before it); 0: full causal
    softcap: float = 0.0  # soft-cap of the attention logits (Gemma 2); 0: off
    sinks: bool = False  # a learned sink logit per query head and layer (gpt-oss)
    qk_gain: float = 1.0  # scale of the q/k projections at init: large enough logits for the soft-cap to bend
    num_q_heads: int = 4
    num_kv_heads: int = 2
    vocab: int = 64
    d_model: int = 64
    d_ff: int = 128

    @property
    def num_layers(self) -> int:
        return len(self.windows)


GPT_OSS = ModelConfig(head_dim=64, windows=(8, 0), sinks=True)
GEMMA2 = ModelConfig(head_dim=256, windows=(8, 0), softcap=50.0, qk_gain=4.0)
ROPE_THETA, EPS = 10000.0, 1e-6


def init_params(cfg: ModelConfig, key) -> dict:
    keys = iter(jax.random.split(key, 2 + 8 * cfg.num_layers))

    def w(shape, gain=1.0):
        return jax.random.normal(next(keys), shape, jnp.float32) * gain * shape[0] ** -0.5

    hq, hkv, d = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.d_model
    layers = [dict(attn_norm=jnp.ones(d), wq=w((d, hq), cfg.qk_gain), wk=w((d, hkv), cfg.qk_gain), wv=w((d, hkv)),
                   wo=w((hq, d)), mlp_norm=jnp.ones(d), w_gate=w((d, cfg.d_ff)), w_up=w((d, cfg.d_ff)),
                   w_down=w((cfg.d_ff, d)), sinks=jax.random.normal(next(keys), (cfg.num_q_heads,), jnp.float32))
              for _ in range(cfg.num_layers)]
    return dict(embed=jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32), layers=layers,
                final_norm=jnp.ones(d), lm_head=w((d, cfg.vocab)))


def rms_norm(x, weight):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def rope(x, positions):  # x [T, H, D], positions i32[T] (absolute, per request)
    d = x.shape[-1]
    inv_freq = ROPE_THETA ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angle = positions[:, None].astype(jnp.float32) * inv_freq  # [T, D/2]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(params, cfg: ModelConfig, tokens, positions, attend):
    """tokens, positions: i32[T] packed rows -> logits f32[T, vocab]. ``attend(layer, q [T, Hq, D], k [T, Hkv, D],
    v)`` is the one thing the engine and the dense model do differently."""
    x = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])
        q = rope((h @ p["wq"]).reshape(-1, cfg.num_q_heads, cfg.head_dim), positions)
        k = rope((h @ p["wk"]).reshape(-1, cfg.num_kv_heads, cfg.head_dim), positions)
        v = (h @ p["wv"]).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        x = x + attend(i, q, k, v).reshape(-1, cfg.num_q_heads * cfg.head_dim) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    return rms_norm(x, params["final_norm"]) @ params["lm_head"]


def kernel_features(params, cfg: ModelConfig, layer: int) -> dict:
    """The layer's model-family keywords, as varlen_attention and paged_decode_attention take them."""
    window = cfg.windows[layer]
    return dict(window_size=(window - 1, 0) if window else (-1, -1), softcap=cfg.softcap,
                sinks=params["layers"][layer]["sinks"] if cfg.sinks else None)


# ------------------------------------------------------------------------------------------------- dense
def dense_attention(q, k, v, *, window: int, softcap: float, sinks):
    """One request, all of it: q [S, Hq, D], k, v [S, Hkv, D] -> [S, Hq, D]. Query i sees keys j <= i, and with a
    window only i - j < window; scores soft-capped; a sink is one more logit in the softmax, with no value."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # query head h reads kv head h // group
    s = jnp.einsum("ihd,jhd->hij", q, k) * d ** -0.5
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    s = jnp.where(visible, s, -jnp.inf)
    if sinks is not None:  # [Hq, S, S + 1]: the sink's column joins the softmax, then is dropped
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], (hq, n, 1))], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :n]
    return jnp.einsum("hij,jhd->ihd", p, v)


DENSE_LEN = 32  # every sequence zero-padded to one length (one compile); causality keeps the tail out of real rows


@functools.partial(jax.jit, static_argnums=1)
def dense_logits(params, cfg: ModelConfig, tokens):  # tokens i32[DENSE_LEN] -> logits of every row
    def attend(i, q, k, v):
        return dense_attention(q, k, v, window=cfg.windows[i], softcap=cfg.softcap,
                               sinks=params["layers"][i]["sinks"] if cfg.sinks else None)

    return forward(params, cfg, tokens, jnp.arange(DENSE_LEN, dtype=jnp.int32), attend)


def dense_generate(params, cfg: ModelConfig, prompt, new_tokens: int):
    """Greedy: the new tokens and the logits that chose each, f32[new_tokens, vocab]."""
    seq, logits = list(prompt), []
    for _ in range(new_tokens):
        row = dense_logits(params, cfg, jnp.asarray(seq + [0] * (DENSE_LEN - len(seq)), jnp.int32))[len(seq) - 1]
        logits.append(row)
        seq.append(int(jnp.argmax(row)))
    return seq[len(prompt):], jnp.stack(logits)


# ------------------------------------------------------------------------------------------------- engine
BLOCK_SIZE = 16
NUM_BLOCKS = 8
TABLES = np.array([[5, 2], [0, 6]], np.int32)  # request 0: pages 5 then 2; request 1: pages 0 then 6
FREE_PAGES = np.array([1, 3, 4, 7])  # no request owns them: NaN, so a read that leaks shows in the logits


def empty_caches(cfg: ModelConfig, kv: tuple | None = None, dtype=jnp.float32):
    """One cache per layer, ``(k_cache, v_cache)`` ``[NUM_BLOCKS, BLOCK_SIZE, Hkv, D]`` in ``dtype``, the free pages
    poisoned. ``kv = (fp8 dtype, "tensor" | "token")``: FP8 caches, with their scales as the tuple's tail: per
    tensor, set from the prompt's keys and values at the first write (:func:`write`); per token and head, scale
    caches (their free pages NaN too)."""
    dtype, mode = kv or (dtype, None)
    caches = []
    for _ in range(cfg.num_layers):
        k, v = pallas_attn.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
        cache = (k.at[FREE_PAGES].set(jnp.nan), v.at[FREE_PAGES].set(jnp.nan))
        if mode == "token":
            cache += tuple(s.at[FREE_PAGES].set(jnp.nan) for s in pallas_attn.allocate_kv_scales(
                NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads))
        elif mode == "tensor":
            cache += (None, None)
        caches.append(cache)
    return caches


def write(cache, k, v, slot_mapping):
    """``write_kv_cache`` into one layer's cache (:func:`empty_caches`); per-tensor scales not yet set are
    calibrated on these rows (their largest magnitude at the top of the format), as a deployment calibrates on
    sample prompts."""
    if len(cache) == 2:
        return pallas_attn.write_kv_cache(*cache, k, v, slot_mapping)
    k_cache, v_cache, k_scale, v_scale = cache
    if k_scale is None:
        k_scale, v_scale = (pallas_attn.reference.kv_scale_per_tensor(x, k_cache.dtype) for x in (k, v))
    out = pallas_attn.write_kv_cache(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return out if len(out) == 4 else (*out, k_scale, v_scale)


def read(cache) -> tuple:
    """``(k_cache, v_cache)`` and the kernels' keyword arguments for its scales."""
    return cache[:2], dict(zip(("k_scale", "v_scale"), cache[2:]))


def serve(params, cfg: ModelConfig, prompts, new_tokens: int, on_step=None, kv=None, forced=None,
          dtype=jnp.float32):
    """Packed prefill, then ``new_tokens - 1`` decode steps over the paged caches, greedy. Returns the new tokens
    and the logits that chose them, per request. ``on_step(step)`` runs after the prefill (step 0) and each decode
    step; ``kv``: FP8 caches (:func:`empty_caches`); ``forced``: the tokens to feed back (per request, as returned)
    instead of the argmax, to compare two engines' logits along one token path; ``dtype``: of the kernels' q, k, v
    and of the caches (the rest of the model stays float32)."""
    n = len(prompts)
    lens = np.array([len(p) for p in prompts])
    assert np.all(-(-(lens + new_tokens) // BLOCK_SIZE) <= TABLES.shape[1]), "the tables hold every token"
    caches = empty_caches(cfg, kv, dtype)

    def cast(attend):  # the kernels' dtype in, float32 out
        return lambda layer, *qkv: attend(layer, *(x.astype(dtype) for x in qkv)).astype(jnp.float32)

    # prefill: the prompts packed (bucketed to md.num_tokens rows; padding rows have slot -1, skipped by the write)
    md = pallas_attn.build_metadata(lens, np.zeros(n, np.int64), BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                    block_tables=TABLES)
    real = int(md.cu_query_lens[-1])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:real] = np.concatenate(prompts)
    positions = np.zeros(md.num_tokens, np.int32)
    positions[:real] = np.concatenate([np.arange(length) for length in lens])

    def prefill_attend(layer, q, k, v):
        caches[layer] = write(caches[layer], k, v, md.slot_mapping)
        return pallas_attn.varlen_attention(q, k, v, md.cu_query_lens, max_seqlen=md.max_query_len,
                                            **kernel_features(params, cfg, layer))

    logits = forward(params, cfg, tokens, positions, cast(prefill_attend))[md.cu_query_lens[1:n + 1] - 1]
    step_logits = [logits]
    if on_step:
        on_step(0)

    # decode: one token per request per step, at position = tokens cached before it
    cached = lens.copy()
    for step in range(1, new_tokens):
        md = pallas_attn.build_metadata(np.ones(n, np.int64), cached, BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                        block_tables=TABLES, num_seqs=n, num_tokens=n)

        def decode_attend(layer, q, k, v, md=md):
            caches[layer] = write(caches[layer], k, v, md.slot_mapping)
            (k_cache, v_cache), scales = read(caches[layer])
            return pallas_attn.paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, **scales,
                                                      **kernel_features(params, cfg, layer))

        next_tokens = (jnp.argmax(step_logits[-1], axis=-1).astype(jnp.int32) if forced is None
                       else jnp.asarray([f[step - 1] for f in forced], jnp.int32))
        step_logits.append(forward(params, cfg, next_tokens, jnp.asarray(cached, jnp.int32), cast(decode_attend)))
        cached = cached + 1
        if on_step:
            on_step(step)
    logits = jnp.stack(step_logits, axis=1)  # [n, new_tokens, vocab]
    tokens = np.asarray(jnp.argmax(logits, axis=-1))
    return [tokens[i].tolist() for i in range(n)], [logits[i] for i in range(n)]


def serve_ragged(params, cfg: ModelConfig, prompts, new_tokens: int, kv=None):
    """The same requests through ``paged_attention`` alone, as a scheduler with a token budget runs them: the
    prompts in two chunks (the second attends to the first from the cache: chunked prefill over a prefix the
    window partly leaves behind), then one token per request per step. Returns what :func:`serve` returns."""
    n = len(prompts)
    caches = empty_caches(cfg, kv)
    cached = np.zeros(n, np.int64)

    def step(chunks):  # chunks: the new tokens of each request -> logits of each request's last one
        nonlocal cached
        q_lens = np.array([len(c) for c in chunks])
        md = pallas_attn.build_metadata(q_lens, cached, BLOCK_SIZE, num_blocks=NUM_BLOCKS, block_tables=TABLES)
        real = int(md.cu_query_lens[-1])
        tokens = np.zeros(md.num_tokens, np.int32)
        tokens[:real] = np.concatenate(chunks)
        positions = np.zeros(md.num_tokens, np.int32)
        positions[:real] = np.concatenate([np.arange(c, c + q) for c, q in zip(cached, q_lens)])

        def attend(layer, q, k, v):
            caches[layer] = write(caches[layer], k, v, md.slot_mapping)
            (k_cache, v_cache), scales = read(caches[layer])
            return pallas_attn.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_query_lens,
                                               max_query_len=md.max_query_len, **scales,
                                               **kernel_features(params, cfg, layer))

        cached = cached + q_lens
        return forward(params, cfg, tokens, positions, attend)[md.cu_query_lens[1:n + 1] - 1]

    step([p[:10] for p in prompts])
    step_logits = [step([p[10:] for p in prompts])]
    for _ in range(1, new_tokens):
        step_logits.append(step([np.asarray(jnp.argmax(step_logits[-1], axis=-1), np.int32)[i:i + 1]
                                 for i in range(n)]))
    logits = jnp.stack(step_logits, axis=1)  # [n, new_tokens, vocab]
    tokens = np.asarray(jnp.argmax(logits, axis=-1))
    return [tokens[i].tolist() for i in range(n)], [logits[i] for i in range(n)]


# ------------------------------------------------------------------------------------------------- tests
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """Full float32 matmuls in both models: on a GPU, XLA's default for float32 is TF32 (about 1e-3 relative), which
    the kernels' float32 dots do not use; the comparison is of attention, not of matmul precision."""
    with jax.default_matmul_precision("highest"):
        yield


def _prompts(cfg: ModelConfig):
    rng = np.random.default_rng(0)
    return [rng.integers(1, cfg.vocab, length).astype(np.int32) for length in (21, 13)]


@pytest.mark.parametrize("engine", [serve, serve_ragged], ids=["varlen+decode", "ragged"])
@pytest.mark.parametrize("cfg", [GPT_OSS, GEMMA2], ids=["gpt-oss", "gemma2"])
def test_engine_generates_the_dense_models_tokens(cfg, engine):
    params = init_params(cfg, jax.random.key(0))
    prompts = _prompts(cfg)
    engine_tokens, engine_logits = engine(params, cfg, prompts, NEW_TOKENS)
    for prompt, tokens, logits in zip(prompts, engine_tokens, engine_logits):
        dense_tokens, dense = dense_generate(params, cfg, prompt, NEW_TOKENS)
        assert tokens == dense_tokens
        for step in range(NEW_TOKENS):
            assert relative_l2(logits[step], dense[step]) < 1e-4, step


@pytest.mark.parametrize("cfg, off", [(GPT_OSS, dict(windows=(0, 0))), (GPT_OSS, dict(sinks=False)),
                                      (GEMMA2, dict(windows=(0, 0))), (GEMMA2, dict(softcap=0.0))],
                         ids=["gpt-oss-window", "gpt-oss-sinks", "gemma2-window", "gemma2-softcap"])
def test_each_feature_changes_the_dense_model(cfg, off):
    """The comparison above would not notice a feature the kernels ignore unless the feature matters here."""
    params = init_params(cfg, jax.random.key(0))
    prompt = _prompts(cfg)[0]
    _, with_it = dense_generate(params, cfg, prompt, NEW_TOKENS)
    _, without = dense_generate(params, dataclasses.replace(cfg, **off), prompt, NEW_TOKENS)
    assert relative_l2(without, with_it) > 1e-2


def _jitted(fn):
    """The jitted function behind the public wrappers (argument checks, renamed arguments)."""
    while not hasattr(fn, "_cache_size"):
        fn = fn.__wrapped__
    return fn


def test_alternating_layers_compile_once_per_layer_kind():
    """Three layers, windowed / full / windowed: each kernel compiles one program per layer kind, in the prefill and
    in the first decode step, and none in the steps after (shapes bucketed, features static per layer, sinks data)."""
    cfg = ModelConfig(head_dim=32, windows=(8, 0, 8), sinks=True, num_q_heads=2, num_kv_heads=1)  # shapes of its own
    params = init_params(cfg, jax.random.key(1))
    varlen, decode = _jitted(pallas_attn.varlen_attention), _jitted(pallas_attn.paged_decode_attention)
    before = varlen._cache_size(), decode._cache_size()
    programs = []
    serve(params, cfg, _prompts(cfg), 3,
          on_step=lambda step: programs.append((varlen._cache_size() - before[0], decode._cache_size() - before[1])))
    kinds = len(set(cfg.windows))
    assert programs == [(kinds, 0), (kinds, kinds), (kinds, kinds)]  # after the prefill, then each decode step


# Both models in bf16 with JAX's Pallas Triton backend gone (as tests/test_no_triton.py simulates it): the prefill
# and every decode step on the Mosaic GPU kernels (their interpreter on CPU), the same greedy tokens as the float32
# dense model, the logits within bf16's error.
SERVE_WITHOUT_TRITON = textwrap.dedent("""
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None  # what a JAX without the backend does on import
    import jax, jax.numpy as jnp
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # the Mosaic GPU interpreter: tests/conftest.py
    from tests import test_models as m
    assert not m.pallas_attn.core.backend.triton_available()
    with jax.default_matmul_precision("highest"):
        for cfg in (m.GPT_OSS, m.GEMMA2):
            params = m.init_params(cfg, jax.random.key(0))
            prompts = m._prompts(cfg)
            tokens, logits = m.serve(params, cfg, prompts, m.NEW_TOKENS, dtype=jnp.bfloat16)
            for prompt, got_tokens, got in zip(prompts, tokens, logits):
                want_tokens, want = m.dense_generate(params, cfg, prompt, m.NEW_TOKENS)
                assert got_tokens == want_tokens, (got_tokens, want_tokens)
                assert float(m.relative_l2(got, want)) < 2e-2
    print("OK")
""")


@pytest.mark.timeout(900)
def test_models_served_without_the_triton_backend():
    result = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TRITON], capture_output=True, text=True,
                            timeout=880, cwd=pathlib.Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines()[-1] == "OK", result.stdout


FP8_CACHES = [(jnp.float8_e4m3fn, "tensor"), (jnp.float8_e4m3fn, "token"), (jnp.float8_e5m2, "tensor"),
              (jnp.float8_e5m2, "token")]
FP8_IDS = ["e4m3-tensor", "e4m3-token", "e5m2-tensor", "e5m2-token"]


@pytest.mark.parametrize("kv", FP8_CACHES, ids=FP8_IDS)
def test_fp8_cache_logits_along_the_same_tokens(kv):
    """The gpt-oss-shaped model over an FP8 cache, fed the float32 cache's greedy tokens: every step's logits
    within the format's error of the float32 cache's (e4m3: 3 mantissa bits, e5m2: 2), the NaN free pages (and
    their NaN scales) never read. The bounds leave room over the largest error :func:`fp8_agreement` measures
    (docs/performance.md#fp8-kv-caches)."""
    params = init_params(GPT_OSS, jax.random.key(0))
    prompts = _prompts(GPT_OSS)
    tokens, base = serve(params, GPT_OSS, prompts, NEW_TOKENS)
    _, fp8 = serve(params, GPT_OSS, prompts, NEW_TOKENS, kv=kv, forced=tokens)
    bound = 0.04 if kv[0] == jnp.float8_e4m3fn else 0.07
    for logits, want in zip(fp8, base):
        assert np.isfinite(np.asarray(logits)).all()
        assert relative_l2(logits, want) < bound


def fp8_agreement(seeds: int = 5, new_tokens: int = 10) -> dict:
    """For each model, FP8 cache and seed (weights and prompts): whether greedy decoding over the FP8 cache
    gives the float32 cache's tokens, per request; and along the float32 cache's tokens, the logits' relative L2
    and how many steps' argmax differ."""
    out = {}
    for cfg, name in ((GPT_OSS, "gpt-oss"), (GEMMA2, "gemma2")):
        for seed in range(seeds):
            params = init_params(cfg, jax.random.key(seed))
            rng = np.random.default_rng(seed)
            prompts = [rng.integers(1, cfg.vocab, n).astype(np.int32) for n in (21, 13)]
            tokens, base = serve(params, cfg, prompts, new_tokens)
            for kv, kv_id in zip(FP8_CACHES, FP8_IDS):
                row = out.setdefault(f"{name} {kv_id}", {"requests": 0, "identical_tokens": 0, "steps": 0,
                                                          "forced_argmax_changed": 0, "max_rel_l2": 0.0})
                fp8_tokens, _ = serve(params, cfg, prompts, new_tokens, kv=kv)
                _, forced = serve(params, cfg, prompts, new_tokens, kv=kv, forced=tokens)
                row["requests"] += len(prompts)
                row["identical_tokens"] += sum(a == b for a, b in zip(fp8_tokens, tokens))
                row["steps"] += len(prompts) * new_tokens
                row["forced_argmax_changed"] += int(sum(np.sum(np.argmax(np.asarray(f), -1) != np.asarray(t))
                                                        for f, t in zip(forced, tokens)))
                row["max_rel_l2"] = max(row["max_rel_l2"], *(float(relative_l2(f, b)) for f, b in zip(forced, base)))
    return out


if __name__ == "__main__":  # python -m tests.test_models [seeds]: fp8_agreement as JSON in $OUT/fp8-serving.json
    with jax.default_matmul_precision("highest"):
        doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
               "fp8_agreement": fp8_agreement(int(sys.argv[1]) if len(sys.argv) > 1 else 5)}
    path = pathlib.Path(os.environ.get("OUT", "."), "fp8-serving.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
