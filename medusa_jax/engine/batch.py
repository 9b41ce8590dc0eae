"""The engine's batch on the device: one decoding step over the live rows, a prefilled row copied
in, the batch re-laid (rows gathered, cache grown), and an empty batch.
Jitted; the engine compiles
them ahead of time (`decoding.compile.aot`) so that no timing includes a compilation."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from medusa_jax import sharding
from medusa_jax.decoding.processors import LogitsProcessors
from medusa_jax.decoding.state import DecodeState, StepOutput, constrain_state
from medusa_jax.decoding.step import StepConfig, medusa_step
from medusa_jax.engine.loop import put_row
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import KVCache, grow_cache, init_cache
from medusa_jax.models.llama import compute_dtype


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("state",))
def engine_step(config: StepConfig, params, head_params, state: DecodeState,
                live: jax.Array, procs: Optional[LogitsProcessors] = None) -> Tuple[StepOutput, DecodeState]:
    """`medusa_step` over the batch, every row that is not `live` ([B] bool) left at length 0 (a
    free row computes, but never grows out of its cache); `config` (the one static: its ``logprobs``
    None: off, N: the emitted tokens' log-probabilities with N alternatives each) and `procs` (the
    rows' logit bias, penalties and min_p, or None) as there. The state is donated."""
    out, st = medusa_step(config, params, head_params, state, procs)
    lengths = jnp.where(live, st.cache.lengths, 0)
    return out, constrain_state(st.replace(cache=st.cache.replace(lengths=lengths)))


@functools.partial(jax.jit, donate_argnums=(0,))
def insert_row(state: DecodeState, row: DecodeState, b: jax.Array) -> DecodeState:
    """`state` with row b replaced by the B = 1 `row` (same cache size; `loop.put_row`), donated."""
    return constrain_state(put_row(state, row, b))


@functools.partial(jax.jit, static_argnums=(0,))
def regroup(size: int, state: DecodeState, index: jax.Array) -> DecodeState:
    """A new batch whose row i is `state`'s row ``index[i]`` (-1: a free row, length 0), its cache
    padded to `size` slots (>= the old size). index: [B'] int32."""
    take = lambda x: jnp.take(x, jnp.maximum(index, 0), axis=0)
    c = state.cache
    cache = grow_cache(KVCache(k=jnp.take(c.k, jnp.maximum(index, 0), axis=1),
                               v=jnp.take(c.v, jnp.maximum(index, 0), axis=1),
                               lengths=jnp.where(index >= 0, take(c.lengths), 0), tokens=take(c.tokens)), size)
    return constrain_state(DecodeState(logits=take(state.logits), hidden=take(state.hidden), cache=cache,
                                       key=take(state.key), temperature=take(state.temperature),
                                       top_p=take(state.top_p), top_k=take(state.top_k)))


def empty_batch(cfg: ModelConfig, params, rows: int, size: int) -> DecodeState:
    """A batch of `rows` free rows (length 0) with caches of `size` slots, on the params' mesh when
    they have one (the KV cache split as `sharding.cache_spec`, the rest by rows)."""
    dtype = compute_dtype(params)
    state = DecodeState(logits=jnp.zeros((rows, cfg.vocab_size), jnp.float32),
                        hidden=jnp.zeros((rows, cfg.hidden_size), dtype),
                        cache=init_cache(cfg, rows, size, dtype), key=jnp.zeros((rows, 2), jnp.uint32),
                        temperature=jnp.zeros((rows,), jnp.float32), top_p=jnp.ones((rows,), jnp.float32),
                        top_k=jnp.zeros((rows,), jnp.int32))
    mesh = sharding.mesh_of(params)
    if mesh is None:
        return state
    put = lambda x: sharding.put(x, mesh, sharding.batch_spec(x.ndim))  # noqa: E731
    spec = sharding.cache_spec()
    c = state.cache
    cache = KVCache(k=sharding.put(c.k, mesh, spec), v=sharding.put(c.v, mesh, spec), lengths=put(c.lengths),
                    tokens=put(c.tokens))
    return DecodeState(logits=put(state.logits), hidden=put(state.hidden), cache=cache, key=put(state.key),
                       temperature=put(state.temperature), top_p=put(state.top_p), top_k=put(state.top_k))

