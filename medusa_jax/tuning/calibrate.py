"""The library half of `medusa-tune`: calibrate the heads on held-out chats, grow trees for them, and
choose the tree that decodes fastest on this device."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from medusa_jax import resolve
from medusa_jax.convert.medusa_format import OUR_KEYS
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.train import data as D
from medusa_jax.train.data import plain_positions
from medusa_jax.train.hidden import Backbone, compute_positions, position_sources
from medusa_jax.tuning.replay import Replay, path_ranks, rank_accuracies_of, search_tree, tree_accepted

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
      heads: the --heads directory, or None for the shipped heads (`resolve.DEFAULT_HEADS_DIR`).
      out: the --out directory, or None.
      update_shipped: --update-shipped-heads: write into the shipped heads directory.
    Returns: `out` when given; the shipped heads directory when `update_shipped`; else `heads` when it
      is a directory outside the installed package (tuned in place); else `DEFAULT_OUT` in the
      current directory. The path is absolute.
    Raises:
      OutputDirError: `out` is inside the installed medusa_jax package without `update_shipped`, or
        both `out` and `update_shipped` are given.
    """

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # medusa_jax/
    heads = resolve.heads_location(heads)
    # --update-shipped-heads writes to the shipped heads being tuned (--heads medusa1), else the default ones
    shipped = heads if heads in resolve.SHIPPED_HEADS.values() else resolve.DEFAULT_HEADS_DIR
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
    is P(rank r right | the path so far right), which is what `decoding.tree_estimates.expected_acceptance_length`
    multiplies along a path.

    Args:
      hidden: [P, D] float32 backbone hidden states at positions t.
      labels: [K, P] int32, the base model's greedy token at t + k + 2 for head k.
      valid: [K, P] bool, whether that label exists.
      topk: ranks to measure.
      path_tokens: hydra heads: [K, P] int32 tokens t+1..t+K (`data.path_tokens`); ignored by Medusa heads.
      embeddings: hydra heads: [V, D] the backbone's input embeddings (`heads.hydra.token_embeddings`).
    Returns:
      (acc [K, topk] float64: acc[k][r] = hits of head k at rank r / counts[k], counts [K] int64).
    Raises ValueError when some head has no valid position, or hydra heads lack path_tokens or embeddings.
    """

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
      ranks: [P, K] `tuning.replay.path_ranks` of the held-out positions.
      cost: {T: c(T)} measured relative step costs (T = tree tokens, root included; T = 1 is plain
        decoding with c = 1 and is always a candidate).
      chats, sources: the held-out chats (token ids, loss mask) and the (chat, t) of each position
        (`train.hidden.position_sources`): tokens per step are then those of decoding the answers
        step by step (`tuning.replay.replay`); without them, 1 + the mean accepted over the positions.
      lookup: with chats, also replay decoding with this prompt lookup, and choose on that. A step
        then verifies max(T, k + 1) nodes (`decoding.tree_arrays.padded_arrays`), so it costs c(max(T, k + 1)),
        which `cost` must hold.
      order: the trees' paths in the order `tuning.replay.search_tree` adds them (each size's tree is a
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


def dynamic_rows(accepted: Dict[int, np.ndarray], cost: Dict[int, float], width: int, chats: Sequence,
                 sources: np.ndarray, accepted_lookup: Optional[Dict[int, np.ndarray]] = None) -> List[dict]:
    """`choose_tree`'s rows for trees chosen per step (`drafts.dynamic`, ``dynamic:T:W``).

    Args:
      accepted: {T: [P] candidates the dynamic tree of T nodes accepts at each held-out position}
        (`tuning.replay.dynamic_accepted`), the heads alone.
      cost: {T: c(T)} of the dynamic trees (their draft's own work included; the copied chain of
        prompt lookup shares the T slots, so it costs nothing more).
      width: the trees' width W. chats, sources: as `choose_tree`.
      accepted_lookup: {T: [P]} the same with prompt lookup's chain competing for the slots
        (`dynamic_accepted` with `lookup_drafts`), or None.
    Returns:
      rows as `choose_tree`'s, with ``"dynamic": {"budget": T, "width": W}`` instead of paths.
    """
    decode = Replay(chats, sources)  # the copied chain is inside the trees: no separate lookup steps
    rows = []
    for T in sorted(accepted):
        a = accepted[T]
        tps = decode.tokens_per_step(a)
        row = {"size": T, "dynamic": {"budget": T, "width": width},
               "expected_accepted": float(a.mean()) if len(a) else 0.0, "predicted_tokens_per_step": tps,
               "cost": float(cost[T])}
        if accepted_lookup is not None:
            row["predicted_tokens_per_step_lookup"] = tps = decode.tokens_per_step(accepted_lookup[T])
        rows.append({**row, "predicted_speedup": tps / row["cost"]})
    return rows


def calibration_data(model, data_dir: str, val_fraction: float, seed: int, num_heads: int, max_seq_len: int,
                      max_positions: int, progress: bool):
    """(train, val, chats, pos, sources): the split of the self-distilled chats, the held-out chats
    calibrated (cut to max_seq_len; whole chats, in a seeded order, until they hold max_positions
    positions; 0 = all), their `Positions` and each position's (chat index, t)."""

    examples = D.load_distilled(data_dir)
    train, val = D.split_train_val(examples, val_fraction, seed)
    if not val:
        raise ValueError(f"{data_dir}: its {len(examples)} chats with val_fraction={val_fraction} leave no held-out "
                         "chat for calibration; distill more chats (medusa-distill) or raise --val-fraction")
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


def timing_prompt(val, target_len: int) -> List[int]:
    """The prompt part of the held-out chat whose prompt length is closest to target_len."""
    prompts = []
    for ids, mask in val:
        mask = np.asarray(mask, bool)
        start = int(np.argmax(mask)) if mask.any() else len(ids)
        prompts.append(list(np.asarray(ids[:start], np.int64)))
    prompts = [p for p in prompts if p]
    return min(prompts, key=lambda p: (abs(len(p) - target_len), len(p)))


def format_extras(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if k not in OUR_KEYS and k != "version" and k != "tree_search"}
