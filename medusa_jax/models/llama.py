"""Flax Linen decoder for the Llama family: Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2,
Qwen3 (per-head RMSNorm of queries and keys before RoPE).

Used pure-functionally (docs/design-notes.md, "Conventions")::

    logits, hidden, cache = LlamaModel(cfg).apply({"params": p}, tokens, positions, cache, mask)

Reference: transformers' ``modeling_llama.py`` / ``modeling_mistral.py`` / ``modeling_qwen2.py`` /
``modeling_qwen3.py`` (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP). Parameter
kernels are stored ``[in, out]`` (the transpose of torch's ``nn.Linear.weight``).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import KVCache


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[Dh/2] float32``, with Llama-3 or linear scaling applied.

    Follows transformers' ``_compute_default_rope_parameters`` and
    ``_compute_llama3_parameters``.
    """
    dh = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    # llama3
    old = rs.original_max_position_embeddings
    low_wl = old / rs.low_freq_factor
    high_wl = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def accumulation_dtype(dtype) -> jnp.dtype:
    """The dtype RMSNorm, RoPE's rotation, attention's scores and softmax and the logits compute in
    for activations of `dtype`: float32 for float32, bfloat16 and float16, float64 for float64
    (params cast to float64 under ``jax_enable_x64``: a reference forward, as transformers'
    ``model.double()``, whose RoPE tables stay float32 too)."""
    return jnp.promote_types(dtype, jnp.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> Tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE's (cos, sin), each [B, T, 1, Dh] float32, for positions [B, T] int32.

    Computed once per forward and shared by every layer's queries and keys. Left to itself, XLA's
    CPU compiler fuses the sines and cosines into each layer's RoPE fusions, for queries and keys:
    60 evaluations per step for SmolLM2 (0.6 ms of an 8-node tree step, docs/performance.md); an
    optimization barrier does not stop it (it is removed before fusion), a conditional does."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, Dh]
    tables = lambda e: (jnp.cos(e)[:, :, None, :], jnp.sin(e)[:, :, None, :])
    # On the CPU, behind a conditional whose predicate XLA cannot know (always true), so that the
    # tables are materialized once; elsewhere (GPU, where a conditional reads its predicate on the
    # host) as they are.
    cpu = lambda e: jax.lax.cond(jnp.all(positions >= -(1 << 30)), tables, tables, e)
    return jax.lax.platform_dependent(emb, cpu=cpu, default=tables)


def apply_rope(x: jax.Array, rope: Tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; rope: (cos, sin) from `rope_tables`. Returns x's shape and dtype."""
    cos, sin = rope
    xf = x.astype(accumulation_dtype(x.dtype))
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


class Linear(nn.Module):
    """``y = x @ kernel + bias``: nn.Dense's parameters and initialisers (``kernel [in, out]``,
    ``bias [out]``), with a second, decoding layout.

    When the params hold ``kernel_t [out, in]`` instead of ``kernel``
    (`models.layout.decoding_params`), the product streams the weights once for all rows
    (`medusa_jax.kernels.matmul_nt`: the CPU kernel for decoding-sized products, XLA's otherwise); ``kernel_t`` may be a `kernels.BlockWeight`
    (a GGUF file's blocks, ``load_model(weights="as-stored")``). x: [..., in] -> [..., out] in `dtype`.
    """
    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel_t"):
            w = self.get_variable("params", "kernel_t")
            y = kernels.matmul_nt(x.astype(self.dtype), kernels.weight_for(w, self.dtype))
        else:
            w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.param_dtype)
            y = jax.lax.dot_general(x.astype(self.dtype), w.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype).astype(self.dtype)
        return y


def _fused_product(module: nn.Module, x: jax.Array, name: str, dtype) -> jax.Array:
    """The decoding layout's fused projection of `module`: ``x [..., D] @ {name}_t [N, D]^T`` (+
    ``{name}_bias [N]`` when present) -> [..., N] in `dtype`, one weight-streaming product for
    what `Linear` layers sharing an input compute (`models.layout.decoding_params`)."""
    w = module.get_variable("params", f"{name}_t")
    y = kernels.matmul_nt(x.astype(dtype), kernels.weight_for(w, dtype))
    if module.has_variable("params", f"{name}_bias"):
        y = y + module.get_variable("params", f"{name}_bias").astype(dtype)
    return y


class Embed(nn.Embed):
    """`flax.linen.Embed` (param ``embedding [V, D]``, the same init and lookup), whose table may
    also be a `kernels.BlockWeight` (a GGUF file's blocks, ``load_model(weights="as-stored")``):
    then a lookup dequantizes only the rows it reads. tokens [...] int -> [..., D] in `dtype`."""

    def setup(self):
        if self.has_variable("params", "embedding") and isinstance(
                self.get_variable("params", "embedding"), kernels.BlockWeight):
            self.embedding = self.get_variable("params", "embedding")
        else:
            super().setup()

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if isinstance(self.embedding, kernels.BlockWeight):
            return kernels.take_rows(self.embedding, inputs).astype(self.dtype)
        return super().__call__(inputs)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis (computed in float32, as transformers' LlamaRMSNorm; float64 for
    float64 x, `accumulation_dtype`). x: [..., D];
    param ``scale [D]``. Qwen3's q/k norms apply it to [B, T, heads, Dh] (each head alone)."""
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(accumulation_dtype(x.dtype))
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(self.dtype) * xf.astype(self.dtype))


