"""Load on the OpenAI-compatible server (issue 29): Spec-Bench prompts replayed by concurrent streaming
clients (the official `openai` package), bounded in time.

    .venv/bin/python scripts/serve_bench.py [--prompts 48] [--concurrency 1,4,16] [--speculation off,always,adaptive]
        [--repeats 2] [--prefix-cache-mb 1024]

For each speculation setting a server is started (``medusa-serve --speculation S --max-batch 16`` on a
free port; all of them at once) and warmed up (untimed: by default every concurrency replays all the
prompts once, so that each shape of step the replay meets is compiled; `--warmup short`: a few
prompts); then ``--repeats`` times, each concurrency replays the prompts on each server in turn
(interleaved: off, always, adaptive, so that a slow spell of the machine falls on all three; greedy,
``--max-tokens`` each): N clients, each taking the next prompt when its stream ends. The figures pool
the repeats. With the servers' prefix cache on (their default), a timed replay finds each prompt's
KV left by the warm-up and measures decoding mostly; ``--prefix-cache-mb 0`` prefills every prompt
again (at concurrency 16 the prefills then take most of the time). Reported per run: throughput (completion tokens / wall seconds, prefills included),
decode throughput (the tokens after each request's first chunk / the seconds from its first chunk
to its last, summed over requests: at concurrency 1 the decoding speed alone; a Medusa first chunk
may carry more than one token, which overstates Medusa's figure by ~1-2% at 64 tokens), time to
first token and inter-chunk latency p50 / p99 (the gap between two streamed chunks; a chunk carries
the tokens one step accepted), the answers' agreement with the plain server's (greedy: identical),
and the server's tokens per step. One JSON line per (speculation, concurrency); a ratios line at the
end (throughput and decode throughput against speculation off).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from medusa_jax.chat import load_first_turns  # noqa: E402
from medusa_jax.evals.speed import per_category, spec_bench_groups  # noqa: E402

SPEC_BENCH = os.path.join(ROOT, "data", "Spec-Bench_question.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(speculation: str, max_batch: int, prefix_cache_mb: int):
    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "medusa-serve"), "--port", str(port),
                             "--speculation", speculation, "--max-batch", str(max_batch), "--log-level", "warning",
                             "--prefix-cache-mb", str(prefix_cache_mb)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not start")


def replay(url: str, prompts, concurrency: int, max_tokens: int, deadline_s: float) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=deadline_s)
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    answers, ttft, itl, tokens = {}, [], [], 0
    decode = [0, 0.0]  # tokens after the first chunk, seconds from the first chunk to the last
    end_at = time.perf_counter() + deadline_s

    def worker():
        nonlocal tokens
        while time.perf_counter() < end_at:
            with lock:
                if not queue:
                    return
                i, p = queue.pop(0)
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model="smollm2-135m-instruct", stream=True,
                                                    messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                                                    temperature=0, stream_options={"include_usage": True})
            first = last = None
            parts, n = [], 0
            for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                parts.append(chunk.choices[0].delta.content)
                if last is None:
                    ttft.append(now - t0)
                    first = now
                else:
                    itl.append(now - last)
                last = now
            with lock:
                answers[i] = "".join(parts)
                tokens += n
                if first is not None and last > first:
                    decode[0] += n - 1
                    decode[1] += last - first

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return summary({"tokens": tokens, "wall": wall, "decode": decode, "ttft": ttft, "itl": itl, "answers": answers})


def summary(raw: dict) -> dict:
    """Figures of one replay's (or several pooled replays') raw measurements."""
    pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None  # noqa: E731
    decode = raw["decode"]
    return {"requests": len(raw["answers"]), "tokens": raw["tokens"], "wall_s": round(raw["wall"], 2),
            "tok_s": round(raw["tokens"] / raw["wall"], 2),
            "decode_tok_s": round(decode[0] / decode[1], 2) if decode[1] else None,
            "ttft_p50_ms": pct(raw["ttft"], 50), "ttft_p99_ms": pct(raw["ttft"], 99),
            "itl_p50_ms": pct(raw["itl"], 50), "itl_p99_ms": pct(raw["itl"], 99), "answers": raw["answers"], "raw": raw}


def pooled(runs) -> dict:
    """One summary of several replays of the same prompts: tokens and seconds summed, latencies pooled; the
    answers are the first replay's (`identical` says whether every replay gave the same)."""
    raws = [r["raw"] for r in runs]
    out = summary({"tokens": sum(r["tokens"] for r in raws), "wall": sum(r["wall"] for r in raws),
                   "decode": [sum(r["decode"][0] for r in raws), sum(r["decode"][1] for r in raws)],
                   "ttft": [x for r in raws for x in r["ttft"]], "itl": [x for r in raws for x in r["itl"]],
                   "answers": raws[0]["answers"]})
    out["replays"] = len(raws)
    out["tok_s_each"] = [r["tok_s"] for r in runs]
    out["identical_across_replays"] = all(r["answers"] == raws[0]["answers"] for r in raws)
    out.pop("raw")
    return out


