"""Train Medusa heads: frozen backbone (Medusa-1) or jointly with the backbone (Medusa-2).

Cai et al. 2024, "Medusa", Sec. 2.2. Head k (0-based) reads the backbone's last hidden state at t
and is trained with cross-entropy on token t+k+2, weighted ``loss_decay**k`` (Sec. 2.2.1).

* ``frozen`` (Medusa-1): the backbone's hidden states are computed once (batched by length, jitted,
  ``compute_logits=False``) and reused across epochs; training runs on a flat dataset of positions
  (hidden [D] at t, labels of every head) shuffled across sequences, keeping only positions where
  at least one head has a valid label. Only the heads get gradients and optimizer state. With a
  shared lm_head the loss is `losses.shared_head_loss` (no lm_head gradient, fused backward).
* ``joint`` (Medusa-2, Sec. 2.2.2): backbone and heads; loss = ``lambda_base * L_base +
  sum_k decay^k L_k`` with L_base the next-token cross-entropy, or the KL divergence from the frozen
  original model (``base_loss: kl``, for self-distilled data, Sec. 2.3.2). The heads have their own
  learning-rate multiplier, and the first ``heads_warmup_steps`` steps train the heads only (the
  backbone's optimizer and schedule start after them).

Two options apply to both modes:

* ``head_type: hydra`` (Ankner et al. 2024, Sec. 3; `medusa_jax.hydra`): head k also reads the
  embeddings of tokens t+1..t+k+1, trained with teacher forcing on the data's true tokens (what
  decoding sees on the path it accepts).
* ``loss_targets: soft``: head k at t learns the backbone's own distribution over token t+k+2,
  ``softmax(h_{t+k+1} @ lm_head / soft_temperature)``, with a KL divergence. In frozen mode the
  cached hidden state at t+k+1 gives it (`data.Positions.target_rows`): no extra backbone pass.

And two to frozen mode:

* ``proposal_vocab: N``: the heads' loss runs over the N most frequent training tokens only (the
  proposal vocabulary they then decode with, `proposal_vocabulary`): labels outside it leave the
  loss and count as validation misses; soft targets are the backbone's distribution renormalised
  over it. The vocabulary projection, most of a step, costs N/V as much.
* ``loop_weight`` < 1: positions inside verbatim repetition loops of the distilled answers
  (`loop_flags`) are kept with that probability; validation also reports ``val_noloop_top1/5``.

Optax AdamW, linear warm-up + cosine decay, global-norm clipping. The data order of epoch e is a
permutation drawn from (seed, e) only (`checkpoint.batch_indices`), so a run resumed from an Orbax
checkpoint (`checkpoint.Checkpointer`) ends with the same params as an uninterrupted one.

Outputs in ``out_dir``: ``metrics.jsonl``, ``accuracy.png``, ``checkpoints/``, ``heads/`` (our
format, `medusa_jax.convert.medusa_format.save_heads`, with the final metrics), and in joint mode
``backbone/`` (an HF directory: config.json + model.safetensors, loadable by `load_model`).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import sharding
from ..config import MedusaConfig, ModelConfig, TrainConfig
from ..heads import MedusaHeads, init_heads
from ..hydra import from_medusa, teacher_forced_states, token_embeddings
from ..models.llama import LlamaModel, lm_head_matrix
from . import data as D
from .checkpoint import Checkpointer, MetricsLog, batch_indices, export
from .losses import (NUM_RANKS, heads_ce, heads_kl, kl_to_teacher_sums, masked_ce_sums, safe_mean,
                     shared_head_loss, topk_from_ranks, total_heads_loss)

Pair = Tuple[np.ndarray, np.ndarray]  # (ids [T] int32, loss_mask [T] bool)
#: Sequences are padded to a multiple of this many tokens (one compiled shape per bucket).
LENGTH_BUCKET = 128
#: Config fields that may change between a checkpoint and its resumption: they change neither the
#: trained params (up to float rounding: loss_chunk) nor the data order. ``steps`` may change too
#: (`check_resume`); any other difference refuses to resume.
_RESUME_FREE = ("out_dir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "cache_hidden",
                "hidden_dir", "hidden_batch_tokens", "tree", "tree_nodes", "save_backbone", "max_val_positions", "topk",
                "loss_chunk", "mesh")
#: Of those, the fields the export depends on: a finished run is exported again when one changes.
_EXPORT_FIELDS = ("tree", "tree_nodes", "topk", "save_backbone", "max_val_positions")
#: How to get past a run in out_dir that cannot be continued, for messages.
_START_OVER = ("to start over in that out_dir use --no-resume (train(resume=False)); to keep that run, "
               "train elsewhere with --set out_dir=DIR")


class ResumeConflictError(ValueError):
    """out_dir holds a checkpoint that this config cannot continue (other settings, or more steps
    done than asked for)."""


@dataclass
class Backbone:
    """cfg: `ModelConfig`; params: `LlamaModel` params (jnp); path: where it came from or "random";
    tokenizer: a transformers tokenizer or None."""
    cfg: ModelConfig
    params: Any
    path: str
    tokenizer: Any = None


@dataclass
class TrainResult:
    """What `train` returns. heads_params / backbone_params are numpy pytrees (backbone_params only
    in joint mode); metrics holds the last evaluation (val_loss, val_top1, val_top5 per head, ranks);
    steps_done < steps only when stopped early with ``stop_at_step``; heads_dir is None then.
    already_finished: out_dir held this run, finished with the same settings: nothing was trained
    or written, heads_params and metrics were read back from heads_dir (backbone_params is None)."""
    heads_cfg: MedusaConfig
    heads_params: dict
    backbone_params: Optional[dict]
    metrics: dict
    steps_done: int
    heads_dir: Optional[str]
    already_finished: bool = False


# ---------------------------------------------------------------------------------- backbone, data

def build_backbone(tc: TrainConfig) -> Backbone:
    """The backbone: a tiny random Llama (``model: random``) or `load_model(tc.model)` (None: SmolLM2)."""
    if tc.model == "random":
        cfg = ModelConfig(arch="llama", vocab_size=tc.random_vocab_size, hidden_size=tc.random_hidden_size,
                          intermediate_size=tc.random_intermediate_size, num_layers=tc.random_num_layers,
                          num_heads=tc.random_num_heads, num_kv_heads=tc.random_num_kv_heads, rms_norm_eps=1e-5,
                          max_position_embeddings=max(tc.max_seq_len, 256))
        k1, k2 = jax.random.split(jax.random.PRNGKey(tc.seed))
        tok = jnp.zeros((1, 4), jnp.int32)
        params = LlamaModel(cfg).init(k1, tok, jnp.arange(4, dtype=jnp.int32)[None])["params"]
        params = jax.tree_util.tree_map(lambda x: x, params)  # a mutable copy
        params["embed"]["embedding"] = tc.random_init_std * jax.random.normal(
            k2, (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        return Backbone(cfg, params, "random")
    from ..loading import load_model
    lm = load_model(tc.model, with_tokenizer=tc.mode == "joint")
    return Backbone(lm.cfg, lm.params, lm.path, lm.tokenizer)


def synthetic_examples(tc: TrainConfig, vocab_size: int) -> List[Pair]:
    """Sequences of a random permutation f of the vocabulary: x[t+1] = f(x[t]), x[0] random.

    Token t+k+2 is then f^(k+2)(token t), a deterministic function of token t. The first
    ``synthetic_prompt_len`` tokens are masked out (like a prompt). Returns `data.Example`s
    (ids int32 [T], loss_mask bool [T], id "synthetic-<i>").
    """
    rng = np.random.default_rng([tc.seed, 12345])
    f = rng.permutation(vocab_size)
    out = []
    for i in range(tc.synthetic_num_sequences):
        ids = np.empty(tc.synthetic_seq_len, np.int32)
        ids[0] = rng.integers(vocab_size)
        for t in range(1, len(ids)):
            ids[t] = f[ids[t - 1]]
        out.append(D.Example(ids, np.arange(len(ids)) >= tc.synthetic_prompt_len, id=f"synthetic-{i}"))
    return out


def load_examples(tc: TrainConfig, vocab_size: int) -> Tuple[List[Pair], List[Pair]]:
    """(train, val) examples, truncated to max_seq_len. Raises ValueError for out-of-vocabulary ids
    or an empty training split; FileNotFoundError for a missing data directory."""
    examples = synthetic_examples(tc, vocab_size) if tc.data == "synthetic" else D.load_distilled(tc.data)
    top = max((int(np.max(i)) for i, _ in examples if len(i)), default=-1)
    if top >= vocab_size:
        raise ValueError(f"{tc.data}: token id {top} is outside the backbone's vocabulary ({vocab_size}); "
                         "the data was made with another tokenizer")
    train, val = D.split_train_val(examples, tc.val_fraction, tc.seed)  # by example id: stable
    if not train:
        raise ValueError(f"{tc.data}: no training sequences (val_fraction={tc.val_fraction})")
    cut = lambda exs: [(np.asarray(i, np.int32)[:tc.max_seq_len], np.asarray(m, bool)[:tc.max_seq_len])
                       for i, m in exs]
    return cut(train), cut(val)


def _bucket_len(n: int, max_len: int) -> int:
    return int(min(max_len, max(LENGTH_BUCKET, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET)))


def _padded(examples: Sequence[Pair], rows: int, max_len: int):
    """pad_batch to a bucketed length, plus all-masked rows up to `rows`: tokens, mask [rows, T]."""
    T = _bucket_len(max(len(i) for i, _ in examples), max_len)
    tokens, mask, _ = D.pad_batch(list(examples), T)
    tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
    extra = rows - tokens.shape[0]
    if extra > 0:
        tokens = np.concatenate([tokens, np.zeros((extra, T), np.int32)])
        mask = np.concatenate([mask, np.zeros((extra, T), bool)])
    return tokens, mask


def _positions(tokens) -> jax.Array:
    B, T = tokens.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


@functools.lru_cache(maxsize=4)
def _hidden_fn(cfg: ModelConfig):
    @jax.jit
    def fn(params, tokens):
        return LlamaModel(cfg).apply({"params": params}, tokens, _positions(tokens), compute_logits=False)[1]
    return fn


def proposal_vocabulary(tc: TrainConfig, train_ex, vocab_size: int) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(proposal_ids [N] int32, remap [V] int64) for ``tc.proposal_vocab`` = N > 0: the N most
    frequent tokens of the training sequences (`heads.frequent_tokens`, as `medusa_jax.tune
    --proposal-vocab` picks them) and each token id's index among them (-1 outside); (None, None)
    for 0. Raises ValueError when N exceeds the vocabulary."""
    if not tc.proposal_vocab:
        return None, None
    if tc.proposal_vocab > vocab_size:
        raise ValueError(f"proposal_vocab={tc.proposal_vocab} exceeds the backbone's vocabulary ({vocab_size})")
    from ..heads import frequent_tokens

    ids = frequent_tokens((i for i, _ in train_ex), tc.proposal_vocab, vocab_size)
    remap = np.full(vocab_size, -1, np.int64)
    remap[ids] = np.arange(len(ids))
    return ids, remap


