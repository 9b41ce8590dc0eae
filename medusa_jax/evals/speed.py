"""Side-by-side speed: plain greedy vs Medusa greedy (and optionally transformers' generate).

``medusa-bench --prompts data/Spec-Bench_question.jsonl --limit 120 --hf``

For every prompt (first turn, chat template applied) the decoders run in the same process on the
same prompt ids, interleaved (the order rotates from prompt to prompt), after an untimed warm-up of
every decoder on the first prompt with the full token budget: plain greedy and Medusa greedy both
as one fully jitted on-device loop (`generate_device`; no host sync per step, compilation never
timed), and with ``--hf`` transformers' greedy ``generate`` on the same weights (float32, its
default attention, torch limited to ``--torch-threads`` intra-op threads). Every decoder gets the
same ``--max-new-tokens`` and the same EOS ids, and only generated tokens count.

What is measured (the same way for every decoder):

- **decode tokens/s** = total tokens emitted after the prompt's forward pass / total seconds from
  the end of that forward pass to the last token, summed over the prompts. Prefill is excluded on
  both sides: ours picks the first new token from the prefill's logits inside the decode loop, so
  all n new tokens fall in its decode window; transformers' ``generate`` picks the first new token
  in its prefill step, so its window (from the first streamed token to the return of ``generate``)
  holds n - 1 tokens. Compilation of ours is excluded; transformers has none.
- **prefill seconds** of plain greedy and transformers, summed, are reported beside it.
- **identical**: Medusa against plain greedy must match token for token (a difference is checked
  for a float32 near-tie as in `medusa_jax.cli.check`; any other one fails the run). transformers'
  output is compared with plain greedy too and counted (``hf_identical``); its first difference
  and our top-2 logit gap there are recorded, but do not fail the run.

Why one torch thread by default: on a 2-core machine, torch's own default (one intra-op thread per
core) gives transformers no decode speed for this 135M model at batch 1, and whenever another
process takes a core, its OpenMP threads wait on each other at every operation and a ``generate``
call drops several-fold. Measured 2026-11-29 on a 2-core AMD EPYC VM (MT-bench, one prompt per
category, 64 new tokens, 24 interleaved calls each, every call tagged with the CPU time other
processes used meanwhile): on calls with the machine otherwise idle, 24.4 tok/s with 1 thread and
24.3 with 2; on calls during which another process used one core, 23-25 tok/s with 1 thread and
1.3-8 with 2 (5 idle calls each; our plain greedy: 62 idle, 38-51 loaded). A run in which some calls overlap other
work therefore understates transformers and overstates plain / transformers; the 2.29x of an
earlier run, which did not reproduce (docs/performance.md), fits that.

Sampling (``--temperature > 0``): plain sampling against Medusa sampling (``--acceptance exact``,
the default, or ``typical``), prompt i with seed ``--seed + i``; outputs are not compared (the two
draw different random numbers), and the figures are tokens/s and tokens per step.

Batches (``--batch-size 4,16``): after the batch-1 runs, plain and Medusa each decode all prompts
through `generate_batch` (continuous batching) at every listed size, after an untimed warm-up on
the first prompts. Throughput there is total new tokens / total wall seconds with prefills
included (at batch 1: each prompt's prefill plus decode seconds), and greedy rows must equal plain
greedy's batch-1 output (near-tie rule as in check; any other difference fails the run).

Reported per category and overall: tokens/s of each decoder, the speedups (Medusa / plain, plain /
transformers), tokens per step and the acceptance rate per depth (the fraction of steps that
accepted at least d candidates). Writes ``results.json`` (with the run's conditions: torch threads,
versions, load average before and after), ``results.md`` and ``speed.png`` to --out. Speed figures
follow Spec-Bench (Xia et al. 2024): wall-clock speedup over the same model's greedy decoding, and
mean accepted tokens per step.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.engine.generate import generate_batch, generate_device
from medusa_jax.evals.lossless import compare


def time_jit_generate(cfg, params, heads, tree, ids: List[int], max_new_tokens: int, eos, acceptance=None,
                      seed: int = 0, progress: bool = True) -> dict:
    """One fully on-device generation (`generate_device`; compilation never timed).

    acceptance: a `decoding.acceptance.Acceptance` (default greedy); seed: the sampling seed; progress: a
    progress bar for a long prefill.
    Returns {"tokens": list, "seconds": float (decode only: all new tokens), "prefill_s": float,
    "steps": int, "hist": list}.
    """

    r = generate_device(cfg, params, [ids], max_new_tokens=max_new_tokens, heads=heads, tree=tree,
                        eos_token_ids=eos, acceptance=acceptance or Acceptance(), seed=seed, progress=progress)
    n = int(r.count[0])
    return {"tokens": r.tokens[0, :n].tolist(), "seconds": r.decode_s, "prefill_s": r.prefill_s,
            "steps": r.steps, "hist": r.hist.tolist()}


def time_batch_generate(cfg, params, heads, tree, prompts: List[List[int]], batch_size: int, max_new_tokens: int,
                        eos, acceptance=None, seed: int = 0) -> dict:
    """All prompts through `generate_batch` (continuous batching, `batch_size` rows; compilation
    never timed; prompt i samples with seed + i, as at batch 1).

    Returns {"tokens": [list per prompt, input order], "seconds": float (wall, prefills included),
    "steps": [per prompt], "hist": list}.
    """

    gen = generate_batch(cfg, params, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens, heads=heads,
                         tree=tree, acceptance=acceptance or Acceptance(), seed=seed, eos_token_ids=eos,
                         progress=False)
    tokens: List[Optional[list]] = [None] * len(prompts)
    steps = [0] * len(prompts)
    while True:
        try:
            i, res = next(gen)
        except StopIteration as stop:
            stats = stop.value
            break
        tokens[i], steps[i] = res.tokens, res.steps
    return {"tokens": tokens, "seconds": stats.wall_s, "steps": steps, "hist": stats.hist.tolist()}


class TokenClock:
    """A transformers ``generate`` streamer that only notes when each ``put`` arrives.

    ``generate`` calls ``put`` once with the prompt before its prefill, then once per new token
    (the first right after the prefill step); `first_token_s` is the time of that second call.
    clock: the timer (seconds; `time.perf_counter` by default).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.times: List[float] = []

    def put(self, value) -> None:
        self.times.append(self.clock())

    def end(self) -> None:
        pass

    @property
    def first_token_s(self) -> float:
        """When the first new token was streamed. Raises RuntimeError if none was."""
        if len(self.times) < 2:
            raise RuntimeError(f"transformers' generate streamed {len(self.times)} time(s); expected the prompt "
                               "and then each new token (has its streamer protocol changed?)")
        return self.times[1]


