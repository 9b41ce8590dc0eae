"""What verifying T tokens costs in XLA's CPU matrix products: [T, D] @ [D, N] against T = 1.

    .venv/bin/python scripts/matmul_rows.py [--rows 1,2,4,8,16] [--rounds 5] [--calls 10]

A plain decoding step multiplies one row by every weight matrix (a matrix-vector product, bound by
reading the weights); a Medusa tree step multiplies T rows, which XLA's CPU backend runs as a
general matrix product. Times, at SmolLM2-135M's shapes (D = 576, 1,536-wide MLP, 49,152-token
vocabulary), in float32, compilation excluded, best of `--rounds` interleaved rounds of `--calls` calls each:

* mlp: a 30-layer stack of ``x + silu(x @ W1) @ W2`` (the MLP weights of the backbone);
* lm_head x@W: ``x [T, D] @ W [D, V]`` (the layout `models.llama.lm_head_matrix` returns);
* lm_head E@x.T: the same logits from the embedding layout ``E [V, D] @ x.T``;
* the same MLP stack and lm_head through the weight-streaming kernel (`medusa_jax.kernels.matmul_nt`,
  weights stored ``[out, in]``), when it is available, with this machine's read bandwidth.

The ratio to T = 1 is the extra cost of verifying T tokens in that product; on a CPU where it is
well above 1 for T = 2, no tree pays (see `medusa-tune`).
"""
from __future__ import annotations

import argparse
import time


def _best_seconds(fn, arg_sets, rounds: int, calls: int) -> list:
    """Best seconds per call of `fn` on each argument tuple, in interleaved rounds (so that load
    from other processes hits every case alike), after one untimed warm-up round."""
    for args in arg_sets:
        fn(*args).block_until_ready()  # compile and touch the weights
    best = [float("inf")] * len(arg_sets)
    for _ in range(rounds):
        for i, args in enumerate(arg_sets):
            t = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            out.block_until_ready()
            best[i] = min(best[i], (time.perf_counter() - t) / calls)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16", help="row counts T to time, comma-separated (default: 1,2,4,8,16)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per case; the best is kept (default: 5)")
    p.add_argument("--calls", type=int, default=10, help="calls per round (default: 10)")
    a = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    rows = [int(r) for r in a.rows.split(",")]
    D, F, V, L = 576, 1536, 49152, 30
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w1, w2 = jax.random.normal(k[0], (L, D, F)) * 0.02, jax.random.normal(k[1], (L, F, D)) * 0.02
    w = jax.random.normal(k[2], (D, V)) * 0.02
    e = jnp.asarray(w.T)

    def mlp(x, w1, w2):
        return jax.lax.scan(lambda h, ws: (h + jax.nn.silu(h @ ws[0]) @ ws[1], None), x, (w1, w2))[0]

    from medusa_jax import kernels

    def mlp_streamed(x, w1t, w2t):
        step = lambda h, ws: (h + kernels.matmul_nt(jax.nn.silu(kernels.matmul_nt(h, ws[0])), ws[1]), None)
        return jax.lax.scan(step, x, (w1t, w2t))[0]

    cases = {"mlp (30 layers)": (jax.jit(mlp), (w1, w2)),
             "lm_head x@W": (jax.jit(lambda x, w: x @ w), (w,)),
             "lm_head E@x.T": (jax.jit(lambda x, e: (e @ x.T).T), (e,))}
    if kernels.available():
        cases["mlp, streaming kernel"] = (jax.jit(mlp_streamed), (jnp.swapaxes(w1, 1, 2) + 0, jnp.swapaxes(w2, 1, 2) + 0))
        cases["lm_head, streaming kernel"] = (jax.jit(kernels.matmul_nt), (e,))
        print(f"read bandwidth {kernels.read_bandwidth() / 1e9:.1f} GB/s (2 threads); the MLP stack is "
              f"{2 * L * D * F * 4 / 1e6:.0f} MB, the lm_head {D * V * 4 / 1e6:.0f} MB")
    else:
        print(f"(no streaming-kernel rows: {kernels.status()})")
    print(f"device: {jax.devices()[0].device_kind}; ms per call (ratio to T = {rows[0]})")
    print("| product | " + " | ".join(f"T={t}" for t in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, (fn, weights) in cases.items():
        s = _best_seconds(fn, [(jnp.ones((t, D)),) + weights for t in rows], a.rounds, a.calls)
        print(f"| {name} | " + " | ".join(f"{v * 1e3:.2f} ({v / s[0]:.2f}x)" for v in s) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
