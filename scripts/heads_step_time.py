"""Per-step time of the heads' proposal: official-format heads with their own lm_heads vs the shipped heads.

    .venv/bin/python scripts/heads_step_time.py [--rounds 5] [--before] [--breakdown]

On the real SmolLM2-135M-Instruct (`medusa_jax.load_model()`) and the shipped heads' tree, times the
heads alone per step (`medusa_jax.tuning.cost.heads_seconds`: blocks, vocabulary projection, top-k of the
tree's heads, many steps in one jitted loop, compilation excluded), the heads prepared as decoding
prepares them (`medusa_jax.heads.medusa.prepare_heads`), for:

* shipped: the shipped heads (shared lm_head, 8,192-token proposal vocabulary);
* official, as exported: the shipped heads written by ``export_official(include_lm_head=True)``
  (every head's lm_head a copy of the base one, no proposal vocabulary in the format);
* own lm_heads, full vocabulary / proposal N: official-format heads with their own, distinct lm_heads
  (copies of the base lm_head plus N(0, 1e-4) noise, written and read back in the official format),
  with the whole vocabulary, or with the shipped heads' N most frequent tokens as proposal vocabulary
  (as ``medusa-tune --proposal-vocab N`` adds one).

``--before`` adds the own-lm_head heads unprepared (the per-step slicing and gathering of the code
before `prepare_heads`); ``--breakdown`` adds `medusa_jax.tuning.cost.overhead_breakdown` (whole Medusa step)
for the shipped and own-lm_head proposal heads. Variants are timed in interleaved rounds and each
keeps its best, so that load from other processes on a shared machine hits all of them alike.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (best kept)")
    p.add_argument("--steps", type=int, default=32, help="head proposals per timed call")
    p.add_argument("--prompt-len", type=int, default=100, help="prompt tokens prefilled before timing")
    p.add_argument("--cache-size", type=int, default=256, help="KV cache slots")
    p.add_argument("--proposal-sizes", default="8192,4096", help="proposal vocabularies for own lm_heads")
    p.add_argument("--before", action="store_true", help="also time own lm_heads unprepared (the old path)")
    p.add_argument("--breakdown", action="store_true", help="also run cost.overhead_breakdown (slow)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import medusa_jax as mj
    from medusa_jax.convert.medusa_format import export_official, load_heads
    from medusa_jax.decoding.prefill import start_state
    from medusa_jax.heads.medusa import prepare_heads
    from medusa_jax.resolve import DEFAULT_HEADS_DIR, resolve_tree
    from medusa_jax.tuning.cost import heads_seconds, overhead_breakdown

    model = mj.load_model(with_tokenizer=False)
    cfg, params = model.cfg, model.params
    base = np.asarray(mj.lm_head_matrix(cfg, params))
    shipped_cfg, shipped = load_heads(DEFAULT_HEADS_DIR, cfg)
    tree = resolve_tree(None, shipped_cfg)
    depth = tree.max_depth
    ids = shipped["proposal_ids"]  # most frequent first
    prompt = [int(t) for t in ids[:args.prompt_len]]  # the content does not change the heads' work
    state = start_state(cfg, params, [prompt], args.cache_size)
    plain_cfg = shipped_cfg.replace(proposal_vocab_size=0)
    blocks = {k: shipped[k] for k in ("blocks_kernel", "blocks_bias")}

    variants = {"shipped (shared lm_head, proposal 8192)": (shipped_cfg, shipped)}
    with tempfile.TemporaryDirectory() as tmp:
        export_official(os.path.join(tmp, "copies"), plain_cfg, blocks, base, fmt="safetensors", include_lm_head=True)
        variants["official, as exported (lm_head copies)"] = load_heads(os.path.join(tmp, "copies"), cfg)
        own_cfg = plain_cfg.replace(shared_lm_head=False)
        noise = np.random.default_rng(0).normal(0.0, 1e-4, (own_cfg.num_heads,) + base.shape).astype(np.float32)
        export_official(os.path.join(tmp, "own"), own_cfg, {**blocks, "lm_head": base[None] + noise},
                        fmt="safetensors", include_lm_head=True)
        own = load_heads(os.path.join(tmp, "own"), cfg)
    assert not own[0].shared_lm_head
    variants["own lm_heads, full vocabulary"] = own
    for n in [int(s) for s in args.proposal_sizes.split(",") if s]:
        variants[f"own lm_heads, proposal {n}"] = (own[0].replace(proposal_vocab_size=n),
                                                   {**own[1], "proposal_ids": ids[:n]})
    timed = {name: prepare_heads(hc, hp, base, depth=depth) for name, (hc, hp) in variants.items()}
    if args.before:
        timed["own lm_heads, full vocabulary, unprepared (before)"] = (
            own[0], jax.tree_util.tree_map(jnp.asarray, own[1]))
    for name, (hc, _) in timed.items():
        print(f"{name}: {hc.num_heads} heads kept, shared_lm_head={hc.shared_lm_head}, "
              f"proposal_vocab={hc.proposal_vocab_size}", flush=True)

    best = {name: float("inf") for name in timed}
    for r in range(args.rounds):
        for name, heads in timed.items():
            best[name] = min(best[name], heads_seconds(cfg, params, heads, depth, state, args.steps, repeats=1))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    ref = best[next(iter(best))]
    print(f"\nheads alone per step, {jax.devices()[0].device_kind}, tree {list(map(list, tree.medusa_choices))} "
          f"(depth {depth}, {tree.size} nodes), best of {args.rounds} interleaved rounds of {args.steps} steps\n")
    print("| heads | heads ms/step | vs shipped |\n|---|---:|---:|")
    for name, s in best.items():
        print(f"| {name} | {s * 1e3:.2f} | {s / ref:.2f}x |")
    if args.breakdown:
        print()
        for name in [n for n in variants if n.startswith("shipped") or "proposal" in n]:
            br = overhead_breakdown(cfg, params, variants[name], tree, prompt, steps=16, repeats=3,
                                    cache_size=args.cache_size)
            print(f"{name}: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in br.items() if k.endswith("_ms")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
