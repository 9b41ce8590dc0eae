"""The engine's device side: the batch (`DecodeState` of B rows, caches of S slots), the compiled
steps and row moves, a step's dispatch and its read-back. The host's bookkeeping (which request
is in which row, how long each is, what to run next) is the engine's; this module only runs what
it is told and counts the seconds spent compiling (`compile_s`), which every timing leaves out.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.compile import aot
from medusa_jax.decoding.prefix_cache import snapshot
from medusa_jax.decoding.processors import changes_logits, dense_processors
from medusa_jax.decoding.state import DecodeState, StepOutput
from medusa_jax.decoding.step import StepConfig
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.drafts import drafter_for
from medusa_jax.engine.batch import empty_batch, engine_step, insert_row, regroup
from medusa_jax.engine.rows import Row
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import grow_cache


class Runner:
    """The batch on the device and the compiled functions that change it.

    Args:
      cfg: the backbone's config; params: its params in decoding layout (`decoding.setup`);
      heads_cfg, head_params: the draft heads (prepared), or None.
    Attributes:
      state: the batch's `DecodeState` ([B, ...] rows, caches of ``size`` slots), None before the first row.
      size: S, the cache slots per row (0 before the first row).
      compile_s: seconds spent compiling and in first calls (`compile.warm_up`).
    """

    def __init__(self, cfg: ModelConfig, params, heads_cfg: Optional[MedusaConfig], head_params):
        self.cfg, self.params, self.heads_cfg, self.head_params = cfg, params, heads_cfg, head_params
        self.state: Optional[DecodeState] = None
        self.size = 0
        self.compile_s = 0.0
        self._steps: dict = {}  # (tree index, rows, cache size, acceptance, logprobs, processors) -> compiled step
        self._live_masks: dict = {}  # live rows (a tuple of bools) -> the [B] mask on the device
        self._procs = (None, None)  # (the rows it was built for, their `LogitsProcessors` on the device, or None)

    def compiled(self, fn, static: tuple, args: tuple):
        """`decoding.compile.aot` with its first call (`compile.warm_up`), both counted in `compile_s`."""
        t = time.perf_counter()
        out = aot(fn, static, args, first_call=True)
        self.compile_s += time.perf_counter() - t
        return out

    def insert(self, row_state: DecodeState, row: int) -> None:
        """Copy a finished prefill (a B = 1 state of at most ``size`` slots, grown to them) into batch
        row `row`."""
        if row_state.cache.size < self.size:
            row_state = row_state.replace(cache=grow_cache(row_state.cache, self.size))
        args = (self.state, row_state, jnp.int32(row))
        self.state = self.compiled(insert_row, (), args)(*args)

    def regroup(self, index: np.ndarray, size: int) -> None:
        """Re-lay the batch: new row i is old row ``index[i]`` (-1: a free row), caches of `size`
        slots; the first call makes an empty batch of ``len(index)`` rows. index: [B'] int32."""
        if self.state is None:
            self.state = empty_batch(self.cfg, self.params, len(index), size)
        else:
            args = (self.state, jnp.asarray(index))
            self.state = self.compiled(regroup, (size,), args)(*args)
        self.size = size

    def has_step(self, tree_index: int, shape: tuple) -> bool:
        """Whether a step of tree `tree_index` is compiled for ``shape`` = (rows, cache size, acceptance)."""
        return any(k[0] == tree_index and k[1:4] == shape for k in self._steps)

    def processors(self, rows: Sequence[Optional[Row]]):
        """The rows' `LogitsProcessors` on the device (None when no row changes its logits), rebuilt
        only when the rows with a logit bias, penalty or min_p change."""
        processing = tuple(r if r is not None and changes_logits(r.request) else None for r in rows)
        if processing != self._procs[0]:
            dense = dense_processors([r and r.request for r in processing], self.cfg.vocab_size,
                                     [r and r.stop for r in processing])
            self._procs = (processing, None if dense is None else jax.tree_util.tree_map(jnp.asarray, dense))
        return self._procs[1]

    def prepare_step(self, tree_index: int, tree: TreeBuffers, rows: Sequence[Optional[Row]], acc: Acceptance,
                     logprobs: Optional[int]) -> Tuple[object, tuple]:
        """(the compiled step of `tree` over the batch, its arguments) for `run`: rows None are free
        (they stay at length 0); logprobs: the alternatives asked for (None: off). Compiles on first
        use. Per-step host work is kept small (a plain step on a 2-core CPU is ~18 ms): the compiled
        step and the live mask are looked up by plain keys."""
        mask = tuple(r is not None for r in rows)
        if mask not in self._live_masks:
            self._live_masks[mask] = jnp.asarray(np.asarray(mask, bool))
        procs = self.processors(rows)
        args = (self.params, self.head_params, self.state, self._live_masks[mask], procs)
        key = (tree_index, len(rows), self.size, acc, logprobs, None if procs is None else procs.used)
        fn = self._steps.get(key)
        if fn is None:
            config = StepConfig(self.cfg, self.heads_cfg, drafter_for(tree), acc, logprobs)
            fn = self._steps[key] = self.compiled(engine_step, (config,), args)
        return fn, args

    def run(self, fn, args: tuple) -> StepOutput:
        """Dispatch a step from `prepare_step` (the state donated) and return its output, still on the
        device (`fetch` waits for it)."""
        out, self.state = fn(*args)
        return out

    def wait(self) -> None:
        """Let the work queued so far (row copies, regroups) finish: a step dispatched next is timed alone."""
        jax.block_until_ready(self.state)

    @staticmethod
    def fetch(out: StepOutput) -> Tuple[np.ndarray, np.ndarray, object]:
        """Wait for a step and bring its output to the host: (tokens [B, W] int32, accepted + 1
        [B] int32, log-probabilities or None)."""
        return jax.device_get((out.tokens, out.num_tokens, out.logprobs))

    def snapshot(self, row: int, n: int) -> Tuple[List, List]:
        """Row `row`'s first `n` K/V entries (`decoding.prefix_cache.snapshot`), for the prefix cache."""
        return snapshot(self.state.cache, row, n)

    def reset(self) -> None:
        """Drop the batch (after an error): the next row starts a new one."""
        self.state, self.size = None, 0
