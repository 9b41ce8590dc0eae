"""Prefill, plain decoding and Medusa decoding, streaming (host loop) and fully jitted (lax.while_loop).

Plain decoding is the Medusa step with the trivial tree (the root alone: one token per step, no
heads), so both paths share one tested step function (`medusa_jax.decoding.step.medusa_step`).

Stopping rules, shared by every path so that Medusa greedy output equals plain greedy output:
an EOS token ends the output (the EOS is included), ``max_new_tokens`` caps it, and the sequence
(prompt + output) never exceeds the cache size S.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import (Callable, Generator, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import as_int, check_generation_args
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.prefill import bucket, cache_size_for, progress_bar, start_state
from medusa_jax.decoding.requests import PENALTY_FIELDS, Finished, Request
from medusa_jax.decoding.sampling import prompt_seed, row_seeds
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.decoding.step import StepConfig
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.drafts import drafter_for
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.loop import generate_jit, grow_carry, init_carry
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig


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




def generate_stream(cfg: ModelConfig, params, prompt: Sequence[int], *, max_new_tokens: int = 256,
                    heads: Optional[Tuple[MedusaConfig, dict]] = None, tree: Optional[TreeBuffers] = None,
                    acceptance: Acceptance = Acceptance(), seed: int = 0,
                    eos_token_ids: Optional[Sequence[int]] = None, cache_size: Optional[int] = None,
                    progress: bool = True, penalties: Optional[Mapping[str, float]] = None,
                    logit_bias: Optional[Mapping[int, float]] = None, min_tokens: int = 0,
                    allowed_token_ids: Optional[Sequence[int]] = None,
                    bad_words: Optional[Sequence[Sequence[int]]] = None,
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
      penalties: `SamplingParams` fields by name, any of min_p, presence_penalty, frequency_penalty
        and repetition_penalty (vLLM's meanings: `decoding.processors`); greedy output with them
        stays plain greedy's with them.
      logit_bias, min_tokens, allowed_token_ids, bad_words: as the engine's `decoding.requests.Request`
        takes them (OpenAI's ``logit_bias``; vLLM's ``min_tokens``, ``allowed_token_ids`` and
        ``bad_words`` as token-id sequences); Medusa's verification applies them too, so greedy
        output stays plain greedy's with them.
    Yields:
      lists of new token ids, one list per step (the EOS included, nothing after it).
    Returns (as the generator's value): a `GenerationResult`.
    Raises: ValueError for a misused argument (`check_generation_args`: an empty prompt, several
      prompts, ids outside the vocabulary, max_new_tokens < 1, a cache_size beyond the model's
      context, heads without a tree or a tree deeper than the heads, an unknown or out-of-range
      penalty, a logit_bias, min_tokens, allowed or banned id outside the vocabulary or its range
      (`decoding.args.checked_request`)...), PromptTooLongError, HeadsMismatchError.
    """
    (prompt,), eos = check_generation_args(cfg, prompt, caller=_caller, batch=False,
                                           max_new_tokens=max_new_tokens, cache_size=cache_size,
                                           heads=heads, tree=tree, eos_token_ids=eos_token_ids,
                                           acceptance=acceptance, seed=seed)
    step_size = tree.step_size if tree is not None else 1
    S = cache_size or cache_size_for(cfg, len(prompt), max_new_tokens, step_size)
    engine = Engine(cfg, params, heads=heads, tree=tree, max_batch=1, max_len=S, speculation="always",
                    acceptance=acceptance.method if acceptance.mode != "greedy" else "exact",
                    posterior_threshold=acceptance.posterior_threshold, posterior_alpha=acceptance.posterior_alpha,
                    eos_token_ids=eos, progress=progress)
    make = _request_maker(engine, _caller, max_new_tokens, acceptance, penalties, logit_bias, min_tokens,
                          allowed_token_ids, bad_words)
    return _stream(engine, engine.check(make(prompt, seed)))


