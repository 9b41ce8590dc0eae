"""One static-shape speculative step: a drafter's candidates -> tree forward -> posterior -> accepted
path -> KV compaction. The step verifies whatever its `Drafter` proposes (`decoding.proposal`;
the drafters: `medusa_jax.drafts`).

Method: Cai et al., "Medusa" (ICML 2024), Sec. 2.1.2 (tree attention) and Sec. 2.3.1 (typical
acceptance); reference implementation FasterDecoding/Medusa ``medusa/model/utils.py``
(``generate_candidates``, ``tree_decoding``, ``evaluate_posterior``, ``update_inference_inputs``).
Differences from the reference, all for speed: the heads run only on the last accepted position
(not on every tree node), the posterior reads only the argmax (greedy) or the candidate's
probability (typical) instead of copying full-vocabulary logits per path, and the accepted nodes'
K/V are moved with one fixed-size gather/scatter. Everything here is jit-compatible with static
shapes; `StepConfig` (the backbone's and heads' configs, the drafter holding its tree, the
acceptance rule) is the one static argument.

Hydra heads (Ankner et al. 2024, "Hydra", Sec. 3; `medusa_jax.heads.hydra`) draft per parent instead of
per head: head d runs on every depth-d node that has children, reading that node's own path
(`drafts.heads.hydra_candidates`). Verification is the same for every drafter.

Exact acceptance (``Acceptance(method="exact")``) is speculative sampling over the tree: Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling", Theorem 1) for one
draft, extended to several deterministic candidates per node as in Miao et al. 2024 ("SpecInfer",
Sec. 4.3, multi-step speculative sampling). A node's children are tried in rank order; the output
is distributed exactly as plain sampling at the same temperature and top-p (`evaluate_posterior`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from medusa_jax.decoding.acceptance import Acceptance, evaluate_posterior
from medusa_jax.decoding.logprobs import emitted_logprobs
from medusa_jax.decoding.processors import LogitsProcessors, step_logits
from medusa_jax.decoding.proposal import DraftInputs, Drafter
from medusa_jax.decoding.sampling import sample_tokens
from medusa_jax.decoding.state import DecodeState, StepOutput, constrain_state
from medusa_jax.decoding.tree_arrays import tree_rows
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import KVCache
from medusa_jax.models.llama import LlamaModel


def compact_cache(cache: KVCache, path_nodes: jax.Array, start: jax.Array, new_lengths: jax.Array) -> KVCache:
    """Move the accepted nodes' K/V to consecutive slots.

    The tree's K/V were written at slots ``start + node``; the accepted path's node j goes to slot
    ``start + j``. All D+1 path entries move (a fixed-size gather/scatter); those past the accepted
    length land beyond ``new_lengths`` and are never read. Node indices along a path are >= their
    depth, and the gather happens before the scatter, so no entry is overwritten before it is read.

    Args:
      path_nodes: [B, D+1] int32 node indices of the chosen path (root first).
      start: [B] int32 cache length before the tree forward.
      new_lengths: [B] int32.
    """
    B, P1 = path_nodes.shape
    rows = jnp.arange(B)[:, None]
    src = start[:, None] + path_nodes
    dst = start[:, None] + jnp.arange(P1, dtype=jnp.int32)[None, :]
    k, v = (c.at[:, rows, :, dst].set(c[:, rows, :, src], mode="drop") for c in (cache.k, cache.v))
    tokens = cache.tokens.at[rows, dst].set(cache.tokens[rows, src], mode="drop")
    return KVCache(k=k, v=v, lengths=new_lengths, tokens=tokens)


@dataclass(frozen=True)
class StepConfig:
    """Everything a compiled step is specialised on: the one static argument of the jitted steps
    (hashable; equal configs share a compilation), in place of positional statics.

    cfg: the backbone's config; heads_cfg: the draft heads' (None without heads);
    drafter: what the step verifies (`decoding.proposal.Drafter`, holding its tree;
      `medusa_jax.drafts.drafter_for(tree)` makes it); acc: the acceptance rule and its compile
      flags (`decoding.acceptance.Acceptance`); logprobs: the alternatives computed per emitted
      token (None: no log-probabilities).
    """
    cfg: ModelConfig
    heads_cfg: Optional[MedusaConfig]
    drafter: Drafter
    acc: Acceptance
    logprobs: Optional[int] = None

    def with_drafter(self, drafter: Drafter, heads: bool = True) -> "StepConfig":
        """This config with another drafter (``heads`` False: and no heads, as plain decoding's)."""
        return replace(self, drafter=drafter, heads_cfg=self.heads_cfg if heads else None)


def step_root(acc: Acceptance, state: DecodeState, procs: Optional[LogitsProcessors] = None) -> jax.Array:
    """[B] int32, the root token `medusa_step` decodes from `state`: each row's choice from
    ``state.logits`` (processed by `procs`: `decoding.processors`) at its position ``cache.lengths``
    (the argmax, or a sample by that position's key: `decoding.sampling.sample_tokens`)."""
    return sample_tokens(step_logits(procs, state), state.key, state.cache.lengths, state.temperature, state.top_p,
                         sampled=acc.mode != "greedy", nucleus=acc.filters, top_k=state.top_k)


def medusa_step(config: StepConfig, params, head_params, state: DecodeState,
                procs: Optional[LogitsProcessors] = None) -> Tuple[StepOutput, DecodeState]:
    """One speculative decoding step (pure; jit it with `config`, a `StepConfig`, static).

    1. Root token: the argmax, or a sample at the row's temperature and top-p, of ``state.logits``
       (`step_root`).
    2. The draft: ``drafter.propose`` (`decoding.proposal`; the drafters are `medusa_jax.drafts`':
       Medusa or Hydra heads on a static tree, a tree chosen per step, prompt lookup) gives the
       tree to verify (static, or per row) and the [B, T] tokens on its nodes, root first.
    3. One forward of the T tree tokens at positions ``length + depth`` with the ancestor mask.
    4. Posterior (`evaluate_posterior`: greedy, typical or exact), best path, accepted length a.
    5. Emits root + a candidates; the next logits/hidden are the last accepted node's; the path's
       K/V are compacted (unless the tree is a chain); lengths advance by a + 1.
    Steps 3-5 are the same for every drafter. A row's token at position t is chosen by the noise of
    its own key and t, so rows are independent of each other, and exact acceptance emits what plain
    sampling would (a drafter's tokens never depend on the target's random numbers). With the
    trivial tree (T = 1) this is exactly one plain decoding step and the heads are not run.

    With ``config.logprobs`` N (None: off) the output also holds the emitted tokens' log-probabilities
    and their N most likely alternatives (`decoding.logprobs.emitted_logprobs`). With `procs` (the
    rows' logit bias, penalties and min_p: `decoding.processors.LogitsProcessors`) every token is
    chosen from the processed logits, the root's and each tree node's alike (a node's penalties
    count the tokens on its path), so a plain step and a speculative step still choose the same
    tokens; the log-probabilities and the logits handed to the next step stay the model's own.

    Requires ``cache.lengths + drafter.tree.step_size <= cache.size`` (the caller picks a smaller
    tree near the end). Returns (StepOutput with ``drafter.max_accepted + 1`` token columns, next
    DecodeState). Raises ValueError (at trace time) when the drafter cannot draft its tree (e.g. a
    tree deeper than the heads).
    """
    c = config
    root = step_root(c.acc, state, procs)
    p = c.drafter.propose(DraftInputs(c.cfg, c.heads_cfg, head_params, params, state, root, procs))
    return _verify_tree(c.cfg, p.tree, p.compact, c.acc, params, state, p.tokens, c.drafter.max_accepted + 1,
                        c.logprobs, procs)


def _verify_tree(cfg: ModelConfig, tree, compact: bool, acc: Acceptance, params, state: DecodeState,
                 tree_tokens: jax.Array, width: int, logprobs: Optional[int] = None,
                 procs: Optional[LogitsProcessors] = None) -> Tuple[StepOutput, DecodeState]:
    """Steps 3-5 of `medusa_step` for the [B, T] tokens on the nodes of `tree` (a `TreeBuffers`, or
    `TreeArrays` with a row axis: each row's own tree; root first). compact (static): whether the
    accepted path's K/V must move (False for a chain, whose accepted prefix is in place). The
    emitted tokens (and their `logprobs`, when asked for) are padded to `width` columns; `procs`: as
    `medusa_step`'s."""
    B = tree_tokens.shape[0]
    tr = tree_rows(tree, B)
    D = tr.retrieve_indices.shape[2] - 1
    start = state.cache.lengths
    positions = start[:, None] + tr.depth
    logits, hidden, cache = LlamaModel(cfg).apply(
        {"params": params}, tree_tokens, positions, state.cache, tr.ancestor_mask)
    if D > 0:
        chosen_from = step_logits(procs, state, logits, tree_tokens, tr)
        best, acc_len = evaluate_posterior(chosen_from, tree_tokens, tr, acc, state, start)
        path_nodes = jnp.take_along_axis(tr.retrieve_indices, best[:, None, None], axis=1)[:, 0]  # [B, D+1]
        last = jnp.take_along_axis(path_nodes, acc_len[:, None], axis=1)[:, 0]
        if compact:
            cache = compact_cache(cache, path_nodes, start, start + acc_len + 1)
        else:  # a chain: node j already sits at slot start + j, the accepted prefix is in place
            cache = cache.replace(lengths=start + acc_len + 1)
        tokens = jnp.take_along_axis(tree_tokens, path_nodes, axis=1)
    else:
        acc_len = jnp.zeros((B,), jnp.int32)
        last = jnp.zeros((B,), jnp.int32)
        tokens = tree_tokens
        path_nodes = jnp.zeros((B, 1), jnp.int32)
    lp = None
    if logprobs is not None:
        pad3 = lambda a: jnp.pad(a, ((0, 0), (0, width - a.shape[1])) + ((0, 0),) * (a.ndim - 2))  # noqa: E731
        lp = jax.tree_util.tree_map(pad3, emitted_logprobs(state.logits, logits, path_nodes, tokens, logprobs))
    tokens = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    rows = jnp.arange(B)
    new_state = state.replace(logits=logits[rows, last], hidden=hidden[rows, last], cache=cache)
    return StepOutput(tokens=tokens, num_tokens=acc_len + 1, logprobs=lp), new_state


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("state",))
def step(config: StepConfig, params, head_params, state: DecodeState) -> Tuple[StepOutput, DecodeState]:
    """Jitted `medusa_step` (same arguments, the state donated); on a device mesh the output state
    keeps the input state's layout (`state.constrain_state`)."""
    out, st = medusa_step(config, params, head_params, state)
    return out, constrain_state(st)
