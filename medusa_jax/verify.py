"""One static-shape Medusa step: candidates -> tree forward -> posterior -> accepted path -> KV compaction.

Method: Cai et al., "Medusa" (ICML 2024), Sec. 2.1.2 (tree attention) and Sec. 2.3.1 (typical
acceptance); reference implementation FasterDecoding/Medusa ``medusa/model/utils.py``
(``generate_candidates``, ``tree_decoding``, ``evaluate_posterior``, ``update_inference_inputs``).
Differences from the reference, all for speed: the heads run only on the last accepted position
(not on every tree node), the posterior reads only the argmax (greedy) or the candidate's
probability (typical) instead of copying full-vocabulary logits per path, and the accepted nodes'
K/V are moved with one fixed-size gather/scatter. Everything here is jit-compatible with static
shapes; the tree (`TreeBuffers`) is a static argument.

Hydra heads (Ankner et al. 2024, "Hydra", Sec. 3; `medusa_jax.hydra`) draft per parent instead of
per head: head d runs on every depth-d node that has children, reading that node's own path
(`hydra_candidates`). Verification is the same for both head types.

Exact acceptance (``Acceptance(method="exact")``) is speculative sampling over the tree: Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling", Theorem 1) for one
draft, extended to several deterministic candidates per node as in Miao et al. 2024 ("SpecInfer",
Sec. 4.3, multi-step speculative sampling). A node's children are tried in rank order; the output
is distributed exactly as plain sampling at the same temperature and top-p (`evaluate_posterior`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from . import kernels
from .config import MedusaConfig, ModelConfig
from .heads import BLOCK_KEYS, MedusaHeads, proposal_projection
from .hydra import head_state, teacher_forced_states, token_embeddings
from .kv_cache import KVCache
from .lookup import chain_tree, ngram_draft
from .models.llama import LlamaModel, lm_head_matrix
from .sampling import categorical_rows, filtered_logits, sample_logits, split_rows, uniform_rows
from .tree import TreeBuffers


@flax.struct.dataclass
class DecodeState:
    """What one step hands the next.

    logits: [B, V] float32, base-model logits at the last accepted position (predict the next token).
    hidden: [B, D], final-norm hidden state there (the heads' input).
    cache: the KV cache; ``cache.lengths[b]`` = tokens of row b in the cache (prompt + emitted).
    key: [B, 2] uint32, one PRNG key per row (`sampling.row_keys`).
    next_token: [B] int32, the next step's root when it is already drawn (exact acceptance draws it
      from the residual distribution of the last accepted node), -1 when it is still to be chosen
      from ``logits``.
    """
    logits: jax.Array
    hidden: jax.Array
    cache: KVCache
    key: jax.Array
    next_token: jax.Array


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


class StepOutput(NamedTuple):
    """tokens: [B, D+1] int32, the emitted tokens (root then accepted candidates; entries at and
    beyond ``num_tokens`` are filler; D = the tree's ``max_accepted``). num_tokens: [B] int32 in
    [1, D+1] (tokens per step)."""
    tokens: jax.Array
    num_tokens: jax.Array


def _states_topk(heads_cfg: MedusaConfig, head_params, states: jax.Array, base_lm_head: Optional[jax.Array],
                 topk: int, first: int = 0) -> jax.Array:
    """Top-k token ids from head states: [J, ..., D] states of heads first..first+J-1 -> [J, ..., topk]
    int32, over the proposal vocabulary when the heads have one (module `heads`)."""
    J = states.shape[0]
    ids = None
    if "proposal_lm_head_t" in head_params:  # [N, D] shared proposal projection (heads.prepare_heads)
        ids = jnp.asarray(head_params["proposal_ids"], jnp.int32)
        proj = head_params["proposal_lm_head_t"].T  # .T gives back the stored [N, D] to matmul_nt below
    elif heads_cfg.proposal_vocab_size:
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
        # proj [D, N] is the transpose of a stored [N, D] (the embedding of a tied lm_head, the
        # prepared proposal projection): .T gives the stored array back, streamed as it lies
        logits = kernels.matmul_nt(states, kernels.weight_for(proj.T, states.dtype))
    else:
        logits = jnp.einsum("k...d,kdv->k...v", states, proj[first:first + J].astype(states.dtype))
    idx = jax.lax.top_k(logits.astype(jnp.float32), topk)[1].astype(jnp.int32)
    return idx if ids is None else ids[idx]


def head_topk(heads_cfg: MedusaConfig, head_params, hidden: jax.Array, base_lm_head: Optional[jax.Array],
              depth: int, topk: int, path_tokens: Optional[jax.Array] = None,
              embeddings: Optional[jax.Array] = None) -> jax.Array:
    """Top-k proposals of the first `depth` heads.

    Args:
      hidden: [N, D] backbone hidden states (after the final norm).
      base_lm_head: [D, V] (used by heads that share the base lm_head).
      path_tokens: hydra heads only: [K', N] int32 (K' >= depth), the tokens t+1..t+K' after each
        hidden state's own token t; head k reads the first k+1 (teacher forcing, Ankner et al. 2024,
        Sec. 3). Medusa heads ignore it.
      embeddings: hydra heads only: [V, D] the backbone's input embedding table
        (`hydra.token_embeddings`).
      With ``heads_cfg.proposal_vocab_size = P``, the top-k is taken over the P tokens of
      ``head_params["proposal_ids"]`` only, projected with ``head_params["proposal_lm_head"]``
      (gathered here, every call, when absent).
      Params from `heads.prepare_heads` (with ``depth`` = this depth) make this slice- and
      gather-free; others work, at the cost of copying the first `depth` heads' weights per call.
    Returns:
      [depth, N, topk] int32 token ids, best first; head k guesses the token k + 2 positions
      after each hidden state's own token.
    Raises:
      ValueError: hydra heads without path_tokens or embeddings.
    """
    if heads_cfg.head_type == "hydra":
        if path_tokens is None or embeddings is None:
            raise ValueError("hydra heads read the path's tokens: pass path_tokens [K, N] (tokens t+1..t+K) and "
                             "embeddings [V, D] (hydra.token_embeddings(params))")
        path = jnp.take(embeddings, jnp.transpose(path_tokens[:depth]), axis=0)           # [N, depth, D]
        states = teacher_forced_states(heads_cfg, head_params, hidden, path, depth)      # [depth, N, D]
    else:
        blocks = {k: head_params[k][:depth] for k in BLOCK_KEYS}
        states = MedusaHeads(heads_cfg.replace(num_heads=depth, shared_lm_head=True, proposal_vocab_size=0)).apply(
            {"params": blocks}, hidden, method=MedusaHeads.head_states)                  # [depth, N, D]
    return _states_topk(heads_cfg, head_params, states, base_lm_head, topk)


def propose_candidates(heads_cfg: MedusaConfig, head_params, state: DecodeState,
                       base_lm_head: Optional[jax.Array], depth: int, topk: int) -> jax.Array:
    """Top-k tokens of the first `depth` Medusa heads at the last accepted position (`head_topk` of
    ``state.hidden`` [B, D]; the root token will sit at position ``state.cache.lengths``).

    Returns:
      [depth, B, topk] int32; head k's rank-r token is a guess for position ``lengths + k + 1``.
    """
    return head_topk(heads_cfg, head_params, state.hidden, base_lm_head, depth, topk)


def tree_candidates(root: jax.Array, head_tokens: jax.Array, tree: TreeBuffers, per_parent: bool = False) -> jax.Array:
    """Tokens placed on the tree's nodes.

    Args:
      root: [B] int32 base-model token (node 0).
      head_tokens: Medusa heads (``per_parent`` False): [D, B, topk] int32 from `propose_candidates`,
        one top-k per head. Parent-dependent candidates (hydra heads, ``per_parent`` True):
        [B, M, topk] int32, one top-k per node with children, in ``tree.expand_nodes`` order.
    Returns:
      [B, T] int32: node i gets flat candidate ``tree_indices[i]`` of
      ``[root, head0 top-k..., head1 top-k..., ...]``, or with ``per_parent`` ``parent_tree_indices[i]``
      of ``[root, expanded node 0's top-k..., expanded node 1's top-k..., ...]``.
    """
    B = root.shape[0]
    if per_parent:
        flat = jnp.concatenate([root[:, None], head_tokens.reshape(B, -1)], axis=1)
        return flat[:, jnp.asarray(tree.parent_tree_indices)]
    flat = jnp.concatenate([root[:, None], jnp.transpose(head_tokens, (1, 0, 2)).reshape(B, -1)], axis=1)
    return flat[:, jnp.asarray(tree.tree_indices)]


def hydra_candidates(heads_cfg: MedusaConfig, head_params, hidden: jax.Array, root: jax.Array,
                     embeddings: jax.Array, base_lm_head: Optional[jax.Array], tree: TreeBuffers) -> jax.Array:
    """The draft of hydra heads on the tree, depth by depth (Ankner et al. 2024, Sec. 3).

    For depth d = 0..D-1: head d runs on every node at depth d that has children (static
    ``tree.expand_nodes``), reading h_t and the embeddings of that node's path root..node (gathered
    from the tokens placed so far with static indices), and its top-k become the node's children's
    candidates (child rank r gets the rank-r token). Static shapes throughout; the tree is static.

    Args:
      hidden: [B, D] hidden state at the last accepted position.
      root: [B] int32 the root token (node 0).
      embeddings: [V, D] the backbone's input embedding table (`hydra.token_embeddings`).
      base_lm_head: [D, V] (shared-lm_head heads without a proposal projection).
    Returns:
      [B, T] int32 tokens on the tree's nodes (`tree_candidates` with ``per_parent``).
    """
    B = root.shape[0]
    flat = root[:, None]                                              # [B, 1 + (expanded so far) * topk]
    h = hidden[:, None, :]                                            # one h_t for every path
    offsets = tree.expand_offsets
    for d in range(tree.max_depth):
        nodes = tree.expand_nodes[offsets[d]:offsets[d + 1]]          # numpy: static
        idx = tree.parent_tree_indices[tree.node_paths[nodes, :d + 1]]  # [n, d+1] into `flat`
        path = jnp.take(embeddings, flat[:, jnp.asarray(idx)], axis=0)  # [B, n, d+1, D]
        states = head_state(heads_cfg, head_params, d, h, path)       # [B, n, D]
        top = _states_topk(heads_cfg, head_params, states[None], base_lm_head, tree.topk, first=d)[0]
        flat = jnp.concatenate([flat, top.reshape(B, -1)], axis=1)
    return tree_candidates(root, flat[:, 1:].reshape(B, -1, tree.topk), tree, per_parent=True)


def draft_tokens(cfg: ModelConfig, heads_cfg: MedusaConfig, head_params, params, state: DecodeState,
                 root: jax.Array, tree: TreeBuffers) -> jax.Array:
    """The tree's candidate tokens [B, T] int32 for either head type: Medusa heads propose once at
    ``state.hidden`` (`propose_candidates`, `tree_candidates`); hydra heads per parent, depth by depth
    (`hydra_candidates`). `params` is the backbone's (its lm_head and input embeddings)."""
    lm = lm_head_matrix(cfg, params)
    if heads_cfg.head_type == "hydra":
        return hydra_candidates(heads_cfg, head_params, state.hidden, root, token_embeddings(params), lm, tree)
    head_tokens = propose_candidates(heads_cfg, head_params, state, lm, tree.max_depth, tree.topk)
    return tree_candidates(root, head_tokens, tree)


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


