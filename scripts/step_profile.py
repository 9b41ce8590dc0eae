"""Where a plain step and a tree step spend their time on the CPU kernels, per kind of call.

Traces `--steps` on-device greedy steps (`medusa_jax.tuning.cost.run_steps`, 3 calls) of the real
SmolLM2-135M-Instruct with the shipped heads and their tree, and of plain decoding, with
`jax.profiler`, then sums the custom calls' time per (kernel, output shape), read from the compiled
HLO: which products, attention calls and heads' products make the tree step dearer than the plain
one (docs/performance.md, issue 13 third pass). Also prints XLA's own ops outside the kernels.

    .venv/bin/python scripts/step_profile.py [--cache-size 256] [--prompt-tokens 100] [--weights as-stored]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from medusa_jax.convert.load import load_model
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.tree import PLAIN_TREE
from medusa_jax.models.layout import decoding_params
from medusa_jax.resolve import resolve_heads
from medusa_jax.tuning import cost

_CALL = re.compile(r'(ffi_call\.\d+) = (\S+) custom-call\(.*?custom_call_target="(\w+)"')


def profile(fn, args, calls: int, steps: int) -> tuple:
    """(ms per step per (kernel, output shape), ms per step of XLA's other ops by fusion kind)."""
    kinds = {m.group(1): (m.group(3), m.group(2)) for m in map(_CALL.search, fn.as_text().splitlines()) if m}
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    kernels, other = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or "dur" not in e or name.startswith(("$", "Thunk", "Pjit", "Common", "end:")):
            continue
        if name in kinds:
            kernels[kinds[name]] += e["dur"] / 1e3 / (calls * steps)
        elif name.split(".")[0] != "while":
            other[re.sub(r"[.\d]+$", "", name)] += e["dur"] / 1e3 / (calls * steps)
    return kernels, other


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-size", type=int, default=256, help="KV cache slots")
    p.add_argument("--prompt-tokens", type=int, default=100, help="length of the prefilled prompt")
    p.add_argument("--steps", type=int, default=8, help="steps per traced call")
    p.add_argument("--weights", choices=("float32", "as-stored"), default="float32",
                   help="the GGUF's weights dequantized at load, or kept as its blocks (the block kernels)")
    args = p.parse_args()
    model = load_model(weights=args.weights)
    heads, tree, _ = resolve_heads(model, None)
    params = decoding_params(model.params)
    state = start_state(model.cfg, params, [list(range(100, 100 + args.prompt_tokens))], args.cache_size,
                        progress=False)
    for name, tr in (("plain", PLAIN_TREE), (f"{tree.size}-node tree", tree)):
        hc, hp = cost.prepared_heads(model.cfg, params, heads, tr) if tr.size > 1 else (None, None)
        call_args = (params, hp, state)
        fn = aot(cost.run_steps, (model.cfg, hc, tr, args.steps), call_args)
        kernels, other = profile(fn, call_args, 3, args.steps)
        print(f"{name}: kernels {sum(kernels.values()):.2f} ms/step, XLA's other ops {sum(other.values()):.2f}")
        for (target, shape), ms in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {ms:7.3f} ms  {target} -> {shape}")


if __name__ == "__main__":
    main()
