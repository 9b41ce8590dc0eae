"""The engine's scheduler: what runs next, decided on the host alone (no jax, nothing on a device).

It keeps the requests that wait for a row (`pending`) and the prefills under way (`jobs`), and
decides: which waiting requests start their prefill (as many as there are free rows), which
prefill runs its next chunk (the one with the fewest tokens left: a short request does not wait
behind a long document), how many rows and cache slots the batch needs (powers of two, capped),
which tree the next step verifies (`TreeChooser`: plain, a smaller tree or the full one, by
expected tokens per second), whether a step may be dispatched before the one in flight is read
back, and when the batch shrinks. The engine (`engine.Engine`) carries the decisions out, with
the runner (`engine.runner.Runner`) on the device.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from medusa_jax.decoding.prefill import PrefillJob, bucket
from medusa_jax.decoding.requests import RequestHandle
from medusa_jax.decoding.tree import PLAIN_TREE, TreeBuffers, tree_with_budget, with_lookup
from medusa_jax.engine.chooser import TreeChooser


class Scheduler:
    """Admission, prefill order, the batch's shape and the tree per step (module docstring).

    Args:
      chooser: picks each step's tree among ``chooser.trees`` (plain first).
      max_batch: the most rows; max_len: the most cache slots per row.
    Attributes:
      pending: requests waiting for a prefill to start, in arrival order.
      jobs: (handle, prefill) pairs under way.
      step_size: the most tokens one step's forward runs, over the trees (cache room per step).
    """

    def __init__(self, chooser: TreeChooser, max_batch: int, max_len: int):
        self.chooser = chooser
        self.max_batch, self.max_len = max_batch, max_len
        self.step_size = max(t.step_size for t in chooser.trees)
        self.pending: List[RequestHandle] = []
        self.jobs: List[Tuple[RequestHandle, PrefillJob]] = []

    @property
    def trees(self) -> List[TreeBuffers]:
        return self.chooser.trees

    @staticmethod
    def trees_for(full: TreeBuffers, speculation: str) -> List[TreeBuffers]:
        """The trees a step may verify, plain first: plain alone ("off", or no draft), plain and the
        full tree ("always"), or plain, a tree of half the full one's budget and the full one
        ("adaptive", when the full tree is deeper than one)."""
        trees = [PLAIN_TREE]
        if full is not PLAIN_TREE and speculation != "off":
            if full.max_depth > 1 and speculation == "adaptive":
                small = tree_with_budget(full, max(2, full.size // 2))
                trees.append(with_lookup(small, full.lookup) if full.lookup is not None else small)
            trees.append(full)
        return trees

    def start_next(self, live: int) -> Optional[RequestHandle]:
        """The waiting request whose prefill starts now (taken off `pending`), or None when none
        waits or the `live` decoding rows and the prefills under way leave no row free."""
        if self.pending and live + len(self.jobs) < self.max_batch:
            return self.pending.pop(0)
        return None

    def next_prefill(self) -> Optional[Tuple[RequestHandle, PrefillJob]]:
        """The prefill that runs its next chunk: the one with the fewest prompt tokens left."""
        return min(self.jobs, key=lambda j: j[1].remaining) if self.jobs else None

    def followers(self, done: PrefillJob) -> List[Tuple[RequestHandle, PrefillJob]]:
        """The prefills that finish with `done` (the n choices of one prompt: `PrefillJob.can_follow`)."""
        return [j for j in self.jobs if j[1].can_follow(done)]

    def cancelled(self) -> List[RequestHandle]:
        """The cancelled requests that have no row yet, taken off `pending` and `jobs`."""
        out = [h for h in self.pending if h.cancelled.is_set()]
        self.pending[:] = [h for h in self.pending if not h.cancelled.is_set()]  # in place: one list throughout
        out += [h for h, _ in self.jobs if h.cancelled.is_set()]
        self.jobs[:] = [j for j in self.jobs if not j[0].cancelled.is_set()]
        return out

    def prefill_slots(self, prompt_len: int, size: int) -> int:
        """Cache slots of a new prefill: room for the prompt and a step, a power of two >= 128,
        at most ``max_len``, at least the batch's `size` (it joins the batch as it is)."""
        return max(min(bucket(prompt_len + self.step_size + 1, 128), self.max_len), size)

    def more_rows(self, rows: int) -> int:
        """The rows a full batch of `rows` grows to: the next power of two (`rows_for` caps it)."""
        return bucket(rows + 1, smallest=1)

    def rows_for(self, rows: int, live: int) -> int:
        """The batch's rows when asked for `rows`: at least the `live` ones and 1, at most ``max_batch``."""
        return min(max(rows, live, 1), self.max_batch)

    def choose(self, rows: int, live: int, ready: Callable[[int], bool]) -> int:
        """The tree (an index into `trees`) the next step verifies (`TreeChooser.choose`)."""
        return self.chooser.choose(rows, live, ready=ready)

    def grown_cache(self, longest: int, tree: TreeBuffers, size: int) -> Optional[int]:
        """The cache slots the batch grows to before a step of `tree` whose longest row holds `longest`
        tokens (room for two steps, so that the next one can run ahead again), or None when it fits
        or the cache is at ``max_len`` already."""
        if longest + tree.step_size > size and size < self.max_len:
            return min(bucket(longest + 2 * self.step_size + 1, 128), self.max_len)
        return None

    @property
    def prefilling(self) -> bool:
        """Whether a request waits for its prefill or has one under way."""
        return bool(self.jobs or self.pending)

    def plain(self, tree_index: int) -> bool:
        """Whether tree `tree_index` is plain decoding's (it drafts nothing)."""
        return self.trees[tree_index].max_accepted == 0

    def runs_ahead(self, in_flight: int, lengths: Sequence[int], size: int) -> bool:
        """Whether a step may be dispatched while the step of tree `in_flight` is not read back: only
        after a plain step (beside a tree step, which keeps a 2-core CPU busy, the host's work slowed
        it by more than the overlap saved), only with no prefill waiting, and only when every live row
        (`lengths`) has room for it whatever the step in flight accepts."""
        if self.prefilling or not self.plain(in_flight):
            return False
        return not lengths or max(lengths) + self.trees[in_flight].step_size + self.step_size <= size

    def shrinks(self, rows: int, live: int, waiting: int) -> bool:
        """Whether the batch of `rows` rows shrinks (to `fewer_rows`): once most are free and nobody
        waits (a step costs what its rows cost)."""
        return rows > 1 and not waiting and live <= rows // 4

    @staticmethod
    def fewer_rows(live: int) -> int:
        """The rows a shrinking batch keeps for its `live` rows: the power of two >= live (>= 1)."""
        return bucket(max(live, 1), smallest=1)
