"""Parameters ready for decoding, once per call: the backbone's in its decoding layout, the heads
prepared for the tree (`decoding_setup`)."""
from __future__ import annotations

import functools
from typing import Optional

from medusa_jax import sharding
from medusa_jax.decoding.tree import PLAIN_TREE, TreeBuffers
from medusa_jax.heads.medusa import prepare_heads
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.layout import decoding_params
from medusa_jax.models.llama import lm_head_blocks, lm_head_matrix


def decoding_setup(cfg: ModelConfig, params, heads, tree: Optional[TreeBuffers]):
    """(params in decoding layout, heads_cfg or None, head params or None, the tree to run:
    `PLAIN_TREE` without heads), from arguments that `check_generation_args` accepted.

    The backbone's params go to decoding layout once (`models.layout.decoding_params`, cached per
    params tree: the weight-streaming kernels' ``[out, in]`` layout when they are available).
    Heads are readied for the tree once, here (`heads.medusa.prepare_heads`; heads from
    `resolve.resolve_heads` pass through unchanged, without building the backbone's [D, V] lm_head),
    so that heads straight from `load_heads` do not slice or gather their weights in every step.

    Params placed on a device mesh (`sharding.shard_params`) keep their layout (the CPU kernels do
    not run on a mesh; XLA splits the products) and the heads are placed on the same mesh.
    Raises ValueError when the mesh's model axis does not divide the attention heads."""
    mesh = sharding.mesh_of(params)
    if mesh is not None:
        sharding.check_model_axis(cfg, mesh.shape["model"])
    params = decoding_params(params)
    if heads is None:  # plain decoding, or prompt lookup alone (the trivial tree with lookup settings)
        return params, None, None, tree if tree is not None else PLAIN_TREE
    heads_cfg, head_params = heads
    if tree.max_depth > 0:
        heads_cfg, head_params = prepare_heads(heads_cfg, head_params, functools.partial(lm_head_matrix, cfg, params),
                                               depth=tree.max_depth, lm_head_blocks=lm_head_blocks(cfg, params))
    if mesh is not None and sharding.mesh_of(head_params) != mesh:
        head_params = sharding.shard_params(head_params, mesh)
    return params, heads_cfg, head_params, tree
