"""Medusa decoding heads (Cai et al. 2024, "Medusa", Sec. 2.1.1).

K heads sit on the backbone's last hidden state (after the final norm). Head k (0-based) reads the
hidden state at position t and predicts token t+k+2 (the backbone's own lm_head predicts t+1).
Each head is L residual blocks followed by a vocabulary projection::

    x = h_t
    for l in range(L):
        x = x + silu(x @ W[k, l] + b[k, l])        # W [D, D] stored [in, out]
    logits_k = x @ lm_head_k                        # [D, V]

This is the official ``ResBlock`` (``x + SiLU(Linear(x))``) of FasterDecoding/Medusa
(``medusa/model/medusa_model.py``) followed by ``nn.Linear(D, V, bias=False)``. W and b start at
zero, and silu(0) == 0, so a fresh block is the identity; with the projection equal to the base
lm_head a fresh head reproduces the base model's next-token logits exactly.

The projection is either a per-head copy of the base lm_head (the paper's head, ``lm_head [K, D, V]``
in the params) or the base lm_head itself, shared and frozen, passed in at call time
(``MedusaConfig.shared_lm_head``; the official format's ``"version": "2"`` variant).

Params (fixed layout; `medusa_jax.convert.medusa_format` and the trainer depend on it)::

    blocks_kernel [K, L, D, D]   y = x @ W (layout [in, out], the transpose of torch's Linear.weight)
    blocks_bias   [K, L, D]
    lm_head       [K, D, V]      only when cfg.shared_lm_head is False
    proposal_ids  [N] int32      only when cfg.proposal_vocab_size = N > 0: the tokens the heads
                                 may propose at decoding time (see `proposal_projection`)

Hydra heads (``cfg.head_type == "hydra"``, Ankner et al. 2024) have these params plus the path
params of `medusa_jax.heads.hydra` (their first block also reads the path's token embeddings); the
functions here handle both types.

Decoding reads the heads through `prepare_heads` (once, at load time): only the heads the tree
uses, the proposal projection precomputed, so the jitted step copies no weight.

Used pure-functionally, like the backbone::

    logits = MedusaHeads(cfg).apply({"params": p}, hidden, base_lm_head)      # [K, ..., V]
    states = MedusaHeads(cfg).apply({"params": p}, hidden, method=MedusaHeads.head_states)
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.heads import hydra
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import check_path_params, init_path_params, num_path_params, path_key_head
from medusa_jax.models.config import ModelConfig


class HeadsMismatchError(ValueError):
    """Medusa heads whose hidden size or vocabulary differ from the backbone's."""


def check_heads_match(heads_cfg: MedusaConfig, model_cfg: ModelConfig, source: str = "") -> None:
    """Raise `HeadsMismatchError` when the heads do not fit the backbone.

    Args:
      heads_cfg: the heads' `MedusaConfig`.
      model_cfg: the backbone's `ModelConfig`.
      source: where the heads came from (a path), for the message.
    Raises:
      HeadsMismatchError: hidden_size or vocab_size differ; the message names both numbers of each
        mismatch and what to do.
    """
    problems = []
    if heads_cfg.hidden_size != model_cfg.hidden_size:
        problems.append(f"hidden size {heads_cfg.hidden_size} (heads) != {model_cfg.hidden_size} (backbone)")
    if heads_cfg.vocab_size != model_cfg.vocab_size:
        problems.append(f"vocabulary size {heads_cfg.vocab_size} (heads) != {model_cfg.vocab_size} (backbone)")
    if problems:
        where = f" from {source}" if source else ""
        trained_for = f" (they were trained for {heads_cfg.base_model!r})" if heads_cfg.base_model else ""
        raise HeadsMismatchError(
            f"{heads_cfg.head_type.capitalize()} heads{where} do not fit this backbone{trained_for}: "
            f"{'; '.join(problems)}. "
            "Load heads trained for this backbone, or train new heads for it with train.py.")


def _check_lm_head(cfg: MedusaConfig, base_lm_head) -> None:
    shape = tuple(base_lm_head.shape)
    if shape != (cfg.hidden_size, cfg.vocab_size):
        raise HeadsMismatchError(
            f"base lm_head has shape {shape}, expected [D, V] = ({cfg.hidden_size}, {cfg.vocab_size}) "
            "for these heads; pass models.llama.lm_head_matrix(cfg, params) ([D, V], not torch's [V, D]) of the "
            "backbone the heads were trained for.")


