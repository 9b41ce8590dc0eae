"""Token choice from logits: greedy, or temperature, top-k and nucleus (top-p) sampling by the
Gumbel-max trick with noise fixed per row and position.

The noise that chooses the token at absolute position t of a row comes from that row's key
(``[B, 2]`` uint32, `row_keys`, from the request's seed) folded with t (`position_keys`), never
from a key that advances step by step. So the token at every position is a fixed function of the
seed and the tokens before it: a row's sampled answer does not depend on the other rows of its
batch, on the tree that verified it, or on how many tokens each step accepted. Speculative decoding
with this coupling is exact in the strongest sense: Medusa sampling emits token for token what plain
sampling with the same seed emits (a candidate is accepted when it is the token that position's
key chooses, which happens with the candidate's own probability: the acceptance rate of
speculative sampling with a deterministic draft, Chen et al. 2023, Alg. 2), and the output follows
the model's distribution exactly (tests/test_exact_sampling.py). Several candidates per node
(siblings) accept together with their summed probability, as sequential rejection over the tree does
(Miao et al. 2024, "SpecInfer", Sec. 4.3). The choice is an argmax over the logits plus noise
(`gumbel_choice`, in two levels of 192 + 256 draws), so the float round-off by which one forward's
logits differ from another's (batch shapes, tree against plain steps) changes a sampled token as
rarely as it changes a greedy one (session 38; the inverse CDF used before changed about one sampled
token in a hundred under such round-off, so a seeded answer could change with the load).
"""
from __future__ import annotations

from typing import List, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels

SEED_LIMIT = 2 ** 31
"""Seeds are in [0, SEED_LIMIT)."""

#: Vocabulary entries per block of `gumbel_choice`'s two levels.
CHOICE_BLOCK = 256


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


def check_top_k(top_k) -> None:
    """Raise ValueError unless `top_k` is an int in [0, 2**31) (0: every token; it is stored as int32)."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 0 <= top_k < 2 ** 31:
        raise ValueError(f"top_k must be an int in [0, 2**31) (0 = every token), got {top_k!r}")


def filtered_logits(logits: jax.Array, temperature, top_p=1.0, nucleus: bool = True, top_k=0) -> jax.Array:
    """The sampling distribution's logits: ``logits / temperature`` with every token outside the
    top-k and the nucleus set to -inf.

    Args:
      logits: [..., V] float.
      temperature: > 0: a float, or an array broadcastable to ``logits.shape[:-1]`` (per row).
      top_p: nucleus mass in (0, 1], a float or an array like `temperature`; 1 keeps every token. The
        nucleus is the smallest set of most likely tokens whose mass reaches top_p (Holtzman et al.
        2020); it always holds the most likely token, however small top_p is.
      nucleus: static; False skips both filters (and their sort over the vocabulary) whatever top_p
        and top_k say: for steps where every row has top_p = 1 and top_k = 0.
      top_k: int >= 0, or an int array like `temperature`: keep the k most likely tokens (0: all;
        tokens tied with the k-th are kept too). As in vLLM and transformers, top-k applies first
        and the nucleus is taken from the top-k tokens' renormalised distribution.
    Returns:
      [..., V] float32; ``softmax`` of it is the distribution a sample is drawn from.
    """
    scaled = logits.astype(jnp.float32) / jnp.expand_dims(jnp.asarray(temperature, jnp.float32), -1)
    use_p = nucleus and not (isinstance(top_p, (int, float)) and top_p >= 1.0)
    use_k = nucleus and not (isinstance(top_k, int) and top_k <= 0)
    if use_p or use_k:
        sorted_logits = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
        first = jnp.arange(sorted_logits.shape[-1]) == 0
        keep_sorted = jnp.ones(sorted_logits.shape, bool)
        if use_k:
            k = jnp.expand_dims(jnp.asarray(top_k, jnp.int32), -1)
            keep_sorted = (jnp.arange(sorted_logits.shape[-1]) < k) | (k <= 0)
            sorted_logits = jnp.where(keep_sorted, sorted_logits, -jnp.inf)
        if use_p:
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            # keep tokens whose preceding mass is < top_p, and always the most likely one (a top_p that
            # underflows to 0 in float32, or that a flush-to-zero CPU reads as 0, must not empty the nucleus)
            keep_sorted &= (jnp.cumsum(probs, axis=-1) - probs) < jnp.expand_dims(jnp.asarray(top_p, jnp.float32), -1)
        keep_sorted = keep_sorted | first
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return scaled


def position_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row and position: ``fold_in(keys[b], positions[b, ...])``.

    Args:
      keys: [B, 2] uint32, one key per row (`row_keys`).
      positions: [B, ...] int32 absolute positions in the row's sequence.
    Returns:
      [B, ..., 2] uint32.
    """
    def row(key, pos):
        return jax.vmap(lambda p: jax.random.fold_in(key, p))(pos.reshape(-1)).reshape(pos.shape + (2,))

    return jax.vmap(row)(keys, positions.astype(jnp.int32))


