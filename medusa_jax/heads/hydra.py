"""Hydra heads: sequentially dependent draft heads (Ankner et al. 2024, "Hydra: Sequentially-Dependent
Draft Heads for Medusa Decoding", Sec. 3).

A Medusa head k reads only the hidden state h_t and must guess token t+k+2 without knowing the tokens
before it. A Hydra head k also reads the embeddings of the tokens on the path it extends, root
first: the root x_{t+1} (the base model's own next token, known before any head runs) and the
candidates x_{t+2}..x_{t+k+1} of the shallower heads::

    e_j = E[x_{t+j}]                                  # the backbone's input embedding table E [V, D]
    y   = h_t @ W[k, 0] + b[k, 0] + sum_{j=1..k+1} e_j @ P[k][j-1]
    x   = h_t + sum_{j=1..k+1} e_j @ R[k][j-1] + silu(y)           # the first block
    for l in 1..L-1:  x = x + silu(x @ W[k, l] + b[k, l])         # plain Medusa blocks
    logits_k = x @ lm_head                                         # shared base lm_head, or head k's own

This is the first block of the reference code (github.com/zankner/Hydra, ``hydra/model/hydra_heads/
mlp_head.py``: ``ResBlock(hidden_size, num_condition)``, a ``Linear`` plus a ``res_connection``
``Linear`` over the concatenation ``[h_t ; e_1 ; ... ; e_{k+1}]``) with the concatenation's matrices
split by input: ``[W[k, 0]; P[k]]`` is its ``linear`` and ``[I; R[k]]`` its ``res_connection``. We fix
the hidden state's part of the residual to the identity (the reference learns it from a random
init) and start P and R at zero, so a fresh Hydra head is exactly a fresh Medusa head (it reproduces
the base model's next-token logits), and trained Medusa heads plus zero P, R are the same heads
(`from_medusa`): a warm start. Later blocks, the projection and the proposal vocabulary are the
Medusa heads' (`medusa_jax.heads.medusa`).

Params: the Medusa layout (``blocks_kernel [K, L, D, D]``, ``blocks_bias [K, L, D]``, ``lm_head
[K, D, V]`` when not shared, ``proposal_ids``) plus, per head k (path length k+1)::

    path_kernel_{k}    [k+1, D, D]   P[k]: embedding j -> the first block's pre-activation ([in, out])
    path_residual_{k}  [k+1, D, D]   R[k]: embedding j -> the residual stream ([in, out])

The embedding size is the backbone's hidden size D (Llama-family models). Decoding (`verify`) runs
the heads depth by depth on the tree: head d on every node at depth d that has children, reading
that node's own path; training and calibration use teacher forcing (the true tokens t+1..t+k+1),
which is what decoding sees on the path it accepts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.heads.config import MedusaConfig

#: Name patterns of the Hydra-only params (k = head index).
PATH_KERNEL, PATH_RESIDUAL = "path_kernel_{}", "path_residual_{}"


def path_keys(num_heads: int) -> Tuple[str, ...]:
    """Names of the Hydra-only params of heads 0..num_heads-1, head by head."""
    return tuple(name.format(k) for k in range(num_heads) for name in (PATH_KERNEL, PATH_RESIDUAL))


def path_key_head(key: str) -> Optional[int]:
    """The head index of a Hydra-only param name (`path_keys`), or None for any other name."""
    for name in (PATH_KERNEL, PATH_RESIDUAL):
        prefix = name.format("")
        if key.startswith(prefix) and key[len(prefix):].isdigit():
            return int(key[len(prefix):])
    return None


def path_shapes(cfg: MedusaConfig) -> dict:
    """{name: shape} of the Hydra-only params: ``path_kernel_k`` and ``path_residual_k`` [k+1, D, D]."""
    D = cfg.hidden_size
    return {name.format(k): (k + 1, D, D) for k in range(cfg.num_heads) for name in (PATH_KERNEL, PATH_RESIDUAL)}


def init_path_params(cfg: MedusaConfig, dtype=jnp.float32) -> dict:
    """Zero Hydra-only params (`path_shapes`): with them, Hydra heads equal the Medusa heads of the
    same blocks (module docstring)."""
    return {k: jnp.zeros(s, dtype) for k, s in path_shapes(cfg).items()}


def from_medusa(cfg: MedusaConfig, params) -> Tuple[MedusaConfig, dict]:
    """Hydra heads that compute exactly what the given Medusa heads compute (zero path params): a
    warm start for training. Returns (cfg with head_type "hydra", params). Raises ValueError for
    heads without a block layer (a Hydra head's first block reads the path)."""
    if cfg.num_layers < 1:
        raise ValueError("Medusa heads with 0 block layers cannot become Hydra heads: a Hydra head's first "
                         "block reads the path embeddings; train Hydra heads from scratch (init_heads: null)")
    hcfg = cfg.replace(head_type="hydra")
    return hcfg, {**dict(params), **init_path_params(hcfg, jnp.asarray(params["blocks_kernel"]).dtype)}


def check_path_params(cfg: MedusaConfig, params, depth: Optional[int] = None) -> None:
    """Raise ValueError naming the first missing or mis-shaped Hydra param of heads 0..depth-1."""
    shapes = path_shapes(cfg)
    for k in path_keys(cfg.num_heads if depth is None else depth):
        got = params.get(k)
        if got is None or tuple(got.shape) != shapes[k]:
            raise ValueError(f"hydra head param {k!r}: {None if got is None else tuple(got.shape)}, expected "
                             f"{shapes[k]}; load hydra heads with load_heads or make them with init_heads")


def token_embeddings(params) -> jax.Array:
    """The backbone's input embedding table [V, D] (`models.llama.LlamaModel` params ``embed/embedding``)."""
    return params["embed"]["embedding"]


def head_state(cfg: MedusaConfig, params, k: int, hidden: jax.Array, path_embeds: jax.Array,
               dtype=jnp.float32) -> jax.Array:
    """Head k's state before its vocabulary projection (module docstring; Ankner et al. 2024, Sec. 3).

    Args:
      cfg: the heads' config (num_layers L >= 1).
      params: Hydra head params (module docstring); only head k's are read.
      k: the head (static int), 0 <= k < cfg.num_heads.
      hidden: [..., D] backbone hidden state h_t (after the final norm); it broadcasts against
        ``path_embeds[..., 0, :]``, so one h_t ([B, 1, D]) serves many paths ([B, n, k+1, D]).
      path_embeds: [..., k+1, D] embeddings of the path's tokens x_{t+1}..x_{t+k+1}, root first.
      dtype: compute dtype.
    Returns:
      [broadcast(...), D] in `dtype`.
    Raises:
      ValueError: a path of the wrong length.
    """
    if path_embeds.shape[-2] != k + 1:
        raise ValueError(f"hydra head {k} reads a path of {k + 1} tokens (root first), got {path_embeds.shape[-2]}")
    if DECODE_FIRST.format(k) in params:
        return _decoding_head_state(cfg, params, k, hidden, path_embeds, dtype)
    h = hidden.astype(dtype)
    e = path_embeds.astype(dtype)
    w, b = params["blocks_kernel"][k].astype(dtype), params["blocks_bias"][k].astype(dtype)
    pk, pr = params[PATH_KERNEL.format(k)].astype(dtype), params[PATH_RESIDUAL.format(k)].astype(dtype)
    y = h @ w[0] + b[0] + jnp.einsum("...jd,jde->...e", e, pk)
    x = h + jnp.einsum("...jd,jde->...e", e, pr) + jax.nn.silu(y)
    for l in range(1, cfg.num_layers):
        x = x + jax.nn.silu(x @ w[l] + b[l])
    return x


#: Names of the decoding layout's params (`decoding_layout`), per head k and block l.
DECODE_FIRST, DECODE_RESIDUAL = "decode_first_t_{}", "decode_residual_t_{}"
DECODE_BLOCK, DECODE_BIAS = "decode_block_t_{}_{}", "decode_bias_{}_{}"
DECODE_PREFIX = "decode_"


def decoding_layout(cfg: MedusaConfig, params, depth: int, dtype=jnp.float32) -> dict:
    """`params` plus heads 0..depth-1 in decoding layout, made once (`heads.medusa.prepare_heads`), the
    matrices in `dtype` (float32 or bfloat16; the biases stay as they are):

        decode_first_t_{k}     [D, (k+2) D]  [W[k, 0]; P[k][0]; ...; P[k][k]] transposed: the first
                                             block's pre-activation from ``[h_t ; e_1 ; ... ; e_{k+1}]``
        decode_residual_t_{k}  [D, (k+1) D]  [R[k][0]; ...; R[k][k]] transposed
        decode_block_t_{k}_{l} [D, D]        W[k, l] transposed, l >= 1
        decode_bias_{k}_{l}    [D]           b[k, l]

    Each is one ``[out, in]`` matrix that `medusa_jax.kernels.matmul_nt` streams whole: inside the
    jitted step, slicing head k's blocks out of the stacked ``blocks_kernel`` and reshaping its
    path params copied ~3 MB of weights per head per step (1-3 ms of a tree step on this
    project's CPU, docs/performance.md). Matrices of 2 MB or more go on 2 MB pages
    (`kernels.on_huge_pages`), as the backbone's. A head already in decoding layout in `dtype`
    (prepared heads prepared again, as each `generate` call does) keeps its arrays; other decoding
    layout keys from an earlier call are dropped.
    """
    out = {k: v for k, v in params.items() if not k.startswith(DECODE_PREFIX)}
    for k in range(depth):
        keys = [DECODE_FIRST.format(k), DECODE_RESIDUAL.format(k)] + [DECODE_BLOCK.format(k, l) for l in
                                                                      range(1, cfg.num_layers)]
        if all(n in params and params[n].dtype == dtype for n in keys):
            out.update({n: params[n] for n in keys + [DECODE_BIAS.format(k, l) for l in range(cfg.num_layers)]})
            continue
        w, b = jnp.asarray(params["blocks_kernel"][k]), jnp.asarray(params["blocks_bias"][k])  # [L, D, D], [L, D]
        D = w.shape[-1]
        path_kernel = jnp.asarray(params[PATH_KERNEL.format(k)]).reshape(-1, D)      # [(k+1) D, D]
        out[DECODE_FIRST.format(k)] = jnp.transpose(jnp.concatenate([w[0], path_kernel], axis=0)).astype(dtype)
        out[DECODE_RESIDUAL.format(k)] = jnp.transpose(
            jnp.asarray(params[PATH_RESIDUAL.format(k)]).reshape(-1, D)).astype(dtype)
        for l in range(cfg.num_layers):
            if l:
                out[DECODE_BLOCK.format(k, l)] = jnp.transpose(w[l]).astype(dtype)
            out[DECODE_BIAS.format(k, l)] = b[l]
        out.update({n: kernels.on_huge_pages(out[n]) for n in keys})
    return out


def _decoding_head_state(cfg: MedusaConfig, params, k: int, hidden: jax.Array, path_embeds: jax.Array,
                         dtype) -> jax.Array:
    """`head_state` from the decoding layout (`decoding_layout`): the same math, as 1 + 1 + (L - 1)
    weight-streaming products."""
    D = hidden.shape[-1]
    e = path_embeds.astype(dtype)
    lead = jnp.broadcast_shapes(hidden.shape[:-1], e.shape[:-2])
    h = jnp.broadcast_to(hidden.astype(dtype), lead + (D,))
    path = jnp.broadcast_to(e.reshape(e.shape[:-2] + (-1,)), lead + ((k + 1) * D,))    # [..., (k+1) D]
    mat = lambda name: kernels.weight_for(params[name], dtype)
    y = kernels.matmul_nt(jnp.concatenate([h, path], axis=-1), mat(DECODE_FIRST.format(k))) \
        + mat(DECODE_BIAS.format(k, 0))
    x = h + kernels.matmul_nt(path, mat(DECODE_RESIDUAL.format(k))) + jax.nn.silu(y)
    for l in range(1, cfg.num_layers):
        x = x + jax.nn.silu(kernels.matmul_nt(x, mat(DECODE_BLOCK.format(k, l))) + mat(DECODE_BIAS.format(k, l)))
    return x


def teacher_forced_states(cfg: MedusaConfig, params, hidden: jax.Array, path_embeds: jax.Array,
                          depth: Optional[int] = None, dtype=jnp.float32) -> jax.Array:
    """Every head's state with the true path (teacher forcing), for training and calibration.

    Args:
      hidden: [N, D] hidden states h_t.
      path_embeds: [N, K', D] embeddings of the true tokens t+1..t+K' (K' >= depth); head k reads
        the first k+1 of them.
      depth: heads 0..depth-1 (default: all cfg.num_heads).
    Returns:
      [depth, N, D] in `dtype`: row k is head k's state before its projection (it scores token t+k+2).
    """
    depth = cfg.num_heads if depth is None else depth
    if path_embeds.shape[-2] < depth:
        raise ValueError(f"{depth} hydra heads need paths of {depth} tokens, got {path_embeds.shape[-2]}")
    return jnp.stack([head_state(cfg, params, k, hidden, path_embeds[..., :k + 1, :], dtype) for k in range(depth)])


def num_path_params(cfg: MedusaConfig) -> int:
    """Number of Hydra-only parameters (sum of `path_shapes`)."""
    return int(sum(np.prod(s) for s in path_shapes(cfg).values()))


def hydra_logits(cfg: MedusaConfig, params, hidden: jax.Array, path_embeds: jax.Array,
                 base_lm_head: Optional[jax.Array] = None) -> jax.Array:
    """Full-vocabulary logits of every head with teacher forcing (`teacher_forced_states`).

    Args:
      hidden: [N, D]; path_embeds: [N, K, D] (embeddings of tokens t+1..t+K).
      base_lm_head: [D, V], required when cfg.shared_lm_head.
    Returns:
      [K, N, V] float32; entry k at position t scores token t+k+2.
    Raises:
      ValueError: shared lm_head and no base_lm_head.
    """
    x = teacher_forced_states(cfg, params, hidden, path_embeds)
    if cfg.shared_lm_head:
        if base_lm_head is None:
            raise ValueError("these hydra heads share the base model's lm_head: pass base_lm_head=[D, V]")
        return jnp.einsum("knd,dv->knv", x, base_lm_head.astype(x.dtype)).astype(jnp.float32)
    return jnp.einsum("knd,kdv->knv", x, params["lm_head"].astype(x.dtype)).astype(jnp.float32)
