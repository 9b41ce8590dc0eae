"""A draft tree chosen per step at a fixed node budget (`decoding.tree.dynamic_tree`, ``"dynamic:T"``;
its drafter: `DynamicDrafter`).

Every step, the heads propose top-k tokens depth by depth and the T - 1 candidates with the highest
cumulative draft log-probability (the sum of the head log-probabilities along the node's path)
become the tree's nodes below the root. Scores fall along a path (each depth also costs
`DEPTH_COST`, so a child always scores below its parent), hence the top T - 1 are ancestor-closed
and the selection is a tree. Method: EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees", Sec. 4: expand the best nodes, rerank all drafted nodes, keep the
top T by draft confidence); here the confidence is the Medusa or Hydra heads' own probability.

- Medusa heads (one top-k per head at the last accepted position): a depth-d node's children are
  head d's top-k whatever the parent, so every one of the T - 1 best nodes of a depth may be
  expanded at no cost; the selection is then exactly the best-first top T - 1 over all paths.
- Hydra heads (children drafted from the parent's own path, Ankner et al. 2024, Sec. 3): head d runs
  on the `width` W best depth-d nodes (a fixed width, so the shapes stay static), and the global
  top T - 1 are kept among everything drafted.
- Prompt lookup's copied chains (`add_chain_tokens`) join the candidates depth by depth, scored by
  their measured acceptance per depth, before each depth's expansion: a copied node may be among the
  W expanded, so the heads also draft below a copied token (where a copy stops matching, the heads'
  continuation of it is in the tree).

The shapes are static (T nodes, T paths: every node ends one, depth D); the tree itself is data: the
ancestor mask [B, T, T], depths (positions), parents and paths are built on the device from the
selected nodes' parent indices, row by row, and verified by the same `decoding.step` code as a static
tree (as prompt lookup's per-row trees are). Verification is unchanged, so greedy output equals
plain greedy; and since the tree depends only on the draft (the heads), never on the target's
random numbers, exact acceptance stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding.processors import draft_adjuster
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.decoding.tree_arrays import TreeArrays
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import head_state, token_embeddings
from medusa_jax.heads.topk import head_topk, states_topk
from medusa_jax.models.config import ModelConfig
from medusa_jax.drafts.lookup import ngram_drafts
from medusa_jax.models.llama import lm_head_matrix

#: Nats each depth costs on top of its head's log-probability: a child always scores strictly below
#: its parent (a head may give a token probability 1.0 in float32), so the top T - 1 are
#: ancestor-closed.
DEPTH_COST = 1e-4


def node_confidence(spec, depth: int, logprob: jax.Array) -> jax.Array:
    """A depth-`depth` node's score: the log-probability that it is accepted once its parent is.

    Args:
      spec: the tree's `decoding.dynamic_spec.DynamicSpec`; without ``confidence`` the head's own
        log-probability is the score, with it the measured map (`tuning.confidence`) for that depth.
      depth: 0-based head index (static).
      logprob: [...] float32 the head's log-probabilities of the nodes' tokens.
    Returns: [...] float32 scores <= 0, nondecreasing in `logprob`.
    """
    if spec.confidence is None:
        return logprob
    knots, values = spec.confidence
    row = values[min(depth, len(values) - 1)]
    return jnp.interp(logprob, jnp.asarray(knots, jnp.float32), jnp.asarray(row, jnp.float32))


def select_tree(tokens: jax.Array, scores: jax.Array, parents: jax.Array, depths: np.ndarray, root: jax.Array,
                budget: int, max_depth: int) -> Tuple[TreeArrays, jax.Array]:
    """The tree of the `budget` - 1 best drafted candidates below the root, row by row.

    Args:
      tokens: [B, C] int32 drafted candidates, listed depth by depth (every candidate after its parent).
      scores: [B, C] float32 cumulative draft log-probabilities, strictly below the parent's.
      parents: [B, C] int32 each candidate's parent, an index into the C candidates, or -1 (the root).
      depths: [C] int32 (static, numpy) each candidate's depth (1..max_depth).
      root: [B] int32 the root token.
      budget: T (static), root included; C >= T - 1.
      max_depth: D (static), the paths' length - 1.
    Returns:
      (TreeArrays with a row axis: ancestor_mask [B, T, T] bool, depth [B, T] int32, parents [B, T]
      int32 (-1 for the root), retrieve_indices [B, T, D+1] int32 (node i's path root..i: every node
      ends a path), valid [B, T, D+1] bool; the nodes' tokens [B, T] int32, root first). Nodes are
      ordered by candidate index, hence by depth, so a node's index is at least its depth and a
      parent comes before its children (`decoding.step.compact_cache` relies on both).
    """
    B, C = tokens.shape
    T, D = budget, max_depth
    rows = jnp.arange(B)[:, None]
    sel = jnp.sort(jax.lax.top_k(scores, T - 1)[1], axis=1).astype(jnp.int32)          # [B, T-1] candidates
    node_of = jnp.zeros((B, C), jnp.int32).at[rows, sel].set(jnp.arange(1, T, dtype=jnp.int32)[None])
    par = jnp.take_along_axis(parents, sel, axis=1)                                       # [B, T-1]
    par_node = jnp.where(par < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1))
    parent = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), par_node], axis=1)        # [B, T]
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.asarray(depths, jnp.int32)[sel]], axis=1)
    node_tokens = jnp.concatenate([root[:, None], jnp.take_along_axis(tokens, sel, axis=1)], axis=1)
    # each node's path root..node: walk up the parents D times, writing each ancestor at its depth
    up = jnp.maximum(parent, 0)                                                           # the root's is itself
    cur = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    paths = jnp.zeros((B, T, D + 1), jnp.int32)
    for _ in range(D):
        d = jnp.take_along_axis(depth, cur, axis=1)
        paths = paths + jax.nn.one_hot(d, D + 1, dtype=jnp.int32) * cur[..., None]     # the root adds 0
        cur = jnp.take_along_axis(up, cur, axis=1)
    valid = jnp.arange(D + 1, dtype=jnp.int32)[None, None] <= depth[..., None]           # [B, T, D+1]
    mask = jnp.any(jax.nn.one_hot(paths, T, dtype=jnp.bool_) & valid[..., None], axis=2)  # [B, T, T]
    return TreeArrays(mask, depth, parent, paths, valid), node_tokens


def dynamic_draft(cfg: ModelConfig, heads_cfg: MedusaConfig, head_params, params, state: DecodeState,
                  root: jax.Array, tree: TreeBuffers, lookup_draft: Optional[Tuple[jax.Array, ...]] = None,
                  adjust: Optional[Callable] = None) -> Tuple[TreeArrays, jax.Array]:
    """This step's tree and its tokens: `draft_tree` at ``state.hidden`` with the backbone's lm_head
    and input embeddings (`params`, in decoding layout; head_params prepared for the depth);
    `adjust`: the rows' logits processing applied to the heads' logits (`heads.topk.states_topk`)."""
    emb = token_embeddings(params) if heads_cfg.head_type == "hydra" else None
    return draft_tree(heads_cfg, head_params, lm_head_matrix(cfg, params), emb, state.hidden, root, tree,
                      lookup_draft, adjust)


def draft_tree(heads_cfg: MedusaConfig, head_params, base_lm_head: jax.Array, embeddings, hidden: jax.Array,
               root: jax.Array, tree: TreeBuffers, lookup_draft: Optional[Tuple[jax.Array, ...]] = None,
               adjust: Optional[Callable] = None) -> Tuple[TreeArrays, jax.Array]:
    """A tree chosen from the heads' proposals (module docstring): the heads' top-``tree.topk`` per
    expanded node, depth by depth to ``tree.max_depth``, then the best ``tree.size - 1``
    (`select_tree`); with `lookup_draft`, prompt lookup's copied chains compete for the same slots
    and for the heads' expansion (`draft_candidates`).

    Args:
      base_lm_head: [D, V] the backbone's lm_head (shared-lm_head heads project through it).
      embeddings: hydra heads: [V, D] the backbone's input embeddings; else None.
      hidden: [B, D] the backbone's hidden state at the last accepted position.
      root: [B] int32 the root token (the next token after that position).
      tree: a dynamic tree (``tree.dynamic`` set: `decoding.tree.dynamic_tree`).
      lookup_draft: (copied [B, m, k] int32, found [B, m] bool, ngram [B] int32) from
        `drafts.lookup.ngram_drafts` (without ngram, every copy scores by `lookup_confidence`), or None.
      adjust: None, or a change to the heads' logits before their top-k (`heads.topk.states_topk`).
    Returns:
      (TreeArrays with a row axis, tokens [B, T] int32), as `select_tree`, paths as deep as
      ``tree.max_accepted``.
    Raises:
      ValueError: hydra heads whose width drafts fewer than T - 1 candidates.
    """
    cands = draft_candidates(heads_cfg, head_params, base_lm_head, embeddings, hidden, root, tree, lookup_draft,
                             adjust)
    return select_tree(*cands, root, tree.dynamic.budget, tree.max_accepted)


def draft_candidates(heads_cfg: MedusaConfig, head_params, base_lm_head: jax.Array, embeddings, hidden: jax.Array,
                     root: jax.Array, tree: TreeBuffers, lookup_draft: Optional[Tuple[jax.Array, ...]] = None,
                     adjust: Optional[Callable] = None) -> Tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    """Everything a dynamic tree drafts, before the selection (`draft_tree`'s args).

    Depth by depth: the heads draft the top-k children of each node expanded at the depth above;
    with `lookup_draft`, each copied chain adds its next token under its own node of the depth above
    (`add_chain_tokens`: prompt lookup as branches of the same budget; scored by the length of the
    n-gram that matched, `DynamicSpec.lookup_ngram_confidence`); then the ``width`` best nodes
    of the depth, the heads' and the chains' alike, are the ones expanded next. So the heads also
    draft below a copied token: where a copy stops matching, the heads' continuation of it is in the
    tree (EAGLE-2's expansion, Li et al. 2024, Sec. 4, over both drafters' nodes).

    Returns: (tokens [B, C] int32, scores [B, C] float32, parents [B, C] int32, depths [C] numpy
    int32), as `select_tree` takes them, listed depth by depth (each depth: the heads' candidates,
    then one slot per copied chain).
    """
    spec = tree.dynamic
    T, D, k = spec.budget, tree.max_depth, tree.topk
    B = root.shape[0]
    lm = base_lm_head
    hydra = heads_cfg.head_type == "hydra"
    width = spec.width if hydra else T - 1
    if spec.candidates(D, k, hydra) < T - 1:
        raise ValueError(f"a dynamic tree of {T} nodes needs more candidates than hydra heads draft at depth {D}, "
                         f"topk {k} and width {spec.width} ({spec.candidates(D, k, hydra)}); raise the width "
                         f"(dynamic:{T}:W) or topk, or lower the budget")
    m, L = (0, 0) if lookup_draft is None else lookup_draft[0].shape[1:]
    if lookup_draft is not None:
        copied, found = lookup_draft[0].astype(jnp.int32), lookup_draft[1]
        # chain c's rates at depth d per row, by the n-gram its row matched ([L, B, m]); n past the
        # table's last row takes its last column, which has no row of its own (`lookup_confidence`'s)
        table = spec.lookup_rate_table(L, m, max([n for n, _ in spec.lookup_ngram_confidence or ()], default=0) + 1)
        ngram = lookup_draft[2] if len(lookup_draft) > 2 else jnp.zeros((B,), jnp.int32)
        rates = jnp.asarray(table).transpose(1, 2, 0)[:, jnp.minimum(ngram, table.shape[2] - 1)]  # [L, B, m]
        chain_node = jnp.full((B, m), -1, jnp.int32)     # each chain's node at the depth above (-1: the root)
        chain_score = jnp.zeros((B, m), jnp.float32)
    if hydra:
        h = hidden[:, None, :]
    else:
        ids, logp = head_topk(heads_cfg, head_params, hidden, lm, D, k, logprobs=True, adjust=adjust)  # [D, B, k]
    score = jnp.zeros((B, 1), jnp.float32)              # the expanded nodes' scores, [B, n]
    index = jnp.full((B, 1), -1, jnp.int32)             # their candidate indices (-1: the root)
    path = root[:, None, None]                          # hydra: their paths' tokens [B, n, d+1]
    toks, scores, parents, depths = [], [], [], []
    offset = 0
    for d in range(max(D, L)):
        tok = jnp.zeros((B, 0), jnp.int32)
        sc = jnp.zeros((B, 0), jnp.float32)
        par = jnp.zeros((B, 0), jnp.int32)
        if d < D and score.shape[1]:  # the heads' children of the n expanded nodes
            n = score.shape[1]
            if hydra:
                states = head_state(heads_cfg, head_params, d, h, kernels.take_rows(embeddings, path))  # [B, n, D]
                t, lp = (x[0] for x in states_topk(heads_cfg, head_params, states[None], lm, k, first=d,
                                                   logprobs=True, adjust=adjust))
            else:
                t, lp = jnp.broadcast_to(ids[d][:, None], (B, n, k)), logp[d][:, None]
            sc = (score[:, :, None] + node_confidence(spec, d, lp) - DEPTH_COST).reshape(B, n * k)
            tok = t.reshape(B, n * k).astype(jnp.int32)
            par = jnp.repeat(index, k, axis=1)
        heads_slots = tok.shape[1]
        if d < L:  # each chain's token d + 1
            tok, sc, par, chain_node, chain_score = add_chain_tokens(
                tok, sc, par, offset, chain_node, chain_score, copied[:, :, d], found, rates[d])
        toks.append(tok)
        scores.append(sc)
        parents.append(par)
        depths.append(np.full(tok.shape[1], d + 1, np.int32))
        if d + 1 < D:  # the next depth expands the `width` best of these, and never more than the tree
            # can hold at this depth (T - 1 - d: a node needs its d ancestors), the only ones that could be kept
            score, best = jax.lax.top_k(sc, min(width, tok.shape[1], T - 1 - d))
            index = offset + best.astype(jnp.int32)
            if hydra:  # the heads' paths are their parents' and their own token; a copied node's, the root
                # and its chain's first d + 1 tokens
                grown = [jnp.concatenate([jnp.repeat(path, k, axis=1), tok[:, :heads_slots, None]], axis=2)]
                if d < L:
                    grown.append(jnp.concatenate([jnp.broadcast_to(root[:, None, None], (B, m, 1)),
                                                  copied[:, :, :d + 1]], axis=2))
                path = jnp.take_along_axis(jnp.concatenate(grown, axis=1), best[..., None], axis=1)  # [B, n', d+2]
        offset += tok.shape[1]
    return (jnp.concatenate(toks, axis=1), jnp.concatenate(scores, axis=1), jnp.concatenate(parents, axis=1),
            np.concatenate(depths))


def add_chain_tokens(tokens: jax.Array, scores: jax.Array, parents: jax.Array, offset: int, chain_node: jax.Array,
                     chain_score: jax.Array, next_tokens: jax.Array, found: jax.Array, rates
                     ) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One depth of prompt lookup's copied chains as candidates beside the heads' (issue 30: lookup as
    branches of the same node budget). Chain c's token scores its node's score at the depth above
    plus ``rates[c]``, the measured log-probability that it is accepted once its parent is, and
    competes with the heads' nodes for the tree's slots; a chain whose n-gram did not occur (or not
    that often) gets no node (score -1e30, never chosen while the heads draft enough). A copied token
    already drafted under the same parent (a heads' proposal, or an earlier chain's token) is not
    drafted twice: the chain goes on from that node, which scores the better of the two estimates,
    so no token appears twice among siblings.

    Args:
      tokens, scores, parents: [B, n] the depth's candidates so far (the heads'), parents as global
        candidate indices (-1: the root).
      offset: the global index of the depth's first candidate (static).
      chain_node, chain_score: [B, m] int32 / float32 each chain's node at the depth above (a global
        index, -1 for the root) and its score.
      next_tokens: [B, m] int32 each chain's token at this depth; found: [B, m] bool whether the chain
        exists (`drafts.lookup.ngram_drafts`, latest match first).
      rates: [B, m] (or [m]) float32 log-probabilities <= 0, each chain's at this depth
        (`DynamicSpec.lookup_rate_table`).
    Returns: (tokens, scores, parents) [B, n + m], chain c's own slot at n + c (-1e30 where it is
      merged or absent), and the chains' nodes and scores at this depth ([B, m] each).
    """
    B, n = tokens.shape
    m = next_tokens.shape[1]
    rows = jnp.arange(B)
    next_tokens = next_tokens.astype(jnp.int32)
    rates = jnp.broadcast_to(jnp.asarray(rates, jnp.float32), (B, m))
    tokens = jnp.concatenate([tokens, next_tokens], axis=1)
    scores = jnp.concatenate([scores, jnp.full((B, m), -1e30, scores.dtype)], axis=1)
    parents = jnp.concatenate([parents, chain_node], axis=1)
    nodes, node_scores = [], []
    for c in range(m):
        parent, live = chain_node[:, c], found[:, c]
        cand = chain_score[:, c] + rates[:, c] - DEPTH_COST
        same = (parents == parent[:, None]) & (tokens == next_tokens[:, c][:, None]) & (scores > -1e29)  # [B, n+m]
        merged = jnp.any(same, axis=1)
        target = jnp.where(merged, jnp.argmax(same, axis=1).astype(jnp.int32), n + c)
        scores = scores.at[:, n + c].set(jnp.where(live & ~merged, cand, -1e30))
        at = scores[rows, target]
        raised = jnp.where(live & merged, jnp.maximum(at, cand), at)
        scores = scores.at[rows, target].set(raised)
        nodes.append(offset + target)
        node_scores.append(raised)
    return tokens, scores, parents, jnp.stack(nodes, axis=1), jnp.stack(node_scores, axis=1)


@dataclass(frozen=True)
class DynamicDrafter(Drafter):
    """A tree chosen per step (``tree.dynamic``): `dynamic_draft` from the heads' proposals, whose
    heads draft from their logits with the rows' bias and penalties (`decoding.processors.draft_adjuster`);
    with prompt lookup (``tree.lookup``), the copied chains (one per match, `drafts.lookup.ngram_drafts`)
    are more branches of it, competing with the heads' nodes for its T slots (`add_chain_tokens`)."""

    def propose(self, x: DraftInputs) -> Proposal:
        tree = self.tree
        drafts = None
        if tree.lookup is not None:
            # [B, m, k] copies, [B, m] found, [B] n-gram sizes
            drafts = ngram_drafts(x.state.cache.tokens, x.state.cache.lengths, x.root, tree.lookup)
        arrays, tokens = dynamic_draft(x.cfg, x.heads_cfg, x.head_params, x.params, x.state, x.root, tree, drafts,
                                       draft_adjuster(x.procs, x.state))
        return Proposal(arrays, tokens, True)

