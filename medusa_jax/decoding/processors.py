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

from typing import Callable, Mapping, NamedTuple, Optional, Sequence

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
    """
    bias: Optional[jax.Array] = None
    penalties: Optional[jax.Array] = None
    prompt_len: Optional[jax.Array] = None
    min_p: Optional[jax.Array] = None
    min_tokens: Optional[jax.Array] = None
    stop_ids: Optional[jax.Array] = None

    @property
    def used(self) -> tuple:
        """Which fields are set (static: part of a compiled step's key)."""
        return tuple(f is not None for f in self)


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
              emitted: Optional[jax.Array] = None) -> jax.Array:
    """`logits` [B, ..., V] float32 as the rows' tokens are chosen from them: bias, the stop ids
    while fewer than min_tokens output tokens come before (`emitted`: [B, ...] int32, those before
    each token), penalties (with `counts` shaped like `logits` and `in_prompt` [B, V], from
    `context_counts` / `path_counts`), min_p at the rows' `temperature` [B]; the logits themselves
    when `procs` is None."""
    if procs is None:
        return logits
    rows = lambda a: a.reshape(a.shape[:1] + (1,) * (logits.ndim - 2) + a.shape[1:])  # noqa: E731 [B, V] -> [B, ..., V]
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
    counts = in_prompt = emitted = None
    c = state.cache
    if procs is not None and procs.penalties is not None:
        counts, in_prompt = context_counts(c.tokens, c.lengths, procs.prompt_len, state.logits.shape[-1])
        if tree_logits is not None:
            counts = path_counts(counts, tree.ancestor_mask, tree_tokens)
    if procs is not None and procs.min_tokens is not None:
        emitted = c.lengths - procs.prompt_len  # before the root
        if tree_logits is not None:
            emitted = emitted[:, None] + tree.depth + 1  # before a node's children
    logits = state.logits if tree_logits is None else tree_logits
    return processed(procs, logits, state.temperature, counts, in_prompt, emitted)


def draft_adjuster(procs: Optional[LogitsProcessors], state) -> Optional[Callable]:
    """The rows' bias and penalties (from the context's counts, not the tree paths') as a change to
    the heads' logits, `heads.topk.states_topk`'s ``adjust``: ``adjust(logits [J, B, ..., N], ids [N]
    or None) -> logits``, so that the heads draft what the processed target would choose (a draft
    only affects speed; verification judges it against the exact processed logits). None when no
    row has a bias or a penalty."""
    if procs is None or (procs.bias is None and procs.penalties is None):
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
        return jnp.moveaxis(out, 0, 1)

    return adjust


def changes_logits(request) -> bool:
    """Whether a `decoding.requests.Request` asks for a logit bias, a penalty, (sampled) min_p or
    min_tokens."""
    s = request.sampling
    return bool(request.logit_bias) or (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) != (
        0.0, 0.0, 1.0) or (s.min_p > 0 and s.temperature > 0) or request.min_tokens > 0


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
    if penalties is not None or min_tokens is not None:
        prompt_len = np.asarray([len(r.prompt) if r is not None else 0 for r in rows], np.int32)
    procs = LogitsProcessors(bias, penalties, prompt_len, min_p, min_tokens, stop_ids)
    return procs if any(procs.used) else None


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
