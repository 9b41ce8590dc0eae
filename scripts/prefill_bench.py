"""Prefill speed: our chunked prefill (`medusa_jax.decoding.prefill.start_state`) against transformers'
forward of the same prompt ids on the same weights, interleaved in one run.

    .venv/bin/python scripts/prefill_bench.py                    # ~2,000-token prompt, SmolLM2 GGUF
    .venv/bin/python scripts/prefill_bench.py --tokens 8000 --chunk-size 128 256 512

The prompt is Spec-Bench's first turns joined into one user message, through the chat template,
as long as it stays within ``--tokens``. Each repeat times every chunk size of ours, then
transformers, so that load changes on a shared machine hit both sides alike; compilation is never
timed (one untimed warm-up call each), and both sides end on the device (``block_until_ready``).
Ours is timed as decode.py runs it: a cache for the prompt and 256 new tokens (``cache_size_for``).
transformers runs ``model(ids, use_cache=True, logits_to_keep=1)`` under ``torch.inference_mode``
with ``torch.set_num_threads(--threads)`` (default: the cores this process may use), as a prefill
inside its ``generate`` does. Prints seconds per repeat, the medians and ours / transformers, and
the largest difference between the two last-position logits (a check that both computed the same).
Needs the test extra (torch, accelerate) for transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                               "Spec-Bench_question.jsonl")


def long_prompt(tokenizer, path: str, tokens: int) -> list:
    """Chat-templated ids of the file's first turns joined by blank lines, as many as fit in `tokens`."""
    from medusa_jax.chat import apply_chat_template

    with open(path) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    ids, taken = apply_chat_template(tokenizer, texts[0]), [texts[0]]
    for text in texts[1:]:
        longer = apply_chat_template(tokenizer, "\n\n".join(taken + [text]))
        if len(longer) > tokens:
            break
        ids, taken = longer, taken + [text]
    return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Our prefill against transformers' forward, interleaved.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the SmolLM2 GGUF)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL with 'turns' (first turns are joined)")
    p.add_argument("--tokens", type=int, default=2000, help="the prompt's length at most, in tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each side")
    p.add_argument("--chunk-size", type=int, nargs="+", default=None,
                   help="our prefill chunk size(s) to time (default: medusa_jax.decoding.prefill.PREFILL_CHUNK)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    args = p.parse_args(argv)


    import jax
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from medusa_jax.cli import common
    from medusa_jax.convert.load import load_model
    from medusa_jax.decoding import prefill as gen
    common.enable_compilation_cache()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    cfg, params = model.cfg, model.params
    if os.path.isdir(model.path):
        hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32, local_files_only=True)
    else:
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(model.path), gguf_file=os.path.basename(model.path),
                                                  dtype=torch.float32, local_files_only=True)
    hf.eval()
    ids = long_prompt(model.tokenizer, args.prompts, args.tokens)
    S = gen.cache_size_for(cfg, len(ids), 256)
    chunks = args.chunk_size or [gen.PREFILL_CHUNK]
    x = torch.tensor([ids])

    def ours(chunk: int):
        timing = {}
        state = gen.start_state(cfg, params, [ids], S, timing=timing, chunk_size=chunk, progress=False)
        return timing["prefill_s"], np.asarray(state.logits[0])

    def theirs():
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = hf(input_ids=x, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t0
        return dt, out.logits[0, -1].float().numpy()

    print(f"prompt {len(ids)} tokens, cache {S} slots, torch threads {args.threads}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, chunk sizes {chunks}", flush=True)
    logits = {c: ours(c)[1] for c in chunks}  # warm-ups: compile, first-call effects
    ref = theirs()[1]
    times = {c: [] for c in chunks}
    times["transformers"] = []
    for r in range(args.repeats):
        for c in chunks:
            times[c].append(ours(c)[0])
        times["transformers"].append(theirs()[0])
        print(f"repeat {r + 1}: " + ", ".join(f"{k if k == 'transformers' else f'ours(chunk {k})'} {v[-1]:.2f} s"
                                             for k, v in times.items()), flush=True)
    hf_s = statistics.median(times["transformers"])
    print(f"transformers forward: median {hf_s:.2f} s")
    for c in chunks:
        s = statistics.median(times[c])
        diff = float(np.max(np.abs(logits[c] - ref)))
        print(f"ours, chunk {c}: median {s:.2f} s = {s / hf_s:.2f}x transformers' time "
              f"(last-position logits differ by at most {diff:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
