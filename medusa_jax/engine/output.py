"""Output processing, written once for the engine: what one step's accepted tokens become for each
row's request (cut at its stop ids and token budget, with their log-probabilities) and the
engine's statistics (vLLM's speculation counters: drafts, draft tokens, accepted tokens, accepted
per position). Host only: numpy arrays in, Python lists out; no jax.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from medusa_jax.decoding.requests import FINISH_REASONS, TokenLogprob
from medusa_jax.decoding.tree import TreeBuffers
from medusa_jax.engine.rows import Row


def new_stats(trees: Sequence[TreeBuffers]) -> dict:
    """The engine's counters (all zero) for the trees its chooser picks from (plain first): steps,
    row-steps, tokens, prompt/prefill/reused tokens, requests, finish reasons, vLLM's speculation
    counters, each tree's choices and step sizes, the accepted-length histogram, cache sizes."""
    depth = max(t.max_accepted for t in trees)
    return {"steps": 0, "row_steps": 0, "tokens": 0, "prompt_tokens": 0, "prefill_tokens": 0, "reused_tokens": 0,
            "requests": 0, "finished": {r: 0 for r in FINISH_REASONS}, "drafts": 0, "draft_tokens": 0,
            "accepted_tokens": 0, "accepted_per_pos": [0] * depth, "tree_choices": [0] * len(trees),
            "tree_sizes": [t.step_size for t in trees], "hist": [0] * (depth + 1), "cache_sizes": []}


def count_step(stats: dict, tree_index: int, emitted: Sequence[int]) -> None:
    """Count one step of tree `tree_index` (into the chooser's trees) whose rows emitted `emitted`
    tokens each (accepted + 1, before any cut): steps, the tree's choices, the accepted-length histogram."""
    stats["steps"] += 1
    stats["tree_choices"][tree_index] += 1
    for n in emitted:
        stats["hist"][n - 1] += 1


def max_logprobs(requests: Sequence) -> Optional[int]:
    """The alternatives a step computes for its rows' `requests`: the most any asks for (rows that
    ask for fewer keep their first ones), None when none asks for log-probabilities."""
    asked = [r.logprobs for r in requests if r.logprobs is not None]
    return max(asked) if asked else None


def row_logprobs(tokens: np.ndarray, num: int, lps, b: int, top: Optional[int]) -> Optional[List[TokenLogprob]]:
    """Row b's first `num` emitted tokens with their log-probabilities and `top` alternatives each
    (None when the row did not ask: ``top`` None). tokens: [B, W] int32; lps: the step's
    `decoding.logprobs` output on the host (logprob [B, W], top_ids / top_logprobs [B, W, N])."""
    if top is None:
        return None
    return [TokenLogprob(int(tokens[b, j]), float(lps.logprob[b, j]),
                         tuple(zip(lps.top_ids[b, j, :top].tolist(), lps.top_logprobs[b, j, :top].tolist())))
            for j in range(num)]


def cut_chunk(chunk: List[int], stop: set, room: int) -> Tuple[List[int], Optional[str]]:
    """(`chunk` cut after its first stop id and to `room` tokens, the finish reason or None): "eos"
    at a stop id, "length" when the budget is reached (a stop token past the budget is cut off
    with it)."""
    reason = None
    for j, t in enumerate(chunk):
        if t in stop:
            chunk, reason = chunk[:j + 1], "eos"
            break
    if len(chunk) > room or (len(chunk) == room and reason is None):
        reason = "length"
    return chunk[:room], reason


def count_speculation(stats: dict, row: Row, tree: TreeBuffers, accepted: int) -> None:
    """Add one row-step that verified `tree` and accepted `accepted` drafted tokens to the engine's
    counters (named as vLLM's) and to the row's own (draft tokens, accepted depths)."""
    if tree.max_accepted == 0:
        return
    stats["drafts"] += 1
    stats["draft_tokens"] += tree.step_size - 1
    stats["accepted_tokens"] += accepted
    row.draft_tokens += tree.step_size - 1
    for d in range(accepted):
        stats["accepted_per_pos"][d] += 1
    while len(row.depth_hist) < tree.max_accepted:
        row.depth_hist.append(0)
    for d in range(accepted):
        row.depth_hist[d] += 1


def deliver(stats: dict, row: Row, chunk: List[int], tree: TreeBuffers, now: float, wall: float,
            lp: Optional[List[TokenLogprob]] = None) -> Optional[str]:
    """Hand a row's accepted tokens (root first; their log-probabilities `lp`, when it asked) to its
    request, cut at a stop id and the budget (`cut_chunk`), and count them. now: the read-back's
    time (s, ``time.perf_counter``); wall: the step's seconds (host work included, compilation not).
    Returns the finish reason when the request is done, else None."""
    row.decode_s += wall
    stats["row_steps"] += 1
    row.steps += 1
    count_speculation(stats, row, tree, len(chunk) - 1)
    chunk, reason = cut_chunk(chunk, row.stop, row.request.max_new_tokens - len(row.tokens))
    if row.first_token_at is None and chunk:
        row.first_token_at = now
    row.tokens.extend(chunk)
    row.step_tokens.append(len(chunk))
    stats["tokens"] += len(chunk)
    if chunk and lp is not None:
        row.logprobs.extend(lp[:len(chunk)])
        row.handle._emit("logprobs", lp[:len(chunk)])
    if chunk:
        row.handle._emit("tokens", chunk)
    return reason
