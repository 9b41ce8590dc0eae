"""Prefill, plain decoding and Medusa decoding, streaming (host loop) and fully jitted (lax.while_loop).

Plain decoding is the Medusa step with the trivial tree (the root alone: one token per step, no
heads), so both paths share one tested step function (`medusa_jax.verify.medusa_step`).

Stopping rules, shared by every path so that Medusa greedy output equals plain greedy output:
an EOS token ends the output (the EOS is included), ``max_new_tokens`` caps it, and the sequence
(prompt + output) never exceeds the cache size S.
"""
from __future__ import annotations

import contextlib
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import sharding
from .config import MedusaConfig, ModelConfig
from .kv_cache import KVCache, grow_cache, init_cache
from .models.llama import LlamaModel, compute_dtype
from .sampling import row_keys, row_seeds
from .tree import TreeBuffers, build_tree
from .verify import Acceptance, DecodeState, StepOutput, medusa_step

PLAIN_TREE: TreeBuffers = build_tree([], topk=1)


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context (or the requested cache)."""


_ONE_PROMPT = ("decodes one prompt: pass a list (or 1-D array) of token ids, or a [1, T] array; for "
               "several prompts use generate_device(prompts=[[...], [...]])")
_PROMPTS = ("takes a batch of prompts: a list of token-id lists (or a [B, T] array), e.g. "
            "prompts=[[1, 2, 3], [4, 5]]; for one prompt pass [ids]")


def _as_int(x: Any, what: str) -> int:
    """`x` as a Python int (int, numpy integer, 0-d integer array); ValueError naming `what` otherwise."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{what} must be an integer, got the bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {type(x).__name__} {x!r}") from None


def _token_ids(p: Any, caller: str, what: str) -> Optional[List[int]]:
    """One prompt as a list of ints, or None when `p` is not a flat sequence of ids (nested)."""
    if isinstance(p, str):
        raise ValueError(f"{caller}() takes token ids, not text ({what} is a str): tokenize it first, "
                         "e.g. medusa_jax.apply_chat_template(tokenizer, text)")
    if isinstance(p, (np.ndarray, jax.Array)):
        arr = np.asarray(p)
        if arr.ndim != 1:
            return None
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{caller}(): {what} must hold integer token ids, got an array of {arr.dtype}")
        return arr.astype(np.int64).tolist()
    if not isinstance(p, Sequence):
        raise ValueError(f"{caller}(): {what} must be a list or array of token ids, got {type(p).__name__}")
    if any(isinstance(t, (Sequence, np.ndarray, jax.Array)) and not isinstance(t, str)
           and np.ndim(t) > 0 for t in p):
        return None
    return [_as_int(t, f"{what}[{i}] (a token id)") for i, t in enumerate(p)]


