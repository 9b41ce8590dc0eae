"""How a step accepts candidates: `Acceptance` (the settings) and `evaluate_posterior` (the best
path of the tree): greedy (a candidate equals its parent's argmax), typical (Cai et al., "Medusa",
ICML 2024, Sec. 2.3.1) or exact.

Exact acceptance (``Acceptance(method="exact")``) accepts a candidate when it is the token that its
position's key chooses from its parent's distribution (`decoding.sampling.sample_tokens`): the
output is then token for token what plain sampling with the same seed emits, and so distributed
exactly as the model's own sampling; each candidate is accepted with its own probability, as in
speculative sampling with deterministic drafts (Chen et al. 2023, Alg. 2; several candidates per
node: Miao et al. 2024, "SpecInfer", Sec. 4.3).

Every function takes a static tree (`TreeBuffers`) or per-row tree arrays (`tree_arrays.tree_rows`: with
prompt lookup each row verifies its own tree), and reads the posterior from the nodes' logits
without copying full-vocabulary logits per path.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.decoding.requests import SamplingParams
from medusa_jax.decoding.sampling import check_top_k, filtered_logits, sample_tokens
from medusa_jax.decoding.tree_arrays import tree_rows

ACCEPTANCE_METHODS = ("greedy", "typical", "exact")


class Acceptance(NamedTuple):
    """Static acceptance settings (a jit static argument).

    A step reads each row's own temperature, top-p and top-k from the decoding state
    (``DecodeState.temperature`` / ``top_p`` / ``top_k``, set from these fields by the entry points, per
    request by the engine); here ``temperature > 0``, ``top_p < 1`` and ``top_k > 0`` only say that
    some row samples, uses a nucleus or a top-k, so that an all-greedy step compiles without sampling
    and a step without filters without their sort.

    temperature: 0 = greedy: every node's argmax decides, whatever `method` says. > 0: sampling from
      ``softmax(logits / temperature)`` restricted to the top-k tokens and the top-p nucleus.
    method: how a sampling step accepts candidates (`ACCEPTANCE_METHODS`):
      "exact" (the default): a candidate is accepted when it is the token its position's key
        chooses (`decoding.sampling.sample_tokens`); the output equals plain sampling's with the same
        seed, token for token (lossless).
      "typical": Medusa's typical acceptance (Sec. 2.3.1) with posterior_threshold (epsilon) and
        posterior_alpha (delta); accepts more, but changes the output distribution.
      "greedy": only with temperature 0 (sampling with greedy acceptance is an error).
    top_p: nucleus mass in (0, 1] for every sampled token.
    top_k: the most likely tokens kept for every sampled token (0: all), before the nucleus.
    """
    temperature: float = 0.0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    top_p: float = 1.0
    method: str = "exact"
    top_k: int = 0

    @property
    def mode(self) -> str:
        """The rule a step applies: "greedy" at temperature 0, else `method`."""
        return "greedy" if self.temperature <= 0.0 else self.method

    def sampling(self, seed: int) -> SamplingParams:
        """One request's `decoding.requests.SamplingParams` with these settings and `seed`."""
        return SamplingParams(self.temperature, self.top_p, int(seed), self.top_k)

    @property
    def filters(self) -> bool:
        """Some row's distribution is cut by top-p or top-k (the sort over the vocabulary is needed)."""
        return self.top_p < 1.0 or self.top_k > 0

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
        check_top_k(self.top_k)
        alpha_ok = math.isfinite(self.posterior_alpha) and self.posterior_alpha >= 0
        if not 0 < self.posterior_threshold <= 1 or not alpha_ok:
            raise ValueError("typical acceptance needs posterior_threshold in (0, 1] and posterior_alpha >= 0, got "
                             f"{self.posterior_threshold} and {self.posterior_alpha}")
        return self


def step_acceptance(sampling: Sequence[SamplingParams], method: str, posterior_threshold: float,
                    posterior_alpha: float) -> Acceptance:
    """The static `Acceptance` of one batched step over rows with these `SamplingParams` (each row
    reads its own temperature, top-p and top-k from the state; greedy rows are greedy under any
    rule): sampling with `method` when some row samples, with the filters' sort when some sampled
    row cuts by top-p or top-k; else greedy."""
    sampled = [s for s in sampling if s.temperature > 0]
    return Acceptance(temperature=1.0 if sampled else 0.0, top_p=min([s.top_p for s in sampled] or [1.0]),
                      top_k=max([s.top_k for s in sampled] or [0]), method=method if sampled else "exact",
                      posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)


