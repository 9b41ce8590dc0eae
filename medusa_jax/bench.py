"""Side-by-side speed: plain greedy vs Medusa greedy (and optionally transformers' generate).

``python -m medusa_jax.bench --prompts ../shared/data/Spec-Bench_question.jsonl --limit 120 --hf``

For every prompt (first turn, chat template applied) the decoders run in the same process,
interleaved, after a warm-up that compiles every shape: plain greedy and Medusa greedy both as one
fully jitted on-device loop (`generate_jit`; no host sync per step), transformers' greedy
``generate`` on the same weights with ``--hf``. Both of ours must give identical tokens; a difference
is checked for a float32 near-tie as in `medusa_jax.check`. Reported per category and overall:
tokens/s of each, the speedup (Medusa / plain, and plain / transformers), tokens per step and the
acceptance rate per depth (the fraction of steps that accepted at least d candidates). Writes
``results.json``, ``results.md`` and ``speed.png`` to --out. Speed figures follow Spec-Bench
(Xia et al. 2024): wall-clock speedup over the same model's greedy decoding, and mean accepted
tokens per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Dict, List

import jax
import numpy as np


def time_jit_generate(cfg, params, heads, tree, ids: List[int], max_new_tokens: int, eos) -> dict:
    """One fully on-device generation (`generate_device`; compilation never timed).

    Returns {"tokens": list, "seconds": float (decode only), "prefill_s", "steps", "hist": list}.
    """
    from .generate import generate_device

    r = generate_device(cfg, params, [ids], max_new_tokens=max_new_tokens, heads=heads, tree=tree,
                        eos_token_ids=eos)
    n = int(r.count[0])
    return {"tokens": r.tokens[0, :n].tolist(), "seconds": r.decode_s, "prefill_s": r.prefill_s,
            "steps": r.steps, "hist": r.hist.tolist()}


def time_hf_generate(hf_model, ids: List[int], max_new_tokens: int, eos) -> dict:
    """transformers' greedy generate on the same prompt; seconds include its prefill."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=list(eos), pad_token_id=list(eos)[0])
        dt = time.perf_counter() - t0
    return {"tokens": out[0, len(ids):].tolist(), "seconds": dt}


#: MT-bench's eight categories; in Spec-Bench they are one task, "multi-turn conversation".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def spec_bench_groups(records: List[dict]) -> List[dict]:
    """Spec-Bench's six tasks: when the file has other tasks too (translation, summarization, qa,
    math_reasoning, rag), its MT-bench questions become category "mt_bench" (the original
    category is kept as "subcategory"). MT-bench alone keeps its eight categories."""
    cats = {r["category"] for r in records}
    if not cats - set(MT_BENCH_CATEGORIES) - {""} or not cats & set(MT_BENCH_CATEGORIES):
        return records
    return [{**r, "category": "mt_bench", "subcategory": r["category"]} if r["category"] in MT_BENCH_CATEGORIES
            else r for r in records]


def per_category(records: List[dict], n: int) -> List[dict]:
    """n prompts of every category, evenly spaced over that category's prompts (file order kept)."""
    groups: Dict[str, List[int]] = defaultdict(list)
    for i, r in enumerate(records):
        groups[r["category"]].append(i)
    keep = set()
    for idx in groups.values():
        m = min(n, len(idx))
        keep.update(idx[int(j * len(idx) / m)] for j in range(m))
    return [r for i, r in enumerate(records) if i in keep]


def summarize(rows: List[dict], depth: int) -> Dict[str, dict]:
    """Per-category and overall totals: tokens/s = total tokens / total seconds."""
    groups: Dict[str, List[dict]] = defaultdict(list)
    for r in rows:
        groups[r["category"] or "all"].append(r)
        if r["category"]:
            groups["overall"].append(r)
    out = {}
    for name, rs in groups.items():
        tok = sum(r["new_tokens"] for r in rs)
        plain_s = sum(r["plain_s"] for r in rs)
        med_s = sum(r["medusa_s"] for r in rs)
        steps = sum(r["medusa_steps"] for r in rs)
        hist = np.sum([r["hist"] for r in rs], axis=0)
        at_least = [float(hist[d:].sum() / max(hist.sum(), 1)) for d in range(1, depth + 1)]
        s = {"prompts": len(rs), "new_tokens": tok, "plain_tok_s": tok / plain_s, "medusa_tok_s": tok / med_s,
             "speedup": plain_s / med_s, "tokens_per_step": tok / max(steps, 1),
             "acceptance_per_depth": at_least,
             "identical": sum(r["identical"] for r in rs), "near_ties": sum(r["near_tie"] for r in rs)}
        if all("hf_s" in r for r in rs):
            hf_tok = sum(r["hf_tokens"] for r in rs)
            s["hf_tok_s"] = hf_tok / sum(r["hf_s"] for r in rs)
            s["plain_vs_hf"] = s["plain_tok_s"] / s["hf_tok_s"]
        out[name] = s
    return out