def check_generation_args(cfg: ModelConfig, prompts: Any, *, caller: str, batch: bool,
                          max_new_tokens: Optional[int] = None, cache_size: Optional[int] = None,
                          heads: Any = None, tree: Any = None, eos_token_ids: Any = None,
                          acceptance: Any = None, seed: Any = 0,
                          check_decoding: bool = True) -> Tuple[List[List[int]], Tuple[int, ...]]:
    """Validate the arguments of every generation entry point (`generate`, `generate_stream`,
    `generate_device`, `start_state`) and normalise the prompts.

    Args:
      prompts: ``batch=False``: one prompt, a list / tuple / 1-D numpy or jax array of ints, or a
        [1, T] array (or a list holding one list). ``batch=True``: a list of such prompts, or a
        [B, T] integer array (each row a whole prompt). Every id must be in [0, cfg.vocab_size).
      caller: the entry point's name, for messages.
      max_new_tokens: an int >= 1 (None: not checked).
      cache_size: None, or S slots with longest prompt < S <= ``cfg.max_position_embeddings``: a
        larger cache would give positions the model was never trained on, so it is refused, not capped.
      heads: None or (MedusaConfig, head params) fitting the backbone (`heads.check_heads_match`).
      tree: a `TreeBuffers` no deeper than the heads; given exactly when heads are.
      eos_token_ids: None (the config's), one id, or a sequence of ids in [0, vocab_size).
      acceptance: None or an `Acceptance`; seed: an int.
      check_decoding: False checks only prompts and cache_size (`start_state`).
    Returns:
      (prompts as lists of ints, eos ids tuple).
    Raises:
      ValueError: any argument of the wrong kind or out of range; the message says what it takes.
      PromptTooLongError: a prompt with no room left in `cache_size`.
      HeadsMismatchError: heads made for another backbone.
    """
    if batch:
        if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
            prompts = list(np.asarray(prompts))
        if isinstance(prompts, (str, np.ndarray, jax.Array)) or not isinstance(prompts, Sequence):
            raise ValueError(f"{caller}() {_PROMPTS}; got {type(prompts).__name__}"
                             + (f" of shape {np.shape(prompts)}" if hasattr(prompts, "shape") else ""))
        if len(prompts) == 0:
            raise ValueError(f"no prompts given: {caller}() {_PROMPTS}")
        if not any(isinstance(p, (Sequence, np.ndarray, jax.Array)) and not isinstance(p, str) for p in prompts):
            raise ValueError(f"{caller}() {_PROMPTS}; got a flat sequence of {len(prompts)} ids")
        out = []
        for b, p in enumerate(prompts):
            ids = _token_ids(p, caller, f"prompt {b}")
            if ids is None:
                raise ValueError(f"{caller}(): prompt {b} is not a flat list of token ids; {caller}() {_PROMPTS}")
            out.append(ids)
    else:
        p = prompts
        if isinstance(p, (np.ndarray, jax.Array)) and np.ndim(p) == 2 and np.shape(p)[0] == 1:
            p = np.asarray(p)[0]
        ids = _token_ids(p, caller, "the prompt")
        if ids is None and isinstance(p, Sequence) and len(p) == 1:
            ids = _token_ids(p[0], caller, "the prompt")
        if ids is None:
            got = (f"an array of shape {np.shape(p)}" if hasattr(p, "shape") else f"{len(p)} prompts")
            raise ValueError(f"{caller}() {_ONE_PROMPT}; got {got}")
        out = [ids]
    V = cfg.vocab_size
    for b, ids in enumerate(out):
        if not ids:
            raise ValueError("empty prompt: give at least one token (after the chat template)")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < V), None)
        if bad is not None:
            where = f" of prompt {b}" if batch else ""
            raise ValueError(f"{caller}(): token id {ids[bad]} at position {bad}{where} is outside the model's "
                             f"vocabulary [0, {V}); were the ids made by another model's tokenizer?")
    ctx = cfg.max_position_embeddings
    if cache_size is not None:
        S = _as_int(cache_size, "cache_size")
        if not 1 <= S <= ctx:
            raise ValueError(f"{caller}(): cache_size={S} is outside [1, {ctx}]: the model's context "
                             f"(max_position_embeddings) is {ctx} positions, and no position beyond "
                             f"{ctx - 1} is decoded. Pass cache_size <= {ctx}, or None to size the cache "
                             "from the prompt and max_new_tokens")
        longest = max(len(p) for p in out)
        if longest >= S:
            raise PromptTooLongError(f"a prompt has {longest} tokens but the cache holds {S}; "
                                     "shorten the prompt or raise the cache size / context")
    if not check_decoding:
        return out, ()
    if acceptance is not None:
        if not isinstance(acceptance, Acceptance):
            raise ValueError(f"{caller}(): acceptance takes a medusa_jax.verify.Acceptance(temperature=...), "
                             f"got {type(acceptance).__name__}")
        try:
            acceptance.check()
        except ValueError as e:
            raise ValueError(f"{caller}(): {e}") from None
    if isinstance(seed, (Sequence, np.ndarray)) and not isinstance(seed, str):
        if not batch or len(seed) != len(out):
            raise ValueError(f"{caller}(): seed takes an int" + (f" or one int per prompt ({len(out)})" if batch else "")
                             + f", got a sequence of {len(seed)}")
        for s in seed:
            _as_int(s, "each seed")
    else:
        _as_int(seed, "seed")
    if max_new_tokens is not None:
        n = _as_int(max_new_tokens, "max_new_tokens")
        if n < 1:
            raise ValueError(f"{caller}(): max_new_tokens must be >= 1 (the most new tokens to generate), got {n}")
    if eos_token_ids is None:
        eos = tuple(cfg.eos_token_ids)
    elif isinstance(eos_token_ids, (int, np.integer)) and not isinstance(eos_token_ids, bool):
        eos = (int(eos_token_ids),)
    elif isinstance(eos_token_ids, (Sequence, np.ndarray, jax.Array)) and not isinstance(eos_token_ids, str):
        eos = tuple(_as_int(e, "each of eos_token_ids") for e in eos_token_ids)
    else:
        raise ValueError(f"{caller}(): eos_token_ids takes None, a token id or a list of token ids, "
                         f"got {type(eos_token_ids).__name__}")
    if any(not 0 <= e < V for e in eos):
        raise ValueError(f"{caller}(): eos_token_ids {list(eos)} must be in the vocabulary [0, {V})")
    if heads is not None:
        if not (isinstance(heads, tuple) and len(heads) == 2 and isinstance(heads[0], MedusaConfig)):
            raise ValueError(f"{caller}(): heads takes (MedusaConfig, head params), e.g. from "
                             f"medusa_jax.load_heads(path), got {type(heads).__name__}")
        from .heads import check_heads_match

        check_heads_match(heads[0], cfg)
        if tree is None:
            raise ValueError(f"{caller}(): heads given without a tree; pass tree=medusa_jax.tree.get_tree(...) "
                             "(or heads=None for plain decoding)")
    if tree is not None:
        if not isinstance(tree, TreeBuffers):
            raise ValueError(f"{caller}(): tree takes a TreeBuffers (medusa_jax.tree.get_tree(spec)), "
                             f"got {type(tree).__name__}")
        if heads is None and (tree.max_depth > 0 or tree.lookup is None):
            raise ValueError(f"{caller}(): a tree was given without heads; pass heads=(MedusaConfig, params) "
                             "too, or tree=None for plain decoding (without heads, a tree may only be the trivial "
                             "one with prompt lookup: medusa_jax.tree.with_lookup(get_tree([]), PromptLookup()))")
        if heads is not None and tree.max_depth > heads[0].num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the {heads[0].num_heads} Medusa heads; "
                             "use a shallower tree")
    return out, eos


@dataclass
class GenerationResult:
    """One generation's output and statistics (B = 1).

    tokens: the new token ids (EOS included when it ended the output).
    steps: decoding steps (tree forwards) after the prefill.
    tokens_per_step: tokens emitted by each step (1 for plain decoding; the last step's count
      stops at an EOS or at max_new_tokens).
    prefill_s / decode_s: wall-clock seconds, compilation excluded.
    stop_reason: "eos", "max_new_tokens" or "cache_full".
    """
    tokens: List[int] = field(default_factory=list)
    steps: int = 0
    tokens_per_step: List[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""

    @property
    def mean_accepted(self) -> float:
        """New tokens per decoding step (the bonus token included)."""
        return len(self.tokens) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0


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
    if prompt_len >= cfg.max_position_embeddings:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens but the model's context is {cfg.max_position_embeddings}; "
            "shorten the prompt")
    return int(min(bucket(prompt_len + max_new_tokens + tree_size, 128), cfg.max_position_embeddings))


