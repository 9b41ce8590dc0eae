"""How often a drafted node is accepted, as a function of its head's probability, measured on held-out
chats: the scores a tree chosen per step ranks its nodes by (`drafts.dynamic`, ``DynamicSpec.confidence``).

A dynamic tree keeps the T - 1 nodes with the highest probability of being accepted. A node is
accepted when its parent is and its own token is the target's next one, so that probability is the
product, along the node's path, of each node's acceptance given its parent's. The heads' own
probabilities estimate it badly: heads trained on hard targets are over- or under-confident, and
differently per depth. Teacher forcing gives the exact event for each depth: with the path's
earlier tokens the answer's own (the parent accepted), is the head's rank-r proposal the answer's
next token? Binning those events by the proposal's head log-probability and fitting a
nondecreasing map per depth (isotonic regression, pool-adjacent-violators) gives the calibrated
scores (Platt 1999 / Zadrozny and Elkan 2002 for calibration; EAGLE-2, Li et al. 2024, Sec. 4, for
why the tree's expected acceptance is the sum of its nodes' path probabilities).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np

Confidence = Tuple[Tuple[float, ...], Tuple[Tuple[float, ...], ...]]


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The nondecreasing sequence closest to `y` in `w`-weighted squared error (pool adjacent violators)."""
    blocks = []  # [value, weight, length]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            wt = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / wt if wt > 0 else (v1 + v2) / 2, wt, n1 + n2])
    return np.concatenate([np.full(n, v) for v, _, n in blocks])


def fit_confidence(logprob: np.ndarray, hit: np.ndarray, valid: np.ndarray, bins: int = 24,
                   floor: float = 1e-4) -> Confidence:
    """Per depth, the probability that a proposal of a given head log-probability is accepted once its
    parent is (module docstring), as ``DynamicSpec.confidence``.

    Args:
      logprob, hit, valid: `tuning.replay.proposal_events`' arrays ([K, P, topk], [K, P, topk], [K, P]).
      bins: the knots, at quantiles of all heads' proposal log-probabilities (shared by the depths).
      floor: the least acceptance probability a knot may have (log 1e-4 = -9.2 nats).
    Returns:
      (knots [J] increasing log-probabilities, values [K][J] log acceptance probabilities <= 0,
      nondecreasing along each row), J <= bins + 1.
    Raises:
      ValueError: no labelled position.
    """
    K = logprob.shape[0]
    m = np.broadcast_to(valid[:, :, None], logprob.shape)
    if not m.any():
        raise ValueError("no labelled held-out position to measure the heads' confidence on")
    pooled = np.sort(logprob[m].astype(np.float64))
    edges = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, bins + 1)))
    mids = np.array([pooled[(pooled >= a) & (pooled <= b)].mean() for a, b in zip(edges, edges[1:])])
    centers = np.unique(np.concatenate([[pooled[0] - 1.0], mids, [0.0]]))
    prior = np.exp(mids)                            # where a bin is empty, trust the head's own probability
    values = []
    for k in range(K):
        x, y = logprob[k][m[k]].astype(np.float64), hit[k][m[k]].astype(np.float64)
        which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
        n = np.bincount(which, minlength=len(edges) - 1).astype(np.float64)
        h = np.bincount(which, weights=y, minlength=len(edges) - 1)
        rate = _isotonic((h + prior) / (n + 1.0), n + 1.0)
        rate = np.clip(np.interp(centers, mids, rate), floor, 1.0)
        values.append(tuple(float(v) for v in np.log(np.maximum.accumulate(rate))))
    return tuple(float(c) for c in centers), tuple(values)


