"""medusa_jax against llama.cpp on the same GGUF file and the same prompt ids, interleaved (issue 32).

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36   # its own venv
    .venv/bin/python scripts/llama_cpp_side_by_side.py --llama-python /tmp/llvenv/bin/python \\
        --prompts data/Spec-Bench_question.jsonl --per-category 4

llama.cpp (through llama-cpp-python) runs in a worker process started with ``--llama-python``, a
Python whose environment has llama-cpp-python; it is never a dependency of this project. Every
prompt (first turn, our chat template applied) is decoded greedily by four decoders, in an order
that rotates from prompt to prompt: our plain greedy and Medusa (shipped heads and tree, prompt
lookup on) with ``--weights`` (default as-stored: the file's own Q4_1 / Q8_0 blocks), and
llama.cpp's plain greedy and its prompt-lookup speculation (``LlamaPromptLookupDecoding``), both
with ``--threads`` threads on the file's own weights. Everyone gets the same token ids, the same
EOS ids and ``--max-new-tokens``. Decode tokens/s excludes prefill for everyone: ours counts the n
tokens emitted after the prompt's forward pass over the seconds after it; llama.cpp's the n - 1
tokens after its first one over the seconds after it (its first token comes out of the prefill).
Prints a table and one JSON line; every output is compared with our plain greedy (llama.cpp rounds
its activations to 8 bits for quantized products, so its answers may differ).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path, threads, lookup_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(draft):
    return Llama(model_path=path, n_ctx=8192, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False, draft_model=draft)
models = {"plain": load(None), "lookup": load(LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens))}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    llm = models[req["kind"]]
    llm.reset()
    eos, out, t_first = set(req["eos"]), [], None
    t0 = time.perf_counter()
    try:
        for tok in llm.generate(req["ids"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(tok))
            if tok in eos or len(out) >= req["max_new"]:
                break
    except Exception as e:  # reported, and the prompt left out of the llama.cpp figures
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        continue
    t_end = time.perf_counter()
    print(json.dumps({"tokens": out, "prefill_s": t_first - t0, "seconds": t_end - t_first}), flush=True)
"""


class LlamaCpp:
    """The llama.cpp worker process: ``run(kind, ids, max_new, eos)`` -> {tokens, prefill_s, seconds}."""

    def __init__(self, python: str, path: str, threads: int, lookup_tokens: int):
        self.proc = subprocess.Popen([python, "-c", WORKER, path, str(threads), str(lookup_tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the llama.cpp worker ({python}) did not start; does it have llama-cpp-python?")

    def run(self, kind: str, ids, max_new: int, eos) -> dict:
        self.proc.stdin.write(json.dumps({"kind": kind, "ids": list(ids), "max_new": max_new, "eos": list(eos)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    p.add_argument("--prompts", required=True, help="MT-bench / Spec-Bench JSONL (first turns)")
    p.add_argument("--per-category", type=int, default=4, help="prompts per Spec-Bench category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp prompt lookup: tokens drafted per step")
    p.add_argument("--no-llama-lookup", action="store_true",
                   help="leave llama.cpp's prompt lookup out (llama-cpp-python 0.3.36's fails on long prompts, "
                        "which then drops those prompts from every figure)")
    p.add_argument("--weights", default="as-stored", choices=("as-stored", "float32"), help="ours")
    p.add_argument("--out", default=None, help="also write every row as JSON here")
    args = p.parse_args()

    from medusa_jax.chat import apply_chat_template, load_first_turns
    from medusa_jax.cli import common
    from medusa_jax.evals.speed import per_category, spec_bench_groups, time_jit_generate

    records = per_category(spec_bench_groups(load_first_turns(args.prompts, None)), args.per_category)
    ns = argparse.Namespace(model=None, heads=None, tree=None, dtype="float32", weights=args.weights,
                            prompt_lookup=None, mesh=None)
    model, heads, tree, _, _ = common.setup_decoding(ns, progress=False)
    cfg, params, eos = model.cfg, model.params, model.cfg.eos_token_ids
    llama = LlamaCpp(args.llama_python, model.path, args.threads, args.lookup_tokens)
    from medusa_jax.decoding.acceptance import Acceptance
    greedy = Acceptance()
    ours = {"plain": lambda ids: time_jit_generate(cfg, params, None, None, ids, args.max_new_tokens, eos, greedy, 0),
            "medusa": lambda ids: time_jit_generate(cfg, params, heads, tree, ids, args.max_new_tokens, eos, greedy, 0)}
    decoders = {**ours, "llama_plain": lambda ids: llama.run("plain", ids, args.max_new_tokens, eos)}
    if not args.no_llama_lookup:
        decoders["llama_lookup"] = lambda ids: llama.run("lookup", ids, args.max_new_tokens, eos)
    prompts = [apply_chat_template(model.tokenizer, r["prompt"]) for r in records]
    for run in decoders.values():  # untimed warm-up (compilation, first-call costs)
        run(prompts[0])
    names, rows, skipped = list(decoders), [], []
    t_start = time.time()
    for i, (rec, ids) in enumerate(zip(records, prompts)):
        k = i % len(names)
        res = {n: decoders[n](ids) for n in names[k:] + names[:k]}
        row = {"id": rec.get("id"), "category": rec.get("category"), "prompt_tokens": len(ids)}
        failed = [n for n, r in res.items() if "error" in r]
        if failed:  # llama.cpp could not decode this prompt: left out of every figure
            print(f"{i + 1}/{len(records)}: left out, {failed}: {[res[n]['error'] for n in failed]}", file=sys.stderr)
            skipped.append({"id": rec.get("id"), "errors": {n: res[n]["error"] for n in failed}})
            continue
        for n, r in res.items():
            tokens = [int(t) for t in r["tokens"]]
            decoded = len(tokens) - (1 if n.startswith("llama") else 0)  # llama.cpp's first token is the prefill's
            row[n] = {"tokens": len(tokens), "decode_tokens": decoded, "seconds": r["seconds"],
                      "prefill_s": r["prefill_s"], "same_as_plain": tokens == [int(t) for t in res["plain"]["tokens"]]}
        rows.append(row)
        print(f"{i + 1}/{len(records)} {rec.get('category')}: "
              + ", ".join(f"{n} {row[n]['decode_tokens'] / max(row[n]['seconds'], 1e-9):.1f} tok/s" for n in names),
              file=sys.stderr, flush=True)
    llama.close()
    tok_s = {n: sum(r[n]["decode_tokens"] for r in rows) / sum(r[n]["seconds"] for r in rows) for n in names}
    same = {n: sum(r[n]["same_as_plain"] for r in rows) for n in names}
    prefill = {n: sum(r[n]["prefill_s"] for r in rows) for n in names}
    print("| decoder | decode tok/s | / llama.cpp plain | prefill s (sum) | same tokens as our plain |")
    print("|---|---:|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {tok_s[n]:.1f} | {tok_s[n] / tok_s['llama_plain']:.2f}x | {prefill[n]:.2f} | "
              f"{same[n]}/{len(rows)} |")
    summary = {"prompts": len(rows), "weights": args.weights, "threads": args.threads, "tok_s": tok_s,
               "same_as_plain": same, "prefill_s": prefill, "wall_s": time.time() - t_start,
               "tree_size": tree.size, "prompt_lookup": tree.lookup_settings, "left_out": skipped}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
