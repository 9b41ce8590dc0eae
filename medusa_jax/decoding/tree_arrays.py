"""A tree's verification buffers as arrays with a row axis (`TreeArrays`): what a step verifies when
each row has its own tree (prompt lookup's copied chain or the heads' tree, chosen by data; a tree
chosen per step, `drafts.dynamic`), and the padding that gives trees of different shapes one shape."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.tree import TreeBuffers


class TreeArrays(NamedTuple):
    """A tree's verification buffers as arrays, named as `TreeBuffers`' fields (which the
    verification functions also accept): a step that picks its tree per call (prompt lookup) selects
    them with ``jnp.where``, so the one forward it runs needs no conditional around it.

    ancestor_mask [T, T] bool, depth [T] int32, parents [T] int32, retrieve_indices [P, D+1] int32,
    valid [P, D+1] bool.
    """
    ancestor_mask: jax.Array
    depth: jax.Array
    parents: jax.Array
    retrieve_indices: jax.Array
    valid: jax.Array


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
    return TreeArrays(mask, np.pad(tree.depth, (0, size - T)), parents, retrieve, valid)


def tree_rows(tree, batch: int) -> TreeArrays:
    """`tree`'s verification buffers with a leading row axis, as jax arrays: ancestor_mask
    [B, T, T], depth [B, T], parents [B, T], retrieve_indices [B, P, D+1], valid [B, P, D+1]. A
    `TreeBuffers` (one static tree) is broadcast to every row; `TreeArrays`
    that already have the row axis pass through: with prompt lookup each row verifies its own tree
    (the copied chain or the heads' tree), so that a row's draft never depends on the other rows."""
    if isinstance(tree, TreeArrays) and np.ndim(tree.parents) == 2:
        return tree
    arrays = (tree.ancestor_mask, tree.depth, tree.parents, tree.retrieve_indices, tree.valid)
    return TreeArrays(*(jnp.broadcast_to(jnp.asarray(a), (batch,) + tuple(np.shape(a))) for a in arrays))