def build_attention_mask(lengths: Optional[jax.Array], size: int, block: jax.Array,
                         positions: jax.Array, sliding_window: Optional[int]) -> jax.Array:
    """Boolean attention mask ``[B, T, S]`` over a cache of ``S = size`` slots.

    Slot ``s`` of row ``b`` is visible to query ``t`` when it is in the cached prefix
    (``s < lengths[b]``) or it is new token ``j = s - lengths[b]`` with ``block[b, t, j]``.
    With ``lengths=None`` there is no cache and ``S == T`` (the block alone).
    A sliding window (``ModelConfig.layer_windows``, per layer) hides keys with
    ``q_pos - k_pos >= window``, as transformers' ``sliding_window_overlay``; cached slot ``s``
    holds position ``s`` (rows start at position 0), so the whole cache is kept and masked.

    Args:
      lengths: [B] int32 or None.
      block: [B, T, T] bool (causal for prefill/decode; the tree's ancestor mask for verification).
      positions: [B, T] int32 positions of the new tokens.
    """
    B, T, _ = block.shape
    if lengths is None:
        mask = block
        k_pos = positions
    else:
        s = jnp.arange(size, dtype=jnp.int32)[None, :]
        rel = s - lengths[:, None]  # [B, S]
        in_new = (rel >= 0) & (rel < T)
        idx = jnp.clip(rel, 0, T - 1)
        gathered = jnp.take_along_axis(block, jnp.broadcast_to(idx[:, None, :], (B, T, size)), axis=2)
        mask = (rel < 0)[:, None, :] | (in_new[:, None, :] & gathered)
        k_pos = jnp.where(rel < 0, s, jnp.take_along_axis(positions, idx, axis=1))
    if sliding_window:
        mask = mask & ((positions[:, :, None] - k_pos[:, None, :]) < sliding_window)
    return mask


