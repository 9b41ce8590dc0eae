"""What a decoding step verifies: the `Drafter` interface, its inputs and its `Proposal`.

A drafter proposes, for one step, candidate tokens on a tree whose root is the step's own token;
`decoding.step.medusa_step` verifies whatever it proposes, the same way for every drafter (one
forward with the ancestor mask, the acceptance rule, KV compaction), without knowing which one it
is. The interface lives here, beside the verification it feeds, so that decoding/ imports none of
its implementations: Medusa and Hydra heads on a static tree, a tree chosen per step, prompt lookup
(`medusa_jax.drafts`, which also picks the drafter of a tree: `drafts.drafter_for`).

A drafter is a frozen, hashable dataclass: a jit static argument of the step, like the tree it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import jax

from medusa_jax.decoding.processors import LogitsProcessors
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.decoding.tree_arrays import TreeArrays
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig


class DraftInputs(NamedTuple):
    """What a drafter may read to propose one step's candidates.

    cfg: the backbone's config (static); heads_cfg: the draft heads' config (static; None without heads);
    head_params / params: the heads' and the backbone's parameters (decoding layout);
    state: the rows' `DecodeState` before the step (hidden [B, D] at the last accepted position,
      the KV cache with its token ids);
    root: [B] int32, the token the step decodes at each row's position ``cache.lengths`` (node 0);
    procs: the rows' logits processing (`decoding.processors`), or None.
    """
    cfg: ModelConfig
    heads_cfg: Optional[MedusaConfig]
    head_params: object
    params: object
    state: DecodeState
    root: jax.Array
    procs: Optional[LogitsProcessors] = None


class Proposal(NamedTuple):
    """One step's draft.

    tree: the tree to verify: the static `TreeBuffers`, or `TreeArrays` with a row axis (each row's
      own tree, [B, ...]); node 0 is the root.
    tokens: [B, T] int32, the tokens on the tree's T nodes (root first).
    compact: (static) whether the accepted path's K/V must move to consecutive slots: False for a
      chain, whose accepted prefix already sits in place.
    """
    tree: Union[TreeBuffers, TreeArrays]
    tokens: jax.Array
    compact: bool


@dataclass(frozen=True)
class Drafter:
    """A draft method for the step (`propose`), and the static tree settings it drafts under.

    tree: the `TreeBuffers` the step was built for: its shape (``step_size`` tokens per forward,
      ``max_accepted`` candidates per path at most), and the method's settings (``lookup``,
      ``dynamic``). Subclasses implement `propose`; a drafter with state of its own between steps
      keeps it in `DecodeState`, so that the step stays one pure function.
    """
    tree: TreeBuffers

    @property
    def max_accepted(self) -> int:
        """The most candidates one step can accept (the step emits at most this + 1 tokens)."""
        return self.tree.max_accepted

    def propose(self, x: DraftInputs) -> Proposal:
        """This step's `Proposal` from `x` (traced inside the jitted step; static shapes)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose")