def gumbel_choice(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """A sample of ``softmax(logits)`` chosen by a key: the Gumbel-max trick in two levels. A block
    of `CHOICE_BLOCK` tokens is the argmax of its log-mass plus Gumbel noise, then a token of that
    block the argmax of its logit plus Gumbel noise (each level's noise from the key folded with 0
    or 1): block b is chosen with probability S_b / S and token i in it with p_i / S_b, so token i
    with p_i / S, exactly, for 448 random numbers per choice (192 blocks of SmolLM's 49,152 tokens)
    where one Gumbel per token would draw the whole vocabulary.

    The choice is an argmax of the logits plus fixed noise, so logits that differ by float round-off
    (another batch shape, a tree step's forward against a plain step's) change it only when its two
    best perturbed scores are that close: a few in 10^5 per token, as near-ties are for greedy. (An
    inverse CDF, one uniform against the cumulative probabilities in vocabulary order, changes its
    choice whenever the uniform lands among the tail's tokens, whose CDF steps are as small as the
    round-off: about one sampled token in a hundred, tests/test_gumbel_choice.py.) A token of
    probability 0 (-inf logit) is never chosen.

    Args:
      logits: [..., V] float32 (-inf allowed, at least one finite).
      keys: [..., 2] uint32 (`position_keys`).
    Returns:
      [...] int32.
    """
    V = logits.shape[-1]
    nb = -(-V // CHOICE_BLOCK)
    pad = nb * CHOICE_BLOCK - V
    x = jnp.pad(logits.astype(jnp.float32), [(0, 0)] * (logits.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    blocks = x.reshape(x.shape[:-1] + (nb, CHOICE_BLOCK))
    top = jnp.max(x, axis=-1, keepdims=True)[..., None]                      # [..., 1, 1]
    log_mass = jnp.log(jnp.sum(jnp.exp(blocks - top), axis=-1))              # [..., nb] (-inf: no mass)
    flat = keys.reshape(-1, 2)
    noise = lambda salt, n: jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, salt), (n,)))(  # noqa: E731
        flat).reshape(keys.shape[:-1] + (n,))
    k = jnp.argmax(log_mass + noise(0, nb), axis=-1)
    within = jnp.take_along_axis(blocks, k[..., None, None], axis=-2)[..., 0, :]  # [..., block]
    j = jnp.argmax(within + noise(1, CHOICE_BLOCK), axis=-1)
    return (k * CHOICE_BLOCK + j).astype(jnp.int32)


def sample_tokens(logits: jax.Array, keys: jax.Array, positions: jax.Array, temperature: jax.Array,
                  top_p: jax.Array, sampled: bool = True, nucleus: bool = True, top_k=0) -> jax.Array:
    """The token each row chooses at `positions` from `logits`: the argmax for a row whose temperature
    is 0 (greedy), else the sample (`gumbel_choice`) of the tempered, top-k- and nucleus-filtered
    distribution (`filtered_logits`) that the position's key (`position_keys`) chooses.

    Args:
      logits: [B, ..., V] float32; keys: [B, 2] uint32; positions: [B, ...] int32, the absolute
        position of the token being chosen.
      temperature, top_p: [B] float32 per row; top_k: [B] int32 per row (0: off), or 0 for every row.
      sampled: static; False: every row is greedy (nothing is drawn, nothing is sorted).
      nucleus: static; False: no row uses top_p < 1 or top_k > 0.
    Returns:
      [B, ...] int32.
    """
    greedy = kernels.argmax(logits)
    if not sampled:
        return greedy
    extra = (1,) * (logits.ndim - 2)
    t = temperature.reshape(temperature.shape + extra)
    top = top_p.reshape(top_p.shape + extra)
    k = top_k if isinstance(top_k, int) else top_k.reshape(top_k.shape + extra)
    scaled = filtered_logits(logits, jnp.where(t > 0, t, 1.0), top, nucleus, k)
    chosen = gumbel_choice(scaled, position_keys(keys, positions))
    return jnp.where(t > 0, chosen, greedy)