class MedusaHeads(nn.Module):
    """K Medusa heads (see the module docstring for the math, the params and the source).

    Attributes:
      cfg: `MedusaConfig` (num_heads K, num_layers L, hidden_size D, vocab_size V, shared_lm_head).
      dtype: compute dtype of the blocks and the projection; params stay float32 and the logits
        are returned as float32.
    """
    cfg: MedusaConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        K, L, D, V = c.num_heads, c.num_layers, c.hidden_size, c.vocab_size
        self.blocks_kernel = self.param("blocks_kernel", nn.initializers.zeros, (K, L, D, D), jnp.float32)
        self.blocks_bias = self.param("blocks_bias", nn.initializers.zeros, (K, L, D), jnp.float32)
        if not c.shared_lm_head:
            # Module.init gives zeros here; use `init_heads` to start from copies of the base lm_head.
            self.lm_head = self.param("lm_head", nn.initializers.zeros, (K, D, V), jnp.float32)

    def head_states(self, hidden: jax.Array) -> jax.Array:
        """Each head's state after its residual blocks, before the vocabulary projection.

        Args:
          hidden: [..., D] backbone hidden states (after the final norm), any float dtype.
        Returns:
          [K, ..., D] in `dtype`; row k is head k's input to its projection.
        """
        c = self.cfg
        K = c.num_heads
        x = jnp.broadcast_to(hidden.astype(self.dtype), (K,) + hidden.shape)
        bshape = (K,) + (1,) * (hidden.ndim - 1) + (c.hidden_size,)
        for l in range(c.num_layers):  # L is small and static; the heads run together
            w = self.blocks_kernel[:, l].astype(self.dtype)  # [K, D, D]
            b = self.blocks_bias[:, l].astype(self.dtype).reshape(bshape)
            y = jnp.einsum("k...d,kde->k...e", x, w) + b
            x = x + jax.nn.silu(y)
        return x

    def __call__(self, hidden: jax.Array, base_lm_head: Optional[jax.Array] = None) -> jax.Array:
        """Logits of every head.

        Args:
          hidden: [..., D] backbone hidden states at positions t (e.g. [B, T, D]).
          base_lm_head: [D, V] the backbone's lm_head (`models.llama.lm_head_matrix(cfg, params)`); required
            when cfg.shared_lm_head, ignored otherwise.
        Returns:
          [K, ..., V] float32; entry k at position t scores token t+k+2.
        Raises:
          ValueError: shared lm_head and base_lm_head is None.
          HeadsMismatchError: base_lm_head is not [D, V].
        """
        x = self.head_states(hidden)
        if self.cfg.shared_lm_head:
            if base_lm_head is None:
                raise ValueError("these Medusa heads share the base model's lm_head "
                                 "(cfg.shared_lm_head=True): pass base_lm_head=[D, V], e.g. "
                                 "models.llama.lm_head_matrix(cfg, params)")
            _check_lm_head(self.cfg, base_lm_head)
            logits = jnp.einsum("k...d,dv->k...v", x, base_lm_head.astype(self.dtype))
        else:
            logits = jnp.einsum("k...d,kdv->k...v", x, self.lm_head.astype(self.dtype))
        return logits.astype(jnp.float32)


def init_heads(cfg: MedusaConfig, base_lm_head=None, dtype=jnp.float32) -> dict:
    """Fresh head params that reproduce the base model's next-token logits exactly.

    Blocks are zero (each block is then the identity, since silu(0) == 0). When
    ``cfg.shared_lm_head`` is False every head gets its own copy of ``base_lm_head``, as the official
    ``MedusaModel.__init__`` does.

    Args:
      cfg: the heads' config.
      base_lm_head: [D, V] the backbone's output projection (`models.llama.lm_head_matrix(cfg, params)`);
        required unless cfg.shared_lm_head (then it is only shape-checked if given).
      dtype: dtype of the returned arrays.
    Returns:
      {"blocks_kernel" [K, L, D, D], "blocks_bias" [K, L, D], and "lm_head" [K, D, V] when not
      shared}: pass as ``{"params": params}`` to `MedusaHeads.apply`. Hydra heads
      (``cfg.head_type == "hydra"``) also get their zero path params (`heads.hydra.init_path_params`),
      which keep the same starting logits.
    Raises:
      ValueError: not shared and base_lm_head is None.
      HeadsMismatchError: base_lm_head is not [D, V].
    """
    K, L, D = cfg.num_heads, cfg.num_layers, cfg.hidden_size
    params = {"blocks_kernel": jnp.zeros((K, L, D, D), dtype), "blocks_bias": jnp.zeros((K, L, D), dtype)}
    if base_lm_head is not None:
        _check_lm_head(cfg, base_lm_head)
    if not cfg.shared_lm_head:
        if base_lm_head is None:
            raise ValueError("heads with their own lm_head (cfg.shared_lm_head=False) start from copies "
                             "of the base lm_head: pass base_lm_head=[D, V], e.g. models.llama.lm_head_matrix(cfg, params)")
        lm = jnp.asarray(base_lm_head, dtype)
        params["lm_head"] = jnp.tile(lm[None], (K, 1, 1))
    if cfg.head_type == "hydra":
        params.update(init_path_params(cfg, dtype))
    return params


