"""Lossless check: Medusa greedy output against plain greedy output on a prompt set.

``python -m medusa_jax.check --prompts ../shared/data/FastChat_mt_bench_question.jsonl``

For every prompt (first turn), both decoders run greedily on the same weights. Outputs must be
identical token for token. Where they differ, the first differing position is examined on the
plain path: if its top-2 logit gap is below ``--tie-gap`` (`TIE_GAPS`: 1e-4 in float32) the
difference is a near-tie (the tree forward sums in another order) and is counted as such; any
other difference is a bug and makes the command exit with status 1.

With ``--temperature > 0`` it samples instead (``--acceptance exact``, the default, or ``typical``)
and reports Medusa's tokens per step; sampled answers are not compared with anything (plain and
Medusa sampling draw different random numbers; tests/test_exact_sampling.py checks that exact
acceptance keeps the distribution).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp


#: Top-2 logit gap below which a difference between two decoders counts as a near-tie, per compute
#: dtype. float32: 1e-4, two orders above the round-off of a float32 logit of magnitude ~10 (the
#: two paths' float32 logits measured equal bit for bit). bfloat16 0.5 and float16 0.0625: twice
#: the largest change of a top-2 gap measured between the plain and the Medusa path on SmolLM2
#: (`scripts/path_noise.py`, 13 MT-bench answers, ~400 positions: bfloat16 0.26, float16 0.031),
#: since in those dtypes every layer's output is rounded and a tree forward rounds other sums.
TIE_GAPS = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.0625}


@dataclass
class Comparison:
    """One prompt's verdict. first_diff: index into the new tokens (None if identical);
    gap: top-2 logit gap of the plain path at that index; near_tie: gap < tie_gap."""
    identical: bool
    first_diff: Optional[int] = None
    gap: Optional[float] = None
    near_tie: bool = False


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(cfg, params, ids: Sequence[int]) -> float:
    """Gap between the two largest float32 logits after the last of `ids` (one full forward, no cache)."""
    from .models.llama import LlamaModel

    toks = jnp.asarray([list(ids)], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    _, hidden, _ = LlamaModel(cfg).apply({"params": params}, toks, pos, compute_logits=False)
    logits = LlamaModel(cfg).apply({"params": params}, hidden[:, -1], method=LlamaModel.logits)
    top = jax.lax.top_k(logits[0], 2)[0]
    return float(top[0] - top[1])


def compare(cfg, params, prompt: Sequence[int], plain: Sequence[int], medusa: Sequence[int],
            tie_gap: Optional[float] = None) -> Comparison:
    """Compare two outputs for one prompt; see the module docstring. tie_gap: None: `TIE_GAPS` of
    the params' compute dtype."""
    if tie_gap is None:
        from .models.llama import compute_dtype
        tie_gap = TIE_GAPS[compute_dtype(params).name]
    i = first_difference(plain, medusa)
    if i is None:
        return Comparison(identical=True)
    if i >= min(len(plain), len(medusa)):  # one stopped earlier: not explained by a near-tie
        return Comparison(identical=False, first_diff=i)
    gap = top2_gap(cfg, params, list(prompt) + list(plain[:i]))
    return Comparison(identical=False, first_diff=i, gap=gap, near_tie=gap < tie_gap)


