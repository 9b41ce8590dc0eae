"""Fit the Medusa tree to the heads and to the hardware, and save it with the heads.

``medusa-tune --heads DIR [--data data/distill/smollm2] [--proposal-vocab 8192] [--out DIR]``

Where the tuned heads go (`output_dir`): ``--out``; without it, back into ``--heads`` (your own
heads directory) or, for the shipped heads, ``./tuned_heads``. Nothing is ever written inside the
installed package unless ``--update-shipped-heads`` says so (maintainers re-tuning the shipped heads).

1. Proposal vocabulary (optional, ``--proposal-vocab N``): the N most frequent tokens of the
   self-distilled training split; the heads then propose only those (their vocabulary projection
   per step shrinks by V / N; verification still uses the full vocabulary, so output is unchanged).
2. Calibration: at every position of the held-out chats of the self-distillation data (prompts
   from the training pool, never the evaluation sets; answers are the backbone's own greedy
   tokens), the rank of the true token among each head's proposals (`tuning.replay.path_ranks`; hydra
   heads read the true tokens before it). The per-head rank accuracies ``acc[k][r]`` follow, but
   the ranks themselves say exactly what any tree accepts at each position.
3. Tree search: trees grown node by node for the fewest decoding steps on those chats
   (`tuning.replay.search_tree`), with greedy decoding replayed step by step (`tuning.replay.Replay`), with
   decoding's prompt lookup unless ``--prompt-lookup 0``. Medusa Sec. 3.3.1 instead multiplies the
   per-head accuracies as if the heads erred independently, which on SmolLM2's hydra heads
   overestimated tokens per step by 0.07-0.10; and the tree of most acceptance summed over the
   positions (a chain, at 4 nodes) decodes in more steps than the one grown for steps, because a
   long acceptance skips the positions it covers (docs/performance.md).
4. Hardware-aware choice: the verify cost ``c(T) = t(Medusa step with the T-node tree) / t(plain
   step)`` is measured on this device (`medusa_jax.tuning.cost`; the mean over the KV cache sizes of
   ``--cost-cache-sizes``, on the products decoding runs: `medusa_jax.kernels`), and the tree that
   maximises the predicted speedup, replayed tokens per step / c(T) (a step with prompt lookup
   verifies max(T, K + 1) nodes), is saved as the heads' ``medusa_choices``, with the whole table
   (``tree_search`` in config.json). decode.py and the benchmark use it by default; the benchmark
   prints the predicted tokens per step beside the measured one. The step costs depend on the
   weights (``--weights``: a GGUF file's blocks cost relatively more per extra row than float32),
   so the report says which it was measured on (``weights``), an earlier report on the other kind
   is kept (``tree_search_by_weights``), and decoding reads the one for its own weights
   (`resolve.heads_calibration`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax.cli import interruptible
from medusa_jax import kernels
from medusa_jax.decoding.dynamic_spec import DEFAULT_DYNAMIC_WIDTH
from medusa_jax.decoding.tree import build_tree, dynamic_tree, with_lookup
from medusa_jax.train.distill import SAMPLES_FILE
from medusa_jax.train.examples import distilled_for_another_model
from medusa_jax.tuning.calibrate import (
    DEFAULT_OUT,
    DEFAULT_SIZES,
    OutputDirError,
    calibration_data,
    choose_tree,
    dynamic_rows,
    format_extras,
    output_dir,
    timing_prompt,
)
from medusa_jax.tuning.confidence import fit_confidence, fit_lookup_confidence, fit_lookup_ngram_confidence
from medusa_jax.tuning.replay import (Replay, dynamic_accepted, lookup_drafts, proposal_events, rank_accuracies_of,
                                      ranks_of, search_tree)


def _report_markdown(report: dict) -> str:
    """One tune report (``tree_search``) as a markdown section: its static trees' table and, when it
    timed them, its dynamic trees' (the chosen row marked)."""
    chosen, rows, dynamic = report.get("dynamic_tree"), report.get("rows") or [], report.get("dynamic_rows") or []
    best = next((r for r in dynamic if chosen and r.get("dynamic") == chosen), None) \
        or next((r for r in rows if not chosen and r["size"] == report.get("chosen_size")), None)
    width = dynamic[0]["dynamic"]["width"] if dynamic else None
    step = f", plain step {report['plain_step_ms']:.2f} ms" if "plain_step_ms" in report else ""
    return (f"# Tree search: {report.get('weights', 'float32')} weights ({report.get('device')}{step})\n\n"
            + _table(rows, best) + "\n"
            + (f"\nTrees chosen per step (dynamic:T:{width}):\n\n" + _table(dynamic, best) + "\n" if dynamic else ""))


