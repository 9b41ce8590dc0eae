"""Streaming against the on-device loop (issue 28): decode tokens/s of decode.py's path (`generate`:
one request through the engine, a host sync per step, tokens streamed) and of bench's
(`evals.speed.time_jit_generate`: `generate_device`, the whole loop on the device), on the same
MT-bench prompts, interleaved prompt by prompt, plain and Medusa (shipped heads and tree).

    .venv/bin/python scripts/stream_bench.py [--prompts 10] [--max-new-tokens 128]

Decode tokens/s = total tokens / total decode seconds (each path's own measure: the engine's wall
time of the steps, host work included; the loop's wall time), compilation excluded. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import medusa_jax as mj  # noqa: E402
from medusa_jax.chat import load_first_turns  # noqa: E402
from medusa_jax.evals.speed import time_jit_generate  # noqa: E402

MT_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "FastChat_mt_bench_question.jsonl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    model = mj.load_model()
    heads, tree, _ = mj.resolve_heads(model, None)
    ids = [mj.apply_chat_template(model.tokenizer, r["prompt"]) for r in load_first_turns(MT_BENCH, args.prompts)]
    eos, n = model.cfg.eos_token_ids, args.max_new_tokens
    out = {}
    for name, h, t in (("plain", None, None), ("medusa", heads, tree)):
        stream = lambda p: mj.generate(model.cfg, model.params, p, heads=h, tree=t, max_new_tokens=n,  # noqa: E731
                                       progress=False)
        device = lambda p: time_jit_generate(model.cfg, model.params, h, t, p, n, eos, progress=False)  # noqa: E731
        stream(ids[0]), device(ids[0])  # untimed warm-up: compiles
        tok = {"stream": 0, "device": 0}
        sec = {"stream": 0.0, "device": 0.0}
        same = 0
        for i, prompt in enumerate(ids):
            order = ("stream", "device") if i % 2 == 0 else ("device", "stream")
            got = {}
            for k in order:
                if k == "stream":
                    r = stream(prompt)
                    got[k], s = r.tokens, r.decode_s
                else:
                    r = device(prompt)
                    got[k], s = r["tokens"], r["seconds"]
                tok[k] += len(got[k])
                sec[k] += s
            same += got["stream"] == got["device"]
        rates = {k: round(tok[k] / sec[k], 2) for k in tok}
        out[name] = {**rates, "stream_vs_device": round(rates["stream"] / rates["device"], 3),
                     "identical": f"{same}/{len(ids)}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