def _length_order(examples: Sequence[Pair]) -> List[int]:
    """The order `compute_positions` runs (and lays out) the sequences in: by length, then index."""
    return sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), i))


def position_sources(examples: Sequence[Pair], num_heads: int) -> np.ndarray:
    """Where each of `compute_positions`' flat positions comes from, without running the backbone:
    [P, 2] int64 rows (sequence index, position t), in its order (`_length_order`, then t)."""
    out = [np.stack([np.full(len(t), i), t], axis=1)
           for i in _length_order(examples) for t in [D.kept_positions(*examples[i], num_heads)]]
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 2), np.int64)


def loop_flags(examples: Sequence[Pair], num_heads: int, ngram: int) -> np.ndarray:
    """[P] bool over `compute_positions`' flat positions: True where the root token t+1 continues a
    verbatim repeat of `ngram` tokens (`data.repetition_mask`), i.e. inside a repetition loop."""
    src = position_sources(examples, num_heads)
    reps = {i: D.repetition_mask(examples[i][0], ngram) for i in np.unique(src[:, 0])}
    return np.array([reps[i][t + 1] for i, t in src], bool)


def compute_positions(backbone: Backbone, examples: Sequence[Pair], num_heads: int, max_len: int,
                      batch_tokens: int, desc: str = "hidden states", progress: bool = True) -> D.Positions:
    """The flat frozen-mode dataset: hidden states, every head's labels, the paths hydra heads read
    and the rows of the soft targets, at each useful position.

    Sequences are sorted by length and run in batches of about ``batch_tokens`` tokens padded to
    a multiple of LENGTH_BUCKET (one compiled shape per bucket), jitted, without logits.
    Returns:
      `data.Positions`: the positions where at least one head has a valid label
      (`data.head_targets`), in a deterministic order, then the extra hidden rows that only serve as
      soft targets (positions whose next token is a target but where no head has a label: about one
      per sequence, just before its last token).
    """
    from tqdm import tqdm
    fn = _hidden_fn(backbone.cfg)
    order = _length_order(examples)
    hs, extra_hs, labs, oks, paths, rows = [], [], [], [], [], []
    n_kept = n_extra = 0
    bar = tqdm(total=sum(len(examples[i][0]) for i in order), desc=desc, unit="tok", leave=False,
               disable=not progress)
    i = 0
    while i < len(order):
        T = _bucket_len(len(examples[order[i]][0]), max_len)
        nrows = max(1, batch_tokens // T)
        group = [order[j] for j in range(i, min(i + nrows, len(order)))
                 if _bucket_len(len(examples[order[j]][0]), max_len) == T]
        i += len(group)
        tokens, mask = _padded([examples[j] for j in group], nrows, max_len)
        lab, ok = (np.asarray(a) for a in D.head_targets(tokens, mask, num_heads))
        keep = ok.any(axis=0)                                  # [N, T]
        extra = D.base_targets(tokens, mask)[1] & ~keep        # soft-target rows only
        if keep.any():
            h = np.asarray(fn(backbone.params, jnp.asarray(tokens)))
            # row of h_{t+k+1} for head k at t: kept positions count up from n_kept; extra rows are
            # encoded as -2 - (their index among the extra rows) until the kept total is known
            row = np.full(keep.shape, -1, np.int64)
            row[keep] = n_kept + np.arange(keep.sum())
            row[extra] = -2 - (n_extra + np.arange(extra.sum()))
            tr = np.full(ok.shape, -1, np.int64)
            for k in range(min(num_heads, T - 1)):
                tr[k, :, :T - k - 1] = row[:, k + 1:]
            tr[~ok] = -1
            hs.append(h[keep].astype(np.float32))
            extra_hs.append(h[extra].astype(np.float32))
            labs.append(lab[:, keep].astype(np.int32))
            oks.append(ok[:, keep].astype(bool))
            paths.append(D.path_tokens(tokens, num_heads)[:, keep])
            rows.append(tr[:, keep])
            n_kept, n_extra = n_kept + int(keep.sum()), n_extra + int(extra.sum())
        bar.update(sum(len(examples[j][0]) for j in group))
    bar.close()
    if not hs:
        empty = np.zeros((num_heads, 0), np.int32)
        return D.Positions(np.zeros((0, backbone.cfg.hidden_size), np.float32), empty, empty.astype(bool), empty,
                           empty)
    tr = np.concatenate(rows, axis=1)
    tr = np.where(tr <= -2, n_kept + (-tr - 2), tr).astype(np.int32)
    return D.Positions(np.concatenate(hs + extra_hs), np.concatenate(labs, axis=1), np.concatenate(oks, axis=1),
                       np.concatenate(paths, axis=1).astype(np.int32), tr)


#: Version of the hidden-state cache's layout (`cached_positions`); older caches are recomputed.
CACHE_FORMAT = 2


def _checksum(examples: Sequence[Pair]) -> int:
    return int(sum(int(i.astype(np.int64) @ (np.arange(len(i)) % 7 + 1)) + int(m.sum()) for i, m in examples))


def _row_counts(examples: Sequence[Pair], num_heads: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per sequence, its positions and its soft-target-only rows in `compute_positions`' layout:
    kept [n] int64 (`data.kept_positions`) and extra [n] int64 (next-token label, no head label)."""
    kept, extra = np.zeros(len(examples), np.int64), np.zeros(len(examples), np.int64)
    for e, (ids, m) in enumerate(examples):
        ok = D.head_targets(np.asarray(ids)[None], np.asarray(m)[None], num_heads)[1].any(axis=0)
        kept[e] = ok.sum()
        extra[e] = (D.base_targets(np.asarray(ids)[None], np.asarray(m)[None])[1] & ~ok).sum()
    return kept, extra


def merge_positions(old: D.Positions, new: D.Positions, examples: Sequence[Pair], n_old: int,
                    num_heads: int) -> Optional[D.Positions]:
    """`compute_positions` of all `examples`, from that of ``examples[:n_old]`` (`old`) and that of
    ``examples[n_old:]`` (`new`), without the backbone: the rows are put back in the whole set's
    layout (`_length_order`, kept positions first, then the soft-target-only rows) and every
    ``target_rows`` entry follows its row. Returns None when the parts do not hold the rows the
    sequences need (a cache that is not `compute_positions`' own): recompute then."""
    kept, extra = _row_counts(examples, num_heads)
    parts = [(old, list(range(n_old))), (new, list(range(n_old, len(examples))))]
    start_kept, start_extra, base = {}, {}, 0   # each sequence's first row in the concatenated parts
    for pos, members in parts:
        order = [members[j] for j in _length_order([examples[e] for e in members])]
        if pos.num_positions != kept[order].sum() or pos.hidden.shape[0] != pos.num_positions + extra[order].sum():
            return None
        k_off, x_off = base, base + pos.num_positions
        for e in order:
            start_kept[e], start_extra[e] = k_off, x_off
            k_off, x_off = k_off + kept[e], x_off + extra[e]
        base += pos.hidden.shape[0]
    order = _length_order(examples)
    blocks = lambda start, count: [np.arange(start[e], start[e] + count[e]) for e in order]
    kept_rows = np.concatenate(blocks(start_kept, kept) + [np.zeros(0, np.int64)])  # combined row of new position p
    perm = np.concatenate([kept_rows] + blocks(start_extra, extra))                 # combined row of new row r
    where = np.empty(base, np.int64)
    where[perm] = np.arange(base)                                                   # new row of combined row
    kept_of = np.empty(base, np.int64)                                             # combined row -> column in old|new
    kept_of[:old.num_positions] = np.arange(old.num_positions)
    kept_of[old.hidden.shape[0]:old.hidden.shape[0] + new.num_positions] = old.num_positions + np.arange(
        new.num_positions)
    cols = kept_of[kept_rows]
    cat = lambda a, b: np.concatenate([a, b], axis=1)[:, cols]
    rows = np.concatenate([old.target_rows, np.where(new.target_rows >= 0, new.target_rows + old.hidden.shape[0],
                                                     -1)], axis=1)[:, cols].astype(np.int64)
    return D.Positions(np.concatenate([old.hidden, new.hidden])[perm], cat(old.labels, new.labels),
                       cat(old.valid, new.valid), cat(old.path_tokens, new.path_tokens),
                       np.where(rows >= 0, where[np.maximum(rows, 0)], -1).astype(np.int32))


def cached_positions(tc: TrainConfig, backbone: Backbone, examples, split: str, out_dir: str,
                     progress: bool = True) -> D.Positions:
    """`compute_positions`, kept in ``out_dir/hidden/<split>.npz`` (``tc.hidden_dir/<split>.npz`` when
    set) when ``tc.cache_hidden``.

    The cache is used only when its fingerprint (model, data, split, K, token checksum, layout
    version `CACHE_FORMAT`) matches. When the data has grown since (distillation resumed: the
    cached sequences are the first ones, unchanged), only the new sequences run through the backbone
    and are merged in (`merge_positions`)."""
    key = {"model": backbone.path, "cfg": repr(backbone.cfg), "data": tc.data, "split": split, "K": tc.num_heads,
           "random": [tc.seed, tc.random_init_std] if backbone.path == "random" else None, "n": len(examples),
           "sum": _checksum(examples), "format": CACHE_FORMAT}
    fn = os.path.join(tc.hidden_dir or os.path.join(out_dir, "hidden"), f"{split}.npz")
    run = lambda exs, desc: compute_positions(backbone, exs, tc.num_heads, tc.max_seq_len, tc.hidden_batch_tokens,
                                              desc=desc, progress=progress)
    out = None
    if tc.cache_hidden and os.path.isfile(fn):
        with np.load(fn) as z:
            have = json.loads(str(z["key"]))
            same = {k: v for k, v in have.items() if k not in ("n", "sum")} == {
                k: v for k, v in key.items() if k not in ("n", "sum")}
            if same and have == key:
                return D.Positions(*(z[f] for f in D.Positions._fields))
            n_old = int(have.get("n", 0))
            if same and 0 < n_old < len(examples) and have.get("sum") == _checksum(examples[:n_old]):
                old = D.Positions(*(z[f] for f in D.Positions._fields))
                _note(f"hidden-state cache {fn}: {n_old:,} of {len(examples):,} {split} sequences cached; "
                      f"computing the {len(examples) - n_old:,} new ones")
                out = merge_positions(old, run(examples[n_old:], f"hidden states ({split}, new)"), examples,
                                      n_old, tc.num_heads)
                del old
    if out is None:
        out = run(examples, f"hidden states ({split})")
    if tc.cache_hidden and jax.process_index() == 0:  # in a multi-process run, process 0 writes it
        os.makedirs(os.path.dirname(fn), exist_ok=True)
        tmp = f"{fn}.{os.getpid()}.tmp.npz"
        np.savez(tmp, key=json.dumps(key), **out._asdict())
        os.replace(tmp, fn)
    return out


# ------------------------------------------------------------------------------------- optimizers

def _schedule(tc: TrainConfig, peak: float, steps: int):
    warm = min(tc.warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), peak * tc.min_lr_ratio)


def _decay_mask(params):
    def keep(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not ("bias" in name or "scale" in name)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tc: TrainConfig, peak: float, steps: int) -> optax.GradientTransformation:
    """AdamW with linear warm-up to `peak` then cosine decay over `steps` (clipping is done outside,
    over every trained parameter together)."""
    return optax.adamw(_schedule(tc, peak, steps), tc.adam_b1, tc.adam_b2, tc.adam_eps,
                       weight_decay=tc.weight_decay, mask=_decay_mask)


def _clip(grads, max_norm: float):
    norm = optax.global_norm(grads)
    if max_norm > 0:
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    return grads, norm


# ------------------------------------------------------------------------------------ step functions

def _heads_loss(hcfg: MedusaConfig, tc: TrainConfig, hp, lm, emb, batch: dict, with_grad=True):
    """A batch of positions (`data.positions_batch`: hidden [N, D], labels/valid/path_tokens [K, N],
    teacher [K, N, D] for soft targets) -> (weighted loss, (per-head loss [K], counts [K], ranks [K, R])).

    Medusa heads read h_t; hydra heads also the embeddings (`emb` [V, D]) of the true tokens
    t+1..t+k+1 (teacher forcing, Ankner et al. 2024, Sec. 3). Hard targets: cross-entropy on the
    labels; soft: KL divergence from the backbone's distribution ``softmax(teacher_k @ lm / T)``.
    """
    hidden, lab, ok = batch["hidden"], batch["labels"], batch["valid"]
    if hcfg.head_type == "hydra":
        path = jnp.take(emb, jnp.transpose(batch["path_tokens"]), axis=0)      # [N, K, D]
        states = teacher_forced_states(hcfg, hp, hidden, path)
    else:
        states = MedusaHeads(hcfg).apply({"params": hp}, hidden, method=MedusaHeads.head_states)
    dt = jnp.dtype(tc.head_matmul_dtype)
    teacher = batch.get("teacher")
    if hcfg.shared_lm_head:
        per, cnt, ranks = shared_head_loss(states, lm.astype(dt), lab, ok, tc.loss_chunk, with_grad,
                                           teacher=teacher, temperature=tc.soft_temperature)
    else:
        logits = jnp.einsum("knd,kdv->knv", states.astype(dt), hp["lm_head"].astype(dt),
                            preferred_element_type=jnp.float32)
        if teacher is None:
            per, cnt, ranks = heads_ce(logits, lab, ok)
        else:
            t_logits = jnp.einsum("knd,dv->knv", teacher.astype(dt), lm.astype(dt), preferred_element_type=jnp.float32)
            per, cnt, ranks = heads_kl(logits, t_logits, lab, ok, tc.soft_temperature)
    return total_heads_loss(per, tc.loss_decay), (per, cnt, ranks)


def make_frozen_step(hcfg: MedusaConfig, tc: TrainConfig, opt):
    """Jitted ``(heads, opt_state, lm [D, V], emb [V, D], batch) -> (heads, opt_state, stats)`` with
    `batch` from `data.positions_batch`; only the heads are differentiated."""
    def step(hp, opt_state, lm, emb, batch):
        (loss, (per, cnt, ranks)), g = jax.value_and_grad(
            lambda p: _heads_loss(hcfg, tc, p, lm, emb, batch), has_aux=True)(hp)
        g, gnorm = _clip(g, tc.grad_clip)
        upd, opt_state = opt.update(g, opt_state, hp)
        return optax.apply_updates(hp, upd), opt_state, dict(loss=loss, head_loss=per, counts=cnt, ranks=ranks,
                                                              grad_norm=gnorm)
    return jax.jit(step, donate_argnums=(0, 1))


def _sequence_batch(hidden, tokens, lab, ok, K: int, soft: bool) -> dict:
    """A joint-mode batch in the frozen layout: hidden [B, T, D], tokens [B, T], lab/ok [K, B, T] ->
    `data.positions_batch`'s dict over the B*T positions (teacher: h_{t+k+1}, no gradient)."""
    B, T, Dm = hidden.shape
    path = jnp.stack([jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1))) for k in range(K)])   # [K, B, T]
    batch = {"hidden": hidden.reshape(B * T, Dm), "labels": lab.reshape(K, B * T), "valid": ok.reshape(K, B * T),
             "path_tokens": path.reshape(K, B * T)}
    if soft:
        h = jax.lax.stop_gradient(hidden)
        batch["teacher"] = jnp.stack([jnp.pad(h[:, k + 1:], ((0, 0), (0, k + 1), (0, 0)))
                                      for k in range(K)]).reshape(K, B * T, Dm)
    return batch