def time_hf_generate(hf_model, ids: List[int], max_new_tokens: int, eos: Sequence[int]) -> dict:
    """transformers' greedy ``generate`` on the same prompt ids, timed like ours.

    eos: the ids that end the output (the same as ours; empty: none, whatever the model's
    generation_config says).

    Returns {"tokens": list (all new tokens, EOS included), "prefill_s": float (from the call to the
    first new token), "seconds": float (decode only: from the first new token to the return),
    "decode_tokens": int (new tokens emitted in that window: all but the first)}.
    """
    import torch

    eos = list(eos)
    clock = TokenClock()
    with torch.no_grad():
        t0 = time.perf_counter()
        # eos_token_id=None (no EOS ids) overrides the model's generation_config, as ours does
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=eos or None, pad_token_id=eos[0] if eos else None, streamer=clock)
        t1 = time.perf_counter()
    tokens = out[0, len(ids):].tolist()
    return {"tokens": tokens, "prefill_s": clock.first_token_s - t0, "seconds": t1 - clock.first_token_s,
            "decode_tokens": len(tokens) - 1}


def load_hf_peer(path: str, torch_threads: int):
    """transformers' float32 model of the same weights (HF directory or GGUF file; local files only),
    in eval mode, with torch's intra-op threads set to `torch_threads`.

    Raises ValueError for torch_threads < 1; ImportError (with the install hint) without torch.
    """
    if torch_threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {torch_threads}")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(f"--hf needs torch ({e}); install the test extra: pip install -e '.[test]'") from e
    torch.set_num_threads(torch_threads)
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                                     gguf_file=os.path.basename(path), local_files_only=True)
    return model.eval()


