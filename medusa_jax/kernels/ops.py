"""The kernels as JAX operations (`matmul_nt`, `cache_attention`, `argmax`), each falling back to
XLA where the library cannot run, and the 2 MB-page weight copies they stream fastest
(`on_huge_pages`). See the package docstring."""
from __future__ import annotations

import math
import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import sharding
from medusa_jax.kernels.blocks import BlockWeight, block_format, dequantize_blocks
from medusa_jax.kernels.library import MAX_ROWS, available

_HUGE_PAGE = 2 << 20


def on_huge_pages(a: jax.Array) -> jax.Array:
    """`a` copied into host memory backed by 2 MB pages, as a CPU jax array that uses that memory in
    place (no further copy), for the weights the kernels stream: from 4 KB pages the hardware
    prefetchers restart at every page and the TLB misses, and the product kernel read 8-16% slower
    on this project's CPU (docs/performance.md). The memory is an anonymous mapping aligned to 2 MB
    and advised ``MADV_HUGEPAGE`` before it is written, so the OS backs it with 2 MB pages as it is
    filled, where it can (Linux; best effort elsewhere).

    Args: a: a jax array on the CPU (any shape and dtype).
    Returns: an equal jax array; `a` itself when it is under 2 MB, not on a single CPU device, a
      tracer (inside jit), the kernels are unavailable, or ``MEDUSA_JAX_HUGE_PAGES=0``."""
    if (not available() or not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer) or a.nbytes < _HUGE_PAGE
            or os.environ.get("MEDUSA_JAX_HUGE_PAGES", "1").strip().lower() in ("0", "false", "off")):
        return a
    devices = a.devices()
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return a
    mm = mmap.mmap(-1, a.nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    raw = np.frombuffer(mm, np.uint8)
    start = -raw.ctypes.data % _HUGE_PAGE
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # the OS declines: 4 KB pages, as any other array
            pass
    host = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    host[...] = np.asarray(a)
    return jax.device_put(host, next(iter(devices)))  # page-aligned host memory: used in place


def _ffi_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """[M, K] float32 @ [N, K]^T float32 or bfloat16 -> [M, N] float32 by the kernel (CPU only)."""
    target = "medusa_matmul_nt_bf16" if w.dtype == jnp.bfloat16 else "medusa_matmul_nt"
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w)


def xla_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    dt = jnp.promote_types(x.dtype, w.dtype)
    return jax.lax.dot_general(x.astype(dt), w.astype(dt), (((x.ndim - 1,), (1,)), ((), ())))


@jax.custom_vjp
def _streamed_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    # platform_dependent: the kernel where this lowers for the CPU, XLA's product elsewhere (GPU).
    return jax.lax.platform_dependent(x, w, cpu=_ffi_nt, default=xla_nt)


def _streamed_fwd(x, w):
    return _streamed_nt(x, w), (x, w)


def _streamed_bwd(res, g):  # the same gradients as XLA's product (training never needs the kernel)
    x, w = res
    return (g @ w).astype(x.dtype), (g.T @ x).astype(w.dtype)


_streamed_nt.defvjp(_streamed_fwd, _streamed_bwd)


def _kernel_applies(dtype, rows: int) -> bool:
    """Whether a kernel runs for float activations of `dtype` in `rows` rows: float32, 1 to
    `MAX_ROWS` rows, the kernels available, no device mesh being traced (a custom call has no SPMD
    partitioning)."""
    return jnp.dtype(dtype) == jnp.float32 and 0 < rows <= MAX_ROWS and available() and not sharding.active()


