"""The step-level decoding engine: requests admitted into the rows of one batch as they come, each
streaming the tokens it accepts, step by step; the one batching decoder of the project (the library's
`generate_batch` and `generate_stream`, distillation, the chat and the server all run on it).

One iteration (`Engine.step`):

1. Requests that were submitted are checked and queued; cancelled ones leave at once (a running
   request's row is freed).
2. One prefill chunk (`prefill.PrefillJob`: a B = 1 cache) of the waiting request with the fewest
   prompt tokens left, started from the longest cached prefix of an earlier request when prefix
   reuse is on (`prefix_cache`). With rows decoding, one chunk of at most ``live_chunk`` tokens runs
   per iteration, so no running request waits more than that chunk for its next step, and a short
   request does not wait behind a long document; with none, chunks of ``prefill_chunk`` tokens run
   until a row is admitted. A finished prefill is copied into a free row (the batch grows in powers
   of two up to ``max_batch``, its cache in powers of two up to ``max_len``).
3. One decoding step of every live row (`step.medusa_step`, jitted per tree, batch, cache size and
   sampling kind), with the tree chosen for this step (`TreeChooser`: plain, a smaller tree or the
   full one, by expected tokens per second from the measured step times and acceptance); every
   row's accepted tokens go to its request (a callback, or the handle's queue), cut at its stop ids
   and token budget; finished rows are freed and their caches kept for prefix reuse. With nothing
   to prefill, the step after a plain step is launched before the plain step is read back
   (`Engine._decode`), so the host's work overlaps the device's.

The parts, by role: the scheduler (`engine.scheduler`, host only) decides what runs next (which
prefill, the batch's rows and cache size, the tree per step, whether a step runs ahead); the
runner (`engine.runner`) holds the batch on the device and runs the compiled steps and row moves;
output processing (`engine.output`) turns a step's tokens into each request's (stop ids, budget,
log-probabilities) and counts the statistics; the front (`engine.front`) takes submissions from
other threads and runs the loop in the background. This class keeps the rows' bookkeeping and
carries the scheduler's decisions out; it runs jax only through the runner, the prefill jobs and prompt scoring.

Exactness: greedy rows emit exactly plain greedy decoding's tokens whatever the tree, and sampled
rows exactly plain sampling's for their seed (`decoding.sampling`: the token at each position is
chosen by that position's key), so neither the load, nor the tree choice, nor the batch changes a
request's answer (up to float32 round-off where a batch's products sum in another order).
Requests run in one thread; `Engine.start` runs it in the background (the server), `Engine.run`
in the caller's (the library).
"""
from __future__ import annotations

import collections
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from medusa_jax.decoding.acceptance import ACCEPTANCE_METHODS, Acceptance, step_acceptance
from medusa_jax.decoding.args import CONTEXT, checked_request
from medusa_jax.decoding.prefill import PREFILL_CHUNK, PrefillJob
from medusa_jax.decoding.prefix_cache import PrefixCache, snapshot
from medusa_jax.decoding.prompt_logprobs import score_prompt
from medusa_jax.decoding.requests import Finished, Request, RequestHandle, TokenLogprob
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.engine.chooser import TreeChooser
from medusa_jax.engine.front import EngineFront
from medusa_jax.engine.output import count_step, deliver, max_logprobs, new_stats, row_logprobs
from medusa_jax.engine.rows import Flight, Row
from medusa_jax.engine.runner import Runner
from medusa_jax.engine.scheduler import Scheduler
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig


