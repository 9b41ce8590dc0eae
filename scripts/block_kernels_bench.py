"""The product kernel over GGUF blocks against float32 (issue 32): ms per product, best of 5 x 20 calls.

    .venv/bin/python scripts/block_kernels_bench.py [--rows 1,4,16]

Random weights of the default model's shapes (lm_head [49152, 576], gate/up [3072, 576], down
[576, 1536]) quantized by the gguf package to Q8_0, Q4_0 and Q4_1, on 2 MB pages as decoding keeps
them; `kernels.matmul_nt` on the float32 weights against `kernels.matmul_nt_blocks` on the blocks.
Prints one JSON line per (shape, rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from medusa_jax import kernels  # noqa: E402

SHAPES = {"lm_head": (49152, 576), "gate_up": (3072, 576), "down": (576, 1536)}
FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}


def best_ms(f, *args, calls: int = 20, repeats: int = 5) -> float:
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            y = f(*args)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / calls)
    return round(best * 1e3, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16", help="rows M of x")
    args = p.parse_args()
    if not kernels.available():
        print(f"error: the kernels are unavailable: {kernels.status()}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    dense = jax.jit(kernels.matmul_nt)
    blocks = jax.jit(kernels.matmul_nt_blocks, static_argnums=2)
    for name, shape in SHAPES.items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        wf = kernels.on_huge_pages(jnp.asarray(w))
        qs = {f: kernels.on_huge_pages(jnp.asarray(np.ascontiguousarray(quantize(w, q)).reshape(shape[0], -1)))
              for f, q in FORMATS.items()}
        for M in (int(m) for m in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((M, shape[1])).astype(np.float32))
            row = {"product": name, "shape": list(shape), "rows": M, "float32_ms": best_ms(dense, x, wf)}
            row.update({f"{f}_ms": best_ms(blocks, x, b, f) for f, b in qs.items()})
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
