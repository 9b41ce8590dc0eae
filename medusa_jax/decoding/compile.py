"""Ahead-of-time compilation, cached per function, static arguments and argument shapes, so that no
timing ever includes a compilation."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from medusa_jax import sharding

_COMPILED: dict = {}
_CALLED: set = set()  # keys of the executables `warm_up` has called once


def aot(fn, static: tuple, args: tuple, first_call: bool = False):
    """`fn` (a jitted function whose leading arguments are `static`) compiled ahead of time for
    these static values and argument shapes, cached, so that timings never include compilation.
    Arguments placed on a device mesh (`medusa_jax.sharding`) compile under that mesh, so the
    shardings the step constrains (the KV cache's) hold; the shardings are part of the cache key.

    With `first_call`, a new executable is also called once on throwaway inputs (`warm_up`), so
    that the setup XLA's CPU runtime does on an executable's first call is paid here, with the
    compilation, and not by the first step that uses it. Only for functions whose one call is
    short (a step, a row copy, a prefill chunk), never for a whole decoding loop."""
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, getattr(a, "sharding", None)), args)
    key = (fn, static, str(shapes))
    compiled = _COMPILED.get(key)
    if compiled is None:
        mesh = sharding.mesh_of(args)
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            compiled = fn.lower(*static, *args).compile()
        _COMPILED[key] = compiled
    if first_call and key not in _CALLED and sharding.mesh_of(args) is None:
        warm_up(compiled, args)
        _CALLED.add(key)
    return compiled


def warm_up(compiled, args: tuple) -> None:
    """Call `compiled` once and drop its results: donated arguments get zero-filled copies (the
    caller's arrays stay valid), the others are passed as they are. Only on the CPU, where the first
    call of an executable sets up every dot product of it (XLA's YNNPACK runtime, ~1.7 ms per dot:
    300-450 ms for a 16-row step of the default model against ~100 ms for each later call;
    docs/performance.md); elsewhere it does nothing. Costs one call and, while it runs, a second
    copy of the donated arguments (for a decoding step: its KV cache)."""
    leaves = jax.tree_util.tree_leaves(args)
    if not leaves or any(d.platform != "cpu" for a in leaves if isinstance(a, jax.Array) for d in a.devices()):
        return
    info = compiled.args_info[0]
    fresh = jax.tree_util.tree_map(lambda a, i: jnp.zeros_like(a) if i.donated else a, tuple(args), tuple(info))
    jax.block_until_ready(compiled(*fresh))


def clear_compiled() -> None:
    """Forget every executable `aot` compiled (tests that count compilations start from none)."""
    _COMPILED.clear()
    _CALLED.clear()