BLOCK_KEYS = ("blocks_kernel", "blocks_bias")


def check_block_params(cfg: MedusaConfig, params) -> None:
    """Raise `HeadsMismatchError` when the heads' block params (and own lm_heads, if present) do
    not have the shapes `cfg` says: blocks_kernel [K, L, D, D], blocks_bias [K, L, D], lm_head
    [K, D, V] (K heads, L blocks, hidden size D, vocabulary V), e.g. params of other heads put
    beside this config. Params without blocks (already in a decoding layout) pass."""
    K, L, D, V = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    expected = {"blocks_kernel": (K, L, D, D), "blocks_bias": (K, L, D), "lm_head": (K, D, V)}
    for key, shape in expected.items():
        got = params.get(key)
        if got is not None and tuple(got.shape) != shape:
            raise HeadsMismatchError(
                f"head param {key!r} has shape {tuple(got.shape)}, but the heads' config (K={K} heads, L={L} "
                f"blocks, hidden size D={D}, vocabulary V={V}) needs {shape}: the params and the config "
                "come from different heads; load both with load_heads, or make them with init_heads")


def proposal_projection(cfg: MedusaConfig, params, base_lm_head=None) -> jax.Array:
    """The heads' vocabulary projection restricted to ``params["proposal_ids"]``.

    Returns [D, N] (shared lm_head: columns of `base_lm_head` [D, V]) or [K, D, N] (own lm_heads).
    `with_proposal_projection` stores it once, so decoding does not gather it every step.
    Raises ValueError when ``cfg.proposal_vocab_size`` is 0 or the ids are missing or mis-sized.
    """
    ids = params.get("proposal_ids") if cfg.proposal_vocab_size else None
    if ids is None or tuple(ids.shape) != (cfg.proposal_vocab_size,):
        raise ValueError(f"proposal_vocab_size={cfg.proposal_vocab_size} needs params['proposal_ids'] of that "
                         f"length, got {None if ids is None else tuple(ids.shape)}")
    ids = jnp.asarray(ids, jnp.int32)
    if cfg.shared_lm_head:
        if base_lm_head is None:
            raise ValueError("shared-lm_head heads need base_lm_head [D, V] for their proposal projection")
        _check_lm_head(cfg, base_lm_head)
        return jnp.take(jnp.asarray(base_lm_head), ids, axis=1)
    return jnp.take(jnp.asarray(params["lm_head"]), ids, axis=2)


def with_proposal_projection(cfg: MedusaConfig, params, base_lm_head=None) -> dict:
    """`params` plus ``"proposal_lm_head"`` (`proposal_projection`, computed once) when the heads
    propose from a truncated vocabulary; unchanged otherwise. For decoding only."""
    if not cfg.proposal_vocab_size:
        return params
    return {**params, "proposal_lm_head": proposal_projection(cfg, params, base_lm_head)}


#: Params with a leading head axis [K, ...] (so is ``proposal_lm_head`` [K, D, N] of own lm_heads).
_PER_HEAD_KEYS = BLOCK_KEYS + ("lm_head",)


#: dtype of the matrices `prepare_heads` makes for the draft (the shared proposal projection, hydra
#: heads' decoding layout): the draft only proposes candidates, which the backbone verifies, and
#: bfloat16 halves what the heads stream per step (docs/performance.md, session 11).
DRAFT_DTYPE = jnp.bfloat16


