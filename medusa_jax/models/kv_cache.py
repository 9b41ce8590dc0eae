"""The KV cache: an explicit pytree that goes into and comes out of every forward call.

Layout: ``k, v: [L, B, KVH, S, Dh]`` in the compute dtype, ``tokens: [B, S] int32`` (the token
whose K/V sit in each slot: prompt lookup drafts from it, `medusa_jax.decoding.lookup`), ``lengths: [B] int32``. (The starting
design had ``[L, B, S, KVH, Dh]``; with the slots next to the head dimension, a layer's keys and
values are the ``[B, KVH, S, Dh]`` operands attention's products read, with no transposed copy of
the cache per layer and step: that copy was ~10% of a plain decoding step on this project's CPU at
256 slots, and grew with the cache; docs/performance.md.)
Row ``b`` holds valid entries at cache indices ``[0, lengths[b])``; index equals token position,
which Medusa's in-place compaction (`medusa_jax.decoding.step`) keeps true after every step.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from medusa_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Static-size KV cache. k, v: [L, B, KVH, S, Dh]; tokens: [B, S] int32, the token id in each
    slot (written with its K/V, moved with them by the tree's compaction); lengths: [B] int32 (valid
    entries per row)."""
    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    tokens: jax.Array

    @property
    def size(self) -> int:
        """S, the static number of slots per row."""
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `size` slots per row (all lengths 0).

    Args:
      cfg: the backbone's config (layers, KV heads, head_dim).
      batch: B.
      size: S, slots per row; a call of T tokens needs lengths + T <= S.
      dtype: storage dtype of k and v.
    """
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, size, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32), tokens=jnp.zeros((batch, size), jnp.int32))


def grow_cache(cache: KVCache, size: int) -> KVCache:
    """The same cache with `size` slots per row (new slots are zeros; lengths unchanged).

    Decoding starts with a cache just big enough for the prompt and grows it in power-of-two
    steps (`medusa_jax.engine.generate.generate_device`), because attention reads every slot of the
    cache each step: on this project's 2-core CPU a 1,024-slot cache made a step ~25% slower than a
    256-slot one (docs/design-notes.md).
    Raises ValueError if `size` is smaller than the current size.
    """
    if size < cache.size:
        raise ValueError(f"cannot shrink a KV cache from {cache.size} to {size} slots")
    if size == cache.size:
        return cache
    pad = ((0, 0), (0, 0), (0, 0), (0, size - cache.size), (0, 0))
    return KVCache(k=jnp.pad(cache.k, pad), v=jnp.pad(cache.v, pad), lengths=cache.lengths,
                   tokens=jnp.pad(cache.tokens, ((0, 0), (0, size - cache.size))))
