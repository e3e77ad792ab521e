"""Generates notebooks/01_packed_requests.ipynb, 02_paged_kv.ipynb, 03_use_in_a_model.ipynb and 04_threads.ipynb
(outputs stripped).

    python notebooks/_build.py
"""
import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent

SETUP = '''\
import os, pathlib, sys
# Make `import pallas_attn` work from a source checkout, whatever the kernel's working directory.
_root = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "pallas_attn").is_dir())
sys.path.insert(0, str(_root))
import matplotlib
if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import jax, jax.numpy as jnp
import pallas_attn
from pallas_attn import reference
from pallas_attn.core import backend, masks
from pallas_attn.testing import relative_l2, random_packed, make_paged_kv
print("jax", jax.__version__, "on", jax.default_backend(), "| interpret mode:", backend.resolve_interpret(None))'''


def nb(cells):
    book = new_notebook()
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book.cells = [new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c) for c in cells]
    for c in book.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    return book


NB1 = [
"""md:# 01 — Many requests in one launch: packing, masks, tiles, online softmax

The first half of [the design](../docs/design.md) with pictures. Everything runs on CPU: the Pallas kernels run in
*interpret mode* (same kernel code, executed by the host), so the shapes here are tiny.""",
SETUP,
"""md:## 1. Packing: two requests, one token tensor

Request A has 6 tokens, request B has 4. Their tokens are concatenated along the token axis —
`Q: [total_tokens, num_heads, head_dim]` — and the boundaries are kept in `cu_seqlens` (prefix sums of the
lengths). Row `t` belongs to request `b` iff `cu_seqlens[b] <= t < cu_seqlens[b+1]`.""",
"""lens = np.array([6, 4])                       # A, B
cu_seqlens = np.concatenate([[0], np.cumsum(lens)])
print("seq_lens  =", lens.tolist())
print("cu_seqlens =", cu_seqlens.tolist())
owner = np.repeat(["A", "B"], lens)
local = np.concatenate([np.arange(n) for n in lens])
for t in range(cu_seqlens[-1]):
    print(f"packed row {t:2d}: request {owner[t]}, local position {local[t]}")""",
"""md:## 2. The logical mask of a mixed batch: block-diagonal, each block causal

Logically the packed score matrix is block-diagonal: a request never sees another request's keys, and inside its
block it is lower-triangular (causal). The kernels never build this matrix — each program computes its own piece
of the mask in registers from request-local positions — but it is the picture of what they compute.""",
"""mixed = np.array([6, 4, 9, 3])                 # a mixed batch of four requests
cu = np.concatenate([[0], np.cumsum(mixed)])
T = cu[-1]
req = np.searchsorted(cu, np.arange(T), side="right") - 1
pos = np.arange(T) - cu[req]
visible = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None])
fig, ax = plt.subplots(figsize=(4.5, 4.5))
ax.imshow(visible, cmap="Blues", interpolation="nearest")
for c in cu[1:-1]:
    ax.axhline(c - 0.5, color="k", lw=0.5); ax.axvline(c - 0.5, color="k", lw=0.5)
ax.set_xlabel("key (packed row)"); ax.set_ylabel("query (packed row)")
ax.set_title(f"visible(q, k), lens {mixed.tolist()}")
plt.show()
print(f"{visible.sum()} of {T*T} entries visible ({visible.mean():.0%}); nothing of the rest is ever computed")""",
"""md:## 3. The prefill grid: `(batch, heads, q_tiles)`

`grid = (batch, num_heads, cdiv(max_seqlen, BLOCK_M))`. Program `(b, h, m)` owns rows
`[seq_start + m·BLOCK_M, seq_start + min((m+1)·BLOCK_M, seq_len))` of head `h`. Programs whose tile starts past
`seq_len` exit at once (they exist only because the grid is rectangular).""",
"""BLOCK_M = 4
n_tiles = -(-mixed.max() // BLOCK_M)
print(f"grid = (batch={len(mixed)}, heads=H, q_tiles={n_tiles}),  BLOCK_M={BLOCK_M}\\n")
print(f"{'program (b, h, m)':<18} {'packed rows owned':<20} note")
for b, n in enumerate(mixed):
    for m in range(n_tiles):
        lo, hi = m * BLOCK_M, min((m + 1) * BLOCK_M, n)
        if lo >= n:
            print(f"({b}, h, {m})".ljust(18), "-".ljust(20), "tile starts past seq_len: exits at once")
        else:
            print(f"({b}, h, {m})".ljust(18), f"[{cu[b]+lo}, {cu[b]+hi})".ljust(20),
                  f"local rows {lo}..{hi-1}" + (" (partial tile)" if hi - lo < BLOCK_M else ""))
# the same as a picture: which program (b, m) owns each packed row
owner_prog = np.array([req[t] * n_tiles + pos[t] // BLOCK_M for t in range(T)])
fig, ax = plt.subplots(figsize=(7, 1.2))
ax.imshow(owner_prog[None, :], cmap="tab20", aspect="auto")
for t in range(T):
    ax.text(t, 0, f"{req[t]},{pos[t] // BLOCK_M}", ha="center", va="center", fontsize=6)
ax.set_yticks([]); ax.set_xlabel("packed row"); ax.set_title("owner program (b, m) of each row (every head h alike)")
plt.show()""",
"""md:## 4. Tile classes: ■ full, △ diagonal, · future

Walking over KV tiles, a query tile meets *full* tiles (entirely below the diagonal: no mask at all),
*diagonal* tiles (element-wise mask) and *future* tiles (never visited: the loop stops at the diagonal).
The map below is drawn by `pallas_attn.core.masks.tile_map`, which uses the same bounds
(`masks.kv_tile_ranges`) as the kernels.""",
"""q_len = kv_len = 40
bm, bn = 8, 8
tm = masks.tile_map(q_len, kv_len, bm, bn, causal=True)
print(f"request of {q_len} tokens, BLOCK_M={bm}, BLOCK_N={bn}: rows = query tiles, columns = KV tiles")
for row in tm:
    print("  " + " ".join(row))
code = {masks.FULL: 2, masks.DIAGONAL: 1, masks.FUTURE: 0}
fig, ax = plt.subplots(figsize=(3.5, 3.5))
ax.imshow(np.vectorize(code.get)(tm), cmap="Greens", vmin=0, vmax=2)
for (i, j), s in np.ndenumerate(tm):
    ax.text(j, i, s, ha="center", va="center")
ax.set_xlabel("KV tile"); ax.set_ylabel("query tile"); ax.set_title("tile_map (■ / △ / ·)")
plt.show()
print("counts:", {s: int((tm == s).sum()) for s in (masks.FULL, masks.DIAGONAL, masks.FUTURE)})""",
"""md:## 5. Online softmax, step by step

Per query row keep a running max `m`, running sum `l` and accumulator `acc`. For each KV tile:
`m_new = max(m, rowmax(S))`, `alpha = exp(m - m_new)`, `l = alpha·l + Σ exp(S - m_new)`,
`acc = alpha·acc + exp(S - m_new)·V`; finally `out = acc / l`. The `[L, L]` score matrix is never stored.""",
"""rs = np.random.default_rng(0)
L, D, BN = 12, 8, 4
q1 = rs.standard_normal(D); K = rs.standard_normal((L, D)); V = rs.standard_normal((L, D))
scale = D ** -0.5
m, l, acc = -np.inf, 0.0, np.zeros(D)
for j in range(0, L, BN):
    s = (K[j:j+BN] @ q1) * scale
    m_new = max(m, s.max())
    alpha = np.exp(m - m_new)
    p = np.exp(s - m_new)
    l = alpha * l + p.sum()
    acc = alpha * acc + p @ V[j:j+BN]
    print(f"tile {j//BN}: keys {j}..{j+BN-1}  m={m_new:+.3f}  alpha={alpha:.3f}  l={l:.3f}")
    m = m_new
out_online = acc / l
s_full = (K @ q1) * scale
w = np.exp(s_full - s_full.max()); w /= w.sum()
out_full = w @ V
print("max |online - full softmax| =", np.abs(out_online - out_full).max())
assert np.allclose(out_online, out_full)""",
"""md:## 6. The kernel: `varlen_attention` on the packed batch

A and B packed (plus one more request), several heads, `head_dim` 64, checked against the pure-jnp oracle
`pallas_attn.reference.varlen_attention`.""",
"""rng = np.random.default_rng(0)
lens_k = [6, 4, 13]
H, D = 4, 64
q, cu_j = random_packed(rng, lens_k, H, D, jnp.float32)
k, _ = random_packed(rng, lens_k, H, D, jnp.float32)
v, _ = random_packed(rng, lens_k, H, D, jnp.float32)
out = pallas_attn.varlen_attention(q, k, v, cu_j, max_seqlen=16)
ref = reference.varlen_attention(q, k, v, cu_j)
err = relative_l2(out, ref)
print("q", q.shape, "cu_seqlens", np.asarray(cu_j).tolist(), "-> out", out.shape, f"| rel. L2 vs reference {err:.2e}")
assert err < 1e-4
# isolation: changing request B's keys does not change request A's outputs
k2 = k.at[6:10].set(100.0)
out2 = pallas_attn.varlen_attention(q, k2, v, cu_j, max_seqlen=16)
print("A's rows unchanged when B's keys change:", bool(jnp.allclose(out[:6], out2[:6])))
assert jnp.allclose(out[:6], out2[:6])""",
"""md:## 7. Decode and verification masks

**Decode**: one new query at the end of its context — its mask row is all-visible (a long vector per head,
memory-bound). **Verification** (speculative decoding): `q_len` draft tokens after `context_len` cached ones see a
full `[q_len, context_len]` rectangle plus a `[q_len, q_len]` lower triangle; from absolute positions,
`key_pos <= context_len + q_local`.""",
"""context_len, q_len = 20, 6
kv = context_len + q_len
key_pos = np.arange(kv)
decode_row = key_pos[None, :] <= (kv - 1)                           # one query, at position kv-1
verify = key_pos[None, :] <= context_len + np.arange(q_len)[:, None]
fig, axes = plt.subplots(2, 1, figsize=(7, 3), gridspec_kw={"height_ratios": [1, q_len]})
axes[0].imshow(decode_row, cmap="Blues", vmin=0, vmax=1, aspect="auto"); axes[0].set_yticks([])
axes[0].set_title(f"decode: one row, all {kv} keys visible")
axes[1].imshow(verify, cmap="Blues", vmin=0, vmax=1, aspect="auto")
axes[1].axvline(context_len - 0.5, color="r", lw=1)
axes[1].set_title(f"verification: q_len={q_len} after context {context_len} = rectangle + triangle")
axes[1].set_xlabel("key position"); axes[1].set_ylabel("draft token")
plt.tight_layout(); plt.show()
print("tile map of the verification (BLOCK_M=8, BLOCK_N=8):")
for row in masks.tile_map(q_len, kv, 8, 8):
    print("  " + " ".join(row))""",
]

