"""Token choice from logits: greedy, temperature and nucleus (top-p) sampling, with per-row PRNG keys.

Every row of a batch draws with its own key (``[B, 2]`` uint32, `row_keys`), so a row's samples do
not depend on which other rows share its batch.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels

SEED_LIMIT = 2 ** 31
"""Seeds are in [0, SEED_LIMIT)."""


def prompt_seed(seed: int, i: int) -> int:
    """The seed of prompt (or row) i of a run seeded `seed`: ``(seed + i) mod 2**31``."""
    return (int(seed) + int(i)) % SEED_LIMIT


def row_seeds(seeds: Union[int, Sequence[int]], batch: int) -> List[int]:
    """One seed per row: ``seeds`` itself (a sequence of `batch` ints), or ``prompt_seed(seed, b)``
    for one int seed.

    Raises ValueError when a sequence of seeds does not have `batch` entries, or a seed is outside
    [0, 2**31).
    """
    if isinstance(seeds, (int, np.integer)):
        if not 0 <= seeds < SEED_LIMIT:
            raise ValueError(f"seeds must be in [0, 2**31), got {seeds}")
        return [prompt_seed(seeds, b) for b in range(batch)]
    out = [int(s) for s in seeds]
    if len(out) != batch:
        raise ValueError(f"got {len(out)} seeds for {batch} rows: give one seed per row, or one int")
    if out and not (0 <= min(out) and max(out) < SEED_LIMIT):
        raise ValueError(f"seeds must be in [0, 2**31), got {min(out)}..{max(out)}")
    return out


def row_keys(seeds: Union[int, Sequence[int]], batch: int) -> jax.Array:
    """Per-row PRNG keys [B, 2] uint32: row b gets ``PRNGKey(row_seeds(seeds, batch)[b])``, so that
    row 0 of any batch draws like a batch of one with the same seed. Raises as `row_seeds`."""
    return jax.vmap(jax.random.PRNGKey)(jnp.asarray(row_seeds(seeds, batch), jnp.int32))


def filtered_logits(logits: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
    """The sampling distribution's logits: ``logits / temperature`` with every token outside the
    nucleus set to -inf.

    Args:
      logits: [..., V] float.
      temperature: > 0 (static).
      top_p: nucleus mass in (0, 1] (static); 1 keeps every token. The nucleus is the smallest set of
        most likely tokens whose mass reaches top_p (Holtzman et al. 2020).
    Returns:
      [..., V] float32; ``softmax`` of it is the distribution a sample is drawn from.
    """
    scaled = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_logits = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep tokens whose preceding mass is < top_p
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return scaled


def categorical_rows(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(logits)``: keys [B, 2] uint32 (one per row), logits [B, V]
    -> [B] int32."""
    return jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys, logits).astype(jnp.int32)


def uniform_rows(keys: jax.Array, n: int) -> jax.Array:
    """[B, n] float32 uniforms in [0, 1), row b from ``keys[b]`` ([B, 2] uint32)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (n,)))(keys)


def split_rows(keys: jax.Array, n: int) -> jax.Array:
    """Each row's key split in n: [B, 2] -> [n, B, 2]."""
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(keys), 0, 1)


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
    """Pick one token per row.

    Args:
      logits: [B, V] float32.
      key: per-row PRNG keys [B, 2] uint32 (`row_keys`), or one key [2] for the whole batch
        (ignored when temperature == 0).
      temperature: 0 (a Python float, static) means greedy argmax; > 0 scales the logits.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it (`filtered_logits`).
    Returns:
      [B] int32 token ids.
    """
    if temperature <= 0.0:
        return kernels.argmax(logits)
    scaled = filtered_logits(logits, temperature, top_p)
    if key.ndim == 2:
        return categorical_rows(key, scaled)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
