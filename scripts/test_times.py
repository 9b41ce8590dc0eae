"""Summarise tests/timing_plugin.py's file: the slowest tests and where their time went.

    .venv/bin/python -m pytest -p tests.timing_plugin --test-times /tmp/times.jsonl
    .venv/bin/python scripts/test_times.py /tmp/times.jsonl --top 60

Prints a Markdown table (seconds): wall, fixtures' setup, XLA compiles (misses) and cache reads,
tracing and lowering, model loading in the process, the CPU of the commands it started and waited
for, and the rest (decoding, numpy, the test's own work); then the totals by marker and by file.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="the JSON lines written by --test-times")
    p.add_argument("--top", type=int, default=60, help="how many of the slowest tests to list (default 60)")
    args = p.parse_args(argv)
    recs = [json.loads(line) for line in open(args.file, encoding="utf-8") if line.strip()]
    recs.sort(key=lambda r: -r["wall"])
    g = lambda r, k: r.get(k, 0.0)  # noqa: E731
    print("| # | test | wall | setup | XLA compile | cache reads | trace + lower | load | commands' CPU | rest |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(recs[:args.top], 1):
        compile_ = g(r, "compile") - g(r, "cache_read")
        known = g(r, "compile") + g(r, "trace") + g(r, "lower") + g(r, "load")
        print(f"| {i} | `{r['test']}` | {r['wall']:.1f} | {g(r, 'setup'):.1f} | {compile_:.1f} ({r.get('compiles', 0)}) "
              f"| {g(r, 'cache_read'):.1f} ({int(g(r, 'cache_hits'))}) | {g(r, 'trace') + g(r, 'lower'):.1f} "
              f"| {g(r, 'load'):.1f} | {g(r, 'children_cpu'):.1f} | {max(r['wall'] - known, 0.0):.1f} |")
    total = sum(r["wall"] for r in recs)
    print(f"\n{len(recs)} tests, {total:.0f} s of test time; the {args.top} slowest: "
          f"{sum(r['wall'] for r in recs[:args.top]):.0f} s")
    for k in ("compile", "cache_read", "trace", "lower", "load", "children_cpu"):
        print(f"- {k}: {sum(g(r, k) for r in recs):.0f} s")
    by = defaultdict(lambda: [0, 0.0])
    for r in recs:
        key = ",".join(r["markers"]) or "(unmarked)"
        by[key][0] += 1
        by[key][1] += r["wall"]
    print("\nby marker: " + "; ".join(f"{k}: {n} tests, {t:.0f} s" for k, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])))
    files = defaultdict(float)
    for r in recs:
        files[r["test"].split("::")[0]] += r["wall"]
    print("by file: " + "; ".join(f"{k} {t:.0f} s" for k, t in sorted(files.items(), key=lambda x: -x[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