def load_first_turns(path: str, limit: Optional[int] = None) -> List[dict]:
    """Records {"index", "id", "category", "prompt"} from a JSONL file: one object per line with a
    "prompt" string, or MT-bench / Spec-Bench questions with "turns" (the first turn is used);
    blank lines are skipped and a UTF-8 byte-order mark is allowed. ``limit``: only the first N.

    Raises:
      ValueError: naming the file and line, for a line that is not such an object, an empty prompt,
        or a file without prompts; for an unreadable file (missing, a directory, not UTF-8).
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    out: List[dict] = []
    for n, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object with a 'prompt' string, got {type(rec).__name__}")
        if isinstance(rec.get("prompt"), str):
            text = rec["prompt"]
        elif isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
            text = rec["turns"][0]
        else:
            raise ValueError(f"{where}: needs a 'prompt' string (or a 'turns' list of strings)")
        if not text.strip():
            raise ValueError(f"{where}: the prompt is empty")
        out.append({"index": len(out), "id": rec.get("question_id", rec.get("id")),
                    "category": rec.get("category", ""), "prompt": text})
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def main(argv=None) -> int:
    from . import runtime
    from .cli_help import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m medusa_jax.check", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--prompts", required=True, help="JSONL with MT-bench style 'turns' or a 'prompt' field")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2 GGUF)")
    p.add_argument("--heads", default=None,
                   help=runtime.heads_help())
    p.add_argument("--num-heads", type=int, default=4, help="head count for --heads zero")
    p.add_argument("--tree", default=None, help="tree preset or file (default: the heads' tree)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--tie-gap", type=float, default=None,
                   help="top-2 logit gap below which a difference is a near-tie; default by --dtype: "
                        + ", ".join(f"{k} {v:g}" for k, v in TIE_GAPS.items()))
    runtime.add_dtype_arg(p)
    p.add_argument("--out", default=None, help="also write per-prompt results as JSON to this file")
    runtime.add_acceptance_args(p, temperature_help="0: the lossless check (Medusa greedy against plain greedy); "
                                                    "> 0: Medusa sampling's tokens/step, no comparison")
    runtime.add_lookup_arg(p)
    args = p.parse_args(argv)
    acc = runtime.acceptance_from_args(p, args)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

    from tqdm import tqdm

    from .loading import apply_chat_template, load_model

    try:  # paths, heads and tree before the slow model load
        runtime.preflight(args.model, args.heads, args.tree, zero_heads=args.num_heads)
        records = load_first_turns(args.prompts, args.limit)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runtime.enable_compilation_cache()
    model = load_model(args.model, dtype=jnp.dtype(args.dtype))
    heads, tree, note = runtime.resolve_heads(model, args.heads, args.tree, zero_heads=args.num_heads,
                                              prompt_lookup=args.prompt_lookup)
    if tree is None:  # neither heads nor prompt lookup: nothing to compare with plain decoding
        print(f"error: {note}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}", file=sys.stderr)
    if acc.mode != "greedy":
        return sampled(model, heads, tree, records, acc, args)
    rows, steps, new_tokens = [], 0, 0
    for rec in tqdm(records, desc="prompts", unit="prompt"):
        ids = apply_chat_template(model.tokenizer, rec["prompt"])
        plain, _ = decode_one(model, ids, args.max_new_tokens)
        med, med_steps = decode_one(model, ids, args.max_new_tokens, heads, tree)
        c = compare(model.cfg, model.params, ids, plain, med, args.tie_gap)
        steps += med_steps
        new_tokens += len(med)
        rows.append({**rec, **asdict(c), "new_tokens": len(med), "steps": med_steps,
                     "tokens_per_step": len(med) / max(med_steps, 1)})
    identical = sum(r["identical"] for r in rows)
    ties = sum(r["near_tie"] for r in rows)
    bugs = len(rows) - identical - ties
    summary = {"prompts": len(rows), "identical": identical, "near_ties": ties, "other_differences": bugs,
               "mean_tokens_per_step": new_tokens / max(steps, 1), "tree_size": tree.size,
               "prompt_lookup": tree.lookup_settings, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(summary))
    for r in rows:
        if not r["identical"]:
            print(json.dumps({k: r[k] for k in ("id", "first_diff", "gap", "near_tie")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 1 if bugs else 0


def decode_one(model, ids, max_new_tokens: int, heads=None, tree=None, acceptance=None, seed: int = 0):
    """(new token ids, decoding steps) of one prompt with the on-device loop
    (`bench.time_jit_generate`: the same tokens as `generate`, and on a CPU in bfloat16 several
    times faster, because XLA converts the weights to float32 once per loop rather than every step)."""
    from .bench import time_jit_generate

    r = time_jit_generate(model.cfg, model.params, heads, tree, ids, max_new_tokens, model.cfg.eos_token_ids,
                          acceptance, seed, progress=False)
    return r["tokens"], r["steps"]


def sampled(model, heads, tree, records, acc, args) -> int:
    """``--temperature > 0``: Medusa sampling on every prompt (prompt i with `sampling.prompt_seed`);
    prints the summary with the mean tokens per step. Returns 0."""
    from tqdm import tqdm

    from .loading import apply_chat_template
    from .sampling import prompt_seed

    rows, steps, new_tokens = [], 0, 0
    for i, rec in enumerate(tqdm(records, desc="prompts", unit="prompt")):
        ids = apply_chat_template(model.tokenizer, rec["prompt"])
        med, med_steps = decode_one(model, ids, args.max_new_tokens, heads, tree, acc, prompt_seed(args.seed, i))
        steps += med_steps
        new_tokens += len(med)
        rows.append({**rec, "new_tokens": len(med), "steps": med_steps, "tokens_per_step": len(med) / max(med_steps, 1)})
    summary = {"prompts": len(rows), "acceptance": acc.mode, "temperature": acc.temperature, "top_p": acc.top_p,
               "mean_tokens_per_step": new_tokens / max(steps, 1), "new_tokens": new_tokens, "steps": steps,
               "tree_size": tree.size, "prompt_lookup": tree.lookup_settings,
               "max_new_tokens": args.max_new_tokens}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
