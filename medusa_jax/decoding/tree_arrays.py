"""A tree's verification buffers as arrays with a row axis (`TreeArrays`): what a step verifies when
each row has its own tree (prompt lookup's copied chain or the heads' tree, chosen by data; a tree
chosen per step, `decoding.dynamic`), and the padding that gives trees of different shapes one shape."""
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


def pad_tree_rows(arrays: TreeArrays, size: int, paths: int, depth: int) -> TreeArrays:
    """Per-row tree arrays (`select_tree`) padded to `size` nodes, `paths` paths and `depth` (as
    `decoding.tree_arrays.padded_arrays` pads a static tree): a padding node is a lone root that sees only
    itself, on no path; padding paths are invalid past the root."""
    B, T = arrays.depth.shape
    P, D1 = arrays.retrieve_indices.shape[1:]
    mask = jnp.broadcast_to(jnp.eye(size, dtype=jnp.bool_), (B, size, size)).at[:, :T, :T].set(arrays.ancestor_mask)
    pad = lambda x, n, value: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2), constant_values=value)  # noqa: E731
    retrieve = jnp.pad(arrays.retrieve_indices, ((0, 0), (0, paths - P), (0, depth + 1 - D1)))
    valid = jnp.pad(arrays.valid, ((0, 0), (0, paths - P), (0, depth + 1 - D1))).at[:, :, 0].set(True)
    return TreeArrays(mask, pad(arrays.depth, size - T, 0), pad(arrays.parents, size - T, -1), retrieve, valid)
