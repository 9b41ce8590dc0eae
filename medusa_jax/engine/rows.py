"""The engine's bookkeeping of its batch: a live row (`Row`: its request, the tokens and timings so
far, and the `Finished` they make) and a step in flight (`Flight`)."""
from __future__ import annotations

import time
from typing import List, NamedTuple, Optional, Tuple

from medusa_jax.decoding.prefill import PrefillJob
from medusa_jax.decoding.requests import Finished, RequestHandle, TokenLogprob
from medusa_jax.decoding.state import StepOutput


class Row:
    """A live row: its handle, the tokens so far, its stop ids, and what its `Finished` reports
    (steps, drafts, accepted depths, timings, log-probabilities)."""

    def __init__(self, handle: RequestHandle, stop: Tuple[int, ...], job: PrefillJob):
        self.handle = handle
        self.request = handle.request
        self.stop = set(stop)
        self.tokens: List[int] = []
        self.steps = 0
        self.draft_tokens = 0
        self.depth_hist: List[int] = []
        self.prefill_s = job.seconds
        self.queue_s = max(job.started - handle.submitted, 0.0)
        self.reused = job.reused
        self.first_token_at: Optional[float] = None
        self.decode_s = 0.0
        self.step_tokens: List[int] = []
        self.logprobs: Optional[List[TokenLogprob]] = None if self.request.logprobs is None else []

    def finished(self, reason: str) -> Finished:
        """The row's `Finished` for `reason` (one of `requests.FINISH_REASONS`), now."""
        first = self.first_token_at or time.perf_counter()
        return Finished(reason, tokens=self.tokens, steps=self.steps, prompt_tokens=len(self.request.prompt),
                        reused_tokens=self.reused, queue_s=self.queue_s, prefill_s=self.prefill_s,
                        first_token_s=first - self.handle.submitted, decode_s=self.decode_s,
                        draft_tokens=self.draft_tokens, accepted_per_depth=self.depth_hist, logprobs=self.logprobs,
                        step_tokens=self.step_tokens)


class Flight(NamedTuple):
    """A step dispatched and not yet read back: its output, its tree (an index into the chooser's
    trees) and the rows it ran for (the `Row` objects: a row freed or replaced since is not read)."""
    out: StepOutput
    index: int
    rows: List[Optional[Row]]