PREFILL_CHUNK = 256
"""Tokens per prefill chunk (`prefill_plan`). On this project's 2-core CPU, 256 was faster than
128 and 512 on a 1,958-token prompt (docs/performance.md, "Prefill")."""

PREFILL_KV_BLOCK = 512
"""Cache slots per attention block during prefill (`medusa_jax.models.llama.blockwise_attention`)."""

PROGRESS_DELAY_S = 2.0
"""A prefill of several chunks shows a progress bar on stderr once it has run this many seconds."""


def _constrain_cache(cache: KVCache) -> KVCache:
    """Inside jit on a mesh: keep the cache split as `sharding.cache_spec` says and its lengths
    on 'data' (no-op otherwise)."""
    spec = sharding.cache_spec()
    return KVCache(k=sharding.constrain(cache.k, spec), v=sharding.constrain(cache.v, spec),
                   lengths=sharding.constrain(cache.lengths, sharding.batch_spec(1)),
                   tokens=sharding.constrain(cache.tokens, sharding.batch_spec(2)))


def _constrain_state(st: DecodeState) -> DecodeState:
    """Inside jit on a mesh: every array of the decoding state split by rows on 'data' and the
    cache as `_constrain_cache`, so that a compiled step's output state has its input's layout
    and can be fed back to it (no-op otherwise)."""
    rows = lambda x: sharding.constrain(x, sharding.batch_spec(x.ndim))
    return DecodeState(logits=rows(st.logits), hidden=rows(st.hidden), cache=_constrain_cache(st.cache),
                       key=rows(st.key), next_token=rows(st.next_token))


def _prefill_chunk(cfg: ModelConfig, kv_block: Optional[int], params, tokens: jax.Array, lengths: jax.Array,
                   cache: KVCache, last: jax.Array) -> Tuple[KVCache, jax.Array]:
    """One chunk of a right-padded prompt batch into the cache (see `prefill_chunk`)."""
    B, T = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    num_new = jnp.clip(lengths - cache.lengths, 0, T)  # this chunk's real tokens per row
    _, hidden, new_cache = LlamaModel(cfg).apply({"params": params}, tokens, positions, cache, num_new=num_new,
                                                 compute_logits=False, kv_block=kv_block)
    j = lengths - 1 - cache.lengths  # where the row's last prompt token is in this chunk, if here
    here = (j >= 0) & (j < T)
    last = jnp.where(here[:, None], hidden[jnp.arange(B), jnp.clip(j, 0, T - 1)].astype(last.dtype), last)
    return _constrain_cache(new_cache), sharding.constrain(last, sharding.batch_spec(2))


prefill_chunk = jax.jit(_prefill_chunk, static_argnums=(0, 1), donate_argnames=("cache",))
prefill_chunk.__doc__ = """Jitted prefill of one chunk of a right-padded prompt batch (`start_state` drives it).

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


def _prefill_logits(cfg: ModelConfig, params, last: jax.Array, cache: KVCache, key: jax.Array) -> DecodeState:
    """The decoding state after the last chunk: logits [B, V] float32 of the last prompt tokens."""
    logits = LlamaModel(cfg).apply({"params": params}, last, method=LlamaModel.logits)
    return _constrain_state(DecodeState(logits=logits, hidden=last, cache=cache, key=key,
                                        next_token=jnp.full((last.shape[0],), -1, jnp.int32)))


prefill_logits = jax.jit(_prefill_logits, static_argnums=0, donate_argnames=("cache",))


def _prefill(cfg: ModelConfig, params, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
             key: jax.Array) -> DecodeState:
    """The whole prompt batch as one chunk (see `prefill`)."""
    last = jnp.zeros((tokens.shape[0], cfg.hidden_size), jnp.float32)
    cache, last = _prefill_chunk(cfg, PREFILL_KV_BLOCK, params, tokens, lengths, cache, last)
    return _prefill_logits(cfg, params, last, cache, key)


prefill = jax.jit(_prefill, static_argnums=0, donate_argnames=("cache",))
prefill.__doc__ = """Jitted prefill of a right-padded batch of prompts into an empty cache, the whole prompt
in one chunk (`start_state` feeds long prompts in chunks of `PREFILL_CHUNK` tokens instead).

Args:
  cfg: ModelConfig (static).
  params: backbone params.
  tokens: [B, Tp] int32 prompt ids, right-padded (pad with any id).
  lengths: [B] int32 true prompt lengths, 1 <= lengths <= Tp.
  cache: an empty `KVCache` with S >= Tp slots (donated).
  key: [B, 2] uint32 per-row PRNG keys for later sampling (`sampling.row_keys`).
Returns:
  DecodeState with the last prompt position's logits [B, V] float32 and hidden state [B, D].
"""

def _step(cfg: ModelConfig, heads_cfg, tree: TreeBuffers, acc: Acceptance, params, head_params,
          state: DecodeState):
    out, st = medusa_step(cfg, heads_cfg, tree, acc, params, head_params, state)
    return out, _constrain_state(st)


step = jax.jit(_step, static_argnums=(0, 1, 2, 3), donate_argnames=("state",))
step.__doc__ = """Jitted `verify.medusa_step` (same arguments, the state donated); on a device mesh the
output state keeps the input state's layout (`_constrain_state`)."""


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


def _progress_bar(show: bool, total: int, desc: str, unit: str):
    """A tqdm bar on stderr that appears once it has run `PROGRESS_DELAY_S` seconds and is erased
    when closed; None when not `show`."""
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, delay=PROGRESS_DELAY_S, leave=False, file=sys.stderr)


