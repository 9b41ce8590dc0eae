"""Flax Linen decoder for the Llama family: Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2.

Used pure-functionally (DESIGN.md)::

    logits, hidden, cache = LlamaModel(cfg).apply({"params": p}, tokens, positions, cache, mask)

Reference: transformers' ``modeling_llama.py`` / ``modeling_mistral.py`` / ``modeling_qwen2.py``
(RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP). Parameter kernels are stored
``[in, out]`` (the transpose of torch's ``nn.Linear.weight``).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..kv_cache import KVCache


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; positions: [B, T] int32. Returns x's shape and dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, Dh]
    cos = jnp.cos(emb)[:, :, None, :]
    sin = jnp.sin(emb)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (computed in float32, as transformers' LlamaRMSNorm). x: [..., D]."""
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
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


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        dense = lambda n, bias: nn.Dense(n, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype)
        self.q_proj = dense(c.num_heads * c.head_dim, c.attention_bias)
        self.k_proj = dense(c.num_kv_heads * c.head_dim, c.attention_bias)
        self.v_proj = dense(c.num_kv_heads * c.head_dim, c.attention_bias)
        self.o_proj = dense(c.hidden_size, False)

    def __call__(self, x, positions, mask, kv: Optional[Tuple[jax.Array, jax.Array]], lengths,
                 inv_freq, layer: int):
        """x: [B, T, D]; mask: [B, T, S]; kv: the whole cache (k, v: [L, B, S, KVH, Dh]) or None.

        The T new K/V go to slots ``lengths[b] + t`` of layer `layer` (a scatter that XLA does in
        place when the cache is donated; out-of-range slots are dropped, never clamped).
        Returns (out [B, T, D], updated (k, v) or None).
        """
        c = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim)
        k = self.k_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if kv is not None:
            rows = jnp.arange(B)[:, None]
            slots = lengths[:, None] + jnp.arange(T)[None, :]
            k_full = kv[0].at[layer, rows, slots].set(k.astype(kv[0].dtype), mode="drop")
            v_full = kv[1].at[layer, rows, slots].set(v.astype(kv[1].dtype), mode="drop")
            k_all, v_all, new_kv = k_full[layer], v_full[layer], (k_full, v_full)
        else:
            k_all, v_all, new_kv = k, v, None
        g = c.num_heads // c.num_kv_heads
        qg = q.reshape(B, T, c.num_kv_heads, g, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_all.astype(q.dtype),
                            preferred_element_type=jnp.float32) / math.sqrt(c.head_dim)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v_all.astype(self.dtype))
        return self.o_proj(out.reshape(B, T, c.num_heads * c.head_dim)), new_kv


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name)
        h = nn.silu(dense(c.intermediate_size, "gate_proj")(x)) * dense(c.intermediate_size, "up_proj")(x)
        return dense(c.hidden_size, "down_proj")(h)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.input_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)
        self.attn = Attention(self.cfg, self.dtype)
        self.post_attn_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)
        self.mlp = MLP(self.cfg, self.dtype)

    def __call__(self, x, positions, mask, kv, lengths, inv_freq, layer: int):
        h, new_kv = self.attn(self.input_norm(x), positions, mask, kv, lengths, inv_freq, layer)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), new_kv


class LlamaModel(nn.Module):
    """Llama-family causal LM.

    Parameters: ``embed/embedding [V, D]``, ``layers_{i}/...``, ``norm/scale [D]`` and, when the
    embeddings are untied, ``lm_head/kernel [D, V]``.
    """
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Optional[KVCache] = None,
                 mask: Optional[jax.Array] = None, num_new: Optional[jax.Array] = None,
                 compute_logits: bool = True):
        """Run T new tokens per row, optionally on top of a KV cache.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions (``lengths + arange(T)`` for prefill/decode,
            ``lengths + depth`` for a Medusa tree).
          cache: a `KVCache` (k, v: [L, B, S, KVH, Dh]); the T new K/V are written at slots
            ``lengths[b] .. lengths[b] + T - 1`` (caller guarantees ``lengths + T <= S``).
            None: no cache, attention over the T tokens only (training).
          mask: [T, T] or [B, T, T] bool block among the new tokens (default causal); the cached
            prefix is visible, except what a layer's sliding window (`ModelConfig.layer_windows`)
            hides.
          num_new: [B] int32, how many of the T tokens are real per row (right padding);
            the returned cache's lengths advance by it (default T).
          compute_logits: when False, logits are None (saves the [B, T, V] projection).

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
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(tokens)
        kv = (cache.k, cache.v) if cache is not None else None
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, masks[windows[i]], kv, lengths, inv_freq, i)
        hidden = self.norm(x)
        new_cache = None
        if cache is not None:
            adv = num_new if num_new is not None else jnp.full((B,), T, jnp.int32)
            new_cache = KVCache(k=kv[0], v=kv[1], lengths=cache.lengths + adv)
        logits = self.logits(hidden) if compute_logits else None
        return logits, hidden, new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head projection: hidden [..., D] -> logits [..., V] float32."""
        if self.cfg.tie_word_embeddings:
            out = self.embed.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)


def lm_head_matrix(cfg: ModelConfig, params) -> jax.Array:
    """The base model's output projection from a params tree, as [D, V] (embedding.T when tied)."""
    if cfg.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]
