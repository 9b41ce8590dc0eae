"""``medusa-bench``: plain greedy vs Medusa greedy speed, side by side (and optionally transformers'
generate).

``medusa-bench --prompts data/Spec-Bench_question.jsonl --per-category 20 --hf``

What is measured, and how, is `medusa_jax.evals.speed`'s docstring; this module parses the flags,
runs the decoders prompt by prompt, interleaved, and writes ``results.json``, ``results.md`` and
``speed.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

from medusa_jax.cli import interruptible
from medusa_jax.evals.speed import (
    batch_table,
    batched,
    load_hf_peer,
    markdown_table,
    per_category,
    plot,
    run_conditions,
    spec_bench_groups,
    summarize,
    time_hf_generate,
    time_jit_generate,
)


def _parser() -> argparse.ArgumentParser:
    """medusa-bench's flags."""
    from medusa_jax.cli import common
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(prog="medusa-bench",
                                description="Plain vs Medusa greedy speed, side by side (what is measured: medusa_jax.evals.speed).",
                                formatter_class=HelpFormatter)
    p.add_argument("--prompts", required=True, help="MT-bench / Spec-Bench JSONL (first turns are used)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N prompts (default: all); not with --per-category")
    p.add_argument("--per-category", type=int, default=None,
                   help="take N prompts of every category, evenly spaced, instead of --limit (Spec-Bench: its "
                        "six tasks, MT-bench's questions counting as one); not with --limit")
    p.add_argument("--out", default="bench_out",
                   help="directory for results.json, results.md, speed.png (created before the benchmark runs)")
    p.add_argument("--hf", action="store_true",
                   help="also time transformers' greedy generate on the same weights (the peer; needs torch)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads for --hf (on 2 cores, 2 threads were no faster than 1 and "
                        "stalled whenever another process took a core: see module docs)")
    p.add_argument("--model", default=None, help="HF directory or GGUF (default: SmolLM2 GGUF)")
    p.add_argument("--heads", default=None, help=common.heads_help())
    p.add_argument("--tree", default=None, help=common.TREE_HELP)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--batch-size", default="1", metavar="N[,N...]",
                   help="batch sizes > 1 (comma-separated): also decode all prompts N at a time (continuous batching, "
                        "`generate_batch`), plain and Medusa, and report throughput (tokens/s, prefill included) "
                        "against batch 1; greedy rows must equal plain greedy's batch-1 output (near-tie rule as in "
                        "check)")
    common.add_dtype_arg(p)
    p.add_argument("--compare-weights", choices=common.WEIGHTS, default=None,
                   help="also time plain greedy on a second copy of the model loaded with these --weights, "
                        "interleaved with the others (e.g. float32 beside the default as-stored GGUF blocks); its "
                        "output is compared with plain greedy's")
    common.add_mesh_arg(p)
    common.add_acceptance_args(p, temperature_help="0: greedy, Medusa checked against plain greedy; > 0: plain "
                                                    "sampling against Medusa sampling (no comparison of outputs)")
    common.add_lookup_arg(p)
    return p


def _checked_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Tuple[Any, List[int]]:
    """The flags' checks (`p.error`, exit 2, on a bad value), and what they give: the `Acceptance`
    and the batch sizes > 1 to time (sorted)."""
    from medusa_jax.cli import common

    acc = common.acceptance_from_args(p, args)
    batch_sizes = sorted(set(n for n in common.int_list(p, "--batch-size", args.batch_size) if n > 1))
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.per_category is not None and args.per_category < 1:
        p.error(f"--per-category must be >= 1, got {args.per_category}")
    if args.limit is not None and args.per_category is not None:
        p.error("--limit and --per-category both choose the prompts: give one or the other")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.hf and acc.mode != "greedy":
        p.error("--hf times transformers' greedy generate: use it at --temperature 0")
    if args.compare_weights and acc.mode != "greedy":
        p.error("--compare-weights times plain greedy decoding: use it at --temperature 0")
    if args.torch_threads < 1:
        p.error(f"--torch-threads must be >= 1, got {args.torch_threads}")
    if args.hf and importlib.util.find_spec("torch") is None:
        p.error("--hf needs torch, which comes with the test extra: pip install -e '.[test]'")
    return acc, batch_sizes


