"""The decoding step against the memory roofline on this machine (issue 13).

On the real SmolLM2-135M-Instruct and the shipped heads, in one run: the read bandwidth
(`medusa_jax.kernels.read_bandwidth`, measured before and after the step timings), the plain step
and c(T) = t(Medusa step, T-node tree) / t(plain step) for the greedy trees of the heads' calibrated
accuracies, with the weight-streaming kernels (`models.layout.decoding_params`) and, interleaved,
with XLA's products on the same ``[out, in]`` layout (the kernels' row limit, `kernels.MAX_ROWS`,
set to 0 in-process; ``MEDUSA_JAX_KERNELS=0`` would also keep XLA's ``[in, out]`` layout). The plain step's weight stream is the float32 weights (the tied embedding counted
once, as the lm_head it is read as) over the step time.

    .venv/bin/python scripts/roofline.py [--sizes 2,4,8,16] [--cache-sizes 256,1024] [--rounds 2]
"""
from __future__ import annotations

import argparse
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import medusa_jax as mj
from medusa_jax import kernels, resolve
from medusa_jax.convert.medusa_format import load_heads
from medusa_jax.decoding.tree import build_tree
from medusa_jax.decoding.tree_estimates import greedy_tree_search
from medusa_jax.evals.memory import tree_bytes
from medusa_jax.heads.medusa import with_proposal_projection
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.tuning.cost import step_costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2,4,8,16", help="tree sizes T")
    p.add_argument("--cache-sizes", default="256,1024", help="KV cache slots to time at")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (kernels, XLA) per cache size")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit(f"the kernels are unavailable here: {kernels.status()}")
    m = mj.load_model(with_tokenizer=False)
    weight_bytes = tree_bytes(m.params)
    d = resolve.DEFAULT_HEADS_DIR
    hcfg, hp = load_heads(d, m.cfg)
    acc = np.asarray(json.load(open(f"{d}/config.json"))["tree_search"]["rank_accuracies"])
    trees = [build_tree(greedy_tree_search(acc, int(T), hcfg.topk), hcfg.topk) for T in args.sizes.split(",")]
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm_head_matrix(m.cfg, m.params))
    prompt = list(range(1000, 1100))
    bw = [kernels.read_bandwidth()]
    print(f"read bandwidth {bw[0] / 1e9:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB; {kernels.status()}")
    limit = kernels.MAX_ROWS
    for S in (int(s) for s in args.cache_sizes.split(",")):
        for r in range(args.rounds):
            for name in ("kernels", "xla"):
                kernels.MAX_ROWS = limit if name == "kernels" else 0
                jax.clear_caches()  # the row limit is read at trace time: recompile
                importlib.import_module("medusa_jax.decoding.compile").clear_compiled()  # ahead-of-time cache
                c = step_costs(m.cfg, m.params, (hcfg, jhp), trees, prompt, args.steps, args.repeats, S,
                               progress=False)
                gbs = weight_bytes / c["plain_s"] / 1e9
                print(f"cache {S:5d} round {r} {name:7s}: plain {c['plain_s'] * 1e3:6.2f} ms "
                      f"({gbs:.1f} GB/s = {gbs / (bw[-1] / 1e9):.2f} of the bandwidth)  "
                      + "  ".join(f"c({T})={v:.2f}" for T, v in c["cost"].items()), flush=True)
        bw.append(kernels.read_bandwidth())
        print(f"read bandwidth {bw[-1] / 1e9:.1f} GB/s")
    kernels.MAX_ROWS = limit


if __name__ == "__main__":
    main()
