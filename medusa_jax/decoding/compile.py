"""Ahead-of-time compilation, cached per function, static arguments and argument shapes, so that no
timing ever includes a compilation."""
from __future__ import annotations

import contextlib

import jax

from medusa_jax import sharding

_COMPILED: dict = {}


def aot(fn, static: tuple, args: tuple):
    """`fn` (a jitted function whose leading arguments are `static`) compiled ahead of time for
    these static values and argument shapes, cached, so that timings never include compilation.
    Arguments placed on a device mesh (`medusa_jax.sharding`) compile under that mesh, so the
    shardings the step constrains (the KV cache's) hold; the shardings are part of the cache key."""
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, getattr(a, "sharding", None)), args)
    key = (fn, static, str(shapes))
    compiled = _COMPILED.get(key)
    if compiled is None:
        mesh = sharding.mesh_of(args)
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            compiled = fn.lower(*static, *args).compile()
        _COMPILED[key] = compiled
    return compiled


def clear_compiled() -> None:
    """Forget every executable `aot` compiled (tests that count compilations start from none)."""
    _COMPILED.clear()
