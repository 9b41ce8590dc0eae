#!/usr/bin/env python
"""How far the plain and the Medusa path's logits drift apart in a low-precision dtype: the measure
behind `medusa_jax.evals.lossless.TIE_GAPS`.

    python scripts/path_noise.py --dtype bfloat16 --ids 81,89,97 [--max-new-tokens 64]

For each MT-bench question (first turn), both greedy decoders run step by step with the shipped
heads and tree, and the logits each path holds after every step are kept by position. Over the
positions both paths reached before their outputs first differ, it prints (one JSON line per
prompt) the largest absolute logit difference and the largest change of the plain path's top-2
gap (top-1 minus top-2 logit of the plain path, measured on both paths' logits): a token flips
between the paths only where that change exceeds the gap, so it sets the near-tie threshold.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trace(m, ids, heads, tree, n: int):
    """(tokens, {position: logits [V] float32 numpy}) of greedy decoding, step by step."""
    import medusa_jax as mj
    from medusa_jax.decoding.compile import aot
    from medusa_jax.decoding.setup import decoding_setup
    from medusa_jax.decoding.prefill import cache_size_for, start_state
    from medusa_jax.decoding.step import StepConfig, step
    from medusa_jax.drafts import drafter_for

    params, hc, hp, tr = decoding_setup(m.cfg, m.params, heads, tree if heads else None)
    S = cache_size_for(m.cfg, len(ids), n, tr.size)
    st = start_state(m.cfg, params, [ids], S, 0, progress=False)
    logits, toks = {len(ids): np.asarray(st.logits[0])}, []
    while len(toks) < n:
        out, st = aot(step, (StepConfig(m.cfg, hc, drafter_for(tr), mj.Acceptance()),), (params, hp, st))(params, hp, st)
        toks += [int(t) for t in out.tokens[0, :int(out.num_tokens[0])]]
        logits[len(ids) + len(toks)] = np.asarray(st.logits[0])
    return toks, logits


def main(argv=None) -> int:
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(prog="python scripts/path_noise.py", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16", help="compute dtype")
    p.add_argument("--ids", required=True, help="comma-separated MT-bench question ids")
    p.add_argument("--prompts", default="data/FastChat_mt_bench_question.jsonl", help="question file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    args = p.parse_args(argv)
    import jax.numpy as jnp

    import medusa_jax as mj
    from medusa_jax import resolve
    from medusa_jax.chat import load_first_turns

    m = mj.load_model(dtype=jnp.dtype(args.dtype))
    heads, tree, _ = resolve.resolve_heads(m, None)
    recs = {str(r["id"]): r for r in load_first_turns(args.prompts)}
    for qid in args.ids.split(","):
        ids = mj.apply_chat_template(m.tokenizer, recs[qid.strip()]["prompt"])
        tp, lp = trace(m, ids, None, None, args.max_new_tokens)
        tm, lm = trace(m, ids, heads, tree, args.max_new_tokens)
        first = next((j for j, (a, b) in enumerate(zip(tp, tm)) if a != b), None)
        end = len(ids) + (first if first is not None else args.max_new_tokens)
        shared = [q for q in sorted(lm) if q in lp and q <= end]
        top2 = {q: np.argsort(lp[q])[-2:] for q in shared}
        gap = lambda x, q: float(x[top2[q][1]] - x[top2[q][0]])
        print(json.dumps({"id": qid, "dtype": args.dtype, "first_diff": first, "positions": len(shared),
                          "max_abs_logit_diff": round(max(float(np.max(np.abs(lp[q] - lm[q]))) for q in shared), 4),
                          "max_top2_gap_change": round(max(abs(gap(lp[q], q) - gap(lm[q], q)) for q in shared), 4)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
