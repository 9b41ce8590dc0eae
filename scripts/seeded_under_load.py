"""Seeded sampling under load, through a running server: each seeded request alone, then again with
all the others and neighbours that ask for penalties, log-probabilities, n > 1 and stop strings at
the same time; counts the answers that stayed identical.

    .venv/bin/medusa-serve --port 8000 &
    .venv/bin/python scripts/seeded_under_load.py --url http://127.0.0.1:8000/v1 --requests 40

Logits computed in another batch shape, compiled step or tree differ by float round-off (~1e-5),
so a seeded token can change only where the sampler is that sensitive
(`decoding.sampling.gumbel_choice`: at a near-tie). Prints identical / requests and, for each that
differs, its seed and the first differing character.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

QUESTIONS = ["Name three colors.", "Write a haiku about rain.", "Tell me about the moon.", "Give me a fun fact."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL")
    p.add_argument("--requests", type=int, default=40, help="seeded requests (seeds 100, 101, ...)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    args = p.parse_args(argv)

    import httpx

    async def ask(client, body):
        r = await client.post(args.url + "/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    def body(i):
        return {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "seed": 100 + i,
                "temperature": args.temperature, "max_tokens": args.max_tokens}

    neighbours = [{"messages": [{"role": "user", "content": q}], "temperature": 0.7, "seed": 7, "max_tokens": 40,
                   "presence_penalty": 0.5, "logprobs": True, "top_logprobs": 5, "n": 2, "stop": ["\n\n"]}
                  for q in QUESTIONS]

    async def run():
        async with httpx.AsyncClient() as client:
            alone = [await ask(client, body(i)) for i in range(args.requests)]
            crowd = await asyncio.gather(*[ask(client, body(i)) for i in range(args.requests)],
                                         *[ask(client, b) for b in neighbours])
        return alone, crowd[:args.requests]

    alone, crowd = asyncio.run(run())
    diffs = [(100 + i, next(k for k, (x, y) in enumerate(zip(a + "\0", b + "\1")) if x != y))
             for i, (a, b) in enumerate(zip(alone, crowd)) if a != b]
    print(f"identical alone and in a crowd: {args.requests - len(diffs)}/{args.requests}"
          + (f"; (seed, first differing character) of the others: {diffs}" if diffs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
