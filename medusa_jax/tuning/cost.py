"""Measured cost of a Medusa step on the current device: c(T) and the per-step overhead breakdown.

The hardware-aware tree choice (`medusa_jax.cli.tune`) needs the wall-clock cost of one Medusa step
with a T-node tree relative to one plain decoding step, ``c(T) = t_step(T) / t_step(plain)``.
Steps are timed on the device, many per call (a `lax.fori_loop` of `medusa_step`, no host sync in
between), on a real prefilled prompt; the best of a few repeats is kept, as usual for
micro-benchmarks. Compilation is never timed.
"""
from __future__ import annotations

import functools
import time
from typing import Dict, Iterable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from tqdm import tqdm

from medusa_jax import kernels
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.compile import aot
from medusa_jax.drafts.heads import draft_tokens
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.step import StepConfig, medusa_step
from medusa_jax.drafts import drafter_for
from medusa_jax.decoding.tree import PLAIN_TREE, TreeBuffers
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import prepare_heads
from medusa_jax.heads.topk import head_topk
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.layout import decoding_params
from medusa_jax.models.llama import LlamaModel, lm_head_blocks, lm_head_matrix


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def run_steps(cfg: ModelConfig, heads_cfg: Optional[MedusaConfig], tree: TreeBuffers, n: int,
               params, head_params, state: DecodeState) -> DecodeState:
    """`n` Medusa (or plain, with `PLAIN_TREE`) greedy steps in one on-device loop."""
    def body(_, st):
        return medusa_step(StepConfig(cfg, heads_cfg, drafter_for(tree), Acceptance()), params, head_params, st)[1]
    return jax.lax.fori_loop(0, n, body, state)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run_forwards(cfg: ModelConfig, tree: TreeBuffers, n: int, params, state: DecodeState) -> jax.Array:
    """`n` tree forwards alone (no heads, posterior or compaction) at the same cache position."""
    T = tree.size
    tokens = jnp.zeros((state.logits.shape[0], T), jnp.int32)
    positions = state.cache.lengths[:, None] + jnp.asarray(tree.depth)[None, :]
    mask = jnp.asarray(tree.ancestor_mask)

    def body(i, acc):
        logits, _, _ = LlamaModel(cfg).apply({"params": params}, tokens + i, positions, state.cache, mask)
        return acc + kernels.argmax(logits).sum()
    return jax.lax.fori_loop(0, n, body, jnp.int32(0))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _run_heads(cfg: ModelConfig, heads_cfg: MedusaConfig, depth: int, tree: Optional[TreeBuffers], n: int, params,
               head_params, state: DecodeState) -> jax.Array:
    """`n` head proposals alone (blocks, vocabulary projection, top-k); with `tree` the whole draft
    (`drafts.heads.draft_tokens`: hydra heads run depth by depth on it)."""
    lm = lm_head_matrix(cfg, params)
    root = kernels.argmax(state.logits)

    def body(i, acc):  # a different input each time, so nothing is hoisted out of the loop
        hidden = state.hidden + i.astype(state.hidden.dtype) * 1e-6
        if tree is not None:
            return acc + draft_tokens(cfg, heads_cfg, head_params, params, state.replace(hidden=hidden), root,
                                      tree).sum()
        return acc + head_topk(heads_cfg, head_params, hidden, lm, depth, heads_cfg.topk).sum()
    return jax.lax.fori_loop(0, n, body, jnp.int32(0))


def timed_call(fn, args: tuple, n: int):
    """A function of no arguments that calls ``fn(*args)`` once (`n` steps) and returns seconds per
    step, so that timings of several functions can be interleaved (`step_costs`)."""
    def call() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return (time.perf_counter() - t0) / n
    return call


def best_time(call, repeats: int) -> float:
    """Seconds per step: best of `repeats` timed calls after one untimed warm-up call."""
    call()
    return min(call() for _ in range(repeats))


def prepared_heads(cfg: ModelConfig, params, heads: Optional[Tuple[MedusaConfig, dict]], tree: TreeBuffers):
    """`heads` as decoding runs them with `tree` (`heads.medusa.prepare_heads` to its depth), or (None, None)."""
    if heads is None:
        return None, None
    return prepare_heads(heads[0], heads[1], functools.partial(lm_head_matrix, cfg, params),
                         depth=max(tree.max_depth, 1), lm_head_blocks=lm_head_blocks(cfg, params))


def _step_call(cfg: ModelConfig, params, heads: Optional[Tuple[MedusaConfig, dict]], tree: TreeBuffers,
               state: DecodeState, steps: int):
    """One timed call of `steps` greedy steps with `tree`, compiled once: a function of no arguments
    returning seconds per step (so that timings of several steps can be interleaved)."""
    need = int(state.cache.lengths.max()) + steps * (tree.max_depth + 1) + tree.size
    if need > state.cache.size:
        raise ValueError(f"timing {steps} steps of a {tree.size}-node tree needs {need} cache slots, "
                         f"the state has {state.cache.size}")
    heads_cfg, head_params = prepared_heads(cfg, params, heads, tree) if tree.size > 1 else (None, None)
    args = (params, head_params, state)
    return timed_call(aot(run_steps, (cfg, heads_cfg, tree, steps), args), args, steps)