def attention_applies(dtype, rows: int) -> bool:
    """Whether `cache_attention` runs the kernel for queries of this dtype with `rows` new tokens per
    row: float32, at most `MAX_ROWS` tokens (decoding and tree steps, not prefill chunks), the
    kernels available, no device mesh being traced."""
    return _kernel_applies(dtype, rows)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, lengths: jax.Array, layer: int,
                    fallback) -> jax.Array:
    """Masked grouped-query attention of T new tokens over layer `layer` of the KV cache, read in
    place (the ``medusa_cache_attention`` kernel on the CPU; `fallback` elsewhere).

    Args:
      q: [B, T, H, Dh] float32 queries (RoPE applied).
      k, v: [L, B, KVH, S, Dh] float32, the whole cache with the T new tokens already written.
      mask: [B, T, S] bool (True = visible; slots at or past ``lengths[b] + T`` must be hidden).
      lengths: [B] int32 cache lengths before the new tokens.
      layer: the layer to read (static).
      fallback: ``(q, k, v, mask, lengths) -> [B, T, H * Dh]``, XLA's attention, run on other
        backends (GPU).
    Returns:
      [B, T, H * Dh] float32, ``softmax(q k^T / sqrt(Dh)) v`` per query head (query head h reads
      KV head ``h // (H // KVH)``); equal to `models.llama.grouped_query_attention` up to float32
      round-off, and each query's result does not depend on T.
    Callers check `attention_applies` first.
    """
    B, T, H, Dh = q.shape

    def ffi(q, k, v, mask, lengths):
        call = jax.ffi.ffi_call("medusa_cache_attention", jax.ShapeDtypeStruct((B, T, H * Dh), jnp.float32),
                                vmap_method="sequential")
        return call(q, k, v, mask, lengths.astype(jnp.int32), layer=np.int64(layer))

    return jax.lax.platform_dependent(q, k, v, mask.astype(bool), lengths, cpu=ffi, default=fallback)


def argmax(logits: jax.Array) -> jax.Array:
    """The greedy token: ``jnp.argmax(logits, axis=-1)`` as int32, the same answer (the first index
    of the largest logit; a NaN counts as the largest, the first NaN wins).

    Args: logits: [..., V] (V >= 1).
    Returns: [...] int32. float32 logits on the CPU go through the ``medusa_argmax_rows`` kernel
      when `available()` (XLA:CPU's argmax walks (value, index) pairs one at a time: ~1 ns an
      element, 0.4 ms of an 8-node tree step over SmolLM2's 49,152 logits); others, and any
      logits traced under a device mesh, through `jnp.argmax`.
    """
    fallback = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    if logits.dtype != jnp.float32 or logits.shape[-1] < 1 or not available() or sharding.active():
        return fallback(logits)
    lead = logits.shape[:-1]
    flat = logits.reshape(math.prod(lead), logits.shape[-1])

    def ffi(x):
        call = jax.ffi.ffi_call("medusa_argmax_rows", jax.ShapeDtypeStruct((x.shape[0],), jnp.int32),
                                vmap_method="sequential")
        return call(x)

    return jax.lax.platform_dependent(flat, cpu=ffi, default=fallback).reshape(lead)


