"""Weight-streaming CPU kernels for decoding: few-row matrix products as XLA FFI custom calls.

A decoding step multiplies M = batch x tree-node rows (1-16 here) by every weight matrix of the
model. That product is bound by memory bandwidth (each weight is read once and used M times), and
XLA's CPU GEMM for a handful of rows reads the weights well below the bandwidth: on this project's
CPU the 2-row lm_head product cost 2-2.8x the 1-row one (issue 13, docs/performance.md).
`stream_matmul.cc` streams each weight matrix once for all M rows, in the ``[out, in]`` layout
(contiguous rows, as torch's ``nn.Linear.weight``), and splits the output columns between the
calling thread and the kernel's own worker threads, which spin briefly between products instead of
sleeping (waking a sleeping thread cost tens of microseconds per product here). It also holds the
attention of decoding and tree steps over the KV cache, read in place (`cache_attention`).

The library is compiled on first use (``c++ -O3 -mavx2 -mfma`` against ``jax.ffi.include_dir()``,
plus ``-mavx512f -mavx512vl`` where the CPU has them, which dequantizes 4-bit blocks by a table
lookup, the same values; ``MEDUSA_JAX_KERNELS_AVX512=0`` asks for the AVX2 build, which is also
built where the compiler rejects those flags) into
``$MEDUSA_JAX_CACHE`` (default ``~/.cache/medusa_jax``) and registered with
``jax.ffi.register_ffi_target``; ``make demo`` builds it at install (``python -m medusa_jax.kernels``).
Where it cannot be used (no C++ compiler, a CPU without AVX2/FMA, not x86-64, a GPU backend,
``MEDUSA_JAX_KERNELS=0``), every product falls back to XLA's, with the same results up to float32
round-off; `status()` says which path runs and why. Environment: ``MEDUSA_JAX_THREADS=N`` caps
the threads one product uses (default: the CPUs this process may run on); ``MEDUSA_JAX_SPIN_US``
is how long an idle worker spins before it sleeps (default 200); ``MEDUSA_JAX_CHUNK_KB`` the
work per claimed chunk of columns, as KB of float32 weights (default 256; blocks count their
weights, not their bytes); ``MEDUSA_JAX_HUGE_PAGES=0`` keeps the decoding
weights on ordinary 4 KB pages (`on_huge_pages`).

Public API:
  available() -> bool;  in_use() -> bool (available and the CPU backend);  status() -> str
  matmul_nt(x [..., K], w [N, K]) -> [..., N]  (x @ w.T; float32 kernel for <= MAX_ROWS rows, w float32
      or bfloat16);  weight_for(w, dtype): a weight as matmul_nt takes it (bfloat16 kept as it is)
  cache_attention(q, k, v, mask, lengths, layer, fallback) -> [B, T, H * Dh]  (attention over the
      KV cache read in place; attention_applies(dtype, T) says when the kernel runs)
  matmul_nt_blocks(x [..., K], blocks [N, K/32*bytes] uint8, "q8_0" | "q4_0" | "q4_1") -> [..., N]  (the
      product with GGUF blocks as stored, dequantized in registers: bit for bit matmul_nt over
      dequantize_blocks(blocks, fmt), the gguf package's float32 weights)
  BlockWeight(blocks, fmt): a [N, K] weight kept as GGUF blocks (a pytree; matmul_nt and weight_for
      take it where they take an array; .rows(ids) reads embedding rows, .dequantize() the float32)
  take_rows(table, ids) -> [..., D]  (embedding rows of an array or a BlockWeight)
  argmax(logits [..., V]) -> [...] int32  (jnp.argmax over the last axis, the greedy token)
  read_bandwidth(bytes, threads) -> bytes/s   (the roofline the decoding step is measured against)
  on_huge_pages(a) -> a copy of a CPU array on 2 MB pages (the kernels stream such weights faster)
"""
from medusa_jax.kernels.blocks import BLOCK_BYTES, BlockWeight, dequantize_blocks, take_rows
from medusa_jax.kernels.library import (
                                       FLAGS,
                                       SOURCE,
                                       TARGETS,
                                       available,
                                       build,
                                       cache_dir,
                                       cpu_supported,
                                       in_use,
                                       load_library,
                                       read_bandwidth,
                                       status,
)
from medusa_jax.kernels.ops import (
                                       MAX_ROWS,
                                       argmax,
                                       attention_applies,
                                       cache_attention,
                                       matmul_nt,
                                       matmul_nt_blocks,
                                       on_huge_pages,
                                       weight_for,
                                       xla_nt,
)

__all__ = ["BLOCK_BYTES", "BlockWeight", "FLAGS", "MAX_ROWS", "SOURCE", "TARGETS", "argmax", "attention_applies", "available", "build",
           "cache_attention", "cache_dir", "cpu_supported", "dequantize_blocks", "in_use", "load_library", "matmul_nt",
           "matmul_nt_blocks", "on_huge_pages", "read_bandwidth", "status", "take_rows", "weight_for", "xla_nt"]
