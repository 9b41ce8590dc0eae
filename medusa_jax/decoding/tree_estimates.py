"""Trees from per-head rank accuracies under independent heads (Medusa, Cai et al. 2024, Sec. 3.3.1):
the expected acceptance length of a tree, and the greedy tree of a given size. `medusa_jax.tuning`
replays held-out chats instead, which needs no independence; these remain for training's quick
tree choice and the estimates printed beside it."""
from __future__ import annotations

import heapq
from typing import Any, Iterable, Sequence

import numpy as np

from medusa_jax.decoding.tree import Path, TreeBuffers, normalise_choices


def _accuracies(head_accuracies: Any) -> np.ndarray:
    acc = np.asarray(head_accuracies, dtype=np.float64)
    if acc.ndim != 2:
        raise ValueError(f"head_accuracies must be 2-D [num_heads, topk], got shape {acc.shape}")
    if not np.all(np.isfinite(acc)) or acc.min(initial=0.0) < 0 or acc.max(initial=0.0) > 1:
        raise ValueError("head_accuracies must be probabilities in [0, 1]")
    return acc


def expected_acceptance_length(choices: TreeBuffers | Iterable[Sequence[int]],
                               head_accuracies: Any) -> float:
    """Expected accepted Medusa tokens per step under independent heads (Medusa Sec. 3.3.1).

    ``head_accuracies[k][r]`` = P(head k's rank-r token is right), shape [num_heads, topk'].
    Returns ``sum over non-root nodes of prod_i acc[i][r_i]``; tokens per step is 1 + this.
    Raises: ValueError if a path is deeper than the number of heads or a rank has no accuracy, or
      the accuracies are not a 2-D array of probabilities.
    """
    acc = _accuracies(head_accuracies)
    paths = choices.medusa_choices if isinstance(choices, TreeBuffers) else \
        normalise_choices(choices, max(acc.shape[1], 1), acc.shape[0])
    total = 0.0
    for p in paths:
        if len(p) > acc.shape[0] or max(p) >= acc.shape[1]:
            raise ValueError(f"path {p} is outside head_accuracies of shape {acc.shape}")
        total += float(np.prod([acc[i, r] for i, r in enumerate(p)]))
    return total


def greedy_tree_search(head_accuracies: Any, num_nodes: int, topk: int = 10) -> tuple[Path, ...]:
    """Greedy tree construction (Medusa Sec. 3.3.1): repeatedly add the node of highest path
    probability ``prod_i acc[i][r_i]`` whose parent is already in the tree.

    ``num_nodes`` counts tree tokens, root included (``num_nodes - 1`` paths are returned; fewer
    if the heads/ranks run out). Ranks are limited to ``min(topk, head_accuracies.shape[1])``;
    ties go to the smaller (depth, ranks). The result is in insertion order, so every prefix of it
    is the greedy tree of that size (prefix-closed); pass it to build_tree.
    Raises: ValueError if ``num_nodes < 1`` or the accuracies are not 2-D probabilities.
    """
    acc = _accuracies(head_accuracies)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1 (the root), got {num_nodes}")
    k = min(topk, acc.shape[1])
    heap: list[tuple[float, int, Path]] = []

    def push_children(path: Path, prob: float) -> None:
        if len(path) < acc.shape[0]:
            for r in range(k):
                child = path + (r,)
                heapq.heappush(heap, (-prob * acc[len(path), r], len(child), child))

    out: list[Path] = []
    push_children((), 1.0)
    while heap and len(out) < num_nodes - 1:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        push_children(path, -neg)
    return tuple(out)
