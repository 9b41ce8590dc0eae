"""The backbone's params in decoding layout (`decoding_params`): ``kernel_t [out, in]`` matrices,
projections sharing an input fused, large arrays on 2 MB pages, the layout the streaming kernels
(`medusa_jax.kernels`) read. `LlamaModel` runs either layout with the same results."""
from __future__ import annotations

import weakref
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from medusa_jax import kernels, sharding

_DECODING: dict = {}  # id(params) -> (weakref to its embedding, params in decoding layout)


# Projections that read the same input, fused into one [sum of outs, in] matrix in decoding layout.
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def decoding_params(params: dict) -> dict:
    """The backbone's params in decoding layout: every `Linear` ``kernel [in, out]`` stored as
    ``kernel_t [out, in]`` (contiguous), the layout `medusa_jax.kernels` streams, and the
    projections that share an input fused into one matrix: ``attn/qkv_t [(H + 2 KVH) Dh, D]``
    (with ``qkv_bias`` when q/k/v have biases) and ``mlp/gate_up_t [2 I, D]``. A decoding step
    then makes 4 weight-streaming products per layer instead of 7; each starts and ends its
    threads, which costs about as much as streaming a small matrix. Every array of 2 MB or more,
    the embedding included, is then copied onto 2 MB pages (`kernels.on_huge_pages`), from which
    the kernels stream it faster; smaller ones are shared, not copied. `LlamaModel` runs either
    layout with the same results (up to float32 round-off; the kernel computes each output alike
    whichever matrix holds it); training keeps the ``kernel`` layout (its gradients and
    checkpoints use it). Matrices a GGUF file's blocks hold (`kernels.BlockWeight`, loaded with
    ``weights="as-stored"``) are already ``kernel_t``; they fuse with blocks of their format.

    Returns `params` unchanged off the CPU or when the streaming kernels are unavailable
    (`kernels.in_use`, `kernels.status`), for params placed on a device mesh
    (`medusa_jax.sharding`), or when the tree is already in decoding layout. The result is cached
    per params tree (while its embedding array lives), so the decoding entry points may call this
    on every request.
    """
    if (not kernels.in_use() or _in_decoding_layout(params)
            or sharding.mesh_of(params["embed"]["embedding"]) is not None):
        return params
    leaf = params["embed"]["embedding"]
    hit = _DECODING.get(id(params))
    if hit is not None and hit[0]() is leaf:
        return hit[1]

    def convert(tree):
        if not isinstance(tree, Mapping):
            return tree
        out = {("kernel_t" if k == "kernel" else k): (jnp.transpose(v) if k == "kernel" else convert(v))
               for k, v in tree.items()}
        for fused, parts in _FUSED.items():
            fused_w = _fused_weight(_parts(out, parts))
            if fused_w is not None:
                out[f"{fused}_t"] = fused_w
                if all("bias" in out[p] for p in parts):
                    out[f"{fused}_bias"] = jnp.concatenate([out[p]["bias"] for p in parts])
                for p in parts:
                    del out[p]
        return out

    out = jax.tree_util.tree_map(kernels.on_huge_pages, convert(params))  # streamed faster from 2 MB pages
    for key in [k for k, (ref, _) in _DECODING.items() if ref() is None]:
        del _DECODING[key]
    _DECODING[id(params)] = (weakref.ref(leaf), out)
    return out


def _parts(tree: Mapping, parts) -> list:
    """The ``kernel_t`` of each of `parts` in `tree` (None where there is none)."""
    return [tree[p].get("kernel_t") if isinstance(tree.get(p), Mapping) else None for p in parts]


def _fusible(ws: list) -> bool:
    """Whether ``[out, in]`` weights stack into one: all present, and all arrays or all GGUF blocks
    of one format (mixed kinds stay apart)."""
    blocks = [isinstance(w, kernels.BlockWeight) for w in ws]
    return (all(w is not None for w in ws) and (not any(blocks) or all(blocks))
            and len({w.fmt for w in ws if isinstance(w, kernels.BlockWeight)}) <= 1)


def _fused_weight(ws: list):
    """The weights `ws` stacked along out (`_fusible`): arrays concatenated, blocks concatenated
    as blocks (a row's blocks are its own); None when they do not stack."""
    if not _fusible(ws):
        return None
    if isinstance(ws[0], kernels.BlockWeight):
        return kernels.BlockWeight(jnp.concatenate([jnp.asarray(w.blocks) for w in ws], axis=0), ws[0].fmt)
    return jnp.concatenate(ws, axis=0)


def _in_decoding_layout(tree) -> bool:
    """No ``kernel [in, out]`` left and no projections that `decoding_params` would still fuse."""
    def fusible(t) -> bool:
        if not isinstance(t, Mapping):
            return False
        return any(_fusible(_parts(t, parts)) for parts in _FUSED.values()) or any(fusible(v) for v in t.values())
    return not _has_key(tree, "kernel") and not fusible(tree)


def _has_key(tree, key: str) -> bool:
    """Whether `key` occurs at any depth of the nested mapping `tree`."""
    return isinstance(tree, Mapping) and any(k == key or _has_key(v, key) for k, v in tree.items())
