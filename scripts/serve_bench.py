"""Load on the OpenAI-compatible server (issue 29): Spec-Bench prompts replayed by concurrent streaming
clients (the official `openai` package), bounded in time.

    .venv/bin/python scripts/serve_bench.py [--prompts 48] [--concurrency 1,4,16] [--speculation off,always,adaptive]

For each speculation setting a server is started (``medusa-serve --speculation S --max-batch 16`` on a
free port), warmed up (untimed: by default every concurrency replays all the prompts once, so that
each shape of step the replay meets is compiled; `--warmup short`: a few prompts), then each concurrency
replays the prompts (greedy, ``--max-tokens`` each): N clients, each taking the next prompt when its
stream ends. Reported per run: throughput (completion tokens / wall seconds, prefills included),
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

SPEC_BENCH = os.path.join(ROOT, "..", "shared", "data", "Spec-Bench_question.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(speculation: str, max_batch: int):
    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "medusa-serve"), "--port", str(port),
                             "--speculation", speculation, "--max-batch", str(max_batch), "--log-level", "warning"],
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
    pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None  # noqa: E731
    return {"requests": len(answers), "tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "decode_tok_s": round(decode[0] / decode[1], 2) if decode[1] else None,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "answers": answers}


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
    args = p.parse_args()
    recs = per_category(spec_bench_groups(load_first_turns(SPEC_BENCH)), -(-args.prompts // 6))[:args.prompts]
    prompts = [r["prompt"] for r in recs]
    levels = [int(c) for c in args.concurrency.split(",")]
    results = {}
    for spec in args.speculation.split(","):
        proc, url = start(spec, args.max_batch)
        try:
            for c in levels:  # untimed warm-up: compiles the shapes (trees, rows, cache sizes) the replay meets
                replay(url, prompts if args.warmup == "full" else prompts[:max(c, 2)], c, args.max_tokens,
                       args.deadline)
            for c in levels:
                r = replay(url, prompts, c, args.max_tokens, args.deadline)
                results[(spec, c)] = r
                base = results.get(("off", c))
                same = (sum(r["answers"][i] == base["answers"].get(i) for i in r["answers"]) if base else None)
                print(json.dumps({"speculation": spec, "concurrency": c, **{k: v for k, v in r.items() if k != "answers"},
                                  "identical_to_off": same, "server_tokens_per_step": tokens_per_step(url)}), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
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
