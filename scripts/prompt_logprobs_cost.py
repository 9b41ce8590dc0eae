"""What a completion's ``echo`` with ``logprobs`` costs: scoring a prompt (`Engine.prompt_logprobs`: every
position's logits, log-softmax and top-k) against prefilling it for decoding (the last position's logits
only), on the default model as the server holds it, prompts of several lengths, interleaved rounds (best kept).

    .venv/bin/python scripts/prompt_logprobs_cost.py [--lengths 128,512,2048] [--rounds 3] [--weights as-stored]

Prints, per prompt length, the milliseconds of a scoring with ``logprobs: 1`` (top-20 kept, as the server
compiles it for any N > 0), of one with ``logprobs: 0``, and of a prefill (`decoding.prefill.start_state`),
and their ratio: the price of loglikelihood requests (lm-evaluation-harness) relative to a prompt's prefill.
Then a whole loglikelihood request through the engine (the server's echo + ``logprobs: 1`` + ``max_tokens: 1``:
the scoring, then a one-token answer), with the scoring's KV cache kept for the answer's prefill
(`Engine.prompt_logprobs`'s ``keep``) and without, over a prefill.
Compilation is left out (a first untimed round compiles each shape).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, variants interleaved (best kept)")
    p.add_argument("--weights", default="as-stored", choices=["as-stored", "float32"],
                   help="the weights as the server holds them (default: the GGUF's blocks)")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.prefill import start_state
    from medusa_jax.decoding.prefix_cache import PrefixCache
    from medusa_jax.decoding.requests import Request
    from medusa_jax.decoding.prompt_logprobs import prompt_logprobs

    model = mj.load_model(weights=args.weights)
    cfg, params = model.cfg, model.params
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(["the", "model", "reads", "a", "long", "prompt", "about", "rivers", "and", "stars"],
                               size=4096).tolist())
    base = list(model.tokenizer.encode(text))
    engine = Engine(cfg, params, max_batch=1, prefix_cache_bytes=1 << 30)

    def loglikelihood(ids, keep):
        engine.prefix = PrefixCache(1 << 30)  # nothing kept from the rounds before
        engine.prompt_logprobs(ids, 1, keep=keep)
        handle = engine.submit(Request(ids, 1))
        engine.run()
        assert handle.finished.reused_tokens == (len(ids) - 1 if keep else 0)

    variants = {"score, logprobs=1": lambda ids: prompt_logprobs(cfg, params, ids, 1),
                "score, logprobs=0": lambda ids: prompt_logprobs(cfg, params, ids, 0),
                "prefill": lambda ids: jax.block_until_ready(
                    start_state(cfg, params, [ids], min(2 * len(ids), cfg.max_position_embeddings),
                                progress=False).logits),
                "loglikelihood, kept": lambda ids: loglikelihood(ids, True),
                "loglikelihood": lambda ids: loglikelihood(ids, False)}
    names = list(variants)
    print(f"{args.weights} weights; ms per prompt, best of {args.rounds}")
    print(f"{'tokens':>7} " + " ".join(f"{n:>20}" for n in names) + f" {'score/prefill':>14}"
          + f" {'kept/prefill':>13} {'unkept/prefill':>15}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = base[:n]
        best = {k: float("inf") for k in names}
        for r in range(1 + args.rounds):  # round 0 compiles
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                variants[name](ids)
                if r:
                    best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{n:>7} " + " ".join(f"{best[k] * 1e3:>20.1f}" for k in names)
              + f" {best[names[0]] / best['prefill']:>14.2f} {best[names[3]] / best['prefill']:>13.2f}"
              + f" {best[names[4]] / best['prefill']:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
