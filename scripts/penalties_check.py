"""Medusa with penalties and bans on the real model: every answer of the engine's Medusa steps (the
shipped heads and tree) against its plain steps with the same settings, token for token.

    .venv/bin/python scripts/penalties_check.py --prompts data/FastChat_mt_bench_question.jsonl

For each setting (greedy: a repetition penalty of 1.3; presence 0.5 with frequency 0.5; sampled at
temperature 0.7 with min_p 0.05 and a repetition penalty of 1.2, seed = the prompt's index; greedy with
bad words of one and two tokens, tokenized as the server does), the first
turn of each prompt is answered by an Engine with speculation off and one with it always on; the
two must be identical. A greedy difference is counted as a near-tie when the processed logits'
top-2 gap at the first differing token (one plain forward, the engine's processors) is below
`evals.lossless.TIE_GAPS` (as `medusa-check` does). Prints per setting: identical / prompts,
near-ties, tokens per step, and how many answers the penalties changed against the greedy answer
without them. Exits 1 when an answer differs and is not a near-tie.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {
    "repetition 1.3": dict(repetition_penalty=1.3),
    "presence 0.5 + frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "sampled 0.7, min_p 0.05, repetition 1.2": dict(temperature=0.7, min_p=0.05, repetition_penalty=1.2),
    "bad words": dict(bad_words=["of the", "in the", "It is", "can be", "you", "the"]),
}


def processed_gap(cfg, params, request, answer) -> float:
    """Top-2 gap of the logits after the request's prompt + answer as the engine processes them for
    `request` (one plain forward, then `decoding.processors.step_logits`)."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.decoding.processors import dense_processors, step_logits
    from medusa_jax.models.llama import LlamaModel

    ids = jnp.asarray([list(request.prompt) + list(answer)], jnp.int32)
    logits = LlamaModel(cfg).apply({"params": params}, ids, jnp.arange(ids.shape[1])[None])[0][:, -1]
    procs = jax.tree_util.tree_map(jnp.asarray, dense_processors([request], logits.shape[-1]))
    state = SimpleNamespace(cache=SimpleNamespace(tokens=ids, lengths=jnp.asarray([ids.shape[1]])), logits=logits,
                            temperature=jnp.zeros((1,)))
    top = np.sort(np.asarray(step_logits(procs, state)[0], np.float64))[-2:]
    return float(top[1] - top[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True, help="a JSONL file of questions (MT-bench's 'turns', or 'prompt')")
    p.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--max-batch", type=int, default=4, help="rows of each engine")
    p.add_argument("--only", default="", help="the settings whose name contains this text only")
    args = p.parse_args(argv)

    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request, SamplingParams
    from medusa_jax.evals.lossless import TIE_GAPS
    from medusa_jax.evals.lossless import first_difference as diff
    from medusa_jax.serve.text import bad_words_ids

    with open(args.prompts) as f:
        records = [json.loads(line) for line in f if line.strip()]
    texts = [r["turns"][0] if "turns" in r else r["prompt"] for r in records]
    texts = texts[:args.limit] if args.limit else texts
    model = mj.load_model(weights="as-stored")
    heads, tree, _ = mj.resolve_heads(model, None)
    prompts = [mj.apply_chat_template(model.tokenizer, t) for t in texts]
    plain = Engine(model.cfg, model.params, max_batch=args.max_batch, speculation="off", progress=False)
    medusa = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=args.max_batch, speculation="always",
                    progress=False)

    def answers(engine, requests):
        handles = [engine.submit(r) for r in requests]
        engine.run()
        return [h.finished for h in handles]

    unpenalized = [f.tokens for f in answers(plain, [Request(ids, args.max_new_tokens) for ids in prompts])]
    failed = 0
    print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens, tree {tree}")
    for name, kw in ((n, kw) for n, kw in SETTINGS.items() if args.only in n):
        kw = dict(kw)
        words = bad_words_ids(model.tokenizer, kw.pop("bad_words")) if "bad_words" in kw else None
        requests = [Request(ids, args.max_new_tokens, SamplingParams(seed=i, **kw), bad_words=words)
                    for i, ids in enumerate(prompts)]
        ref, got = answers(plain, requests), answers(medusa, requests)
        same = ties = 0
        for r, a, b in zip(requests, ref, got):
            i = diff(a.tokens, b.tokens)
            if i is None:
                same += 1
            elif (r.sampling.temperature == 0 and i < min(len(a.tokens), len(b.tokens))
                  and processed_gap(model.cfg, model.params, r, a.tokens[:i]) < TIE_GAPS["float32"]):
                ties += 1
            else:
                failed += 1
        changed = sum(a.tokens != u for a, u in zip(ref, unpenalized))
        tps = sum(len(f.tokens) for f in got) / sum(f.steps for f in got)
        print(f"{name:42s} identical {same}/{len(prompts)}, near-ties {ties}, {tps:.3f} tokens/step "
              f"(answers changed by the setting: {changed}/{len(prompts)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