def weight_for(w: jax.Array, dtype) -> jax.Array:
    """A weight for `matmul_nt` with activations of `dtype`: bfloat16 weights stay bfloat16 (the
    kernel widens them as it streams them, where a cast inside jit would copy the whole matrix every
    call), and so do GGUF blocks (`BlockWeight`) for float32 activations; others are cast to `dtype`
    (blocks dequantized first)."""
    if isinstance(w, BlockWeight):
        return w if jnp.dtype(dtype) == jnp.float32 else w.dequantize().astype(dtype)
    return w if w.dtype == jnp.bfloat16 else w.astype(dtype)


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a weight stored ``[out, in]``.

    Args:
      x: [..., K] activations; w: [N, K] weights (row n holds output n's K weights): an array, or
        a `BlockWeight` (GGUF blocks: `matmul_nt_blocks`).
    Returns:
      [..., N] in the promoted dtype of x and w. Products of float32 x and float32 or bfloat16 w
      (float32 out: the bfloat16 weights widen exactly, half the bytes are streamed) with at most
      `MAX_ROWS` rows (the product of x's leading dims) run the weight-streaming kernel when `available()`; the
      others, every product on a non-CPU backend and every product traced under a device mesh
      (a custom call has no SPMD partitioning; `medusa_jax.sharding`) run XLA's ``dot_general``.
      Both agree to float32 round-off; the kernel's rows do not depend on M (a row's sums run in one fixed
      order), so a tree step's logits equal a plain step's.
    Raises:
      ValueError: x's last dim differs from w's second.
    """
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"matmul_nt: x [..., {x.shape[-1]}] does not match w [{w.shape[0]}, {w.shape[-1]}]")
    if isinstance(w, BlockWeight):
        return matmul_nt_blocks(x, w.blocks, w.fmt)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if w.dtype in (jnp.float32, jnp.bfloat16) and _kernel_applies(x.dtype, rows):
        return _streamed_nt(x.reshape(rows, x.shape[-1]), w).reshape(*lead, w.shape[0])
    return xla_nt(x, w)


#: Products over GGUF blocks with up to this many rows run the block kernel in passes of
#: `MAX_ROWS` rows (each pass streams the blocks again); more rows (long prefill chunks) run XLA's
#: product over the weights dequantized once per product. Prefill of SmolLM2 on this project's CPU
#: (docs/performance.md): a 20-token prompt (a 32-row chunk) 0.114 s in two passes against 0.221 s
#: dequantized (float32 weights: 0.103 s); a 50-token one (64 rows) 0.21-0.23 s either way.
BLOCK_PASS_ROWS = 32


def matmul_nt_blocks(x: jax.Array, blocks: jax.Array, fmt: str) -> jax.Array:
    """``x @ w.T`` for a weight kept as a GGUF file stores it (`dequantize_blocks`' w, never built
    on the CPU path: the kernel dequantizes each block in registers as it streams it).

    Args:
      x: [..., K] float32 activations; blocks: [N, K / 32 * bytes] uint8; fmt: "q8_0", "q4_0", "q4_1".
    Returns:
      [..., N] float32. On the CPU (kernels available, no mesh), up to `BLOCK_PASS_ROWS` rows
      the ``medusa_matmul_nt_<fmt>`` kernel in passes of `MAX_ROWS` rows: each output the same
      sum in the same order as `matmul_nt` over the dequantized float32 weights, so the two agree
      bit for bit; with more rows (long prefill chunks) XLA's product over the weights
      dequantized by the ``medusa_dequantize_<fmt>`` kernel (the same values as
      `dequantize_blocks`, at memory speed; XLA's own dequantization took ~1 ns a weight);
      elsewhere XLA's product over `dequantize_blocks`.
    Raises:
      ValueError: an unknown format, or blocks that do not hold K weights per row.
    """
    nbytes = block_format(fmt)
    K = x.shape[-1]
    if K % 32 or blocks.ndim != 2 or blocks.shape[1] != K // 32 * nbytes:
        raise ValueError(f"matmul_nt_blocks: x [..., {K}] needs {fmt} rows of {K // 32 * nbytes} bytes (K a "
                         f"multiple of 32), got blocks {tuple(blocks.shape)}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    N = blocks.shape[0]
    fallback = lambda x, b: xla_nt(x, dequantize_blocks(b, fmt))  # noqa: E731
    flat = x.reshape(rows, K)

    def ffi(x, b):  # the block kernel, in passes of at most MAX_ROWS rows
        parts = []
        for i in range(0, x.shape[0], MAX_ROWS):
            m = min(MAX_ROWS, x.shape[0] - i)
            call = jax.ffi.ffi_call(f"medusa_matmul_nt_{fmt}", jax.ShapeDtypeStruct((m, N), jnp.float32),
                                    vmap_method="sequential")
            parts.append(call(x[i:i + m], b))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

    def dequantized(x, b):  # XLA's product over the weights the dequantizing kernel writes
        call = jax.ffi.ffi_call(f"medusa_dequantize_{fmt}", jax.ShapeDtypeStruct((N, K), jnp.float32),
                                vmap_method="sequential")
        return xla_nt(x, call(b))

    if not _kernel_applies(x.dtype, 1):
        return fallback(x, blocks)
    cpu = ffi if rows <= BLOCK_PASS_ROWS else dequantized
    return jax.lax.platform_dependent(flat, blocks, cpu=cpu, default=fallback).reshape(*lead, N)
