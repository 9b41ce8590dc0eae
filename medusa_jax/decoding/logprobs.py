"""Log-probabilities of the tokens a step emits, for callers that ask for them (the server's
``logprobs`` / ``top_logprobs``); a prompt's own tokens' are `decoding.prompt_logprobs`'.

A step emits the root and the accepted candidates: token j of row b was chosen from the base
model's distribution after the tokens before it, which is ``state.logits`` for the root and the tree
forward's logits at the accepted path's node j - 1 for the others. Their log-softmax is the
model's own (raw) log-probability, before temperature, top-k or top-p, as vLLM reports by default
(``logprobs_mode="raw_logprobs"``); speculation does not change it beyond float round-off, since a
tree node's logits are those of the same context.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

#: The most alternatives per token a request may ask for (OpenAI's ``top_logprobs`` limit, vLLM's
#: default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20


class StepLogprobs(NamedTuple):
    """logprob: [B, W] float32, each emitted token's log-probability. top_ids: [B, W, N] int32 and
    top_logprobs: [B, W, N] float32, the N most likely tokens at that position, most likely first
    (N = 0: empty). Columns at and beyond the step's ``num_tokens`` are filler."""
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def emitted_logprobs(root_logits: jax.Array, node_logits: jax.Array, path_nodes: jax.Array, tokens: jax.Array,
                     top: int) -> StepLogprobs:
    """The log-probabilities of a step's emitted tokens.

    Args:
      root_logits: [B, V] float32, the distribution the root was chosen from (``state.logits``).
      node_logits: [B, T, V] float32, the tree forward's logits.
      path_nodes: [B, A] int32, the nodes of each row's chosen path (root first); token j >= 1 was
        chosen from node j - 1's logits. A = 1 for a plain step.
      tokens: [B, A] int32, the emitted tokens (root first).
      top: N >= 0, the alternatives kept per token.
    Returns: `StepLogprobs` with W = A columns.
    """
    B = tokens.shape[0]
    before = jnp.take_along_axis(node_logits, path_nodes[:, :-1, None], axis=1)  # [B, A - 1, V]
    dists = jnp.concatenate([root_logits[:, None].astype(jnp.float32), before.astype(jnp.float32)], axis=1)
    logp = jax.nn.log_softmax(dists, axis=-1)  # [B, A, V]
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    if top > 0:
        top_lp, top_ids = jax.lax.top_k(logp, top)
    else:
        top_lp, top_ids = jnp.zeros((B, tokens.shape[1], 0), jnp.float32), jnp.zeros((B, tokens.shape[1], 0), jnp.int32)
    return StepLogprobs(chosen, top_ids.astype(jnp.int32), top_lp)

