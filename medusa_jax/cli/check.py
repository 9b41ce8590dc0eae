"""Lossless check: Medusa greedy output against plain greedy output on a prompt set.

``medusa-check --prompts data/FastChat_mt_bench_question.jsonl``

For every prompt (first turn), both decoders run greedily on the same weights. Outputs must be
identical token for token. Where they differ, the first differing position is examined on the
plain path: if its top-2 logit gap is below ``--tie-gap`` (`TIE_GAPS`: 1e-4 in float32) the
difference is a near-tie (the tree forward sums in another order) and is counted as such; any
other difference is a bug and makes the command exit with status 1. With ``--reference-weights``
the plain reference decodes from a second copy of the model loaded with other ``--weights`` (the
GGUF blocks against the dequantized float32 model).

With ``--temperature > 0`` it samples instead and reports Medusa's tokens per step. With
``--acceptance exact`` (the default) each answer is also compared with plain sampling's for the same
seed, which it must equal token for token (exact acceptance draws every position's token with the
noise of that seed and position, whatever the tree); a difference makes the command exit with
status 1. ``typical`` acceptance changes the distribution, so its answers are not compared
(tests/test_exact_sampling.py checks the distributions).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from medusa_jax.cli import interruptible
from medusa_jax.chat import load_first_turns
from medusa_jax.evals.lossless import TIE_GAPS, compare, decode_one


@interruptible
def main(argv=None) -> int:
    from medusa_jax.cli import common
    from medusa_jax.cli.common import HelpFormatter
    from medusa_jax.convert.load import weights_of

    p = argparse.ArgumentParser(prog="medusa-check", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--prompts", required=True, help="JSONL with MT-bench style 'turns' or a 'prompt' field")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2 GGUF)")
    p.add_argument("--heads", default=None,
                   help=common.heads_help())
    p.add_argument("--num-heads", type=int, default=4, help="head count for --heads zero")
    p.add_argument("--tree", default=None, help=common.TREE_HELP)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--tie-gap", type=float, default=None,
                   help="top-2 logit gap below which a difference is a near-tie; default by --dtype: "
                        + ", ".join(f"{k} {v:g}" for k, v in TIE_GAPS.items()))
    common.add_dtype_arg(p)
    p.add_argument("--reference-weights", choices=common.WEIGHTS, default=None,
                   help="decode the plain greedy reference from a second copy of the model loaded with these "
                        "--weights: '--weights as-stored --reference-weights float32' checks Medusa on the GGUF "
                        "blocks against plain decoding of the dequantized model (default: the same weights)")
    p.add_argument("--out", default=None,
                   help="also write per-prompt results as JSON to this file (its directory must exist)")
    common.add_acceptance_args(p, temperature_help="0: the lossless check (Medusa greedy against plain greedy); "
                                                    "> 0: Medusa sampling's tokens/step, and with exact acceptance "
                                                    "the comparison with plain sampling for the same seed")
    common.add_lookup_arg(p)
    args = p.parse_args(argv)
    acc = common.acceptance_from_args(p, args)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_heads < 1:
        p.error(f"--num-heads must be >= 1 (the zero heads --heads zero makes), got {args.num_heads}")
    if args.num_heads != p.get_default("num_heads") and args.heads != "zero":
        print(f"note: --num-heads {args.num_heads} has no effect without --heads zero (the heads' own count is "
              "used)", file=sys.stderr)
    if args.tie_gap is not None and not (math.isfinite(args.tie_gap) and args.tie_gap >= 0):
        p.error(f"--tie-gap must be a finite number >= 0 (0: no difference is a near-tie), got {args.tie_gap}")
    if args.out is not None:
        common.check_out_file(p, args.out)

    from tqdm import tqdm

    try:  # paths, heads and tree are checked before the slow model load
        records = load_first_turns(args.prompts, args.limit)
        model, heads, tree, note, _ = common.setup_decoding(args, zero_heads=args.num_heads)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if tree is None:  # neither heads nor prompt lookup: nothing to compare with plain decoding
        print(f"error: {note}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}", file=sys.stderr)
    try:
        prompts = common.chat_prompts(model.tokenizer, records, args.prompts, model.cfg.max_position_embeddings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if acc.mode != "greedy":
        return sampled(model, heads, tree, records, prompts, acc, args)
    ref = model  # the plain greedy reference
    if args.reference_weights not in (None, args.weights):
        ref = common.load_backbone(args.model, args.heads, args.dtype, with_tokenizer=False, progress=False,
                                   weights=args.reference_weights)
    rows, steps, new_tokens = [], 0, 0
    for rec, ids in tqdm(list(zip(records, prompts)), desc="prompts", unit="prompt"):
        plain, _ = decode_one(ref, ids, args.max_new_tokens)
        med, med_steps = decode_one(model, ids, args.max_new_tokens, heads, tree)
        c = compare(ref.cfg, ref.params, ids, plain, med, args.tie_gap)
        steps += med_steps
        new_tokens += len(med)
        rows.append({**rec, **asdict(c), "new_tokens": len(med), "steps": med_steps,
                     "tokens_per_step": len(med) / max(med_steps, 1)})
    identical = sum(r["identical"] for r in rows)
    ties = sum(r["near_tie"] for r in rows)
    bugs = len(rows) - identical - ties
    summary = {"prompts": len(rows), "identical": identical, "near_ties": ties, "other_differences": bugs,
               "mean_tokens_per_step": new_tokens / max(steps, 1), "tree_size": tree.size,
               "prompt_lookup": tree.lookup_settings, "max_new_tokens": args.max_new_tokens,
               "weights": weights_of(model.params), "reference_weights": weights_of(ref.params)}  # as loaded
    print(json.dumps(summary))
    for r in rows:
        if not r["identical"]:
            print(json.dumps({k: r[k] for k in ("id", "first_diff", "gap", "near_tie")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 1 if bugs else 0


def sampled(model, heads, tree, records, prompts, acc, args) -> int:
    """``--temperature > 0``: Medusa sampling on every prompt (`prompts`: their token ids; prompt i with
    `decoding.sampling.prompt_seed`);
    with exact acceptance also plain sampling with the same seed, which must give the same tokens.
    Prints the summary with the mean tokens per step. Returns 1 when an exact answer differs, else 0."""
    from tqdm import tqdm

    from medusa_jax.decoding.sampling import prompt_seed
    from medusa_jax.evals.lossless import first_difference

    exact = acc.mode == "exact"
    rows, steps, new_tokens = [], 0, 0
    for i, (rec, ids) in enumerate(tqdm(list(zip(records, prompts)), desc="prompts", unit="prompt")):
        seed = prompt_seed(args.seed, i)
        med, med_steps = decode_one(model, ids, args.max_new_tokens, heads, tree, acc, seed)
        steps += med_steps
        new_tokens += len(med)
        row = {**rec, "new_tokens": len(med), "steps": med_steps, "tokens_per_step": len(med) / max(med_steps, 1)}
        if exact:
            plain, _ = decode_one(model, ids, args.max_new_tokens, acceptance=acc, seed=seed)
            row["first_diff"] = first_difference(plain, med)
            row["identical"] = row["first_diff"] is None
        rows.append(row)
    summary = {"prompts": len(rows), "acceptance": acc.mode, "temperature": acc.temperature, "top_p": acc.top_p,
               "top_k": acc.top_k,
               "mean_tokens_per_step": new_tokens / max(steps, 1), "new_tokens": new_tokens, "steps": steps,
               "tree_size": tree.size, "prompt_lookup": tree.lookup_settings,
               "max_new_tokens": args.max_new_tokens}
    if exact:
        summary["identical_to_plain_sampling"] = sum(r["identical"] for r in rows)
    print(json.dumps(summary))
    for r in rows:
        if exact and not r["identical"]:
            print(json.dumps({k: r[k] for k in ("id", "first_diff")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 1 if exact and summary["identical_to_plain_sampling"] < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