def start_state(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], cache_size: int,
                seed: int = 0, dtype=None, timing: Optional[dict] = None, *,
                chunk_size: int = PREFILL_CHUNK, kv_block: Optional[int] = PREFILL_KV_BLOCK,
                progress: bool = True) -> DecodeState:
    """Validate prompts, build the cache and prefill it, chunk by chunk (`prefill_plan`).

    Args:
      prompts: B lists of token ids (each non-empty and shorter than `cache_size`).
      cache_size: S slots per row.
      seed: an int (row b's key is PRNGKey(seed + b)) or one int per row (`sampling.row_keys`).
      dtype: the cache's and the hidden states' dtype; None: the params' compute dtype
        (`models.llama.compute_dtype`).
      timing: if a dict, ``timing["prefill_s"]`` gets the prefill's seconds (compilation excluded).
      chunk_size: tokens per chunk; any value gives the same state up to float32 round-off.
      kv_block: cache slots per attention block (`prefill_chunk`); None: one pass over the cache.
      progress: for a prefill of several chunks, a progress bar on stderr once it has run
        `PROGRESS_DELAY_S` seconds; the host then follows the chunks one behind (a one-chunk
        prefill never waits and shows nothing). False: silent.
    Returns:
      DecodeState: logits [B, V] float32 and final hidden state [B, D] of each row's last prompt
      token, a cache of `cache_size` slots with ``lengths`` = the prompt lengths, per-row keys
      [B, 2] from `seed`, ``next_token`` -1 (the first root is chosen from the logits).
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
    run = _aot(prefill_chunk, (cfg, kv_block), (params, jnp.asarray(toks[:, :T]), lengths, cache, last))
    finish = _aot(prefill_logits, (cfg,), (params, last, cache, key))
    bar = _progress_bar(progress and chunks > 1, chunks, "prefill", "chunk")
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
    if timing is not None or bar is not None:
        state = jax.block_until_ready(state)
    if bar is not None:
        bar.update(1)
        bar.close()
    if timing is not None:
        timing["prefill_s"] = time.perf_counter() - t0
    return state


def _cut_at_eos(chunk: List[int], eos: Sequence[int]) -> Tuple[List[int], bool]:
    for i, t in enumerate(chunk):
        if t in eos:
            return chunk[:i + 1], True
    return chunk, False


def _decoding_setup(cfg: ModelConfig, params, heads, tree: Optional[TreeBuffers]):
    """(params in decoding layout, heads_cfg or None, head params or None, the tree to run:
    `PLAIN_TREE` without heads), from arguments that `check_generation_args` accepted.

    The backbone's params go to decoding layout once (`models.llama.decoding_params`, cached per
    params tree: the weight-streaming kernels' ``[out, in]`` layout when they are available).
    Heads are readied for the tree once, here (`heads.prepare_heads`; heads from
    `runtime.resolve_heads` pass through unchanged), so that heads straight from `load_heads` do
    not slice or gather their weights in every step.

    Params placed on a device mesh (`sharding.shard_params`) keep their layout (the CPU kernels do
    not run on a mesh; XLA splits the products) and the heads are placed on the same mesh.
    Raises ValueError when the mesh's model axis does not divide the attention heads."""
    from .models.llama import decoding_params

    mesh = sharding.mesh_of(params)
    if mesh is not None:
        sharding.check_model_axis(cfg, mesh.shape["model"])
    params = decoding_params(params)
    if heads is None:  # plain decoding, or prompt lookup alone (the trivial tree with lookup settings)
        return params, None, None, tree if tree is not None else PLAIN_TREE
    heads_cfg, head_params = heads
    if tree.max_depth > 0:
        from .heads import prepare_heads
        from .models.llama import lm_head_matrix

        heads_cfg, head_params = prepare_heads(heads_cfg, head_params, lm_head_matrix(cfg, params),
                                               depth=tree.max_depth)
    if mesh is not None and sharding.mesh_of(head_params) != mesh:
        head_params = sharding.shard_params(head_params, mesh)
    return params, heads_cfg, head_params, tree


def generate_stream(cfg: ModelConfig, params, prompt: Sequence[int], *, max_new_tokens: int = 256,
                    heads: Optional[Tuple[MedusaConfig, dict]] = None, tree: Optional[TreeBuffers] = None,
                    acceptance: Acceptance = Acceptance(), seed: int = 0,
                    eos_token_ids: Optional[Sequence[int]] = None, cache_size: Optional[int] = None,
                    progress: bool = True,
                    _caller: str = "generate_stream") -> Generator[List[int], None, GenerationResult]:
    """Generate for one prompt, yielding the tokens accepted at each step.

    The arguments are checked here, before the generator is returned (`check_generation_args`).

    Args:
      prompt: token ids (chat template already applied): a list, a 1-D numpy / jax integer array
        or a [1, T] array.
      max_new_tokens: the most new tokens (>= 1).
      heads: (MedusaConfig, head params) or None for plain decoding.
      tree: the Medusa tree (`medusa_jax.tree.get_tree`), which may carry prompt-lookup settings
        (`medusa_jax.tree.with_lookup`); required with heads. Without heads only the trivial tree
        with prompt lookup is accepted (prompt lookup alone, for a model with no heads).
      acceptance: temperature 0 = greedy; > 0 = sampling, with exact acceptance by default (the
        output follows the model's own distribution) or ``method="typical"`` (`verify.Acceptance`).
      seed: PRNG seed (the key is PRNGKey(seed), as row 0 of a batch with this seed).
      eos_token_ids: ids that end the output (default ``cfg.eos_token_ids``); one id or a list.
      cache_size: S, at most the model's context (``cfg.max_position_embeddings``); default
        `cache_size_for` the prompt, budget and tree.
      progress: a progress bar on stderr for a long prefill (`start_state`); False: silent.
    Yields:
      lists of new token ids, one list per step (the EOS included, nothing after it).
    Returns (as the generator's value): a `GenerationResult`.
    Raises: ValueError for a misused argument (`check_generation_args`: an empty prompt, several
      prompts, ids outside the vocabulary, max_new_tokens < 1, a cache_size beyond the model's
      context, heads without a tree or a tree deeper than the heads...), PromptTooLongError,
      HeadsMismatchError.
    """
    (prompt,), eos = check_generation_args(cfg, prompt, caller=_caller, batch=False,
                                           max_new_tokens=max_new_tokens, cache_size=cache_size,
                                           heads=heads, tree=tree, eos_token_ids=eos_token_ids,
                                           acceptance=acceptance, seed=seed)
    params, heads_cfg, head_params, full_tree = _decoding_setup(cfg, params, heads, tree)
    S = cache_size or cache_size_for(cfg, len(prompt), max_new_tokens, full_tree.step_size)
    return _stream(cfg, params, prompt, max_new_tokens, heads_cfg, head_params, full_tree, acceptance,
                   seed, eos, S, progress)


