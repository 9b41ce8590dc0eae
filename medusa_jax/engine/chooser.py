"""Which tree a decoding step verifies, from measured step times and acceptance (`TreeChooser`)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, Optional, Sequence, Tuple

from medusa_jax.decoding.tree import TreeBuffers

#: What `Engine(speculation=...)` takes: choose the tree per step, always the full tree, or plain.
SPECULATION = ("adaptive", "always", "off")


class TreeChooser:
    """Which tree a step verifies, from measured step times and acceptance (`Engine`).

    Per tree, the tokens a live row gains per step (the mean of its first steps, then an
    exponential mean with weight `smoothing`: acceptance varies from step to step and request to
    request, so it needs a long memory; before any step, `priors`), and per (tree, batch rows) the
    seconds of a step (the least of its last `window` measurements: interference only ever adds
    time; a pair measured fewer than `min_measured` times is tried first, so that one slow call,
    such as the first of a new executable, never rules a tree out for long). A step takes the tree
    with the most expected tokens per second,
    ``live rows * tokens per row-step / seconds per step``, and re-measures each other tree once it
    has not run for `explore_every` steps times how much slower it was (and its step is compiled for
    the shapes at hand), so the means follow the load at little cost. Mode "always": the full
    tree (the last); "off": plain (the first).
    """

    def __init__(self, trees: Sequence[TreeBuffers], mode: str = "adaptive", priors: Optional[Sequence[float]] = None,
                 explore_every: int = 32, smoothing: float = 0.03, window: int = 8, min_measured: int = 2):
        if mode not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {mode!r}")
        self.trees, self.mode = list(trees), mode
        self.gain = list(priors) if priors is not None else [1.0] + [1.5] * (len(self.trees) - 1)
        self.measured = [0] * len(self.trees)
        self.seconds: Dict[Tuple[int, int], float] = {}
        self.times: Dict[Tuple[int, int], Deque[float]] = {}
        self.last_used: Dict[Tuple[int, int], int] = {}
        self.explore_every, self.smoothing, self.window = explore_every, smoothing, window
        self.min_measured = min_measured
        self.steps = 0
        self.chosen = [0] * len(self.trees)

    def choose(self, rows: int, live: int, ready: Optional[Callable[[int], bool]] = None) -> int:
        """The index of the tree for a step of `rows` batch rows, `live` of them decoding. `ready(i)`:
        whether tree i's step is compiled for the current shapes; a re-measurement waits for a shape
        where it is (compiling a step and its slow first call, 2-3 s here, to refresh one estimate
        stalled every row and cost more than the exploring was worth)."""
        if self.mode == "off" or len(self.trees) == 1:
            return 0
        if self.mode == "always":
            return len(self.trees) - 1
        keys = [(i, rows) for i in range(len(self.trees))]
        unmeasured = [k for k in keys if len(self.times.get(k, ())) < self.min_measured]
        if unmeasured:
            return unmeasured[0][0]
        best = max(range(len(self.trees)), key=lambda i: live * self.gain[i] / self.seconds[(i, rows)])
        # re-measure another tree now and then, the less often the slower it was (exploring a tree
        # 6x slower than the best every 32 steps would cost ~15% of the time)
        for i in range(len(self.trees)):
            slower = self.seconds[(i, rows)] / self.seconds[(best, rows)]
            if i != best and self.steps - self.last_used.get((i, rows), -1) > self.explore_every * max(1.0, slower) \
                    and (ready is None or ready(i)):
                return i
        return best

    def update(self, index: int, rows: int, seconds: float, accepted_per_row: float) -> None:
        """Record a step: its seconds and the mean tokens it gave a live row."""
        key = (index, rows)
        times = self.times.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        self.seconds[key] = min(times)
        a = max(self.smoothing, 1.0 / (self.measured[index] + 1))  # the first measurement replaces the prior
        self.gain[index] = (1 - a) * self.gain[index] + a * accepted_per_row
        self.measured[index] += 1
        self.last_used[key] = self.steps
        self.steps += 1
        self.chosen[index] += 1
