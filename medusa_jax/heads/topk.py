"""The heads' vocabulary projection and top-k: head states -> proposed token ids, over the whole
vocabulary or the heads' proposal vocabulary (`heads.medusa.prepare_heads`)."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import teacher_forced_states
from medusa_jax.heads.medusa import BLOCK_KEYS, MedusaHeads, proposal_projection


def states_topk(heads_cfg: MedusaConfig, head_params, states: jax.Array, base_lm_head: Optional[jax.Array],
                topk: int, first: int = 0, logprobs: bool = False, adjust: Optional[Callable] = None):
    """Top-k token ids from head states: [J, ..., D] states of heads first..first+J-1 -> [J, ..., topk]
    int32, over the proposal vocabulary when the heads have one (module `heads`). With `logprobs`,
    also their log-probabilities [J, ..., topk] float32 under the head's softmax over that vocabulary
    (the draft probabilities a dynamic tree ranks its nodes by: `drafts.dynamic`). `adjust`:
    ``adjust(logits [J, ..., N], ids [N] int32 or None) -> logits``, applied before the top-k (a
    request's penalties and bias: `decoding.processors.draft_adjuster`)."""
    J = states.shape[0]
    ids = None
    if "proposal_lm_head_t" in head_params:  # [N, D] shared proposal projection (heads.prepare_heads):
        ids = jnp.asarray(head_params["proposal_ids"], jnp.int32)  # an array or GGUF blocks, streamed as stored
        logits = kernels.matmul_nt(states, kernels.weight_for(head_params["proposal_lm_head_t"], states.dtype))
        return _top(logits, ids, topk, logprobs, adjust)
    if heads_cfg.proposal_vocab_size:
        ids = jnp.asarray(head_params["proposal_ids"], jnp.int32)
        proj = head_params.get("proposal_lm_head")
        if proj is None:
            proj = proposal_projection(heads_cfg, head_params, base_lm_head)
    elif heads_cfg.shared_lm_head:
        if base_lm_head is None:
            raise ValueError("these heads share the base model's lm_head (shared_lm_head=True): pass "
                             "base_lm_head=[D, V], e.g. models.llama.lm_head_matrix(cfg, params)")
        proj = base_lm_head
    else:
        proj = head_params["lm_head"]
    if heads_cfg.shared_lm_head:
        # proj [D, V] is the transpose of a stored [V, D] (the embedding of a tied lm_head): .T
        # gives the stored array back, streamed as it lies
        logits = kernels.matmul_nt(states, kernels.weight_for(proj.T, states.dtype))
    else:
        logits = jnp.einsum("k...d,kdv->k...v", states, proj[first:first + J].astype(states.dtype))
    return _top(logits, ids, topk, logprobs, adjust)


def _top(logits: jax.Array, ids: Optional[jax.Array], topk: int, logprobs: bool, adjust: Optional[Callable] = None):
    """`states_topk`'s result from the logits [..., N] over ``ids`` [N] (None: the whole vocabulary)."""
    logits = logits.astype(jnp.float32)
    if adjust is not None:
        logits = adjust(logits, ids)
    top, idx = jax.lax.top_k(logits, topk)
    idx = idx.astype(jnp.int32)
    tokens = idx if ids is None else ids[idx]
    if not logprobs:
        return tokens
    return tokens, top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def head_topk(heads_cfg: MedusaConfig, head_params, hidden: jax.Array, base_lm_head: Optional[jax.Array],
              depth: int, topk: int, path_tokens: Optional[jax.Array] = None,
              embeddings: Optional[jax.Array] = None, logprobs: bool = False, adjust: Optional[Callable] = None):
    """Top-k proposals of the first `depth` heads.

    Args:
      hidden: [N, D] backbone hidden states (after the final norm).
      base_lm_head: [D, V] (used by heads that share the base lm_head).
      path_tokens: hydra heads only: [K', N] int32 (K' >= depth), the tokens t+1..t+K' after each
        hidden state's own token t; head k reads the first k+1 (teacher forcing, Ankner et al. 2024,
        Sec. 3). Medusa heads ignore it.
      embeddings: hydra heads only: [V, D] the backbone's input embedding table
        (`heads.hydra.token_embeddings`).
      With ``heads_cfg.proposal_vocab_size = P``, the top-k is taken over the P tokens of
      ``head_params["proposal_ids"]`` only, projected with ``head_params["proposal_lm_head"]``
      (gathered here, every call, when absent).
      Params from `heads.medusa.prepare_heads` (with ``depth`` = this depth) make this slice- and
      gather-free; others work, at the cost of copying the first `depth` heads' weights per call.
      logprobs: also return the tokens' log-probabilities (`states_topk`); adjust: as there.
    Returns:
      [depth, N, topk] int32 token ids, best first; head k guesses the token k + 2 positions
      after each hidden state's own token. With `logprobs`: (ids, [depth, N, topk] float32).
    Raises:
      ValueError: hydra heads without path_tokens or embeddings.
    """
    if heads_cfg.head_type == "hydra":
        if path_tokens is None or embeddings is None:
            raise ValueError("hydra heads read the path's tokens: pass path_tokens [K, N] (tokens t+1..t+K) and "
                             "embeddings [V, D] (hydra.token_embeddings(params))")
        path = kernels.take_rows(embeddings, jnp.transpose(path_tokens[:depth]))           # [N, depth, D]
        states = teacher_forced_states(heads_cfg, head_params, hidden, path, depth)      # [depth, N, D]
    else:
        blocks = {k: head_params[k][:depth] for k in BLOCK_KEYS}
        states = MedusaHeads(heads_cfg.replace(num_heads=depth, shared_lm_head=True, proposal_vocab_size=0)).apply(
            {"params": blocks}, hidden, method=MedusaHeads.head_states)                  # [depth, N, D]
    return states_topk(heads_cfg, head_params, states, base_lm_head, topk, logprobs=logprobs, adjust=adjust)