def _stream(cfg: ModelConfig, params, prompt: List[int], max_new_tokens: int, heads_cfg, head_params,
            full_tree: TreeBuffers, acceptance: Acceptance, seed: int, eos: Tuple[int, ...], S: int,
            progress: bool) -> Generator[List[int], None, GenerationResult]:
    """The generator behind `generate_stream`, on checked arguments."""
    result = GenerationResult()
    timing: dict = {}
    state = start_state(cfg, params, [prompt], S, seed, timing=timing, progress=progress)
    result.prefill_s = timing["prefill_s"]
    length = len(prompt)
    t_decode = 0.0
    compiled = {}
    while len(result.tokens) < max_new_tokens:
        if length >= S:
            result.stop_reason = "cache_full"
            break
        tr = full_tree if length + full_tree.step_size <= S else PLAIN_TREE
        if tr not in compiled:
            compiled[tr] = _aot(step, (cfg, heads_cfg, tr, acceptance), (params, head_params, state))
        t1 = time.perf_counter()
        out, state = compiled[tr](params, head_params, state)
        toks, n = jax.device_get((out.tokens[0], out.num_tokens[0]))
        chunk = [int(t) for t in toks[:int(n)]]
        t_decode += time.perf_counter() - t1
        length += int(n)
        result.steps += 1
        chunk, hit_eos = _cut_at_eos(chunk, eos)
        chunk = chunk[:max_new_tokens - len(result.tokens)]
        result.tokens_per_step.append(len(chunk))
        result.tokens.extend(chunk)
        yield chunk
        if hit_eos and chunk and chunk[-1] in eos:
            result.stop_reason = "eos"
            break
    else:
        result.stop_reason = "max_new_tokens"
    result.decode_s = t_decode
    return result


def generate(cfg: ModelConfig, params, prompt: Sequence[int], *, on_tokens: Optional[Callable[[List[int]], None]] = None,
             **kw) -> GenerationResult:
    """`generate_stream` run to the end; `on_tokens` gets each step's tokens. Same arguments."""
    gen = generate_stream(cfg, params, prompt, _caller="generate", **kw)
    while True:
        try:
            chunk = next(gen)
        except StopIteration as stop:
            return stop.value
        if on_tokens is not None:
            on_tokens(chunk)


_COMPILED: dict = {}


def _aot(fn, static: tuple, args: tuple):
    """`fn` (a jitted function whose leading arguments are `static`) compiled ahead of time for
    these static values and argument shapes, cached, so that timings never include compilation.
    Arguments placed on a device mesh (`medusa_jax.sharding`) compile under that mesh, so the
    shardings the step constrains (the KV cache's) hold; the shardings are part of the cache key."""
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, getattr(a, "sharding", None)), args)
    key = (fn, static, str(shapes))
    compiled = _COMPILED.get(key)
    if compiled is None:
        mesh = sharding.mesh_of(args)
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            compiled = fn.lower(*static, *args).compile()
        _COMPILED[key] = compiled
    return compiled


class DeviceResult(NamedTuple):
    """Output of `generate_device` (B prompts).

    tokens: [B, max_new_tokens] int32 numpy; row b is valid up to ``count[b]``.
    count: [B] int32 new tokens per row (EOS included when it ended the row).
    steps: decoding steps (tree forwards) of the batch.
    hist: [D+1] int32; ``hist[n-1]`` counts the (row, step) pairs that emitted n tokens.
    prefill_s / decode_s: wall-clock seconds, compilation excluded.
    cache_sizes: the cache sizes S the loop ran with (it grows in power-of-two steps).
    """
    tokens: np.ndarray
    count: np.ndarray
    steps: int
    hist: np.ndarray
    prefill_s: float
    decode_s: float
    cache_sizes: Tuple[int, ...]


