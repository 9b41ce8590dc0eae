"""Prefill, plain decoding and Medusa decoding, streaming (host loop) and fully jitted (lax.while_loop).

Plain decoding is the Medusa step with the trivial tree (the root alone: one token per step, no
heads), so both paths share one tested step function (`medusa_jax.decoding.step.medusa_step`).

Stopping rules, shared by every path so that Medusa greedy output equals plain greedy output:
an EOS token ends the output (the EOS is included), ``max_new_tokens`` caps it, and the sequence
(prompt + output) never exceeds the cache size S.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import sharding
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import as_int, check_generation_args
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.loop import generate_jit, grow_carry, init_carry, insert_row
from medusa_jax.decoding.prefill import bucket, cache_size_for, progress_bar, start_state
from medusa_jax.decoding.sampling import prompt_seed, row_seeds
from medusa_jax.decoding.step import step
from medusa_jax.decoding.tree import PLAIN_TREE, TreeBuffers
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import prepare_heads
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import decoding_params, lm_head_matrix


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


def _cut_at_eos(chunk: List[int], eos: Sequence[int]) -> Tuple[List[int], bool]:
    for i, t in enumerate(chunk):
        if t in eos:
            return chunk[:i + 1], True
    return chunk, False


def decoding_setup(cfg: ModelConfig, params, heads, tree: Optional[TreeBuffers]):
    """(params in decoding layout, heads_cfg or None, head params or None, the tree to run:
    `PLAIN_TREE` without heads), from arguments that `check_generation_args` accepted.

    The backbone's params go to decoding layout once (`models.llama.decoding_params`, cached per
    params tree: the weight-streaming kernels' ``[out, in]`` layout when they are available).
    Heads are readied for the tree once, here (`heads.medusa.prepare_heads`; heads from
    `resolve.resolve_heads` pass through unchanged), so that heads straight from `load_heads` do
    not slice or gather their weights in every step.

    Params placed on a device mesh (`sharding.shard_params`) keep their layout (the CPU kernels do
    not run on a mesh; XLA splits the products) and the heads are placed on the same mesh.
    Raises ValueError when the mesh's model axis does not divide the attention heads."""

    mesh = sharding.mesh_of(params)
    if mesh is not None:
        sharding.check_model_axis(cfg, mesh.shape["model"])
    params = decoding_params(params)
    if heads is None:  # plain decoding, or prompt lookup alone (the trivial tree with lookup settings)
        return params, None, None, tree if tree is not None else PLAIN_TREE
    heads_cfg, head_params = heads
    if tree.max_depth > 0:

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
      tree: the Medusa tree (`medusa_jax.decoding.tree.get_tree`), which may carry prompt-lookup settings
        (`medusa_jax.decoding.tree.with_lookup`); required with heads. Without heads only the trivial tree
        with prompt lookup is accepted (prompt lookup alone, for a model with no heads).
      acceptance: temperature 0 = greedy; > 0 = sampling, with exact acceptance by default (the
        output follows the model's own distribution) or ``method="typical"`` (`decoding.acceptance.Acceptance`).
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
    params, heads_cfg, head_params, full_tree = decoding_setup(cfg, params, heads, tree)
    S = cache_size or cache_size_for(cfg, len(prompt), max_new_tokens, full_tree.step_size)
    return _stream(cfg, params, prompt, max_new_tokens, heads_cfg, head_params, full_tree, acceptance,
                   seed, eos, S, progress)


def _stream(cfg: ModelConfig, params, prompt: List[int], max_new_tokens: int, heads_cfg, head_params,
            full_tree: TreeBuffers, acceptance: Acceptance, seed: int, eos: Tuple[int, ...], S: int,
            progress: bool) -> Generator[List[int], None, GenerationResult]:
    """The generator behind `generate_stream`, on checked arguments."""
    result = GenerationResult()
    timing: dict = {}
    state = start_state(cfg, params, [prompt], S, seed, timing=timing, progress=progress,
                        temperature=acceptance.temperature, top_p=acceptance.top_p)
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
            compiled[tr] = aot(step, (cfg, heads_cfg, tr, acceptance), (params, head_params, state))
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
    params, heads_cfg, head_params, tr = decoding_setup(cfg, params, heads, tree)
    longest = max(len(p) for p in prompts)
    s_max = cache_size or cache_size_for(cfg, longest, max_new_tokens, tr.step_size)
    S = min(bucket(longest + tr.step_size + 1, 128), s_max)
    timing: dict = {}
    state = start_state(cfg, params, prompts, S, seed, timing=timing, progress=progress,
                        temperature=acceptance.temperature, top_p=acceptance.top_p)
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
        fn = aot(generate_jit, static, args)  # compiled once per tree, cache size and kind, never timed
        if t0 is None:
            t0 = time.perf_counter()
        else:
            compile_s += time.perf_counter() - tc
        carry = fn(*args)
        done, steps = jax.device_get((carry.done, carry.steps))
        if bool(np.all(done)) or int(steps) >= max_new_tokens or (final and tail):
            break
        if final:  # the tree no longer fits in the largest cache: plain steps to the end
            tail = True
            continue
        S = min(S * 2, s_max)
        sizes.append(S)
        carry = grow_carry(carry, S)
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


def generate_batch(cfg: ModelConfig, params, prompts: Iterable[Sequence[int]], *, batch_size: int = 8,
                   max_new_tokens: int = 256, heads: Optional[Tuple[MedusaConfig, dict]] = None,
                   tree: Optional[TreeBuffers] = None, acceptance: Acceptance = Acceptance(),
                   seed: Union[int, Sequence[int]] = 0, eos_token_ids: Optional[Sequence[int]] = None,
                   cache_size: Optional[int] = None,
                   progress: bool = True) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """Decode many prompts, `batch_size` rows at a time, refilling a row as soon as it finishes
    (continuous batching), with the decoding loop on the device between refills.

    Every row accepts its own number of tokens per step. The on-device loop (`generate_jit`) runs
    until a row finishes while prompts may be waiting; the host then hands that row's answer to the
    caller (the yield), takes the next prompt, prefills it into the row (the other rows wait for that
    prefill) and starts the loop again. The cache starts just big enough and doubles when the tree no
    longer fits, up to `cache_size`, as in `generate_device`; a row's output does not depend on the
    batch it ran in (greedy: up to float32 round-off; sampling: prompt i always draws with
    PRNGKey(seed + i)), except that near a full cache (`cache_size`, or the model's context, below
    prompt + max_new_tokens + tree) the whole batch falls back to plain steps together, so a sampled
    row's draws there can differ from its batch-1 run (its distribution does not).

    Args:
      prompts: N token-id lists (chat template applied), N >= 1: a list (or [N, T] array), checked
        before the generator is returned; or any other iterable (e.g. a generator), read lazily: the
        next prompt is taken only when a row is free and the previous answer has been yielded, so
        the caller may decide, from the answers so far, to end it (self-distillation's token
        target); each prompt is then checked as it is taken.
      batch_size: rows decoded together (>= 1; at most N are used).
      seed: an int (prompt i draws with PRNGKey((seed + i) mod 2**31), `decoding.sampling.prompt_seed`) or
        one int per prompt (a list of prompts only).
      cache_size: the largest cache; default `cache_size_for` the longest prompt of a list, the
        model's context for lazily read prompts.
      others: as `generate_device`.
    Yields:
      (i, GenerationResult) as prompt i finishes (completion order, not input order); the result's
      ``decode_s`` is the wall time the row spent in the batch, ``prefill_s`` its prefill's (a
      shared batch prefill for the first rows), ``tokens_per_step`` is left empty.
    Returns (the generator's value): `BatchStats`.
    Raises: as `generate_device` (checked before the generator is returned; for lazily read prompts
      the prompt checks raise when the prompt is taken), and ValueError for batch_size < 1.
    """
    lazy = not isinstance(prompts, (Sequence, np.ndarray, jax.Array))
    checked, eos = check_generation_args(cfg, [[0]] if lazy else prompts, caller="generate_batch", batch=True,
                                         max_new_tokens=max_new_tokens, cache_size=cache_size, heads=heads,
                                         tree=tree, eos_token_ids=eos_token_ids, acceptance=acceptance,
                                         seed=0 if lazy and isinstance(seed, (int, np.integer)) else seed)
    if as_int(batch_size, "batch_size") < 1:
        raise ValueError(f"generate_batch(): batch_size must be >= 1, got {batch_size}")
    if lazy:
        if not isinstance(seed, (int, np.integer)):
            raise ValueError("generate_batch(): one seed per prompt needs a list of prompts; with prompts read "
                             "lazily give one int seed (prompt i draws with seed + i)")
        row_seeds(seed, 1)  # a seed out of range fails here, before anything runs
        source = _checked_prompts(cfg, iter(prompts), cache_size, seed)
    else:
        seeds = row_seeds(seed, len(checked))  # seeds out of range fail here, before anything runs
        source = iter(zip(checked, seeds))
        batch_size = min(batch_size, len(checked))
    s_max = cache_size or (cfg.max_position_embeddings if lazy else None)
    params, heads_cfg, head_params, tr = decoding_setup(cfg, params, heads, tree)
    if s_max is None:
        s_max = cache_size_for(cfg, max(len(p) for p in checked), max_new_tokens, tr.step_size)
    return _batch_loop(cfg, params, heads_cfg, head_params, tr, source, None if lazy else len(checked), s_max,
                       batch_size, max_new_tokens, acceptance, eos, progress)


def _checked_prompts(cfg: ModelConfig, prompts: Iterator, cache_size: Optional[int],
                     seed: int) -> Iterator[Tuple[List[int], int]]:
    """(prompt ids, seed) of lazily read prompts, each checked as it is taken (`check_generation_args`)."""
    for i, p in enumerate(prompts):
        try:
            (ids,), _ = check_generation_args(cfg, [p], caller="generate_batch", batch=True, cache_size=cache_size,
                                              check_decoding=False)
        except ValueError as e:
            raise type(e)(f"prompt {i}: {e}") from None
        yield ids, prompt_seed(seed, i)


def _batch_loop(cfg, params, heads_cfg, head_params, tr: TreeBuffers, source: Iterator[Tuple[List[int], int]],
                total: Optional[int], s_max: int, batch_size: int, max_new_tokens: int, acceptance: Acceptance,
                eos: Tuple[int, ...], progress: bool) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """The generator behind `generate_batch`, on checked arguments: (ids, seed) of each prompt from
    `source`, `total` of them when known."""
    def room(n: int) -> int:  # the cache a prompt of n tokens needs for one tree step
        return min(bucket(n + tr.step_size + 1, 128), s_max)

    overhead = 0.0  # compilation seconds, left out of every timing

    def clock() -> float:
        return time.perf_counter() - overhead

    first = list(itertools.islice(source, batch_size))
    # more prompts may come (a lazy source is read one prompt at a time)
    waiting = len(first) < total if total is not None else len(first) == batch_size
    if not first:
        return BatchStats(wall_s=0.0, steps=0, hist=np.zeros((tr.max_accepted + 1,), np.int32), cache_sizes=())
    B = len(first)
    S = room(max(len(p) for p, _ in first))
    timing: dict = {}
    t = time.perf_counter()
    state = start_state(cfg, params, [p for p, _ in first], S, [s for _, s in first], timing=timing, progress=False,
                        temperature=acceptance.temperature, top_p=acceptance.top_p)
    overhead += time.perf_counter() - t - timing["prefill_s"]
    t_begin = clock() - timing["prefill_s"]
    carry = init_carry(state, max_new_tokens, tr.max_accepted)
    rows: List[Optional[int]] = list(range(B))  # the prompt in each row; None: retired
    started = [clock()] * B
    prefill_s = [timing["prefill_s"]] * B
    next_i = B  # the index of the next prompt
    sizes = [S]
    bar = progress_bar(progress, total, "decode", "prompt")
    steps = 0
    tail = tr.max_accepted == 0  # plain steps only (plain decoding, or the tree no longer fits)
    while any(r is not None for r in rows):
        final = S >= s_max
        static = (cfg, heads_cfg, tr, acceptance, max_new_tokens, eos, tail)
        done0 = sum(r is None for r in rows)  # at a segment's start only retired rows are done
        limits = jnp.asarray([steps + max_new_tokens, done0 + 1 if waiting else B + 1], jnp.int32)
        args = (params, head_params, carry, jnp.bool_(final), limits)
        t = time.perf_counter()
        fn = aot(generate_jit, static, args)
        overhead += time.perf_counter() - t
        carry = fn(*args)
        done, count, steps, row_steps = jax.device_get((carry.done, carry.count, carry.steps, carry.row_steps))
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
            carry = grow_carry(carry, S)
            continue
        out = jax.device_get(carry.out)
        now = clock()
        tail = tr.max_accepted == 0  # a finished row may leave room for the tree again
        for b in finished:
            toks = [int(x) for x in out[b, :count[b]]]
            res = GenerationResult(tokens=toks, steps=int(row_steps[b]), prefill_s=prefill_s[b],
                                   decode_s=now - started[b], stop_reason=_stop_reason(toks, eos, max_new_tokens))
            i, rows[b] = rows[b], None
            if bar is not None:
                bar.update(1)
            yield i, res  # before the next prompt is taken: the caller may end a lazy source
            nxt = next(source, None) if waiting else None
            if nxt is None:
                waiting = False
                continue
            ids, row_seed = nxt
            need = room(len(ids))
            if need > S:
                S = need
                sizes.append(S)
                carry = grow_carry(carry, S)
            timing = {}
            t = time.perf_counter()
            row = start_state(cfg, params, [ids], S, [row_seed], timing=timing, progress=False,
                              temperature=acceptance.temperature, top_p=acceptance.top_p)
            b_arr = jnp.int32(b)
            carry = aot(insert_row, (), (carry, row, b_arr))(carry, row, b_arr)
            jax.block_until_ready(carry.state.logits)
            overhead += time.perf_counter() - t - timing["prefill_s"]
            rows[b], started[b], prefill_s[b], next_i = next_i, clock(), timing["prefill_s"], next_i + 1
            waiting = total is None or next_i < total
    if bar is not None:
        bar.close()
    hist = jax.device_get(carry.hist)
    return BatchStats(wall_s=clock() - t_begin, steps=steps, hist=np.asarray(hist), cache_sizes=tuple(sizes))
