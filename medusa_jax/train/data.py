"""Training data: chats -> token ids with an assistant-only loss mask, batching, Medusa targets.

Conventions (docs/design-notes.md, "Conventions"): an example is token ids ``[T]`` int32 with a loss mask ``[T]`` bool that
marks the tokens the model should learn to produce (assistant answers and their end-of-turn
token). Medusa head k (0-based) reads the hidden state at position t and predicts token t + k + 2;
the backbone's own next-token prediction is "head -1" (token t + 1). A target is valid only when
its position is inside the sequence (and the same packed segment) and its loss mask is True.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from medusa_jax.chat import end_of_turn_ids, render_chat
from medusa_jax.train.distill import SAMPLES_FILE, check_not_eval_set, read_samples


class Example(tuple):
    """One training sequence: unpacks as ``(ids, loss_mask)``; ``.id`` names it (or None).

    ids: [T] int32 token ids. loss_mask: [T] bool, True where the token is a training target.
    """

    def __new__(cls, ids, loss_mask, id: Optional[str] = None):
        ids = np.asarray(ids, np.int32).reshape(-1)
        loss_mask = np.asarray(loss_mask, bool).reshape(-1)
        if ids.shape != loss_mask.shape:
            raise ValueError(f"ids {ids.shape} and loss_mask {loss_mask.shape} differ in length")
        self = super().__new__(cls, (ids, loss_mask))
        self.id = id
        return self

    @property
    def ids(self) -> np.ndarray:
        return self[0]

    @property
    def loss_mask(self) -> np.ndarray:
        return self[1]


# --------------------------------------------------------------------------------------------
# chats


def chat_to_example(tokenizer, messages: Sequence[dict], id: Optional[str] = None) -> Example:
    """Tokenize a chat with its template; the loss mask covers the assistant turns only.

    Method: the template is rendered on prefixes of the conversation and token counts are
    diffed. Assistant message i spans ``[len(render(messages[:i], add_generation_prompt=True)),
    len(render(messages[:i+1])))``, so the template's role header (e.g. ``<|im_start|>assistant\\n``)
    is excluded, and anything the template inserts by itself (a default system prompt, as
    SmolLM2's ChatML does) falls outside every span. Within a span, tokens after the last
    end-of-turn token (e.g. the newline after ``<|im_end|>``) are excluded: the model stops at
    the end-of-turn token and never predicts them.

    Args:
      tokenizer: a transformers tokenizer with a chat template.
      messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
      id: optional name carried by the returned `Example`.
    Returns:
      Example(ids [T] int32, loss_mask [T] bool).
    Raises:
      ValueError: no messages, a message without role/content, no chat template, or a template
        whose rendering of a prefix is not a prefix of the full rendering (e.g. one that drops
        earlier turns' reasoning), where the diffing cannot place the spans.
    """
    if not messages:
        raise ValueError("empty conversation")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a 'role' and a 'content' string, got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    mask = np.zeros(len(full), bool)
    eot = set(end_of_turn_ids(tokenizer))

    def prefix_len(msgs, gen):
        if not msgs:
            return 0
        ids = render_chat(tokenizer, msgs, gen)
        if full[:len(ids)] != ids:
            raise ValueError("the chat template does not render a conversation's prefix as a prefix of "
                             "the whole; cannot locate the assistant turns")
        return len(ids)

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = prefix_len(messages[:i], True)
        end = prefix_len(messages[:i + 1], False)
        ends = [j for j in range(start, end) if full[j] in eot]
        if ends:
            end = ends[-1] + 1
        mask[start:end] = True
    return Example(full, mask, id)


def load_distilled(directory: str) -> List[Example]:
    """Self-distilled samples (`medusa_jax.train.distill` output) as training examples.

    Args:
      directory: holds ``samples.jsonl`` (a truncated last line is ignored).
    Returns:
      [Example(prompt_ids + response_ids, mask False on the prompt and True on the response, id)],
      in file order; samples with an empty response are dropped.
    Raises:
      FileNotFoundError: no samples.jsonl there.
    """

    path = os.path.join(directory, SAMPLES_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; run `medusa-distill --out {directory}`")
    out = []
    for pid, r in read_samples(path, repair=False).items():
        p, a = r["prompt_ids"], r["response_ids"]
        if a:
            out.append(Example(list(p) + list(a), [False] * len(p) + [True] * len(a), pid))
    return out


def _example_key(ex, index: int) -> str:
    ident = getattr(ex, "id", None)
    if ident is not None:
        return "id:" + str(ident)
    return "ids:" + hashlib.sha256(np.asarray(ex[0], np.int32).tobytes()).hexdigest()


def split_train_val(examples: Sequence, val_fraction: float, seed: int = 0) -> Tuple[list, list]:
    """Split into (train, val), deterministically by example id (content hash when no id).

    Each example goes to val when ``sha256(seed, id)`` mapped to [0, 1) is below `val_fraction`,
    so the split does not depend on the order of the examples nor on which others exist
    (adding data never moves an example from val to train). Order is kept within each part.
    Raises: ValueError for a fraction outside [0, 1].
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    train, val = [], []
    for i, ex in enumerate(examples):
        h = hashlib.sha256(f"{seed}:{_example_key(ex, i)}".encode()).digest()
        u = int.from_bytes(h[:8], "big") / 2.0 ** 64
        (val if u < val_fraction else train).append(ex)
    return train, val


# --------------------------------------------------------------------------------------------
# batching


def pad_batch(examples: Sequence, seq_len: int, pad_id: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad (or truncate) examples to `seq_len`.

    Args:
      examples: N (ids, loss_mask) pairs.
    Returns:
      tokens [N, seq_len] int32 (pad_id after the end), loss_mask [N, seq_len] bool (False on
      padding), lengths [N] int32 (real tokens, at most seq_len).
    """
    n = len(examples)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    mask = np.zeros((n, seq_len), bool)
    lengths = np.zeros((n,), np.int32)
    for i, (ids, m) in enumerate(examples):
        L = min(len(ids), seq_len)
        tokens[i, :L] = np.asarray(ids, np.int32)[:L]
        mask[i, :L] = np.asarray(m, bool)[:L]
        lengths[i] = L
    return tokens, mask, lengths


def pack(examples: Sequence, seq_len: int, pad_id: int = 0
         ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pack examples end to end into rows of `seq_len` (first fit, in order; long ones truncated).

    The model must not attend across examples: build a block-diagonal causal mask from
    ``segment_ids`` and use ``positions`` for RoPE; pass ``segment_ids`` to `head_targets` /
    `base_targets` so no label crosses into the next example.
    Returns:
      tokens [R, seq_len] int32, loss_mask [R, seq_len] bool, segment_ids [R, seq_len] int32
      (1, 2, ... per example within a row; 0 on padding), positions [R, seq_len] int32 (restart
      at 0 for each example; 0 on padding).
    """
    rows: List[List[Tuple[np.ndarray, np.ndarray]]] = []
    used: List[int] = []
    for ids, m in examples:
        ids = np.asarray(ids, np.int32)[:seq_len]
        m = np.asarray(m, bool)[:seq_len]
        if len(ids) == 0:
            continue
        for r, u in enumerate(used):
            if u + len(ids) <= seq_len:
                rows[r].append((ids, m))
                used[r] += len(ids)
                break
        else:
            rows.append([(ids, m)])
            used.append(len(ids))
    R = len(rows)
    tokens = np.full((R, seq_len), pad_id, np.int32)
    mask = np.zeros((R, seq_len), bool)
    seg = np.zeros((R, seq_len), np.int32)
    pos = np.zeros((R, seq_len), np.int32)
    for r, row in enumerate(rows):
        o = 0
        for s, (ids, m) in enumerate(row):
            L = len(ids)
            tokens[r, o:o + L], mask[r, o:o + L], seg[r, o:o + L] = ids, m, s + 1
            pos[r, o:o + L] = np.arange(L)
            o += L
    return tokens, mask, seg, pos


def _shifted(tokens: np.ndarray, loss_mask: np.ndarray, shift: int,
             segment_ids: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    N, T = tokens.shape
    labels = np.zeros((N, T), np.int32)
    valid = np.zeros((N, T), bool)
    if shift < T:
        labels[:, :T - shift] = tokens[:, shift:]
        valid[:, :T - shift] = loss_mask[:, shift:]
        if segment_ids is not None:
            valid[:, :T - shift] &= (segment_ids[:, :T - shift] == segment_ids[:, shift:]) & (segment_ids[:, shift:] > 0)
    labels[~valid] = 0
    return labels, valid


def head_targets(tokens, loss_mask, num_heads: int, segment_ids=None) -> Tuple[np.ndarray, np.ndarray]:
    """Medusa head labels: head k at position t predicts token t + k + 2.

    Args:
      tokens: [N, T] int. loss_mask: [N, T] bool. num_heads: K.
      segment_ids: optional [N, T] int from `pack`: a label must lie in the same segment.
    Returns:
      labels [K, N, T] int32 (0 where invalid), valid [K, N, T] bool: True when t + k + 2 < T,
      ``loss_mask[n, t + k + 2]`` and (packed) the same segment.
    """
    tokens = np.asarray(tokens, np.int32)
    loss_mask = np.asarray(loss_mask, bool)
    seg = None if segment_ids is None else np.asarray(segment_ids)
    pairs = [_shifted(tokens, loss_mask, k + 2, seg) for k in range(num_heads)]
    N, T = tokens.shape
    if not pairs:
        return np.zeros((0, N, T), np.int32), np.zeros((0, N, T), bool)
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def base_targets(tokens, loss_mask, segment_ids=None) -> Tuple[np.ndarray, np.ndarray]:
    """The backbone's next-token labels (token t + 1): labels [N, T] int32, valid [N, T] bool.
    Same rules as `head_targets` (which is this with shift k + 2)."""
    return _shifted(np.asarray(tokens, np.int32), np.asarray(loss_mask, bool), 1,
                    None if segment_ids is None else np.asarray(segment_ids))


def repetition_mask(ids, ngram: int) -> np.ndarray:
    """Which tokens continue a verbatim repeat: [T] int -> [T] bool, True at token j when the
    `ngram` tokens ending at j (j-ngram+1..j) already occurred, ending before j, in `ids`.

    Greedy self-distillation of a small model loops: the same sentence or list item repeated up to
    the length limit. Past the first `ngram` tokens of a repeat, the rest is a copy, easy for draft
    heads and over-represented in the data (`loop_flags`). Raises ValueError for ngram < 1.
    """
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = np.zeros(len(ids), bool)
    seen = set()
    for j in range(ngram - 1, len(ids)):
        gram = ids[j - ngram + 1:j + 1].tobytes()
        out[j] = gram in seen
        seen.add(gram)
    return out


def kept_positions(ids, loss_mask, num_heads: int) -> np.ndarray:
    """Positions t of one sequence where at least one head has a label (`head_targets`): [T] -> [P] int."""
    ok = head_targets(np.asarray(ids)[None], np.asarray(loss_mask)[None], num_heads)[1]
    return np.nonzero(ok.any(axis=0)[0])[0]


# --------------------------------------------------------------------------------------------
# flat position datasets (frozen backbone: hidden states computed once)


def trainable_positions(valid) -> np.ndarray:
    """Positions where at least one head has a valid label.

    Args:
      valid: [K, N, T] bool from `head_targets`.
    Returns:
      [P, 2] int32 (row n, position t) pairs, row-major order; shuffle them to mix sequences.
    """
    valid = np.asarray(valid, bool)
    n, t = np.nonzero(valid.any(axis=0))
    return np.stack([n, t], axis=1).astype(np.int32)


def gather_positions(hidden, labels, valid, positions) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Select positions from per-sequence arrays into a flat dataset.

    Args:
      hidden: [N, T, D] hidden states (numpy or jax). labels, valid: [K, N, T].
      positions: [P, 2] int from `trainable_positions` (possibly shuffled / a minibatch of it).
    Returns:
      hidden [P, D], labels [K, P] int32, valid [K, P] bool.
    """
    positions = np.asarray(positions)
    n, t = positions[:, 0], positions[:, 1]
    return hidden[n, t], np.asarray(labels)[:, n, t], np.asarray(valid)[:, n, t]


def path_tokens(tokens, num_heads: int) -> np.ndarray:
    """The tokens after each position, unmasked: [N, T] -> [K, N, T] int32 with entry [k, n, t] =
    ``tokens[n, t + k + 1]`` (0 past the end). Hydra head k reads entries 0..k at t (teacher forcing:
    the true tokens t+1..t+k+1 on its path); where head k's label is valid they are all inside the
    sequence."""
    tokens = np.asarray(tokens, np.int32)
    N, T = tokens.shape
    out = np.zeros((num_heads, N, T), np.int32)
    for k in range(num_heads):
        if k + 1 < T:
            out[k, :, :T - k - 1] = tokens[:, k + 1:]
    return out


class Positions(NamedTuple):
    """The frozen-backbone dataset: every useful position t of every sequence, flat.

    With P positions and R >= P hidden rows:
      hidden      [R, D] float32  rows 0..P-1: h_t of the positions; rows P..R-1: hidden states only
                                  used as soft targets (positions where no head has a label)
      labels      [K, P] int32    head k's label, token t+k+2 (0 where not valid)
      valid       [K, P] bool     whether that label exists (`head_targets`)
      path_tokens [K, P] int32    tokens t+1..t+K, unmasked (`path_tokens`): hydra heads' paths
      target_rows [K, P] int32    row of `hidden` holding h_{t+k+1}, whose projection through the
                                  base lm_head is the backbone's distribution over token t+k+2: head
                                  k's soft target (-1 where not valid)
    """
    hidden: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    path_tokens: np.ndarray
    target_rows: np.ndarray

    @property
    def num_positions(self) -> int:
        """P."""
        return int(self.labels.shape[1])


def plain_positions(hidden, labels, valid, path=None) -> Positions:
    """`Positions` from hidden [P, D], labels and valid [K, P] (and optionally path tokens [K, P]),
    without soft-target rows (target_rows all -1)."""
    labels = np.asarray(labels, np.int32)
    path = np.zeros_like(labels) if path is None else np.asarray(path, np.int32)
    return Positions(np.asarray(hidden), labels, np.asarray(valid, bool), path, np.full(labels.shape, -1, np.int32))


def select_positions(pos: Positions, pick) -> Positions:
    """The positions `pick` ([n] int indices into 0..P-1) of `pos`, with the hidden rows their soft
    targets need (kept after theirs, so the `Positions` layout holds)."""
    pick = np.asarray(pick, np.int64)
    tr = pos.target_rows[:, pick]
    need = np.unique(tr[tr >= 0])
    remap = np.full(pos.hidden.shape[0], -1, np.int64)
    remap[need] = len(pick) + np.arange(len(need))
    rows = np.concatenate([pick, need])
    return Positions(pos.hidden[rows], pos.labels[:, pick], pos.valid[:, pick], pos.path_tokens[:, pick],
                     np.where(tr >= 0, remap[np.maximum(tr, 0)], -1).astype(np.int32))


def positions_batch(pos: Positions, idx, batch: Optional[int] = None, soft: bool = False) -> dict:
    """The arrays of positions `idx` for one step, padded with invalid rows up to `batch`.

    Returns {"hidden" [B, D], "labels" [K, B], "valid" [K, B], "path_tokens" [K, B], and with `soft`
    "teacher" [K, B, D]: h_{t+k+1} for head k (zeros where not valid)}.
    """
    idx = np.asarray(idx, np.int64)
    pad = 0 if batch is None else batch - len(idx)
    padk = lambda a: np.pad(a, ((0, 0), (0, pad))) if pad else a
    out = {"hidden": np.pad(pos.hidden[idx], ((0, pad), (0, 0))) if pad else pos.hidden[idx],
           "labels": padk(pos.labels[:, idx]), "valid": padk(pos.valid[:, idx]),
           "path_tokens": padk(pos.path_tokens[:, idx])}
    if soft:
        tr = padk(pos.target_rows[:, idx])
        out["teacher"] = np.where((tr >= 0)[..., None], pos.hidden[np.maximum(tr, 0)], 0.0).astype(pos.hidden.dtype)
    return out


def position_batches(pos: Positions, batch: int, soft: bool = False):
    """Fixed-size batches of consecutive positions (`positions_batch`); the last one is padded with
    invalid rows, so one compiled shape serves all."""
    for s in range(0, pos.num_positions, batch):
        yield positions_batch(pos, np.arange(s, min(s + batch, pos.num_positions)), batch, soft)


def read_chat_jsonl(path: str, field: str = "messages") -> Iterable[Tuple[str, list]]:
    """(id, messages) from a JSONL file whose lines hold a list of {"role", "content"} in `field`.
    Raises `medusa_jax.train.distill.EvalSetError` for an evaluation set (MT-Bench, Spec-Bench)."""

    check_not_eval_set(path)
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                rec = json.loads(line)
                yield str(rec.get("id", i)), rec[field]