NB2 = [
"""md:# 02 — Paged KV cache: block tables, a decode loop, split-KV, sparse top-k

[The design](../docs/design.md#paged-kv-layout), paged half. All requests share one pool of pages; each request's
block table maps its logical pages to physical ones: `physical = block_table[req][pos // block_size]`,
`slot = physical·block_size + pos % block_size`.""",
SETUP,
"""md:## 1. Block tables and the page pool

`build_metadata` allocates pages from a shuffled pool (so tables are never the identity).""",
"""BS = 4                                            # tokens per page
prompt = np.array([5, 9, 3])                      # three requests' prompts
STEPS = 3                                         # decode steps we will run
final = prompt + STEPS
pages_needed = int((-(-final // BS)).sum())
NUM_BLOCKS = pages_needed + 3                     # 3 free pages
md_final = pallas_attn.build_metadata(final, np.zeros_like(final), BS, num_blocks=NUM_BLOCKS, seed=1)
tables = md_final.block_tables
for i, n in enumerate(final):
    print(f"request {i}: {n} tokens -> logical pages 0..{-(-n // BS) - 1} -> physical {tables[i, : -(-n // BS)].tolist()}")
owner = np.full(NUM_BLOCKS, -1)
fill = np.zeros(NUM_BLOCKS)
for i, n in enumerate(final):
    for j in range(-(-n // BS)):
        owner[tables[i, j]] = i
        fill[tables[i, j]] = min(BS, n - j * BS) / BS
fig, ax = plt.subplots(figsize=(8, 1.6))
colors = plt.cm.tab10(np.arange(10))
for p in range(NUM_BLOCKS):
    c = colors[owner[p]] if owner[p] >= 0 else (0.9, 0.9, 0.9, 1)
    ax.bar(p, fill[p] if owner[p] >= 0 else 1, color=c, edgecolor="k")
    ax.text(p, 0.5, "free" if owner[p] < 0 else f"r{owner[p]}", ha="center", va="center", fontsize=7)
ax.set_xticks(range(NUM_BLOCKS)); ax.set_yticks([]); ax.set_xlabel("physical page")
ax.set_title("page pool: owner request (bar height = fraction of the page used)")
plt.show()""",
"""md:## 2. A decode loop: `build_metadata` → `write_kv_cache` → `paged_attention`

Step 0 is the prefill of every prompt; then each step adds one token per request. Each step's new K/V go to the
cache through `slot_mapping`; the kernel reads all of the request's history through its block table, and is
checked against the reference every step.""",
"""rng = np.random.default_rng(0)
HQ, HKV, D = 4, 2, 64                             # GQA: 2 query heads per KV head
k_cache, v_cache = pallas_attn.allocate_kv_cache(NUM_BLOCKS, BS, HKV, D, jnp.float32)
context = np.zeros_like(prompt)
query_lens = prompt.copy()
for step in range(STEPS + 1):
    md = pallas_attn.build_metadata(query_lens, context, BS, num_blocks=NUM_BLOCKS, block_tables=tables)
    q, _ = random_packed(rng, query_lens, HQ, D, jnp.float32, pad_to=md.num_tokens)
    k_new, _ = random_packed(rng, query_lens, HKV, D, jnp.float32, pad_to=md.num_tokens)
    v_new, _ = random_packed(rng, query_lens, HKV, D, jnp.float32, pad_to=md.num_tokens)
    k_cache, v_cache = pallas_attn.write_kv_cache(k_cache, v_cache, k_new, v_new, jnp.asarray(md.slot_mapping))
    args = (q, k_cache, v_cache, jnp.asarray(md.block_tables), jnp.asarray(md.seq_lens), jnp.asarray(md.cu_query_lens))
    out = pallas_attn.paged_attention(*args, max_query_len=md.max_query_len)
    ref = reference.paged_attention(*args)
    n = int(md.cu_query_lens[-1])
    err = relative_l2(out, ref, valid=n)
    print(f"step {step}: query_lens {query_lens.tolist()} seq_lens {md.seq_lens.tolist()} "
          f"slots {md.slot_mapping[:n].tolist()} | rel. L2 {err:.1e}")
    assert err < 1e-4
    context = context + query_lens
    query_lens = np.ones_like(prompt)""",
"""md:## 3. Split-KV (flash-decoding) and the merge

With few requests and long contexts, `batch × kv_heads` programs cannot fill the GPU: split each sequence into
segments, each writes `(m_s, l_s, O_s)` (here: output + LSE), and a reduction merges them:
`m = max lse_s`, `w_s = exp(lse_s − m)`, `O = Σ w_s·O_s / Σ w_s`. The kernel does it with `num_splits`; below the
same thing by hand with two calls over disjoint key ranges and `merge_attention_states`.""",
"""rng = np.random.default_rng(1)
lens = np.array([70, 33])
kc, vc, bt = make_paged_kv(rng, lens, 16, HKV, D, jnp.float32)
qd = jnp.asarray(rng.standard_normal((len(lens), HQ, D)), jnp.float32)
seq_lens = jnp.asarray(lens, jnp.int32)
ref = reference.paged_decode_attention(qd, kc, vc, bt, seq_lens)
o1 = pallas_attn.paged_decode_attention(qd, kc, vc, bt, seq_lens, num_splits=1)
o4 = pallas_attn.paged_decode_attention(qd, kc, vc, bt, seq_lens, num_splits=4)
print(f"num_splits=1: rel. L2 {relative_l2(o1, ref):.1e}   num_splits=4: rel. L2 {relative_l2(o4, ref):.1e}   "
      f"|1 vs 4| max {float(jnp.abs(o1 - o4).max()):.1e}")
assert relative_l2(o1, ref) < 1e-4 and relative_l2(o4, ref) < 1e-4

# by hand: keys [0, 32) and [32, seq_len) — the second half reads the table shifted by 32 // 16 = 2 pages
AT = 32
shift = AT // 16
bt_hi = jnp.concatenate([bt[:, shift:], jnp.full((bt.shape[0], shift), -1, bt.dtype)], axis=1)
lo_len = jnp.minimum(seq_lens, AT)
o_lo, lse_lo = pallas_attn.paged_decode_attention(qd, kc, vc, bt, lo_len, num_splits=1, return_lse=True)
o_hi, lse_hi = pallas_attn.paged_decode_attention(qd, kc, vc, bt_hi, seq_lens - lo_len, num_splits=1, return_lse=True)
merged, lse = pallas_attn.merge_attention_states(jnp.stack([o_lo, o_hi]), jnp.stack([lse_lo, lse_hi]))
print("segment LSEs (request 0, head 0):", float(lse_lo[0, 0]), float(lse_hi[0, 0]), "-> merged", float(lse[0, 0]))
print(f"manual split + merge: rel. L2 vs reference {relative_l2(merged, ref):.1e}")
assert relative_l2(merged, ref) < 1e-4""",
"""md:## 4. Sparse top-k attention: positions → pages

Each query attends only to its top-k selected positions of an MLA latent cache (one shared KV head;
query/key dim = latent rank + rope dims, value = the first `kv_lora_rank` dims). A selected logical position goes
through the request's block table: `page = block_table[pos // block_size]`, `row = pos % block_size`. Shapes are
tiny here (rank 64 + rope 32) instead of DeepSeek's 512 + 64.""",
"""rng = np.random.default_rng(2)
RANK, ROPE, HS, TOPK, BS2 = 64, 32, 4, 8, 8
seq = np.array([40, 23])
lat, _, bt2 = make_paged_kv(rng, seq, BS2, None, RANK + ROPE, jnp.float32)
qs = jnp.asarray(rng.standard_normal((len(seq), HS, RANK + ROPE)), jnp.float32)
topk = np.stack([rng.permutation(n)[:TOPK] for n in seq]).astype(np.int32)
topk[1, -2:] = -1                                  # unused slots
i = 0
print(f"request {i}, top-{TOPK} positions -> (page, row):")
for p in topk[i]:
    print(f"  pos {p:3d} -> logical page {p // BS2} -> physical page {int(bt2[i, p // BS2]):2d}, row {p % BS2}")
pages_touched = sorted({int(bt2[i, p // BS2]) for p in topk[i] if p >= 0})
print("pages touched:", pages_touched, "of the request's", [int(x) for x in bt2[i, : -(-seq[i] // BS2)]])
out = pallas_attn.sparse_mla_attention(qs, lat, bt2, jnp.asarray(topk), kv_lora_rank=RANK)
ref = reference.sparse_mla_attention(qs, lat, bt2, jnp.asarray(topk), kv_lora_rank=RANK)
print("out", out.shape, f"| rel. L2 vs reference {relative_l2(out, ref):.1e}")
assert relative_l2(out, ref) < 1e-4""",
]

