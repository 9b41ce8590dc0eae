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

The library is compiled on first use (``c++ -O3 -mavx2 -mfma`` against ``jax.ffi.include_dir()``)
into ``$MEDUSA_JAX_CACHE`` (default ``~/.cache/medusa_jax``) and registered with
``jax.ffi.register_ffi_target``; ``make demo`` builds it at install (``python -m medusa_jax.kernels``).
Where it cannot be used (no C++ compiler, a CPU without AVX2/FMA, not x86-64, a GPU backend,
``MEDUSA_JAX_KERNELS=0``), every product falls back to XLA's, with the same results up to float32
round-off; `status()` says which path runs and why. Environment: ``MEDUSA_JAX_THREADS=N`` caps
the threads one product uses (default: the CPUs this process may run on); ``MEDUSA_JAX_SPIN_US``
is how long an idle worker spins before it sleeps (default 200); ``MEDUSA_JAX_CHUNK_KB`` the
weights per claimed chunk of columns (default 256); ``MEDUSA_JAX_HUGE_PAGES=0`` keeps the decoding
weights on ordinary 4 KB pages (`on_huge_pages`).

Public API:
  available() -> bool;  status() -> str
  matmul_nt(x [..., K], w [N, K]) -> [..., N]  (x @ w.T; float32 kernel for <= MAX_ROWS rows, w float32
      or bfloat16);  weight_for(w, dtype): a weight as matmul_nt takes it (bfloat16 kept as it is)
  cache_attention(q, k, v, mask, lengths, layer, fallback) -> [B, T, H * Dh]  (attention over the
      KV cache read in place; attention_applies(dtype, T) says when the kernel runs)
  argmax(logits [..., V]) -> [...] int32  (jnp.argmax over the last axis, the greedy token)
  read_bandwidth(bytes, threads) -> bytes/s   (the roofline the decoding step is measured against)
  on_huge_pages(a) -> a copy of a CPU array on 2 MB pages (the kernels stream such weights faster)
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import mmap
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding

SOURCE = Path(__file__).with_name("stream_matmul.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = ("medusa_matmul_nt", "medusa_matmul_nt_bf16", "medusa_cache_attention", "medusa_argmax_rows")
# Products with more rows than this go to XLA: the kernel's advantage is for decoding-sized M (it
# keeps 4 rows' accumulators in registers and re-reads the weights from L1 for every 4 rows); on
# this project's CPU a 32-node tree step was faster with XLA's product (docs/performance.md).
MAX_ROWS = 16


def cache_dir() -> Path:
    """Where the compiled kernels live: ``$MEDUSA_JAX_CACHE`` or ``~/.cache/medusa_jax``."""
    return Path(os.environ.get("MEDUSA_JAX_CACHE") or Path.home() / ".cache" / "medusa_jax")


def _cpu_supported() -> Tuple[bool, str]:
    """(ok, reason): the kernels need x86-64 with AVX2 and FMA (read from /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the kernels are x86-64 only (this CPU: {platform.machine()})"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    missing = [f for f in ("avx2", "fma") if f not in flags]
    if missing:
        return False, f"this CPU lacks {' and '.join(missing)}"
    return True, ""


@functools.lru_cache(maxsize=1)
def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + jax.__version__.encode()).hexdigest()[:16]
    return cache_dir() / f"stream_matmul-{key}.so"


def build(verbose: bool = False) -> Path:
    """Compile `stream_matmul.cc` (if not already built for this source, flags and jax version).

    Returns the shared library's path. Raises RuntimeError (with the compiler's message) when the
    compiler is missing or fails. The file is written to a temporary name and renamed, so
    concurrent builds are safe.
    """
    out = _library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp, "-lpthread"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(tmp)
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX)") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cxx} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=1)
def _load() -> Tuple[Optional[ctypes.CDLL], str]:
    """(library or None, why not): build, load and register the kernels once per process."""
    if os.environ.get("MEDUSA_JAX_KERNELS", "1").strip().lower() in ("0", "false", "off", "xla"):
        return None, "disabled by MEDUSA_JAX_KERNELS=0"
    ok, why = _cpu_supported()
    if not ok:
        return None, why
    if not hasattr(jax, "ffi"):
        return None, f"jax {jax.__version__} has no jax.ffi"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        return None, f"could not build or load the kernels: {e}"
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.medusa_read_bandwidth.restype = ctypes.c_double
    lib.medusa_read_bandwidth.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
    return lib, ""


def available() -> bool:
    """True when the streaming kernels are built, loaded and registered for the CPU."""
    return _load()[0] is not None


def status() -> str:
    """One line for the user: which path few-row products take on the CPU, and why."""
    lib, why = _load()
    if lib is not None:
        return f"weight-streaming CPU kernels (AVX2+FMA, <= {MAX_ROWS} rows; {_library_path().name})"
    return f"XLA's CPU products ({why})"


def read_bandwidth(nbytes: int = 1 << 30, threads: int = 2, repeats: int = 3) -> float:
    """This machine's read bandwidth in bytes/s: `threads` threads summing a `nbytes` buffer
    (best of `repeats`). The roofline for a decoding step, which reads every weight once.

    Raises RuntimeError when the kernels are unavailable (see `status`)."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"read_bandwidth needs the streaming kernels: {why}")
    return float(lib.medusa_read_bandwidth(int(nbytes), int(threads), int(repeats)))


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


def _xla_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    dt = jnp.promote_types(x.dtype, w.dtype)
    return jax.lax.dot_general(x.astype(dt), w.astype(dt), (((x.ndim - 1,), (1,)), ((), ())))


@jax.custom_vjp
def _streamed_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    # platform_dependent: the kernel where this lowers for the CPU, XLA's product elsewhere (GPU).
    return jax.lax.platform_dependent(x, w, cpu=_ffi_nt, default=_xla_nt)


def _streamed_fwd(x, w):
    return _streamed_nt(x, w), (x, w)


def _streamed_bwd(res, g):  # the same gradients as XLA's product (training never needs the kernel)
    x, w = res
    return (g @ w).astype(x.dtype), (g.T @ x).astype(w.dtype)


_streamed_nt.defvjp(_streamed_fwd, _streamed_bwd)


def attention_applies(dtype, rows: int) -> bool:
    """Whether `cache_attention` runs the kernel for queries of this dtype with `rows` new tokens per
    row: float32, at most `MAX_ROWS` tokens (decoding and tree steps, not prefill chunks), the
    kernels available, no device mesh being traced."""
    return jnp.dtype(dtype) == jnp.float32 and 0 < rows <= MAX_ROWS and available() and not sharding.active()


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
    call); others are cast to `dtype`."""
    return w if w.dtype == jnp.bfloat16 else w.astype(dtype)


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a weight stored ``[out, in]``.

    Args:
      x: [..., K] activations; w: [N, K] weights (row n holds output n's K weights).
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
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if (x.dtype == jnp.float32 and w.dtype in (jnp.float32, jnp.bfloat16) and 0 < rows <= MAX_ROWS and available()
            and not sharding.active()):
        return _streamed_nt(x.reshape(rows, x.shape[-1]), w).reshape(*lead, w.shape[0])
    return _xla_nt(x, w)
