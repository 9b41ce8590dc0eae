"""Reuse of a conversation's KV cache across its turns: an LRU of finished requests' caches, looked
up by the longest common prefix of token ids.

Medusa and Hydra heads keep no draft cache of their own: everything a request needs at position t
is the backbone's K/V of the tokens before t, which depend on those tokens only. So a new request
whose prompt begins with the tokens an earlier request's cache holds (the next turn of the same
conversation: the earlier prompt, its answer, then the new user message) may start from that cache
and prefill only the rest, with the same tokens as a full prefill up to float32 round-off. Any
prefix of an entry is usable (K/V at position t does not depend on later tokens), so two
conversations that share a system prompt share its cache too, and a re-tokenised answer that
differs from the generated ids still reuses everything before the first difference.
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.models.kv_cache import KVCache


class PrefixEntry:
    """One finished request's cache: ``tokens`` [n] int (the ids whose K/V are held), ``k`` and
    ``v`` [L, KVH, n_slots, Dh] (``n_slots`` >= n, a power of two: few compiled shapes), bytes."""

    def __init__(self, tokens: np.ndarray, k: jax.Array, v: jax.Array):
        self.tokens = tokens
        self.k, self.v = k, v
        self.nbytes = int(k.nbytes + v.nbytes)


def _slots(n: int) -> int:
    size = 32
    while size < n:
        size *= 2
    return size


@functools.partial(jax.jit, static_argnums=3)
def _row_slots(k: jax.Array, v: jax.Array, b: jax.Array, slots: int) -> Tuple[jax.Array, jax.Array]:
    return k[:, b, :, :slots], v[:, b, :, :slots]


def snapshot(cache: KVCache, b: int, n: int) -> Tuple[jax.Array, jax.Array]:
    """Row `b`'s K/V of its first `n` slots, copied out of the batch cache ([L, KVH, slots, Dh] each,
    slots = the power of two >= n, capped at the cache's size)."""
    return _row_slots(cache.k, cache.v, jnp.int32(b), min(_slots(n), cache.size))


class PrefixCache:
    """An LRU of `PrefixEntry` within a byte budget; `add` and `lookup` may be called from several
    threads (the engine's, and a scoring's: `Engine.prompt_logprobs`).

    Args:
      budget_bytes: the most bytes of K/V kept (0: off). The oldest entries go first.
      min_tokens: a match shorter than this is not worth reusing (the prefill of a few tokens is
        cheaper than the copy).
    """

    def __init__(self, budget_bytes: int, min_tokens: int = 16):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.min_tokens = int(min_tokens)
        self.entries: "OrderedDict[int, PrefixEntry]" = OrderedDict()
        self.bytes = 0
        self._next = 0
        self.hits = self.misses = self.reused_tokens = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def add(self, tokens, k: jax.Array, v: jax.Array) -> None:
        """Keep a finished request's K/V of `tokens` [n] (the ids in its cache's first n slots)."""
        if not self.enabled:
            return
        entry = PrefixEntry(np.asarray(tokens, np.int64), k, v)
        if entry.nbytes > self.budget:
            return
        with self._lock:
            self.entries[self._next] = entry
            self._next += 1
            self.bytes += entry.nbytes
            while self.bytes > self.budget:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.nbytes

    def lookup(self, prompt, max_slots: Optional[int] = None) -> Tuple[int, Optional[PrefixEntry]]:
        """(n, entry): the entry sharing the longest common prefix with `prompt` (the most recent of
        equals), and how many of its tokens to reuse (at most ``len(prompt) - 1``: the last prompt
        token is always prefilled, for its logits), or (0, None) when no entry shares at least
        ``min_tokens``. Entries of more than `max_slots` slots (a cache they cannot be copied into)
        are passed over. The entry becomes the most recently used."""
        with self._lock:
            return self._lookup(prompt, max_slots)

    def _lookup(self, prompt, max_slots: Optional[int]) -> Tuple[int, Optional[PrefixEntry]]:
        if not self.entries:
            self.misses += 1
            return 0, None
        p = np.asarray(prompt, np.int64)
        best, best_id = 0, None
        for eid, e in self.entries.items():  # oldest first: a later equal match replaces an earlier one
            m = min(len(e.tokens), len(p) - 1)
            if m < best or m == 0 or (max_slots is not None and e.k.shape[2] > max_slots):
                continue
            diff = np.nonzero(e.tokens[:m] != p[:m])[0]
            n = int(diff[0]) if diff.size else m
            if n >= best and n:
                best, best_id = n, eid
        if best_id is None or best < self.min_tokens:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(best_id)
        self.hits += 1
        self.reused_tokens += best
        return best, self.entries[best_id]

    def prefix_for(self, prompt, max_slots: int):
        """What `prefill.PrefillJob` takes as its ``prefix`` for `prompt` [n] in a cache of `max_slots`
        slots: (k, v [L, KVH, slots, Dh], tokens [slots] int32, m) from the entry `lookup` finds (its
        first m tokens are `prompt`'s), or None (the cache is off, or no entry shares ``min_tokens``)."""
        if not self.enabled:
            return None
        n, entry = self.lookup(prompt, max_slots=max_slots)
        if entry is None:
            return None
        slots = entry.k.shape[2]
        tokens = np.zeros((slots,), np.int32)
        tokens[:len(entry.tokens)] = entry.tokens[:slots]
        return entry.k, entry.v, jnp.asarray(tokens), n


@jax.jit
def load_prefix(cache: KVCache, k: jax.Array, v: jax.Array, tokens: jax.Array, n: jax.Array) -> KVCache:
    """A B = 1 `cache` holding an entry's K/V in its first slots (k, v [L, KVH, slots, Dh], tokens
    [slots] int32) and the length n (the slots reused; the later ones are overwritten by the
    prefill). Requires slots <= the cache's size."""
    slots = k.shape[2]
    return KVCache(k=cache.k.at[:, 0, :, :slots].set(k.astype(cache.k.dtype)),
                   v=cache.v.at[:, 0, :, :slots].set(v.astype(cache.v.dtype)),
                   lengths=jnp.reshape(n, (1,)).astype(jnp.int32),
                   tokens=cache.tokens.at[0, :slots].set(tokens))