def markdown_table(summary: Dict[str, dict]) -> str:
    has_hf = all("hf_tok_s" in s for s in summary.values())
    head = "| category | prompts | plain tok/s | Medusa tok/s | speedup | tokens/step |"
    sep = "|---|---|---|---|---|---|"
    if has_hf:
        head += " transformers tok/s | plain / transformers |"
        sep += "---|---|"
    lines = [head, sep]
    for name in sorted(summary, key=lambda n: (n == "overall", n)):
        s = summary[name]
        line = (f"| {name} | {s['prompts']} | {s['plain_tok_s']:.1f} | {s['medusa_tok_s']:.1f} | "
                f"{s['speedup']:.2f}x | {s['tokens_per_step']:.2f} |")
        if has_hf:
            line += f" {s['hf_tok_s']:.1f} | {s['plain_vs_hf']:.2f}x |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(summary: Dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(summary, key=lambda n: (n == "overall", n))
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    ax.bar(x - 0.2, [summary[n]["plain_tok_s"] for n in names], 0.4, label="plain greedy")
    ax.bar(x + 0.2, [summary[n]["medusa_tok_s"] for n in names], 0.4, label="Medusa greedy")
    for i, n in enumerate(names):
        ax.text(i + 0.2, summary[n]["medusa_tok_s"], f"{summary[n]['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    from .cli_help import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m medusa_jax.bench",
                                description="Plain vs Medusa greedy speed, side by side (see module docs).",
                                formatter_class=HelpFormatter)
    p.add_argument("--prompts", required=True, help="MT-bench / Spec-Bench JSONL (first turns are used)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (default: all)")
    p.add_argument("--per-category", type=int, default=None,
                   help="take N prompts of every category, evenly spaced, instead of --limit (Spec-Bench: its "
                        "six tasks, MT-bench's questions counting as one)")
    p.add_argument("--out", default="bench_out", help="directory for results.json, results.md, speed.png")
    p.add_argument("--hf", action="store_true", help="also time transformers' greedy generate (the peer)")
    p.add_argument("--model", default=None, help="HF directory or GGUF (default: SmolLM2 GGUF)")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped heads); 'zero' for fresh heads")
    p.add_argument("--tree", default=None, help="tree preset or file (default: the heads' tree)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    args = p.parse_args(argv)

    from tqdm import tqdm

    from . import runtime
    from .check import compare, load_first_turns
    from .loading import apply_chat_template, load_model

    runtime.enable_compilation_cache()
    model = load_model(args.model)
    cfg, params = model.cfg, model.params
    heads, tree, note = runtime.resolve_heads(model, args.heads, args.tree, zero_heads=4)
    if heads is None:
        print(f"error: {note}", file=sys.stderr)
        return 2
    records = load_first_turns(args.prompts, None if args.per_category else args.limit)
    records = spec_bench_groups(records)
    if args.per_category:
        records = per_category(records, args.per_category)
    hf_model = None
    if args.hf:
        import torch
        from transformers import AutoModelForCausalLM
        if os.path.isdir(model.path):
            hf_model = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32, local_files_only=True)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model.path), dtype=torch.float32,
                                                            gguf_file=os.path.basename(model.path),
                                                            local_files_only=True)
        hf_model.eval()
    eos = cfg.eos_token_ids
    prompts = [apply_chat_template(model.tokenizer, r["prompt"]) for r in records]
    # warm-up (compilation is always outside the timed region, see `_aot`; this also settles caches)
    time_jit_generate(cfg, params, None, None, prompts[0], args.max_new_tokens, eos)
    time_jit_generate(cfg, params, heads, tree, prompts[0], args.max_new_tokens, eos)
    if hf_model is not None:
        time_hf_generate(hf_model, prompts[0], 8, eos)
    rows = []
    for rec, ids in tqdm(list(zip(records, prompts)), desc="bench", unit="prompt"):
        plain = time_jit_generate(cfg, params, None, None, ids, args.max_new_tokens, eos)
        med = time_jit_generate(cfg, params, heads, tree, ids, args.max_new_tokens, eos)
        c = compare(cfg, params, ids, plain["tokens"], med["tokens"])
        row = {**rec, "new_tokens": len(plain["tokens"]), "plain_s": plain["seconds"], "medusa_s": med["seconds"],
               "medusa_steps": med["steps"], "hist": med["hist"], "identical": c.identical,
               "near_tie": c.near_tie, "first_diff": c.first_diff, "gap": c.gap}
        if hf_model is not None:
            hf = time_hf_generate(hf_model, ids, args.max_new_tokens, eos)
            row.update(hf_s=hf["seconds"], hf_tokens=len(hf["tokens"]), hf_identical=hf["tokens"] == plain["tokens"])
        rows.append(row)
    summary = summarize(rows, tree.max_depth)
    predicted = runtime.predicted_tokens_per_step(tree, runtime.heads_calibration(args.heads))
    overall = summary.get("overall", summary.get("all"))
    tps_line = (f"tokens/step: measured {overall['tokens_per_step']:.3f}, predicted "
                + (f"{predicted:.3f} (calibrated rank accuracies, independent heads)" if predicted else "n/a (heads not tuned)")
                + f"; tree of {tree.size} tokens; acceptance per depth "
                + " ".join(f"{a:.3f}" for a in overall["acceptance_per_depth"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"summary": summary, "tree": [list(c) for c in tree.medusa_choices],
                   "predicted_tokens_per_step": predicted, "rows": rows}, f, indent=1)
    table = markdown_table(summary) + "\n" + tps_line + "\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(summary, os.path.join(args.out, "speed.png"))
    print(table)
    bugs = sum(1 for r in rows if not r["identical"] and not r["near_tie"])
    print(f"identical {sum(r['identical'] for r in rows)}/{len(rows)}, near-ties "
          f"{sum(r['near_tie'] for r in rows)}, other differences {bugs}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
