"""Sharding on a ``('data', 'model')`` device mesh: one rules table, Megatron-style.

The model is split the way Megatron-LM splits a transformer (Shoeybi et al. 2019, Sec. 3): the
query/key/value projections and the MLP's gate/up projections are split by output column on
'model' (attention heads and the MLP hidden dimension), the output and down projections by input
row, so each layer needs one all-reduce per block; vocabulary projections (the embedding, the
lm_head, the Medusa heads' own lm_heads and proposal projections) are split by vocabulary entry.
The batch goes on 'data', and the KV cache ``[L, B, KVH, S, Dh]`` follows the attention heads
(B on 'data', KVH on 'model'). JAX's SPMD partitioner (GSPMD) inserts every collective; there is
no hand-written communication.

Where a dimension does not divide by its axis (a batch of 4 on 8 data devices, a proposal
vocabulary of 8,192 on 3 model devices), that dimension is replicated along the axis instead
(`fit_spec`); the attention heads are the exception: a model axis that does not divide the
query and KV heads is refused (`check_model_axis`), because the cache could not follow them.

Public API:
  parse_mesh("2x4") -> (2, 4);  make_mesh(data, model) -> Mesh;  mesh_from_arg(text) -> Mesh | None
  check_model_axis(cfg, model)           clear error naming the model-axis sizes that work
  spec_for(path, shape, mesh) -> PartitionSpec   (the rules table, `RULES`; path_str(key path))
  shard_params(tree, mesh), put(array, mesh, spec) (spec fitted), cache_spec(), batch_spec(ndim, axis)
  mesh_of(tree) -> Mesh | None;  constrain(x, spec) inside jit (no-op without a mesh in context)
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "model")

# Parameter path (keys joined by "/", matched at the end of the path so that optimizer states,
# whose paths end in the parameter's, follow their parameter) -> PartitionSpec of that array.
# The backbone's `Linear` kernels are [in, out] (`kernel`) or [out, in] (`kernel_t`, the decoding
# layout); Medusa heads are `heads.medusa.MedusaHeads` (blocks [K, L, D, D], lm_head [K, D, V]) and
# Hydra's path params [k+1, D, D]. Anything unmatched is replicated.
RULES: Tuple[Tuple[str, P], ...] = (
    (r"embed/embedding$", P("model", None)),                              # [V, D]: vocabulary
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P(None, "model")),   # [D, out]: columns
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel_t$", P("model", None)),
    (r"(q_proj|k_proj|v_proj)/bias$", P("model")),
    (r"(o_proj|down_proj)/kernel$", P("model", None)),                    # [in, D]: rows
    (r"(o_proj|down_proj)/kernel_t$", P(None, "model")),
    (r"(q_norm|k_norm)/scale$", P(None)),                                 # Qwen3 [Dh]: replicated
    (r"lm_head/kernel$", P(None, "model")),                               # [D, V]
    (r"lm_head/kernel_t$", P("model", None)),                             # [V, D]
    (r"(^|/)blocks_kernel$", P(None, None, None, "model")),               # heads [K, L, D, D]
    (r"(^|/)blocks_bias$", P(None, None, "model")),                       # [K, L, D]
    (r"(^|/)lm_head$", P(None, None, "model")),                           # own lm_heads [K, D, V]
    (r"(^|/)proposal_lm_head_t$", P("model", None)),                      # [N, D]
    (r"(^|/)proposal_lm_head$", P(None, None, "model")),                  # [depth, D, N]
    (r"(^|/)path_(kernel|residual)_\d+$", P(None, None, "model")),        # Hydra [k+1, D, D]
)


def parse_mesh(text: str) -> Tuple[int, int]:
    """``"DATAxMODEL"`` (e.g. ``"2x4"``) -> (data, model). Raises ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--mesh takes DATAxMODEL with positive sizes, e.g. 2x4 (2-way data parallel, 4-way "
                         f"model parallel); got {text!r}")
    return int(m.group(1)), int(m.group(2))


