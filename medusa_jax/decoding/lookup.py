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


class PromptLookup(NamedTuple):
    """Static prompt-lookup settings (hashable: part of a tree, a jit static argument).

    num_tokens: k, tokens copied per draft (the chain verified has k + 1 tokens with the root).
    max_ngram / min_ngram: the n-gram sizes tried, longest first; the first size that occurred
      earlier in the context wins, at its latest occurrence. Spec-Bench with SmolLM2-135M
      (docs/performance.md): min_ngram 1 drafts more often and accepts less per draft.
    """
    num_tokens: int = 3
    max_ngram: int = 3
    min_ngram: int = 2

    def check(self) -> "PromptLookup":
        """Raise ValueError for settings that cannot draft; return self."""
        if self.num_tokens < 1:
            raise ValueError(f"prompt lookup copies num_tokens >= 1 tokens, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram} and "
                             f"{self.max_ngram}")
        return self


def ngram_draft(tokens: jax.Array, lengths: jax.Array, root: jax.Array,
                lookup: PromptLookup) -> Tuple[jax.Array, jax.Array]:
    """The prompt-lookup draft after each row's root token.

    The context of row b is ``tokens[b, :lengths[b]]`` followed by ``root[b]`` (at index
    ``L = lengths[b]``). For n from ``max_ngram`` down to ``min_ngram``, the last n context tokens
    are searched for among the earlier n-grams (those ending before L); the first n with a match
    takes its latest occurrence, ending at e, and the draft is the k tokens after it,
    ``context[e + 1 .. e + k]``. Where those run past L, the draft repeats the span with period
    ``L - e`` (a loop goes on looping).

    Args:
      tokens: [B, S] int32 token ids in cache slot order (`KVCache.tokens`); slots at and past a
        row's length are ignored.
      lengths: [B] int32, tokens in the cache (< S).
      root: [B] int32, the token decoded next (it will sit at slot ``lengths``).
      lookup: the settings (static).
    Returns:
      (draft [B, k] int32, found [B] bool: whether the row's n-gram occurred earlier; where False
      the draft is filler: it is verified like any draft and only lowers acceptance).
    """
    B, S = tokens.shape
    pos = jnp.arange(S, dtype=jnp.int32)[None, :]                                   # [1, S]
    L = lengths.astype(jnp.int32)[:, None]                                          # [B, 1]
    ctx = jnp.where(pos == L, root.astype(jnp.int32)[:, None], tokens)
    end = jnp.full((B,), -1, jnp.int32)
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        hit = (pos >= n - 1) & (pos < L)        # an earlier n-gram, ending at e < L (so L >= n: one at L too)
        for j in range(n):
            earlier = jnp.pad(ctx, ((0, 0), (j, 0)))[:, :S]                          # ctx[e - j]
            last = jnp.take_along_axis(ctx, jnp.maximum(L - j, 0), axis=1)          # ctx[L - j]
            hit = hit & (earlier == last)
        latest = jnp.max(jnp.where(hit, pos, -1), axis=1)
        end = jnp.where(end < 0, latest, end)
    found = end >= 0
    e = jnp.maximum(end, 0)[:, None]
    idx = e + 1 + jnp.arange(lookup.num_tokens, dtype=jnp.int32)[None, :]            # [B, k]
    period = jnp.maximum(L - e, 1)
    over = idx - L
    idx = jnp.where(over > 0, idx - period * ((over + period - 1) // period), idx)
    return jnp.take_along_axis(ctx, jnp.clip(idx, 0, S - 1), axis=1), found