def _generate_loop(cfg: ModelConfig, heads_cfg: Optional[MedusaConfig], tree: TreeBuffers, acc: Acceptance,
                   max_new_tokens: int, eos: Tuple[int, ...], tail: bool, params, head_params, carry, final, limits):
    """One segment of on-device generation (lax.while_loop). See `generate_jit`."""
    state = carry[0]
    B = state.logits.shape[0]
    S = state.cache.size
    D = tree.max_accepted
    width = D + 1
    eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)
    step_limit, done_limit = limits[0], limits[1]

    def plain(st):
        o, s = medusa_step(cfg, None, PLAIN_TREE, acc, params, None, st)
        toks = jnp.pad(o.tokens, ((0, 0), (0, width - 1)))
        return StepOutput(toks, o.num_tokens), s

    def full(st):
        return medusa_step(cfg, heads_cfg, tree, acc, params, head_params, st)

    # one kind of step per segment: a lax.cond choosing between the tree step and a plain one made
    # XLA copy the KV cache every step (docs/performance.md); the host runs the plain tail apart
    plain_only = tail or D == 0
    room = 1 if plain_only else tree.step_size

    def fits(st):
        return jnp.all(st.cache.lengths + room <= S)

    def cond(c):
        st, _, _, done, steps, _, _ = c
        return (jnp.logical_not(jnp.all(done)) & (steps < step_limit) & (jnp.sum(done) < done_limit)
                & (fits(st) | (final & plain_only)))

    def body(c):
        st0, out, count, done, steps, hist, row_steps = c
        o, st = plain(st0) if plain_only else full(st0)
        # a finished row keeps its length: it computes on, but never grows out of its cache
        st = st.replace(cache=st.cache.replace(lengths=jnp.where(done, st0.cache.lengths, st.cache.lengths)))
        j = jnp.arange(width)[None, :]
        live = j < o.num_tokens[:, None]
        is_eos = jnp.isin(o.tokens, eos_arr) & live
        has_eos = jnp.any(is_eos, axis=1)
        n = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, o.num_tokens)
        n = jnp.minimum(n, max_new_tokens - count)
        n = jnp.where(done, 0, n)
        idx = jnp.where(j < n[:, None], count[:, None] + j, max_new_tokens)  # out of range -> dropped
        out = out.at[jnp.arange(B)[:, None], idx].set(o.tokens, mode="drop")
        hist = hist.at[o.num_tokens - 1].add(jnp.where(done, 0, 1))
        row_steps = row_steps + jnp.where(done, 0, 1)
        count = count + n
        done = done | (has_eos & (n > 0)) | (count >= max_new_tokens) | (final & (st.cache.lengths >= S))
        return _constrain_state(st), out, count, done, steps + 1, hist, row_steps

    return jax.lax.while_loop(cond, body, tuple(carry))


generate_jit = jax.jit(_generate_loop, static_argnums=(0, 1, 2, 3, 4, 5, 6), donate_argnames=("carry",))
generate_jit.__doc__ = """One segment of whole-generation-on-the-device: a lax.while_loop, no host sync per step.

Args (static first): cfg, heads_cfg (None for plain), tree (`PLAIN_TREE` for plain), acc,
  max_new_tokens, eos ids (tuple), tail (True: plain steps only, for the last cache slots where the
  tree no longer fits); then params, head_params, the loop carry (donated, `init_carry`)
  ``(DecodeState, out [B, max_new_tokens] int32, count [B] int32, done [B] bool, steps () int32,
  hist [D+1] int32, row_steps [B] int32)``, ``final`` (bool scalar: the cache is at its largest)
  and ``limits`` [2] int32 (step_limit, done_limit).
Every step of a segment is of one kind, the tree's or (plain decoding, ``tail``) a plain one: a
conditional between them made XLA copy the KV cache every step. The loop stops when every row is
done, when ``steps`` reaches step_limit, when done_limit rows are done (a row to refill:
`generate_batch`), or as soon as its step no longer fits in the cache: the caller then grows the
cache, or at the final size runs a ``tail`` segment, whose plain steps go on (with ``final``) until
each row's cache is full (the row is then done). A done row emits nothing more and its cache length
stays put. Use `generate_device` or `generate_batch`, which drive it.
Returns the carry after the segment.
"""


