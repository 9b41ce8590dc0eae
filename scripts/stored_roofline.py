"""A decoding step's weight products against both limits of this machine (issue 32): memory and arithmetic.

    .venv/bin/python scripts/stored_roofline.py [--rows 1,4,8] [--rounds 3]

On the default model loaded both ways (``--weights as-stored``: its Q4_1 projections and Q8_0
tied embedding as blocks; ``float32``), in decoding layout (`models.layout.decoding_params`), one
jitted function runs the products of a decoding step over M rows: per layer the fused q/k/v, o,
fused gate/up and down products, then the lm_head (attention, norms and the rest of a step are
left out). Per kind of weights it reports:

- **memory**: the bytes the products stream per step over their time, against the read
  bandwidth (`kernels.read_bandwidth`, measured before each round);
- **arithmetic**: the weights per step over their time, against the rate of the same products on
  weights that stay in the cache (one layer's matrices, and a 2,048-row slice of the lm_head, each
  multiplied as often as a step multiplies all of them): what the kernels reach when memory is not
  the limit. Dequantizing costs the same per weight whatever M is; the multiply-adds grow with M.

Rounds alternate the two kinds; the best time of each is kept. Prints one JSON line per (kind, M).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from medusa_jax import kernels  # noqa: E402
from medusa_jax.convert.load import load_model  # noqa: E402
from medusa_jax.models.layout import decoding_params  # noqa: E402


def step_matrices(params) -> list:
    """The weights a decoding step multiplies by, in order: per layer qkv, o, gate/up, down; the lm_head."""
    out = []
    for i in range(len([k for k in params if k.startswith("layers_")])):
        layer = params[f"layers_{i}"]
        out += [layer["attn"]["qkv_t"], layer["attn"]["o_proj"]["kernel_t"], layer["mlp"]["gate_up_t"],
                layer["mlp"]["down_proj"]["kernel_t"]]
    return out + [params["embed"]["embedding"]]


def products(ws: list):
    """A jitted x [M, D] -> the chained products by every weight of `ws` (each one's input the
    previous output folded back to D, so that none is skipped)."""
    def run(x, ws):
        D = x.shape[1]
        h = x
        for w in ws:
            K = w.shape[1]
            inp = jnp.tile(h, (1, -(-K // D)))[:, :K]
            h = h + 1e-3 * kernels.matmul_nt(inp, w)[:, :D]
        return h
    return jax.jit(run)


def best_s(f, x, ws, calls: int = 10) -> float:
    f(x, ws).block_until_ready()
    t = time.perf_counter()
    for _ in range(calls):
        y = f(x, ws)
    y.block_until_ready()
    return (time.perf_counter() - t) / calls


def n_weights(ws) -> int:
    return sum(int(w.shape[0]) * int(w.shape[1]) for w in ws)


def n_bytes(ws) -> int:
    return sum(int(w.nbytes) for w in ws)


def in_cache(ws: list) -> list:
    """Matrices of the same kinds as a step's, small enough to stay in the cache: layer 0's four,
    repeated once per layer, and 2,048 rows of the lm_head repeated to its size."""
    layer, lm = ws[:4], ws[-1]
    rows = 2048
    if isinstance(lm, kernels.BlockWeight):
        part = kernels.BlockWeight(jnp.asarray(lm.blocks)[:rows], lm.fmt)
    else:
        part = jnp.asarray(lm)[:rows]
    return layer * ((len(ws) - 1) // 4) + [part] * (int(lm.shape[0]) // rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8", help="rows M")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (best kept)")
    args = p.parse_args()
    if not kernels.available():
        print(f"error: the kernels are unavailable: {kernels.status()}", file=sys.stderr)
        return 1
    kinds = {w: step_matrices(decoding_params(load_model(weights=w, with_tokenizer=False).params))
             for w in ("as-stored", "float32")}
    rows = [int(m) for m in args.rows.split(",")]
    best: dict = {}
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(kernels.read_bandwidth())
        for kind, ws in kinds.items():
            cached = in_cache(ws)
            for M in rows:
                x = jnp.ones((M, int(ws[0].shape[1])), jnp.float32)
                f = products(ws)
                t = best_s(f, x, ws)
                c = best_s(products(cached), x, cached) * n_weights(ws) / n_weights(cached)
                key = (kind, M)
                old = best.get(key, (float("inf"), float("inf")))
                best[key] = (min(old[0], t), min(old[1], c))
    bw = max(bandwidth)
    for (kind, M), (t, c) in best.items():
        ws = kinds[kind]
        print(json.dumps({"weights": kind, "rows": M, "step_products_ms": round(t * 1e3, 2),
                          "bytes_per_step_mb": round(n_bytes(ws) / 1e6, 1),
                          "gb_s": round(n_bytes(ws) / t / 1e9, 1), "read_bandwidth_gb_s": round(bw / 1e9, 1),
                          "of_bandwidth": round(n_bytes(ws) / t / bw, 2),
                          "weights_per_step_m": round(n_weights(ws) / 1e6, 1),
                          "in_cache_ms": round(c * 1e3, 2), "of_arithmetic": round(c / t, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
