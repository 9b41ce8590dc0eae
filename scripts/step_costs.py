"""Plain step time and c(T) of a model's real shape with random weights, on whatever device JAX has.

    python scripts/step_costs.py [--model smollm2-135m,llama-2-7b] [--dtype bfloat16]
        [--trees small_4,small_16,mc_sim_7b_63,dynamic:16:4] [--prompt-len 128] [--json FILE]

The cost of a decoding step depends on the shapes, not on the weights' values (every Medusa step
runs its whole tree), so a machine that cannot hold the real checkpoint (a device machine reached
with a 64 MiB copy of the repository) still measures what a tree costs there: the model's
architecture from `medusa_jax.evals.memory.PRESETS` (or the SmolLM2-135M-Instruct config below),
weights drawn from normal(0, 0.02) (norm scales 1), four one-block Medusa heads drawn from
normal(0, 0.02) sharing the lm_head, a prompt of random tokens prefilled, then
`medusa_jax.tuning.cost.step_costs` (plain and tree steps timed alternately, many per on-device loop,
best of `--repeats`; compilation never timed). With the tokens per step the real heads accept at T
(measured on the CPU, hardware-independent in greedy float32), the predicted speed-up on this device
is tokens_per_step(T) / c(T).

Prints one line per model and tree: plain ms/step, tree ms/step, c(T); ``--json`` also writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the default model's architecture).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}


def random_model(name: str, dtype, seed: int = 0):
    """(ModelConfig, params, (MedusaConfig, head params)) of preset `name` with random weights in
    `dtype`, built leaf by leaf on the default device (no float32 copy of a large model)."""
    import jax
    import jax.numpy as jnp

    from medusa_jax.evals.memory import PRESETS
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.models.config import ModelConfig
    from medusa_jax.models.llama import LlamaModel

    presets = dict(PRESETS, **{"smollm2-135m": SMOLLM2_135M})
    if name not in presets:
        raise SystemExit(f"error: unknown model {name!r}; choose from {', '.join(sorted(presets))}")
    cfg = ModelConfig.from_hf_dict(presets[name], source=name)
    shapes = jax.eval_shape(lambda k: LlamaModel(cfg).init(k, jnp.zeros((1, 4), jnp.int32),
                                                           jnp.zeros((1, 4), jnp.int32))["params"],
                            jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))

    def draw(key, s):
        if len(s.shape) == 1:
            return jnp.ones(s.shape, dtype)
        return (jax.random.normal(key, s.shape, jnp.float32) * 0.02).astype(dtype)
    params = jax.tree_util.tree_unflatten(treedef, [jax.jit(draw, static_argnums=1)(k, s)
                                                    for k, s in zip(keys, leaves)])
    K, D = 4, cfg.hidden_size
    hcfg = MedusaConfig(hidden_size=D, vocab_size=cfg.vocab_size, num_heads=K, num_layers=1, shared_lm_head=True)
    hk = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    heads = {"blocks_kernel": (jax.random.normal(hk[0], (K, 1, D, D)) * 0.02).astype(dtype),
             "blocks_bias": (jax.random.normal(hk[1], (K, 1, D)) * 0.02).astype(dtype)}
    return cfg, params, (hcfg, heads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m,llama-2-7b",
                   help="comma-separated architectures: smollm2-135m or a medusa-plan preset (llama-2-7b, ...)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="weights, activations and KV cache dtype")
    p.add_argument("--trees", default="small_4,small_16,mc_sim_7b_63,dynamic:16:4",
                   help="comma-separated trees (presets or dynamic:T[:W], as --tree takes them)")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens prefilled before timing")
    p.add_argument("--cache-size", type=int, default=1024, help="KV cache slots")
    p.add_argument("--steps", type=int, default=32, help="steps per timed on-device loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per tree (best kept)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.decoding.tree import get_tree
    from medusa_jax.tuning.cost import step_costs

    device = f"{jax.default_backend()} {jax.devices()[0].device_kind}"
    print(f"device: {device}, jax {jax.__version__}, dtype {args.dtype}", flush=True)
    specs = [t for t in args.trees.split(",") if t]
    results = {"device": device, "jax": jax.__version__, "dtype": args.dtype, "models": {}}
    for name in [m for m in args.model.split(",") if m]:
        t0 = time.perf_counter()
        cfg, params, heads = random_model(name, jnp.dtype(args.dtype))
        trees = [get_tree(t, topk=10, num_heads=heads[0].num_heads) for t in specs]
        prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, args.prompt_len).tolist()
        rows = []
        for spec, tree in zip(specs, trees):  # one call each: step_costs keys trees by T
            r = step_costs(cfg, params, heads, [tree], prompt, steps=args.steps, repeats=args.repeats,
                           cache_size=args.cache_size, progress=False)
            T = tree.size
            rows.append({"tree": spec, "T": T, "plain_ms": 1e3 * r["plain_seconds"][T],
                         "tree_ms": 1e3 * r["seconds"][T], "c": r["cost"][T]})
            print(f"{name:14s} {spec:14s} T={T:3d}  plain {rows[-1]['plain_ms']:7.3f} ms  "
                  f"tree {rows[-1]['tree_ms']:7.3f} ms  c(T) {rows[-1]['c']:.3f}", flush=True)
        results["models"][name] = {"rows": rows, "seconds_total": time.perf_counter() - t0}
        del params
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