SETUP3 = SETUP + "\nimport functools, time"

NB3 = [
"""md:# 03 — Use in a model: a small Llama-style decoder with packed prefill and paged decode

A 2-layer Llama-style decoder in plain JAX (random weights): RMSNorm, rotary embeddings (RoPE), grouped-query
attention (4 query heads share 2 KV heads, head_dim 64), a SwiGLU MLP, vocabulary 128, d_model 256.

The model is written once, with its attention as a pluggable function, and run two ways:

* **engine** — the prompts of three requests (different lengths) are packed into one token tensor and prefilled
  with `pallas_attn.varlen_attention`; every layer's K/V go into its own paged cache through
  `build_metadata` → `write_kv_cache`; then each decode step runs the whole batch (one token per request) through
  `pallas_attn.paged_decode_attention`, one jitted step function with static, bucketed shapes.
* **dense** — each prompt alone, plain `jnp` causal softmax over the full sequence, recomputed from scratch for
  every new token (no cache at all).

Greedy decoding must give the same tokens both ways. float32 on CPU (the kernels run in interpret mode).""",
SETUP3,
"""md:## 1. The model

`forward(params, tokens, positions, attend)` takes packed token rows and their positions; `attend(layer, q, k, v)`
is the only thing that differs between the two versions.""",
"""VOCAB, D_MODEL, N_LAYERS, D_FF = 128, 256, 2, 512
HQ, HKV, HD = 4, 2, 64                             # GQA: 2 query heads per KV head
ROPE_THETA, EPS = 10000.0, 1e-6


def init_params(key):
    keys = iter(jax.random.split(key, 2 + 7 * N_LAYERS))
    w = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5
    layers = [dict(attn_norm=jnp.ones(D_MODEL), wq=w((D_MODEL, HQ * HD)), wk=w((D_MODEL, HKV * HD)),
                   wv=w((D_MODEL, HKV * HD)), wo=w((HQ * HD, D_MODEL)), mlp_norm=jnp.ones(D_MODEL),
                   w_gate=w((D_MODEL, D_FF)), w_up=w((D_MODEL, D_FF)), w_down=w((D_FF, D_MODEL)))
              for _ in range(N_LAYERS)]
    return dict(embed=jax.random.normal(next(keys), (VOCAB, D_MODEL), jnp.float32), layers=layers,
                final_norm=jnp.ones(D_MODEL), lm_head=w((D_MODEL, VOCAB)))


def rms_norm(x, weight):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def rope(x, positions):                            # x [T, H, HD], positions i32[T] (absolute, per request)
    inv_freq = ROPE_THETA ** (-jnp.arange(0, HD, 2, dtype=jnp.float32) / HD)
    angle = positions[:, None].astype(jnp.float32) * inv_freq  # [T, HD/2]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(params, tokens, positions, attend):
    # tokens, positions: i32[T] packed rows. attend(layer, q [T,HQ,HD], k [T,HKV,HD], v) -> [T,HQ,HD]. -> logits [T,VOCAB]
    x = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])
        q = rope((h @ p["wq"]).reshape(-1, HQ, HD), positions)
        k = rope((h @ p["wk"]).reshape(-1, HKV, HD), positions)
        v = (h @ p["wv"]).reshape(-1, HKV, HD)
        x = x + attend(i, q, k, v).reshape(-1, HQ * HD) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    return rms_norm(x, params["final_norm"]) @ params["lm_head"]


params = init_params(jax.random.PRNGKey(0))
n_params = sum(a.size for a in jax.tree_util.tree_leaves(params))
print(f"{N_LAYERS} layers, d_model {D_MODEL}, {HQ} query heads / {HKV} KV heads x {HD}, SwiGLU {D_FF}, "
      f"vocab {VOCAB}: {n_params / 1e6:.2f} M parameters")

rng = np.random.default_rng(0)
prompt_lens = np.array([5, 12, 7])
prompts = [rng.integers(1, VOCAB, n).astype(np.int32) for n in prompt_lens]
NEW_TOKENS = 6
for i, p in enumerate(prompts):
    print(f"prompt {i} ({len(p):2d} tokens): {p.tolist()}")""",
"""md:## 2. Dense version: full causal softmax, recomputed every step

No cache, no packing: one request at a time, the whole sequence through the model for every new token
(zero-padded to a fixed length so that the jitted forward compiles once).""",
"""def dense_causal_attention(q, k, v):              # one request: q [S, HQ, HD], k, v [S, HKV, HD]
    k, v = jnp.repeat(k, HQ // HKV, axis=1), jnp.repeat(v, HQ // HKV, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) * HD ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool)), s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)


DENSE_LEN = 32                                     # every sequence zero-padded to one length: one compile.
# The causal mask keeps the padding tail out of the real rows, so row len-1 is the full-sequence answer.


@jax.jit
def dense_logits(params, tokens):                  # tokens i32[DENSE_LEN] -> logits of every row
    return forward(params, tokens, jnp.arange(DENSE_LEN, dtype=jnp.int32),
                   lambda i, q, k, v: dense_causal_attention(q, k, v))


def dense_generate(prompt, n_new):
    seq, step_logits = list(prompt), []
    for _ in range(n_new):
        logits = dense_logits(params, jnp.asarray(seq + [0] * (DENSE_LEN - len(seq)), jnp.int32))[len(seq) - 1]
        step_logits.append(logits)
        seq.append(int(jnp.argmax(logits)))
    return seq[len(prompt):], jnp.stack(step_logits)


dense = [dense_generate(p, NEW_TOKENS) for p in prompts]
dense_tokens = [t for t, _ in dense]
for i, t in enumerate(dense_tokens):
    print(f"dense, request {i}: {t}")""",
"""md:## 3. Engine: pages for each request, one paged cache per layer

Each request gets the pages of its whole life (prompt + new tokens) once, from a shuffled pool; every step
reuses these tables through `build_metadata(..., block_tables=tables)`, which computes the step's `seq_lens`
and the `slot_mapping` of its new tokens. `context_lens` is what is already cached *before* the step.
Each layer has its own `(k_cache, v_cache)` of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.""",
"""BS = 8                                             # tokens per page
final_lens = prompt_lens + NEW_TOKENS
NUM_BLOCKS = int((-(-final_lens // BS)).sum()) + 2  # 2 spare pages
plan = pallas_attn.build_metadata(final_lens, np.zeros_like(final_lens), BS, num_blocks=NUM_BLOCKS, seed=3)
tables = plan.block_tables
for i, n in enumerate(final_lens):
    print(f"request {i}: up to {n} tokens -> pages {tables[i, : -(-n // BS)].tolist()}")
caches = [pallas_attn.allocate_kv_cache(NUM_BLOCKS, BS, HKV, HD, jnp.float32) for _ in range(N_LAYERS)]
print(f"{N_LAYERS} caches (k, v), each {caches[0][0].shape} {caches[0][0].dtype}")""",
"""md:## 4. Packed prefill with `varlen_attention`

The three prompts are one packed tensor of `md.num_tokens` rows (bucketed; rows past the last prompt are
padding, with slot -1 so the cache write skips them). Positions restart at 0 for each request, so RoPE and the
causal mask are request-local. Each layer writes its K/V into its cache, and attends with `varlen_attention`
over `cu_seqlens = md.cu_query_lens`. The logits at each prompt's last row give the first new token.""",
"""@functools.partial(jax.jit, static_argnames="max_seqlen")
def prefill(params, caches, tokens, positions, cu_seqlens, slot_mapping, *, max_seqlen):
    new_caches = []

    def attend(i, q, k, v):
        new_caches.append(pallas_attn.write_kv_cache(*caches[i], k, v, slot_mapping))
        return pallas_attn.varlen_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen)

    return forward(params, tokens, positions, attend), new_caches


md = pallas_attn.build_metadata(prompt_lens, np.zeros_like(prompt_lens), BS, num_blocks=NUM_BLOCKS,
                                block_tables=tables)
n = int(md.cu_query_lens[-1])
tokens = np.zeros(md.num_tokens, np.int32)
tokens[:n] = np.concatenate(prompts)
positions = np.zeros(md.num_tokens, np.int32)
positions[:n] = np.concatenate([np.arange(L) for L in prompt_lens])
print(f"packed prefill: {n} real rows padded to {md.num_tokens}, cu_seqlens {md.cu_query_lens.tolist()}, "
      f"max_seqlen {md.max_query_len}")
t0 = time.perf_counter()
logits, caches = prefill(params, caches, tokens, positions, md.cu_query_lens, md.slot_mapping,
                         max_seqlen=md.max_query_len)
last_rows = md.cu_query_lens[1:] - 1
engine_logits = [[logits[last_rows[i]]] for i in range(len(prompts))]
next_tokens = np.asarray(jnp.argmax(logits[last_rows], axis=-1), np.int32)
print(f"prefill (compile + run): {time.perf_counter() - t0:.1f} s; first new tokens {next_tokens.tolist()}")
# the cache holds each prompt's keys at its pages: read request 1's back through its block table
from pallas_attn.core.cache import gather_kv
k1 = gather_kv(caches[0][0], tables[1], int(prompt_lens[1]))
print("layer 0, request 1: keys read back through the block table", k1.shape)""",
"""md:## 5. Decode loop with `paged_decode_attention`, compiled once

Each step: one new token per request, its K/V written to every layer's cache at `slot_mapping`, then
`paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)` — `seq_lens` counts every key a query sees,
the new token included, i.e. `md.seq_lens`. Shapes are static and bucketed: the batch is padded from 3 to
`num_seqs = 4` requests (the padding request has `seq_len 0`, slot -1, output 0) and the block tables keep the
bucketed width of the plan, so all steps share one compiled program — the trace counter stays at 1.""",
"""TRACES = 0
NUM_SEQS = 4                                       # bucket of the batch size (3 real requests)


@jax.jit
def decode_step(params, caches, tokens, positions, block_tables, seq_lens, slot_mapping):
    global TRACES
    TRACES += 1                                    # runs only while tracing
    new_caches = []

    def attend(i, q, k, v):
        k_cache, v_cache = pallas_attn.write_kv_cache(*caches[i], k, v, slot_mapping)
        new_caches.append((k_cache, v_cache))
        return pallas_attn.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)

    return forward(params, tokens, positions, attend), new_caches


nreq = len(prompts)
engine_tokens = [[int(t)] for t in next_tokens]
cached = prompt_lens.copy()                        # tokens in the cache before this step
for step in range(1, NEW_TOKENS):
    md = pallas_attn.build_metadata(np.ones(nreq, np.int64), cached, BS, num_blocks=NUM_BLOCKS,
                                    block_tables=tables, num_seqs=NUM_SEQS, num_tokens=NUM_SEQS)
    tok = np.zeros(NUM_SEQS, np.int32)
    tok[:nreq] = next_tokens
    pos = np.zeros(NUM_SEQS, np.int32)
    pos[:nreq] = cached                            # the new token's position = tokens before it
    t0 = time.perf_counter()
    logits, caches = decode_step(params, caches, tok, pos, md.block_tables, md.seq_lens, md.slot_mapping)
    next_tokens = np.asarray(jnp.argmax(logits[:nreq], axis=-1), np.int32)
    dt = time.perf_counter() - t0
    for i in range(nreq):
        engine_tokens[i].append(int(next_tokens[i]))
        engine_logits[i].append(logits[i])
    print(f"step {step}: seq_lens {md.seq_lens.tolist()} slots {md.slot_mapping.tolist()} "
          f"block_tables {md.block_tables.shape} -> tokens {next_tokens.tolist()}  ({dt * 1e3:.0f} ms, traces {TRACES})")
    cached = cached + 1
print("decode_step traced", TRACES, "time(s)")
assert TRACES == 1""",
"""md:## 6. Same tokens""",
"""for i in range(nreq):
    print(f"request {i}: engine {engine_tokens[i]}")
    print(f"           dense  {dense_tokens[i]}")
max_diff = max(float(jnp.abs(jnp.stack(engine_logits[i]) - dense[i][1]).max()) for i in range(nreq))
print(f"max |logit difference| over all steps: {max_diff:.1e}")
assert engine_tokens == dense_tokens, (engine_tokens, dense_tokens)
assert max_diff < 1e-3
print("OK: packed prefill + paged decode generate exactly the dense model's tokens")""",
]

