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

Exactness: greedy rows emit exactly plain greedy decoding's tokens whatever the tree, and sampled
rows exactly plain sampling's for their seed (`decoding.sampling`: the token at each position is
chosen by that position's key), so neither the load, nor the tree choice, nor the batch changes a
request's answer (up to float32 round-off where a batch's products sum in another order).
Requests run in one thread; `Engine.start` runs it in the background (the server), `Engine.run`
in the caller's (the library).
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.acceptance import ACCEPTANCE_METHODS, step_acceptance
from medusa_jax.decoding.args import CONTEXT, checked_request
from medusa_jax.decoding.batch import empty_batch, engine_step, insert_row, regroup
from medusa_jax.decoding.chooser import TreeChooser
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.prefill import PREFILL_CHUNK, PrefillJob, bucket
from medusa_jax.decoding.prefix_cache import PrefixCache, snapshot
from medusa_jax.decoding.prompt_logprobs import score_prompt
from medusa_jax.decoding.processors import changes_logits, dense_processors
from medusa_jax.decoding.requests import FINISH_REASONS, EngineStopped, Finished, Request, RequestHandle, TokenLogprob
from medusa_jax.decoding.rows import Flight, Row
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.tree import PLAIN_TREE, TreeBuffers, tree_with_budget, with_lookup
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import grow_cache


