"""The log-probability of each token of a prompt given the tokens before it: what vLLM's
``prompt_logprobs`` and a completion's ``echo`` with ``logprobs`` report, and what
lm-evaluation-harness's loglikelihood tasks sum. One causal forward over the prompt through a KV
cache in chunks, as prefill runs it, keeping every position's logits."""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.logprobs import MAX_TOP_LOGPROBS
from medusa_jax.decoding.prefill import PREFILL_KV_BLOCK, bucket, prefill_plan
from medusa_jax.decoding.requests import EngineStopped, TokenLogprob
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import KVCache, init_cache
from medusa_jax.models.llama import LlamaModel, compute_dtype

#: Prompt tokens scored per compiled call of `prompt_logprobs` (as prefill's chunks: `PREFILL_CHUNK`).
SCORE_CHUNK = 256


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnames=("cache",))
def _score_chunk(cfg: ModelConfig, kv_block: Optional[int], top: int, params, tokens: jax.Array,
                 targets: jax.Array, cache: KVCache):
    """One chunk of `prompt_logprobs`: tokens, targets [1, T] int32 (target j: the token after token
    j); cache donated. Returns (cache, logprob [T], top_ids [T, top], top_logprobs [T, top])."""
    T = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, _, cache = LlamaModel(cfg).apply({"params": params}, tokens, positions, cache, kv_block=kv_block)
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [T, V]
    chosen = jnp.take_along_axis(logp, targets[0][:, None], axis=-1)[:, 0]
    if top > 0:
        top_lp, top_ids = jax.lax.top_k(logp, top)
    else:
        top_lp, top_ids = jnp.zeros((T, 0), jnp.float32), jnp.zeros((T, 0), jnp.int32)
    return cache, chosen, top_ids.astype(jnp.int32), top_lp


def prompt_logprobs(cfg: ModelConfig, params, prompt: Sequence[int], top: int = 0,
                    chunk_size: int = SCORE_CHUNK,
                    stop: Optional[Callable[[], bool]] = None) -> List[Optional[TokenLogprob]]:
    """`score_prompt`'s log-probabilities alone (its arguments, returns and errors)."""
    return score_prompt(cfg, params, prompt, top, chunk_size, stop)[0]


def score_prompt(cfg: ModelConfig, params, prompt: Sequence[int], top: int = 0, chunk_size: int = SCORE_CHUNK,
                 stop: Optional[Callable[[], bool]] = None) -> Tuple[List[Optional[TokenLogprob]], KVCache]:
    """The log-probability of each prompt token under the model given the tokens before it: one
    causal forward over the prompt in chunks of `chunk_size` tokens through a KV cache, as prefill
    runs it, with the logits of every position (the module's docstring says who asks for them).

    Args:
      cfg, params: the backbone (float32, bfloat16 or GGUF-block params, as the engine holds them).
      prompt: P >= 1 token ids, each in [0, V).
      top: N in [0, `MAX_TOP_LOGPROBS`], the most likely tokens kept per position (0: none).
      chunk_size: tokens per compiled call; any value gives the same figures up to float32 round-off.
      stop: asked before each chunk; True ends the scoring with EngineStopped (a server shutting down).
    Returns:
      (entries, cache). entries: P of them, None for the first token (nothing precedes it), then
      `decoding.requests.TokenLogprob` (token, its natural-log probability, the N most likely tokens
      at its position as (id, logprob) pairs, most likely first) for tokens 1 .. P - 1. cache: a
      B = 1 `KVCache` (S >= P slots, a power of two) whose first P slots hold the prompt's K/V (the
      later ones padding's), which a prefill of the same prompt may reuse (`Engine.prompt_logprobs`'s
      ``keep``).
    Raises:
      ValueError: an empty prompt, an id outside the vocabulary, `top` outside [0, 20], a prompt
        longer than the model's context.
      EngineStopped: `stop` said so.
    """
    ids = [int(t) for t in prompt]
    if not ids or not all(0 <= t < cfg.vocab_size for t in ids):
        raise ValueError(f"prompt_logprobs: the prompt must be 1 or more token ids in [0, {cfg.vocab_size}), "
                         f"got {len(ids)} ids")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs: top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"prompt_logprobs: the prompt has {len(ids)} tokens; the model's context is "
                         f"{cfg.max_position_embeddings}")
    T, chunks = prefill_plan(len(ids), chunk_size)
    size = bucket(T * chunks, T)  # a power of two: few compiled shapes whatever the prompts' lengths
    toks = np.zeros((1, size), np.int32)
    toks[0, :len(ids)] = ids
    targets = np.zeros((1, size), np.int32)
    targets[0, :len(ids) - 1] = ids[1:]
    k = min(MAX_TOP_LOGPROBS, cfg.vocab_size) if top else 0  # one compiled variant for every top > 0
    kv_block = PREFILL_KV_BLOCK if size > PREFILL_KV_BLOCK and size % PREFILL_KV_BLOCK == 0 else None
    cache = init_cache(cfg, 1, size, compute_dtype(params))
    parts = []
    for c in range(chunks):
        if stop is not None and stop():
            raise EngineStopped(f"prompt_logprobs: stopped after {c} of {chunks} chunks")
        cols = slice(c * T, (c + 1) * T)
        cache, *out = _score_chunk(cfg, kv_block, k, params, jnp.asarray(toks[:, cols]),
                                   jnp.asarray(targets[:, cols]), cache)
        parts.append(out)
    chosen, top_ids, top_lp = (np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(3))
    out: List[Optional[TokenLogprob]] = [None]
    for j in range(1, len(ids)):
        alts = tuple((int(t), float(x)) for t, x in zip(top_ids[j - 1, :top], top_lp[j - 1, :top]))
        out.append(TokenLogprob(ids[j], float(chosen[j - 1]), alts))
    return out, cache
