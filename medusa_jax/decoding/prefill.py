"""Prefill: a batch of prompts into the KV cache, chunk by chunk, and the decoding state after it."""
from __future__ import annotations

import functools
import sys
import time
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax import sharding
from medusa_jax.decoding.args import PromptTooLongError, check_generation_args, check_prompt_room
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.prefix_cache import load_prefix
from medusa_jax.decoding.sampling import row_keys
from medusa_jax.decoding.state import DecodeState, constrain_cache, constrain_state
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import KVCache, init_cache
from medusa_jax.models.llama import LlamaModel, compute_dtype


def bucket(n: int, smallest: int = 32) -> int:
    """The power of two >= n (at least `smallest`): shape buckets keep recompilations few."""
    size = smallest
    while size < n:
        size *= 2
    return size


def cache_size_for(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, tree_size: int = 1) -> int:
    """Slots S for a prompt and budget: room for the prompt, the output and one full tree,
    rounded up to a power of two (>= 128), capped at the model's context (``max_position_embeddings``).

    Raises PromptTooLongError when the prompt leaves no room for even one new token.
    """
    check_prompt_room(prompt_len, cfg.max_position_embeddings)
    return int(min(bucket(prompt_len + max_new_tokens + tree_size, 128), cfg.max_position_embeddings))


PREFILL_CHUNK = 256
"""Tokens per prefill chunk (`prefill_plan`). On this project's 2-core CPU, 256 was faster than
128 and 512 on a 1,958-token prompt (docs/performance.md, "Prefill")."""


PREFILL_KV_BLOCK = 512
"""Cache slots per attention block during prefill (`medusa_jax.models.llama.blockwise_attention`)."""


PROGRESS_DELAY_S = 2.0
"""A prefill of several chunks shows a progress bar on stderr once it has run this many seconds."""


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnames=("cache",))
def prefill_chunk(cfg: ModelConfig, kv_block: Optional[int], params, tokens: jax.Array, lengths: jax.Array,
                  cache: KVCache, last: jax.Array) -> Tuple[KVCache, jax.Array]:
    """Jitted prefill of one chunk of a right-padded prompt batch (`start_state` drives it).

    Chunk ``c`` holds prompt positions ``[c * T, (c + 1) * T)`` of every row; the chunks go in order
    into one cache. Row ``b`` takes ``clip(lengths[b] - cache.lengths[b], 0, T)`` real tokens from the
    chunk; the rest (padding, or a whole chunk past a shorter row's end) is written past the row's
    length or dropped past the cache's end, and never read.

    Args:
      cfg: ModelConfig (static).
      kv_block: static; attention reads the cache in blocks of this many slots, up to the chunk's end
        only, when S is a larger multiple of it (`medusa_jax.models.llama.blockwise_attention`);
        None: all S slots in one pass.
      params: backbone params.
      tokens: [B, T] int32, this chunk of the right-padded prompts.
      lengths: [B] int32 whole prompt lengths (>= 1).
      cache: `KVCache` holding the earlier chunks (lengths ``min(c * T, lengths)``; donated).
      last: [B, D], carried from chunk to chunk (zeros for the first).
    Returns:
      (the cache with this chunk added, last [B, D]: the final hidden state of each row's last prompt
      token once its chunk has run, else `last` unchanged).
    """
    B, T = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    num_new = jnp.clip(lengths - cache.lengths, 0, T)  # this chunk's real tokens per row
    _, hidden, new_cache = LlamaModel(cfg).apply({"params": params}, tokens, positions, cache, num_new=num_new,
                                                 compute_logits=False, kv_block=kv_block)
    j = lengths - 1 - cache.lengths  # where the row's last prompt token is in this chunk, if here
    here = (j >= 0) & (j < T)
    last = jnp.where(here[:, None], hidden[jnp.arange(B), jnp.clip(j, 0, T - 1)].astype(last.dtype), last)
    return constrain_cache(new_cache), sharding.constrain(last, sharding.batch_spec(2))


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("cache",))
def prefill_logits(cfg: ModelConfig, params, last: jax.Array, cache: KVCache, key: jax.Array) -> DecodeState:
    """Jitted: the decoding state after the last chunk (logits [B, V] float32 of the last prompt
    tokens from their hidden states `last` [B, D]; `cache` donated; key [B, 2] uint32; every row
    greedy: temperature 0, top_p 1, top_k 0, which `start_state` sets as asked)."""
    logits = LlamaModel(cfg).apply({"params": params}, last, method=LlamaModel.logits)
    B = last.shape[0]
    return constrain_state(DecodeState(logits=logits, hidden=last, cache=cache, key=key,
                                       temperature=jnp.zeros((B,), jnp.float32), top_p=jnp.ones((B,), jnp.float32),
                                       top_k=jnp.zeros((B,), jnp.int32)))


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("cache",))
def prefill(cfg: ModelConfig, params, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            key: jax.Array) -> DecodeState:
    """Jitted prefill of a right-padded batch of prompts into an empty cache, the whole prompt in one
    chunk (`start_state` feeds long prompts in chunks of `PREFILL_CHUNK` tokens instead).

    Args:
      cfg: ModelConfig (static).
      params: backbone params.
      tokens: [B, Tp] int32 prompt ids, right-padded (pad with any id).
      lengths: [B] int32 true prompt lengths, 1 <= lengths <= Tp.
      cache: an empty `KVCache` with S >= Tp slots (donated).
      key: [B, 2] uint32 per-row PRNG keys for later sampling (`decoding.sampling.row_keys`).
    Returns:
      DecodeState with the last prompt position's logits [B, V] float32 and hidden state [B, D].
    """
    last = jnp.zeros((tokens.shape[0], cfg.hidden_size), jnp.float32)
    cache, last = prefill_chunk(cfg, PREFILL_KV_BLOCK, params, tokens, lengths, cache, last)
    return prefill_logits(cfg, params, last, cache, key)