def _table(rows: List[dict], best: Optional[dict]) -> str:
    lookup = any("predicted_tokens_per_step_lookup" in r for r in rows)
    lines = ["| tree tokens T | E[accepted] | tokens/step, heads alone" + (" | tokens/step, with prompt lookup" if lookup
                                                                          else "") + " | c(T) | predicted speedup |",
             "|---:|---:|---:|" + ("---:|" if lookup else "") + "---:|---:|"]
    for r in rows:
        mark = " **(chosen)**" if r is best else ""
        lookup_cell = f" {r.get('predicted_tokens_per_step_lookup', 1.0):.3f} |" if lookup else ""
        lines.append(f"| {r['size']}{mark} | {r['expected_accepted']:.3f} | {r['predicted_tokens_per_step']:.3f} |"
                     f"{lookup_cell} {r['cost']:.3f} | {r['predicted_speedup']:.3f} |")
    return "\n".join(lines)


class _Calibration(NamedTuple):
    """What calibrating the heads on the held-out chats gives (`_calibrate`)."""
    hcfg: Any  # the heads' MedusaConfig, with --proposal-vocab applied
    hp: dict  # their numpy params, likewise
    jhp: dict  # their device params with the proposal projection (`with_proposal_projection`)
    lm: Any  # the backbone's lm_head matrix [D, V]
    val: list  # the held-out chats
    chats: list  # those calibrated on
    pos: Any  # their positions (`train.data.Positions`)
    sources: Any  # each position's (chat index, t) (`calibration_data`)
    events: tuple  # `proposal_events`
    ranks: np.ndarray  # the true token's rank among each head's proposals (`ranks_of`)
    acc: np.ndarray  # rank accuracies [K, topk]
    counts: np.ndarray  # positions per head [K]


class _Dynamic(NamedTuple):
    """The dynamic trees to replay and time (`_dynamic_trees`), and what they were fitted with."""
    trees: dict  # T -> the dynamic tree ({} without --dynamic-width or candidates)
    confidence: Any  # `fit_confidence`, or None
    lookup_conf: Any  # `fit_lookup_confidence`, or None
    by_ngram: Any  # `fit_lookup_ngram_confidence`, or None
    drafts: Any  # the copies the replay checks (`lookup_drafts`), or None
    lookup: Any  # a dynamic tree's prompt lookup (`resolve.dynamic_lookup`), or None


class _Timing(NamedTuple):
    """The step costs measured on this device (`_time_steps`)."""
    by_size: dict  # KV cache slots -> `step_costs` of the static trees
    dynamic_by_size: dict  # KV cache slots -> {T: c(T)} of the dynamic trees
    bandwidth: dict  # KV cache slots -> read bandwidth (bytes/s) measured before them, or None
    weight_bytes: int  # the bytes of weights a plain step streams
    costs: dict  # {"plain_s": mean seconds, "cost": {T: mean c(T)}} over the cache sizes


