"""The engine's benchmarks (issue 28), on the default model and its shipped heads.

    .venv/bin/python scripts/engine_bench.py speculation [--prompts 40] [--rows 1,4,16] [--max-new-tokens 64]
    .venv/bin/python scripts/engine_bench.py multiturn [--context 1500]
    .venv/bin/python scripts/engine_bench.py latency

- speculation: N Spec-Bench prompts (spread over its tasks) through the engine at each row count,
  with speculation off, always and adaptive, interleaved (off, always, adaptive at one row count,
  then the next): total new tokens / total wall seconds (prefills included), and whether every
  greedy answer equals the plain run's.
- multiturn: a 3-turn conversation whose third turn starts ~N tokens in (turn 1 carries a long
  document), with prefix reuse on and off: time to the first token of each turn and the answers.
- latency: 3 requests decoding, then a ~2,000-token prompt and one short request arrive together:
  the short request's inter-token latencies (p50, p99, max) against the same request's with the
  long prompt absent.
Prints one JSON object per measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import medusa_jax as mj  # noqa: E402
from medusa_jax.chat import load_first_turns, render_chat  # noqa: E402
from medusa_jax.engine.engine import Engine  # noqa: E402
from medusa_jax.decoding.requests import Request  # noqa: E402
from medusa_jax.evals.speed import per_category, spec_bench_groups  # noqa: E402

SPEC_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                          "Spec-Bench_question.jsonl")


def prompts(model, n: int):
    recs = spec_bench_groups(load_first_turns(SPEC_BENCH))
    recs = per_category(recs, -(-n // 6))[:n]
    return [mj.apply_chat_template(model.tokenizer, r["prompt"]) for r in recs]


def run_all(engine: Engine, ids, max_new: int) -> tuple:
    t0 = time.perf_counter()
    compiled = engine.compile_s
    handles = [engine.submit(Request(p, max_new)) for p in ids]
    engine.run()
    wall = time.perf_counter() - t0 - (engine.compile_s - compiled)
    toks = [h.finished.tokens for h in handles]
    return sum(len(t) for t in toks) / wall, toks


def speculation(args, model, heads, tree) -> None:
    ids = prompts(model, args.prompts)
    for rows in [int(r) for r in args.rows.split(",")]:
        engines = {mode: Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=rows, speculation=mode)
                   for mode in ("off", "always", "adaptive")}
        for e in engines.values():  # untimed warm-up: compiles the shapes (trees, cache sizes) the run meets
            run_all(e, ids if args.warmup == "full" else ids[:rows], args.max_new_tokens)
        for e in engines.values():  # the chooser starts again from its priors
            e.chooser.__init__(e.chooser.trees, e.chooser.mode)
        out = {}
        for mode, e in engines.items():
            rate, toks = run_all(e, ids, args.max_new_tokens)
            out[mode] = {"tok_s": round(rate, 2), "tree_choices": e.stats["tree_choices"][:]}
            out[mode]["identical_to_off"] = (toks == out["off"]["_toks"]) if mode != "off" else True
            out[mode]["_toks"] = toks
        for m in out.values():
            m.pop("_toks")
        best = max(out["off"]["tok_s"], out["always"]["tok_s"])
        print(json.dumps({"bench": "speculation", "rows": rows, "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
                          **out, "adaptive_vs_best": round(out["adaptive"]["tok_s"] / best, 3)}), flush=True)


def multiturn(args, model, heads, tree) -> None:
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    words = doc.split()
    turns = ["Here is a document:\n" + " ".join(words[:args.context // 2]) + "\n\nSummarise its first section.",
             "Which commands does it mention?", "Give the document a short title."]
    results = {}
    for reuse in (True, False, True, False):  # the first pass of each compiles its shapes; the second is kept
        engine = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=1, speculation="always",
                        prefix_cache_bytes=(1 << 30) if reuse else 0)
        msgs, rows = [], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            ids = render_chat(model.tokenizer, msgs)
            h = engine.submit(Request(ids, args.max_new_tokens))
            engine.run()
            fin = h.finished
            msgs.append({"role": "assistant", "content": model.tokenizer.decode(fin.tokens, skip_special_tokens=True)})
            rows.append({"prompt_tokens": len(ids), "reused": fin.reused_tokens, "ttft_s": round(fin.first_token_s, 3),
                         "prefill_s": round(fin.prefill_s, 3), "tokens": fin.tokens})
        results[reuse] = rows
    same = all(a["tokens"] == b["tokens"] for a, b in zip(results[True], results[False]))
    for r in results[True] + results[False]:
        r.pop("tokens")
    print(json.dumps({"bench": "multiturn", "with_reuse": results[True], "without_reuse": results[False],
                      "identical_answers": same,
                      "turn3_ttft_ratio": round(results[True][2]["ttft_s"] / results[False][2]["ttft_s"], 3)}),
          flush=True)


def latency(args, model, heads, tree) -> None:
    ids = prompts(model, 8)
    long_doc = " ".join(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          "README.md")).read().split()[:1100])
    long_ids = mj.apply_chat_template(model.tokenizer, "Summarise:\n" + long_doc)
    out = {"long_prompt_tokens": len(long_ids)}
    engine = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=8, speculation="adaptive")
    for with_long in (False, True, False, True, False, True):  # the first two passes compile
        times = []
        for p in ids[:3]:
            engine.submit(Request(p, 160))
        while engine.live < 3:  # the three are decoding
            engine.step()
        if with_long:
            engine.submit(Request(long_ids, 16))
        probe = engine.submit(Request(ids[3], 96), on_event=lambda kind, payload: times.append(
            (time.perf_counter(), len(payload) if kind == "tokens" else 0)))
        engine.run()
        stamps = [t for t, n in times if n]
        gaps = np.diff(stamps)
        per_token = gaps / np.asarray([n for t, n in times if n][1:])
        key = "with_long_prefill" if with_long else "alone"
        out.setdefault(key, []).append({"p50_ms": round(float(np.percentile(per_token, 50)) * 1e3, 1),
                                        "p99_ms": round(float(np.percentile(per_token, 99)) * 1e3, 1),
                                        "max_gap_ms": round(float(gaps.max()) * 1e3, 1),
                                        "ttft_s": round(probe.finished.first_token_s, 3)})
    for key in ("alone", "with_long_prefill"):
        out[key] = out[key][1:]  # the first pass of each compiled
    print(json.dumps({"bench": "latency", "live_chunk": engine.live_chunk, **out}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("speculation", "multiturn", "latency"))
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup", choices=("full", "short"), default="full",
                   help="speculation: an untimed run of every prompt first (full: no compilation is timed) or of "
                        "one per row (short: new cache sizes compile inside the timings)")
    p.add_argument("--context", type=int, default=1500, help="multiturn: tokens before the third turn (about)")
    args = p.parse_args()
    model = mj.load_model()
    heads, tree, _ = mj.resolve_heads(model, None)
    {"speculation": speculation, "multiturn": multiturn, "latency": latency}[args.what](args, model, heads, tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