def _grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, H, Dh] queries -> [B, KVH, g * T, Dh], scaled by ``1 / sqrt(Dh)``: each KV head's g
    query heads stacked along the rows, so that both attention products are batched over
    (B, KVH): on this project's CPU, XLA ran 256 queries over 2,048 slots about twice as fast in
    this layout as with the heads between the token axes."""
    B, T, H, Dh = q.shape
    q = (q.astype(accumulation_dtype(q.dtype)) * (1.0 / math.sqrt(Dh))).astype(q.dtype)
    return q.reshape(B, T, kv_heads, H // kv_heads, Dh).transpose(0, 2, 3, 1, 4).reshape(B, kv_heads, -1, Dh)


def _ungrouped(out: jax.Array) -> jax.Array:
    """[B, KVH, g, T, Dh] -> [B, T, H * Dh] (query head ``h = kv_head * g + i``)."""
    B, KVH, g, T, Dh = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, KVH * g * Dh)


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                            dtype=jnp.float32) -> jax.Array:
    """Masked softmax attention with grouped-query heads (KVH key/value heads, each shared by
    ``g = H // KVH`` query heads, query head ``h`` reading KV head ``h // g``, as transformers'
    ``repeat_kv``).

    Args:
      q: [B, T, H, Dh] queries (RoPE applied); k, v: [B, KVH, S, Dh] (the KV cache's layout);
        mask: [B, T, S] bool (True = visible; a query that sees no key gets the mean of all values).
      dtype: the compute dtype of the output.
    Returns:
      [B, T, H * Dh]: ``softmax(q k^T / sqrt(Dh)) v`` per head, scores and softmax in float32
      (`accumulation_dtype`: float64 for float64 q).

    The softmax is normalised after the product with v (``(exp(s - max) v) / sum``), so the
    [B, H, T, S] scores are written once and read twice rather than five times.
    """
    B, T, H, Dh = q.shape
    KVH, S = k.shape[1], k.shape[2]
    qg = _grouped_queries(q, KVH)
    acc = accumulation_dtype(q.dtype)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k.astype(q.dtype),
                        preferred_element_type=acc).reshape(B, KVH, H // KVH, T, S)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(acc).min)
    unnormalized = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)  # [B, KVH, g, T, 1], >= 1
    out = jnp.einsum("bkqs,bksd->bkqd", unnormalized.reshape(B, KVH, -1, S).astype(dtype),
                     v.astype(dtype), preferred_element_type=acc)
    return _ungrouped((out.reshape(B, KVH, H // KVH, T, Dh) / total).astype(dtype))


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, end: jax.Array,
                        block: int, dtype=jnp.float32) -> jax.Array:
    """`grouped_query_attention` over the cache in blocks of `block` slots, with the online
    softmax of FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018): a running max and sum
    per query rescale the partial output as each block arrives. Only the blocks before `end` are
    read (a `lax.fori_loop` with a traced trip count), and no [B, H, T, S] array is formed, so a
    long prompt's chunks cost what their causal part of the cache costs.

    Args:
      q: [B, T, H, Dh]; k, v: [B, KVH, S, Dh]; mask: [B, T, S] bool, as `grouped_query_attention`.
      end: () int32, one past the last slot any query may see (slots ``>= end`` are skipped).
      block: slots per block (static); S must be a multiple of it.
      dtype: the compute dtype of the output.
    Returns:
      [B, T, H * Dh], equal to `grouped_query_attention` up to float32 round-off (a query that
      sees no key gets the mean of the values it read).
    Raises:
      ValueError: S not a multiple of `block`.
    """
    B, T, H, Dh = q.shape
    KVH, S = k.shape[1], k.shape[2]
    if S % block:
        raise ValueError(f"blockwise attention needs a cache size that is a multiple of the block: "
                         f"S={S}, block={block}")
    g = H // KVH
    qg = _grouped_queries(q, KVH)
    acc_dt = accumulation_dtype(q.dtype)
    low = jnp.finfo(acc_dt).min

    def body(j, carry):
        top, total, acc = carry  # running max and sum [B, KVH, g, T, 1], output [B, KVH, g, T, Dh]
        kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=2).astype(q.dtype)
        vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2).astype(dtype)
        mb = jax.lax.dynamic_slice_in_dim(mask, j * block, block, axis=2)
        s = jnp.einsum("bkqd,bksd->bkqs", qg, kb, preferred_element_type=acc_dt).reshape(B, KVH, g, T, block)
        s = jnp.where(mb[:, None, None, :, :], s, low)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - new_top)
        rescale = jnp.exp(top - new_top)
        part = jnp.einsum("bkqs,bksd->bkqd", p.reshape(B, KVH, g * T, block).astype(dtype), vb,
                          preferred_element_type=acc_dt).reshape(B, KVH, g, T, Dh)
        return new_top, total * rescale + jnp.sum(p, axis=-1, keepdims=True), acc * rescale + part

    init = (jnp.full((B, KVH, g, T, 1), low, acc_dt), jnp.zeros((B, KVH, g, T, 1), acc_dt),
            jnp.zeros((B, KVH, g, T, Dh), acc_dt))
    blocks = jnp.clip((end + block - 1) // block, 1, S // block)
    _, total, acc = jax.lax.fori_loop(0, blocks, body, init)
    return _ungrouped((acc / total).astype(dtype))


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        dense = lambda n, bias: Linear(n, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype)
        self.q_proj = dense(c.num_heads * c.head_dim, c.attention_bias)
        self.k_proj = dense(c.num_kv_heads * c.head_dim, c.attention_bias)
        self.v_proj = dense(c.num_kv_heads * c.head_dim, c.attention_bias)
        self.o_proj = dense(c.hidden_size, c.o_proj_bias)
        if c.qk_norm:  # Qwen3: params q_norm/scale, k_norm/scale [Dh], shared by the heads
            self.q_norm = RMSNorm(c.rms_norm_eps, self.dtype)
            self.k_norm = RMSNorm(c.rms_norm_eps, self.dtype)

    def __call__(self, x, rope, mask, kv: Optional[Tuple[jax.Array, jax.Array]], lengths,
                 layer: int, kv_block: Optional[int] = None):
        """x: [B, T, D]; rope: (cos, sin) of the new tokens' positions (`rope_tables`); mask: [B, T, S];
        kv: the whole cache (k, v: [L, B, KVH, S, Dh]) or None.

        The T new K/V go to slots ``lengths[b] + t`` of layer `layer` (a scatter that XLA does in
        place when the cache is donated; out-of-range slots are dropped, never clamped).
        kv_block: read the cache with `blockwise_attention` in blocks of this many slots (when S
        is a larger multiple of it), skipping the slots past every row's last new token.
        Returns (out [B, T, D], updated (k, v) or None).
        """
        c = self.cfg
        B, T, _ = x.shape
        if self.has_variable("params", "qkv_t"):  # decoding layout: one product for q, k and v
            nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            q, k, v = jnp.split(_fused_product(self, x, "qkv", self.dtype), [nq, nq + nk], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, T, c.num_heads, c.head_dim)
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per head, before RoPE (transformers' Qwen3Attention)
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        if kv is not None:
            rows = jnp.arange(B)[:, None]
            slots = lengths[:, None] + jnp.arange(T)[None, :]
            # [B, T, KVH, Dh] into [layer, b, :, slot, :] (the indexed dims lead the update's shape)
            k_full = kv[0].at[layer, rows, :, slots].set(k.astype(kv[0].dtype), mode="drop")
            v_full = kv[1].at[layer, rows, :, slots].set(v.astype(kv[1].dtype), mode="drop")
            k_all, v_all, new_kv = k_full[layer], v_full[layer], (k_full, v_full)
        else:
            k_all, v_all, new_kv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), None
        S = k_all.shape[2]
        if kv is not None and kv[0].dtype == q.dtype and kernels.attention_applies(q.dtype, T):
            # a decoding or tree step: the CPU kernel reads the layer's cache in place
            fallback = lambda q, k, v, mask, lengths: grouped_query_attention(q, k[layer], v[layer], mask, self.dtype)
            out = kernels.cache_attention(q, new_kv[0], new_kv[1], mask, lengths, layer, fallback).astype(self.dtype)
        elif kv is not None and kv_block and S > kv_block and S % kv_block == 0:
            end = jnp.max(lengths) + T  # no row sees a slot at or past it
            out = blockwise_attention(q, k_all, v_all, mask, end, kv_block, self.dtype)
        else:
            out = grouped_query_attention(q, k_all, v_all, mask, self.dtype)
        return self.o_proj(out), new_kv


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = lambda n, name: Linear(n, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name)
        if self.has_variable("params", "gate_up_t"):  # decoding layout: one product for gate and up
            gate, up = jnp.split(_fused_product(self, x, "gate_up", self.dtype), 2, axis=-1)
        else:
            gate, up = dense(c.intermediate_size, "gate_proj")(x), dense(c.intermediate_size, "up_proj")(x)
        h = nn.silu(gate) * up
        return dense(c.hidden_size, "down_proj")(h)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.input_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)
        self.attn = Attention(self.cfg, self.dtype)
        self.post_attn_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)
        self.mlp = MLP(self.cfg, self.dtype)

    def __call__(self, x, rope, mask, kv, lengths, layer: int, kv_block: Optional[int] = None):
        h, new_kv = self.attn(self.input_norm(x), rope, mask, kv, lengths, layer, kv_block)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), new_kv


class LlamaModel(nn.Module):
    """Llama-family causal LM.

    Parameters: ``embed/embedding [V, D]``, ``layers_{i}/...`` (Qwen3 adds
    ``layers_{i}/attn/q_norm/scale`` and ``k_norm/scale [Dh]``), ``norm/scale [D]`` and, when the
    embeddings are untied, ``lm_head/kernel [D, V]``.

    dtype: the compute dtype of activations, weights' products and the K/V written to the cache.
    None (the default): the params' own dtype (`compute_dtype`; float32 when initialising), so
    that float32 params compute in float32 and bfloat16 / float16 params (``load_model(dtype=...)``)
    in bfloat16 / float16. Logits are float32 whatever the dtype; RMSNorm, RoPE and the softmax of
    attention compute in float32 (float64 params under ``jax_enable_x64`` compute everything but
    the RoPE tables in float64, logits included: `accumulation_dtype`).
    """
    cfg: ModelConfig
    dtype: Optional[jnp.dtype] = None

    def setup(self):
        c = self.cfg
        emb = self.variables.get("params", {}).get("embed", {}).get("embedding")
        dt = self.dtype if self.dtype is not None else (emb.dtype if emb is not None else jnp.float32)
        self.compute_dtype = dt
        self.embed = Embed(c.vocab_size, c.hidden_size, dtype=dt, param_dtype=dt)
        self.layers = [DecoderLayer(c, dt, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, dt)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, use_bias=False, dtype=dt, param_dtype=dt)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Optional[KVCache] = None,
                 mask: Optional[jax.Array] = None, num_new: Optional[jax.Array] = None,
                 compute_logits: bool = True, kv_block: Optional[int] = None):
        """Run T new tokens per row, optionally on top of a KV cache.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions (``lengths + arange(T)`` for prefill/decode,
            ``lengths + depth`` for a Medusa tree).
          cache: a `KVCache` (k, v: [L, B, KVH, S, Dh]); the T new K/V are written at slots
            ``lengths[b] .. lengths[b] + T - 1`` (caller guarantees ``lengths + T <= S``).
            None: no cache, attention over the T tokens only (training).
          mask: [T, T] or [B, T, T] bool block among the new tokens (default causal); the cached
            prefix is visible, except what a layer's sliding window (`ModelConfig.layer_windows`)
            hides.
          num_new: [B] int32, how many of the T tokens are real per row (right padding);
            the returned cache's lengths advance by it (default T).
          compute_logits: when False, logits are None (saves the [B, T, V] projection).
          kv_block: with a cache whose size S is a larger multiple of it, attention reads the cache
            in blocks of this many slots and stops after the last new token's slot
            (`blockwise_attention`): for long prompts. None: one pass over all S slots.

        Returns:
          (logits [B, T, V] float32 or None, hidden [B, T, D] after the final norm, new cache or None).
        """
        B, T = tokens.shape
        if mask is None:
            mask = jnp.tril(jnp.ones((T, T), bool))
        if mask.ndim == 2:
            mask = jnp.broadcast_to(mask, (B, T, T))
        lengths = cache.lengths if cache is not None else None
        S = cache.size if cache is not None else T
        windows = self.cfg.layer_windows  # per layer: a window in tokens or None (full attention)
        masks = {w: build_attention_mask(lengths, S, mask, positions, w) for w in set(windows)}
        rope = rope_tables(positions, rope_inv_freq(self.cfg))
        x = self.embed(tokens)
        kv = (cache.k, cache.v) if cache is not None else None
        x, kv = self._run_layers(x, rope, masks, kv, lengths, kv_block, 0, self.cfg.num_layers)
        hidden = self.norm(x)
        new_cache = None
        if cache is not None:
            adv = num_new if num_new is not None else jnp.full((B,), T, jnp.int32)
            slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # where the K/V went
            written = cache.tokens.at[jnp.arange(B)[:, None], slots].set(tokens.astype(jnp.int32), mode="drop")
            new_cache = KVCache(k=kv[0], v=kv[1], lengths=cache.lengths + adv, tokens=written)
        logits = self.logits(hidden) if compute_logits else None
        return logits, hidden, new_cache

    def _run_layers(self, x, rope, masks, kv, lengths, kv_block, start: int, stop: int):
        windows = self.cfg.layer_windows
        for i in range(start, stop):
            x, kv = self.layers[i](x, rope, masks[windows[i]], kv, lengths, i, kv_block)
        return x, kv

    def _causal(self, positions: jax.Array):
        B, T = positions.shape
        block = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        masks = {w: build_attention_mask(None, T, block, positions, w) for w in set(self.cfg.layer_windows)}
        return rope_tables(positions, rope_inv_freq(self.cfg)), masks

    def layer_inputs(self, tokens: jax.Array, positions: jax.Array, layer: int) -> jax.Array:
        """The residual stream entering decoder layer `layer` (0 <= layer <= L; L: after the last
        layer, before the final norm) for whole sequences without a cache: tokens, positions
        [B, T] int32 -> [B, T, D] in the compute dtype. What Medusa-2 on the top ``L - layer``
        layers caches (`medusa_jax.train.layer_cache`); ``top_layers(layer_inputs(t, p, n), p, n)``
        is ``__call__(t, p)`` without a cache."""
        rope, masks = self._causal(positions)
        return self._run_layers(self.embed(tokens), rope, masks, None, None, None, 0, layer)[0]

    def top_layers(self, x: jax.Array, positions: jax.Array, layer: int, compute_logits: bool = True):
        """Decoder layers ``layer .. L - 1``, the final norm and the logits on the residual stream
        `x` [B, T, D] entering `layer` (`layer_inputs`), causal, no cache; positions [B, T] int32.
        Returns (logits [B, T, V] float32 or None, hidden [B, T, D] after the final norm)."""
        rope, masks = self._causal(positions)
        x = self._run_layers(x, rope, masks, None, None, None, layer, self.cfg.num_layers)[0]
        hidden = self.norm(x)
        return (self.logits(hidden) if compute_logits else None), hidden

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head projection: hidden [..., D] -> logits [..., V] float32 (float64 for float64
        params). In bfloat16 / float16 the product accumulates into float32 outputs (rounding
        logits to the low dtype would make exact ties of nearby logits common, and greedy choices
        between them arbitrary)."""
        dt = self.compute_dtype
        if self.cfg.tie_word_embeddings:  # the embedding [V, D] is already the [out, in] layout
            w = self.embed.embedding
        elif dt == jnp.float32:
            return self.lm_head(hidden).astype(jnp.float32)
        else:
            p = self.lm_head.variables["params"]
            w = p["kernel_t"] if "kernel_t" in p else p["kernel"].T
        if dt == jnp.float32:
            return kernels.matmul_nt(hidden.astype(dt), kernels.weight_for(w, dt)).astype(jnp.float32)
        return jax.lax.dot_general(hidden.astype(dt), w.astype(dt), (((hidden.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=accumulation_dtype(dt))


def compute_dtype(params) -> jnp.dtype:
    """The dtype a `LlamaModel` computes in with these params: their embedding's (float32,
    bfloat16 or float16); the KV cache and the hidden states are kept in it too."""
    return jnp.dtype(params["embed"]["embedding"].dtype)


def lm_head_matrix(cfg: ModelConfig, params) -> jax.Array:
    """The base model's output projection from a params tree, as [D, V] (embedding.T when tied;
    a table kept as GGUF blocks is dequantized, inside jit only where the result is used)."""
    if cfg.tie_word_embeddings:
        return _dense(params["embed"]["embedding"]).T
    if "kernel_t" in params["lm_head"]:
        return _dense(params["lm_head"]["kernel_t"]).T
    return params["lm_head"]["kernel"]


def lm_head_blocks(cfg: ModelConfig, params) -> Optional[kernels.BlockWeight]:
    """The base model's output projection as the params hold it when that is GGUF blocks: the
    [V, D] `kernels.BlockWeight` (the tied embedding, or ``lm_head/kernel_t``); None otherwise.
    The heads' proposal projection takes its rows from it as blocks (`heads.medusa.prepare_heads`)."""
    w = params["embed"]["embedding"] if cfg.tie_word_embeddings else params["lm_head"].get("kernel_t")
    return w if isinstance(w, kernels.BlockWeight) else None


def _dense(w):
    """A weight as an array: GGUF blocks (`kernels.BlockWeight`) dequantized to float32."""
    return w.dequantize() if isinstance(w, kernels.BlockWeight) else w