def _request_maker(engine: Engine, caller: str, max_new_tokens: int, acceptance: Acceptance,
                   penalties: Optional[Mapping[str, float]],
                   logit_bias: Optional[Mapping[int, float]], min_tokens: int,
                   allowed_token_ids: Optional[Sequence[int]], bad_words: Optional[Sequence[Sequence[int]]]
                   ) -> Callable[..., Request]:
    """A function (prompt, seed, request_id=None) -> the engine `Request` of `max_new_tokens` with
    these settings, after checking them on a one-token prompt (ValueError naming `caller` for an
    unknown penalty; the engine's own checks, `decoding.args.checked_request`, for the values)."""
    unknown = sorted(set(penalties or ()) - set(PENALTY_FIELDS))
    if unknown:
        raise ValueError(f"{caller}: unknown penalties {', '.join(unknown)} (give any of {', '.join(PENALTY_FIELDS)})")

    def make(prompt: Sequence[int], seed: int, request_id: Optional[str] = None) -> Request:
        return Request(prompt, max_new_tokens, acceptance.sampling(seed)._replace(**(penalties or {})),
                       request_id=request_id, logit_bias=logit_bias, min_tokens=min_tokens,
                       allowed_token_ids=allowed_token_ids, bad_words=bad_words)
    engine.check(make([0], 0))  # the settings alone, before anything runs
    return make


def _stream(engine: Engine, request: Request) -> Generator[List[int], None, GenerationResult]:
    """The generator behind `generate_stream`: one request through the engine, in this thread."""
    events: List[Tuple[str, object]] = []
    engine.submit(request, on_event=lambda kind, payload: events.append((kind, payload)))
    result = GenerationResult()
    while True:
        engine.step()
        for kind, payload in events:
            if kind == "tokens":
                result.tokens_per_step.append(len(payload))
                yield payload
            else:
                return _result(payload)
        events.clear()


_STOP_REASONS = {"length": "max_new_tokens"}


def _result(fin: Finished) -> GenerationResult:
    """A `GenerationResult` of the engine's `Finished`."""
    if fin.reason == "error":
        raise RuntimeError(f"decoding failed: {fin.error}")
    return GenerationResult(tokens=list(fin.tokens), steps=fin.steps, tokens_per_step=list(fin.step_tokens),
                            prefill_s=fin.prefill_s, decode_s=fin.decode_s,
                            stop_reason=_STOP_REASONS.get(fin.reason, fin.reason))


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
                        temperature=acceptance.temperature, top_p=acceptance.top_p, top_k=acceptance.top_k)
    B = len(prompts)
    carry = init_carry(state, max_new_tokens, tr.max_accepted)
    limits = jnp.asarray([max_new_tokens, B + 1], jnp.int32)
    sizes = [S]
    tail = tr.max_accepted == 0  # plain decoding: every segment is plain
    t0, compile_s = None, 0.0
    while True:
        final = S >= s_max
        static = (StepConfig(cfg, heads_cfg, drafter_for(tr), acceptance), max_new_tokens, eos, tail)
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


