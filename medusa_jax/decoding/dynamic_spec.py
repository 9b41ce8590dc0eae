"""The settings of a tree chosen per step (``"dynamic:T"``, `decoding.tree.dynamic_tree`,
`drafts.dynamic`): its node budget and width, and the measured scores its nodes are ranked by (the
heads' confidence, prompt lookup's per depth and per matched n-gram), with their checks and parsing
from files and reports (numpy only)."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np


class DynamicSpec(NamedTuple):
    """A tree chosen per step (`decoding.tree.dynamic_tree`, `medusa_jax.drafts.dynamic`).

    budget: T, the nodes one step verifies, root included (a static shape).
    width: W, the best nodes of a depth whose children are drafted (hydra heads run on W paths per
      depth; Medusa heads' children cost nothing, so for them every node of the best T - 1 may be
      expanded and W is ignored).
    confidence: None (a node scores its head's log-probability), or ``(knots, values)``: knots [J]
      increasing head log-probabilities and values [D'][J], per depth, the log-probability that a
      node of that head log-probability is accepted once its parent is (`tuning.confidence`,
      measured on held-out chats; interpolated linearly, depths past D' use the last row).
    lookup_confidence: with prompt lookup, rows of per-depth log-probabilities that a copied token
      is accepted once its parent is: row 0 for the latest match's chain, row 1 for the other
      matches' nodes that differ from an earlier chain (None, or rows missing:
      `LOOKUP_CONFIDENCE`); the copied chains' nodes compete with the heads' for the budget
      (`drafts.dynamic.add_chain_tokens`).
    lookup_ngram_confidence: None, or ``((n, row), ...)``: for the latest match's chain, the per-depth
      log-probabilities when the context's last n tokens matched (`drafts.lookup.ngram_drafts`'
      ngram; a longer match is a surer copy: on the shipped heads' held-out chats a copied token
      after a 6-gram is accepted 0.91 of the time, after a bare 2-gram 0.54); where it has no row for
      n, `lookup_confidence`'s. The rows hold for the n-gram range they were measured with: the
      longest n there means "n or longer" (tune measures with decoding's, `resolve.default_lookup`).
    """
    budget: int
    width: int
    confidence: tuple[tuple[float, ...], tuple[tuple[float, ...], ...]] | None = None
    lookup_confidence: tuple[tuple[float, ...], ...] | None = None
    lookup_ngram_confidence: tuple[tuple[int, tuple[float, ...]], ...] | None = None

    def lookup_rates(self, num_tokens: int, matches: int = 1) -> tuple[tuple[float, ...], ...]:
        """Per copied chain (the latest match first), its `num_tokens` per-depth log-probabilities
        (`drafts.dynamic.add_chain_tokens`): `lookup_confidence`'s rows, `LOOKUP_CONFIDENCE`'s
        where it has none, the last row for every later match and the last value for deeper tokens."""
        rows = tuple(self.lookup_confidence or ()) + LOOKUP_CONFIDENCE[len(self.lookup_confidence or ()):]
        rows = [rows[min(c, len(rows) - 1)] for c in range(matches)]
        return tuple(tuple(float(r[min(j, len(r) - 1)]) for j in range(num_tokens)) for r in rows)

    def lookup_rate_table(self, num_tokens: int, matches: int, max_ngram: int) -> np.ndarray:
        """[m, k, max_ngram + 1] float32: chain c's log-probability at depth j when the match was an
        n-gram (column n; `drafts.dynamic.draft_candidates` takes column ``ngram`` per row):
        `lookup_ngram_confidence`'s row for n for the latest match's chain, `lookup_rates` elsewhere."""
        table = np.repeat(np.asarray(self.lookup_rates(num_tokens, matches), np.float32)[:, :, None],
                          max_ngram + 1, axis=2)
        for n, row in self.lookup_ngram_confidence or ():
            if n <= max_ngram:
                table[0, :, n] = [row[min(j, len(row) - 1)] for j in range(num_tokens)]
        return table

    def check(self, depth: int, topk: int) -> "DynamicSpec":
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, np.integer)) or self.budget < 2:
            raise ValueError(f"a dynamic tree needs a budget of at least 2 nodes (the root and one more), "
                             f"got {self.budget!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, (int, np.integer)) or self.width < 1:
            raise ValueError(f"a dynamic tree's width must be a positive integer, got {self.width!r}")
        if depth < 1:
            raise ValueError("a dynamic tree needs at least one head (depth >= 1)")
        if self.lookup_confidence is not None and (not self.lookup_confidence or any(
                not r or any(not x <= 0 for x in r) for r in self.lookup_confidence)):
            raise ValueError("a dynamic tree's lookup_confidence must be log-probabilities <= 0, one per depth "
                             "(a list, or a list of such lists: the latest match's, then the others')")
        if self.lookup_ngram_confidence is not None and any(
                isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or not r
                or any(not x <= 0 for x in r) for n, r in self.lookup_ngram_confidence):
            raise ValueError("a dynamic tree's lookup_ngram_confidence must map n-gram sizes >= 1 to lists of "
                             "log-probabilities <= 0, one per depth")
        if self.confidence is not None:
            knots, values = self.confidence
            if len(knots) < 2 or any(b <= a for a, b in zip(knots, knots[1:])) or not values or any(
                    len(v) != len(knots) or any(x > 0 for x in v) for v in values):
                raise ValueError("a dynamic tree's confidence must be (knots, values): at least 2 increasing "
                                 "log-probabilities and, per depth, as many log-probabilities <= 0")
        most = sum(topk ** d for d in range(1, depth + 1))
        if self.budget - 1 > most:
            raise ValueError(f"a dynamic tree of {self.budget} nodes has more nodes than depth {depth} and topk "
                             f"{topk} can draft ({most} below the root); raise topk or lower the budget")
        return self

    def candidates(self, depth: int, topk: int, hydra: bool) -> int:
        """How many candidates a step drafts (hydra heads: `width` parents per depth; Medusa heads:
        every one of the best T - 1 of a depth)."""
        width = self.width if hydra else self.budget - 1
        n, total = 1, 0
        for d in range(depth):
            total += n * topk
            n = min(width, n * topk, self.budget - 1 - d)
        return total


#: Per depth, the log-probability that prompt lookup's copied token is accepted once its parent is,
#: where a dynamic tree's spec does not say (`DynamicSpec.lookup_confidence`): the latest match's
#: chain, then the other matches' nodes that differ from an earlier chain. Measured on the shipped
#: heads' held-out chats with n-grams of 2-3 (0.78, 0.85, 0.88; 0.35, 0.55, 0.67; docs/performance.md).
LOOKUP_CONFIDENCE = ((-0.25, -0.17, -0.13), (-1.06, -0.59, -0.40))

#: Parents expanded per depth by a dynamic tree's hydra heads when the spec does not say.
DEFAULT_DYNAMIC_WIDTH = 4


def dynamic_spec(budget: int, width: int, confidence: Any = None, lookup_confidence: Sequence | None = None,
                 lookup_ngram_confidence: Any = None) -> DynamicSpec:
    """A `DynamicSpec` from the forms files and tune's reports hold them in (`decoding.tree.dynamic_tree`'s
    arguments), not yet checked against the heads (`DynamicSpec.check`).
    Raises: ValueError for a malformed confidence."""
    if isinstance(confidence, Mapping):
        confidence = (confidence.get("knots"), confidence.get("values"))
    if confidence is not None:
        try:
            knots, values = confidence
            confidence = (tuple(float(x) for x in knots), tuple(tuple(float(x) for x in v) for v in values))
        except (TypeError, ValueError):
            raise ValueError("a dynamic tree's confidence must be (knots, values) or {\"knots\": [...], "
                             "\"values\": [[...], ...]}") from None
    if lookup_confidence is not None:
        try:
            rows = [lookup_confidence] if all(np.ndim(x) == 0 for x in lookup_confidence) else lookup_confidence
            lookup_confidence = tuple(tuple(float(x) for x in r) for r in rows)
        except (TypeError, ValueError):
            raise ValueError("a dynamic tree's lookup_confidence must be a list of log-probabilities, one per "
                             "depth, or a list of such lists") from None
    if lookup_ngram_confidence is not None:
        try:
            pairs = lookup_ngram_confidence.items() if isinstance(lookup_ngram_confidence, Mapping) \
                else lookup_ngram_confidence
            lookup_ngram_confidence = tuple(sorted((int(n), tuple(float(x) for x in r)) for n, r in pairs))
        except (TypeError, ValueError):
            raise ValueError("a dynamic tree's lookup_ngram_confidence must be {n: [log-probability per depth, "
                             "...], ...}") from None
    return DynamicSpec(budget, width, confidence, lookup_confidence, lookup_ngram_confidence)
