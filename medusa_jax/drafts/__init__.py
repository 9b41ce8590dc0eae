"""Drafts: what a decoding step verifies, one `Drafter` per method.

The interface (`Drafter`, `DraftInputs`, `Proposal`) is `medusa_jax.decoding.proposal`'s, beside the
verification it feeds; its implementations are here: `HeadsDrafter` (Medusa or Hydra heads on a
static tree, and the trivial tree of plain decoding), `DynamicDrafter` (a tree chosen per step from
the heads' proposals, with prompt lookup's copied chains as more branches), `LookupDrafter` (prompt
lookup beside a static heads' tree). `drafter_for` picks the drafter of a tree: the one place that
tells the methods apart. A new method (EAGLE-3) is one more drafter. Imports nothing of the
engine, the server or the commands.
"""
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.drafts.dynamic import DynamicDrafter
from medusa_jax.drafts.heads import HeadsDrafter
from medusa_jax.drafts.lookup import LookupDrafter


def drafter_for(tree: TreeBuffers) -> Drafter:
    """The drafter of `tree` (hashable: a jit static): `DynamicDrafter` for a tree chosen per step
    (``tree.dynamic``, with or without prompt lookup), `LookupDrafter` for a static tree with
    prompt lookup (``tree.lookup``), else `HeadsDrafter` (the trivial tree included)."""
    if tree.dynamic is not None:
        return DynamicDrafter(tree)
    if tree.lookup is not None:
        return LookupDrafter(tree)
    return HeadsDrafter(tree)


__all__ = ["DraftInputs", "Drafter", "DynamicDrafter", "HeadsDrafter", "LookupDrafter", "Proposal", "drafter_for"]