def make_joint_step(mcfg: ModelConfig, hcfg: MedusaConfig, tc: TrainConfig, opts, train_backbone: bool):
    """Jitted joint step on sequences ``(params {"backbone", "heads"}, opt_state, ref_params, tokens
    [B, T], lab/ok [K, B, T], base_lab/base_ok [B, T])``; with train_backbone False only the heads
    train (the backbone is a constant and its optimizer state is left untouched)."""
    model, K = LlamaModel(mcfg), hcfg.num_heads

    def loss_fn(params, ref, tokens, lab, ok, blab, bok):
        bb = params["backbone"] if train_backbone else jax.lax.stop_gradient(params["backbone"])
        logits, hidden, _ = model.apply({"params": bb}, tokens, _positions(tokens), compute_logits=train_backbone)
        batch = _sequence_batch(hidden, tokens, lab, ok, K, tc.loss_targets == "soft")
        loss, (per, cnt, ranks) = _heads_loss(hcfg, tc, params["heads"], lm_head_matrix(mcfg, bb),
                                              jax.lax.stop_gradient(token_embeddings(bb)), batch)
        base = jnp.zeros((), jnp.float32)
        if train_backbone:
            n = jnp.sum(bok, dtype=jnp.float32)
            if tc.base_loss == "kl":
                teacher = model.apply({"params": ref}, tokens, _positions(tokens))[0]
                base = safe_mean(kl_to_teacher_sums(logits, teacher, bok), n)
            else:
                base = safe_mean(masked_ce_sums(logits[None], blab[None], bok[None])[0], n)
            loss = loss + tc.lambda_base * base
        return loss, (per, cnt, ranks, base)

    def step(params, opt_state, ref, tokens, lab, ok, blab, bok):
        (loss, (per, cnt, ranks, base)), g = jax.value_and_grad(loss_fn, has_aux=True)(
            params, ref, tokens, lab, ok, blab, bok)
        if not train_backbone:
            g = {"heads": g["heads"]}
        g, gnorm = _clip(g, tc.grad_clip)
        new_params, new_state = dict(params), dict(opt_state)
        for name in g:
            upd, new_state[name] = opts[name].update(g[name], opt_state[name], params[name])
            new_params[name] = optax.apply_updates(params[name], upd)
        return new_params, new_state, dict(loss=loss, head_loss=per, counts=cnt, ranks=ranks, grad_norm=gnorm,
                                           base_loss=base)
    return jax.jit(step, donate_argnums=(0, 1))


