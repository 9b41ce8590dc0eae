"""Dynamic against static trees at equal node budgets (issue 30): tokens per step of greedy decoding on
MT-bench first turns with the shipped heads, each tree size T verified both ways, and whether every
answer equals plain greedy's.

    .venv/bin/python scripts/dynamic_bench.py [--sizes 4,8,16,32,64] [--limit 80] [--max-new-tokens 128]
        [--widths 4] [--prompt-lookup 0] [--dynamic-lookup K,...] [--weights as-stored]

- static T: the tree `tune` grows today (`tuning.replay.search_tree` over the heads' held-out
  calibration chats, replaying decoding), its first T - 1 nodes: the best static tree of that size
  tune knows how to build. The grown order is cached in ``--static-cache`` (it takes a few minutes).
- dynamic T: ``dynamic:T:W`` (`drafts.dynamic`), chosen per step, for each width W in ``--widths``
  (W = 0: T / 4, at least 4), scored by the confidences `tune` measured for the heads (as `check` does).
Both without prompt lookup by default (the heads alone; ``--prompt-lookup K`` adds it to both; with
``--dynamic-lookup K1,K2`` the dynamic trees copy each of those instead, one row per K).
``--fit-lookup-confidence`` measures the copied tokens' acceptance per depth afresh, to the deepest K
asked (`tuning.confidence.fit_lookup_confidence` on every held-out chat: n-gram matching, no model),
in place of the saved one (tune's replay measures 3 depths; deeper tokens reuse the last), pooled and
per n-gram size (``--no-ngram-confidence`` scores every copy by the pooled rows; ``--max-ngram N``
matches n-grams up to N; ``--matches M`` offers the M latest matches). ``--no-static`` decodes with the
dynamic trees only, ``--no-dynamic`` with the static ones only. ``--heads DIR`` decodes the dynamic trees
with other heads (scored by their own `tune` report when they have one, else by the draft's
probabilities; the static trees are grown for the shipped heads only, so it needs ``--no-static``).
The model is loaded as `check` loads it (``--weights as-stored``: the GGUF blocks, by default).
Prints one JSON line per (T, tree) and a table at the end. Tokens per step are those of greedy
decoding, so they do not depend on the machine's load; the seconds do.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import medusa_jax as mj  # noqa: E402
from medusa_jax import resolve  # noqa: E402
from medusa_jax.chat import load_first_turns  # noqa: E402
from medusa_jax.decoding.tree import build_tree, get_tree, with_lookup  # noqa: E402
from medusa_jax.evals.lossless import decode_one  # noqa: E402

MT_BENCH = os.path.join(ROOT, "data", "FastChat_mt_bench_question.jsonl")


def grown_order(max_size: int, cache: str, lookup_tokens: int):
    """`search_tree`'s node order for the shipped heads (as `medusa_jax.cli.tune` grows it, on the
    float32 model's hidden states), cached."""
    key = f"{max_size}:{lookup_tokens}"
    saved = json.load(open(cache)) if os.path.exists(cache) else {}
    if key in saved:
        return [tuple(p) for p in saved[key]]
    import jax
    import jax.numpy as jnp

    from medusa_jax.convert.medusa_format import load_heads
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.heads.medusa import with_proposal_projection
    from medusa_jax.models.llama import lm_head_matrix
    from medusa_jax.tuning.calibrate import calibration_data
    from medusa_jax.tuning.replay import Replay, path_ranks, search_tree

    model = mj.load_model(with_tokenizer=False)
    hcfg, hp = load_heads(resolve.DEFAULT_HEADS_DIR, model.cfg)
    lm = lm_head_matrix(model.cfg, model.params)
    _, _, chats, pos, sources = calibration_data(model, os.path.join(ROOT, "data", "distill", "smollm2"), 0.04, 0,
                                                 hcfg.num_heads, 512, 0, True)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    ranks = path_ranks(hcfg, jhp, lm, pos, hcfg.topk, embeddings=token_embeddings(model.params))
    lookup = resolve.tree_lookup(build_tree([]), lookup_tokens).lookup
    order = search_tree(ranks, max_size, hcfg.topk, Replay(chats, sources, lookup))
    saved[key] = [list(p) for p in order]
    with open(cache, "w") as f:
        json.dump(saved, f)
    return list(order)