def _records(p: argparse.ArgumentParser, args: argparse.Namespace) -> List[dict]:
    """The prompts' records (first turns, Spec-Bench categories) that --prompts, --limit and
    --per-category choose; `p.error` (exit 2) on an unreadable or empty file."""
    from medusa_jax.chat import load_first_turns

    try:  # before the slow load
        records = load_first_turns(args.prompts, args.limit)
    except ValueError as e:
        p.error(f"--prompts {e}")
    records = spec_bench_groups(records)
    if args.per_category:
        records = per_category(records, args.per_category)
    if not records:
        p.error(f"--prompts {args.prompts}: no prompts in the file")
    return records


def _setup(args: argparse.Namespace):
    """(model, heads, tree, mesh, the heads' calibration) for the benchmark (`common.setup_decoding`,
    whose notes and the tree's speed note are printed on stderr); None, with the error on stderr,
    when the paths, heads, tree or mesh are wrong or there is nothing to compare with plain decoding."""
    from medusa_jax import resolve
    from medusa_jax.cli import common
    from medusa_jax.convert.load import weights_of

    try:  # paths, heads, tree and mesh are checked before the slow model load
        model, heads, tree, note, mesh = common.setup_decoding(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if tree is None:  # neither heads nor prompt lookup: nothing to compare with plain decoding
        print(f"error: {note}", file=sys.stderr)
        return None
    calibration = resolve.heads_calibration(args.heads, weights_of(model.params))
    for line in (note, resolve.speed_note(tree, calibration)
                 or resolve.untuned_note(args.heads, heads, tree, calibration, args.tree, args.model)):
        if line:
            print(f"note: {line}", file=sys.stderr)
    return model, heads, tree, mesh, calibration


def _decoders(args: argparse.Namespace, model, heads, tree, acc, plain_acc,
              hf_model) -> Tuple[Dict[str, Callable], Any]:
    """The timed decoders by name, each ``(prompt ids, seed) -> timings and tokens``: plain, Medusa,
    transformers' generate with --hf, and plain greedy on the --compare-weights copy of the model,
    which is loaded here. Returns (decoders, that copy or None)."""
    from medusa_jax.cli import common

    cfg, params, eos = model.cfg, model.params, model.cfg.eos_token_ids
    decoders = {"plain": lambda ids, seed: time_jit_generate(cfg, params, None, None, ids, args.max_new_tokens, eos,
                                                             plain_acc, seed),
                "medusa": lambda ids, seed: time_jit_generate(cfg, params, heads, tree, ids, args.max_new_tokens, eos,
                                                              acc, seed)}
    if hf_model is not None:
        decoders["hf"] = lambda ids, seed: time_hf_generate(hf_model, ids, args.max_new_tokens, eos)
    ref = None  # the same model on the other --weights
    if args.compare_weights:
        ref = common.load_backbone(args.model, args.heads, args.dtype, with_tokenizer=False, progress=False,
                                   weights=args.compare_weights)
        decoders["ref"] = lambda ids, seed: time_jit_generate(ref.cfg, ref.params, None, None, ids,
                                                              args.max_new_tokens, eos, plain_acc, seed)
    return decoders, ref


def _row(cfg, params, rec: dict, ids: List[int], res: dict, greedy: bool) -> dict:
    """One prompt's results row: its record, each decoder's timings and token counts, and how each
    output compares with plain greedy's (`evals.lossless.compare`; Medusa's only when greedy)."""
    from medusa_jax.evals.lossless import Comparison, compare

    plain, med = res["plain"], res["medusa"]
    c = compare(cfg, params, ids, plain["tokens"], med["tokens"]) if greedy else Comparison(identical=False)
    row = {**rec, "prompt_tokens": len(ids), "new_tokens": len(plain["tokens"]), "plain_s": plain["seconds"],
           "plain_prefill_s": plain["prefill_s"], "medusa_new_tokens": len(med["tokens"]),
           "medusa_prefill_s": med["prefill_s"], "medusa_s": med["seconds"], "medusa_steps": med["steps"],
           "hist": med["hist"], "identical": c.identical, "near_tie": c.near_tie, "first_diff": c.first_diff,
           "gap": c.gap}
    if "hf" in res:
        hf = res["hf"]
        h = compare(cfg, params, ids, plain["tokens"], hf["tokens"])
        row.update(hf_tokens=len(hf["tokens"]), hf_decode_tokens=hf["decode_tokens"], hf_s=hf["seconds"],
                   hf_prefill_s=hf["prefill_s"], hf_identical=h.identical, hf_first_diff=h.first_diff,
                   hf_gap=h.gap)
    if "ref" in res:
        r = res["ref"]
        w = compare(cfg, params, ids, plain["tokens"], r["tokens"])
        row.update(ref_tokens=len(r["tokens"]), ref_s=r["seconds"], ref_prefill_s=r["prefill_s"],
                   ref_identical=w.identical, ref_near_tie=w.near_tie)
    return row


def _run_prompts(args: argparse.Namespace, model, decoders: Dict[str, Callable], records: List[dict],
                 prompts: List[List[int]], greedy: bool) -> Tuple[List[dict], List[list]]:
    """Every prompt through every decoder, their order rotated prompt by prompt. Returns (the rows,
    `_row`; plain decoding's output tokens per prompt)."""
    from tqdm import tqdm

    from medusa_jax.decoding.sampling import prompt_seed

    names = list(decoders)
    rows, plain_outputs = [], []
    for i, (rec, ids) in enumerate(tqdm(list(zip(records, prompts)), desc="bench", unit="prompt")):
        k = i % len(names)  # rotate the order so that no decoder always runs first or last
        res = {name: decoders[name](ids, prompt_seed(args.seed, i)) for name in names[k:] + names[:k]}
        plain_outputs.append(res["plain"]["tokens"])
        rows.append(_row(model.cfg, model.params, rec, ids, res, greedy))
    return rows, plain_outputs


def _summary_lines(args: argparse.Namespace, overall: dict, tree, predicted, conditions: dict, ref,
                   hf_model) -> Tuple[str, str]:
    """The report's tokens-per-step line (measured against tune's prediction) and its timing line."""
    tps_line = (f"tokens/step: measured {overall['tokens_per_step']:.3f}, predicted "
                + (f"{predicted[0]:.3f} ({predicted[1]})" if predicted else "n/a (tune made no figure for this tree)")
                + f"; tree of {tree.size} tokens"
                + (f", prompt lookup {tree.lookup_settings}" if tree.lookup else ", no prompt lookup")
                + "; acceptance per depth "
                + " ".join(f"{a:.3f}" for a in overall["acceptance_per_depth"]))
    timing_line = ("tokens/s: decode only, total tokens emitted after the prompt's forward pass / total seconds "
                   f"after it (prefill excluded for every decoder); prefill over {overall['prompts']} prompts: "
                   f"plain {overall['plain_prefill_s']:.2f} s")
    if ref is not None:
        timing_line += (f", plain on {conditions['compare_weights']} weights {overall['ref_prefill_s']:.2f} s "
                        f"(these: {conditions['weights']})")
    if hf_model is not None:
        timing_line += (f", transformers {overall['hf_prefill_s']:.2f} s; transformers with "
                        f"{args.torch_threads} torch thread(s), {conditions['cpu_cores']} cores")
    return tps_line, timing_line


def _write_results(args: argparse.Namespace, acc, tree, rows: List[dict], batches: List[dict], conditions: dict,
                   calibration, ref, hf_model) -> None:
    """Writes results.json, results.md and speed.png into --out and prints the markdown report."""
    from medusa_jax import resolve

    summary = summarize(rows, tree.max_accepted)
    predicted = resolve.predicted_tokens_per_step(tree, calibration)
    overall = summary.get("overall", summary.get("all"))
    tps_line, timing_line = _summary_lines(args, overall, tree, predicted, conditions, ref, hf_model)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"summary": summary, "batches": batches, "acceptance": acc._asdict(),
                   "tree": [list(c) for c in tree.medusa_choices],
                   "dynamic_tree": tree.dynamic and tree.dynamic._asdict(),
                   "prompt_lookup": tree.lookup_settings,
                   "predicted_tokens_per_step": predicted and predicted[0],
                   "predicted_basis": predicted and predicted[1], "conditions": conditions, "rows": rows}, f, indent=1)
    table = markdown_table(summary) + "\n" + tps_line + "\n" + timing_line + "\n"
    if acc.mode != "greedy":
        table += (f"sampling at temperature {acc.temperature}, top-p {acc.top_p}, top-k {acc.top_k or 'off'}: plain "
                  f"sampling against Medusa with {acc.mode} acceptance (outputs are not compared)\n")
    if batches:
        table += "\n" + batch_table(batches)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(summary, os.path.join(args.out, "speed.png"))
    print(table)