def rate(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """Tokens per second over several prompts: total tokens / total seconds (not a mean of rates).

    Raises ValueError when the seconds sum to zero or less."""
    total_s = float(np.sum(seconds))
    if total_s <= 0:
        raise ValueError(f"total time {total_s} s: nothing was timed")
    return float(np.sum(tokens)) / total_s


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
    """Per-category and overall totals; every tokens/s is `rate` (total tokens / total seconds).

    rows: one dict per prompt, as `main` writes them: category, new_tokens, plain_s, medusa_s
      (decode seconds), medusa_steps, hist, identical, near_tie; optionally plain_prefill_s; with
      ``--hf`` also hf_decode_tokens, hf_s (decode seconds), hf_prefill_s, hf_identical; with
      ``--compare-weights`` also ref_tokens, ref_s (plain greedy on the other weights), ref_prefill_s,
      ref_identical.
    Returns {category or "all" / "overall": figures}; the transformers figures (hf_tok_s,
    plain_vs_hf, hf_identical, hf_prefill_s) and the other weights' (ref_tok_s, plain_vs_ref,
    medusa_vs_ref, ref_identical, ref_prefill_s) only where every row has them.
    """
    groups: Dict[str, List[dict]] = defaultdict(list)
    for r in rows:
        groups[r["category"] or "all"].append(r)
        if r["category"]:
            groups["overall"].append(r)
    out = {}
    for name, rs in groups.items():
        tok = [r["new_tokens"] for r in rs]
        med_tok = [r.get("medusa_new_tokens", r["new_tokens"]) for r in rs]  # they differ only when sampling
        steps = sum(r["medusa_steps"] for r in rs)
        hist = np.sum([r["hist"] for r in rs], axis=0)
        at_least = [float(hist[d:].sum() / max(hist.sum(), 1)) for d in range(1, depth + 1)]
        plain_rate, med_rate = rate(tok, [r["plain_s"] for r in rs]), rate(med_tok, [r["medusa_s"] for r in rs])
        s = {"prompts": len(rs), "new_tokens": sum(tok), "plain_tok_s": plain_rate,
             "medusa_tok_s": med_rate, "speedup": med_rate / plain_rate,
             "tokens_per_step": sum(med_tok) / max(steps, 1), "acceptance_per_depth": at_least,
             "identical": sum(r["identical"] for r in rs), "near_ties": sum(r["near_tie"] for r in rs)}
        if all("plain_prefill_s" in r for r in rs):
            s["plain_prefill_s"] = sum(r["plain_prefill_s"] for r in rs)
        if all("hf_s" in r for r in rs):
            s["hf_tok_s"] = rate([r["hf_decode_tokens"] for r in rs], [r["hf_s"] for r in rs])
            s["plain_vs_hf"] = s["plain_tok_s"] / s["hf_tok_s"]
            s["hf_identical"] = sum(r["hf_identical"] for r in rs)
            s["hf_prefill_s"] = sum(r["hf_prefill_s"] for r in rs)
        if all("ref_s" in r for r in rs):
            s["ref_tok_s"] = rate([r["ref_tokens"] for r in rs], [r["ref_s"] for r in rs])
            s["plain_vs_ref"] = s["plain_tok_s"] / s["ref_tok_s"]
            s["medusa_vs_ref"] = s["medusa_tok_s"] / s["ref_tok_s"]
            s["ref_identical"] = sum(r["ref_identical"] for r in rs)
            s["ref_prefill_s"] = sum(r["ref_prefill_s"] for r in rs)
        out[name] = s
    return out


def markdown_table(summary: Dict[str, dict]) -> str:
    """The summary as a markdown table, "overall" last (transformers' columns, and those of plain
    greedy on the other weights, when every group has them)."""
    has_hf = all("hf_tok_s" in s for s in summary.values())
    has_ref = all("ref_tok_s" in s for s in summary.values())
    head = "| category | prompts | plain tok/s | Medusa tok/s | speedup | tokens/step |"
    sep = "|---|---|---|---|---|---|"
    if has_hf:
        head += " transformers tok/s | plain / transformers | identical to transformers |"
        sep += "---|---|---|"
    if has_ref:
        head += " plain tok/s, other weights | plain / other | Medusa / other | identical to other |"
        sep += "---|---|---|---|"
    lines = [head, sep]
    for name in sorted(summary, key=lambda n: (n == "overall", n)):
        s = summary[name]
        line = (f"| {name} | {s['prompts']} | {s['plain_tok_s']:.1f} | {s['medusa_tok_s']:.1f} | "
                f"{s['speedup']:.2f}x | {s['tokens_per_step']:.2f} |")
        if has_hf:
            line += f" {s['hf_tok_s']:.1f} | {s['plain_vs_hf']:.2f}x | {s['hf_identical']}/{s['prompts']} |"
        if has_ref:
            line += (f" {s['ref_tok_s']:.1f} | {s['plain_vs_ref']:.2f}x | {s['medusa_vs_ref']:.2f}x | "
                     f"{s['ref_identical']}/{s['prompts']} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def batched(cfg, params, heads, tree, prompts: List[List[int]], reference: List[List[int]], rows: List[dict],
            batch_size: int, max_new_tokens: int, eos, acceptance: Dict[str, object], seed: int, greedy: bool) -> dict:
    """Plain and Medusa over all prompts at `batch_size` (`time_batch_generate`), against the batch-1
    runs in `rows`: throughput, prefill included on both sides (batch 1: the sum of each prompt's
    prefill and decode seconds), tokens per step, and with `greedy` every row compared with the
    batch-1 plain greedy output `reference` (`evals.lossless.compare`, near-tie rule). Each decoder first
    runs untimed on the first `batch_size` prompts."""

    out: dict = {"batch_size": batch_size}
    for name, h, tr in (("plain", None, None), ("medusa", heads, tree)):
        # untimed warm-up on the first batch_size prompts: the first run of an executable costs extra
        time_batch_generate(cfg, params, h, tr, prompts[:batch_size], batch_size, max_new_tokens, eos,
                            acceptance[name], seed)
        r = time_batch_generate(cfg, params, h, tr, prompts, batch_size, max_new_tokens, eos, acceptance[name], seed)
        tok = sum(len(t) for t in r["tokens"])
        one_tok = sum(row["new_tokens"] if name == "plain" else row["medusa_new_tokens"] for row in rows)
        one_s = sum(row[f"{name}_s"] + row[f"{name}_prefill_s"] for row in rows)
        one_steps = sum(row["medusa_steps"] for row in rows) if name == "medusa" else one_tok
        d = {"tokens": tok, "seconds": r["seconds"], "tok_s": tok / r["seconds"], "batch1_tok_s": one_tok / one_s,
             "batch1_tokens_per_step": one_tok / max(one_steps, 1), "tokens_per_step": tok / max(sum(r["steps"]), 1)}
        if greedy:
            cs = [compare(cfg, params, ids, ref, t) for ids, ref, t in zip(prompts, reference, r["tokens"])]
            d.update(identical=sum(c.identical for c in cs), near_ties=sum(c.near_tie for c in cs),
                     other_differences=sum(not c.identical and not c.near_tie for c in cs))
        out[name] = d
    return out


def batch_table(batches: List[dict]) -> str:
    """`batched`'s figures (one dict per batch size) as a markdown table, batch 1 first."""
    lines = ["| decoder | batch | tok/s (prefill included) | vs batch 1 | tokens/step |", "|---|---|---|---|---|"]
    for name in ("plain", "medusa"):
        one = batches[0][name]["batch1_tok_s"]
        one_tps = batches[0][name].get("batch1_tokens_per_step")
        lines.append(f"| {name} | 1 | {one:.1f} | 1.00x | " + (f"{one_tps:.2f} |" if one_tps else "1.00 |"))
        for b in batches:
            d = b[name]
            lines.append(f"| {name} | {b['batch_size']} | {d['tok_s']:.1f} | {d['tok_s'] / one:.2f}x | "
                         f"{d['tokens_per_step']:.2f} |")
    ratios = [f"batch 1 {batches[0]['medusa']['batch1_tok_s'] / batches[0]['plain']['batch1_tok_s']:.2f}x"]
    ratios += [f"batch {b['batch_size']} {b['medusa']['tok_s'] / b['plain']['tok_s']:.2f}x" for b in batches]
    return "\n".join(lines) + ("\n\nthroughput: total new tokens / total seconds, prefill included; Medusa / plain: "
                               + ", ".join(ratios) + "\n")


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


def run_conditions(torch_threads: Optional[int]) -> dict:
    """What the figures depend on besides the code: versions, cores, torch threads, load average."""

    cond = {"jax": jax.__version__, "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if torch_threads is not None:
        cond.update(torch=md.version("torch"), transformers=md.version("transformers"), torch_threads=torch_threads)
    return cond
