"""The on-device decoding loop: one segment of whole generation in a `lax.while_loop`, with no host
sync per step, over a named loop carry (`LoopCarry`, a pytree as gemma's ``SamplingState``); rows
replaced and the cache grown between segments (`engine.generate.generate_device`, `engine.generate.generate_batch`)."""
from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from medusa_jax.decoding.state import DecodeState, StepOutput, constrain_state
from medusa_jax.decoding.step import StepConfig, medusa_step
from medusa_jax.decoding.tree import PLAIN_TREE
from medusa_jax.drafts import drafter_for
from medusa_jax.models.kv_cache import KVCache, grow_cache


class LoopCarry(NamedTuple):
    """What the on-device loop carries from step to step (a pytree; B rows, D = the tree's
    ``max_accepted``).

    state: the `DecodeState` of every row.
    out: [B, max_new_tokens] int32, the tokens emitted so far (row b valid up to ``count[b]``).
    count: [B] int32, tokens emitted per row (EOS included when it ended the row).
    done: [B] bool, rows that emit nothing more (EOS, max_new_tokens, or a full cache at the final size).
    steps: () int32, decoding steps of the batch.
    hist: [D+1] int32; ``hist[n-1]`` counts the (row, step) pairs that emitted n tokens.
    row_steps: [B] int32, decoding steps per row.
    """
    state: DecodeState
    out: jax.Array
    count: jax.Array
    done: jax.Array
    steps: jax.Array
    hist: jax.Array
    row_steps: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnames=("carry",))
def generate_jit(config: StepConfig, max_new_tokens: int, eos: Tuple[int, ...], tail: bool, params, head_params,
                 carry: LoopCarry, final: jax.Array, limits: jax.Array) -> LoopCarry:
    """One segment of whole-generation-on-the-device: a lax.while_loop, no host sync per step.

    Args (static first): config (`decoding.step.StepConfig`: the configs, the drafter of the tree,
      `PLAIN_TREE`'s for plain, and the acceptance rule), max_new_tokens, eos ids (tuple), tail (True: plain steps only, for the last cache slots where
      the tree no longer fits); then params, head_params, the loop carry (`LoopCarry`, donated;
      `init_carry`), ``final`` (bool scalar: the cache is at its largest) and ``limits`` [2] int32
      (step_limit, done_limit).
    Every step of a segment is of one kind, the tree's or (plain decoding, ``tail``) a plain one: a
    conditional between them made XLA copy the KV cache every step (docs/performance.md). The loop
    stops when every row is done, when ``steps`` reaches step_limit, when done_limit rows are done
    (a row to refill: `generate_batch`), or as soon as its step no longer fits in the cache: the
    caller then grows the cache, or at the final size runs a ``tail`` segment, whose plain steps go
    on (with ``final``) until each row's cache is full (the row is then done). A done row emits
    nothing more and its cache length stays put. Use `generate_device` or `generate_batch`, which
    drive it.
    Returns the `LoopCarry` after the segment.
    """
    B = carry.state.logits.shape[0]
    S = carry.state.cache.size
    D = config.drafter.max_accepted
    width = D + 1
    eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)
    step_limit, done_limit = limits[0], limits[1]

    def plain(st):
        o, s = medusa_step(config.with_drafter(drafter_for(PLAIN_TREE), heads=False), params, None, st)
        toks = jnp.pad(o.tokens, ((0, 0), (0, width - 1)))
        return StepOutput(toks, o.num_tokens), s

    def full(st):
        return medusa_step(config, params, head_params, st)

    # one kind of step per segment: a lax.cond choosing between the tree step and a plain one made
    # XLA copy the KV cache every step (docs/performance.md); the host runs the plain tail apart
    plain_only = tail or D == 0
    room = 1 if plain_only else config.drafter.tree.step_size

    def fits(st):
        return jnp.all(st.cache.lengths + room <= S)

    def cond(c: LoopCarry):
        return (jnp.logical_not(jnp.all(c.done)) & (c.steps < step_limit) & (jnp.sum(c.done) < done_limit)
                & (fits(c.state) | (final & plain_only)))

    def body(c: LoopCarry) -> LoopCarry:
        o, st = plain(c.state) if plain_only else full(c.state)
        # a finished row keeps its length: it computes on, but never grows out of its cache
        st = st.replace(cache=st.cache.replace(lengths=jnp.where(c.done, c.state.cache.lengths, st.cache.lengths)))
        j = jnp.arange(width)[None, :]
        live = j < o.num_tokens[:, None]
        is_eos = jnp.isin(o.tokens, eos_arr) & live
        has_eos = jnp.any(is_eos, axis=1)
        n = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, o.num_tokens)
        n = jnp.minimum(n, max_new_tokens - c.count)
        n = jnp.where(c.done, 0, n)
        idx = jnp.where(j < n[:, None], c.count[:, None] + j, max_new_tokens)  # out of range -> dropped
        out = c.out.at[jnp.arange(B)[:, None], idx].set(o.tokens, mode="drop")
        hist = c.hist.at[o.num_tokens - 1].add(jnp.where(c.done, 0, 1))
        count = c.count + n
        done = c.done | (has_eos & (n > 0)) | (count >= max_new_tokens) | (final & (st.cache.lengths >= S))
        return LoopCarry(state=constrain_state(st), out=out, count=count, done=done, steps=c.steps + 1, hist=hist,
                         row_steps=c.row_steps + jnp.where(c.done, 0, 1))

    return jax.lax.while_loop(cond, body, carry)


def init_carry(state: DecodeState, max_new_tokens: int, depth: int) -> LoopCarry:
    """The `generate_jit` carry for a freshly prefilled `state` ([B] rows, nothing emitted)."""
    B = state.logits.shape[0]
    return LoopCarry(state=state, out=jnp.zeros((B, max_new_tokens), jnp.int32), count=jnp.zeros((B,), jnp.int32),
                     done=jnp.zeros((B,), bool), steps=jnp.int32(0), hist=jnp.zeros((depth + 1,), jnp.int32),
                     row_steps=jnp.zeros((B,), jnp.int32))


def put_row(state: DecodeState, row: DecodeState, b: jax.Array) -> DecodeState:
    """`state` ([B] rows) with row b replaced by the B = 1 `row` (same cache size S): its cache,
    logits, hidden state, key, temperature, top-p and top-k. Pure; jit it with `state` donated to update in
    place."""
    c, r = state.cache, row.cache
    cache = KVCache(k=c.k.at[:, b].set(r.k[:, 0]), v=c.v.at[:, b].set(r.v[:, 0]),
                    lengths=c.lengths.at[b].set(r.lengths[0]), tokens=c.tokens.at[b].set(r.tokens[0]))
    return DecodeState(logits=state.logits.at[b].set(row.logits[0]), hidden=state.hidden.at[b].set(row.hidden[0]),
                       cache=cache, key=state.key.at[b].set(row.key[0]),
                       temperature=state.temperature.at[b].set(row.temperature[0]),
                       top_p=state.top_p.at[b].set(row.top_p[0]), top_k=state.top_k.at[b].set(row.top_k[0]))


def grow_carry(carry: LoopCarry, size: int) -> LoopCarry:
    """`carry` with its cache padded to `size` slots, each array kept where it was (on a mesh:
    split as before)."""
    old = carry.state.cache
    new = grow_cache(old, size)
    new = KVCache(k=jax.device_put(new.k, old.k.sharding), v=jax.device_put(new.v, old.v.sharding),
                  lengths=new.lengths, tokens=jax.device_put(new.tokens, old.tokens.sharding))
    return carry._replace(state=carry.state.replace(cache=new))
