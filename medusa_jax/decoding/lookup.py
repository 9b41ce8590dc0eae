"""Prompt lookup: draft the next tokens by copying what followed the latest earlier occurrence of
the context's last n-gram (Saxena 2023, "Prompt Lookup Decoding"; the PLD baseline of Spec-Bench,
Xia et al. 2024). Summaries, answers about a document, translations and code edits repeat long
spans of their context, which the heads (trained on what the model tends to say next) do not know.

A tree that carries a `PromptLookup` (`medusa_jax.decoding.tree.with_lookup`) makes each decoding step
choose its draft: when the context's last n-gram (ending with the step's root token) occurred
before, the step verifies the ``num_tokens`` tokens that followed it, as a chain; otherwise the
heads' tree. Verification is the same as for the heads' candidates, so greedy output stays
identical to plain greedy and exact acceptance still samples the model's own distribution (a
copied token is one more deterministic draft). The search runs on the device, inside the jitted
step, over the token ids the KV cache keeps (`KVCache.tokens`).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp


#: The most tokens prompt lookup copies per draft: a copied chain is accepted token by token, so
#: its tail past a few dozen tokens is almost never reached, while the step verifies all of it.
MAX_LOOKUP_TOKENS = 64


class PromptLookup(NamedTuple):
    """Static prompt-lookup settings (hashable: part of a tree, a jit static argument).

    num_tokens: k, tokens copied per draft (the chain verified has k + 1 tokens with the root).
    max_ngram / min_ngram: the n-gram sizes tried, longest first; the first size that occurred
      earlier in the context wins, at its latest occurrence. Spec-Bench with SmolLM2-135M
      (docs/performance.md): min_ngram 1 drafts more often and accepts less per draft.
    matches: how many occurrences of that n-gram are copied, the latest first (`ngram_drafts`):
      several chains, as llama.cpp's and SGLang's n-gram drafters offer, compete for a dynamic
      tree's budget (`decoding.dynamic.add_chain_tokens`); a static tree verifies one (matches 1).
    """
    num_tokens: int = 3
    max_ngram: int = 3
    min_ngram: int = 2
    matches: int = 1

    def check(self) -> "PromptLookup":
        """Raise ValueError for settings that cannot draft; return self."""
        if not 1 <= self.num_tokens <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"prompt lookup copies 1 to {MAX_LOOKUP_TOKENS} tokens (num_tokens), got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram} and "
                             f"{self.max_ngram}")
        if self.matches < 1:
            raise ValueError(f"prompt lookup copies matches >= 1 occurrences, got {self.matches}")
        return self


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