def init_carry(state: DecodeState, max_new_tokens: int, depth: int) -> tuple:
    """The `generate_jit` carry for a freshly prefilled `state` ([B] rows, nothing emitted)."""
    B = state.logits.shape[0]
    return (state, jnp.zeros((B, max_new_tokens), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
            jnp.int32(0), jnp.zeros((depth + 1,), jnp.int32), jnp.zeros((B,), jnp.int32))


def put_row(state: DecodeState, row: DecodeState, b: jax.Array) -> DecodeState:
    """`state` ([B] rows) with row b replaced by the B = 1 `row` (same cache size S): its cache,
    logits, hidden state, key and next token. Pure; jit it with `state` donated to update in place."""
    c, r = state.cache, row.cache
    cache = KVCache(k=c.k.at[:, b].set(r.k[:, 0]), v=c.v.at[:, b].set(r.v[:, 0]),
                    lengths=c.lengths.at[b].set(r.lengths[0]), tokens=c.tokens.at[b].set(r.tokens[0]))
    return DecodeState(logits=state.logits.at[b].set(row.logits[0]), hidden=state.hidden.at[b].set(row.hidden[0]),
                       cache=cache, key=state.key.at[b].set(row.key[0]),
                       next_token=state.next_token.at[b].set(row.next_token[0]))


def _insert_row(carry: tuple, row: DecodeState, b: jax.Array) -> tuple:
    """`carry` with row b replaced by the B = 1 prefilled `row` (`put_row`), nothing emitted."""
    st, out, count, done, steps, hist, row_steps = carry
    return (_constrain_state(put_row(st, row, b)), out, count.at[b].set(0), done.at[b].set(False), steps, hist,
            row_steps.at[b].set(0))


insert_row = jax.jit(_insert_row, donate_argnums=(0,))


def _grow_carry(carry: tuple, size: int) -> tuple:
    """`carry` with its cache padded to `size` slots, each array kept where it was (on a mesh:
    split as before)."""
    st = carry[0]
    old = st.cache
    new = grow_cache(old, size)
    new = KVCache(k=jax.device_put(new.k, old.k.sharding), v=jax.device_put(new.v, old.v.sharding),
                  lengths=new.lengths, tokens=jax.device_put(new.tokens, old.tokens.sharding))
    return (st.replace(cache=new),) + tuple(carry[1:])


def generate_device(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
                    heads: Optional[Tuple[MedusaConfig, dict]] = None, tree: Optional[TreeBuffers] = None,
                    acceptance: Acceptance = Acceptance(), seed: Union[int, Sequence[int]] = 0,
                    eos_token_ids: Optional[Sequence[int]] = None, cache_size: Optional[int] = None,
                    progress: bool = True) -> DeviceResult:
    """Generate for B prompts with the whole decoding loop on the device (the fast path).

    The KV cache starts just big enough for the longest prompt plus one tree (a power of two,
    >= 128 slots) and doubles whenever the tree no longer fits, up to `cache_size`; attention reads
    every slot, so a tight cache is faster. Each segment is one `generate_jit` call (compiled once
    per tree and cache size; the cache is donated); the host syncs only between segments.
    Same stopping rules and the same output as `generate` (token for token in greedy mode).

    Args: as `generate_stream` (``prompts`` is a list of token-id lists; ``cache_size`` is the
      largest cache, default `cache_size_for` the longest prompt; ``seed`` an int, row b then
      drawing with PRNGKey(seed + b), or one int per row: a row's samples never depend on the other
      rows of its batch).
    Returns: `DeviceResult`.
    Raises: as `generate_stream` (``prompts`` must be a batch: a flat list of ids is refused).
    """
    prompts, eos = check_generation_args(cfg, prompts, caller="generate_device", batch=True,
                                         max_new_tokens=max_new_tokens, cache_size=cache_size,
                                         heads=heads, tree=tree, eos_token_ids=eos_token_ids,
                                         acceptance=acceptance, seed=seed)
    params, heads_cfg, head_params, tr = _decoding_setup(cfg, params, heads, tree)
    longest = max(len(p) for p in prompts)
    s_max = cache_size or cache_size_for(cfg, longest, max_new_tokens, tr.step_size)
    S = min(bucket(longest + tr.step_size + 1, 128), s_max)
    timing: dict = {}
    state = start_state(cfg, params, prompts, S, seed, timing=timing, progress=progress)
    B = len(prompts)
    carry = init_carry(state, max_new_tokens, tr.max_accepted)
    limits = jnp.asarray([max_new_tokens, B + 1], jnp.int32)
    sizes = [S]
    tail = tr.max_accepted == 0  # plain decoding: every segment is plain
    t0, compile_s = None, 0.0
    while True:
        final = S >= s_max
        static = (cfg, heads_cfg, tr, acceptance, max_new_tokens, eos, tail)
        args = (params, head_params, carry, jnp.bool_(final), limits)
        tc = time.perf_counter()
        fn = _aot(generate_jit, static, args)  # compiled once per tree, cache size and kind, never timed
        if t0 is None:
            t0 = time.perf_counter()
        else:
            compile_s += time.perf_counter() - tc
        carry = fn(*args)
        done, steps = jax.device_get((carry[3], carry[4]))
        if bool(np.all(done)) or int(steps) >= max_new_tokens or (final and tail):
            break
        if final:  # the tree no longer fits in the largest cache: plain steps to the end
            tail = True
            continue
        S = min(S * 2, s_max)
        sizes.append(S)
        carry = _grow_carry(carry, S)
    _, out, count, _, steps, hist, _ = jax.block_until_ready(carry)
    decode_s = time.perf_counter() - t0 - compile_s
    return DeviceResult(tokens=np.asarray(out), count=np.asarray(count), steps=int(steps), hist=np.asarray(hist),
                        prefill_s=timing["prefill_s"], decode_s=decode_s, cache_sizes=tuple(sizes))


class BatchStats(NamedTuple):
    """What `generate_batch` returns when it is done.

    wall_s: seconds from the first prefill to the last token, compilation excluded (prefills of
      refilled rows included: the other rows wait for them).
    steps: decoding steps of the batch; hist: [D+1] int32, ``hist[n-1]`` = (row, step) pairs that
      emitted n tokens; cache_sizes: the cache sizes S the loop ran with, in order.
    """
    wall_s: float
    steps: int
    hist: np.ndarray
    cache_sizes: Tuple[int, ...]


def _stop_reason(tokens: List[int], eos: Tuple[int, ...], max_new_tokens: int) -> str:
    if tokens and tokens[-1] in eos:
        return "eos"
    return "max_new_tokens" if len(tokens) >= max_new_tokens else "cache_full"


def generate_batch(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, batch_size: int = 8,
                   max_new_tokens: int = 256, heads: Optional[Tuple[MedusaConfig, dict]] = None,
                   tree: Optional[TreeBuffers] = None, acceptance: Acceptance = Acceptance(),
                   seed: Union[int, Sequence[int]] = 0, eos_token_ids: Optional[Sequence[int]] = None,
                   cache_size: Optional[int] = None,
                   progress: bool = True) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """Decode many prompts, `batch_size` rows at a time, refilling a row as soon as it finishes
    (continuous batching), with the decoding loop on the device between refills.

    Every row accepts its own number of tokens per step. The on-device loop (`generate_jit`) runs
    until a row finishes while prompts are waiting; the host then reads that row's answer, prefills
    the next prompt into it (the other rows wait for that prefill) and starts the loop again. The
    cache starts just big enough and doubles when the tree no longer fits, up to `cache_size`, as
    in `generate_device`; a row's output does not depend on the batch it ran in (greedy: up to
    float32 round-off; sampling: prompt i always draws with PRNGKey(seed + i)), except that near a
    full cache (`cache_size`, or the model's context, below prompt + max_new_tokens + tree) the
    whole batch falls back to plain steps together, so a sampled row's draws there can differ from
    its batch-1 run (its distribution does not).

    Args:
      prompts: N token-id lists (chat template applied), N >= 1.
      batch_size: rows decoded together (>= 1; at most N are used).
      seed: an int (prompt i draws with PRNGKey((seed + i) mod 2**31), `sampling.prompt_seed`) or
        one int per prompt.
      others: as `generate_device`; `cache_size` defaults to `cache_size_for` the longest prompt.
    Yields:
      (i, GenerationResult) as prompt i finishes (completion order, not input order); the result's
      ``decode_s`` is the wall time the row spent in the batch, ``prefill_s`` its prefill's (a
      shared batch prefill for the first rows), ``tokens_per_step`` is left empty.
    Returns (the generator's value): `BatchStats`.
    Raises: as `generate_device` (checked before the generator is returned), and ValueError for
      batch_size < 1.
    """
    prompts, eos = check_generation_args(cfg, prompts, caller="generate_batch", batch=True,
                                         max_new_tokens=max_new_tokens, cache_size=cache_size, heads=heads,
                                         tree=tree, eos_token_ids=eos_token_ids, acceptance=acceptance, seed=seed)
    if _as_int(batch_size, "batch_size") < 1:
        raise ValueError(f"generate_batch(): batch_size must be >= 1, got {batch_size}")
    seeds = row_seeds(seed, len(prompts))  # seeds out of range fail here, before anything runs
    params, heads_cfg, head_params, tr = _decoding_setup(cfg, params, heads, tree)
    return _batch_loop(cfg, params, heads_cfg, head_params, tr, prompts, seeds, min(batch_size, len(prompts)),
                       max_new_tokens, acceptance, eos, cache_size, progress)


def _batch_loop(cfg, params, heads_cfg, head_params, tr: TreeBuffers, prompts: List[List[int]], seeds: List[int],
                B: int, max_new_tokens: int, acceptance: Acceptance, eos: Tuple[int, ...],
                cache_size: Optional[int], progress: bool) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """The generator behind `generate_batch`, on checked arguments."""
    N = len(prompts)
    s_max = cache_size or cache_size_for(cfg, max(len(p) for p in prompts), max_new_tokens, tr.step_size)

    def room(n: int) -> int:  # the cache a prompt of n tokens needs for one tree step
        return min(bucket(n + tr.step_size + 1, 128), s_max)

    overhead = 0.0  # compilation seconds, left out of every timing

    def clock() -> float:
        return time.perf_counter() - overhead

    S = room(max(len(p) for p in prompts[:B]))
    timing: dict = {}
    t = time.perf_counter()
    state = start_state(cfg, params, prompts[:B], S, seeds[:B], timing=timing, progress=False)
    overhead += time.perf_counter() - t - timing["prefill_s"]
    t_begin = clock() - timing["prefill_s"]
    carry = init_carry(state, max_new_tokens, tr.max_accepted)
    rows: List[Optional[int]] = list(range(B))  # the prompt in each row; None: retired
    started = [clock()] * B
    prefill_s = [timing["prefill_s"]] * B
    next_i = B  # the next prompt to start
    sizes = [S]
    bar = _progress_bar(progress, N, "decode", "prompt")
    steps = 0
    tail = tr.max_accepted == 0  # plain steps only (plain decoding, or the tree no longer fits)
    while any(r is not None for r in rows):
        final = S >= s_max
        static = (cfg, heads_cfg, tr, acceptance, max_new_tokens, eos, tail)
        done0 = sum(r is None for r in rows)  # at a segment's start only retired rows are done
        limits = jnp.asarray([steps + max_new_tokens, done0 + 1 if next_i < N else B + 1], jnp.int32)
        args = (params, head_params, carry, jnp.bool_(final), limits)
        t = time.perf_counter()
        fn = _aot(generate_jit, static, args)
        overhead += time.perf_counter() - t
        carry = fn(*args)
        done, count, steps, row_steps = jax.device_get((carry[3], carry[2], carry[4], carry[6]))
        steps = int(steps)
        finished = [b for b in range(B) if rows[b] is not None and done[b]]
        if not finished:
            if final and not tail:  # the tree no longer fits in the largest cache: plain steps
                tail = True
                continue
            if final:
                raise RuntimeError("generate_batch: the decoding loop stopped with no row done")  # a bug
            S = min(S * 2, s_max)
            sizes.append(S)
            carry = _grow_carry(carry, S)
            continue
        out = jax.device_get(carry[1])
        now = clock()
        tail = tr.max_accepted == 0  # a finished row may leave room for the tree again
        for b in finished:
            toks = [int(x) for x in out[b, :count[b]]]
            res = GenerationResult(tokens=toks, steps=int(row_steps[b]), prefill_s=prefill_s[b],
                                   decode_s=now - started[b], stop_reason=_stop_reason(toks, eos, max_new_tokens))
            i = rows[b]
            rows[b] = None
            if next_i < N:
                i_new, next_i = next_i, next_i + 1
                need = room(len(prompts[i_new]))
                if need > S:
                    S = need
                    sizes.append(S)
                    carry = _grow_carry(carry, S)
                timing = {}
                t = time.perf_counter()
                row = start_state(cfg, params, [prompts[i_new]], S, [seeds[i_new]], timing=timing, progress=False)
                b_arr = jnp.int32(b)
                carry = _aot(insert_row, (), (carry, row, b_arr))(carry, row, b_arr)
                jax.block_until_ready(carry[0].logits)
                overhead += time.perf_counter() - t - timing["prefill_s"]
                rows[b], started[b], prefill_s[b] = i_new, clock(), timing["prefill_s"]
            if bar is not None:
                bar.update(1)
            yield i, res
    if bar is not None:
        bar.close()
    hist = jax.device_get(carry[5])
    return BatchStats(wall_s=clock() - t_begin, steps=steps, hist=np.asarray(hist), cache_sizes=tuple(sizes))