def _pow2(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


class Engine:
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
        trees = [PLAIN_TREE]
        if full is not PLAIN_TREE and speculation != "off":
            if full.max_depth > 1 and speculation == "adaptive":
                small = tree_with_budget(full, max(2, full.size // 2))
                trees.append(with_lookup(small, full.lookup) if full.lookup is not None else small)
            trees.append(full)
        self.chooser = TreeChooser(trees, speculation if len(trees) > 1 else "off", priors=priors)
        self.max_batch = int(max_batch)
        self.max_len = int(min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
        self.step_size = max(t.step_size for t in trees)
        self.method = acceptance
        self.threshold, self.alpha = posterior_threshold, posterior_alpha
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.prefill_chunk, self.live_chunk = prefill_chunk, live_chunk
        self.progress = progress
        self.compile_s = 0.0  # seconds spent compiling and in first calls (`compile.warm_up`); left out of every timing
        self.state: Optional[DecodeState] = None
        self._steps: dict = {}  # (tree index, rows, cache size, acceptance, logprobs, processors) -> compiled step
        self._live_masks: dict = {}  # live rows (a tuple of bools) -> the [B] mask on the device
        self._procs = (None, None)  # (the rows it was built for, their `LogitsProcessors` on the device, or None)
        self.flights: "collections.deque[Flight]" = collections.deque()  # steps dispatched, not read back
        self._mark = (0.0, 0.0)  # (time, compile_s) of the last read-back: a step's cost runs from there
        self._clean = True  # only decoding steps ran since the mark (their interval is a step cost)
        self.rows: List[Optional[Row]] = []
        self.lengths = np.zeros((0,), np.int64)
        self.S = 0
        self.inbox: "queue.Queue[RequestHandle]" = queue.Queue()
        self._open: set = set()  # requests submitted, not finished (`cancel_all`); each set call is atomic
        self.pending: List[RequestHandle] = []
        self.jobs: List[Tuple[RequestHandle, PrefillJob]] = []  # prefills under way
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()  # set by stop(), cleared by start(): submissions are refused while set
        self._submitting = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.stats = {"steps": 0, "row_steps": 0, "tokens": 0, "prompt_tokens": 0, "prefill_tokens": 0,
                      "reused_tokens": 0,
                      "requests": 0, "finished": {r: 0 for r in FINISH_REASONS}, "drafts": 0, "draft_tokens": 0,
                      "accepted_tokens": 0, "accepted_per_pos": [0] * max(t.max_accepted for t in trees),
                      "tree_choices": [0] * len(trees), "tree_sizes": [t.step_size for t in trees],
                      "hist": [0] * (max(t.max_accepted for t in trees) + 1), "cache_sizes": []}

    # ------------------------------------------------------------------ requests

    def check(self, request: Request) -> Request:
        """`request` with its id set, or the errors of `args.checked_request` (ValueError,
        PromptTooLongError)."""
        where = CONTEXT if self.max_len == self.cfg.max_position_embeddings \
            else f"the engine's KV cache (max_len={self.max_len})"
        return checked_request(request, self.cfg.vocab_size, self.max_len, where, lambda: str(next(self._ids)))

    def submit(self, request: Request, on_event: Optional[Callable[[str, object], None]] = None) -> RequestHandle:
        """Queue a request (thread-safe); it starts at the engine's next iteration.

        on_event: called from the engine's thread with ``("tokens", [ids])`` each step and
        ``("done", Finished)`` at the end; without it the events go to the handle's queue.
        Raises: as `check`, and EngineStopped after `stop` (nothing is queued then).
        """
        handle = RequestHandle(self.check(request), on_event)
        with self._submitting:  # a submission is queued before a stop, or refused after it
            if self._stop.is_set():
                raise EngineStopped(f"request {handle.request.request_id}: the engine was stopped (Engine.stop); "
                                    "start() it again to submit")
            self._open.add(handle)
            self.inbox.put(handle)
        self._wake.set()
        return handle

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
        return self.inbox.qsize() + len(self.pending) + len(self.jobs)

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

    def run(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Iterate in this thread until idle (or until `until()` is true)."""
        while self.step():
            if until is not None and until():
                return

    def start(self) -> "Engine":
        """Run the loop in a background thread (the server); `stop` ends it."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
            self._thread.start()
        return self

    def cancel_all(self) -> None:
        """Cancel every request submitted so far, running, prefilling or waiting: each ends
        ("cancelled") at the loop's next iteration, or between two chunks of a prefill. Safe to call
        from any thread (the server, as its shutdown grace runs out)."""
        for h in set(self._open):  # a copy: the engine's thread removes finished ones
            if not h.cancelled.is_set():  # one a stop sequence ended keeps its reason
                h.cancel()
        self._wake.set()

    def stop(self, cancel: bool = True, timeout: Optional[float] = None) -> None:
        """End the background loop; with `cancel`, every request still running or waiting ends
        ("cancelled") first. Later submissions raise EngineStopped until `start`."""
        with self._submitting:  # first: a request submitted from now on is refused, any before it cancelled
            self._stop.set()
        if cancel:
            self.cancel_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if cancel:
            self._take_submissions()
            self._drop_cancelled()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # a bug: end every request with the error, keep serving the next ones
                self._fail_all(f"{type(e).__name__}: {e}")
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    # ------------------------------------------------------------------ admission and prefill

    def _take_submissions(self) -> None:
        while True:
            try:
                h = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.pending.append(h)
            self.stats["requests"] += 1

    def _drop_cancelled(self) -> None:
        for h in [h for h in self.pending if h.cancelled.is_set()]:
            self.pending.remove(h)
            self._finish_handle(h, Finished("cancelled", prompt_tokens=len(h.request.prompt)))
        for h, job in [j for j in self.jobs if j[0].cancelled.is_set()]:
            self.jobs.remove((h, job))
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
        while True:
            while self.pending and self.live + len(self.jobs) < self.max_batch:
                h = self.pending.pop(0)
                try:
                    self.jobs.append((h, self._start_job(h.request)))
                except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                    self._finish_handle(h, Finished("error", prompt_tokens=len(h.request.prompt),
                                                    error=f"{type(e).__name__}: {e}"))
            if not self.jobs:
                return
            h, job = min(self.jobs, key=lambda j: j[1].remaining)
            self._clean = False
            try:
                compiled = job.compile_s
                done = job.run_chunk(None if whole else self.live_chunk)
                self.compile_s += job.compile_s - compiled
            except Exception as e:  # noqa: BLE001
                self.jobs.remove((h, job))
                self._finish_handle(h, Finished("error", prompt_tokens=len(h.request.prompt),
                                                error=f"{type(e).__name__}: {e}"))
                continue
            if done:
                self.jobs.remove((h, job))
                self._admit(h, job)
                for h2, other in [j for j in self.jobs if j[1].can_follow(job)]:  # n choices of one prompt
                    other.follow(job)
                    self.jobs.remove((h2, other))
                    self._admit(h2, other)
            if not whole or self.live or self._stop.is_set():
                return
            # between two chunks: arrivals join (the shortest goes first), cancelled requests leave
            self._take_submissions()
            self._drop_cancelled()

    def _start_job(self, request: Request) -> PrefillJob:
        size = max(min(bucket(len(request.prompt) + self.step_size + 1, 128), self.max_len), self.S)
        s = request.sampling
        return PrefillJob(self.cfg, self.params, request.prompt, size, seed=s.seed, temperature=s.temperature,
                          top_p=s.top_p, top_k=s.top_k, prefix=self.prefix.prefix_for(request.prompt, size),
                          chunk_size=self.prefill_chunk, progress=self.progress and not self.live)

    def _admit(self, h: RequestHandle, job: PrefillJob) -> None:
        """Copy a finished prefill into a free row (growing the batch or its cache as needed)."""
        row_state = job.state
        if row_state.cache.size > self.S:
            self._regroup(len(self.rows), row_state.cache.size)
        elif row_state.cache.size < self.S:
            row_state = row_state.replace(cache=grow_cache(row_state.cache, self.S))
        free = next((b for b, r in enumerate(self.rows) if r is None), None)
        if free is None:
            self._regroup(_pow2(len(self.rows) + 1), self.S)
            free = next(b for b, r in enumerate(self.rows) if r is None)
        args = (self.state, row_state, jnp.int32(free))
        self.state = self._compiled(insert_row, (), args)(*args)
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
        rows = min(max(rows, self.live, 1), self.max_batch)
        live = [b for b, r in enumerate(self.rows) if r is not None]
        index = np.full((rows,), -1, np.int32)
        index[:len(live)] = live
        if self.state is None:
            self.state = empty_batch(self.cfg, self.params, rows, size)
        else:
            args = (self.state, jnp.asarray(index))
            self.state = self._compiled(regroup, (size,), args)(*args)
        self.rows = [self.rows[b] for b in live] + [None] * (rows - len(live))
        self.lengths = np.asarray([self.lengths[b] for b in live] + [0] * (rows - len(live)), np.int64)
        if size != self.S:
            self.stats["cache_sizes"].append(size)
        self.S = size

    # ------------------------------------------------------------------ decoding

    def _decode(self) -> None:
        """Dispatch the next step, then read back the one before it: with nothing to prefill, one
        step stays in flight, so the host's work for step n (reading its tokens back, delivering
        them, choosing the next tree) overlaps step n + 1 on the device, as in the on-device loop.
        The step after a row's last one computes for nothing (its results for rows freed or replaced
        meanwhile are never read); a step runs ahead only when every row has room in its cache for
        it whatever the step in flight accepts, and structural changes (regroup) wait for the
        flight to land. While prefills are under way, each step is dispatched and read back alone
        (after the row copies queued before it), so that its time is its own: the chooser's costs
        must not include the prefill chunks between steps. Only plain steps run ahead: on this
        2-core CPU the host's work beside a tree step (which keeps both cores busy) slowed it by
        more than the overlap saved (streamed Medusa 0.958 -> 0.943 of the on-device loop, plain
        0.905 -> 0.945; docs/performance.md)."""
        ahead = not self.jobs and not self.pending
        if self.flights and not (ahead and self._plain_in_flight() and self._room_ahead()):
            self._drain()
        if self.live:
            self._dispatch(alone=not ahead)
        if len(self.flights) > 1 or (self.flights and not (ahead and self.live and self._plain_in_flight())):
            self._read_back()
        self._shrink()

    def _plain_in_flight(self) -> bool:
        return self.chooser.trees[self.flights[-1].index].max_accepted == 0

    def _room_ahead(self) -> bool:
        live_rows = [b for b, r in enumerate(self.rows) if r is not None]
        if not live_rows:
            return True
        longest = int(max(self.lengths[b] for b in live_rows))
        return longest + self.chooser.trees[self.flights[-1].index].step_size + self.step_size <= self.S

    def _drain(self) -> None:
        while self.flights:
            self._read_back()

    def _dispatch(self, alone: bool) -> None:
        live_rows = [b for b, r in enumerate(self.rows) if r is not None]
        acc = step_acceptance([self.rows[b].request.sampling for b in live_rows], self.method, self.threshold,
                              self.alpha)
        shape = (len(self.rows), self.S, acc)  # a compiled step's key also holds its logprobs and processors
        i = self.chooser.choose(len(self.rows), len(live_rows),
                                ready=lambda j: any(k[0] == j and k[1:4] == shape for k in self._steps))
        tree = self.chooser.trees[i]
        longest = int(max(self.lengths[b] for b in live_rows))  # exact here unless a step has room ahead
        if longest + tree.step_size > self.S and self.S < self.max_len:
            # grown with room for two steps, so that the next one can run ahead again
            self._regroup(len(self.rows), min(bucket(longest + 2 * self.step_size + 1, 128), self.max_len))
            live_rows = [b for b, r in enumerate(self.rows) if r is not None]
            if not live_rows:
                return
        if longest + tree.step_size > self.S:  # at the largest cache: plain steps
            i, tree = 0, self.chooser.trees[0]
            for b in live_rows:
                if self.lengths[b] + 1 > self.S:
                    self._retire(b, "cache_full")
            live_rows = [b for b, r in enumerate(self.rows) if r is not None]
            if not live_rows:
                return
            acc = step_acceptance([self.rows[b].request.sampling for b in live_rows], self.method, self.threshold,
                                  self.alpha)  # retired rows may have been the sampled ones (a regroup keeps them all)
        # per-step host work kept small (a plain step on this CPU is ~18 ms): the compiled step and
        # the live mask are looked up by plain keys
        mask = tuple(r is not None for r in self.rows)
        if mask not in self._live_masks:
            self._live_masks[mask] = jnp.asarray(np.asarray(mask, bool))
        processing = tuple(r if r is not None and changes_logits(r.request) else None for r in self.rows)
        if processing != self._procs[0]:  # rebuilt when the rows with a logit bias, penalty or min_p change
            dense = dense_processors([r and r.request for r in processing], self.cfg.vocab_size,
                                     [r and r.stop for r in processing])
            self._procs = (processing, None if dense is None else jax.tree_util.tree_map(jnp.asarray, dense))
        procs = self._procs[1]
        args = (self.params, self.head_params, self.state, self._live_masks[mask], procs)
        asked = [self.rows[b].request.logprobs for b in live_rows if self.rows[b].request.logprobs is not None]
        lp = max(asked) if asked else None  # rows asking for fewer alternatives keep their first ones
        key = (i, len(self.rows), self.S, acc, lp, None if procs is None else procs.used)
        fn = self._steps.get(key)
        if fn is None:
            fn = self._steps[key] = self._compiled(engine_step, (self.cfg, self.heads_cfg, tree, acc, lp), args)
        if alone:  # admissions and regroups first: the step's time is its own
            jax.block_until_ready(self.state)
        if alone or not self.flights:
            self._mark, self._clean = (time.perf_counter(), self.compile_s), True
        out, self.state = fn(*args)
        self.flights.append(Flight(out, i, list(self.rows)))

    def _read_back(self) -> None:
        """Wait for the oldest step in flight and hand its tokens to the rows it ran for (those that
        are still the same requests); the time since the last read-back (compilation left out) is
        the step's cost for the chooser and the rows' decode time."""
        f = self.flights.popleft()
        toks, n, lps = jax.device_get((f.out.tokens, f.out.num_tokens, f.out.logprobs))
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
        st["steps"] += 1
        st["tree_choices"][f.index] += 1
        for b in rows:
            st["hist"][int(n[b]) - 1] += 1
            k = self.rows[b].request.logprobs
            lp = None if k is None else [
                TokenLogprob(int(toks[b, j]), float(lps.logprob[b, j]),
                             tuple(zip(lps.top_ids[b, j, :k].tolist(), lps.top_logprobs[b, j, :k].tolist())))
                for j in range(int(n[b]))]
            self._deliver(b, [int(t) for t in toks[b, :n[b]]], self.chooser.trees[f.index], now, wall=wall, lp=lp)

    def _compiled(self, fn, static: tuple, args: tuple):
        """`decoding.compile.aot` with its first call (`compile.warm_up`), both counted in `compile_s`."""
        t = time.perf_counter()
        out = aot(fn, static, args, first_call=True)
        self.compile_s += time.perf_counter() - t
        return out

    def _deliver(self, b: int, chunk: List[int], tree: TreeBuffers, now: float, wall: float,
                 lp: Optional[List[TokenLogprob]] = None) -> None:
        """Hand row b's accepted tokens (and their log-probabilities `lp`, when it asked for them) to
        its request, cut at a stop id and the budget; retire it when it is done. wall: the step's
        seconds so far (host work included, compilation not)."""
        row = self.rows[b]
        row.decode_s += wall
        st = self.stats
        st["row_steps"] += 1
        row.steps += 1
        accepted = len(chunk) - 1
        if tree.max_accepted > 0:  # the speculation counters, named as vLLM's
            st["drafts"] += 1
            st["draft_tokens"] += tree.step_size - 1
            st["accepted_tokens"] += accepted
            row.draft_tokens += tree.step_size - 1
            for d in range(accepted):
                st["accepted_per_pos"][d] += 1
            while len(row.depth_hist) < tree.max_accepted:
                row.depth_hist.append(0)
            for d in range(accepted):
                row.depth_hist[d] += 1
        reason = None
        for j, t in enumerate(chunk):
            if t in row.stop:
                chunk, reason = chunk[:j + 1], "eos"
                break
        room = row.request.max_new_tokens - len(row.tokens)
        if len(chunk) > room or (len(chunk) == room and reason is None):  # (a stop token past the budget
            reason = "length"                                                 # is cut off with it)
        chunk = chunk[:room]
        if row.first_token_at is None and chunk:
            row.first_token_at = now
        row.tokens.extend(chunk)
        row.step_tokens.append(len(chunk))
        st["tokens"] += len(chunk)
        if chunk and lp is not None:
            row.logprobs.extend(lp[:len(chunk)])
            row.handle._emit("logprobs", lp[:len(chunk)])
        if chunk:
            row.handle._emit("tokens", chunk)
        if reason is not None:
            self._retire(b, reason)

    def _retire(self, b: int, reason: str) -> None:
        row = self.rows[b]
        self.rows[b] = None
        if self.prefix.enabled and reason != "error":  # a turn that filled the context is kept too
            n = int(min(self.lengths[b], len(row.request.prompt) + len(row.tokens)))
            if n > 0:
                k, v = snapshot(self.state.cache, b, n)
                ids = list(row.request.prompt) + row.tokens
                self.prefix.add(ids[:n], k, v)
        self._finish_handle(row.handle, row.finished(reason))
        self.lengths[b] = 0

    def _shrink(self) -> None:
        """Fewer rows once most are free and nobody waits (a step costs what its rows cost)."""
        rows = len(self.rows)
        if rows > 1 and not self.waiting and self.live <= rows // 4:
            self._drain()  # the flight's rows may finish: the new size counts only those still live
            self._regroup(_pow2(max(self.live, 1)), self.S)

    def _finish_handle(self, h: RequestHandle, fin: Finished) -> None:
        self._open.discard(h)
        self.stats["finished"][fin.reason] += 1
        h._emit("done", fin)

    def _fail_all(self, message: str) -> None:
        self.flights.clear()
        for b, r in enumerate(self.rows):
            if r is not None:
                self.rows[b] = None
                self._finish_handle(r.handle, Finished("error", tokens=r.tokens, steps=r.steps,
                                                       prompt_tokens=len(r.request.prompt), error=message))
        for h, _ in self.jobs:
            self._finish_handle(h, Finished("error", prompt_tokens=len(h.request.prompt), error=message))
        self.jobs = []
        self.state, self.rows, self.lengths, self.S = None, [], np.zeros((0,), np.int64), 0
