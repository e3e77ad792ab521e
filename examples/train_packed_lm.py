"""Train a small language model on packed documents with varlen_attention, beside the same model with dense masked
attention: the two loss curves, step by step.

Documents of random lengths are packed end to end into rows of ``--tokens`` tokens (``cu_seqlens`` marks where each
starts); each is an arithmetic sequence modulo the vocabulary, so predicting the next token needs the document's
own earlier tokens and nothing of its neighbours'. The model: token and request-local position embeddings, pre-norm
blocks of grouped-query attention (``Hq`` 4, ``Hkv`` 2, head dim 16) and an MLP, Adam (optax). Two copies start from
the same weights and see the same batches; one attends with :func:`pallas_attn.varlen_attention` (forward and
backward kernels), the other with :func:`pallas_attn.reference.varlen_attention_dense` (a masked ``[T, T]``
attention over the packed row, differentiated by JAX). Prints both losses and their relative difference.

    python examples/train_packed_lm.py                    # GPU: compiled; CPU: interpreted (a few minutes)
    python examples/train_packed_lm.py --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a source checkout works uninstalled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from pallas_attn import PrefillConfig, reference, varlen_attention  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    max_len: int = 32  # the longest document (and max_seqlen)


def init_params(cfg: ModelConfig, key) -> dict:
    keys = iter(jax.random.split(key, 4 + 6 * cfg.layers))
    normal = lambda shape, fan_in: jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)  # noqa: E731
    d, hd = cfg.d_model, cfg.head_dim
    blocks = [dict(wq=normal((d, cfg.q_heads * hd), d), wk=normal((d, cfg.kv_heads * hd), d),
                   wv=normal((d, cfg.kv_heads * hd), d), wo=normal((cfg.q_heads * hd, d), cfg.q_heads * hd),
                   w1=normal((d, 4 * d), d), w2=normal((4 * d, d), 4 * d)) for _ in range(cfg.layers)]
    return dict(embed=normal((cfg.vocab, d), 1.0), pos=normal((cfg.max_len, d), 1.0), blocks=blocks,
                unembed=normal((d, cfg.vocab), d))


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def forward(params, tokens, positions, cu_seqlens, *, cfg: ModelConfig, attention) -> jax.Array:
    """``[T, vocab]`` logits of one packed row: ``tokens i32[T]``, ``positions i32[T]`` request-local."""
    x = params["embed"][tokens] + params["pos"][positions]
    t = tokens.shape[0]
    for blk in params["blocks"]:
        h = rms_norm(x)
        q = (h @ blk["wq"]).reshape(t, cfg.q_heads, cfg.head_dim)
        k = (h @ blk["wk"]).reshape(t, cfg.kv_heads, cfg.head_dim)
        v = (h @ blk["wv"]).reshape(t, cfg.kv_heads, cfg.head_dim)
        x = x + attention(q, k, v, cu_seqlens, max_seqlen=cfg.max_len).reshape(t, -1) @ blk["wo"]
        x = x + jax.nn.gelu(rms_norm(x) @ blk["w1"]) @ blk["w2"]
    return rms_norm(x) @ params["unembed"]


def loss_fn(params, batch, *, cfg: ModelConfig, attention):
    """Mean next-token cross-entropy over the targets inside each document (``batch["mask"]``), averaged over rows."""
    def row_loss(tokens, positions, cu, targets, mask):
        logits = forward(params, tokens, positions, cu, cfg=cfg, attention=attention)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return jnp.mean(jax.vmap(row_loss)(batch["tokens"], batch["positions"], batch["cu_seqlens"], batch["targets"],
                                       batch["mask"]))


def make_batch(rng: np.random.Generator, cfg: ModelConfig, rows: int, tokens: int, max_docs: int) -> dict:
    """``rows`` packed rows of ``tokens`` tokens: documents of 4..max_len tokens end to end, the row's tail padding.
    Targets are each document's next token; the last token of a document (and padding) predicts nothing."""
    out = {k: np.zeros((rows, tokens), np.int32) for k in ("tokens", "positions", "targets")}
    out["mask"] = np.zeros((rows, tokens), np.float32)
    out["cu_seqlens"] = np.zeros((rows, max_docs + 1), np.int32)
    for r in range(rows):
        start, docs = 0, []
        while len(docs) < max_docs:
            n = int(rng.integers(4, cfg.max_len + 1))
            if start + n > tokens:
                break
            a, b = rng.integers(0, cfg.vocab, 2)
            seq = (a + b * np.arange(n + 1)) % cfg.vocab
            out["tokens"][r, start:start + n] = seq[:-1]
            out["targets"][r, start:start + n] = seq[1:]
            out["positions"][r, start:start + n] = np.arange(n)
            out["mask"][r, start:start + n - 1] = 1.0  # predicting past the document's end is not its business
            docs.append(n)
            start += n
        cu = np.concatenate([[0], np.cumsum(docs)])
        out["cu_seqlens"][r] = np.pad(cu, (0, max_docs + 1 - cu.size), mode="edge")  # empty trailing requests
    return {k: jnp.asarray(v) for k, v in out.items()}


def kernel_attention(interpret: bool | None):
    tiles = PrefillConfig(block_m=16, block_n=16)  # the documents are short: 16-row tiles waste less
    return functools.partial(varlen_attention, config=tiles, backward_config=tiles, interpret=interpret)


def train(steps: int, *, seed: int = 0, rows: int = 4, tokens: int = 96, interpret: bool | None = None,
          log=print) -> dict:
    """Both models, ``steps`` Adam steps on the same batches. Returns the two loss curves and their relative
    difference per step."""
    cfg = ModelConfig()
    max_docs = tokens // 4
    params = init_params(cfg, jax.random.key(seed))
    opt = optax.adam(3e-3)
    attentions = {"pallas_attn": kernel_attention(interpret), "dense": reference.varlen_attention_dense}

    def make_step(attention):
        @jax.jit
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(functools.partial(loss_fn, cfg=cfg, attention=attention))(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    state = {name: (params, opt.init(params), make_step(attention)) for name, attention in attentions.items()}
    rng = np.random.default_rng(seed)
    curves = {name: [] for name in attentions}
    for i in range(steps):
        batch = make_batch(rng, cfg, rows, tokens, max_docs)
        for name, (p, o, step) in state.items():
            p, o, loss = step(p, o, batch)
            state[name] = (p, o, step)
            curves[name].append(float(loss))
        ours, dense = curves["pallas_attn"][-1], curves["dense"][-1]
        if i % max(1, steps // 20) == 0 or i == steps - 1:
            log(f"step {i:4d}  loss {ours:.5f} (pallas_attn)  {dense:.5f} (dense)  "
                f"rel diff {abs(ours - dense) / dense:.2e}")
    rel = [abs(a - b) / abs(b) for a, b in zip(curves["pallas_attn"], curves["dense"])]
    return dict(steps=steps, seed=seed, rows=rows, tokens=tokens, loss=curves, relative_difference=rel,
                max_relative_difference=max(rel), device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, help="write the curves here")
    args = parser.parse_args()
    result = train(args.steps, seed=args.seed)
    print(f"largest relative difference of the losses over {args.steps} steps: "
          f"{result['max_relative_difference']:.2e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
