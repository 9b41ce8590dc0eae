"""What one decoding step hands the next (`DecodeState`) and what it emits (`StepOutput`), and the
sharding constraints that keep both in their layout on a device mesh."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import flax.struct
import jax

from medusa_jax import sharding
from medusa_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class DecodeState:
    """What one step hands the next.

    logits: [B, V] float32, base-model logits at the last accepted position (predict the next token).
    hidden: [B, D], final-norm hidden state there (the heads' input).
    cache: the KV cache; ``cache.lengths[b]`` = tokens of row b in the cache (prompt + emitted).
    key: [B, 2] uint32, one PRNG key per row, from the row's seed (`decoding.sampling.row_keys`); it
      never advances: the token at position t is chosen with the noise of (key, t)
      (`decoding.sampling.position_keys`).
    temperature: [B] float32, the row's sampling temperature (0: greedy).
    top_p: [B] float32, the row's nucleus mass in (0, 1].
    top_k: [B] int32, the row's top-k (0: every token).
    """
    logits: jax.Array
    hidden: jax.Array
    cache: KVCache
    key: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array


class StepOutput(NamedTuple):
    """tokens: [B, D+1] int32, the emitted tokens (root then accepted candidates; entries at and
    beyond ``num_tokens`` are filler; D = the tree's ``max_accepted``). num_tokens: [B] int32 in
    [1, D+1] (tokens per step). logprobs: their `decoding.logprobs.StepLogprobs` ([B, D+1] columns)
    when the step was asked for them, else None."""
    tokens: jax.Array
    num_tokens: jax.Array
    logprobs: Optional[Any] = None


def constrain_cache(cache: KVCache) -> KVCache:
    """Inside jit on a mesh: keep the cache split as `sharding.cache_spec` says and its lengths
    on 'data' (no-op otherwise)."""
    spec = sharding.cache_spec()
    return KVCache(k=sharding.constrain(cache.k, spec), v=sharding.constrain(cache.v, spec),
                   lengths=sharding.constrain(cache.lengths, sharding.batch_spec(1)),
                   tokens=sharding.constrain(cache.tokens, sharding.batch_spec(2)))


def constrain_state(st: DecodeState) -> DecodeState:
    """Inside jit on a mesh: every array of the decoding state split by rows on 'data' and the
    cache as `constrain_cache`, so that a compiled step's output state has its input's layout
    and can be fed back to it (no-op otherwise)."""
    rows = lambda x: sharding.constrain(x, sharding.batch_spec(x.ndim))
    return DecodeState(logits=rows(st.logits), hidden=rows(st.hidden), cache=constrain_cache(st.cache),
                       key=rows(st.key), temperature=rows(st.temperature), top_p=rows(st.top_p),
                       top_k=rows(st.top_k))