def _parser() -> argparse.ArgumentParser:
    """medusa-tune's flags."""
    from medusa_jax.cli import common
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog="medusa-tune",
        description="Calibrate the heads, measure the verify cost c(T) on this device and save the tree that "
                    "maximises the tokens per step that replaying greedy decoding of the held-out chats "
                    "gives, over c(T) (see the module docs).",
        formatter_class=HelpFormatter)
    p.add_argument("--heads", default=None, help=common.heads_help(zero=False))
    p.add_argument("--model", default=None, help="HF directory or GGUF (default: the SmolLM2 GGUF)")
    p.add_argument("--data", default="data/distill/smollm2",
                   help="self-distillation directory (samples.jsonl); its held-out split calibrates the heads")
    p.add_argument("--val-fraction", type=float, default=0.04,
                   help="held-out fraction of the chats, in (0, 1); use the training config's so the heads never "
                        "saw them")
    p.add_argument("--seed", type=int, default=0, help="split seed (the training config's)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per chat kept (the training config's)")
    p.add_argument("--max-positions", type=int, default=0,
                   help="calibrate on whole held-out chats until they hold this many positions (0 = all of them)")
    p.add_argument("--proposal-vocab", type=int, default=None,
                   help="restrict proposals to the N most frequent training tokens (0 = whole vocabulary; "
                        "default: keep what the heads have)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="tree sizes T (tokens, root included; comma-separated) to time and compare; 1 is plain "
                        "decoding, always compared")
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
    p.add_argument("--dynamic-width", type=int, default=DEFAULT_DYNAMIC_WIDTH,
                   help="also replay and time trees chosen per step (dynamic:T:W: the T best nodes of the heads' "
                        "proposals each step, hydra heads expanding W per depth) at every size, and keep one when "
                        "it is predicted faster than every static tree; 0: static trees only")
    p.add_argument("--dry-run", action="store_true", help="print the table, save nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_lookup_arg(p)
    common.add_dtype_arg(p)
    return p


def _checked_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Tuple[Any, List[int], List[int]]:
    """The flags' checks (`p.error`, exit 2, on a bad value), and what they give: the static trees'
    prompt lookup (`resolve.tree_lookup`; None without), the tree sizes T to compare (sorted, each
    >= 2, the lookup's step size included) and the KV cache sizes to time (sorted, slots)."""
    from medusa_jax import resolve
    from medusa_jax.cli import common

    if args.dynamic_width < 0:
        p.error(f"--dynamic-width must be >= 0, got {args.dynamic_width}")
    for flag, low in (("max_seq_len", 2), ("max_positions", 0), ("cost_prompt_len", 1), ("steps", 1), ("repeats", 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    if args.proposal_vocab is not None and args.proposal_vocab < 0:
        p.error(f"--proposal-vocab must be >= 0 (0: the whole vocabulary), got {args.proposal_vocab}")
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1) (the held-out chats calibrate the heads), got {args.val_fraction}")
    lookup = resolve.tree_lookup(build_tree([]), args.prompt_lookup).lookup
    sizes = sorted({s for s in common.int_list(p, "--sizes", args.sizes) if s > 1}
                   | ({lookup.num_tokens + 1} if lookup else set()))
    if not sizes:
        p.error(f"--sizes {args.sizes}: no tree of 2 tokens or more to compare with plain decoding")
    cache_sizes = sorted(set(common.int_list(p, "--cost-cache-sizes", args.cost_cache_sizes)))
    return lookup, sizes, cache_sizes


def _load(args: argparse.Namespace, heads_dir: str):
    """(backbone `LoadedModel` without a tokenizer, heads config, heads params) of --model and the
    heads in `heads_dir`, paths and heads checked before the slow model load; None, with the error
    printed on stderr, when one fails (OSError, ValueError)."""
    from medusa_jax.cli import common
    from medusa_jax.convert.medusa_format import load_heads

    try:  # paths and heads before the slow model load
        common.preflight(args.model, heads_dir, None)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    common.enable_compilation_cache()
    try:  # token ids only; with the Medusa-2 tuned layers saved beside the heads, which they were trained with
        model = common.load_backbone(args.model, heads_dir, args.dtype, with_tokenizer=False, weights=args.weights)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    try:
        hcfg, hp = load_heads(heads_dir, model.cfg)
    except (OSError, ValueError) as e:  # HeadsMismatchError: heads of another model
        print(f"error: {e}", file=sys.stderr)
        return None
    return model, hcfg, hp


def _fit_cache_sizes(cache_sizes: List[int], context: int) -> List[int]:
    """The KV cache sizes (slots) that fit in the model's `context` (tokens): those within it, and
    the context itself in place of the larger ones (with a note on stderr)."""
    if any(S > context for S in cache_sizes):  # a small model's context: its own length is the largest cache
        fit = sorted({S for S in cache_sizes if S <= context} | ({context} if max(cache_sizes) > context else set()))
        print(f"note: the model's context is {context} tokens; the steps are timed with KV caches of "
              f"{', '.join(map(str, fit))} slots (not {', '.join(map(str, cache_sizes))})", file=sys.stderr)
        return fit
    return cache_sizes


def _calibrate(args: argparse.Namespace, model, hcfg, hp: dict, progress: bool) -> Optional[_Calibration]:
    """The heads' proposals and the true tokens' ranks among them at every held-out position, with
    --proposal-vocab applied to the heads; prints the rank accuracies. None, with the error printed
    on stderr, when the data holds too little for a held-out chat or bad samples (ValueError)."""
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.heads.medusa import frequent_tokens, with_proposal_projection
    from medusa_jax.models.llama import lm_head_matrix

    lm = lm_head_matrix(model.cfg, model.params)
    try:  # too little data for a held-out chat, bad samples
        train, val, chats, pos, sources = calibration_data(
            model, args.data, args.val_fraction, args.seed, hcfg.num_heads, args.max_seq_len, args.max_positions,
            progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if args.proposal_vocab is not None:
        if args.proposal_vocab:
            hp = {**hp, "proposal_ids": frequent_tokens((ids for ids, _ in train), args.proposal_vocab,
                                                        model.cfg.vocab_size)}
        else:
            hp = {k: v for k, v in hp.items() if k != "proposal_ids"}
        hcfg = hcfg.replace(proposal_vocab_size=args.proposal_vocab)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    events = proposal_events(hcfg, jhp, lm, pos, hcfg.topk, embeddings=token_embeddings(model.params))
    ranks = ranks_of(events[1])
    acc, counts = rank_accuracies_of(ranks, pos.valid, hcfg.topk)
    print(f"calibration: {len(chats)} of {len(val)} held-out chats, positions per head {counts.tolist()}")
    for k in range(hcfg.num_heads):
        print(f"  head {k}: top-1 {acc[k, 0]:.3f}  top-5 {acc[k, :5].sum():.3f}  ranks "
              + " ".join(f"{a:.3f}" for a in acc[k]))
    return _Calibration(hcfg, hp, jhp, lm, val, chats, pos, sources, events, ranks, acc, counts)


def _static_trees(cal: _Calibration, sizes: List[int], lookup):
    """The static trees that decode the held-out chats in the fewest steps (`search_tree`, each
    size's a prefix of the next's). Returns (the node order, the sizes T compared, the prompt lookup
    with its tokens cut to what the heads' trees can verify, the trees of the sizes the heads'
    candidates reach); notes on stderr say what was cut or left out."""
    hcfg = cal.hcfg
    order = search_tree(cal.ranks, max(sizes, default=1), hcfg.topk, Replay(cal.chats, cal.sources, lookup))
    if lookup is not None and order and lookup.num_tokens > len(order):  # its step could not be timed
        print(f"note: these heads draft static trees of at most {len(order) + 1} tokens, so prompt lookup copies "
              f"at most {len(order)} tokens with them (not {lookup.num_tokens}): a copy of k tokens is verified in "
              "a step of k + 1, timed with a static tree of that size", file=sys.stderr)
        sizes = sorted({T for T in sizes if T != lookup.num_tokens + 1} | {len(order) + 1})
        lookup = lookup._replace(num_tokens=len(order))
    trees = [build_tree(order[:T - 1], hcfg.topk) for T in sizes if T - 1 <= len(order)]
    if len(trees) < len(sizes):  # the heads' candidates (topk per head, depth num_heads) run out first
        print(f"note: these heads draft static trees of at most {len(order) + 1} tokens; "
              f"{', '.join(str(T) for T in sizes if T - 1 > len(order))} left out of the static trees", file=sys.stderr)
    return order, sizes, lookup, trees


def _dynamic_trees(args: argparse.Namespace, cal: _Calibration, sizes: List[int], lookup) -> _Dynamic:
    """The trees chosen per step (dynamic:T:W) of every size T the heads draft enough candidates for,
    with the acceptance rates fitted on the held-out chats (`tuning.confidence`); none without
    --dynamic-width. A note on stderr names the sizes left out."""
    from medusa_jax import resolve

    hcfg, chats, sources = cal.hcfg, cal.chats, cal.sources
    dynamic, confidence, lookup_conf, by_ngram, drafts = {}, None, None, None, None  # T -> the dynamic tree
    # a dynamic tree's lookup offers several matches (resolve.default_lookup), a static tree's one
    dyn_lookup = lookup and resolve.dynamic_lookup(lookup.num_tokens)
    if args.dynamic_width:  # how often the drafts are accepted, by their probability (tuning.confidence)
        confidence = fit_confidence(*cal.events)
        if lookup is not None:  # copies measured deeper than the replay reaches (n-gram matching alone), so
            # that a larger tree's longer copies score by their own acceptance (resolve.DYNAMIC_LOOKUP_TOKENS)
            copied, found, ngram = lookup_drafts(chats, sources, dyn_lookup._replace(
                num_tokens=max(dyn_lookup.num_tokens, resolve.DYNAMIC_LOOKUP_TOKENS)))
            try:  # pooled, and by the length of the n-gram matched
                lookup_conf = fit_lookup_confidence(chats, sources, copied, found)
                by_ngram = fit_lookup_ngram_confidence(chats, sources, copied, found, ngram) or None
            except ValueError as e:  # no copy with answer tokens after it (few or short held-out chats)
                print(f"note: {e}; the copies keep the default acceptance rates", file=sys.stderr)
            if lookup.num_tokens <= hcfg.num_heads:  # the copies the replay can check: a copy of k tokens is
                drafts = (copied[..., :lookup.num_tokens], found, ngram)  # the first k of a longer one (lookup_matches)
    for T in sizes if args.dynamic_width else ():  # where the heads draft enough candidates for it
        tree = dynamic_tree(T, min(hcfg.num_heads, T - 1), hcfg.topk, args.dynamic_width, confidence, lookup_conf,
                            by_ngram)
        if tree.dynamic.candidates(tree.max_depth, hcfg.topk, hcfg.head_type == "hydra") >= T - 1:
            dynamic[T] = tree
    if args.dynamic_width and len(dynamic) < len(sizes):
        print(f"note: these heads draft too few candidates for dynamic trees of "
              f"{', '.join(str(T) for T in sizes if T not in dynamic)} tokens (width {args.dynamic_width}); "
              "left out of the dynamic trees", file=sys.stderr)
    return _Dynamic(dynamic, confidence, lookup_conf, by_ngram, drafts, dyn_lookup)


def _time_steps(args: argparse.Namespace, model, cal: _Calibration, trees: list, dynamic: dict, prompt: List[int],
                cache_sizes: List[int], progress: bool) -> _Timing:
    """The verify costs c(T) of the static and dynamic trees, timed on this device at every KV cache
    size, and the plain step's time; prints one line per cache size with the weights' read rate."""
    from medusa_jax.evals.memory import tree_bytes
    from medusa_jax.tuning.cost import step_costs

    heads = (cal.hcfg, cal.jhp)
    by_size, dynamic_by_size = {}, {}
    # the roofline beside the timings (issue 13): the weights a plain step streams over its time,
    # against this machine's read bandwidth measured before each cache size's timings (the CPU's
    # memory: none on another backend, whose weights live in the device's own memory)
    weight_bytes = tree_bytes(model.params)
    bandwidth = {}
    for S in cache_sizes:
        bandwidth[S] = kernels.read_bandwidth() if kernels.in_use() else None
        by_size[S] = step_costs(model.cfg, model.params, heads, trees, prompt, args.steps, args.repeats,
                                S, progress)
        if dynamic:
            dynamic_by_size[S] = step_costs(model.cfg, model.params, heads, list(dynamic.values()), prompt,
                                            args.steps, args.repeats, S, progress)["cost"]
        gbs = weight_bytes / by_size[S]["plain_s"] / 1e9
        roof = f" = {gbs / (bandwidth[S] / 1e9):.2f} of the read bandwidth {bandwidth[S] / 1e9:.1f} GB/s" \
            if bandwidth[S] else ""
        print(f"cache {S} slots: plain step {by_size[S]['plain_s'] * 1e3:.2f} ms ({gbs:.1f} GB/s of weights{roof}), "
              + " ".join(f"c({T})={c:.2f}" for T, c in by_size[S]["cost"].items()))
    costs = {"plain_s": float(np.mean([c["plain_s"] for c in by_size.values()])),
             "cost": {T: float(np.mean([c["cost"][T] for c in by_size.values()])) for T in by_size[cache_sizes[0]]["cost"]}}
    return _Timing(by_size, dynamic_by_size, bandwidth, weight_bytes, costs)


def _choose(args: argparse.Namespace, model, cal: _Calibration, timing: _Timing, dyn: _Dynamic, lookup,
            order: list, progress: bool) -> Tuple[dict, List[dict], List[dict]]:
    """The tree of the highest predicted speedup, and the rows of the static and the dynamic trees
    (`choose_tree`, `dynamic_rows`): a dynamic tree is chosen only when it beats every static one."""
    from medusa_jax.heads.hydra import token_embeddings

    hcfg, jhp, lm, pos = cal.hcfg, cal.jhp, cal.lm, cal.pos
    best, rows = choose_tree(cal.ranks, timing.costs["cost"], hcfg.topk, cal.chats, cal.sources, lookup, order)
    drows = []
    if dyn.trees:  # what each dynamic tree accepts at every held-out position, replayed exactly
        emb = token_embeddings(model.params) if hcfg.head_type == "hydra" else None
        accepted = {T: dynamic_accepted(hcfg, jhp, lm, pos, tree, emb)
                    for T, tree in tqdm(dyn.trees.items(), desc="dynamic trees", unit="tree", disable=not progress)}
        looked = None if dyn.drafts is None else {
            T: dynamic_accepted(hcfg, jhp, lm, pos, with_lookup(tree, dyn.lookup), emb, lookup_drafts=dyn.drafts)
            for T, tree in tqdm(dyn.trees.items(), desc="dynamic trees + lookup", unit="tree", disable=not progress)}
        dyn_cost = {T: float(np.mean([c[T] for c in timing.dynamic_by_size.values()])) for T in dyn.trees}
        drows = dynamic_rows(accepted, dyn_cost, args.dynamic_width, cal.chats, cal.sources, looked)
        best_dynamic = max(drows, key=lambda r: (r["predicted_speedup"], -r["size"]))
        if best_dynamic["predicted_speedup"] > best["predicted_speedup"]:
            best = best_dynamic
    return best, rows, drows


def _print_choice(timing: _Timing, cache_sizes: List[int], prompt: List[int], rows: List[dict], drows: List[dict],
                  best: dict) -> dict:
    """Prints the plain step's time and the trees' tables. Returns the tree kept: `best`, or, when
    no tree beats plain decoding, the fastest tree (with a note on stderr)."""
    print(f"plain step {timing.costs['plain_s'] * 1e3:.2f} ms on {jax.devices()[0].device_kind} (mean over caches of "
          f"{', '.join(map(str, cache_sizes))} slots, prompt {len(prompt)} tokens; products: {kernels.status()})")
    print(_table(rows, best))
    if drows:
        print("trees chosen per step (dynamic:T:W):\n" + _table(drows, best))
    if best["size"] == 1:
        best = max(rows[1:] + drows, key=lambda r: r["predicted_speedup"])
        print(f"note: on this device no tree beats plain decoding with these heads (best: {best['size']} tokens, "
              f"predicted {best['predicted_speedup']:.3f}x); that tree is the one kept with the heads, but "
              "decode.py --no-medusa is faster here", file=sys.stderr)
    return best


def _step_breakdown(args: argparse.Namespace, model, cal: _Calibration, static_best: dict, prompt: List[int],
                    cache_size: int) -> dict:
    """The chosen static tree's step timed part by part (`overhead_breakdown`, milliseconds), printed."""
    from medusa_jax.tuning.cost import overhead_breakdown

    chosen_tree = build_tree([tuple(p) for p in static_best["medusa_choices"]], cal.hcfg.topk)
    breakdown = overhead_breakdown(model.cfg, model.params, (cal.hcfg, cal.jhp), chosen_tree, prompt, args.steps,
                                   args.repeats, cache_size)
    print("per step (ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in breakdown.items() if k.endswith("_ms"))
          + (" (below 0: the parts timed alone take longer than inside the whole step, so the rest is within "
             "the timings' noise)" if breakdown["rest_ms"] < 0 else ""))
    return breakdown


def _report(model, cal: _Calibration, timing: _Timing, dyn: _Dynamic, lookup, cache_sizes: List[int],
            prompt: List[int], rows: List[dict], drows: List[dict], best: dict, static_best: dict,
            breakdown: dict) -> dict:
    """The tune report saved with the heads (``tree_search`` in their config.json)."""
    from medusa_jax.convert.load import weights_of

    confidence, lookup_conf, by_ngram = dyn.confidence, dyn.lookup_conf, dyn.by_ngram
    return {"device": str(jax.devices()[0].device_kind), "weights": weights_of(model.params),
            "plain_step_ms": timing.costs["plain_s"] * 1e3,
            "cost_cache_sizes": cache_sizes, "cost_prompt_tokens": len(prompt),
            "plain_step_ms_by_cache_size": {S: c["plain_s"] * 1e3 for S, c in timing.by_size.items()},
            "cost_by_cache_size": {S: c["cost"] for S, c in timing.by_size.items()}, "products": kernels.status(),
            "weight_bytes": timing.weight_bytes,
            "read_bandwidth_gbs_by_cache_size": {S: b and b / 1e9 for S, b in timing.bandwidth.items()},
            "calibration_chats": len(cal.chats), "calibration_positions": cal.counts.tolist(),
            "rank_accuracies": np.round(cal.acc, 5).tolist(), "chosen_size": best["size"],
            "medusa_choices": static_best["medusa_choices"], "dynamic_tree": best.get("dynamic"),
            "predicted_tokens_per_step": best["predicted_tokens_per_step"],
            "predicted_tokens_per_step_lookup": best.get("predicted_tokens_per_step_lookup"),
            "prompt_lookup": lookup._asdict() if lookup else None, "predicted_by": "replay",
            "step_breakdown_ms": breakdown,
            "rows": [{k: v for k, v in r.items() if k != "medusa_choices"} for r in rows],
            "dynamic_rows": drows, "dynamic_cost_by_cache_size": timing.dynamic_by_size,
            "confidence": confidence and {"knots": list(confidence[0]), "values": [list(v) for v in confidence[1]]},
            "lookup_confidence": lookup_conf and [list(r) for r in lookup_conf],
            "lookup_ngram_confidence": by_ngram and {str(n): list(r) for n, r in by_ngram.items()}}


def _save(args: argparse.Namespace, heads_dir: str, out_dir: str, cal: _Calibration, report: dict, best: dict,
          static_best: dict) -> None:
    """Writes the tuned heads into `out_dir`: their config with `report` (the reports tuned on the
    other kind of weights kept), the Medusa-2 tuned layers beside them and ``tree_search.md``; prints
    what was saved and how to use it."""
    from medusa_jax import resolve
    from medusa_jax.convert.medusa_format import read_heads_config, save_heads
    from medusa_jax.convert.tuned_layers import LAYERS_FILE, tuned_layers_path

    raw = read_heads_config(heads_dir)
    extras = format_extras(raw)
    extras["tree_search"] = report
    # the reports tuned on the other kind of weights stay (`resolve.heads_calibration`)
    others = dict(raw.get("tree_search_by_weights") or {})
    if raw.get("tree_search"):
        others[raw["tree_search"].get("weights", "float32")] = raw["tree_search"]
    others.pop(report["weights"], None)
    extras.pop("tree_search_by_weights", None)
    if others:
        extras["tree_search_by_weights"] = others
    tuned = cal.hcfg.replace(medusa_choices=tuple(tuple(p) for p in static_best["medusa_choices"]))
    # the shipped heads are kept in float16 (half the package size); tuned copies in float32
    save_heads(out_dir, tuned, cal.hp, extra=extras, dtype=np.float16 if args.update_shipped_heads else np.float32)
    layers_file = tuned_layers_path(heads_dir)  # Medusa-2's tuned backbone layers go with their heads
    if layers_file and os.path.realpath(os.path.dirname(layers_file)) != os.path.realpath(out_dir):
        shutil.copy2(layers_file, os.path.join(out_dir, LAYERS_FILE))
    with open(os.path.join(out_dir, "tree_search.md"), "w") as f:
        f.write("\n".join(_report_markdown(r) for r in [report, *others.values()]))
    lookup_note = (f", {best['predicted_tokens_per_step_lookup']:.3f} with prompt lookup"
                   if "predicted_tokens_per_step_lookup" in best else "")
    kind = f"dynamic:{best['size']}:{args.dynamic_width}" if "dynamic" in best else f"{best['size']}-node"
    print(f"saved the {kind} tree (predicted {best['predicted_tokens_per_step']:.3f} tokens/step with the "
          f"heads alone{lookup_note}, speedup {best['predicted_speedup']:.3f}x) with the heads in {out_dir}")
    if os.path.realpath(out_dir) != os.path.realpath(resolve.DEFAULT_HEADS_DIR):
        model_flag = f"--model {args.model} " if args.model else ""
        print(f"use them with: python decode.py {model_flag}--heads {out_dir}")


@interruptible
def main(argv: Optional[Sequence[str]] = None) -> int:
    """medusa-tune (see the module docstring): calibrate the heads, time the trees on this device and
    save the fastest with the heads. Returns the exit status: 0 done (or --dry-run), 2 bad paths,
    heads, model or data (the error on stderr); bad flags exit 2 through argparse."""
    from medusa_jax import resolve
    from medusa_jax.cli import common

    p = _parser()
    args = p.parse_args(argv)
    lookup, sizes, cache_sizes = _checked_args(p, args)
    try:
        out_dir = output_dir(args.heads, args.out, args.update_shipped_heads)  # its checks also for --dry-run
        out_dir = None if args.dry_run else out_dir
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out_dir is not None:  # created now: a path that cannot hold the heads fails before the slow work
        common.make_out_dir(p, out_dir)
    if not os.path.isfile(os.path.join(args.data, SAMPLES_FILE)):
        p.error(f"--data {args.data}: no {SAMPLES_FILE} there; give a self-distillation directory "
                f"(made by `medusa-distill --out {args.data}`)")

    heads_dir = resolve.heads_location(args.heads) or resolve.DEFAULT_HEADS_DIR
    loaded = _load(args, heads_dir)
    if loaded is None:
        return 2
    model, hcfg, hp = loaded
    made_by = distilled_for_another_model(args.data, model.path)
    if made_by is not None:  # the tree would be chosen by how often the heads match another model's answers
        print(f"note: --data {args.data} holds another model's answers (its meta.json), not {model.path}'s: the "
              "tree is chosen by how often the heads match those; give this model's own (medusa-distill "
              f"--model {model.path} --out DIR, then --data DIR)", file=sys.stderr)
    cache_sizes = _fit_cache_sizes(cache_sizes, model.cfg.max_position_embeddings)
    if args.proposal_vocab is not None and args.proposal_vocab > model.cfg.vocab_size:
        p.error(f"--proposal-vocab {args.proposal_vocab} is larger than the model's vocabulary "
                f"({model.cfg.vocab_size}); give at most that (0: the whole vocabulary)")
    progress = not args.no_progress
    cal = _calibrate(args, model, hcfg, hp, progress)
    if cal is None:
        return 2

    order, sizes, lookup, trees = _static_trees(cal, sizes, lookup)
    dyn = _dynamic_trees(args, cal, sizes, lookup)
    prompt = timing_prompt(cal.val, args.cost_prompt_len)
    timing = _time_steps(args, model, cal, trees, dyn.trees, prompt, cache_sizes, progress)
    best, rows, drows = _choose(args, model, cal, timing, dyn, lookup, order, progress)
    best = _print_choice(timing, cache_sizes, prompt, rows, drows, best)
    # the static tree is kept either way (tools without dynamic trees read medusa_choices); its step's breakdown
    static_best = best if "dynamic" not in best else max(rows[1:], key=lambda r: (r["predicted_speedup"], -r["size"]))
    breakdown = _step_breakdown(args, model, cal, static_best, prompt, cache_sizes[0])
    if args.dry_run:
        return 0
    report = _report(model, cal, timing, dyn, lookup, cache_sizes, prompt, rows, drows, best, static_best, breakdown)
    _save(args, heads_dir, out_dir, cal, report, best, static_best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
