"""The CPU kernels' shared library: compiled on first use from ``stream_matmul.cc`` into the
user's cache, loaded, registered with XLA as FFI targets, and what it says about this CPU
(`status`, `read_bandwidth`). See the package docstring."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import jax

SOURCE = Path(__file__).with_name("stream_matmul.cc")


FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")


TARGETS = ("medusa_matmul_nt", "medusa_matmul_nt_bf16", "medusa_matmul_nt_q8_0", "medusa_matmul_nt_q4_0",
           "medusa_matmul_nt_q4_1", "medusa_dequantize_q8_0", "medusa_dequantize_q4_0", "medusa_dequantize_q4_1",
           "medusa_cache_attention", "medusa_argmax_rows")


# Products with more rows than this go to XLA: the kernel's advantage is for decoding-sized M (it
# keeps 4 rows' accumulators in registers and re-reads the weights from L1 for every 4 rows); on
# this project's CPU a 32-node tree step was faster with XLA's product (docs/performance.md).
MAX_ROWS = 16

# Added to FLAGS where the CPU has AVX-512F and VL (and MEDUSA_JAX_KERNELS_AVX512 is not 0): the
# 4-bit GGUF blocks are then dequantized by a table lookup per vector (stream_matmul.cc, `table16`),
# the same values in fewer instructions; everything else computes as in the AVX2 build.
AVX512_FLAGS = ("-mavx512f", "-mavx512vl")


def cache_dir() -> Path:
    """Where the compiled kernels live: ``$MEDUSA_JAX_CACHE`` or ``~/.cache/medusa_jax``."""
    return Path(os.environ.get("MEDUSA_JAX_CACHE") or Path.home() / ".cache" / "medusa_jax")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> Optional[frozenset]:
    """The CPU's feature flags from /proc/cpuinfo (None when it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return frozenset(flags)


def cpu_supported() -> Tuple[bool, str]:
    """(ok, reason): the kernels need x86-64 with AVX2, FMA and F16C (read from /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the kernels are x86-64 only (this CPU: {platform.machine()})"
    flags = _cpu_flags()
    if flags is None:
        return False, "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    if missing:
        return False, f"this CPU lacks {' and '.join(missing)}"
    return True, ""


def _switched_off(name: str, *also: str) -> bool:
    """True when environment variable `name` says no: 0, false, off (or one of `also`)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", *also)


@functools.lru_cache(maxsize=1)
def build_flags() -> Tuple[str, ...]:
    """The compiler flags asked for on this CPU, decided once per process: FLAGS, plus AVX512_FLAGS
    where /proc/cpuinfo lists avx512f and avx512vl, unless ``MEDUSA_JAX_KERNELS_AVX512=0`` (the AVX2
    build everywhere). `build` falls back to FLAGS where the compiler rejects AVX512_FLAGS, and
    `status` says so."""
    has = {"avx512f", "avx512vl"} <= (_cpu_flags() or frozenset())
    return FLAGS + (AVX512_FLAGS if has and not _switched_off("MEDUSA_JAX_KERNELS_AVX512") else ())


@functools.lru_cache(maxsize=None)
def _library_path(flags: Tuple[str, ...]) -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + jax.__version__.encode()).hexdigest()[:16]
    return cache_dir() / f"stream_matmul-{key}.so"


#: The flags of the library `build` made or found (None before it ran); FLAGS where the compiler
#: rejected AVX512_FLAGS.
_built_flags: Optional[Tuple[str, ...]] = None


def build(verbose: bool = False) -> Path:
    """Compile `stream_matmul.cc` (if not already built for this source, flags and jax version).

    Returns the shared library's path. Where the CPU has AVX-512VL but the compiler rejects its
    flags (an old compiler or assembler), the AVX2 build instead, with the same results; the
    rejection is remembered in the cache (a ``.failed`` file beside the library, per ``CXX``, which
    records the compiler's message; delete it after upgrading the compiler in place), so later
    processes do not compile twice. Raises RuntimeError (with the compiler's message) when the
    compiler is missing or the AVX2 build fails. The file is written to a temporary name and
    renamed, so concurrent builds are safe.
    """
    global _built_flags
    flags = build_flags()
    if flags != FLAGS:
        try:
            out = _compile(flags, verbose, remember_failure=True)
            _built_flags = flags
            return out
        except _CompileError:
            pass  # the AVX2 build below
    out = _compile(FLAGS, verbose)
    _built_flags = FLAGS
    return out


class _CompileError(RuntimeError):
    """The compiler ran and failed (as against: there is no compiler)."""


def _compile(flags: Tuple[str, ...], verbose: bool, remember_failure: bool = False) -> Path:
    """The library built with `flags` (compiled unless it is in the cache). Raises RuntimeError when
    there is no compiler, _CompileError when it fails (remembered in a ``.failed`` file when
    `remember_failure`; a remembered failure is raised again without compiling)."""
    out = _library_path(flags)
    if out.exists():
        return out
    cxx = os.environ.get("CXX", "c++")
    # per compiler: another CXX is asked again
    failed = out.with_suffix(f".{hashlib.sha256(cxx.encode()).hexdigest()[:8]}.failed")
    if remember_failure and failed.exists():
        raise _CompileError(failed.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp, "-lpthread"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(tmp)
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX)") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        message = f"{cxx} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}"
        if remember_failure and proc.returncode > 0:  # it refused; a compiler killed by a signal is asked again
            failed.write_text(message)
        raise _CompileError(message)
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=1)
def load_library() -> Tuple[Optional[ctypes.CDLL], str]:
    """(library or None, why not): build, load and register the kernels once per process."""
    if _switched_off("MEDUSA_JAX_KERNELS", "xla"):
        return None, "disabled by MEDUSA_JAX_KERNELS=0"
    ok, why = cpu_supported()
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
    return load_library()[0] is not None


def in_use() -> bool:
    """True when decoding's products run the kernels in this process: the default backend is the
    CPU (elsewhere `jax.lax.platform_dependent` picks XLA's products) and `available()`."""
    return jax.default_backend() == "cpu" and available()


def status() -> str:
    """One line for the user: which path few-row products take on the default backend, and why
    (the kernels are registered for the CPU only; elsewhere, a GPU say, XLA's products run)."""
    backend = jax.default_backend()
    if backend != "cpu":
        return f"XLA's {backend} products (the weight-streaming kernels are for the CPU backend)"
    lib, why = load_library()
    if lib is not None:
        isa = "AVX-512VL" if "-mavx512vl" in _built_flags else "AVX2+FMA"
        if _built_flags != build_flags():
            isa += ", the compiler rejected " + " ".join(AVX512_FLAGS)
        return f"weight-streaming CPU kernels ({isa}, <= {MAX_ROWS} rows; {_library_path(_built_flags).name})"
    return f"XLA's CPU products ({why})"


def read_bandwidth(nbytes: int = 1 << 30, threads: int = 2, repeats: int = 3) -> float:
    """This machine's read bandwidth in bytes/s: `threads` threads summing a `nbytes` buffer
    (best of `repeats`). The roofline for a decoding step, which reads every weight once.

    Raises RuntimeError when the kernels are unavailable (see `status`)."""
    lib, why = load_library()
    if lib is None:
        raise RuntimeError(f"read_bandwidth needs the streaming kernels: {why}")
    return float(lib.medusa_read_bandwidth(int(nbytes), int(threads), int(repeats)))
