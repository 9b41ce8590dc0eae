"""The attention kernel alone (`medusa_jax.kernels.cache_attention`) over a SmolLM2-shaped KV cache.

Times one jitted call that runs the attention of all 30 layers (9 query heads, 3 KV heads,
Dh 64, batch 1) for T new tokens over a cache of S slots of which `visible` are filled, best of
`--repeats`; the cache is random and the layers are chained (each layer's query depends on the
previous output) so nothing is hoisted. Gives the ms per decoding step spent in attention, the part
of a tree step that grows with the prompt (docs/performance.md, issue 13 third pass).

    .venv/bin/python scripts/attention_bench.py [--rows 1,4,8] [--slots 1024] [--visible 800]
    MEDUSA_JAX_THREADS=1 .venv/bin/python scripts/attention_bench.py   # one thread
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.tuning.cost import best_time, timed_call


def time_attention(T: int, S: int, visible: int, repeats: int, L: int = 30, H: int = 9, KVH: int = 3,
                   Dh: int = 64) -> float:
    """Milliseconds per call of L chained `cache_attention` layers for T tokens (best of `repeats`)."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((L, 1, KVH, S, Dh)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((L, 1, KVH, S, Dh)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((1, T, H, Dh)).astype(np.float32))
    lengths = jnp.asarray([visible - T], jnp.int32)
    mask = jnp.broadcast_to(jnp.arange(S)[None, None, :] < visible, (1, T, S))

    @jax.jit
    def layers(q, k, v, mask, lengths):
        out = jnp.zeros((1, T, H * Dh), jnp.float32)
        for layer in range(L):
            out = out + kernels.cache_attention(q + out.reshape(q.shape) * 1e-9, k, v, mask, lengths, layer, None)
        return out

    return best_time(timed_call(layers, (q, k, v, mask, lengths), 1), repeats) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8", help="new tokens T per step, comma-separated (<= 16)")
    p.add_argument("--slots", type=int, default=1024, help="cache size S")
    p.add_argument("--visible", type=int, default=800, help="filled slots (cache length + T)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls; the best is kept")
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit(f"the attention kernel is not available: {kernels.status()}")
    rows = [int(x) for x in args.rows.split(",")]
    if any(not 1 <= T <= kernels.MAX_ROWS for T in rows) or not max(rows) <= args.visible <= args.slots:
        raise SystemExit(f"need 1 <= T <= {kernels.MAX_ROWS} and T <= --visible <= --slots")
    print(" ".join(f"T={T} {time_attention(T, args.slots, args.visible, args.repeats):.2f} ms" for T in rows))


if __name__ == "__main__":
    main()