def place_frozen_batch(batch: dict, mesh) -> dict:
    """A frozen-mode batch (`data.positions_batch`) on `mesh`, its N positions split on 'data':
    hidden [N, D] along axis 0; labels / valid / path_tokens [K, N] and teacher [K, N, D] along
    axis 1 (`sharding.put`: every process passes the same whole batch). Unchanged without a mesh."""
    if mesh is None:
        return batch
    return {k: sharding.put(v, mesh, sharding.batch_spec(v.ndim, 0 if k == "hidden" else 1)) for k, v in batch.items()}


def place_joint_batch(tokens, lab, ok, blab, bok, mesh) -> tuple:
    """A joint-mode batch on `mesh`, its B sequences split on 'data': tokens, blab, bok [B, T]
    along axis 0, lab / ok [K, B, T] along axis 1. Unchanged without a mesh."""
    if mesh is None:
        return tokens, lab, ok, blab, bok
    put = lambda x, axis: sharding.put(x, mesh, sharding.batch_spec(np.ndim(x), axis))
    return put(tokens, 0), put(lab, 1), put(ok, 1), put(blab, 0), put(bok, 0)


def place_projections(lm, emb, mesh) -> tuple:
    """The frozen steps' constants on `mesh` as the backbone's own: lm [D, V] split like
    ``lm_head/kernel``, emb [V, D] like ``embed/embedding`` (`sharding.RULES`). Unchanged without
    a mesh."""
    if mesh is None:
        return lm, emb
    return (sharding.put(lm, mesh, sharding.spec_for("lm_head/kernel", lm.shape, mesh)),
            sharding.put(emb, mesh, sharding.spec_for("embed/embedding", emb.shape, mesh)))