def dynamic_trees_lookup(num_tokens: int, max_ngram: int = 0, matches: int = 0):
    """`resolve.dynamic_lookup(num_tokens)`, decoding's for a dynamic tree, with this benchmark's
    ``--max-ngram`` and ``--matches`` where given (0: decoding's)."""
    lookup = resolve.dynamic_lookup(num_tokens)
    return lookup._replace(max_ngram=max_ngram or lookup.max_ngram, matches=matches or lookup.matches)


def held_out_lookup_confidence(lookup):
    """`fit_lookup_confidence` and `fit_lookup_ngram_confidence` for the copies `lookup` drafts (a
    `PromptLookup`) at every answer position of the held-out chats (as `tune` splits them)."""
    import numpy as np

    from medusa_jax.train import data as D
    from medusa_jax.tuning.confidence import fit_lookup_confidence, fit_lookup_ngram_confidence
    from medusa_jax.tuning.replay import lookup_drafts

    _, val = D.split_train_val(D.load_distilled(os.path.join(ROOT, "data", "distill", "smollm2")), 0.04, 0)
    chats = [(np.asarray(e[0][:512]), np.asarray(e[1][:512], bool)) for e in val]
    sources = np.asarray([(i, t) for i, (ids, mask) in enumerate(chats) for t in range(len(ids) - 2)
                          if mask[t + 1] or mask[t + 2]])
    copied, found, ngram = lookup_drafts(chats, sources, lookup)
    return (fit_lookup_confidence(chats, sources, copied, found),
            fit_lookup_ngram_confidence(chats, sources, copied, found, ngram))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,8,16,32,64", help="tree sizes T (nodes per step, root included)")
    p.add_argument("--widths", default="4", help="hydra parents expanded per depth for the dynamic trees")
    p.add_argument("--limit", type=int, default=80, help="MT-bench first turns (all 80 by default)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-lookup", type=int, default=0, help="prompt lookup tokens on both trees (0: none)")
    p.add_argument("--dynamic-lookup", default=None,
                   help="comma-separated prompt lookup tokens for the dynamic trees (default: --prompt-lookup)")
    p.add_argument("--fit-lookup-confidence", action="store_true",
                   help="measure the copied tokens' acceptance per depth on the held-out chats, to the deepest K")
    p.add_argument("--weights", default="as-stored", choices=["as-stored", "float32"],
                   help="the GGUF's matrices as stored (check's default) or dequantized")
    p.add_argument("--static-cache", default=os.path.join(ROOT, "data", "static_tree_order.json"),
                   help="where the grown static tree order is kept between runs")
    p.add_argument("--max-ngram", type=int, default=0, help="the longest n-gram the dynamic trees' prompt lookup "
                   "matches (0: resolve.DYNAMIC_LOOKUP_MAX_NGRAM)")
    p.add_argument("--no-ngram-confidence", action="store_true", help="score every copy by the pooled lookup "
                   "confidence, not by the length of the n-gram it matched")
    p.add_argument("--no-static", action="store_true", help="decode with the dynamic trees only (the static ones "
                   "measured before; every answer is still checked against plain greedy's)")
    p.add_argument("--matches", type=int, default=0, help="prompt lookup matches offered to the dynamic trees "
                   "(0: resolve.DYNAMIC_LOOKUP_MATCHES)")
    p.add_argument("--no-dynamic", action="store_true", help="decode with the static trees only (the dynamic ones "
                   "measured before)")
    p.add_argument("--heads", default=None, help="a heads directory to decode the dynamic trees with (default: the "
                   "shipped heads; needs --no-static)")
    args = p.parse_args()
    if args.no_static and args.no_dynamic:
        p.error("--no-static and --no-dynamic leave no tree to decode with")
    if args.heads and not args.no_static:
        p.error("--heads needs --no-static (the static trees are grown for the shipped heads)")
    sizes = [int(s) for s in args.sizes.split(",")]
    model = mj.load_model(weights=args.weights)
    calibration = resolve.heads_calibration(args.heads, args.weights) or {}
    dyn_lookup = [int(k) for k in (args.dynamic_lookup or str(args.prompt_lookup)).split(",")]
    dyn_trees_lookup = functools.partial(dynamic_trees_lookup, max_ngram=args.max_ngram, matches=args.matches)
    if args.fit_lookup_confidence:
        rows, by_ngram = held_out_lookup_confidence(dyn_trees_lookup(max(dyn_lookup)))
        calibration = {**calibration, "lookup_confidence": rows, "lookup_ngram_confidence": by_ngram}
        print(json.dumps({"lookup_acceptance": [[round(math.exp(x), 3) for x in r] for r in rows],
                          "by_ngram": {n: [round(math.exp(x), 3) for x in r] for n, r in by_ngram.items()}}),
              flush=True)
    if args.no_ngram_confidence:
        calibration = {k: v for k, v in calibration.items() if k != "lookup_ngram_confidence"}
    heads, _, _ = mj.resolve_heads(model, args.heads, tree_spec=f"dynamic:{max(sizes)}", prompt_lookup=0)
    hcfg = heads[0]
    prompts = [mj.apply_chat_template(model.tokenizer, r["prompt"]) for r in load_first_turns(MT_BENCH)][:args.limit]
    order = None if args.no_static else grown_order(max(sizes), args.static_cache, args.prompt_lookup)
    t0 = time.perf_counter()
    plain = [decode_one(model, ids, args.max_new_tokens)[0] for ids in prompts]
    plain_s = time.perf_counter() - t0
    print(json.dumps({"tree": "plain", "prompts": len(prompts), "seconds": round(plain_s, 1)}), flush=True)
    rows = []
    for T in sizes:
        trees = {} if args.no_static else {
            "static": resolve.tree_lookup(build_tree(order[:T - 1], hcfg.topk), args.prompt_lookup)}
        for w in ([] if args.no_dynamic else (int(x) for x in args.widths.split(","))):
            w = w or max(4, T // 4)
            tree = resolve.with_confidence(get_tree(f"dynamic:{T}:{w}", topk=hcfg.topk, num_heads=hcfg.num_heads),
                                           calibration.get("confidence"), calibration.get("lookup_confidence"),
                                           calibration.get("lookup_ngram_confidence"))
            for k in dyn_lookup:  # each with its lookup as this run sets it
                trees[f"dynamic W={w}" + (f" K={k}" if args.dynamic_lookup else "")] = \
                    with_lookup(tree, dyn_trees_lookup(k) if k else None)
        for name, tree in trees.items():
            t0 = time.perf_counter()
            tokens = steps = same = 0
            for ids, want in zip(prompts, plain):
                got, n = decode_one(model, ids, args.max_new_tokens, heads=heads, tree=tree)
                tokens, steps, same = tokens + len(got), steps + n, same + (got == want)
            row = {"T": T, "tree": name, "tokens_per_step": round(tokens / steps, 3), "identical": same,
                   "prompts": len(prompts), "seconds": round(time.perf_counter() - t0, 1),
                   "depth": tree.max_depth}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| T | " + " | ".join(dict.fromkeys(r["tree"] for r in rows)) + " |")
    for T in sizes:
        cells = [f"{r['tokens_per_step']:.3f} ({r['identical']}/{r['prompts']})" for r in rows if r["T"] == T]
        static = [r["tokens_per_step"] for r in rows if r["T"] == T and r["tree"] == "static"]
        dynamic = [r["tokens_per_step"] for r in rows if r["T"] == T and r["tree"] != "static"]
        ratio = f" | dynamic/static {max(dynamic) / static[0]:.3f} |" if static and dynamic else " |"
        print(f"| {T} | " + " | ".join(cells) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