def fit_lookup_confidence(chats: Sequence[Tuple[np.ndarray, np.ndarray]], sources: np.ndarray, copied: np.ndarray,
                          found: np.ndarray, floor: float = 1e-3) -> Tuple[Tuple[float, ...], ...]:
    """Per depth, the log-probability that prompt lookup's copied token is accepted once its parent
    is (``DynamicSpec.lookup_confidence``), on the held-out chats' answers: row 0 for the latest
    match's chain; with several matches, row 1 for the other chains' tokens whose path differs from
    every earlier chain's (the nodes `drafts.dynamic.add_chain_tokens` adds for them).

    Args:
      chats: (token ids [L], loss mask [L]) pairs; sources: [P, 2] (chat, t) of the positions.
      copied, found: `tuning.replay.lookup_drafts` at those positions ([P, m, k], [P, m]).
      floor: the least probability a depth may get.
    Returns: 1 row (m = 1, or no later match's own token reached) or 2 rows of k log-probabilities
      <= 0 (depths never reached: the last measured one); a missing row means the default,
      `decoding.dynamic_spec.LOOKUP_CONFIDENCE`, as `DynamicSpec.lookup_rates` fills it.
    Raises ValueError when no position found a copy.
    """
    src = np.asarray(sources).reshape(-1, 2)
    m, k = copied.shape[1], copied.shape[2]
    reach, hits = np.zeros((2, k)), np.zeros((2, k))
    for p in np.flatnonzero(found[:, 0]):
        ids, mask = (np.asarray(a) for a in chats[int(src[p, 0])])
        t = int(src[p, 1])
        truth = ids[t + 2:t + 2 + k]
        room = int(np.cumprod(mask[t + 2:t + 2 + k]).sum())  # answer tokens left to check
        for c in np.flatnonzero(found[p]):
            ok = np.cumprod(copied[p, c, :room] == truth[:room])
            parent_ok = np.concatenate([[1], ok[:-1]])[:room]
            new = np.ones(room, bool)  # depths where chain c's path differs from every earlier chain's
            for e in range(c):
                if found[p, e]:
                    new &= np.cumprod(copied[p, e, :room] == copied[p, c, :room]) == 0
            row = min(c, 1)
            reach[row, :room] += parent_ok * new
            hits[row, :room] += ok * new
    if not reach[0, 0]:
        raise ValueError("prompt lookup found no copy on the held-out chats: nothing to measure")
    rows = []
    for r in range(min(m, 2)):
        if not reach[r, 0]:  # the later matches' row left to the defaults (`DynamicSpec.lookup_rates`)
            break
        rate = np.where(reach[r] > 0, hits[r] / np.maximum(reach[r], 1), np.nan)
        rate = np.where(np.isnan(rate), rate[~np.isnan(rate)][-1], rate)
        rows.append(tuple(float(x) for x in np.log(np.clip(rate, floor, 1.0))))
    return tuple(rows)


def fit_lookup_ngram_confidence(chats: Sequence[Tuple[np.ndarray, np.ndarray]], sources: np.ndarray,
                                copied: np.ndarray, found: np.ndarray, ngram: np.ndarray, min_positions: int = 200,
                                floor: float = 1e-3) -> Dict[int, Tuple[float, ...]]:
    """`fit_lookup_confidence`'s row for the latest match, per size n of the n-gram that matched
    (``DynamicSpec.lookup_ngram_confidence``): a copy after a long match is accepted far more often
    than one after a bare 2-gram (0.91 against 0.54 at depth 1 on the shipped heads' held-out chats,
    docs/performance.md), so each scores by its own rate.

    Args: as `fit_lookup_confidence`, with ngram [P] int32 (`tuning.replay.lookup_drafts`, 0 where
      none matched); sizes matched at fewer than `min_positions` positions are left out (their
      copies score by the pooled row).
    Returns: {n: k log-probabilities <= 0}, possibly empty.
    """
    ngram = np.asarray(ngram)
    out = {}
    for n in sorted(set(ngram[ngram > 0].tolist())):
        latest = np.zeros_like(np.asarray(found, bool))
        latest[:, 0] = np.asarray(found)[:, 0] & (ngram == n)
        if latest[:, 0].sum() >= min_positions:
            out[int(n)] = fit_lookup_confidence(chats, sources, copied, latest, floor)[0]
    return out