def make_mesh(data: int, model: int, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``('data', 'model')`` mesh of data x model devices (jax.devices() by default: in a
    multi-process run, every process's devices), with GSPMD's automatic axes.

    Raises ValueError when there are fewer devices than data x model (on a CPU, more devices are
    simulated with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX starts).
    """
    devs = list(devices) if devices is not None else jax.devices()
    need = data * model
    if need > len(devs):
        hint = ""
        if devs and devs[0].platform == "cpu":
            hint = (f" On a CPU, simulate {need} devices by setting "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before starting Python.")
        raise ValueError(f"a {data}x{model} mesh needs {need} devices, but JAX sees {len(devs)} "
                         f"({devs[0].platform if devs else 'none'}).{hint}")
    grid = np.asarray(devs[:need], dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_from_arg(text: Optional[str]) -> Optional[Mesh]:
    """The mesh a ``--mesh DATAxMODEL`` flag asks for; None for no flag or ``1x1`` (one device)."""
    if text is None:
        return None
    data, model = parse_mesh(text)
    if data * model == 1:
        return None
    return make_mesh(data, model)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_model_axis(cfg, model: int, what: str = "the backbone") -> None:
    """Raise ValueError unless a 'model' axis of this size divides the attention heads (query and
    KV: the KV cache is split on its heads) of `cfg` (a `ModelConfig`). The message names the
    sizes that would work. The MLP hidden size and the vocabulary need not divide: those
    dimensions are replicated where they do not (`fit_spec`)."""
    if model <= 1:
        return
    q, kv = cfg.num_heads, cfg.num_kv_heads
    if q % model or kv % model:
        ok = [d for d in _divisors(kv) if q % d == 0]
        raise ValueError(
            f"a model axis of {model} does not divide {what}'s attention heads ({q} query heads, {kv} KV "
            f"heads): the heads and the KV cache are split on it. Model-axis sizes that work: "
            f"{', '.join(map(str, ok))} (e.g. --mesh {max(1, model // max(ok))}x{max(ok)} or a larger data axis).")


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` with every axis that does not divide its dimension of `shape` dropped (replicated),
    cut to len(shape) entries (dimensions past the spec's are replicated, as in any PartitionSpec)."""
    return P(*(axis if axis is not None and dim % mesh.shape[axis] == 0 else None
               for dim, axis in zip(shape, spec)))


def path_str(path) -> str:
    """A `jax.tree_util` key path as the "/"-joined keys `RULES` match (e.g. "layers_0/attn/q_proj/kernel")."""
    keys = []
    for k in path:
        key = getattr(k, "key", None)
        if key is None:
            key = getattr(k, "name", None)
        if key is None:
            key = getattr(k, "idx", k)
        keys.append(str(key))
    return "/".join(keys)


def spec_for(path: str, shape: Sequence[int], mesh: Mesh) -> P:
    """The PartitionSpec of the array at parameter path `path` (keys joined by "/") with this
    shape: the first matching `RULES` entry, fitted to the shape (`fit_spec`); replicated when no
    rule matches or the array is a scalar."""
    if not shape:
        return P()
    for pattern, spec in RULES:
        if re.search(pattern, path) and len(spec) == len(shape):
            return fit_spec(spec, shape, mesh)
    return P()


def put(x, mesh: Mesh, spec: P) -> jax.Array:
    """`x` (numpy or jax) as a global array on `mesh` with `spec` fitted to its shape (`fit_spec`:
    an axis that does not divide its dimension replicates it). Works in a multi-process run too:
    every process passes the same whole array and keeps only its own devices' shards."""
    sharding = NamedSharding(mesh, fit_spec(spec, np.shape(x), mesh))
    if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(tree, mesh: Optional[Mesh]):
    """Every array of a params (or optimizer-state) tree placed on `mesh` by `RULES`; `tree`
    unchanged when `mesh` is None. Non-array leaves (None, python numbers) pass through."""
    if mesh is None:
        return tree

    def place(path, x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        return put(x, mesh, spec_for(path_str(path), x.shape, mesh))
    return jax.tree_util.tree_map_with_path(place, tree)


def batch_spec(ndim: int, axis: int = 0) -> P:
    """A PartitionSpec splitting dimension `axis` of an `ndim`-d array on 'data'."""
    parts = [None] * ndim
    parts[axis] = "data"
    return P(*parts)


def cache_spec() -> P:
    """The KV cache's ``[L, B, KVH, S, Dh]`` spec: batch on 'data', KV heads on 'model'."""
    return P(None, "data", "model", None, None)


def mesh_of(tree: Any) -> Optional[Mesh]:
    """The mesh of the first array in `tree` that is placed on a mesh of more than one device,
    or None (everything on one device)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """`jax.lax.with_sharding_constraint` with `spec` fitted to x's shape, under the mesh of the
    current context (`jax.set_mesh`); `x` unchanged outside a mesh context. For use inside jit."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(spec, x.shape, mesh))


def active() -> bool:
    """True while tracing under a mesh of more than one device (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def describe(mesh: Optional[Mesh]) -> str:
    """``"2x4 mesh (8 cpu devices)"`` or ``"one device"``."""
    if mesh is None:
        return "one device"
    d = mesh.devices.flat[0]
    return f"{mesh.shape['data']}x{mesh.shape['model']} mesh ({mesh.size} {d.platform} devices)"



def place_on_mesh(model, mesh):
    """`model` (a `convert.load.LoadedModel`) with its params on `mesh` (`sharding.shard_params`);
    unchanged for None. Raises ValueError when the mesh's model axis does not divide the attention
    heads (`sharding.check_model_axis`)."""
    if mesh is None:
        return model
    check_model_axis(model.cfg, mesh.shape["model"], what=os.path.basename(model.path) or "the model")
    return dataclasses.replace(model, params=shard_params(model.params, mesh))
