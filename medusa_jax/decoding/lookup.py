"""Prompt lookup's settings (`PromptLookup`, part of a tree); the search itself is
`medusa_jax.drafts.lookup`.

Prompt lookup: draft the next tokens by copying what followed the latest earlier occurrence of
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

from typing import NamedTuple


#: The most tokens prompt lookup copies per draft: a copied chain is accepted token by token, so
#: its tail past a few dozen tokens is almost never reached, while the step verifies all of it.
MAX_LOOKUP_TOKENS = 64


class PromptLookup(NamedTuple):
    """Static prompt-lookup settings (hashable: part of a tree, a jit static argument).

    num_tokens: k, tokens copied per draft (the chain verified has k + 1 tokens with the root).
    max_ngram / min_ngram: the n-gram sizes tried, longest first; the first size that occurred
      earlier in the context wins, at its latest occurrence. Spec-Bench with SmolLM2-135M
      (docs/performance.md): min_ngram 1 drafts more often and accepts less per draft.
    matches: how many occurrences of that n-gram are copied, the latest first (`drafts.lookup.ngram_drafts`):
      several chains, as llama.cpp's and SGLang's n-gram drafters offer, compete for a dynamic
      tree's budget (`drafts.dynamic.add_chain_tokens`); a static tree verifies one (matches 1).
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
