"""The heads' draft on a static tree: candidate tokens placed on the tree's nodes by Medusa heads
(one top-k per head; Cai et al. 2024, Sec. 2.1.1) or Hydra heads (one top-k per parent, depth by
depth; Ankner et al. 2024, Sec. 3), and `HeadsDrafter`, the drafter of a static tree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.tree import TreeBuffers, check_depth
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import head_state, token_embeddings
from medusa_jax.heads.topk import head_topk, states_topk
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import lm_head_matrix


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
      embeddings: [V, D] the backbone's input embedding table (`heads.hydra.token_embeddings`).
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
        path = kernels.take_rows(embeddings, flat[:, jnp.asarray(idx)])  # [B, n, d+1, D]
        states = head_state(heads_cfg, head_params, d, h, path)       # [B, n, D]
        top = states_topk(heads_cfg, head_params, states[None], base_lm_head, tree.topk, first=d)[0]
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


@dataclass(frozen=True)
class HeadsDrafter(Drafter):
    """The heads' candidates on a static tree (`draft_tokens`); the trivial tree (T = 1, no heads
    needed) proposes the root alone, which makes the step one plain decoding step.

    Raises ValueError (at trace time) for a tree deeper than the root without heads, or deeper than
    the heads (`decoding.tree.check_depth`)."""

    @property
    def compact(self) -> bool:
        """Whether the accepted path's K/V move: False for a chain (its accepted prefix is in place)."""
        return self.tree.size > self.tree.max_depth + 1

    def propose(self, x: DraftInputs) -> Proposal:
        D = self.tree.max_depth
        if D == 0:
            return Proposal(self.tree, x.root[:, None], self.compact)
        if x.heads_cfg is None:
            raise ValueError("a tree deeper than the root needs Medusa heads")
        check_depth(D, x.heads_cfg.num_heads)
        tokens = draft_tokens(x.cfg, x.heads_cfg, x.head_params, x.params, x.state, x.root, self.tree)
        return Proposal(self.tree, tokens, self.compact)

