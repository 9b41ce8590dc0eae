"""Token choice from logits: greedy, temperature and nucleus (top-p) sampling."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
    """Pick one token per row.

    Args:
      logits: [B, V] float32.
      key: a PRNG key (ignored when temperature == 0).
      temperature: 0 (a Python float, static) means greedy argmax; > 0 scales the logits.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    Returns:
      [B] int32 token ids.
    """
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # smallest set whose mass reaches top_p: keep tokens whose preceding mass is < top_p
        keep_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