class Engine(EngineFront):
    """The step-level decoding engine (see the module docstring).

    Args:
      cfg, params: the backbone (`convert.load.load_model`; on a mesh, its params placed there).
      heads: (MedusaConfig, params) or None (plain decoding, or prompt lookup alone with a tree
        that carries lookup settings).
      tree: the full tree (`resolve.resolve_heads` gives it prepared with its heads).
      max_batch: the most rows decoded together (a power of two is best: the batch grows in them).
      max_len: the most cache slots per row (prompt + answer + one tree); default the model's context.
      speculation: "adaptive" (`TreeChooser`), "always" (the full tree) or "off" (plain steps).
      acceptance: "exact" or "typical": how sampled rows accept candidates (greedy rows: greedy).
      posterior_threshold, posterior_alpha: typical acceptance's epsilon and delta.
      prefix_cache_bytes: the K/V kept for reuse across a conversation's turns (0: off).
      eos_token_ids: the ids that end an answer by default (default: the config's).
      prefill_chunk: tokens per prefill chunk.
      priors: tokens per row-step expected of each tree before any is measured (plain, smaller,
        full), e.g. from the heads' calibration.
      progress: a progress bar on stderr for a long prefill that runs while no row decodes.
      live_chunk: tokens per prefill chunk while rows decode (a running request's next step waits
        for at most one such chunk).
    Raises:
      ValueError: bad settings (max_batch < 1, an unknown speculation or acceptance).
    """

    def __init__(self, cfg: ModelConfig, params, *, heads: Optional[Tuple[MedusaConfig, dict]] = None,
                 tree: Optional[TreeBuffers] = None, max_batch: int = 4, max_len: Optional[int] = None,
                 speculation: str = "adaptive", acceptance: str = "exact", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, prefix_cache_bytes: int = 0,
                 eos_token_ids: Optional[Sequence[int]] = None, prefill_chunk: int = PREFILL_CHUNK,
                 priors: Optional[Sequence[float]] = None, progress: bool = False, live_chunk: int = 32):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if acceptance not in ACCEPTANCE_METHODS or acceptance == "greedy":
            raise ValueError(f"acceptance must be 'exact' or 'typical' (greedy rows are greedy anyway), got {acceptance!r}")
        self.cfg = cfg
        self.params, self.heads_cfg, self.head_params, full = decoding_setup(cfg, params, heads, tree)
        trees = Scheduler.trees_for(full, speculation)
        self.chooser = TreeChooser(trees, speculation if len(trees) > 1 else "off", priors=priors)
        self.max_batch = int(max_batch)
        self.max_len = int(min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
        self.scheduler = Scheduler(self.chooser, self.max_batch, self.max_len)  # what runs next (host only)
        self.method = acceptance
        self.threshold, self.alpha = posterior_threshold, posterior_alpha
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.prefill_chunk, self.live_chunk = prefill_chunk, live_chunk
        self.progress = progress
        self.runner = Runner(cfg, self.params, self.heads_cfg, self.head_params)  # the batch on the device
        self.flights: "collections.deque[Flight]" = collections.deque()  # steps dispatched, not read back
        self._mark = (0.0, 0.0)  # (time, compile_s) of the last read-back: a step's cost runs from there
        self._clean = True  # only decoding steps ran since the mark (their interval is a step cost)
        self.rows: List[Optional[Row]] = []
        self.lengths = np.zeros((0,), np.int64)
        EngineFront.__init__(self)
        self.stats = new_stats(trees)

    # ------------------------------------------------------------------ requests

    def check(self, request: Request) -> Request:
        """`request` with its id set, or the errors of `args.checked_request` (ValueError,
        PromptTooLongError)."""
        where = CONTEXT if self.max_len == self.cfg.max_position_embeddings \
            else f"the engine's KV cache (max_len={self.max_len})"
        return checked_request(request, self.cfg.vocab_size, self.max_len, where, self._next_id)

    def prompt_logprobs(self, prompt: Sequence[int], top: int = 0, stop: Optional[Callable[[], bool]] = None,
                        keep: bool = False) -> List[Optional[TokenLogprob]]:
        """Each prompt token's log-probability given the tokens before it, under the engine's backbone
        (`decoding.prompt_logprobs.score_prompt`: P entries, the first None; `top` in [0, 20]
        alternatives each). Runs in the caller's thread, beside the engine's own steps.

        keep: also put the prompt's K/V into the prefix cache (when it is on and the prompt has
        more than its ``min_tokens``), so that a request for the same prompt submitted next prefills its
        last token only: a loglikelihood request (echo with ``logprobs`` and an answer) costs about
        one prefill, not two. Nothing else of the engine's state changes.
        Raises ValueError for an empty prompt, an id outside the vocabulary, or a prompt longer than
        the model's context; EngineStopped between two chunks once the engine is stopped or `stop`
        returns True."""
        out, cache = score_prompt(self.cfg, self.params, prompt, top,
                                  stop=lambda: self._stop.is_set() or (stop is not None and stop()))
        if keep and self.prefix.enabled and len(out) > self.prefix.min_tokens:
            k, v = snapshot(cache, 0, len(out))
            self.prefix.add(list(prompt), k, v)
        return out

    @property
    def S(self) -> int:
        """Cache slots per row of the batch (0 before the first row)."""
        return self.runner.size

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling and in first calls (`compile.warm_up`); left out of every timing."""
        return self.runner.compile_s

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV cache the live rows hold, in [0, 1]: their prompt and output tokens over
        ``max_batch * max_len`` slots (the most the engine's rows may hold; vLLM's
        ``kv_cache_usage_perc``). Read from the host's bookkeeping, so any thread may ask at any time."""
        used = sum(len(r.request.prompt) + len(r.tokens) for r in list(self.rows) if r is not None)
        return min(used / (self.max_batch * self.max_len), 1.0)

    @property
    def waiting(self) -> int:
        """Requests submitted or queued that have no row yet."""
        return self.inbox.qsize() + len(self.scheduler.pending) + len(self.scheduler.jobs)

    @property
    def queued(self) -> int:
        """Requests that will wait for a row: those without one beyond the rows still free (what a
        server's queue limit counts; a burst that the free rows will take is not queued)."""
        return max(0, self.waiting - max(0, self.max_batch - self.live))

    def idle(self) -> bool:
        return not self.live and not self.waiting

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One iteration (module docstring). Returns whether work remains."""
        self._take_submissions()
        self._drop_cancelled()
        self._prefill(whole=not self.live)
        if self.live:
            self._decode()
        return not self.idle()

    # ------------------------------------------------------------------ admission and prefill

    def _queue(self, h: RequestHandle) -> None:
        self.scheduler.pending.append(h)
        self.stats["requests"] += 1

    def _drop_cancelled(self) -> None:
        for h in self.scheduler.cancelled():
            self._finish_handle(h, Finished("cancelled", prompt_tokens=len(h.request.prompt)))
        for b, r in enumerate(self.rows):
            if r is not None and r.handle.cancelled.is_set():
                self._retire(b, r.handle.cancel_reason)

    def _prefill(self, whole: bool) -> None:
        """One chunk of a prefill, then its row when it is done; with `whole` (no row is decoding)
        chunks run until a row is admitted. Every waiting request that a free row could take starts
        its prefill, and the one with the fewest tokens left goes first (a short request does not
        wait behind a long document); while rows decode, chunks are `live_chunk` tokens, so that
        their steps wait little."""
        jobs = self.scheduler.jobs
        while True:
            while (h := self.scheduler.start_next(self.live)) is not None:
                try:
                    jobs.append((h, self._start_job(h.request)))
                except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                    self._finish_error(h, e)
            if not jobs:
                return
            h, job = self.scheduler.next_prefill()
            self._clean = False
            try:
                compiled = job.compile_s
                done = job.run_chunk(None if whole else self.live_chunk)
                self.runner.compile_s += job.compile_s - compiled
            except Exception as e:  # noqa: BLE001
                jobs.remove((h, job))
                self._finish_error(h, e)
                continue
            if done:
                jobs.remove((h, job))
                self._admit(h, job)
                for h2, other in self.scheduler.followers(job):  # n choices of one prompt
                    other.follow(job)
                    jobs.remove((h2, other))
                    self._admit(h2, other)
            if not whole or self.live or self._stop.is_set():
                return
            # between two chunks: arrivals join (the shortest goes first), cancelled requests leave
            self._take_submissions()
            self._drop_cancelled()

    def _start_job(self, request: Request) -> PrefillJob:
        size = self.scheduler.prefill_slots(len(request.prompt), self.S)
        s = request.sampling
        return PrefillJob(self.cfg, self.params, request.prompt, size, seed=s.seed, temperature=s.temperature,
                          top_p=s.top_p, top_k=s.top_k, prefix=self.prefix.prefix_for(request.prompt, size),
                          chunk_size=self.prefill_chunk, progress=self.progress and not self.live)

    def _admit(self, h: RequestHandle, job: PrefillJob) -> None:
        """Copy a finished prefill into a free row (growing the batch or its cache as needed)."""
        if job.state.cache.size > self.S:
            self._regroup(len(self.rows), job.state.cache.size)
        free = next((b for b, r in enumerate(self.rows) if r is None), None)
        if free is None:
            self._regroup(self.scheduler.more_rows(len(self.rows)), self.S)
            free = next(b for b, r in enumerate(self.rows) if r is None)
        self.runner.insert(job.state, free)
        req = h.request
        stop = tuple(req.stop_token_ids) if req.stop_token_ids is not None else self.eos
        self.rows[free] = Row(h, stop, job)
        self.lengths[free] = len(req.prompt)
        self.stats["prompt_tokens"] += len(req.prompt)
        self.stats["prefill_tokens"] += len(req.prompt) - job.reused
        self.stats["reused_tokens"] += job.reused

    def _regroup(self, rows: int, size: int) -> None:
        """Re-lay the batch: `rows` rows (the live ones first, in order), caches of `size` slots
        (after the steps in flight land)."""
        self._drain()
        rows = self.scheduler.rows_for(rows, self.live)
        live = self._live_rows()
        index = np.full((rows,), -1, np.int32)
        index[:len(live)] = live
        if size != self.S:
            self.stats["cache_sizes"].append(size)
        self.runner.regroup(index, size)
        self.rows = [self.rows[b] for b in live] + [None] * (rows - len(live))
        self.lengths = np.asarray([self.lengths[b] for b in live] + [0] * (rows - len(live)), np.int64)

    # ------------------------------------------------------------------ decoding

    def _decode(self) -> None:
        """Dispatch the next step, then read back the one before it: where the scheduler lets a step run
        ahead (`Scheduler.runs_ahead`: after a plain step, nothing to prefill, room in every row), one
        step stays in flight, so the host's work for step n overlaps step n + 1 on the device (the step
        after a row's last one computes for nothing; rows freed or replaced meanwhile are never read).
        Otherwise each step is dispatched and read back alone, so that its time, which the chooser
        learns from, is its own (docs/performance.md)."""
        ahead = not self.scheduler.prefilling
        if self.flights and not self.scheduler.runs_ahead(self.flights[-1].index,
                                                          [int(self.lengths[b]) for b in self._live_rows()], self.S):
            self._drain()
        if self.live:
            self._dispatch(alone=not ahead)
        if len(self.flights) > 1 or (self.flights and not (ahead and self.live
                                                           and self.scheduler.plain(self.flights[-1].index))):
            self._read_back()
        self._shrink()

    def _drain(self) -> None:
        while self.flights:
            self._read_back()

    def _dispatch(self, alone: bool) -> None:
        """Dispatch one step of every live row, with the tree the scheduler chooses; the batch's cache
        grows first where a row has no room for it, and at the largest cache the step is plain (rows
        without room for one token end, "cache_full")."""
        live_rows = self._live_rows()
        acc = self._acceptance(live_rows)
        shape = (len(self.rows), self.S, acc)  # a compiled step's key also holds its logprobs and processors
        i = self.scheduler.choose(len(self.rows), len(live_rows), ready=lambda j: self.runner.has_step(j, shape))
        tree = self.chooser.trees[i]
        longest = int(max(self.lengths[b] for b in live_rows))  # exact here unless a step has room ahead
        grown = self.scheduler.grown_cache(longest, tree, self.S)
        if grown is not None:
            self._regroup(len(self.rows), grown)
            live_rows = self._live_rows()
            if not live_rows:
                return
        if longest + tree.step_size > self.S:  # at the largest cache: plain steps
            i, tree = 0, self.chooser.trees[0]
            for b in live_rows:
                if self.lengths[b] + 1 > self.S:
                    self._retire(b, "cache_full")
            live_rows = self._live_rows()
            if not live_rows:
                return
            acc = self._acceptance(live_rows)  # retired rows may have been the sampled ones
        lp = max_logprobs([self.rows[b].request for b in live_rows])
        fn, args = self.runner.prepare_step(i, tree, self.rows, acc, lp)
        if alone:  # admissions and regroups first: the step's time is its own
            self.runner.wait()
        if alone or not self.flights:
            self._mark, self._clean = (time.perf_counter(), self.compile_s), True
        out = self.runner.run(fn, args)
        self.flights.append(Flight(out, i, list(self.rows)))

    def _live_rows(self) -> List[int]:
        return [b for b, r in enumerate(self.rows) if r is not None]

    def _acceptance(self, live_rows: List[int]) -> Acceptance:
        """The acceptance rule (and compile flags) of a step over `live_rows` (`acceptance.step_acceptance`)."""
        return step_acceptance([self.rows[b].request.sampling for b in live_rows], self.method, self.threshold,
                               self.alpha)

    def _read_back(self) -> None:
        """Wait for the oldest step in flight and hand its tokens to the rows it ran for (those that
        are still the same requests); the time since the last read-back (compilation left out) is
        the step's cost for the chooser and the rows' decode time."""
        f = self.flights.popleft()
        toks, n, lps = self.runner.fetch(f.out)
        now = time.perf_counter()
        wall = now - self._mark[0] - (self.compile_s - self._mark[1])
        clean, self._mark, self._clean = self._clean, (now, self.compile_s), True
        rows = [b for b, r in enumerate(f.rows) if r is not None and self.rows[b] is r]
        if not rows:
            return
        for b in rows:
            self.lengths[b] += int(n[b])  # the step advanced each live row by its accepted tokens
        if clean:  # no prefill chunk or row copy ran since the last read-back
            self.chooser.update(f.index, len(f.rows), wall, float(np.mean(n[rows])))
        st = self.stats
        count_step(st, f.index, [int(n[b]) for b in rows])
        for b in rows:
            lp = row_logprobs(toks, int(n[b]), lps, b, self.rows[b].request.logprobs)
            reason = deliver(st, self.rows[b], [int(t) for t in toks[b, :n[b]]], self.chooser.trees[f.index], now,
                             wall, lp)
            if reason is not None:
                self._retire(b, reason)

    def _retire(self, b: int, reason: str) -> None:
        row = self.rows[b]
        self.rows[b] = None
        if self.prefix.enabled and reason != "error":  # a turn that filled the context is kept too
            n = int(min(self.lengths[b], len(row.request.prompt) + len(row.tokens)))
            if n > 0:
                k, v = self.runner.snapshot(b, n)
                ids = list(row.request.prompt) + row.tokens
                self.prefix.add(ids[:n], k, v)
        self._finish_handle(row.handle, row.finished(reason))
        self.lengths[b] = 0

    def _shrink(self) -> None:
        """Fewer rows once most are free and nobody waits (a step costs what its rows cost)."""
        if self.scheduler.shrinks(len(self.rows), self.live, self.waiting):
            self._drain()  # the flight's rows may finish: the new size counts only those still live
            self._regroup(self.scheduler.fewer_rows(self.live), self.S)

    def _finish_handle(self, h: RequestHandle, fin: Finished) -> None:
        self._open.discard(h)
        self.stats["finished"][fin.reason] += 1
        h._emit("done", fin)

    def _finish_error(self, h: RequestHandle, e: Exception) -> None:
        self._finish_handle(h, Finished("error", prompt_tokens=len(h.request.prompt), error=f"{type(e).__name__}: {e}"))

    def _fail_all(self, message: str) -> None:
        self.flights.clear()
        for b, r in enumerate(self.rows):
            if r is not None:
                self.rows[b] = None
                self._finish_handle(r.handle, Finished("error", tokens=r.tokens, steps=r.steps,
                                                       prompt_tokens=len(r.request.prompt), error=message))
        for h, _ in self.scheduler.jobs:
            self._finish_handle(h, Finished("error", prompt_tokens=len(h.request.prompt), error=message))
        self.scheduler.jobs.clear()
        self.runner.reset()
        self.rows, self.lengths = [], np.zeros((0,), np.int64)