class TreeArrays(NamedTuple):
    """A tree's verification buffers as arrays, named as `TreeBuffers`' fields (which the
    verification functions also accept): a step that picks its tree per call (prompt lookup) selects
    them with ``jnp.where``, so the one forward it runs needs no conditional around it.

    ancestor_mask [T, T] bool, depth [T] int32, parents [T] int32, retrieve_indices [P, D+1] int32,
    valid [P, D+1] bool, earlier [T, T] float32 (`_earlier_siblings`).
    """
    ancestor_mask: jax.Array
    depth: jax.Array
    parents: jax.Array
    retrieve_indices: jax.Array
    valid: jax.Array
    earlier: jax.Array


def padded_arrays(tree: TreeBuffers, size: int, paths: int, depth: int) -> TreeArrays:
    """`tree`'s buffers padded to `size` nodes, `paths` root-to-leaf paths and `depth` (static,
    numpy). A padding node is a lone root (parent -1, depth 0, sees only itself and the cache): it
    is verified but on no path, so it is never accepted; padding paths are invalid past the root."""
    T, P, D = tree.size, tree.num_paths, tree.max_depth
    if size < T or paths < P or depth < D:
        raise ValueError(f"cannot pad a tree of {T} nodes, {P} paths, depth {D} to {size}, {paths}, {depth}")
    mask = np.eye(size, dtype=bool)
    mask[:T, :T] = tree.ancestor_mask
    parents = np.full(size, -1, np.int32)
    parents[:T] = tree.parents
    retrieve = np.zeros((paths, depth + 1), np.int32)
    retrieve[:P, :D + 1] = tree.retrieve_indices
    valid = np.zeros((paths, depth + 1), bool)
    valid[:, 0] = True
    valid[:P, :D + 1] = tree.valid
    earlier = np.zeros((size, size), np.float32)
    earlier[:T, :T] = _earlier_siblings(tree)
    return TreeArrays(mask, np.pad(tree.depth, (0, size - T)), parents, retrieve, valid, earlier)