def _differences(rows: List[dict], batches: List[dict], greedy: bool, conditions: dict, ref, hf_model) -> int:
    """Prints how the outputs compare with plain greedy's (Medusa's and the batches' when greedy, the
    --compare-weights copy's, transformers'). Returns how many differences are neither identical nor a
    near-tie (Medusa's, the batches' and the copy's; transformers' are printed, not counted)."""
    bugs = sum(1 for r in rows if not r["identical"] and not r["near_tie"]) if greedy else 0
    if greedy:
        print(f"identical {sum(r['identical'] for r in rows)}/{len(rows)}, near-ties "
              f"{sum(r['near_tie'] for r in rows)}, other differences {bugs}")
    for batch in batches if greedy else []:
        for name in ("plain", "medusa"):
            b = batch[name]
            bugs += b["other_differences"]
            print(f"batch {batch['batch_size']} {name}: identical to plain greedy at batch 1 {b['identical']}/{len(rows)}, "
                  f"near-ties {b['near_ties']}, other differences {b['other_differences']}")
    if ref is not None:  # the same weights (GGUF blocks dequantize exactly): a difference is a bug
        other = [r["id"] for r in rows if not r["ref_identical"] and not r["ref_near_tie"]]
        bugs += len(other)
        print(f"plain greedy on {conditions['compare_weights']} weights identical to plain greedy "
              f"{sum(r['ref_identical'] for r in rows)}/{len(rows)}, near-ties "
              f"{sum(r['ref_near_tie'] for r in rows)}, other differences {len(other)}"
              + (": " + ", ".join(map(str, other)) if other else ""))
    if hf_model is not None:
        diffs = [f"{r['id']} at token {r['hf_first_diff']} (top-2 gap "
                 + ("n/a: one stopped earlier" if r["hf_gap"] is None else f"{r['hf_gap']:.2g}") + ")"
                 for r in rows if not r["hf_identical"]]
        print(f"transformers identical to plain greedy {len(rows) - len(diffs)}/{len(rows)}"
              + (": differs on " + ", ".join(diffs) if diffs else ""))
    return bugs


