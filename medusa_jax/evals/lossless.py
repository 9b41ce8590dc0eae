"""Lossless output: Medusa greedy against plain greedy, token for token (the library half of
``medusa-check``).

Where two outputs differ, the first differing position is examined on the plain path: if its
top-2 logit gap is below the compute dtype's near-tie threshold (`TIE_GAPS`: 1e-4 in float32) the
difference is a near-tie (the tree forward sums in another order); any other difference is a bug.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.engine.generate import generate_device
from medusa_jax.models.llama import LlamaModel, compute_dtype

#: Top-2 logit gap below which a difference between two decoders counts as a near-tie, per compute
#: dtype. float32: 1e-4, two orders above the round-off of a float32 logit of magnitude ~10 (the
#: two paths' float32 logits measured equal bit for bit). bfloat16 0.5 and float16 0.0625: twice
#: the largest change of a top-2 gap measured between the plain and the Medusa path on SmolLM2
#: (`scripts/path_noise.py`, 13 MT-bench answers, ~400 positions: bfloat16 0.26, float16 0.031),
#: since in those dtypes every layer's output is rounded and a tree forward rounds other sums.
TIE_GAPS = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.0625}


@dataclass
class Comparison:
    """One prompt's verdict. first_diff: index into the new tokens (None if identical);
    gap: top-2 logit gap of the plain path at that index; near_tie: gap < tie_gap."""
    identical: bool
    first_diff: Optional[int] = None
    gap: Optional[float] = None
    near_tie: bool = False


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(cfg, params, ids: Sequence[int]) -> float:
    """Gap between the two largest float32 logits after the last of `ids` (one full forward, no cache)."""

    toks = jnp.asarray([list(ids)], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    _, hidden, _ = LlamaModel(cfg).apply({"params": params}, toks, pos, compute_logits=False)
    logits = LlamaModel(cfg).apply({"params": params}, hidden[:, -1], method=LlamaModel.logits)
    top = jax.lax.top_k(logits[0], 2)[0]
    return float(top[0] - top[1])


def compare(cfg, params, prompt: Sequence[int], plain: Sequence[int], medusa: Sequence[int],
            tie_gap: Optional[float] = None) -> Comparison:
    """Compare two outputs for one prompt; see the module docstring. tie_gap: None: `TIE_GAPS` of
    the params' compute dtype."""
    if tie_gap is None:
        tie_gap = TIE_GAPS[compute_dtype(params).name]
    i = first_difference(plain, medusa)
    if i is None:
        return Comparison(identical=True)
    if i >= min(len(plain), len(medusa)):  # one stopped earlier: not explained by a near-tie
        return Comparison(identical=False, first_diff=i)
    gap = top2_gap(cfg, params, list(prompt) + list(plain[:i]))
    return Comparison(identical=False, first_diff=i, gap=gap, near_tie=gap < tie_gap)


def decode_one(model, ids: Sequence[int], max_new_tokens: int, heads=None, tree=None, acceptance=None,
               seed: int = 0) -> Tuple[List[int], int]:
    """(new token ids, decoding steps) of one prompt with the on-device loop (`generate_device`: the
    same tokens as `generate`, and on a CPU in bfloat16 several times faster, because XLA converts
    the weights to float32 once per loop rather than every step). acceptance: default greedy."""
    r = generate_device(model.cfg, model.params, [list(ids)], max_new_tokens=max_new_tokens, heads=heads, tree=tree,
                        eos_token_ids=model.cfg.eos_token_ids, acceptance=acceptance or Acceptance(), seed=seed,
                        progress=False)
    return r.tokens[0, :int(r.count[0])].tolist(), r.steps