def _earlier_siblings(tree):
    """[T, T] float32 (static): entry (i, j) = 1 when node j is a sibling of node i tried before it
    (same parent, smaller node index, i.e. a better rank: nodes are sorted by (depth, ranks)).
    A `TreeArrays` carries it as ``earlier``."""
    if isinstance(tree, TreeArrays):
        return tree.earlier
    par = np.asarray(tree.parents)
    idx = np.arange(len(par))
    return ((par[:, None] == par[None, :]) & (idx[None, :] < idx[:, None]) & (par[:, None] >= 0)).astype(np.float32)


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
      acc: temperature > 0 and top_p define each node's distribution (`sampling.filtered_logits`).
      key: [B, 2] uint32 per-row PRNG keys.
    Returns:
      [B, T] bool, True where the node is its parent's first accepted child (the root: False).
    """
    B, T = tree_tokens.shape
    logp = jax.nn.log_softmax(filtered_logits(logits, acc.temperature, acc.top_p), axis=-1)
    parent = jnp.asarray(tree.parents).clip(0)
    p = jnp.exp(logp[jnp.arange(B)[:, None], parent[None, :], tree_tokens])           # [B, T]
    earlier = jnp.asarray(_earlier_siblings(tree))
    accepted = uniform_rows(key, T) < sibling_acceptance(p, p @ earlier.T)
    beaten = (accepted.astype(jnp.float32) @ earlier.T) > 0
    return accepted & ~beaten & (jnp.asarray(tree.parents) >= 0)[None, :]


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
    is_child = jnp.asarray(tree.parents)[None, :] == last[:, None]                       # [B, T]
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
    retrieve = jnp.asarray(tree.retrieve_indices)        # [P, D+1]
    valid = jnp.asarray(tree.valid)[:, 1:]                # [P, D]
    parent, child = retrieve[:, :-1], retrieve[:, 1:]     # [P, D]
    child_tok = tree_tokens[:, child]                     # [B, P, D]
    score = jnp.zeros(child_tok.shape, jnp.float32)
    if acc.mode == "greedy":
        pred = kernels.argmax(logits)                      # [B, T]
        match = (child_tok == pred[:, parent]) & valid
    elif acc.mode == "exact":
        if key is None:
            raise ValueError("exact acceptance draws random numbers: pass key=[B, 2] per-row PRNG keys")
        match = exact_chosen(logits, tree_tokens, tree, acc, key)[:, child] & valid
    else:
        logp = jax.nn.log_softmax(logits / acc.temperature, axis=-1)                  # [B, T, V]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)                             # [B, T]
        thresh = jnp.minimum(acc.posterior_threshold, acc.posterior_alpha * jnp.exp(-entropy))
        node_tok = jnp.take_along_axis(logp, tree_tokens[:, None, :], axis=2)        # [B, T(parent), T(node)]
        cand_logp = node_tok[:, parent, child]                                        # [B, P, D]
        match = (jnp.exp(cand_logp) > thresh[:, parent]) & valid
        score = jnp.where(valid, cand_logp, 0.0)
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=-1)                          # [B, P, D]
    acc_len = jnp.sum(accepted, axis=-1)                                              # [B, P]
    acc_score = jnp.sum(score * accepted, axis=-1)
    longest = acc_len == jnp.max(acc_len, axis=-1, keepdims=True)
    best = jnp.argmax(jnp.where(longest, acc_score, -jnp.inf), axis=-1).astype(jnp.int32)
    return best, jnp.take_along_axis(acc_len, best[:, None], axis=1)[:, 0]


def compact_cache(cache: KVCache, path_nodes: jax.Array, start: jax.Array, new_lengths: jax.Array) -> KVCache:
    """Move the accepted nodes' K/V to consecutive slots.

    The tree's K/V were written at slots ``start + node``; the accepted path's node j goes to slot
    ``start + j``. All D+1 path entries move (a fixed-size gather/scatter); those past the accepted
    length land beyond ``new_lengths`` and are never read. Node indices along a path are >= their
    depth, and the gather happens before the scatter, so no entry is overwritten before it is read.

    Args:
      path_nodes: [B, D+1] int32 node indices of the chosen path (root first).
      start: [B] int32 cache length before the tree forward.
      new_lengths: [B] int32.
    """
    B, P1 = path_nodes.shape
    rows = jnp.arange(B)[:, None]
    src = start[:, None] + path_nodes
    dst = start[:, None] + jnp.arange(P1, dtype=jnp.int32)[None, :]
    k, v = (c.at[:, rows, :, dst].set(c[:, rows, :, src], mode="drop") for c in (cache.k, cache.v))
    tokens = cache.tokens.at[rows, dst].set(cache.tokens[rows, src], mode="drop")
    return KVCache(k=k, v=v, lengths=new_lengths, tokens=tokens)


def _step_root(acc: Acceptance, state: DecodeState) -> jax.Array:
    """[B] int32, the root token `medusa_step` will decode from `state`: ``state.next_token`` when
    an exact step drew it, else the argmax (or a sample with the step's own key) of ``state.logits``."""
    k_root = split_rows(state.key, 4)[1]
    return jnp.where(state.next_token >= 0, state.next_token,
                     sample_logits(state.logits, k_root, acc.temperature, acc.top_p))


def medusa_step(cfg: ModelConfig, heads_cfg: Optional[MedusaConfig], tree: TreeBuffers, acc: Acceptance,
                params, head_params, state: DecodeState) -> Tuple[StepOutput, DecodeState]:
    """One Medusa decoding step (pure; jit it with cfg, heads_cfg, tree and acc static).

    1. Root token: ``state.next_token`` when an exact step drew it, else the argmax (or a sample at
       ``acc.temperature`` and ``acc.top_p``) of ``state.logits``.
    2. Candidates (`draft_tokens`): Medusa heads: the first D heads' top-k at ``state.hidden`` placed
       on the tree; hydra heads: depth by depth, each node's children from its own path.
    3. One forward of the T tree tokens at positions ``length + depth`` with the ancestor mask.
    4. Posterior (`evaluate_posterior`: greedy, typical or exact), best path, accepted length a.
    5. Emits root + a candidates; the next logits/hidden are the last accepted node's; the path's
       K/V are compacted; lengths advance by a + 1. Exact acceptance also draws the next root from
       that node's residual distribution (`residual_token`) into ``next_token``.
    Every row draws from its own key (``state.key`` [B, 2]), so rows are independent of each other.
    With the trivial tree (T = 1) this is exactly one plain decoding step and the heads are not run.
    A tree with prompt-lookup settings (``tree.lookup``, `medusa_jax.lookup`) first searches the
    context (``cache.tokens``) for its last n-gram; when at least half the rows find one, the step
    verifies the copied chain (`lookup.ngram_draft`, on `lookup.chain_tree`) instead of the heads'
    tree, with the same acceptance rule: one forward of ``tree.step_size`` tokens whose mask,
    positions and paths are both trees' buffers padded to one shape (`padded_arrays`) and chosen by
    data, not by a conditional (which made XLA copy the KV cache every step); the heads run only on
    the steps that use their tree.

    Requires ``cache.lengths + tree.step_size <= cache.size`` (the caller picks a smaller tree
    near the end). Returns (StepOutput with ``tree.max_accepted + 1`` token columns, next DecodeState).
    """
    key, _, k_accept, k_next = split_rows(state.key, 4)
    root = _step_root(acc, state)
    D = tree.max_depth
    if D > 0:
        if heads_cfg is None:
            raise ValueError("a tree deeper than the root needs Medusa heads")
        if D > heads_cfg.num_heads:
            raise ValueError(f"tree depth {D} exceeds the {heads_cfg.num_heads} Medusa heads; "
                             "use a shallower tree or more heads")

    def heads_draft(_):
        return (draft_tokens(cfg, heads_cfg, head_params, params, state, root, tree) if D > 0
                else root[:, None])

    width = tree.max_accepted + 1
    if tree.lookup is None:
        return _verify_tree(cfg, tree, tree.size > D + 1, acc, params, state, heads_draft(None), key, k_accept,
                            k_next, width)
    # prompt lookup: one forward over the padded union of both trees' shapes, its buffers chosen
    # by data (a lax.cond around the forward made XLA copy the KV cache every step)
    chain = chain_tree(tree.lookup.num_tokens)
    shape = (tree.step_size, max(tree.num_paths, chain.num_paths), tree.max_accepted)
    copied, found = ngram_draft(state.cache.tokens, state.cache.lengths, root, tree.lookup)
    use = 2 * jnp.sum(found.astype(jnp.int32)) >= found.shape[0]
    B = root.shape[0]
    # the heads run only on the steps that verify their tree (a conditional over small arrays)
    by_heads = jax.lax.cond(use, lambda _: jnp.zeros((B, tree.size), jnp.int32), heads_draft, None)
    pad = lambda t: jnp.pad(t, ((0, 0), (0, shape[0] - t.shape[1])))
    tokens = jnp.where(use, pad(jnp.concatenate([root[:, None], copied], axis=1)), pad(by_heads))
    arrays = jax.tree_util.tree_map(lambda c, h: jnp.where(use, c, h), padded_arrays(chain, *shape),
                                    padded_arrays(tree, *shape))
    return _verify_tree(cfg, TreeArrays(*arrays), True, acc, params, state, tokens, key, k_accept, k_next, width)


def _verify_tree(cfg: ModelConfig, tree, compact: bool, acc: Acceptance, params, state: DecodeState,
                 tree_tokens: jax.Array, key: jax.Array, k_accept: jax.Array, k_next: jax.Array,
                 width: int) -> Tuple[StepOutput, DecodeState]:
    """Steps 3-5 of `medusa_step` for the [B, T] tokens on the nodes of `tree` (a `TreeBuffers` or
    `TreeArrays`; root first). compact (static): whether the accepted path's K/V must move (False
    for a chain, whose accepted prefix is in place). The emitted tokens are padded to `width` columns."""
    D = tree.retrieve_indices.shape[1] - 1
    start = state.cache.lengths
    positions = start[:, None] + jnp.asarray(tree.depth)[None, :]
    logits, hidden, cache = LlamaModel(cfg).apply(
        {"params": params}, tree_tokens, positions, state.cache, jnp.asarray(tree.ancestor_mask))
    B = tree_tokens.shape[0]
    next_token = jnp.full((B,), -1, jnp.int32)
    if D > 0:
        best, acc_len = evaluate_posterior(logits, tree_tokens, tree, acc, k_accept)
        path_nodes = jnp.asarray(tree.retrieve_indices)[best]                 # [B, D+1]
        last = jnp.take_along_axis(path_nodes, acc_len[:, None], axis=1)[:, 0]
        if compact:
            cache = compact_cache(cache, path_nodes, start, start + acc_len + 1)
        else:  # a chain: node j already sits at slot start + j, the accepted prefix is in place
            cache = cache.replace(lengths=start + acc_len + 1)
        tokens = jnp.take_along_axis(tree_tokens, path_nodes, axis=1)
        if acc.mode == "exact":
            next_token = residual_token(logits, tree_tokens, tree, acc, last, k_next)
    else:
        acc_len = jnp.zeros((B,), jnp.int32)
        last = jnp.zeros((B,), jnp.int32)
        tokens = tree_tokens
    tokens = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    rows = jnp.arange(B)
    new_state = DecodeState(logits=logits[rows, last], hidden=hidden[rows, last], cache=cache, key=key,
                            next_token=next_token)
    return StepOutput(tokens=tokens, num_tokens=acc_len + 1), new_state
