"""Fit the Medusa tree to the heads and to the hardware, and save it with the heads.

``python -m medusa_jax.tune --heads DIR [--data data/distill/smollm2] [--proposal-vocab 8192] [--out DIR]``

Where the tuned heads go (`output_dir`): ``--out``; without it, back into ``--heads`` (your own
heads directory) or, for the shipped heads, ``./tuned_heads``. Nothing is ever written inside the
installed package unless ``--update-shipped-heads`` says so (maintainers re-tuning the shipped heads).

1. Proposal vocabulary (optional, ``--proposal-vocab N``): the N most frequent tokens of the
   self-distilled training split; the heads then propose only those (their vocabulary projection
   per step shrinks by V / N; verification still uses the full vocabulary, so output is unchanged).
2. Calibration: at every position of the held-out chats of the self-distillation data (prompts
   from the training pool, never the evaluation sets; answers are the backbone's own greedy
   tokens), the rank of the true token among each head's proposals (`replay.path_ranks`; hydra
   heads read the true tokens before it). The per-head rank accuracies ``acc[k][r]`` follow, but
   the ranks themselves say exactly what any tree accepts at each position.
3. Tree search: trees grown node by node for the fewest decoding steps on those chats
   (`replay.search_tree`), with greedy decoding replayed step by step (`replay.Replay`), with
   decoding's prompt lookup unless ``--prompt-lookup 0``. Medusa Sec. 3.3.1 instead multiplies the
   per-head accuracies as if the heads erred independently, which on SmolLM2's hydra heads
   overestimated tokens per step by 0.07-0.10; and the tree of most acceptance summed over the
   positions (a chain, at 4 nodes) decodes in more steps than the one grown for steps, because a
   long acceptance skips the positions it covers (docs/performance.md).
4. Hardware-aware choice: the verify cost ``c(T) = t(Medusa step with the T-node tree) / t(plain
   step)`` is measured on this device (`medusa_jax.cost`; the mean over the KV cache sizes of
   ``--cost-cache-sizes``, on the products decoding runs: `medusa_jax.kernels`), and the tree that
   maximises the predicted speedup, replayed tokens per step / c(T) (a step with prompt lookup
   verifies max(T, K + 1) nodes), is saved as the heads' ``medusa_choices``, with the whole table
   (``tree_search`` in config.json). decode.py and the benchmark use it by default; the benchmark
   prints the predicted tokens per step beside the measured one.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import kernels
from .config import MedusaConfig
from .lookup import PromptLookup
from .replay import Replay, path_ranks, rank_accuracies_of, search_tree, tree_accepted
from .tree import build_tree

DEFAULT_SIZES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
#: Where tuned shipped heads go without --out (relative to the current directory).
DEFAULT_OUT = "tuned_heads"


class OutputDirError(ValueError):
    """A tune output directory that would write into the installed package (or conflicting flags)."""


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def output_dir(heads: Optional[str], out: Optional[str], update_shipped: bool = False) -> str:
    """Where `main` writes the tuned heads.

    Args:
      heads: the --heads directory, or None for the shipped heads (`runtime.DEFAULT_HEADS_DIR`).
      out: the --out directory, or None.
      update_shipped: --update-shipped-heads: write into the shipped heads directory.
    Returns: `out` when given; the shipped heads directory when `update_shipped`; else `heads` when it
      is a directory outside the installed package (tuned in place); else `DEFAULT_OUT` in the
      current directory. The path is absolute.
    Raises:
      OutputDirError: `out` is inside the installed medusa_jax package without `update_shipped`, or
        both `out` and `update_shipped` are given.
    """
    from . import runtime

    package = os.path.dirname(os.path.abspath(__file__))
    heads = runtime.heads_location(heads)
    # --update-shipped-heads writes to the shipped heads being tuned (--heads medusa1), else the default ones
    shipped = heads if heads in runtime.SHIPPED_HEADS.values() else runtime.DEFAULT_HEADS_DIR
    if update_shipped:
        if out is not None:
            raise OutputDirError(f"give either --out or --update-shipped-heads (which writes to {shipped}), not both")
        return os.path.abspath(shipped)
    if out is not None:
        if _inside(out, package):
            raise OutputDirError(f"--out {out} is inside the installed medusa_jax package ({package}); tuned "
                                 f"heads go elsewhere, e.g. --out {DEFAULT_OUT}. To re-tune the shipped heads "
                                 "themselves (maintainers), pass --update-shipped-heads instead of --out")
        return os.path.abspath(out)
    if heads is not None and not _inside(heads, package):
        return os.path.abspath(heads)
    return os.path.abspath(DEFAULT_OUT)


def rank_accuracies(heads_cfg: MedusaConfig, head_params, base_lm_head, hidden: np.ndarray, labels: np.ndarray,
                    valid: np.ndarray, topk: int = 10, batch: int = 1024, path_tokens: Optional[np.ndarray] = None,
                    embeddings=None) -> Tuple[np.ndarray, np.ndarray]:
    """Calibrated rank accuracies of the heads, exactly as decoding proposes (proposal vocabulary included).

    Hydra heads (Ankner et al. 2024, Sec. 3) are conditioned on the true previous tokens (teacher
    forcing): on the path greedy decoding accepts, the earlier guesses were right, so acc[k][r]
    is P(rank r right | the path so far right), which is what `tree.expected_acceptance_length`
    multiplies along a path.

    Args:
      hidden: [P, D] float32 backbone hidden states at positions t.
      labels: [K, P] int32, the base model's greedy token at t + k + 2 for head k.
      valid: [K, P] bool, whether that label exists.
      topk: ranks to measure.
      path_tokens: hydra heads: [K, P] int32 tokens t+1..t+K (`data.path_tokens`); ignored by Medusa heads.
      embeddings: hydra heads: [V, D] the backbone's input embeddings (`hydra.token_embeddings`).
    Returns:
      (acc [K, topk] float64: acc[k][r] = hits of head k at rank r / counts[k], counts [K] int64).
    Raises ValueError when some head has no valid position, or hydra heads lack path_tokens or embeddings.
    """
    from .train.data import plain_positions

    if heads_cfg.head_type == "hydra" and (path_tokens is None or embeddings is None):
        raise ValueError("calibrating hydra heads needs path_tokens [K, P] (tokens t+1..t+K) and embeddings [V, D]")
    pos = plain_positions(hidden, labels, valid, path_tokens)
    ranks = path_ranks(heads_cfg, head_params, base_lm_head, pos, topk, embeddings, batch)
    return rank_accuracies_of(ranks, valid, topk)


def choose_tree(ranks: np.ndarray, cost: Dict[int, float], topk: int = 10, chats: Optional[Sequence] = None,
                sources: Optional[np.ndarray] = None, lookup: Optional[PromptLookup] = None,
                order: Optional[Sequence] = None) -> Tuple[dict, List[dict]]:
    """The hardware-aware choice among the trees that accept the most on the held-out chats.

    Args:
      ranks: [P, K] `replay.path_ranks` of the held-out positions.
      cost: {T: c(T)} measured relative step costs (T = tree tokens, root included; T = 1 is plain
        decoding with c = 1 and is always a candidate).
      chats, sources: the held-out chats (token ids, loss mask) and the (chat, t) of each position
        (`train.trainer.position_sources`): tokens per step are then those of decoding the answers
        step by step (`replay.replay`); without them, 1 + the mean accepted over the positions.
      lookup: with chats, also replay decoding with this prompt lookup, and choose on that. A step
        then verifies max(T, k + 1) nodes (`verify.padded_arrays`), so it costs c(max(T, k + 1)),
        which `cost` must hold.
      order: the trees' paths in the order `replay.search_tree` adds them (each size's tree is a
        prefix); default: searched here, for the fewest decoding steps of the chats when given.
    Returns:
      (best row, all rows); a row is {"size": T, "expected_accepted": E (mean over the positions),
      "predicted_tokens_per_step": the heads alone, ["predicted_tokens_per_step_lookup": with the
      prompt lookup,] "cost": c, "predicted_speedup": tokens per step / c (with the lookup when
      given), "medusa_choices": paths}.
    Raises KeyError when `cost` lacks c(k + 1); ValueError for lookup without chats.
    """
    if lookup is not None and chats is None:
        raise ValueError("choosing with prompt lookup needs the chats and sources to replay")
    alone = Replay(chats, sources) if chats is not None else None
    looked = Replay(chats, sources, lookup) if lookup is not None else None
    if order is None:
        order = search_tree(ranks, max(cost, default=1), topk, looked or alone)
    rows = [{"size": 1, "expected_accepted": 0.0, "predicted_tokens_per_step": 1.0, "cost": 1.0,
             "predicted_speedup": 1.0, "medusa_choices": []}]
    for T in sorted(cost):
        if T <= 1:
            continue
        choices = order[:T - 1]
        accepted = tree_accepted(ranks, choices, topk)
        tps = alone.tokens_per_step(accepted) if alone else 1.0 + (float(accepted.mean()) if len(accepted) else 0.0)
        row = {"size": len(choices) + 1, "expected_accepted": float(accepted.mean()) if len(accepted) else 0.0,
               "predicted_tokens_per_step": tps, "cost": float(cost[T])}
        if looked is not None:
            row["predicted_tokens_per_step_lookup"] = tps = looked.tokens_per_step(accepted)
            row["cost"] = float(cost[max(T, lookup.num_tokens + 1)])
        rows.append({**row, "predicted_speedup": tps / row["cost"], "medusa_choices": [list(p) for p in choices]})
    best = max(rows, key=lambda r: (r["predicted_speedup"], -r["size"]))
    return best, rows


def _table(rows: List[dict], best: dict) -> str:
    lookup = any("predicted_tokens_per_step_lookup" in r for r in rows)
    lines = ["| tree tokens T | E[accepted] | tokens/step, heads alone" + (" | tokens/step, with prompt lookup" if lookup
                                                                          else "") + " | c(T) | predicted speedup |",
             "|---:|---:|---:|" + ("---:|" if lookup else "") + "---:|---:|"]
    for r in rows:
        mark = " **(chosen)**" if r is best else ""
        with_lookup = f" {r.get('predicted_tokens_per_step_lookup', 1.0):.3f} |" if lookup else ""
        lines.append(f"| {r['size']}{mark} | {r['expected_accepted']:.3f} | {r['predicted_tokens_per_step']:.3f} |"
                     f"{with_lookup} {r['cost']:.3f} | {r['predicted_speedup']:.3f} |")
    return "\n".join(lines)


def _calibration_data(model, data_dir: str, val_fraction: float, seed: int, num_heads: int, max_seq_len: int,
                      max_positions: int, progress: bool):
    """(train, val, chats, pos, sources): the split of the self-distilled chats, the held-out chats
    calibrated (cut to max_seq_len; whole chats, in a seeded order, until they hold max_positions
    positions; 0 = all), their `Positions` and each position's (chat index, t)."""
    from .train import data as D
    from .train.trainer import Backbone, compute_positions, position_sources

    examples = D.load_distilled(data_dir)
    train, val = D.split_train_val(examples, val_fraction, seed)
    if not val:
        raise ValueError(f"{data_dir}: val_fraction={val_fraction} leaves no held-out chat for calibration")
    chats = [(np.asarray(i, np.int32)[:max_seq_len], np.asarray(m, bool)[:max_seq_len]) for i, m in val]
    if max_positions:  # whole chats, so that decoding them can be replayed
        sizes = [len(D.kept_positions(i, m, num_heads)) for i, m in chats]
        order = np.random.default_rng(seed).permutation(len(chats))
        n = int(np.searchsorted(np.cumsum([sizes[i] for i in order]), max_positions)) + 1
        chats = [chats[i] for i in sorted(order[:n])]
    bb = Backbone(model.cfg, model.params, model.path)
    pos = compute_positions(bb, chats, num_heads, max_seq_len, 4096, desc="calibration hidden states",
                            progress=progress)
    return train, val, chats, pos, position_sources(chats, num_heads)


