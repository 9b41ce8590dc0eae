"""What a request's logprobs, logit_bias and penalties cost per token: the engine's decode speed on one greedy
answer with each option against none, the variants interleaved over several rounds (best kept).

    .venv/bin/python scripts/request_options_cost.py [--rounds 5] [--max-new-tokens 128]

On the default model and its shipped heads and tree (`medusa_jax.resolve_heads`), one Engine (so the
compiled steps are shared; each variant compiles its own step once, in a first untimed round) answers
the same chat prompt (EOS ignored, so every answer has the same length) with: no option (twice,
as a control: the two differ only by the run's noise); ``logprobs=0`` (the chosen token's log-probability);
``logprobs=20`` (OpenAI's most alternatives); a ``logit_bias`` of one token at +0.5 (the bias array
on every step, the answer unchanged unless that token is a near-tie); a presence penalty of 1e-4
(the output's token counts scattered every step, the tree nodes' paths added; the answer unchanged
unless a near-tie). Prints tok/s of the decode
phase (`Finished.decode_s`) per variant and its ratio to no option, and checks that every variant's
tokens equal the first's (the bias's token is chosen to be absent from the answer). Each round
starts with another variant, so that none always runs first.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, variants interleaved (best kept)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.", help="the user message")
    args = p.parse_args(argv)

    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request, SamplingParams

    model = mj.load_model(weights="as-stored")
    heads, tree, _ = mj.resolve_heads(model, None)
    ids = mj.apply_chat_template(model.tokenizer, args.prompt)
    engine = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=1, speculation="always")

    def answer(**kw):
        h = engine.submit(Request(ids, args.max_new_tokens, stop_token_ids=[], **kw))  # no EOS: a fixed length
        engine.run()
        return h.finished

    first = answer()
    absent = next(t for t in range(1000, model.cfg.vocab_size) if t not in first.tokens)
    variants = {"none": {}, "none, again": {}, "logprobs=0": {"logprobs": 0}, "logprobs=20": {"logprobs": 20},
                "logit_bias (1 token, +0.5)": {"logit_bias": {absent: 0.5}},
                "presence_penalty=1e-4": {"sampling": SamplingParams(presence_penalty=1e-4)}}
    best = {k: 0.0 for k in variants}
    names = list(variants)
    for r in range(1 + args.rounds):  # the first round compiles each variant's step
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts with another
            fin = answer(**variants[name])
            assert fin.tokens == first.tokens, f"{name}: the answer changed"
            best[name] = max(best[name], len(fin.tokens) / fin.decode_s)
    print(f"{len(first.tokens)} tokens, {first.tokens_per_step:.2f} tokens/step, tree {tree}")
    for name, tps in best.items():
        print(f"{name:28s} {tps:7.1f} tok/s  {tps / best['none']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