def tokens_per_step(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    get = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                           if line.startswith(name + "{"))
    drafts = get("vllm:spec_decode_num_drafts_total")
    return round(1 + get("vllm:spec_decode_num_accepted_tokens_total") / drafts, 3) if drafts else 1.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--speculation", default="off,always,adaptive")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--warmup", choices=("full", "short"), default="full",
                   help="untimed replay before each timed one: every prompt (full: no compilation is timed) or a few "
                        "(short: the first requests of new shapes compile inside the timings, as on a cold server)")
    p.add_argument("--deadline", type=float, default=1200.0, help="seconds one replay may take at most")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed replays per (speculation, concurrency), interleaved across the servers; figures pool them")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="the servers' prefix cache: with it (the server's default) the timed replays find each "
                        "prompt's KV from the warm-up, so they measure decoding; 0: every prompt is prefilled again")
    args = p.parse_args()
    recs = per_category(spec_bench_groups(load_first_turns(SPEC_BENCH)), -(-args.prompts // 6))[:args.prompts]
    prompts = [r["prompt"] for r in recs]
    levels = [int(c) for c in args.concurrency.split(",")]
    specs = args.speculation.split(",")
    servers = {}
    results = {}
    try:
        for spec in specs:  # all up at once (an idle server waits on an event), so replays can interleave
            servers[spec] = start(spec, args.max_batch, args.prefix_cache_mb)
        for spec in specs:
            for c in levels:  # untimed warm-up: compiles the shapes (trees, rows, cache sizes) the replay meets
                replay(servers[spec][1], prompts if args.warmup == "full" else prompts[:max(c, 2)], c,
                       args.max_tokens, args.deadline)
        for rep in range(args.repeats):  # interleaved: off, always, adaptive at one concurrency, then the next
            for c in levels:
                for spec in specs:
                    r = replay(servers[spec][1], prompts, c, args.max_tokens, args.deadline)
                    print(json.dumps({"repeat": rep, "speculation": spec, "concurrency": c,
                                      "tok_s": r["tok_s"], "decode_tok_s": r["decode_tok_s"]}), flush=True)
                    results.setdefault((spec, c), []).append(r)
        for c in levels:
            for spec in specs:
                r = pooled(results[(spec, c)])
                results[(spec, c)] = r
                base = results.get(("off", c))
                same = (sum(r["answers"][i] == base["answers"].get(i) for i in r["answers"]) if base else None)
                print(json.dumps({"speculation": spec, "concurrency": c, **{k: v for k, v in r.items() if k != "answers"},
                                  "identical_to_off": same, "server_tokens_per_step": tokens_per_step(servers[spec][1])}),
                      flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(120)
    ratios = {}
    for c in levels:
        off = results.get(("off", c))
        if off:
            for spec in ("always", "adaptive"):
                if (spec, c) in results:
                    r = results[(spec, c)]
                    ratios[f"{spec}/off@{c}"] = round(r["tok_s"] / off["tok_s"], 3)
                    if r["decode_tok_s"] and off["decode_tok_s"]:
                        ratios[f"{spec}/off@{c} decode"] = round(r["decode_tok_s"] / off["decode_tok_s"], 3)
    print(json.dumps({"ratios": ratios}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