def prefill_plan(longest: int, chunk_size: int = PREFILL_CHUNK) -> Tuple[int, int]:
    """How `start_state` splits a prompt batch: (tokens per chunk T, number of chunks).

    A batch whose longest prompt has at most `chunk_size` tokens is one chunk of ``bucket(longest)``
    tokens (>= 32); a longer one is ``ceil(longest / chunk_size)`` chunks of `chunk_size`, all run
    by one compiled chunk function.
    Raises ValueError for a chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
    T = bucket(longest) if longest <= chunk_size else chunk_size
    return T, -(-longest // T)


def progress_bar(show: bool, total: int, desc: str, unit: str):
    """A tqdm bar on stderr that appears once it has run `PROGRESS_DELAY_S` seconds and, when
    closed, is erased on a terminal or ends its line elsewhere (erasing it in a log or a pipe left a
    fragment in front of the answer); None when not `show`."""
    if not show:
        return None
    on_terminal = getattr(sys.stderr, "isatty", lambda: False)()
    return tqdm(total=total, desc=desc, unit=unit, delay=PROGRESS_DELAY_S, leave=not on_terminal, file=sys.stderr)


def start_state(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], cache_size: int,
                seed: int = 0, dtype=None, timing: Optional[dict] = None, *,
                chunk_size: int = PREFILL_CHUNK, kv_block: Optional[int] = PREFILL_KV_BLOCK,
                progress: bool = True, temperature=0.0, top_p=1.0, top_k=0) -> DecodeState:
    """Validate prompts, build the cache and prefill it, chunk by chunk (`prefill_plan`).

    Args:
      prompts: B lists of token ids (each non-empty and shorter than `cache_size`).
      cache_size: S slots per row.
      seed: an int (row b's key is PRNGKey(seed + b)) or one int per row (`decoding.sampling.row_keys`).
      dtype: the cache's and the hidden states' dtype; None: the params' compute dtype
        (`models.llama.compute_dtype`).
      timing: if a dict, ``timing["prefill_s"]`` gets the prefill's seconds (compilation excluded).
      chunk_size: tokens per chunk; any value gives the same state up to float32 round-off.
      kv_block: cache slots per attention block (`prefill_chunk`); None: one pass over the cache.
      progress: for a prefill of several chunks, a progress bar on stderr once it has run
        `PROGRESS_DELAY_S` seconds; the host then follows the chunks one behind (a one-chunk
        prefill never waits and shows nothing). False: silent.
      temperature, top_p, top_k: each row's sampling settings (one for every row, or one per row;
        temperature 0: greedy; top_k 0: off).
    Returns:
      DecodeState: logits [B, V] float32 and final hidden state [B, D] of each row's last prompt
      token, a cache of `cache_size` slots with ``lengths`` = the prompt lengths, per-row keys
      [B, 2] from `seed`, and the rows' temperature and top_p [B] float32 and top_k [B] int32.
    Raises:
      ValueError: an empty prompt, a malformed prompt list, an id outside the vocabulary, or a
        cache_size beyond the model's context (`check_generation_args`); chunk_size < 1.
      PromptTooLongError: a prompt with no room left.
    """
    prompts, _ = check_generation_args(cfg, prompts, caller="start_state", batch=True,
                                       cache_size=cache_size, check_decoding=False)
    longest = max(len(p) for p in prompts)
    T, chunks = prefill_plan(longest, chunk_size)
    B = len(prompts)
    toks = np.zeros((B, T * chunks), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    dtype = compute_dtype(params) if dtype is None else dtype
    cache = init_cache(cfg, B, cache_size, dtype)
    last = jnp.zeros((B, cfg.hidden_size), dtype)
    key = row_keys(seed, B)
    mesh = sharding.mesh_of(params)
    if mesh is not None:  # the cache follows the attention heads; the rows go on 'data'
        spec = sharding.cache_spec()
        cache = KVCache(k=sharding.put(cache.k, mesh, spec), v=sharding.put(cache.v, mesh, spec),
                        lengths=sharding.put(cache.lengths, mesh, sharding.batch_spec(1)),
                        tokens=sharding.put(cache.tokens, mesh, sharding.batch_spec(2)))
        last = sharding.put(last, mesh, sharding.batch_spec(2))
    run = aot(prefill_chunk, (cfg, kv_block), (params, jnp.asarray(toks[:, :T]), lengths, cache, last))
    finish = aot(prefill_logits, (cfg,), (params, last, cache, key))
    bar = progress_bar(progress and chunks > 1, chunks, "prefill", "chunk")
    t0 = time.perf_counter()
    running = None
    for c in range(chunks):
        cache, last = run(params, jnp.asarray(toks[:, c * T:(c + 1) * T]), lengths, cache, last)
        if bar is not None:  # follow one chunk behind, so that the next one is already queued
            if running is not None:
                jax.block_until_ready(running)
                bar.update(1)
            running = last
    state = finish(params, last, cache, key)
    rows = lambda x: sharding.put(x, mesh, sharding.batch_spec(1)) if mesh is not None else x
    state = state.replace(temperature=rows(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))),
                          top_p=rows(jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,))),
                          top_k=rows(jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,))))
    if timing is not None or bar is not None:
        state = jax.block_until_ready(state)
    if bar is not None:
        bar.update(1)
        bar.close()
    if timing is not None:
        timing["prefill_s"] = time.perf_counter() - t0
    return state


class PrefillJob:
    """One prompt prefilled into a B = 1 cache a chunk at a time, so that a caller (the engine) can
    run other rows' decoding steps between its chunks; optionally starting from a reused prefix
    (`decoding.prefix_cache`).

    Args:
      cfg, params: the backbone (params in decoding layout).
      prompt: the token ids.
      cache_size: S slots (> len(prompt)).
      seed, temperature, top_p, top_k: the row's sampling settings (`start_state`).
      prefix: None, or (k, v [L, KVH, slots, Dh], tokens [slots] int32, n): the first n prompt
        tokens' K/V, reused (n < len(prompt)).
      chunk_size: tokens per chunk (the last chunk is the bucket of what remains).
      progress: a progress bar on stderr (after `PROGRESS_DELAY_S`) for a prefill of several chunks.
    Attributes: ``done`` (the state is ready), ``state`` (the B = 1 `DecodeState` once done),
      ``seconds`` (the chunks' compute time, compilation excluded), ``compile_s`` (compilation and
      first calls, `compile.warm_up`), ``reused`` (the prompt tokens whose K/V came with `prefix`),
      ``started`` (`time.perf_counter` when the job was made: its request left the queue).
    """

    def __init__(self, cfg: ModelConfig, params, prompt: Sequence[int], cache_size: int, seed: int = 0,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, prefix=None,
                 chunk_size: int = PREFILL_CHUNK,
                 kv_block: Optional[int] = PREFILL_KV_BLOCK, progress: bool = False):
        self.cfg, self.params, self.kv_block, self.chunk_size = cfg, params, kv_block, chunk_size
        self.started = time.perf_counter()
        self.prompt = np.asarray(prompt, np.int32)
        if not 0 < len(self.prompt) < cache_size:
            raise PromptTooLongError(f"a prompt of {len(self.prompt)} tokens needs more than {cache_size} cache slots")
        dtype = compute_dtype(params)
        mesh = sharding.mesh_of(params)
        cache = init_cache(cfg, 1, cache_size, dtype)
        self.pos = 0
        if prefix is not None:
            k, v, tokens, n = prefix
            cache = load_prefix(cache, k, v, tokens, jnp.int32(n))
            self.pos = int(n)
        self.last = jnp.zeros((1, cfg.hidden_size), dtype)
        if mesh is not None:
            spec = sharding.cache_spec()
            cache = KVCache(k=sharding.put(cache.k, mesh, spec), v=sharding.put(cache.v, mesh, spec),
                            lengths=sharding.put(cache.lengths, mesh, sharding.batch_spec(1)),
                            tokens=sharding.put(cache.tokens, mesh, sharding.batch_spec(2)))
            self.last = sharding.put(self.last, mesh, sharding.batch_spec(2))
        self.cache, self.mesh = cache, mesh
        self.key = row_keys(seed, 1)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.lengths = jnp.asarray([len(self.prompt)], jnp.int32)
        self.state: Optional[DecodeState] = None
        self.seconds = self.compile_s = 0.0
        self.reused = self.pos
        chunks = -(-(len(self.prompt) - self.pos) // chunk_size)
        self.bar = progress_bar(progress and chunks > 1, chunks, "prefill", "chunk")

    @property
    def done(self) -> bool:
        return self.state is not None

    def can_follow(self, other: "PrefillJob") -> bool:
        """Whether `other`'s finished prefill can be this job's (`follow`): the same prompt, the same
        cache size, and this job not done."""
        return (other.done and not self.done and other.cache.size == self.cache.size
                and np.array_equal(other.prompt, self.prompt))

    def follow(self, other: "PrefillJob") -> None:
        """Take `other`'s finished prefill of the same prompt (`can_follow`) as this job's: its cache,
        logits and hidden state, with this job's own key and sampling settings, which is what this
        job's own chunks would compute (up to round-off, where the two were chunked differently).
        So the ``n`` choices of one prompt prefill it once. The prompt counts as reused."""
        self.state = self._own(other.state.replace(key=self.key))
        self.pos = self.reused = len(self.prompt)
        if self.bar is not None:
            self.bar.close()

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt) - self.pos

    def _own(self, state: DecodeState) -> DecodeState:
        """`state` with this job's sampling settings (temperature, top_p, top_k; on its mesh)."""
        rows = lambda x: sharding.put(x, self.mesh, sharding.batch_spec(1)) if self.mesh is not None else x
        return state.replace(temperature=rows(jnp.full((1,), self.temperature, jnp.float32)),
                             top_p=rows(jnp.full((1,), self.top_p, jnp.float32)),
                             top_k=rows(jnp.full((1,), self.top_k, jnp.int32)))

    def run_chunk(self, max_tokens: Optional[int] = None) -> bool:
        """Prefill the next chunk (at most `max_tokens` tokens, default ``chunk_size``; and, after
        the last, compute the logits); True once done."""
        if self.done:
            return True
        rest = len(self.prompt) - self.pos
        size = min(self.chunk_size, max_tokens or self.chunk_size)
        T = size if rest > size else bucket(rest)
        toks = np.zeros((1, T), np.int32)
        chunk = self.prompt[self.pos:self.pos + T]
        toks[0, :len(chunk)] = chunk
        args = (self.params, jnp.asarray(toks), self.lengths, self.cache, self.last)
        t0 = time.perf_counter()
        run = aot(prefill_chunk, (self.cfg, self.kv_block), args, first_call=True)
        finish = aot(prefill_logits, (self.cfg,), (self.params, self.last, self.cache, self.key), first_call=True)
        self.compile_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.cache, self.last = run(*args)
        self.pos += len(chunk)
        if self.pos >= len(self.prompt):
            self.state = jax.block_until_ready(self._own(finish(self.params, self.last, self.cache, self.key)))
        else:
            jax.block_until_ready(self.last)
        self.seconds += time.perf_counter() - t0
        if self.bar is not None:
            self.bar.update(1)
            if self.done:
                self.bar.close()
        return self.done