def step_seconds(cfg: ModelConfig, params, heads: Optional[Tuple[MedusaConfig, dict]], tree: TreeBuffers,
                 state: DecodeState, steps: int = 16, repeats: int = 3) -> float:
    """Seconds per greedy step with `tree` (`PLAIN_TREE` and heads None for a plain step), the
    heads prepared for it as decoding prepares them (`heads.medusa.prepare_heads`): the best of `repeats`
    timed calls of `steps` steps after one untimed call.

    The cache of `state` must hold ``steps * (tree.max_depth + 1) + tree.size`` more tokens.
    Raises ValueError when it does not.
    """
    return best_time(_step_call(cfg, params, heads, tree, state, steps), repeats)


def heads_seconds(cfg: ModelConfig, params, heads: Tuple[MedusaConfig, dict], depth: int, state: DecodeState,
                  steps: int = 16, repeats: int = 3, tree: Optional[TreeBuffers] = None) -> float:
    """Seconds per proposal of the first `depth` heads alone (blocks, vocabulary projection, top-k
    at ``state.hidden`` [B, D]), with `heads` as given: pass them through `heads.medusa.prepare_heads`
    first to time them as decoding runs them (`overhead_breakdown` does). With `tree`, the whole
    draft on that tree instead (`drafts.heads.draft_tokens`; needed for hydra heads, whose work depends
    on the tree). Raises ValueError for hydra heads without a tree."""
    heads_cfg, head_params = heads
    if tree is None and heads_cfg.head_type == "hydra":
        raise ValueError("timing hydra heads needs the tree they draft on: pass tree=")
    args = (params, head_params, state)
    return best_time(timed_call(aot(_run_heads, (cfg, heads_cfg, depth, tree, steps), args), args, steps), repeats)


def step_costs(cfg: ModelConfig, params, heads: Tuple[MedusaConfig, dict], trees: Iterable[TreeBuffers],
               prompt_ids: Sequence[int], steps: int = 16, repeats: int = 3, cache_size: int = 1024,
               progress: bool = True) -> Dict[str, object]:
    """c(T) for every tree: seconds per Medusa step divided by seconds per plain step, the two
    timed alternately, call by call, for each tree (best of `repeats` each): this project's CPU
    reads memory 10-15% faster or slower from one minute to the next (docs/performance.md), and
    a ratio of timings taken minutes apart carried that drift.

    Args:
      heads: (MedusaConfig, params) used to propose the candidates (their accuracy does not
        change the cost: every step runs the whole tree).
      trees: trees to time (any sizes; depth <= the number of heads).
      prompt_ids: the prompt that fills the cache before timing (its length sets the attention work).
      steps, repeats: steps per timed call, best-of repeats.
    Returns:
      {"plain_s": mean seconds per plain step, "plain_seconds": {T: the plain timing beside tree T},
      "seconds": {T: s}, "cost": {T: seconds[T] / plain_seconds[T]}} (T = tree size).
    """

    params = decoding_params(params)
    state = start_state(cfg, params, [list(prompt_ids)], cache_size)
    plain = _step_call(cfg, params, None, PLAIN_TREE, state, steps)
    plains, seconds, cost = {}, {}, {}
    for tree in tqdm(list(trees), desc="c(T)", unit="tree", disable=not progress):
        call = _step_call(cfg, params, heads, tree, state, steps)  # compiled before any timing
        plain(), call()                                             # untimed warm-ups
        pairs = [(plain(), call()) for _ in range(repeats)]         # alternated, best of each
        T = tree.size
        plains[T], seconds[T] = min(p for p, _ in pairs), min(s for _, s in pairs)
        cost[T] = seconds[T] / plains[T]
    plain_s = float(sum(plains.values()) / len(plains)) if plains else best_time(plain, repeats)
    return {"plain_s": plain_s, "plain_seconds": plains, "seconds": seconds, "cost": cost}


def overhead_breakdown(cfg: ModelConfig, params, heads: Tuple[MedusaConfig, dict], tree: TreeBuffers,
                       prompt_ids: Sequence[int], steps: int = 16, repeats: int = 3,
                       cache_size: int = 1024) -> Dict[str, float]:
    """Milliseconds per step of: a plain step, the T-node tree forward alone, the heads' proposal
    alone (blocks + vocabulary projection + top-k, the heads prepared for `tree` as decoding
    prepares them: `heads.medusa.prepare_heads`; hydra heads: their whole draft on `tree`), and the whole
    Medusa step; ``rest`` is the
    whole step minus forward and heads (candidate placement, posterior, cache compaction, loop)."""
    params = decoding_params(params)
    state = start_state(cfg, params, [list(prompt_ids)], cache_size)
    heads = prepared_heads(cfg, params, heads, tree)
    plain = step_seconds(cfg, params, None, PLAIN_TREE, state, steps, repeats)
    fwd_args = (params, state)
    fwd = best_time(timed_call(aot(_run_forwards, (cfg, tree, steps), fwd_args), fwd_args, steps), repeats)
    hd = heads_seconds(cfg, params, heads, tree.max_depth, state, steps, repeats,
                       tree=tree if heads[0].head_type == "hydra" else None)
    full = step_seconds(cfg, params, heads, tree, state, steps, repeats)
    ms = 1e3
    return {"plain_ms": plain * ms, "tree_forward_ms": fwd * ms, "heads_ms": hd * ms, "medusa_step_ms": full * ms,
            "rest_ms": (full - fwd - hd) * ms, "tree_size": tree.size}
