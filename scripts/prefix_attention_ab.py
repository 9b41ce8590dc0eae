"""A/B of Hydra++'s prefix-attention layer (Ankner et al. 2024, "Hydra", Sec. 5) in front of the
shipped hydra heads' recipe, on the same chats, batches and steps (issue 30, item 4).

Hydra++ adds one decoder layer (self-attention over the context plus an MLP, the backbone's own
layer shape) over the backbone's final hidden states; the heads read its output at position t in
place of h_t. It needs the states of the whole context, so this script trains on packed sequences
(rows of `--seq-len` tokens, attention kept within each chat), not on the trainer's shuffled
positions; both arms train on the same rows in the same order, so only the layer differs:

  base:   heads(h_t, path)                             (the shipped recipe's heads)
  prefix: heads(h_t + Layer(h_{<=t})_t, path)          (the layer's two residual outputs start at
                                                        zero, so step 0 is the base arm)

    python scripts/prefix_attention_ab.py hidden --data runs/prefix_ab/data --out runs/prefix_ab
    python scripts/prefix_attention_ab.py train --out runs/prefix_ab --arm base --steps 2400
    python scripts/prefix_attention_ab.py train --out runs/prefix_ab --arm prefix --steps 2400

`hidden` runs the backbone once over the chats (the trainer's split, by a hash of each id) and
keeps each chat's final hidden states [T, D] float32; `train` prints validation top-1 per head
(all held-out positions, the 8,192-token proposal vocabulary as shipped) every `--eval-every` steps
and writes ``<out>/<arm>.json``. Decoding with the layer (its own KV cache) is not built: this
measures whether it would pay.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import teacher_forced_states, token_embeddings
from medusa_jax.heads.medusa import init_heads
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.train import data as D
from medusa_jax.train.config import TrainConfig
from medusa_jax.train.examples import load_examples, proposal_vocabulary
from medusa_jax.train.hidden import build_backbone, hidden_fn, length_batches, padded_sequences
from medusa_jax.train.losses import topk_from_ranks
from medusa_jax.train.optim import clip_grads, make_optimizer
from medusa_jax.train.steps import heads_loss, sequence_batch

CONFIG = "configs/smollm2_hydra.yaml"


def train_config(args) -> TrainConfig:
    return TrainConfig.from_yaml(CONFIG, overrides=(f"data={args.data}", f"steps={args.steps}",
                                                    f"out_dir={args.out}"))


def hidden_phase(args) -> None:
    tc = train_config(args)
    bb = build_backbone(tc)
    fn = hidden_fn(bb.cfg)
    for split, exs in zip(("train", "val"), load_examples(tc, bb.cfg.vocab_size)):
        hs = [None] * len(exs)
        bar = tqdm(total=sum(len(i) for i, _ in exs), desc=f"hidden states ({split})", unit="tok")
        for T, rows, group in length_batches(exs, tc.max_seq_len, tc.hidden_batch_tokens):
            tokens, _ = padded_sequences([exs[j] for j in group], rows, tc.max_seq_len)
            h = np.asarray(fn(bb.params, jnp.asarray(tokens)), np.float32)
            for r, j in enumerate(group):
                hs[j] = h[r, :len(exs[j][0])]
            bar.update(sum(len(exs[j][0]) for j in group))
        bar.close()
        lens = np.array([len(i) for i, _ in exs], np.int64)
        np.savez(os.path.join(args.out, f"seq_{split}.npz"), hidden=np.concatenate(hs),
                 ids=np.concatenate([i for i, _ in exs]), mask=np.concatenate([m for _, m in exs]), lens=lens)
        print(f"{split}: {len(exs)} chats, {lens.sum():,} tokens", flush=True)


# ------------------------------------------------------------------------------------------------
# the prefix layer: a Llama decoder layer (RMSNorm, GQA self-attention with RoPE, RMSNorm, SwiGLU)


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [B, T, H, d], pos [B, T] -> rotated (the half-split layout of HF Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    ang = pos[..., None].astype(jnp.float32) * inv                      # [B, T, d/2]
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def init_prefix(cfg, key) -> dict:
    D_, H, Hk, d, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    ks = jax.random.split(key, 4)
    n = lambda k, s: 0.02 * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    return {"ln1": jnp.ones(D_), "ln2": jnp.ones(D_), "wq": n(ks[0], (D_, H * d)), "wk": n(ks[1], (D_, Hk * d)),
            "wv": n(ks[2], (D_, Hk * d)), "wo": jnp.zeros((H * d, D_)), "wg": n(ks[3], (D_, F)),
            "wu": n(jax.random.fold_in(ks[3], 1), (D_, F)), "wd": jnp.zeros((F, D_))}


def prefix_layer(cfg, p, h, seg, pos):
    """h [B, T, D] final hidden states, seg/pos [B, T] from `data.pack` -> [B, T, D]: h plus the
    layer's attention and MLP outputs (causal within each segment)."""
    B, T, _ = h.shape
    H, Hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = rms(h, p["ln1"], cfg.rms_norm_eps)
    q = rope((x @ p["wq"]).reshape(B, T, H, d), pos, cfg.rope_theta)
    k = rope((x @ p["wk"]).reshape(B, T, Hk, d), pos, cfg.rope_theta)
    v = (x @ p["wv"]).reshape(B, T, Hk, d)
    q = q.reshape(B, T, Hk, H // Hk, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(d)
    ok = (seg[:, :, None] == seg[:, None, :]) & (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])
    s = jnp.where(ok[:, None, None], s, -1e30)
    o = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, -1), v).reshape(B, T, H * d)
    h = h + o @ p["wo"]
    y = rms(h, p["ln2"], cfg.rms_norm_eps)
    return h + (jax.nn.silu(y @ p["wg"]) * (y @ p["wu"])) @ p["wd"]