def prepare_heads(cfg: MedusaConfig, params, base_lm_head: Union[jax.Array, Callable[[], jax.Array], None] = None,
                  depth: Optional[int] = None, draft_dtype=DRAFT_DTYPE,
                  lm_head_blocks: Optional[kernels.BlockWeight] = None
                  ) -> Tuple[MedusaConfig, dict]:
    """Heads made ready for decoding once, at load time, so that the jitted step (`heads.topk.head_topk`)
    slices and gathers no big weight, whatever the head file's layout.

    Inside jit, taking the first `depth` heads of a stacked [K, D, V] projection is a copy of
    depth * D * V floats every step (226 MB for two SmolLM2 heads), and a proposal projection not
    precomputed is a gather every step. Here, once:

    1. Only the first `depth` heads are kept (the tree's depth: deeper heads are never run; for
       hydra heads also their path params).
    2. Own lm_heads (``cfg.shared_lm_head`` False) that all equal `base_lm_head` exactly, as
       ``export_official(include_lm_head=True)`` and ``export_vllm`` write shared heads, become the
       shared lm_head: the same logits from one projection instead of `depth`.
    3. With a proposal vocabulary (``cfg.proposal_vocab_size`` = N), the projection is computed
       (`proposal_projection`) and stored as ``"proposal_lm_head_t"`` [N, D] when shared: the
       ``[out, in]`` layout that `medusa_jax.kernels` streams, in `draft_dtype` (bfloat16 by
       default: the heads' top-k only proposes candidates, which the backbone verifies, so greedy
       output does not depend on it), on 2 MB pages (`kernels.on_huge_pages`); or, when the
       backbone keeps its lm_head as GGUF blocks (`lm_head_blocks`), as those rows' blocks: the
       exact weights in about half of bfloat16's bytes (Q8_0: 34 bytes per 32). Own lm_heads get
       ``"proposal_lm_head"`` [depth, D, N]; the own lm_heads [depth, D, V], which decoding then
       never reads, are dropped.
    4. Hydra heads get their matrices in decoding layout (`heads.hydra.decoding_layout`: one
       ``[out, in]`` matrix per product in `draft_dtype`, streamed whole, instead of slices of the
       stacked params copied every step).
    Already prepared params pass through (cut further when `depth` is smaller).

    Args:
      cfg: the heads' config.
      params: their params (`MedusaHeads` layout, numpy or jax arrays, optionally ``{"params": ...}``).
      base_lm_head: [D, V] the backbone's lm_head (`models.llama.lm_head_matrix`), or a function of
        no arguments returning it, called at most once and only when a step needs the matrix (for
        a backbone held as GGUF blocks, building it dequantizes the whole table: ~150 ms and 113 MB
        for SmolLM2, in vain for heads already prepared or projecting from `lm_head_blocks`);
        needed for shared heads with a proposal vocabulary and no `lm_head_blocks`, and for step 2
        (skipped without it).
      depth: heads to keep, 1 <= depth <= cfg.num_heads; None keeps all.
      draft_dtype: dtype of the matrices made for the draft in steps 3 and 4 (float32 or bfloat16;
        default `DRAFT_DTYPE`). Greedy output does not depend on it; tokens per step barely does.
      lm_head_blocks: [V, D] the backbone's lm_head when held as GGUF blocks
        (`models.llama.lm_head_blocks`), or None; shared heads with a proposal vocabulary then keep
        their projection as its rows' blocks (step 3).
    Returns:
      (cfg with num_heads = depth and medusa_choices cut to that depth, shared_lm_head set by step 2;
      params as jax arrays). For decoding (`heads.topk.head_topk`, `generate`); the full-vocabulary
      logits of `MedusaHeads` and `medusa_format.save_heads` need the params as loaded.
    Raises:
      ValueError: depth outside [1, cfg.num_heads]; a shared-lm_head proposal vocabulary without
        base_lm_head; proposal ids missing; hydra heads whose path params are missing or mis-shaped.
      HeadsMismatchError: block params (or own lm_heads) whose shapes are not the config's
        (`check_block_params`), base_lm_head not [D, V], or lm_head_blocks not [V, D].
    """
    if "params" in params and "blocks_kernel" not in params:
        params = params["params"]
    K = cfg.num_heads
    depth = K if depth is None else int(depth)
    if not 1 <= depth <= K:
        raise ValueError(f"depth must be in [1, {K}] (the number of heads), got {depth}; use a tree no deeper "
                         "than the heads")
    base_of = _lm_head_source(cfg, base_lm_head)  # built only if a step below needs it
    check_block_params(cfg, params)
    if cfg.head_type == "hydra":
        check_path_params(cfg, params, depth)
    p = {k: (v[:depth] if k in _PER_HEAD_KEYS or (k == "proposal_lm_head" and v.ndim == 3) else v)
         for k, v in params.items() if (path_key_head(k) or 0) < depth}  # hydra: heads >= depth go
    choices = cfg.medusa_choices
    if choices is not None:
        choices = tuple(c for c in choices if len(c) <= depth) or None
    cfg = cfg.replace(num_heads=depth, medusa_choices=choices)
    if not cfg.shared_lm_head and "lm_head" in p and base_of() is not None:
        base = np.asarray(base_of())
        if all(np.array_equal(np.asarray(p["lm_head"][k]), base) for k in range(depth)):
            cfg = cfg.replace(shared_lm_head=True)
            p = {k: v for k, v in p.items() if k not in ("lm_head", "proposal_lm_head")}
    p = {k: v if isinstance(v, kernels.BlockWeight) else jnp.asarray(v) for k, v in p.items()}
    if cfg.proposal_vocab_size:
        if "proposal_lm_head_t" not in p and cfg.shared_lm_head and lm_head_blocks is not None:
            if tuple(lm_head_blocks.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise HeadsMismatchError(f"lm_head_blocks is {tuple(lm_head_blocks.shape)}, the heads need "
                                         f"[V={cfg.vocab_size}, D={cfg.hidden_size}]")
            rows = jnp.take(jnp.asarray(lm_head_blocks.blocks), jnp.asarray(p["proposal_ids"], jnp.int32), axis=0)
            p["proposal_lm_head_t"] = kernels.BlockWeight(kernels.on_huge_pages(rows), lm_head_blocks.fmt)  # [N, D]
            p.pop("proposal_lm_head", None)
        if "proposal_lm_head_t" not in p:
            proj = p.pop("proposal_lm_head", None)
            if proj is None:
                proj = proposal_projection(cfg, p, base_of())
            if proj.ndim == 2:  # shared: stored [N, D], the layout the decoding step streams
                p["proposal_lm_head_t"] = kernels.on_huge_pages(jnp.transpose(proj).astype(draft_dtype))
            else:
                p["proposal_lm_head"] = proj
        p.pop("lm_head", None)
    if cfg.head_type == "hydra":  # 4. hydra heads' matrices in the layout the step streams
        p = hydra.decoding_layout(cfg, p, depth, draft_dtype)
    return cfg, p


def _lm_head_source(cfg: MedusaConfig, base_lm_head) -> Callable[[], Optional[jax.Array]]:
    """`prepare_heads`' base lm_head as a function of no arguments that builds it at most once
    (`base_lm_head` an array, a function returning one, or None) and checks its shape: an array at
    once, a function's result when first called. Raises HeadsMismatchError when it is not [D, V]."""
    if not callable(base_lm_head):
        if base_lm_head is not None:
            _check_lm_head(cfg, base_lm_head)
        return lambda: base_lm_head

    @functools.cache
    def built():
        base = base_lm_head()
        if base is not None:
            _check_lm_head(cfg, base)
        return base
    return built


def frequent_tokens(sequences, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent token ids in `sequences` (iterables of ids), most frequent first;
    ties and never-seen tokens by id. Returns [size] int32. Raises ValueError unless 1 <= size <= V."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"size must be in [1, {vocab_size}], got {size}")
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        a = np.asarray(seq, np.int64)
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise ValueError(f"token id outside [0, {vocab_size}) in the data")
        np.add.at(counts, a, 1)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[:size].astype(np.int32)


def num_head_params(cfg: MedusaConfig) -> int:
    """Number of trainable head parameters (blocks, the per-head lm_heads when not shared, and the
    path params of hydra heads)."""
    K, L, D, V = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    n = K * L * (D * D + D) + (0 if cfg.shared_lm_head else K * D * V)
    if cfg.head_type == "hydra":
        n += num_path_params(cfg)
    return n


def heads_params_to_numpy(params) -> dict:
    """Unwrap ``{"params": ...}`` if present and convert every leaf to a float32 numpy array
    (``proposal_ids`` to int32; the derived ``proposal_lm_head`` / ``proposal_lm_head_t`` are dropped)."""
    if "params" in params and "blocks_kernel" not in params:
        params = params["params"]
    return {k: np.asarray(v, dtype=np.int32 if k == "proposal_ids" else np.float32) for k, v in params.items()
            if k not in ("proposal_lm_head", "proposal_lm_head_t") and not k.startswith(hydra.DECODE_PREFIX)}