NB4 = [
"""md:# 04 — The thread layer: one prefill tile, from the grid down to one thread's registers

Block sizes, warps and stages are tuning knobs; which thread holds which element of a tile is the compiler's
choice, fixed by the matrix instruction it picks and that instruction's accumulator layout in the PTX ISA
([docs/threads.md](../docs/threads.md)). This notebook follows one score tile of the standard workload P1 from the
grid to the registers of one thread, with `pallas_attn.inspection` — the library behind `pallas-attn inspect`.

Everything runs on a CPU and builds no arrays, only shapes. On an H200, P1 runs the Mosaic GPU kernel; its compiled
code exists only on a GPU, so its layout here is the one its source declares (`plgpu.Layout.WGMMA`, evaluated from
JAX's own layout object). Section 6 compiles the Triton kernel for sm_90 when the `triton` wheel is installed.""",
SETUP,
"""from pallas_attn.inspection import compiled, draw, fragments, targets
from pallas_attn.kernels.mosaic import prefill as mosaic_prefill

call = targets.build_call("prefill", "P1")   # P1's shapes as jax.ShapeDtypeStruct: nothing is allocated
host = targets.workloads_module().build_host(call.spec)
print(call.describe())
print("backend an H200 picks for it:", call.backend, "(pallas_attn.ops.varlen.default_backend)")""",
"""md:## 1. The grid: programs of three (query tile, head) items

The Mosaic GPU prefill's grid is `(num_kv_heads, work slots)`. Per request and KV head, the *items* are its 64-row
query tiles times the `group` query heads sharing the KV head; a program takes three consecutive items, one per
compute warpgroup, so every K/V tile it loads serves three query tiles. The work list is built from `cu_seqlens`,
heaviest programs first. Below: the first program of KV head 0, from the kernel's own work list.""",
"""q, k = call.args[0], call.args[1]
num_tokens, num_q_heads, head_dim = q.shape
group = num_q_heads // k.shape[1]
wgs = mosaic_prefill.compute_wgs(mosaic_prefill.tile_head_dim(head_dim))
max_seqlen = int(host.seq_lens.max())
slots = mosaic_prefill.num_work_slots(num_tokens, host.num_seqs, max_seqlen, group, wgs)
req, first, _, _, tiles = mosaic_prefill._work_list(jnp.asarray(host.cu_query_lens), slots, True, max_seqlen,
                                                    group, wgs)
print(f"grid = (num_kv_heads={k.shape[1]}, work slots={slots}); {wgs} items a program, group {group}")
b, item0 = int(req[0]), int(first[0])
start = int(host.cu_query_lens[b])
print(f"program (kv_head 0, slot 0): request {b} ({int(host.seq_lens[b])} tokens, {int(tiles[b])} query tiles)")
ITEMS = []
for wg in range(wgs):
    item = item0 + wg
    m, head = item // group, item % group
    rows = (start // 8 * 8 + 64 * m, start // 8 * 8 + 64 * m + 63)
    ITEMS.append((m, head, rows))
    print(f"  compute warpgroup {wg}: item {item} = query tile {m} of query head {head}, packed rows {rows[0]}..{rows[1]}")""",
"""md:## 2. Inside the program: four warpgroups, 512 threads

Three compute warpgroups (one item each: `S = Q Kᵀ`, the online softmax and `O += P V` in registers) and one memory
warpgroup streaming K/V tiles with TMA. What the kernel's source fixes:""",
"""declared = targets.mosaic_declared(call)
print("threads", declared.threads, "| shared memory (the kernel's buffers)", f"{declared.shared:,} B")
for key, value in declared.facts.items():
    print(f"{key}: {value}")
S, O = declared.maps
count, bound = compiled.programs_per_sm(None, declared.threads, declared.shared)
print(f"programs per SM: {count} (bound by {bound}; registers are set per warpgroup with setmaxnreg)")""",
"""md:## 3. One warpgroup's score tile: S [64, 128] in the WGMMA layout

`wgmma.m64nNk16` writes its `[64, N]` float32 result across the 128 threads of a warpgroup: warp `w` gets rows
`16w .. 16w + 15`, and inside them every lane holds two adjacent columns of two rows, eight columns apart in
register order (`d0, d1` / `d2, d3` on the row 8 below, then the next 8 columns). The picture colours each element
by its warp and marks thread 37's. Warpgroups 1 and 2 hold their own items' tiles in the same layout.""",
"""THREAD = 37
fig = draw([S, O], thread=THREAD, title="Mosaic GPU prefill, one compute warpgroup: who holds S and O")
plt.show()
# zoom: warp 1's rows 16..31, columns 0..15 of S, each element labelled with the lane holding it
lanes = S.owner()[16:32, :16] % 32
fig, ax = plt.subplots(figsize=(7, 7))
ax.imshow(lanes // 4, cmap="tab10", vmin=0, vmax=9)        # colour: groupID (the row pair a lane holds)
for (r, c), lane in np.ndenumerate(lanes):
    mine = S.owner()[16 + r, c] == THREAD
    ax.text(c, r, str(lane), ha="center", va="center", fontsize=8, fontweight="bold" if mine else "normal",
            color="black" if mine else "white")
    if mine:
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
ax.set_xticks(range(16)); ax.set_yticks(range(16), [str(16 + r) for r in range(16)])
ax.set_xlabel("column of S"); ax.set_ylabel("row of S")
ax.set_title(f"warp 1 of the warpgroup: the lane of each element (bold: thread {THREAD}, lane {THREAD % 32})",
             fontsize=9)
plt.show()""",
"""md:## 4. Down to one thread: its elements and the registers they live in

Thread 37 is warp 1 of warpgroup 0, lane 5: `groupID = 5 >> 2 = 1`, `threadID_in_group = 5 % 4 = 1`. It holds rows
`16 + 1` and `16 + 1 + 8` of its item's tile, columns `2, 3` of every 8-column block, in `d0 .. d63`. The PTX ISA's
formula (`fragments.wgmma_m64nNk16_element`) gives the same list, register for register.""",
"""elements = S.elements_of(THREAD)
print(f"thread {THREAD}: {len(elements)} elements of S")
for e in elements[:12]:
    print(f"  {e.fragment:>4s} -> S[{e.row:2d}, {e.col:3d}]")
print("  ...")
assert all(fragments.wgmma_m64nNk16_element(THREAD, e.register, S.shape[1]) == (e.row, e.col) for e in elements)
m, head, rows = ITEMS[THREAD // 128]
print(f"in the batch: query head {head}, packed rows {rows[0] + 17} and {rows[0] + 25}; at K/V step j its columns "
      "are keys 128 j + col of the request")""",
"""md:## 5. Why the layout matters: a row lives in four lanes

The online softmax needs each row's max and sum. A row of `S` is spread over the four lanes of one `groupID`, two
columns a register pair, so the reduction is a thread's own registers, then two butterfly shuffles (`SHFL.BFLY` by
1 and 2) — never shared memory. Mosaic GPU relies on it (`reduction_scratch_bytes=0` in the kernel).""",
"""row = 17
holders = sorted({int(t) for t in S.owner()[row]})
print(f"row {row} of S is held by threads {holders} (warp {holders[0] // 32}, lanes {[t % 32 for t in holders]})")
assert len(holders) == 4 and holders == list(range(holders[0], holders[0] + 4))""",
"""md:## 6. The same tile in the Triton kernel, compiled for sm_90 here

With the `triton` wheel (3.6.0, the GPU machine's release) the Triton prefill compiles on this machine exactly as on
the device: its TTGIR says which MMA Triton chose (`#ttg.nvidia_mma`), its PTX and SASS give registers, spills and
the instruction mix of the K/V loops. Without the wheel this section says so and shows nothing compiled.""",
"""if compiled.triton_version() is None:
    print("the triton wheel is not installed here: no compiled facts. With pip install triton==3.6.0:\\n"
          "  pallas-attn inspect prefill --workload P1 --backend triton --thread 37 --plot s_tile.png")
else:
    from pallas_attn.inspection import inspect_kernel, render
    report = inspect_kernel("prefill", "P1", backend="triton", thread=THREAD)
    text = render(report)
    print(text[:text.index("== fragment maps")])
    print(report.maps[0].source)
    draw(report.maps, thread=THREAD, title="Triton prefill (compiled for sm_90 here)")
    plt.show()""",
]

if __name__ == "__main__":
    for name, cells in (("01_packed_requests.ipynb", NB1), ("02_paged_kv.ipynb", NB2),
                        ("03_use_in_a_model.ipynb", NB3), ("04_threads.ipynb", NB4)):
        nbformat.write(nb(cells), HERE / name)
        print("wrote", HERE / name)