# ------------------------------------------------------------------------------------------------


def packed(split_file, seq_len):
    with np.load(split_file) as f:
        z = {k: f[k] for k in f.files}  # each access to an npz member reads it again
    offs = np.concatenate([[0], np.cumsum(z["lens"])])
    exs = [(z["ids"][a:b], z["mask"][a:b]) for a, b in zip(offs[:-1], offs[1:])]
    tokens, mask, seg, pos = D.pack(exs, seq_len)
    # the hidden rows laid out as `pack` lays out the tokens: pack each token's index in the file
    where = D.pack([(np.arange(a, b), m) for (a, b), (_, m) in zip(zip(offs[:-1], offs[1:]), exs)], seq_len,
                   pad_id=-1)[0]
    hid = np.where((where >= 0)[..., None], z["hidden"][np.maximum(where, 0)], 0.0).astype(np.float32)
    return tokens, mask, seg, pos, hid


def train_phase(args) -> None:
    tc = train_config(args)
    bb = build_backbone(tc)
    mcfg, K = bb.cfg, tc.num_heads
    hcfg = MedusaConfig(hidden_size=mcfg.hidden_size, vocab_size=mcfg.vocab_size, num_heads=K,
                        num_layers=tc.num_layers, shared_lm_head=True, topk=tc.topk, head_type="hydra")
    lm0 = jnp.asarray(lm_head_matrix(mcfg, bb.params))
    emb = jnp.asarray(token_embeddings(bb.params))
    train_ex, _ = load_examples(tc, mcfg.vocab_size)
    proposal_ids, remap = proposal_vocabulary(tc, train_ex, mcfg.vocab_size)
    lm = lm0[:, proposal_ids]
    data = {s: packed(os.path.join(args.out, f"seq_{s}.npz"), args.seq_len) for s in ("train", "val")}

    def labels(tokens, mask, seg):
        lab, ok = D.head_targets(tokens, mask, K, seg)
        lab = remap[lab]
        return np.maximum(lab, 0).astype(np.int32), ok & (lab >= 0), (ok & (lab < 0)).sum(axis=(1, 2))

    params = {"heads": {k: v for k, v in init_heads(hcfg, lm0).items() if k != "proposal_ids"}}
    if args.arm == "prefix":
        params["prefix"] = init_prefix(mcfg, jax.random.PRNGKey(1))
    opt = make_optimizer(tc, tc.learning_rate, args.steps)
    opt_state = opt.init(params)

    def loss_fn(p, hid, tokens, seg, pos, lab, ok):
        h = prefix_layer(mcfg, p["prefix"], hid, seg, pos) if "prefix" in p else hid
        batch = sequence_batch(h, tokens, lab, ok, K, soft=False)
        return heads_loss(hcfg, tc, p["heads"], lm, emb, batch)

    @jax.jit
    def step(p, s, hid, tokens, seg, pos, lab, ok):
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, hid, tokens, seg, pos, lab, ok)
        g, _ = clip_grads(g, tc.grad_clip)
        upd, s = opt.update(g, s, p)
        return jax.tree_util.tree_map(lambda a, b: a + b, p, upd), s, loss

    evaluate_fn = jax.jit(lambda p, *a: loss_fn(p, *a)[1])

    @jax.jit
    def top1_hits(p, hid, tokens, seg, pos, lab, ok):
        """[K, B*T] bool: head k's top-1 (in the proposal vocabulary) is the label, teacher-forced."""
        h = prefix_layer(mcfg, p["prefix"], hid, seg, pos) if "prefix" in p else hid
        batch = sequence_batch(h, tokens, lab, ok, K, soft=False)
        path = jnp.take(emb, jnp.transpose(batch["path_tokens"]), axis=0)
        states = teacher_forced_states(hcfg, p["heads"], batch["hidden"], path)
        return (jnp.argmax(states @ lm, -1) == batch["labels"]) & batch["valid"]

    def evaluate(p):
        tokens, mask, seg, pos, hid = data["val"]
        tot_c, tot_r, miss, chain = 0, 0, 0, []
        for i in range(0, len(tokens), args.rows):
            sl = slice(i, i + args.rows)
            lab, ok, m = labels(tokens[sl], mask[sl], seg[sl])
            pad = args.rows - len(lab[0])
            padded = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a  # noqa
            padk = lambda a: np.concatenate([a, np.zeros((a.shape[0], pad) + a.shape[2:], a.dtype)], 1) if pad else a  # noqa
            _, c, r = evaluate_fn(p, padded(hid[sl]), padded(tokens[sl]), padded(seg[sl]), padded(pos[sl]),
                                  padk(lab), padk(ok))
            tot_c, tot_r, miss = tot_c + np.asarray(c, np.float64), tot_r + np.asarray(r, np.float64), miss + m
            hit = np.asarray(top1_hits(p, padded(hid[sl]), padded(tokens[sl]), padded(seg[sl]), padded(pos[sl]),
                                       padk(lab), padk(ok)))
            # a root whose K labels all lie in the answer (ok, before the proposal-vocabulary cut)
            full = D.head_targets(tokens[sl], mask[sl], K, seg[sl])[1].all(0).reshape(-1)
            full = np.concatenate([full, np.zeros(hit.shape[1] - len(full), bool)])
            chain.append(np.cumprod(hit[:, full], axis=0).sum(0))
        chain = np.concatenate(chain)
        return topk_from_ranks(tot_r, tot_c + miss), {
            f"chain{n}": round(float(1 + np.minimum(chain, n).mean()), 4) for n in range(1, K + 1)}

    tokens, mask, seg, pos, hid = data["train"]
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(len(tokens)) for _ in range(args.steps * args.rows // len(tokens) + 1)])
    log = {"arm": args.arm, "steps": args.steps, "rows": args.rows, "seq_len": args.seq_len, "evals": []}
    t0 = time.time()
    for i in tqdm(range(args.steps), desc=args.arm):
        sl = order[i * args.rows:(i + 1) * args.rows]
        lab, ok, _ = labels(tokens[sl], mask[sl], seg[sl])
        params, opt_state, loss = step(params, opt_state, hid[sl], tokens[sl], seg[sl], pos[sl], lab, ok)
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            acc, chains = evaluate(params)
            rec = {"step": i + 1, "loss": float(loss), "top1": acc[0].round(4).tolist(),
                   "top5": acc[1].round(4).tolist(), **chains, "seconds": round(time.time() - t0, 1)}
            log["evals"].append(rec)
            print(json.dumps(rec), flush=True)
    with open(os.path.join(args.out, f"{args.arm}.json"), "w") as f:
        json.dump(log, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("hidden", "train"), help="hidden: run the backbone once; train: one arm")
    ap.add_argument("--data", default="runs/prefix_ab/data", help="distilled chats (samples.jsonl)")
    ap.add_argument("--out", default="runs/prefix_ab", help="where the hidden states and results go")
    ap.add_argument("--arm", choices=("base", "prefix"), default="base", help="heads alone, or the prefix layer too")
    ap.add_argument("--steps", type=int, default=2400, help="optimizer steps")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per step")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed row")
    ap.add_argument("--eval-every", type=int, default=600, help="steps between validation evaluations")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    (hidden_phase if args.phase == "hidden" else train_phase)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