@interruptible
def main(argv=None) -> int:
    """medusa-bench (see the module docstring). Returns the exit status: 0 when every compared
    output matches plain greedy's (or differs at a near-tie), 1 when one differs otherwise, 2 on bad
    paths, heads, tree, mesh or prompts (the error on stderr); bad flags exit 2 through argparse."""
    from medusa_jax import sharding
    from medusa_jax.convert.load import weights_of
    from medusa_jax.cli import common

    p = _parser()
    args = p.parse_args(argv)
    acc, batch_sizes = _checked_args(p, args)
    greedy = acc.mode == "greedy"
    records = _records(p, args)
    common.make_out_dir(p, args.out)  # before the slow work, which would otherwise fail only at the end

    setup = _setup(args)
    if setup is None:
        return 2
    model, heads, tree, mesh, calibration = setup
    cfg, params = model.cfg, model.params
    hf_model = load_hf_peer(model.path, args.torch_threads) if args.hf else None
    try:
        prompts = common.chat_prompts(model.tokenizer, records, args.prompts, cfg.max_position_embeddings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plain_acc = acc._replace(method="exact")  # a plain step has no candidates: only the temperature and top-p act
    decoders, ref = _decoders(args, model, heads, tree, acc, plain_acc, hf_model)
    for run in decoders.values():  # untimed warm-up, full budget (ours: compiles every shape of this prompt)
        run(prompts[0], args.seed)
    conditions = run_conditions(args.torch_threads if hf_model is not None else None)
    conditions.update(dtype=args.dtype, mesh=sharding.describe(mesh), weights=weights_of(params),
                      compare_weights=ref and weights_of(ref.params))
    rows, plain_outputs = _run_prompts(args, model, decoders, records, prompts, greedy)
    batches = [batched(cfg, params, heads, tree, prompts, plain_outputs, rows, n, args.max_new_tokens,
                       cfg.eos_token_ids, {"plain": plain_acc, "medusa": acc}, args.seed, greedy) for n in batch_sizes]
    conditions["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    _write_results(args, acc, tree, rows, batches, conditions, calibration, ref, hf_model)
    return 1 if _differences(rows, batches, greedy, conditions, ref, hf_model) else 0



if __name__ == "__main__":
    sys.exit(main())