def to_host(tree):
    """Every array of `tree` as numpy, gathered from all processes when it is split across them."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree_util.tree_map(np.asarray, tree)


# ---------------------------------------------------------------------------------------- training

def _summary(per_sum, counts, ranks, misses=0) -> dict:
    """Validation figures; `misses` [K]: positions left out of the loss that count as misses
    (labels outside the proposal vocabulary)."""
    counts = np.asarray(counts, np.float64)
    total = counts + misses
    acc = topk_from_ranks(ranks, total)
    return {"val_loss": (np.asarray(per_sum) / np.maximum(counts, 1)).round(5).tolist(),
            "val_top1": acc[0].round(5).tolist(), "val_top5": acc[1].round(5).tolist(),
            "val_positions": total.astype(int).tolist(),
            "val_rank_acc": (np.asarray(ranks) / np.maximum(total, 1)[:, None]).round(5).tolist()}


def restrict_batch(batch: dict, remap: Optional[np.ndarray]) -> Tuple[dict, np.ndarray]:
    """A `data.positions_batch` dict with its labels as indices into the proposal vocabulary.

    Args:
      remap: [V] int: index of each token id in the proposal vocabulary, -1 outside it; None: the
        whole vocabulary (the batch is returned as is).
    Returns:
      (batch with labels [K, B] mapped and valid [K, B] False where the label is outside,
       misses [K] int: the valid labels outside).
    """
    if remap is None:
        return batch, np.zeros(batch["labels"].shape[0], np.int64)
    lab = remap[batch["labels"]]
    outside = batch["valid"] & (lab < 0)
    return ({**batch, "labels": np.maximum(lab, 0).astype(np.int32), "valid": batch["valid"] & (lab >= 0)},
            outside.sum(axis=1))


@functools.lru_cache(maxsize=8)
def _eval_fn(hcfg: MedusaConfig, tc: TrainConfig):
    return jax.jit(lambda hp, lm, emb, batch: _heads_loss(hcfg, tc, hp, lm, emb, batch, with_grad=False)[1])


def evaluate_positions(hcfg, tc, heads_params, lm, emb, pos: D.Positions, remap: Optional[np.ndarray] = None
                       ) -> dict:
    """Per-head validation loss, top-1/top-5 and rank accuracies on flat positions (batches of
    batch_size, the last one padded with invalid rows). emb: the backbone's input embeddings [V, D]
    (read by hydra heads). The loss is the training one (CE, or KL with soft targets); the
    accuracies count the data's tokens either way. With a proposal vocabulary (`lm` [D, N] its
    columns, `remap` as in `restrict_batch`) the ranks are within it and a label outside it is a miss."""
    K, R = hcfg.num_heads, NUM_RANKS
    tot, cnt, ranks, misses = np.zeros(K), np.zeros(K), np.zeros((K, R)), np.zeros(K)
    B, fn = tc.batch_size, _eval_fn(hcfg, tc)
    for batch in D.position_batches(pos, B, soft=tc.loss_targets == "soft"):
        batch, miss = restrict_batch(batch, remap)
        per, c, r = (np.asarray(x, np.float64) for x in fn(heads_params, lm, emb, batch))
        tot, cnt, ranks, misses = tot + per * c, cnt + c, ranks + r, misses + miss
    return _summary(tot, cnt, ranks, misses)


def initial_heads(tc: TrainConfig, hcfg: MedusaConfig, mcfg: ModelConfig, lm) -> dict:
    """Fresh heads (`init_heads`) or those of ``tc.init_heads``. Medusa heads may start hydra heads
    (`hydra.from_medusa`: zero path weights, so the same logits). Raises ValueError when the loaded
    heads' K, L, shared_lm_head or head type differ from the config, HeadsMismatchError when they do
    not fit."""
    if not tc.init_heads:
        return init_heads(hcfg, lm)
    from ..convert.medusa_format import load_heads
    cfg, p = load_heads(tc.init_heads, mcfg)
    got = (cfg.num_heads, cfg.num_layers, cfg.shared_lm_head)
    if got != (hcfg.num_heads, hcfg.num_layers, hcfg.shared_lm_head):
        raise ValueError(f"init_heads {tc.init_heads}: (num_heads, num_layers, shared_lm_head) = {got}, but the "
                         f"config asks for {(hcfg.num_heads, hcfg.num_layers, hcfg.shared_lm_head)}")
    if cfg.head_type != hcfg.head_type:
        if (cfg.head_type, hcfg.head_type) != ("medusa", "hydra"):
            raise ValueError(f"init_heads {tc.init_heads}: {cfg.head_type} heads cannot start {hcfg.head_type} "
                             "heads (only Medusa heads can start hydra heads); set init_heads: null or "
                             f"head_type: {cfg.head_type}")
        cfg, p = from_medusa(cfg, p)
        _note(f"init_heads {tc.init_heads}: Medusa heads start these hydra heads (path weights at zero)")
    return {k: jnp.asarray(v) for k, v in p.items() if k != "proposal_ids"}  # decoding-only field


def latest_checkpoint(ck_dir: str) -> Optional[Tuple[int, dict]]:
    """(step, meta) of the newest checkpoint in `ck_dir` (meta only, no arrays are read), or None
    when the directory holds none."""
    if not os.path.isdir(ck_dir):
        return None
    ck = Checkpointer(ck_dir)
    try:
        step = ck.latest_step()
        return None if step is None else (step, ck.restore_meta(step))
    finally:
        ck.close()


def _note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


def check_resume(tc: TrainConfig, step: int, old: dict) -> Optional[str]:
    """Whether `tc` may continue the checkpoint of `step` made with config `old` (a `to_dict`).

    Resuming is allowed when every field outside `_RESUME_FREE` is unchanged, except ``steps``,
    which may grow (or shrink down to `step`): the warm-up + cosine schedule is then laid over the
    new total, so the learning rate jumps at `step` and the heads differ from those of one
    uninterrupted run of the new length.
    Returns: None, or a notice to show when ``steps`` changed (it names both learning rates).
    Raises:
      ResumeConflictError: other fields differ (the message lists each old -> new value), or the
        checkpoint is already past ``tc.steps``; it says how to start over or train elsewhere.
    """
    out, old_steps = os.path.abspath(tc.out_dir), int(old.get("steps", step))
    what = (f"a finished run ({step}/{old_steps} steps)" if step >= old_steps else
            f"an unfinished run (checkpoint at step {step} of {old_steps})")
    new = tc.to_dict()
    diff = [k for k in new if k not in _RESUME_FREE and k != "steps" and old.get(k) != new[k]]
    if diff:
        changes = ", ".join(f"{k} {old.get(k)!r} -> {new[k]!r}" for k in (diff + ["steps"] * (old_steps != tc.steps)))
        raise ResumeConflictError(f"{out} holds {what} made with other settings ({changes}); {_START_OVER}")
    if tc.steps < step:
        raise ResumeConflictError(f"{out} holds {what}, already past steps={tc.steps}; {_START_OVER}")
    if tc.steps == old_steps:
        return None
    lr = lambda n: float(_schedule(tc, tc.learning_rate * tc.heads_lr_multiplier, n)(step))
    return (f"continuing the run in {out} from step {step} to {tc.steps} steps (it was set up for {old_steps}): "
            f"the learning-rate schedule now spans {tc.steps} steps, so the heads' learning rate at step {step} "
            f"is {lr(tc.steps):.3g} instead of {lr(old_steps):.3g}, and the heads will differ from those of one "
            f"uninterrupted {tc.steps}-step run")


def _finished_result(tc: TrainConfig, out_dir: str, step: int) -> Optional[TrainResult]:
    """The TrainResult of a finished run read back from its export, or None when out_dir/heads is
    missing or was exported with other export settings (tree, topk, ...)."""
    from ..convert.medusa_format import load_heads, read_heads_config
    heads_dir = os.path.join(out_dir, "heads")
    try:
        raw = read_heads_config(heads_dir)
        with open(os.path.join(out_dir, "train_config.json")) as f:
            exported_with = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    if any(exported_with.get(k) != getattr(tc, k) for k in _EXPORT_FIELDS) or exported_with.get("steps") != step:
        return None
    hcfg, hp = load_heads(heads_dir)
    return TrainResult(hcfg, hp, None, raw.get("metrics") or {}, step, heads_dir, already_finished=True)


def _frozen_data(tc: TrainConfig, bb: Backbone, train_ex, val_ex, out_dir: str, progress: bool):
    """Flat train positions, (capped) validation positions (`data.Positions`, computed once, cached)
    and the validation positions outside repetition loops (`loop_flags`; None when there are none).

    Training positions inside loops are kept with probability ``tc.loop_weight`` (a fixed draw per
    seed): an unbiased down-weighting that leaves the hidden-state cache as it is."""
    train = cached_positions(tc, bb, train_ex, "train", out_dir, progress)
    if train.num_positions == 0:
        raise ValueError(f"{tc.data}: no training position has a valid label for any head")
    if tc.loop_weight < 1.0:
        flags = _checked_loop_flags(tc, train_ex, train)
        keep = ~flags | (np.random.default_rng([tc.seed, 11]).random(len(flags)) < tc.loop_weight)
        _note(f"loop_weight={tc.loop_weight}: {int(flags.sum()):,} of {len(flags):,} training positions are inside "
              f"repetition loops (loop_ngram={tc.loop_ngram}); {int((flags & keep).sum()):,} of them are kept")
        train = D.select_positions(train, np.nonzero(keep)[0])
        if train.num_positions == 0:
            raise ValueError(f"loop_weight={tc.loop_weight} left no training position (every one is inside a "
                             f"repetition loop of loop_ngram={tc.loop_ngram}); raise loop_weight or loop_ngram")
    if not val_ex:
        return train, None, None
    val = cached_positions(tc, bb, val_ex, "val", out_dir, progress)
    flags = _checked_loop_flags(tc, val_ex, val)
    if tc.max_val_positions and val.num_positions > tc.max_val_positions:
        pick = np.sort(np.random.default_rng([tc.seed, 7]).permutation(val.num_positions)[:tc.max_val_positions])
        val, flags = D.select_positions(val, pick), flags[pick]
    return train, val, (D.select_positions(val, np.nonzero(~flags)[0]) if flags.any() and not flags.all() else None)


def _checked_loop_flags(tc: TrainConfig, examples, pos: D.Positions) -> np.ndarray:
    flags = loop_flags(examples, tc.num_heads, tc.loop_ngram)
    if len(flags) != pos.num_positions:  # a cache laid out differently from compute_positions
        raise ValueError(f"the hidden-state cache holds {pos.num_positions} positions, the data {len(flags)}: "
                         f"delete {tc.hidden_dir or os.path.join(tc.out_dir, 'hidden')} to recompute it")
    return flags


def _val_sequences(tc: TrainConfig, val_ex):
    """The first validation sequences holding at most about max_val_positions answer tokens."""
    picked, total = [], 0
    for ex in val_ex:
        if tc.max_val_positions and total >= tc.max_val_positions:
            break
        picked.append(ex)
        total += int(ex[1].sum())
    return picked


def _record(tc: TrainConfig, acc: dict, step: int, n_items: int, seconds: float, joint: bool) -> dict:
    """A metrics line from the sums of the step stats since the last line."""
    n = acc["n"]
    train_acc = topk_from_ranks(acc["ranks"], acc["counts"])
    rec = {"step": step, "epoch": round(step * tc.batch_size / n_items, 4),
           "lr": float(_schedule(tc, tc.learning_rate * tc.heads_lr_multiplier, tc.steps)(step - 1)),
           "loss": round(acc["loss"] / n, 5), "head_loss": (acc["head_loss"] / n).round(5).tolist(),
           "train_top1": train_acc[0].round(4).tolist(), "grad_norm": round(acc["grad_norm"] / n, 4),
           "step_time_s": round(seconds / n, 4)}
    if joint:
        hw = tc.heads_warmup_steps
        rec["lr_backbone"] = float(_schedule(tc, tc.learning_rate, tc.steps - hw)(step - 1 - hw)) if step > hw else 0.0
        rec["base_loss"] = round(acc["base_loss"] / n, 5)
    return rec


def train(tc: TrainConfig, resume: bool = True, stop_at_step: Optional[int] = None,
          backbone: Optional[Backbone] = None, progress: bool = True) -> TrainResult:
    """Train Medusa heads as `tc` says (see the module docstring); resumable.

    Args:
      tc: the training config.
      resume: continue from the latest checkpoint in ``out_dir/checkpoints`` when there is one
        (`check_resume` says which config changes are allowed; a larger ``steps`` continues a
        finished run, with a notice on stderr). A run already finished with the same settings
        trains and writes nothing: its export is returned with ``already_finished`` set (and a
        notice). False: start over (checkpoints and metrics.jsonl are deleted; the hidden-state
        cache stays).
      stop_at_step: return after this many steps without a final checkpoint or export (simulates
        an interruption; the next run resumes from the last checkpoint).
      backbone: a prebuilt `Backbone` (default `build_backbone(tc)`).
      progress: show tqdm progress bars.
    Returns: a `TrainResult`.
    Raises: ResumeConflictError (a ValueError: out_dir holds a run this config cannot continue,
      checked before anything is loaded or written), FileNotFoundError (model or data missing),
      ValueError (bad data, mismatched checkpoint or init_heads).
    """
    from tqdm import tqdm
    out_dir = os.path.abspath(tc.out_dir)
    ck_dir = os.path.join(out_dir, "checkpoints")
    if not resume:
        shutil.rmtree(ck_dir, ignore_errors=True)
    point = latest_checkpoint(ck_dir)
    if point is not None:
        notice = check_resume(tc, point[0], point[1].get("config", {}))
        if notice:
            _note(notice)
        elif point[0] == tc.steps:
            done = _finished_result(tc, out_dir, point[0])
            if done is not None:
                _note(f"{out_dir} already holds this run, finished ({point[0]}/{tc.steps} steps) with the same "
                      f"settings; nothing was trained. Its heads: {done.heads_dir}. To train longer: --set "
                      f"steps=N (N > {tc.steps}); to train again from scratch: --no-resume; for a separate run: "
                      "--set out_dir=DIR")
                return done
            _note(f"{out_dir} holds this run, finished ({point[0]}/{tc.steps} steps); exporting its heads again "
                  f"(export settings changed or {os.path.join(out_dir, 'heads')} is missing)")
    mesh = sharding.mesh_from_arg(tc.mesh)
    primary = jax.process_index() == 0  # the process that writes metrics and the export
    os.makedirs(out_dir, exist_ok=True)
    if primary:
        with open(os.path.join(out_dir, "train_config.json"), "w") as f:
            json.dump(tc.to_dict(), f, indent=2)
    bb = backbone or build_backbone(tc)
    mcfg, K, joint = bb.cfg, tc.num_heads, tc.mode == "joint"
    if mesh is not None and joint:
        sharding.check_model_axis(mcfg, mesh.shape["model"])
    hcfg = MedusaConfig(hidden_size=mcfg.hidden_size, vocab_size=mcfg.vocab_size, num_heads=K,
                        num_layers=tc.num_layers, shared_lm_head=tc.shared_lm_head, topk=tc.topk,
                        base_model=os.path.basename(os.path.normpath(bb.path)), head_type=tc.head_type)
    lm0 = jnp.asarray(lm_head_matrix(mcfg, bb.params))
    emb = jnp.asarray(token_embeddings(bb.params))  # hydra heads' path embeddings (frozen)
    soft = tc.loss_targets == "soft"
    train_ex, val_ex = load_examples(tc, mcfg.vocab_size)
    proposal_ids, remap = proposal_vocabulary(tc, train_ex, mcfg.vocab_size)
    # cast once: the frozen steps take it as is; with a proposal vocabulary only its columns
    lm_train = (lm0 if proposal_ids is None else lm0[:, proposal_ids]).astype(tc.head_matmul_dtype)
    heads_lr = tc.learning_rate * tc.heads_lr_multiplier
    heads0 = initial_heads(tc, hcfg, mcfg, lm0)
    if joint:
        opts = {"heads": make_optimizer(tc, heads_lr, tc.steps),
                "backbone": make_optimizer(tc, tc.learning_rate, tc.steps - tc.heads_warmup_steps)}
        params = {"heads": heads0, "backbone": bb.params}
        opt_state = {k: opts[k].init(params[k]) for k in opts}
        step_fns = {b: make_joint_step(mcfg, hcfg, tc, opts, b) for b in (False, True)}
        n_items = len(train_ex)
    else:
        opt = make_optimizer(tc, heads_lr, tc.steps)
        params, opt_state = heads0, opt.init(heads0)
        frozen_step = make_frozen_step(hcfg, tc, opt)
        train_pos, val, val_noloop = _frozen_data(tc, bb, train_ex, val_ex, out_dir, progress)
        n_items = train_pos.num_positions
    ck = Checkpointer(ck_dir, tc.keep_checkpoints)
    step = 0
    if resume and ck.latest_step() is not None:
        step, state, _ = ck.restore({"params": params, "opt_state": opt_state, "step": np.int64(0)})
        params, opt_state = jax.tree_util.tree_map(jnp.asarray, (state["params"], state["opt_state"]))
    else:  # copies: the steps donate their inputs, and bb.params must survive (teacher, export)
        params, opt_state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), (params, opt_state))
    metrics = MetricsLog(out_dir, step if step else -1, write=primary)  # from step 0: no earlier line is kept
    ref = bb.params if joint and tc.base_loss == "kl" else None
    if mesh is not None:  # Megatron-style on 'model' (`sharding.RULES`), optimizer states as their params
        params, opt_state, ref = sharding.shard_params((params, opt_state, ref), mesh)
        lm_train, emb = place_projections(lm_train, emb, mesh)

    def evaluate(p) -> dict:
        if not joint:
            if val is None or not val.num_positions:
                return {}
            out = evaluate_positions(hcfg, tc, p, lm_train, emb, val, remap)
            if val_noloop is not None:  # the same heads outside repetition loops (`loop_flags`)
                clean = evaluate_positions(hcfg, tc, p, lm_train, emb, val_noloop, remap)
                out.update({"val_noloop_top1": clean["val_top1"], "val_noloop_top5": clean["val_top5"]})
            return out
        if not val_ex:
            return {}
        v = compute_positions(Backbone(mcfg, p["backbone"], bb.path), _val_sequences(tc, val_ex), K,
                              tc.max_seq_len, tc.hidden_batch_tokens, progress=False)
        return evaluate_positions(hcfg, tc, p["heads"], lm_head_matrix(mcfg, p["backbone"]),
                                  token_embeddings(p["backbone"]), v)

    def save(s):
        meta = {"step": s, "seed": tc.seed, "data_items": n_items, "epoch": (s * tc.batch_size) // n_items,
                "index_in_epoch": (s * tc.batch_size) % n_items, "config": tc.to_dict()}
        ck.save(s, {"params": params, "opt_state": opt_state, "step": np.int64(s)}, meta)

    acc, last_eval = None, {}
    if step == 0 and tc.eval_every:  # the starting point of the accuracy curves
        metrics.write({"step": 0, "epoch": 0.0, **evaluate(params)})
    t_log, end = time.perf_counter(), min(tc.steps, stop_at_step if stop_at_step is not None else tc.steps)
    bar = tqdm(total=tc.steps, initial=step, desc=f"train ({tc.mode})", disable=not progress, dynamic_ncols=True)
    while step < end:
        idx = batch_indices(n_items, tc.batch_size, tc.seed, step)
        if joint:
            tokens, mask = _padded([train_ex[i] for i in idx], tc.batch_size, tc.max_seq_len)
            params, opt_state, st = step_fns[step >= tc.heads_warmup_steps](
                params, opt_state, ref, *place_joint_batch(tokens, *D.head_targets(tokens, mask, K),
                                                           *D.base_targets(tokens, mask), mesh))
        else:
            batch = restrict_batch(D.positions_batch(train_pos, idx, soft=soft), remap)[0]
            params, opt_state, st = frozen_step(params, opt_state, lm_train, emb, place_frozen_batch(batch, mesh))
        st = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), st)
        acc = dict(st, n=1) if acc is None else {k: acc[k] + st.get(k, 1) for k in acc}
        step += 1
        bar.update(1)
        is_eval = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
        if step % tc.log_every == 0 or is_eval or step == end:
            rec = _record(tc, acc, step, n_items, time.perf_counter() - t_log, joint)
            if is_eval:
                last_eval = evaluate(params)
                rec.update(last_eval)
            metrics.write(rec)
            bar.set_postfix(loss=rec["loss"], top1=rec.get("val_top1", rec["train_top1"])[0])
            acc, t_log = None, time.perf_counter()
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
            save(step)
    bar.close()
    metrics.plot()  # also for runs stopped early or without validation data
    np_params = to_host(params)
    heads_p, backbone_p = (np_params["heads"], np_params["backbone"]) if joint else (np_params, None)
    heads_dir = None
    out_cfg = hcfg
    if proposal_ids is not None:  # the exported heads decode with the vocabulary they were trained on
        heads_p = {**heads_p, "proposal_ids": np.asarray(proposal_ids, np.int32)}
        out_cfg = hcfg.replace(proposal_vocab_size=len(proposal_ids))
    if step >= tc.steps:
        save(step)
        last_eval = last_eval or evaluate(params)
        if primary:
            heads_dir = export(tc, out_cfg, heads_p, backbone_p, bb, last_eval, out_dir)
    ck.close()
    return TrainResult(out_cfg, heads_p, backbone_p, last_eval, step, heads_dir)
