"""The frozen mode's hidden-state cache: the backbone run once over the data (batched by length),
flattened into training positions, kept on disk and grown when distillation appends answers."""
from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax.convert.load import load_model
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import LlamaModel
from medusa_jax.train import data as D
from medusa_jax.train.config import TrainConfig

Pair = Tuple[np.ndarray, np.ndarray]  # (ids [T] int32, loss_mask [T] bool)


#: Sequences are padded to a multiple of this many tokens (one compiled shape per bucket).
LENGTH_BUCKET = 128


@dataclass
class Backbone:
    """cfg: `ModelConfig`; params: `LlamaModel` params (jnp); path: where it came from or "random";
    tokenizer: a transformers tokenizer or None."""
    cfg: ModelConfig
    params: Any
    path: str
    tokenizer: Any = None


def weights_stamp(path: str) -> Optional[List[list]]:
    """[[file name, size, mtime in ns], ...] of a model's weight files (a GGUF file, or an HF
    directory's ``*.safetensors``), None for the random backbone: part of the hidden-state and
    layer-input caches' keys, so that a checkpoint rewritten in place (a fine-tune run again into
    the same directory) is not trained on with the old model's cached states."""
    if path == "random" or not os.path.exists(path):
        return None
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    return [[os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]


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
    lm = load_model(tc.model, with_tokenizer=tc.mode == "joint")
    return Backbone(lm.cfg, lm.params, lm.path, lm.tokenizer)


def bucket_len(n: int, max_len: int) -> int:
    """The padded length of a sequence of n tokens: a multiple of LENGTH_BUCKET, at most max_len."""
    return int(min(max_len, max(LENGTH_BUCKET, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET)))


def padded_sequences(examples: Sequence[Pair], rows: int, max_len: int):
    """pad_batch to a bucketed length, plus all-masked rows up to `rows`: tokens, mask [rows, T]."""
    T = bucket_len(max(len(i) for i, _ in examples), max_len)
    tokens, mask, _ = D.pad_batch(list(examples), T)
    tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
    extra = rows - tokens.shape[0]
    if extra > 0:
        tokens = np.concatenate([tokens, np.zeros((extra, T), np.int32)])
        mask = np.concatenate([mask, np.zeros((extra, T), bool)])
    return tokens, mask


def sequence_positions(tokens) -> jax.Array:
    B, T = tokens.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


@functools.lru_cache(maxsize=4)
def hidden_fn(cfg: ModelConfig):
    @jax.jit
    def fn(params, tokens):
        return LlamaModel(cfg).apply({"params": params}, tokens, sequence_positions(tokens), compute_logits=False)[1]
    return fn


def length_order(examples: Sequence[Pair]) -> List[int]:
    """The order `compute_positions` runs (and lays out) the sequences in: by length, then index."""
    return sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), i))


