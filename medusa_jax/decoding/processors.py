"""Per-request changes to the logits every token is chosen from: OpenAI's ``logit_bias``,
``presence_penalty`` and ``frequency_penalty``, and vLLM's ``repetition_penalty``, ``min_p`` and
``min_tokens`` (`LogitsProcessors`), applied alike to a step's root and to every node of its tree.

The order is vLLM's sampler's (``vllm/v1/sample/sampler.py``): the bias is added to the model's
logits and, before ``min_tokens`` output tokens, the request's stop ids are banned; then the
penalties (``vllm/model_executor/layers/utils.py``, ``apply_penalties``): the repetition penalty
(Keskar et al. 2019, "CTRL", Sec. 4.1) divides a positive logit, and multiplies a negative one, by
r for every token that occurs in the prompt or the output so far; the frequency penalty subtracts
f times the token's count in the output, and the presence penalty p once for a token the output
holds; then temperature, min_p (Nguyen et al. 2024, "min-p sampling": tokens whose probability is
below min_p times the most likely token's are dropped) and top-k/top-p
(`decoding.sampling.filtered_logits`).

Speculation stays exact with penalties because a tree node's counts are its own: the context's
(read from the KV cache's token ids, ``cache.tokens``) plus the tokens on the node's path through
the tree (its ancestors, the root and itself), so each node's logits are those a plain step would
choose from after the same tokens; likewise a node's output length (for ``min_tokens``) is the
row's plus its depth. The heads draft from the model's own logits; the
log-probabilities a request asks for stay the model's own too (vLLM's ``raw_logprobs``).
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np


class LogitsProcessors(NamedTuple):
    """The rows' logits processors for one step (a pytree; a field is None when no row uses it, so
    that a step without it compiles without its work).

    bias: [B, V] float32, each row's ``logit_bias`` as a dense array (0: none).
    penalties: [B, 3] float32, each row's presence penalty, frequency penalty and repetition
      penalty (0, 0, 1: none).
    prompt_len: [B] int32, the row's prompt length: the cache's tokens before it are the prompt,
      those from it on the output (needed with `penalties`).
    min_p: [B] float32 in [0, 1] (0: off; a greedy row ignores it).
    min_tokens: [B] int32, the row's ``min_tokens`` (needs `prompt_len`); stop_ids: [B, V] bool,
      the row's stop ids, banned while its output is shorter than min_tokens.
    banned: [B, V] bool, tokens the row may never choose (vLLM's ``allowed_token_ids``: every
      other token; its one-token ``bad_words``).
    bad_words: [B, W, n + 1] int32, the row's bad words of 2 to n + 1 tokens (needs `prompt_len`):
      column 0 the word's last token, banned right after the word's other tokens; column k >= 1
      the k-th token before it (-1: the word is shorter); a padding word has -1 in column 0.
    """
    bias: Optional[jax.Array] = None
    penalties: Optional[jax.Array] = None
    prompt_len: Optional[jax.Array] = None
    min_p: Optional[jax.Array] = None
    min_tokens: Optional[jax.Array] = None
    stop_ids: Optional[jax.Array] = None
    banned: Optional[jax.Array] = None
    bad_words: Optional[jax.Array] = None

    @property
    def used(self) -> tuple:
        """Which fields are set, and the bad words' (padded) shape (static: part of a compiled step's key)."""
        return tuple(f is not None for f in self) + (None if self.bad_words is None else self.bad_words.shape[1:],)


def context_counts(tokens: jax.Array, lengths: jax.Array, prompt_len: jax.Array, vocab_size: int):
    """How often each token occurs in each row's output so far, and whether it occurs in its prompt.

    Args:
      tokens: [B, S] int32, the cache's token ids (``KVCache.tokens``); lengths: [B] int32, the
        row's tokens in the cache; prompt_len: [B] int32 (positions below it are the prompt).
    Returns:
      (counts [B, V] float32 over positions [prompt_len, lengths), in_prompt [B, V] bool).
    """
    B, S = tokens.shape
    pos = jnp.arange(S, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
    out = ((pos >= prompt_len[:, None]) & (pos < lengths[:, None])).astype(jnp.float32)
    counts = jnp.zeros((B, vocab_size), jnp.float32).at[rows, tokens].add(out, mode="drop")
    prompt = (pos < prompt_len[:, None]).astype(jnp.int32)
    in_prompt = jnp.zeros((B, vocab_size), jnp.int32).at[rows, tokens].max(prompt, mode="drop") > 0
    return counts, in_prompt


def path_counts(counts: jax.Array, ancestor_mask: jax.Array, tree_tokens: jax.Array) -> jax.Array:
    """[B, T, V] float32: the output counts after each tree node, `counts` ([B, V]) plus the
    tokens on the node's path (``ancestor_mask`` [B, T, T], ``ancestor_mask[b, t, a]``: a is t or
    an ancestor of it; `tree_tokens` [B, T] int32)."""
    B, T = tree_tokens.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, T))
    nodes = jnp.broadcast_to(jnp.arange(T)[None, :, None], (B, T, T))
    toks = jnp.broadcast_to(tree_tokens[:, None, :], (B, T, T))
    base = jnp.broadcast_to(counts[:, None, :], (B, T, counts.shape[-1]))
    return base.at[rows, nodes, toks].add(ancestor_mask.astype(jnp.float32), mode="drop")


def recent_tokens(tokens: jax.Array, lengths: jax.Array, prompt_len: jax.Array, n: int,
                  tree_tokens: Optional[jax.Array] = None, tree=None) -> Tuple[jax.Array, jax.Array]:
    """The last `n` output tokens before each choice: the root's ([B, n], from the cache: `tokens`
    [B, S] int32, `lengths` and `prompt_len` [B] int32) or, with `tree_tokens` [B, T] and the rows'
    `tree` (``ancestor_mask`` [B, T, T], ``depth`` [B, T]), before each node's children ([B, T, n]:
    the node's path, root and itself included, then the cache). Column k - 1 holds the k-th token
    from the end. Returns (ids int32, whether each is an output token: bool, False past the
    prompt's end or before the cache's start)."""
    k = jnp.arange(1, n + 1, dtype=jnp.int32)
    if tree_tokens is None:
        at = lengths[:, None] - k[None, :]                                                    # [B, n]
        ids = jnp.take_along_axis(tokens, jnp.clip(at, 0, tokens.shape[1] - 1), axis=1)
        return ids, at >= prompt_len[:, None]
    depth = tree.depth                                                                        # [B, T]
    back = k[None, None, :] - depth[:, :, None] - 1                                           # [B, T, n]
    at = lengths[:, None, None] - back                       # the cache's slot, where the path is too short
    B, T = tree_tokens.shape
    cached = jnp.take_along_axis(tokens, jnp.clip(at, 0, tokens.shape[1] - 1).reshape(B, -1), axis=1).reshape(at.shape)
    # on the path: the ancestor a of node t at depth depth[t] + 1 - k
    want = depth[:, :, None] + 1 - k[None, None, :]                                           # [B, T, n]
    is_anc = tree.ancestor_mask[:, :, None, :] & (depth[:, None, None, :] == want[..., None])  # [B, T, n, T]
    on_path = jnp.sum(jnp.where(is_anc, tree_tokens[:, None, None, :], 0), axis=-1)
    ids = jnp.where(back <= 0, on_path, cached)
    return ids, (back <= 0) | (at >= prompt_len[:, None, None])


def bad_words_banned(logits: jax.Array, bad_words: jax.Array, recent: jax.Array, recent_ok: jax.Array) -> jax.Array:
    """`logits` [B, ..., V] with each bad word's last token at -inf where the tokens before the choice
    (`recent` [B, ..., n] int32 and `recent_ok`: `recent_tokens`) end with the word's other tokens
    (all of them output tokens, as vLLM's ``apply_bad_words`` looks only at the output).
    `bad_words`: [B, W, n + 1] int32 (`LogitsProcessors.bad_words`)."""
    B, W = bad_words.shape[:2]
    extra = logits.ndim - 2
    need = bad_words[:, :, 1:].reshape((B,) + (1,) * extra + (W, -1))                        # [B, ..., W, n]
    ok = (need < 0) | ((recent[..., None, :] == need) & recent_ok[..., None, :])
    hit = jnp.all(ok, axis=-1) & (bad_words[:, :, 0] >= 0).reshape((B,) + (1,) * extra + (W,))
    target = jnp.broadcast_to(bad_words[:, :, 0].reshape((B,) + (1,) * extra + (W,)), hit.shape)
    flat = hit.reshape(-1, W)
    ban = jnp.zeros((flat.shape[0], logits.shape[-1]), bool).at[
        jnp.arange(flat.shape[0])[:, None], target.reshape(-1, W)].max(flat, mode="drop")
    return jnp.where(ban.reshape(logits.shape), -jnp.inf, logits)


def penalized(logits: jax.Array, penalties: jax.Array, counts: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """vLLM's ``apply_penalties`` on `logits` [B, ..., V] float32 with the rows' `penalties` [B, 3]
    (presence, frequency, repetition), the output `counts` (same shape as `logits`) and
    `in_prompt` [B, V] bool."""
    extra = (1,) * (logits.ndim - 1)
    presence, frequency, repetition = (penalties[:, i].reshape((-1,) + extra) for i in range(3))
    seen = (counts > 0) | in_prompt.reshape(in_prompt.shape[:1] + (1,) * (logits.ndim - 2) + in_prompt.shape[1:])
    r = jnp.where(seen, repetition, 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    return logits - frequency * counts - presence * (counts > 0)


def min_p_filtered(logits: jax.Array, min_p: jax.Array, temperature: jax.Array) -> jax.Array:
    """`logits` [B, ..., V] with every token whose tempered probability is below ``min_p`` times the
    most likely token's set to -inf (rows at temperature 0 or min_p 0 unchanged): ``p / p_max <
    min_p`` is ``logit < max_logit + temperature * log(min_p)``. min_p, temperature: [B] float32."""
    extra = (1,) * (logits.ndim - 1)
    m, t = min_p.reshape((-1,) + extra), temperature.reshape((-1,) + extra)
    on = (m > 0) & (t > 0)
    cut = jnp.max(logits, axis=-1, keepdims=True) + t * jnp.log(jnp.where(on, m, 1.0))
    return jnp.where(on & (logits < cut), -jnp.inf, logits)


def processed(procs: Optional[LogitsProcessors], logits: jax.Array, temperature: jax.Array,
              counts: Optional[jax.Array] = None, in_prompt: Optional[jax.Array] = None,
              emitted: Optional[jax.Array] = None, recent: Optional[Tuple[jax.Array, jax.Array]] = None) -> jax.Array:
    """`logits` [B, ..., V] float32 as the rows' tokens are chosen from them: the banned tokens and
    the bad words (with `recent`, `recent_tokens`' pair), bias, the stop ids while fewer than
    min_tokens output tokens come before (`emitted`: [B, ...] int32, those before each token),
    penalties (with `counts` shaped like `logits` and `in_prompt` [B, V], from `context_counts` /
    `path_counts`), min_p at the rows' `temperature` [B]; the logits themselves when `procs` is None."""
    if procs is None:
        return logits
    rows = lambda a: a.reshape(a.shape[:1] + (1,) * (logits.ndim - 2) + a.shape[1:])  # noqa: E731 [B, V] -> [B, ..., V]
    if procs.banned is not None:
        logits = jnp.where(rows(procs.banned), -jnp.inf, logits)
    if procs.bad_words is not None:
        logits = bad_words_banned(logits, procs.bad_words, *recent)
    if procs.bias is not None:
        logits = logits + rows(procs.bias)
    if procs.min_tokens is not None:
        early = emitted < procs.min_tokens.reshape((-1,) + (1,) * (emitted.ndim - 1))
        logits = jnp.where(rows(procs.stop_ids) & early[..., None], -jnp.inf, logits)
    if procs.penalties is not None:
        logits = penalized(logits, procs.penalties, counts, in_prompt)
    if procs.min_p is not None:
        logits = min_p_filtered(logits, procs.min_p, temperature)
    return logits


def step_logits(procs: Optional[LogitsProcessors], state, tree_logits: Optional[jax.Array] = None,
                tree_tokens: Optional[jax.Array] = None, tree=None) -> jax.Array:
    """The logits a step chooses from, processed (`processed`): the root's ([B, V], from
    ``state.logits``) when `tree_logits` is None, else the tree nodes' ([B, T, V] `tree_logits`,
    for their children; each node's counts include its path and its output length its depth:
    `tree_tokens` [B, T], `tree` the rows' `TreeArrays`, ``ancestor_mask`` [B, T, T] and
    ``depth`` [B, T]). `state`: the step's `DecodeState`, before the tree forward (its cache holds
    the context)."""
    counts = in_prompt = emitted = recent = None
    c = state.cache
    if procs is not None and procs.penalties is not None:
        counts, in_prompt = context_counts(c.tokens, c.lengths, procs.prompt_len, state.logits.shape[-1])
        if tree_logits is not None:
            counts = path_counts(counts, tree.ancestor_mask, tree_tokens)
    if procs is not None and procs.min_tokens is not None:
        emitted = c.lengths - procs.prompt_len  # before the root
        if tree_logits is not None:
            emitted = emitted[:, None] + tree.depth + 1  # before a node's children
    if procs is not None and procs.bad_words is not None:
        recent = recent_tokens(c.tokens, c.lengths, procs.prompt_len, procs.bad_words.shape[-1] - 1,
                               tree_tokens, tree)
    logits = state.logits if tree_logits is None else tree_logits
    return processed(procs, logits, state.temperature, counts, in_prompt, emitted, recent)


#: A banned token's logit in the heads' drafts: far below any other, yet finite (the target's is -inf).
DRAFT_BANNED = -1e30


def draft_adjuster(procs: Optional[LogitsProcessors], state) -> Optional[Callable]:
    """The rows' banned tokens, bias and penalties (from the context's counts, not the tree paths';
    not the bad words of several tokens) as a change to
    the heads' logits, `heads.topk.states_topk`'s ``adjust``: ``adjust(logits [J, B, ..., N], ids [N]
    or None) -> logits``, so that the heads draft what the processed target would choose (a draft
    only affects speed; verification judges it against the exact processed logits). None when no
    row has a bias, a penalty or a banned token."""
    if procs is None or (procs.bias is None and procs.penalties is None and procs.banned is None):
        return None
    counts = in_prompt = None
    if procs.penalties is not None:
        c = state.cache
        counts, in_prompt = context_counts(c.tokens, c.lengths, procs.prompt_len, state.logits.shape[-1])
    draft = LogitsProcessors(bias=procs.bias, penalties=procs.penalties)

    def adjust(logits, ids):
        cols = (lambda a: a) if ids is None else (lambda a: a[:, ids])  # noqa: E731 [B, V] -> [B, N]
        x = jnp.moveaxis(logits, 1, 0)                                   # [B, J, ..., N]
        shape = x.shape[:1] + (1,) * (x.ndim - 2) + x.shape[-1:]
        p = draft._replace(bias=None if draft.bias is None else cols(draft.bias))
        out = processed(p, x, state.temperature, None if counts is None else cols(counts).reshape(shape),
                        None if in_prompt is None else cols(in_prompt))
        if procs.banned is not None:  # finite, so that the heads' scores stay numbers when all they propose is banned
            out = jnp.where(cols(procs.banned).reshape(shape), DRAFT_BANNED, out)
        return jnp.moveaxis(out, 0, 1)

    return adjust


def changes_logits(request) -> bool:
    """Whether a `decoding.requests.Request` asks for a logit bias, a penalty, (sampled) min_p,
    min_tokens, allowed token ids or bad words."""
    s = request.sampling
    return bool(request.logit_bias) or (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) != (
        0.0, 0.0, 1.0) or (s.min_p > 0 and s.temperature > 0) or request.min_tokens > 0 or (
        request.allowed_token_ids is not None) or bool(request.bad_words)


def dense_processors(rows: Sequence, vocab_size: int, stops: Sequence = ()) -> Optional[LogitsProcessors]:
    """The `LogitsProcessors` (numpy arrays) of a batch's rows, each a `decoding.requests.Request`
    or None (a free row), with `stops` the rows' stop ids (for min_tokens; None for a free row);
    None when no row changes its logits (the step then compiles without). A field no row uses
    stays None."""
    live = [r for r in rows if r is not None]
    bias = _dense_bias([r and r.logit_bias for r in rows], vocab_size)
    pen = [(r.sampling.presence_penalty, r.sampling.frequency_penalty, r.sampling.repetition_penalty)
           if r is not None else (0.0, 0.0, 1.0) for r in rows]
    penalties = prompt_len = min_p = min_tokens = stop_ids = None
    if any(p != (0.0, 0.0, 1.0) for p in pen):
        penalties = np.asarray(pen, np.float32)
    if any(r.sampling.min_p > 0 and r.sampling.temperature > 0 for r in live):
        min_p = np.asarray([r.sampling.min_p if r is not None else 0.0 for r in rows], np.float32)
    if any(r.min_tokens > 0 for r in live):
        min_tokens = np.asarray([r.min_tokens if r is not None else 0 for r in rows], np.int32)
        stop_ids = np.zeros((len(rows), vocab_size), bool)
        for b, ids in enumerate(stops):
            stop_ids[b, list(ids or ())] = True
    banned, bad_words = _dense_bans(rows, vocab_size)
    if penalties is not None or min_tokens is not None or bad_words is not None:
        prompt_len = np.asarray([len(r.prompt) if r is not None else 0 for r in rows], np.int32)
    procs = LogitsProcessors(bias, penalties, prompt_len, min_p, min_tokens, stop_ids, banned, bad_words)
    return procs if any(procs.used) else None


def _dense_bans(rows: Sequence, vocab_size: int) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """`LogitsProcessors.banned` [B, V] bool (the tokens outside a row's allowed_token_ids, and its
    one-token bad words) and ``bad_words`` [B, W, n + 1] int32 (its longer ones), each None when no
    row has one."""
    banned = None
    longer = [[w for w in (r.bad_words or ()) if len(w) > 1] if r is not None else [] for r in rows]
    for b, r in enumerate(rows):
        if r is None or (r.allowed_token_ids is None and not any(len(w) == 1 for w in r.bad_words or ())):
            continue
        if banned is None:
            banned = np.zeros((len(rows), vocab_size), bool)
        if r.allowed_token_ids is not None:
            banned[b] = True
            banned[b, list(r.allowed_token_ids)] = False
        banned[b, [w[0] for w in r.bad_words or () if len(w) == 1]] = True
    if not any(longer):
        return banned, None
    # padded to powers of two (at least 8 words of 4 tokens), so that few shapes are compiled
    shape = [max(lo, 1 << (n - 1).bit_length()) for lo, n in
             ((8, max(len(ws) for ws in longer)), (4, max(len(w) for ws in longer for w in ws)))]
    words = np.full([len(rows)] + shape, -1, np.int32)
    for b, ws in enumerate(longer):
        for i, w in enumerate(ws):
            words[b, i, :len(w)] = w[::-1]  # the banned token first, then the ones before it, nearest first
    return banned, words


def _dense_bias(biases: Sequence[Optional[Mapping[int, float]]], vocab_size: int) -> Optional[np.ndarray]:
    """[B, V] float32 of the rows' logit biases (token id -> value added to its logit; None or {}:
    none), or None when no row has one."""
    if not any(biases):
        return None
    out = np.zeros((len(biases), vocab_size), np.float32)
    for b, bias in enumerate(biases):
        if bias:
            out[b, list(bias)] = list(bias.values())
    return out