def _timing_prompt(val, target_len: int) -> List[int]:
    """The prompt part of the held-out chat whose prompt length is closest to target_len."""
    prompts = []
    for ids, mask in val:
        mask = np.asarray(mask, bool)
        start = int(np.argmax(mask)) if mask.any() else len(ids)
        prompts.append(list(np.asarray(ids[:start], np.int64)))
    prompts = [p for p in prompts if p]
    return min(prompts, key=lambda p: (abs(len(p) - target_len), len(p)))


def _format_extras(raw: dict) -> dict:
    from .convert.medusa_format import _OUR_KEYS
    return {k: v for k, v in raw.items() if k not in _OUR_KEYS and k != "version" and k != "tree_search"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import runtime
    from .cli_help import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m medusa_jax.tune",
        description="Calibrate the heads, measure the verify cost c(T) on this device and save the tree that "
                    "maximises (1 + E[accepted]) / c(T) with the heads (see the module docs).",
        formatter_class=HelpFormatter)
    p.add_argument("--heads", default=None, help=runtime.heads_help(zero=False))
    p.add_argument("--model", default=None, help="HF directory or GGUF (default: the SmolLM2 GGUF)")
    p.add_argument("--data", default="data/distill/smollm2",
                   help="self-distillation directory (samples.jsonl); its held-out split calibrates the heads")
    p.add_argument("--val-fraction", type=float, default=0.04,
                   help="held-out fraction of the chats; use the training config's so the heads never saw them")
    p.add_argument("--seed", type=int, default=0, help="split seed (the training config's)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per chat kept (the training config's)")
    p.add_argument("--max-positions", type=int, default=0,
                   help="calibrate on whole held-out chats until they hold this many positions (0 = all of them)")
    p.add_argument("--proposal-vocab", type=int, default=None,
                   help="restrict proposals to the N most frequent training tokens (0 = whole vocabulary; "
                        "default: keep what the heads have)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="tree sizes T (tokens, root included) to time and compare")
    p.add_argument("--cost-cache-sizes", "--cost-cache-size", dest="cost_cache_sizes", default="256,512,1024",
                   help="KV cache sizes (slots, comma-separated) to time c(T) at; the tree is chosen by the mean "
                        "c(T) over them (short answers decode at 256 slots, long prompts at 512-2,048)")
    p.add_argument("--cost-prompt-len", type=int, default=100, help="approximate prompt tokens while timing")
    p.add_argument("--steps", type=int, default=16, help="steps per timed call")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per tree (the best is kept)")
    p.add_argument("--out", default=None,
                   help=f"write the tuned heads here (default: back into --heads when it is your own heads "
                        f"directory; ./{DEFAULT_OUT} for the shipped heads). Never inside the installed package")
    p.add_argument("--update-shipped-heads", action="store_true",
                   help="maintainers: write the tuned heads into the shipped heads directory inside the package "
                        "(medusa_jax/assets/heads/...), replacing them, in float16; not with --out")
    p.add_argument("--dry-run", action="store_true", help="print the table, save nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    runtime.add_lookup_arg(p)
    runtime.add_dtype_arg(p)
    args = p.parse_args(argv)
    try:
        out_dir = None if args.dry_run else output_dir(args.heads, args.out, args.update_shipped_heads)
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from .convert.medusa_format import load_heads, read_heads_config, save_heads
    from .cost import overhead_breakdown, step_costs
    from .heads import frequent_tokens, with_proposal_projection
    from .hydra import token_embeddings
    from .loading import load_model
    from .models.llama import lm_head_matrix
    from .plan import tree_bytes

    heads_dir = runtime.heads_location(args.heads) or runtime.DEFAULT_HEADS_DIR
    try:  # paths and heads before the slow model load
        runtime.preflight(args.model, heads_dir, None)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runtime.enable_compilation_cache()
    model = load_model(args.model, dtype=args.dtype, with_tokenizer=False)  # token ids only
    hcfg, hp = load_heads(heads_dir, model.cfg)
    lm = lm_head_matrix(model.cfg, model.params)
    progress = not args.no_progress
    train, val, chats, pos, sources = _calibration_data(
        model, args.data, args.val_fraction, args.seed, hcfg.num_heads, args.max_seq_len, args.max_positions,
        progress)
    if args.proposal_vocab is not None:
        if args.proposal_vocab:
            hp = {**hp, "proposal_ids": frequent_tokens((ids for ids, _ in train), args.proposal_vocab,
                                                        model.cfg.vocab_size)}
        else:
            hp = {k: v for k, v in hp.items() if k != "proposal_ids"}
        hcfg = hcfg.replace(proposal_vocab_size=args.proposal_vocab)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    ranks = path_ranks(hcfg, jhp, lm, pos, hcfg.topk, embeddings=token_embeddings(model.params))
    acc, counts = rank_accuracies_of(ranks, pos.valid, hcfg.topk)
    print(f"calibration: {len(chats)} of {len(val)} held-out chats, positions per head {counts.tolist()}")
    for k in range(hcfg.num_heads):
        print(f"  head {k}: top-1 {acc[k, 0]:.3f}  top-5 {acc[k, :5].sum():.3f}  ranks "
              + " ".join(f"{a:.3f}" for a in acc[k]))

    lookup = runtime.tree_lookup(build_tree([]), args.prompt_lookup).lookup
    sizes = sorted({int(s) for s in args.sizes.split(",") if int(s) > 1} | ({lookup.num_tokens + 1} if lookup else set()))
    # the trees that decode the held-out chats in the fewest steps, each size's a prefix of the next's
    order = search_tree(ranks, max(sizes, default=1), hcfg.topk, Replay(chats, sources, lookup))
    trees = [build_tree(order[:T - 1], hcfg.topk) for T in sizes]
    prompt = _timing_prompt(val, args.cost_prompt_len)
    cache_sizes = sorted({int(s) for s in args.cost_cache_sizes.split(",")})
    by_size = {}
    # the roofline beside the timings (issue 13): the weights a plain step streams over its time,
    # against this machine's read bandwidth measured before each cache size's timings
    weight_bytes = tree_bytes(model.params)
    bandwidth = {}
    for S in cache_sizes:
        bandwidth[S] = kernels.read_bandwidth() if kernels.available() else None
        by_size[S] = step_costs(model.cfg, model.params, (hcfg, jhp), trees, prompt, args.steps, args.repeats,
                                S, progress)
        gbs = weight_bytes / by_size[S]["plain_s"] / 1e9
        roof = f" = {gbs / (bandwidth[S] / 1e9):.2f} of the read bandwidth {bandwidth[S] / 1e9:.1f} GB/s" \
            if bandwidth[S] else ""
        print(f"cache {S} slots: plain step {by_size[S]['plain_s'] * 1e3:.2f} ms ({gbs:.1f} GB/s of weights{roof}), "
              + " ".join(f"c({T})={c:.2f}" for T, c in by_size[S]["cost"].items()))
    costs = {"plain_s": float(np.mean([c["plain_s"] for c in by_size.values()])),
             "cost": {T: float(np.mean([c["cost"][T] for c in by_size.values()])) for T in by_size[cache_sizes[0]]["cost"]}}
    best, rows = choose_tree(ranks, costs["cost"], hcfg.topk, chats, sources, lookup, order)
    print(f"plain step {costs['plain_s'] * 1e3:.2f} ms on {jax.devices()[0].device_kind} (mean over caches of "
          f"{', '.join(map(str, cache_sizes))} slots, prompt {len(prompt)} tokens; products: {kernels.status()})")
    print(_table(rows, best))
    if best["size"] == 1:
        best = max(rows[1:], key=lambda r: r["predicted_speedup"])
        print(f"note: on this device no tree beats plain decoding with these heads (best: {best['size']} tokens, "
              f"predicted {best['predicted_speedup']:.3f}x); that tree is the one kept with the heads, but "
              "decode.py --no-medusa is faster here", file=sys.stderr)
    chosen_tree = build_tree([tuple(p) for p in best["medusa_choices"]], hcfg.topk)
    breakdown = overhead_breakdown(model.cfg, model.params, (hcfg, jhp), chosen_tree, prompt, args.steps,
                                   args.repeats, cache_sizes[0])
    print("per step (ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in breakdown.items() if k.endswith("_ms")))
    if args.dry_run:
        return 0
    report = {"device": str(jax.devices()[0].device_kind), "plain_step_ms": costs["plain_s"] * 1e3,
              "cost_cache_sizes": cache_sizes, "cost_prompt_tokens": len(prompt),
              "plain_step_ms_by_cache_size": {S: c["plain_s"] * 1e3 for S, c in by_size.items()},
              "cost_by_cache_size": {S: c["cost"] for S, c in by_size.items()}, "products": kernels.status(),
              "weight_bytes": weight_bytes,
              "read_bandwidth_gbs_by_cache_size": {S: b and b / 1e9 for S, b in bandwidth.items()},
              "calibration_chats": len(chats), "calibration_positions": counts.tolist(),
              "rank_accuracies": np.round(acc, 5).tolist(), "chosen_size": best["size"],
              "medusa_choices": best["medusa_choices"],
              "predicted_tokens_per_step": best["predicted_tokens_per_step"],
              "predicted_tokens_per_step_lookup": best.get("predicted_tokens_per_step_lookup"),
              "prompt_lookup": lookup._asdict() if lookup else None, "predicted_by": "replay",
              "step_breakdown_ms": breakdown,
              "rows": [{k: v for k, v in r.items() if k != "medusa_choices"} for r in rows]}
    extras = _format_extras(read_heads_config(heads_dir))
    extras["tree_search"] = report
    tuned = hcfg.replace(medusa_choices=tuple(tuple(p) for p in best["medusa_choices"]))
    # the shipped heads are kept in float16 (half the package size); tuned copies in float32
    save_heads(out_dir, tuned, hp, extra=extras, dtype=np.float16 if args.update_shipped_heads else np.float32)
    with open(os.path.join(out_dir, "tree_search.md"), "w") as f:
        f.write(f"# Tree search ({report['device']}, plain step {report['plain_step_ms']:.2f} ms)\n\n"
                + _table(rows, best) + "\n")
    with_lookup = (f", {best['predicted_tokens_per_step_lookup']:.3f} with prompt lookup"
                   if "predicted_tokens_per_step_lookup" in best else "")
    print(f"saved the {best['size']}-node tree (predicted {best['predicted_tokens_per_step']:.3f} tokens/step with the "
          f"heads alone{with_lookup}, speedup {best['predicted_speedup']:.3f}x) with the heads in {out_dir}")
    if os.path.realpath(out_dir) != os.path.realpath(runtime.DEFAULT_HEADS_DIR):
        print(f"use them with: python decode.py --heads {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