def length_batches(examples: Sequence[Pair], max_len: int, batch_tokens: int, indices=None):
    """Batches for one compiled shape each: the sequences (`indices`, default all) sorted by length
    (`length_order`), grouped into about `batch_tokens` tokens of one bucketed length. Yields
    (T, rows, group): the padded length (`bucket_len`), the rows a full batch of it holds
    (``batch_tokens // T``, at least 1) and the sequence indices (at most `rows`, all of length T)."""
    order = length_order(examples) if indices is None else sorted(indices, key=lambda i: (len(examples[i][0]), i))
    i = 0
    while i < len(order):
        T = bucket_len(len(examples[order[i]][0]), max_len)
        rows = max(1, batch_tokens // T)
        group = [j for j in order[i:i + rows] if bucket_len(len(examples[j][0]), max_len) == T]
        i += len(group)
        yield T, rows, group


def position_sources(examples: Sequence[Pair], num_heads: int) -> np.ndarray:
    """Where each of `compute_positions`' flat positions comes from, without running the backbone:
    [P, 2] int64 rows (sequence index, position t), in its order (`length_order`, then t)."""
    out = [np.stack([np.full(len(t), i), t], axis=1)
           for i in length_order(examples) for t in [D.kept_positions(*examples[i], num_heads)]]
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
    fn = hidden_fn(backbone.cfg)
    hs, extra_hs, labs, oks, paths, rows = [], [], [], [], [], []
    n_kept = n_extra = 0
    bar = tqdm(total=sum(len(i) for i, _ in examples), desc=desc, unit="tok", leave=False, disable=not progress)
    for T, nrows, group in length_batches(examples, max_len, batch_tokens):
        tokens, mask = padded_sequences([examples[j] for j in group], nrows, max_len)
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


def examples_checksum(examples: Sequence[Pair]) -> int:
    """A cheap fingerprint of (ids, loss_mask) pairs, for the caches' keys."""
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
    layout (`length_order`, kept positions first, then the soft-target-only rows) and every
    ``target_rows`` entry follows its row. Returns None when the parts do not hold the rows the
    sequences need (a cache that is not `compute_positions`' own): recompute then."""
    kept, extra = _row_counts(examples, num_heads)
    parts = [(old, list(range(n_old))), (new, list(range(n_old, len(examples))))]
    start_kept, start_extra, base = {}, {}, 0   # each sequence's first row in the concatenated parts
    for pos, members in parts:
        order = [members[j] for j in length_order([examples[e] for e in members])]
        if pos.num_positions != kept[order].sum() or pos.hidden.shape[0] != pos.num_positions + extra[order].sum():
            return None
        k_off, x_off = base, base + pos.num_positions
        for e in order:
            start_kept[e], start_extra[e] = k_off, x_off
            k_off, x_off = k_off + kept[e], x_off + extra[e]
        base += pos.hidden.shape[0]
    order = length_order(examples)
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

    The cache is used only when its fingerprint (model, its weight files' sizes and times
    (`weights_stamp`), data, split, K, token checksum, layout version `CACHE_FORMAT`) matches. When
    the data has grown since (distillation resumed: the cached sequences are the first ones,
    unchanged), only the new sequences run through the backbone and are merged in
    (`merge_positions`)."""
    key = {"model": backbone.path, "weights": weights_stamp(backbone.path), "cfg": repr(backbone.cfg),
           "data": tc.data, "split": split, "K": tc.num_heads,
           "random": [tc.seed, tc.random_init_std] if backbone.path == "random" else None, "n": len(examples),
           "sum": examples_checksum(examples), "format": CACHE_FORMAT}
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
            if same and 0 < n_old < len(examples) and have.get("sum") == examples_checksum(examples[:n_old]):
                old = D.Positions(*(z[f] for f in D.Positions._fields))
                note(f"hidden-state cache {fn}: {n_old:,} of {len(examples):,} {split} sequences cached; "
                      f"computing the {len(examples) - n_old:,} new ones")
                out = merge_positions(old, run(examples[n_old:], f"hidden states ({split}, new)"), examples,
                                      n_old, tc.num_heads)
                del old
            else:
                note(stale_cache_note(fn, have, key))
    if out is None:
        out = run(examples, f"hidden states ({split})")
    if tc.cache_hidden and jax.process_index() == 0:  # in a multi-process run, process 0 writes it
        os.makedirs(os.path.dirname(fn), exist_ok=True)
        tmp = f"{fn}.{os.getpid()}.tmp.npz"
        np.savez(tmp, key=json.dumps(key), **out._asdict())
        os.replace(tmp, fn)
    return out


def stale_cache_note(fn: str, have: dict, key: dict) -> str:
    """What a hidden-state cache at `fn` made with key `have` (another run's, or older data's) holds
    that this run (`key`) cannot use: it is computed anew and replaced."""
    what = {"model": "model", "weights": "model's weight files", "cfg": "model config", "data": "data",
            "split": "split", "K": "number of heads", "random": "random backbone", "format": "cache format"}
    differs = [f"{name} {have.get(k)!r}" if k in ("model", "data", "K") else name
               for k, name in what.items() if have.get(k) != key.get(k)]
    why = f"another {', '.join(differs)}" if differs else "other sequences of the same data (it was edited)"
    return (f"hidden-state cache {fn} was made for {why}; computing this run's states and replacing it "
            "(give each run its own hidden_dir to keep both)")


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


def frozen_positions(tc: TrainConfig, bb: Backbone, train_ex, val_ex, out_dir: str, progress: bool):
    """What frozen (Medusa-1) training runs on: (flat train positions, (capped) validation positions
    (`data.Positions`, computed once, cached; None without validation chats), the validation
    positions outside repetition loops (`loop_flags`; None when there are none, or all are)).

    Training positions inside loops are kept with probability ``tc.loop_weight`` (a fixed draw per
    seed): an unbiased down-weighting that leaves the hidden-state cache as it is.
    Raises ValueError: no training position with a valid label (or none left by loop_weight), or a
    hidden-state cache that holds another number of positions than the data."""
    train = cached_positions(tc, bb, train_ex, "train", out_dir, progress)
    if train.num_positions == 0:
        raise ValueError(f"{tc.data}: no training position has a valid label for any head")
    if tc.loop_weight < 1.0:
        flags = _checked_loop_flags(tc, train_ex, train)
        keep = ~flags | (np.random.default_rng([tc.seed, 11]).random(len(flags)) < tc.loop_weight)
        note(f"loop_weight={tc.loop_weight}: {int(flags.sum()):,} of {len(flags):,} training positions are inside "
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
