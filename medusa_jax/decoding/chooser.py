"""Which tree a decoding step verifies, from measured step times and acceptance (`TreeChooser`)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from medusa_jax.decoding.tree import TreeBuffers

#: What `Engine(speculation=...)` takes: choose the tree per step, always the full tree, or plain.
SPECULATION = ("adaptive", "always", "off")


class TreeChooser:
    """Which tree a step verifies, from measured step times and acceptance (`Engine`).

    Per tree, the tokens a live row gains per step (a running mean, started from `priors`), and per
    (tree, batch rows) the seconds of a step (a running mean, measured; a pair never measured is
    tried first). A step takes the tree with the most expected tokens per second,
    ``live rows * tokens per row-step / seconds per step``, and every `explore_every` steps the
    least recently measured other tree once, so the means follow the load. Mode "always": the full
    tree (the last); "off": plain (the first).
    """

    def __init__(self, trees: Sequence[TreeBuffers], mode: str = "adaptive", priors: Optional[Sequence[float]] = None,
                 explore_every: int = 64, smoothing: float = 0.2):
        if mode not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {mode!r}")
        self.trees, self.mode = list(trees), mode
        self.gain = list(priors) if priors is not None else [1.0] + [1.5] * (len(self.trees) - 1)
        self.measured = [0] * len(self.trees)
        self.seconds: Dict[Tuple[int, int], float] = {}
        self.last_used: Dict[Tuple[int, int], int] = {}
        self.explore_every, self.smoothing = explore_every, smoothing
        self.steps = 0
        self.chosen = [0] * len(self.trees)

    def choose(self, rows: int, live: int) -> int:
        """The index of the tree for a step of `rows` batch rows, `live` of them decoding."""
        if self.mode == "off" or len(self.trees) == 1:
            return 0
        if self.mode == "always":
            return len(self.trees) - 1
        keys = [(i, rows) for i in range(len(self.trees))]
        unmeasured = [k for k in keys if k not in self.seconds]
        if unmeasured:
            return unmeasured[0][0]
        if self.steps and self.steps % self.explore_every == 0:
            return min(keys, key=lambda k: self.last_used.get(k, -1))[0]
        return max(range(len(self.trees)), key=lambda i: live * self.gain[i] / self.seconds[(i, rows)])

    def update(self, index: int, rows: int, seconds: float, accepted_per_row: float) -> None:
        """Record a step: its seconds and the mean tokens it gave a live row."""
        a = self.smoothing
        key = (index, rows)
        self.seconds[key] = seconds if key not in self.seconds else (1 - a) * self.seconds[key] + a * seconds
        # the first measurement replaces the prior
        self.gain[index] = accepted_per_row if not self.measured[index] else (
            (1 - a) * self.gain[index] + a * accepted_per_row)
        self.measured[index] += 1
        self.last_used[key] = self.steps
        self.steps += 1
        self.chosen[index] += 1
