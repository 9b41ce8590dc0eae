"""Prompt lookup drafts (Saxena 2023, "Prompt Lookup Decoding"): the n-gram search over the context
the KV cache keeps (`ngram_drafts`), and `LookupDrafter`, a static heads' tree whose rows verify a
copied chain instead wherever their last n-gram occurred before. Settings: `decoding.lookup.PromptLookup`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import jax
import jax.numpy as jnp

from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.tree import chain_tree
from medusa_jax.decoding.tree_arrays import TreeArrays, padded_arrays
from medusa_jax.drafts.heads import HeadsDrafter


def ngram_draft(tokens: jax.Array, lengths: jax.Array, root: jax.Array,
                lookup: PromptLookup) -> Tuple[jax.Array, jax.Array]:
    """The prompt-lookup draft after each row's root token: `ngram_drafts`' first (latest) match.
    Returns (draft [B, k] int32, found [B] bool)."""
    drafts, found, _ = ngram_drafts(tokens, lengths, root, lookup._replace(matches=1))
    return drafts[:, 0], found[:, 0]


def ngram_drafts(tokens: jax.Array, lengths: jax.Array, root: jax.Array,
                 lookup: PromptLookup) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """The prompt-lookup drafts after each row's root token, one per match, the latest first.

    The context of row b is ``tokens[b, :lengths[b]]`` followed by ``root[b]`` (at index
    ``L = lengths[b]``). For n from ``max_ngram`` down to ``min_ngram``, the last n context tokens
    are searched for among the earlier n-grams (those ending before L); the first n with a match
    takes its ``matches`` latest occurrences, and for each, ending at e, the draft is the k tokens
    after it, ``context[e + 1 .. e + k]``. Where those run past L, the draft repeats the span with
    period ``L - e`` (a loop goes on looping).

    Args:
      tokens: [B, S] int32 token ids in cache slot order (`KVCache.tokens`); slots at and past a
        row's length are ignored.
      lengths: [B] int32, tokens in the cache (< S).
      root: [B] int32, the token decoded next (it will sit at slot ``lengths``).
      lookup: the settings (static); m = ``lookup.matches``.
    Returns:
      (drafts [B, m, k] int32, found [B, m] bool: whether the row's n-gram occurred that many
      times; where False the draft is filler: it is verified like any draft and only lowers
      acceptance; ngram [B] int32: the n of the n-gram that matched, 0 where none did: a longer
      match is a surer copy, and a dynamic tree scores its copies by it,
      `DynamicSpec.lookup_ngram_confidence`).
    """
    B, S = tokens.shape
    m = lookup.matches
    pos = jnp.arange(S, dtype=jnp.int32)[None, :]                                   # [1, S]
    L = lengths.astype(jnp.int32)[:, None]                                          # [B, 1]
    ctx = jnp.where(pos == L, root.astype(jnp.int32)[:, None], tokens)
    ends = jnp.full((B, m), -1, jnp.int32)
    ngram = jnp.zeros((B,), jnp.int32)
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        hit = (pos >= n - 1) & (pos < L)        # an earlier n-gram, ending at e < L (so L >= n: one at L too)
        for j in range(n):
            earlier = jnp.pad(ctx, ((0, 0), (j, 0)))[:, :S]                          # ctx[e - j]
            last = jnp.take_along_axis(ctx, jnp.maximum(L - j, 0), axis=1)          # ctx[L - j]
            hit = hit & (earlier == last)
        latest = jnp.where(hit, pos, -1)
        latest = jnp.max(latest, axis=1, keepdims=True) if m == 1 else jax.lax.top_k(latest, m)[0]
        ngram = jnp.where((ends[:, 0] < 0) & (latest[:, 0] >= 0), n, ngram)
        ends = jnp.where(ends[:, :1] < 0, latest, ends)                              # [B, m]
    found = ends >= 0
    e = jnp.maximum(ends, 0)[:, :, None]                                            # [B, m, 1]
    idx = e + 1 + jnp.arange(lookup.num_tokens, dtype=jnp.int32)[None, None, :]     # [B, m, k]
    period = jnp.maximum(L[:, :, None] - e, 1)
    over = idx - L[:, :, None]
    idx = jnp.where(over > 0, idx - period * ((over + period - 1) // period), idx)
    drafts = jnp.take_along_axis(ctx, jnp.clip(idx, 0, S - 1).reshape(B, -1), axis=1)
    return drafts.reshape(B, m, lookup.num_tokens), found, ngram


@dataclass(frozen=True)
class LookupDrafter(Drafter):
    """Prompt lookup beside a static heads' tree (``tree.lookup`` set, ``tree.dynamic`` None).

    Every row first searches its context for its last n-gram (`ngram_draft`); a row that finds one
    verifies the copied chain (on `decoding.tree.chain_tree`), the others the heads' tree, each row
    choosing for itself (a row's draft, and the random numbers its sampled answer consumes, never
    depend on the other rows). One forward of ``tree.step_size`` tokens whose mask, positions and
    paths are, row by row, one of the two trees' buffers padded to one shape (`padded_arrays`),
    chosen by data, not by a conditional (a `lax.cond` around the forward made XLA copy the KV cache
    every step); the heads run only on the steps where some row uses their tree.
    """

    def propose(self, x: DraftInputs) -> Proposal:
        tree = self.tree
        copied, use = ngram_draft(x.state.cache.tokens, x.state.cache.lengths, x.root, tree.lookup)  # [B, k], [B]
        chain = chain_tree(tree.lookup.num_tokens)
        shape = (tree.step_size, max(tree.num_paths, chain.num_paths), tree.max_accepted)
        B = x.root.shape[0]
        heads = HeadsDrafter(tree)
        heads_rows = jax.tree_util.tree_map(lambda a: a[None], padded_arrays(tree, *shape))
        by_heads = jax.lax.cond(jnp.all(use), lambda _: jnp.zeros((B, tree.size), jnp.int32),
                                lambda _: heads.propose(x).tokens, None)
        pad = lambda t: jnp.pad(t, ((0, 0), (0, shape[0] - t.shape[1])))  # noqa: E731
        tokens = jnp.where(use[:, None], pad(jnp.concatenate([x.root[:, None], copied], axis=1)), pad(by_heads))
        per_row = lambda c, h: jnp.where(use.reshape((B,) + (1,) * c.ndim), c[None], h)  # noqa: E731
        arrays = jax.tree_util.tree_map(per_row, padded_arrays(chain, *shape), heads_rows)
        return Proposal(TreeArrays(*arrays), tokens, heads.compact)
