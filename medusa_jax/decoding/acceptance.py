"""How a step accepts candidates: `Acceptance` (the settings) and `evaluate_posterior` (the best
path of the tree): greedy (a candidate equals its parent's argmax), typical (Cai et al., "Medusa",
ICML 2024, Sec. 2.3.1) or exact.

Exact acceptance (``Acceptance(method="exact")``) is speculative sampling over the tree: Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling", Theorem 1) for one
draft, extended to several deterministic candidates per node as in Miao et al. 2024 ("SpecInfer",
Sec. 4.3, multi-step speculative sampling). A node's children are tried in rank order; the output
is distributed exactly as plain sampling at the same temperature and top-p.

Every function takes a static tree (`TreeBuffers`) or per-row tree arrays (`tree.tree_rows`: with
prompt lookup each row verifies its own tree), and reads the posterior from the nodes' logits
without copying full-vocabulary logits per path.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.decoding.sampling import categorical_rows, filtered_logits, uniform_rows
from medusa_jax.decoding.tree import TreeBuffers, tree_rows

ACCEPTANCE_METHODS = ("greedy", "typical", "exact")


class Acceptance(NamedTuple):
    """Static acceptance settings (a jit static argument).

    temperature: 0 = greedy: every node's argmax decides, whatever `method` says. > 0: sampling from
      ``softmax(logits / temperature)`` restricted to the top-p nucleus.
    method: how a sampling step accepts candidates (`ACCEPTANCE_METHODS`):
      "exact" (the default): speculative sampling over the tree; the output is distributed exactly as
        plain sampling (lossless).
      "typical": Medusa's typical acceptance (Sec. 2.3.1) with posterior_threshold (epsilon) and
        posterior_alpha (delta); accepts more, but changes the output distribution.
      "greedy": only with temperature 0 (sampling with greedy acceptance is an error).
    top_p: nucleus mass in (0, 1] for every sampled token.
    """
    temperature: float = 0.0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    top_p: float = 1.0
    method: str = "exact"

    @property
    def mode(self) -> str:
        """The rule a step applies: "greedy" at temperature 0, else `method`."""
        return "greedy" if self.temperature <= 0.0 else self.method

    def check(self) -> "Acceptance":
        """Raise ValueError for settings no step can run; return self."""
        if self.method not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance method {self.method!r} is not one of {', '.join(ACCEPTANCE_METHODS)}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.method == "greedy" and self.temperature > 0:
            raise ValueError(f"greedy acceptance decodes at temperature 0, got temperature {self.temperature}: "
                             "sample with method 'exact' (the model's own distribution) or 'typical'")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        alpha_ok = math.isfinite(self.posterior_alpha) and self.posterior_alpha >= 0
        if not 0 < self.posterior_threshold <= 1 or not alpha_ok:
            raise ValueError("typical acceptance needs posterior_threshold in (0, 1] and posterior_alpha >= 0, got "
                             f"{self.posterior_threshold} and {self.posterior_alpha}")
        return self


def sibling_acceptance(p: jax.Array, prior: jax.Array) -> jax.Array:
    """Probability of accepting a candidate after its earlier siblings were rejected.

    Each rejection removes the rejected token from the parent's distribution and renormalises what
    remains (the residual ``norm(max(0, p - q))`` of Chen et al. 2023, Alg. 2, with the point-mass
    draft q of a deterministic candidate), so the candidate's chance is ``p / (1 - prior)``.

    Args:
      p: [B, T] float32, each node's token's probability under its parent's distribution.
      prior: [B, T] float32, the summed probability of the node's earlier (better-ranked) siblings.
    Returns:
      [B, T] float32 in [0, 1].
    """
    return jnp.clip(p / jnp.maximum(1.0 - prior, 1e-30), 0.0, 1.0)


def exact_chosen(logits: jax.Array, tree_tokens: jax.Array, tree: TreeBuffers, acc: Acceptance,
                 key: jax.Array) -> jax.Array:
    """Which nodes speculative sampling over the tree accepts.

    Each node's children are tried in rank order: a child is accepted with probability
    `sibling_acceptance` (its token's probability under the parent's distribution, renormalised over
    the tokens not yet rejected), one uniform draw per node; the first accepted child is chosen and
    its later siblings are not tried. Following the chosen children from the root gives the accepted
    path (at most one chosen child per node). Method: Chen et al. 2023, Alg. 2 and Theorem 1;
    several candidates per node as in Miao et al. 2024 (SpecInfer), Sec. 4.3.

    Args:
      logits: [B, T, V] float32 base logits at the tree nodes.
      tree_tokens: [B, T] int32 candidate tokens.
      acc: temperature > 0 and top_p define each node's distribution (`decoding.sampling.filtered_logits`).
      key: [B, 2] uint32 per-row PRNG keys.
    Returns:
      [B, T] bool, True where the node is its parent's first accepted child (the root: False).
    """
    B, T = tree_tokens.shape
    rows = tree_rows(tree, B)
    logp = jax.nn.log_softmax(filtered_logits(logits, acc.temperature, acc.top_p), axis=-1)
    parent = rows.parents.clip(0)                                                       # [B, T]
    p = jnp.exp(logp[jnp.arange(B)[:, None], parent, tree_tokens])                      # [B, T]
    before = lambda x: jnp.einsum("bij,bj->bi", rows.earlier, x)  # summed over each node's earlier siblings
    accepted = uniform_rows(key, T) < sibling_acceptance(p, before(p))
    beaten = before(accepted.astype(jnp.float32)) > 0
    return accepted & ~beaten & (rows.parents >= 0)


def residual_token(logits: jax.Array, tree_tokens: jax.Array, tree: TreeBuffers, acc: Acceptance,
                   last: jax.Array, key: jax.Array) -> jax.Array:
    """The token after an exact step's accepted path: a draw from the last accepted node's
    distribution with its children's tokens removed (each was tried and rejected) and renormalised;
    at a leaf, from the whole distribution (Chen et al. 2023, Alg. 2, last line).

    Args:
      logits: [B, T, V] float32; tree_tokens: [B, T] int32; last: [B] int32 the last accepted node;
      key: [B, 2] uint32 per-row keys.
    Returns:
      [B] int32.
    """
    B = logits.shape[0]
    rows = jnp.arange(B)
    dist = filtered_logits(logits[rows, last], acc.temperature, acc.top_p)              # [B, V]
    is_child = tree_rows(tree, B).parents == last[:, None]                               # [B, T]
    # min-scatter: a token on a child node goes to -inf; +inf leaves every other entry as it is
    resid = dist.at[rows[:, None], tree_tokens].min(jnp.where(is_child, -jnp.inf, jnp.inf))
    # the children held all the mass only up to round-off (each should then have been accepted)
    resid = jnp.where(jnp.isfinite(jnp.max(resid, axis=-1, keepdims=True)), resid, dist)
    return categorical_rows(key, resid)


def evaluate_posterior(logits: jax.Array, tree_tokens: jax.Array, tree: TreeBuffers,
                       acc: Acceptance, key: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
    """Choose the best path of the tree.

    Greedy (``acc.mode == "greedy"``): a candidate is accepted when it equals the argmax of its
    parent node's logits. Typical acceptance (Medusa Sec. 2.3.1): accepted when its probability
    under ``softmax(parent_logits / temperature)`` exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-H(parent)))``. Exact: accepted when
    `exact_chosen` chose it (speculative sampling; needs `key`).
    A path's accepted length is its number of consecutive accepted candidates from the root.
    The longest wins; ties go to the highest sum of the accepted tokens' log-probabilities
    (typical), or to the first such path.

    Args:
      logits: [B, T, V] float32 base logits at the tree nodes.
      tree_tokens: [B, T] int32 candidate tokens on the nodes.
      key: [B, 2] uint32 per-row PRNG keys (exact acceptance only).
    Returns:
      (best path index [B] int32 into ``tree.retrieve_indices``, accepted length [B] int32 in [0, D]).
    Raises:
      ValueError: exact acceptance without a key.
    """
    B = tree_tokens.shape[0]
    rows = tree_rows(tree, B)                             # each row's own tree (prompt lookup)
    retrieve = rows.retrieve_indices                      # [B, P, D+1]
    valid = rows.valid[:, :, 1:]                          # [B, P, D]
    parent, child = retrieve[:, :, :-1], retrieve[:, :, 1:]  # [B, P, D]

    def at_nodes(x, nodes):  # x [B, T] read at each row's node indices [B, P, D]
        return jnp.take_along_axis(x, nodes.reshape(B, -1), axis=1).reshape(nodes.shape)

    child_tok = at_nodes(tree_tokens, child)              # [B, P, D]
    score = jnp.zeros(child_tok.shape, jnp.float32)
    if acc.mode == "greedy":
        pred = kernels.argmax(logits)                      # [B, T]
        match = (child_tok == at_nodes(pred, parent)) & valid
    elif acc.mode == "exact":
        if key is None:
            raise ValueError("exact acceptance draws random numbers: pass key=[B, 2] per-row PRNG keys")
        match = at_nodes(exact_chosen(logits, tree_tokens, rows, acc, key), child) & valid
    else:
        logp = jax.nn.log_softmax(logits / acc.temperature, axis=-1)                  # [B, T, V]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)                             # [B, T]
        thresh = jnp.minimum(acc.posterior_threshold, acc.posterior_alpha * jnp.exp(-entropy))
        node_tok = jnp.take_along_axis(logp, tree_tokens[:, None, :], axis=2)        # [B, T(parent), T(node)]
        cand_logp = node_tok[jnp.arange(B)[:, None, None], parent, child]             # [B, P, D]
        match = (jnp.exp(cand_logp) > at_nodes(thresh, parent)) & valid
        score = jnp.where(valid, cand_logp, 0.0)
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=-1)                          # [B, P, D]
    acc_len = jnp.sum(accepted, axis=-1)                                              # [B, P]
    acc_score = jnp.sum(score * accepted, axis=-1)
    longest = acc_len == jnp.max(acc_len, axis=-1, keepdims=True)
    best = jnp.argmax(jnp.where(longest, acc_score, -jnp.inf), axis=-1).astype(jnp.int32)
    return best, jnp.take_along_axis(acc_len, best[:, None], axis=1)[:, 0]