def generate_batch(cfg: ModelConfig, params, prompts: Iterable[Sequence[int]], *, batch_size: int = 8,
                   max_new_tokens: int = 256, heads: Optional[Tuple[MedusaConfig, dict]] = None,
                   tree: Optional[TreeBuffers] = None, acceptance: Acceptance = Acceptance(),
                   seed: Union[int, Sequence[int]] = 0, eos_token_ids: Optional[Sequence[int]] = None,
                   cache_size: Optional[int] = None, speculation: str = "always",
                   progress: bool = True, penalties: Optional[Mapping[str, float]] = None,
                   logit_bias: Optional[Mapping[int, float]] = None, min_tokens: int = 0,
                   allowed_token_ids: Optional[Sequence[int]] = None,
                   bad_words: Optional[Sequence[Sequence[int]]] = None,
                   ) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """Decode many prompts, `batch_size` rows at a time, a finished row taking the next prompt
    (continuous batching), through the step-level engine (`engine.engine.Engine`).

    Every row accepts its own number of tokens per step, and a row's answer does not depend on the
    batch it ran in: greedy rows are plain greedy's (up to float32 round-off), sampled rows are plain
    sampling's for prompt i's seed (`decoding.sampling`: each position's token is chosen by that
    position's key).

    Args:
      prompts: N token-id lists (chat template applied), N >= 1: a list (or [N, T] array), checked
        before the generator is returned; or any other iterable (e.g. a generator), read lazily: the
        next prompt is taken only when a row is free and the previous answer has been yielded, so
        the caller may decide, from the answers so far, to end it (self-distillation's token
        target); each prompt is then checked as it is taken.
      batch_size: rows decoded together (>= 1).
      seed: an int (prompt i samples with seed (seed + i) mod 2**31, `decoding.sampling.prompt_seed`)
        or one int per prompt (a list of prompts only).
      cache_size: the most cache slots per row; default `cache_size_for` the longest prompt of a
        list, the model's context for lazily read prompts.
      speculation: "always" (the tree every step), "adaptive" (the engine chooses per step by
        measured speed) or "off" (plain steps).
      penalties, logit_bias, min_tokens, allowed_token_ids, bad_words: for every prompt, as
        `generate_stream` takes them (greedy rows stay plain greedy's with them).
      others: as `generate_device`.
    Yields:
      (i, GenerationResult) as prompt i finishes (completion order, not input order); the result's
      ``decode_s`` is the compute time of the steps the row took part in, ``prefill_s`` its
      prefill's.
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
        s_max = cache_size or cfg.max_position_embeddings
    else:
        seeds = row_seeds(seed, len(checked))  # seeds out of range fail here, before anything runs
        source = iter(zip(checked, seeds))
        step_size = tree.step_size if tree is not None else 1
        s_max = cache_size or cache_size_for(cfg, max(len(p) for p in checked), max_new_tokens, step_size)
    engine = Engine(cfg, params, heads=heads, tree=tree, max_batch=int(batch_size), max_len=s_max,
                    speculation=speculation, acceptance=acceptance.method if acceptance.mode != "greedy" else "exact",
                    posterior_threshold=acceptance.posterior_threshold, posterior_alpha=acceptance.posterior_alpha,
                    eos_token_ids=eos, progress=False)
    make = _request_maker(engine, "generate_batch()", max_new_tokens, acceptance, penalties, logit_bias, min_tokens,
                          allowed_token_ids, bad_words)
    return _batch_loop(engine, source, None if lazy else len(checked), batch_size, make, progress)


def _checked_prompts(cfg: ModelConfig, prompts: Iterator, cache_size: Optional[int],
                     seed: int) -> Iterator[Tuple[List[int], int]]:
    """(prompt ids, seed) of lazily read prompts, each checked as it is taken (`check_generation_args`)."""
    for i, p in enumerate(prompts):
        (ids,), _ = check_generation_args(cfg, [p], caller="generate_batch", batch=True, cache_size=cache_size,
                                          check_decoding=False, first_index=i)
        yield ids, prompt_seed(seed, i)


def _batch_loop(engine: Engine, source: Iterator[Tuple[List[int], int]], total: Optional[int], batch_size: int,
                make: Callable[..., Request],
                progress: bool) -> Generator[Tuple[int, GenerationResult], None, BatchStats]:
    """The generator behind `generate_batch`: keeps `batch_size` prompts of `source` ((ids, seed)
    each, `total` of them when known) in the engine as `make`'s requests, the next one submitted once
    an answer is out."""
    done: List[Tuple[int, Finished]] = []
    in_flight = 0
    next_i = 0
    bar = progress_bar(progress, total, "decode", "prompt")
    t0 = time.perf_counter()

    def take() -> bool:
        nonlocal in_flight, next_i
        nxt = next(source, None)
        if nxt is None:
            return False
        ids, row_seed = nxt
        i = next_i
        engine.submit(make(ids, row_seed, str(i)),
                      on_event=lambda kind, payload: done.append((i, payload)) if kind == "done" else None)
        in_flight, next_i = in_flight + 1, next_i + 1
        return True

    while in_flight < batch_size and take():
        pass
    while in_flight:
        engine.step()
        while done:
            i, fin = done.pop(0)
            in_flight -= 1
            if bar is not None:
                bar.update(1)
            yield i, _result(fin)  # before the next prompt is taken: the caller may end a lazy source
            take()
    if bar is not None:
        bar.close()
    st = engine.stats
    return BatchStats(wall_s=time.perf_counter() - t0 - engine.compile_s, steps=st["steps"],
                      hist=np.asarray(st["hist"], np.int64), cache_sizes=tuple(st["cache_sizes"]))