def evaluate_posterior(logits: jax.Array, tree_tokens: jax.Array, tree, acc: Acceptance,
                       state=None, start: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
    """Choose the best path of the tree.

    Greedy (a row at temperature 0, or ``acc.mode == "greedy"``): a candidate is accepted when it
    equals the argmax of its parent node's logits. Exact: when it equals the token its position's
    key chooses from the parent's tempered, top-k- and nucleus-filtered distribution
    (`decoding.sampling.sample_tokens`). Typical acceptance (Medusa Sec. 2.3.1): when its probability
    under the parent's tempered, top-k- and nucleus-filtered distribution (what a plain step samples
    from: `decoding.sampling.filtered_logits`; a token it cuts has none) exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-H(parent)))``.
    A path's accepted length is its number of consecutive accepted candidates from the root.
    The longest wins; ties go to the highest sum of the accepted tokens' log-probabilities
    (typical), or to the first such path.

    Args:
      logits: [B, T, V] float32 base logits at the tree nodes.
      tree_tokens: [B, T] int32 candidate tokens on the nodes.
      tree: a `TreeBuffers`, or `TreeArrays` with a row axis (`decoding.tree_arrays.tree_rows`).
      state: the step's `DecodeState` (per-row keys, temperature, top_p, top_k); needed for exact
        acceptance (typical reads its per-row temperature, top_p and top_k when given, else `acc`'s).
      start: [B] int32, the root's position (the cache length before the step); needed with `state`.
    Returns:
      (best path index [B] int32 into the row's ``retrieve_indices``, accepted length [B] int32 in
      [0, D]).
    Raises:
      ValueError: exact acceptance without `state` and `start`.
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
    if acc.mode == "exact" and (state is None or start is None):
        raise ValueError("exact acceptance chooses each position's token with the row's key: pass state= (the "
                         "step's DecodeState, its per-row keys, temperature and top-p) and start= (the root's position)")
    if acc.mode == "typical":  # each row's temperature, top-p and top-k (the state's, else the settings')
        if state is not None:
            temp, top_p, top_k = state.temperature, state.top_p[:, None], state.top_k[:, None]
        else:
            temp, top_p, top_k = jnp.full((B,), acc.temperature, jnp.float32), acc.top_p, acc.top_k
        t = jnp.where(temp > 0, temp, 1.0)[:, None]
        # the distribution a plain step samples from: tokens outside top-k and the nucleus have none
        logp = jax.nn.log_softmax(filtered_logits(logits, t, top_p, acc.filters, top_k), axis=-1)  # [B, T, V]
        entropy = -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)  # [B, T]
        thresh = jnp.minimum(acc.posterior_threshold, acc.posterior_alpha * jnp.exp(-entropy))
        node_tok = jnp.take_along_axis(logp, tree_tokens[:, None, :], axis=2)        # [B, T(parent), T(node)]
        cand_logp = node_tok[jnp.arange(B)[:, None, None], parent, child]             # [B, P, D]
        typical = jnp.exp(cand_logp) > at_nodes(thresh, parent)
        greedy = child_tok == at_nodes(kernels.argmax(logits), parent)
        match = jnp.where((temp > 0)[:, None, None], typical, greedy) & valid
        score = jnp.where(valid, cand_logp, 0.0)
    else:
        # the token each node's children must be: chosen at the position after the node's own
        if acc.mode == "greedy":
            target = kernels.argmax(logits)                                           # [B, T]
        else:
            target = sample_tokens(logits, state.key, start[:, None] + rows.depth + 1, state.temperature,
                                   state.top_p, nucleus=acc.filters, top_k=state.top_k)
        match = (child_tok == at_nodes(target, parent)) & valid
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=-1)                          # [B, P, D]
    acc_len = jnp.sum(accepted, axis=-1)                                              # [B, P]
    acc_score = jnp.sum(score * accepted, axis=-1)
    longest = acc_len == jnp.max(acc_len, axis=-1, keepdims=True)
    best = jnp.argmax(jnp.where(longest, acc_score, -jnp.inf), axis=-1).astype(jnp.int32)
    return best, jnp.take_along_axis(acc_len, best[:, None], axis=1)[:, 0]
