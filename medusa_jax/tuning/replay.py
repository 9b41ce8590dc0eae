"""What greedy decoding accepts on held-out chats, replayed exactly instead of estimated.

A self-distilled chat's answer is the backbone's own greedy answer, so greedy Medusa decoding of
its prompt emits exactly that answer, and what a step accepts at position t is fixed by the
answer: the step's root is token t+1, and a tree node (r_0, ..., r_{d-1}) is accepted when, for
every depth j < d, token t+j+2 is head j's rank-r_j proposal. Hydra heads propose from the path
they extend (Ankner et al. 2024, Sec. 3); on a path whose earlier tokens are right that path is
the answer's own tokens, which is what teacher forcing feeds them. So one number per head and
position, the rank of the true token among the head's proposals (`path_ranks`), gives:

- the exact accepted length of any tree at every position (`tree_accepted`), where Medusa Sec.
  3.3.1 multiplies per-head accuracies as if the heads erred independently;
- decoding itself, step by step (`Replay`), with prompt lookup choosing its draft from the
  context as `medusa_jax.drafts.lookup.ngram_draft` does: the tokens per step of the shipped decoding,
  not only of the heads;
- trees grown node by node for the fewest decoding steps (`search_tree`).

(Greedy decoding only: what sampling accepts depends on the draws. Near-ties, where the float32
forward of a tree step and of the prefill could order two logits differently, are ignored.)
The figures hold for chats like the held-out ones; other prompts accept differently.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.drafts.dynamic import draft_tree
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.heads.topk import head_topk
from medusa_jax.train.data import plain_positions, position_batches

Path = Tuple[int, ...]


def _table(embeddings):
    """The embedding table as the draft reads it: None, GGUF blocks as they are (`kernels.take_rows`
    reads their rows), an array as a jax array."""
    return embeddings if embeddings is None or isinstance(embeddings, kernels.BlockWeight) else jnp.asarray(embeddings)


def proposal_events(heads_cfg, head_params, base_lm_head, pos, topk: int, embeddings=None,
                    batch: int = 1024) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every head's top-k proposals at every held-out position, teacher forced: their head
    log-probabilities and whether each is the answer's next token.

    Args:
      heads_cfg, head_params: the heads, as decoding proposes (proposal vocabulary included).
      base_lm_head: [V, D] the backbone's lm_head (shared-lm_head heads project through it).
      pos: `train.data.Positions` of the chats (hidden [P, D], labels and valid [K, P], path tokens).
      topk: proposals per head.
      embeddings: hydra heads: [V, D] the backbone's input embeddings (`heads.hydra.token_embeddings`).
      batch: positions per call.
    Returns:
      (logprob [K, P, topk] float32, hit [K, P, topk] bool, valid [K, P] bool): head k's rank-r
      proposal at position t, whether it is token t+k+2, and whether head k has a label there.
    Raises ValueError when hydra heads lack embeddings.
    """
    if heads_cfg.head_type == "hydra" and embeddings is None:
        raise ValueError("hydra heads read token embeddings: pass embeddings [V, D]")
    emb = _table(embeddings)
    P, K = pos.num_positions, heads_cfg.num_heads
    lps, hits, valids = [], [], []
    for b in position_batches(plain_positions(pos.hidden[:P], pos.labels, pos.valid, pos.path_tokens), batch):
        lp, hit = _events(heads_cfg, topk, head_params, base_lm_head, emb, b)
        lps.append(np.asarray(lp))
        hits.append(np.asarray(hit))
        valids.append(np.asarray(b["valid"])[:K])
    if not lps:
        return np.zeros((K, 0, topk), np.float32), np.zeros((K, 0, topk), bool), np.zeros((K, 0), bool)
    return (np.concatenate(lps, axis=1)[:, :P], np.concatenate(hits, axis=1)[:, :P],
            np.concatenate(valids, axis=1)[:, :P])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _events(heads_cfg, topk: int, head_params, lm, emb, batch):
    """One batch of `proposal_events`: (logprob [K, N, topk], hit [K, N, topk])."""
    tokens, logp = head_topk(heads_cfg, head_params, batch["hidden"], lm, heads_cfg.num_heads, topk,
                             path_tokens=batch["path_tokens"], embeddings=emb, logprobs=True)
    hit = (tokens == batch["labels"][:, :, None]) & batch["valid"][:, :, None]
    return logp, hit


def ranks_of(hit: np.ndarray) -> np.ndarray:
    """`path_ranks` from `proposal_events`' hit [K, P, topk]: [P, K] int8, the rank of the hit, or
    topk where none."""
    return np.where(hit.any(-1), hit.argmax(-1), hit.shape[-1]).T.astype(np.int8)


def path_ranks(heads_cfg, head_params, base_lm_head, pos, topk: int, embeddings=None,
               batch: int = 1024) -> np.ndarray:
    """The rank of the true token among each head's proposals, at every position.

    Args: as `proposal_events`.
    Returns:
      [P, K] int8: entry [t, k] is r when token t+k+2 is head k's rank-r proposal (0 = its top-1),
      and `topk` when it is not among the `topk` proposals or has no label (past the answer).
    Raises ValueError when hydra heads lack embeddings.
    """
    return ranks_of(proposal_events(heads_cfg, head_params, base_lm_head, pos, topk, embeddings, batch)[1])


def dynamic_accepted(heads_cfg, head_params, base_lm_head, pos, tree, embeddings=None,
                     batch: int = 512, lookup_drafts: Optional[Tuple[np.ndarray, ...]] = None) -> np.ndarray:
    """What a tree chosen per step (``tree.dynamic``, `drafts.dynamic`) accepts at every position,
    exactly: the tree the heads draft there (its root the true token t+1, which greedy decoding of
    the self-distilled answer emits) and the longest of its paths whose tokens are the answer's next
    ones. Unlike a static tree's, this depends on the heads' whole proposal distributions, not only
    on the true tokens' ranks, so the draft itself runs at each position.

    Args: as `path_ranks`, `tree` a dynamic tree (`decoding.tree.dynamic_tree`), and with prompt
      lookup `lookup_drafts` = (copied [P, m, k] int32, found [P, m] bool[, ngram [P] int32]), each
      position's copied chains (`lookup_drafts`), which compete for the tree's slots as in decoding.
    Returns: [P] int32 accepted candidates per position (feed `Replay.run` without lookup: the copy
      is inside the tree).
    """
    if tree.max_accepted > heads_cfg.num_heads:
        raise ValueError(f"the held-out labels reach {heads_cfg.num_heads} tokens past the root, fewer than this "
                         f"tree accepts ({tree.max_accepted}): copy fewer tokens (prompt lookup) or replay a smaller tree")
    emb = _table(embeddings)
    P = pos.num_positions
    out = []
    for s, b in zip(range(0, P, batch), position_batches(
            plain_positions(pos.hidden[:P], pos.labels, pos.valid, pos.path_tokens), batch)):
        look = None
        if lookup_drafts is not None:
            part = [np.asarray(a)[s:s + batch] for a in lookup_drafts]
            look = tuple(np.pad(a, [(0, batch - len(a))] + [(0, 0)] * (a.ndim - 1)) for a in part)
        out.append(np.asarray(_dynamic_batch(heads_cfg, tree, head_params, base_lm_head, emb, b, look)))
    return (np.concatenate(out) if out else np.zeros((0,), np.int32))[:P]


def lookup_drafts(chats: Sequence[Tuple[np.ndarray, np.ndarray]], sources: np.ndarray,
                  lookup: PromptLookup) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt lookup's drafts at every source position (chat i, t: the context is the chat's tokens
    up to the root t+1), as decoding finds them (`lookup_match`).
    Returns: (copied [P, m, k] int32, filler where none; found [P, m] bool; ngram [P] int32, the n
    of the n-gram matched, 0 where none), m = ``lookup.matches``, as `drafts.lookup.ngram_drafts`."""
    src = np.asarray(sources).reshape(-1, 2)
    copied = np.zeros((len(src), lookup.matches, lookup.num_tokens), np.int32)
    found = np.zeros((len(src), lookup.matches), bool)
    ngram = np.zeros(len(src), np.int32)
    for j, (i, t) in enumerate(src):
        drafts, ngram[j] = lookup_match(np.asarray(chats[int(i)][0])[:int(t) + 2], lookup)
        for c, d in enumerate(drafts):
            copied[j, c], found[j, c] = d, True
    return copied, found, ngram


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dynamic_batch(heads_cfg, tree, head_params, lm, emb, batch, look) -> jax.Array:
    """[N] int32 accepted candidates of one batch of positions (`dynamic_accepted`)."""
    D = tree.max_accepted
    root = batch["path_tokens"][0]
    arrays, tokens = draft_tree(heads_cfg, head_params, lm, emb, batch["hidden"], root, tree, look)
    N, T = tokens.shape
    on_path = jnp.take_along_axis(tokens[:, None, :], arrays.retrieve_indices.reshape(N, 1, -1), axis=2)
    on_path = on_path.reshape(N, T, D + 1)[:, :, 1:]                                  # [N, T, D]
    truth = batch["labels"][:D].T[:, None, :]                                        # [N, 1, D]
    match = (on_path == truth) & arrays.valid[:, :, 1:] & batch["valid"][:D].T[:, None, :]
    return jnp.max(jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1), axis=-1).astype(jnp.int32)


def rank_accuracies_of(ranks: np.ndarray, valid: np.ndarray, topk: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per-head rank accuracies from `path_ranks`: (acc [K, topk] float64 = P(head k's rank-r
    proposal is right) over the positions where head k has a label, counts [K] int64 of those).
    Raises ValueError when some head has no labelled position."""
    ranks = np.asarray(ranks)
    valid = np.asarray(valid, bool)                                          # [K, P]
    counts = valid.sum(axis=1).astype(np.int64)
    if np.any(counts == 0):
        raise ValueError(f"no calibration position for heads {np.flatnonzero(counts == 0).tolist()}: "
                         "use more (or longer) held-out chats")
    hits = np.stack([np.bincount(ranks[valid[k], k].astype(np.int64), minlength=topk + 1)[:topk]
                     for k in range(valid.shape[0])])
    return hits / counts[:, None], counts


def _prefix_codes(ranks: np.ndarray, topk: int) -> np.ndarray:
    """[K, P] int64: entry [d, t] encodes the rank vector's first d + 1 ranks (one code per path:
    digits r + 1 in base topk + 1), or -1 once a rank misses (>= topk)."""
    ranks = np.asarray(ranks).astype(np.int64)
    P, K = ranks.shape
    codes = np.full((K, P), -1, np.int64)
    code = np.zeros(P, np.int64)
    alive = np.ones(P, bool)
    for d in range(K):
        alive &= ranks[:, d] < topk
        code = code * (topk + 1) + ranks[:, d] + 1
        codes[d] = np.where(alive, code, -1)
    return codes


def _code(path: Sequence[int], topk: int) -> int:
    c = 0
    for r in path:
        c = c * (topk + 1) + int(r) + 1
    return c


def tree_accepted(ranks: np.ndarray, choices: Iterable[Sequence[int]], topk: Optional[int] = None) -> np.ndarray:
    """[P] int32: the tokens the tree accepts at each position besides its root (the depth of the
    deepest tree path that the position's rank vector starts with).

    Args:
      ranks: [P, K] `path_ranks`. choices: the tree's paths (prefix-closed). topk: the ranks' miss
        value (default: one more than the largest rank in `choices`).
    """
    ranks = np.asarray(ranks)
    choices = [tuple(int(x) for x in p) for p in choices]
    depth = min(max((len(p) for p in choices), default=0), ranks.shape[1])
    if topk is None:
        topk = max((max(p) for p in choices if p), default=0) + 1
    codes = _prefix_codes(np.minimum(ranks, topk), topk)
    out = np.zeros(len(ranks), np.int32)
    alive = np.ones(len(ranks), bool)
    for d in range(depth):
        nodes = [_code(p, topk) for p in choices if len(p) == d + 1]
        alive &= np.isin(codes[d], nodes)
        out += alive
    return out


def lookup_draft(context: np.ndarray, lookup: PromptLookup) -> Optional[np.ndarray]:
    """The prompt-lookup draft after `context` (`lookup_matches`' first, the latest), or None."""
    drafts = lookup_matches(context, lookup._replace(matches=1))
    return drafts[0] if drafts else None


def lookup_matches(context: np.ndarray, lookup: PromptLookup) -> List[np.ndarray]:
    """The prompt-lookup drafts after `context` (its last token is the step's root), exactly as
    `drafts.lookup.ngram_drafts` computes them on the device: for the ``matches`` latest earlier
    occurrences of the longest n-gram that occurred, latest first, the `num_tokens` tokens after it
    (continued periodically past the end); [] when none did."""
    return lookup_match(context, lookup)[0]


def lookup_match(context: np.ndarray, lookup: PromptLookup) -> Tuple[List[np.ndarray], int]:
    """`lookup_matches`' drafts and the n of the n-gram they follow (0 when none occurred), as
    `drafts.lookup.ngram_drafts` returns it."""
    ctx = np.asarray(context)
    L = len(ctx) - 1
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        if L < n:
            continue
        pattern = ctx[L - n + 1:]
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:L], n)               # ends n-1 .. L-1
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            out = []
            for h in hits[::-1][:lookup.matches]:
                e = int(h) + n - 1
                idx = e + 1 + np.arange(lookup.num_tokens)
                period = L - e
                over = idx - L
                out.append(ctx[np.where(over > 0, idx - period * ((over + period - 1) // period), idx)])
            return out, n
    return [], 0


class Replay:
    """Greedy Medusa decoding of the chats' answers, step by step, for any tree's acceptance.

    Each answer (a run of the loss mask) is decoded from the token before it: a step whose last
    accepted token is t emits its root t+1 and the draft's accepted tokens, and the next step
    starts after them. The draft is the heads' tree, or with `lookup` the prompt-lookup chain when
    the context up to the root repeats an earlier n-gram (as decoding chooses, `drafts.lookup.ngram_draft`);
    what a copy accepts does not depend on the tree, so it is found once, here.

    Args:
      chats: (token ids [L], loss mask [L] bool) pairs, the answers' tokens masked True.
      sources: [P, 2] int (chat index, t) of the positions a tree's acceptance is given at
        (`train.hidden.position_sources`); positions not listed accept nothing from the heads.
      lookup: prompt-lookup settings, or None for the heads alone.
    """

    def __init__(self, chats: Sequence[Tuple[np.ndarray, np.ndarray]], sources: np.ndarray,
                 lookup: Optional[PromptLookup] = None):
        index = {(int(i), int(t)): j for j, (i, t) in enumerate(np.asarray(sources).reshape(-1, 2))}
        self.num_positions = len(index)
        self.segments = []          # (position index or -1, copy's accepted tokens or -1, per step start t)
        for i, (ids, mask) in enumerate(chats):
            ids, mask = np.asarray(ids), np.asarray(mask, bool)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
            for s, e in zip(edges[0::2], edges[1::2]):      # answer tokens s .. e-1, first step at t = s - 1
                ts = range(max(int(s) - 1, 0), int(e) - 1)
                where = [index.get((i, t), -1) for t in ts]
                copy = [self._copied(ids, t, int(e), lookup) for t in ts]
                room = [int(e) - (t + 2) for t in ts]       # tokens left after the root
                self.segments.append((where, copy, room))

    @staticmethod
    def _copied(ids, t: int, end: int, lookup: Optional[PromptLookup]) -> int:
        draft = lookup_draft(ids[:t + 2], lookup) if lookup is not None else None
        if draft is None:
            return -1
        truth = ids[t + 2:min(t + 2 + len(draft), end)]
        return int(np.cumprod(draft[:len(truth)] == truth).sum())

    def run(self, accepted: np.ndarray) -> Dict[str, int]:
        """Decode with the heads' tree accepting `accepted` [P] int at each source position.
        Returns {"tokens": tokens emitted, "steps": decoding steps, "lookup_steps": steps that
        verified a copied draft, "lookup_tokens": tokens those steps emitted}."""
        acc = np.append(np.asarray(accepted, np.int64), 0).tolist()       # index -1: no position, 0
        tokens = steps = lookup_steps = lookup_tokens = 0
        for where, copy, room in self.segments:
            t, n = 0, len(where)
            while t < n:
                a = copy[t]
                if a >= 0:
                    lookup_steps += 1
                    lookup_tokens += min(a, room[t]) + 1
                else:
                    a = acc[where[t]]
                a = min(a, room[t])
                tokens += a + 1
                steps += 1
                t += a + 1
        return {"tokens": tokens, "steps": steps, "lookup_steps": lookup_steps, "lookup_tokens": lookup_tokens}

    def tokens_per_step(self, accepted: np.ndarray) -> float:
        r = self.run(accepted)
        return r["tokens"] / max(r["steps"], 1)


def replay(chats, sources, accepted, lookup: Optional[PromptLookup] = None) -> Dict[str, int]:
    """`Replay(chats, sources, lookup).run(accepted)`: one decoding of the chats' answers."""
    return Replay(chats, sources, lookup).run(accepted)


def search_tree(ranks: np.ndarray, num_nodes: int, topk: int = 10, decoding: Optional[Replay] = None,
                candidates: int = 8) -> Tuple[Path, ...]:
    """The tree of `num_nodes` tokens (root included) grown node by node for the most acceptance.

    A node's path is accepted at a position when the position's rank vector starts with it; adding
    it to the tree adds one accepted token at exactly those positions. Without `decoding`, each
    step adds the node accepted at the most positions, which gives the tree of the largest total
    acceptance over the positions (a path never counts more than its parent, so the nodes of
    highest count form a tree). But decoding visits positions unevenly (a long acceptance skips the
    positions it covers), so with `decoding` each step adds, among the `candidates` most counted
    nodes that extend the tree, the one whose tree decodes the chats in the fewest steps
    (`Replay.run`).

    Args:
      ranks: [P, K] `path_ranks`. num_nodes: tree tokens, root included (>= 1). topk: ranks kept.
      decoding: a `Replay` of the chats the positions come from, or None.
    Returns:
      paths in the order added, so every prefix of the tuple is the tree this search gives at that
      size (fewer than `num_nodes - 1` when fewer paths ever occur); pass them to `decoding.tree.build_tree`.
    Raises ValueError when num_nodes < 1.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1 (the root), got {num_nodes}")
    codes = _prefix_codes(ranks, topk)
    counts: Dict[Path, int] = {}
    for d in range(codes.shape[0]):
        live = codes[d][codes[d] >= 0]
        if not len(live):
            break
        value, n = np.unique(live, return_counts=True)
        for v, c in zip(value.tolist(), n.tolist()):
            path = []
            while v:
                v, digit = divmod(v, topk + 1)
                path.append(digit - 1)
            counts[tuple(reversed(path))] = c
    out: list = []
    chosen: set = set()
    accepted = np.zeros(len(codes[0]) if len(codes) else 0, np.int64)
    while len(out) < num_nodes - 1:
        frontier = [p for p in counts if p not in chosen and (len(p) == 1 or p[:-1] in chosen)]
        if not frontier:
            break
        frontier.sort(key=lambda p: (-counts[p], len(p), p))
        best = frontier[0]
        if decoding is not None:
            gain = lambda p: accepted + (codes[len(p) - 1] == _code(p, topk))
            best = max(frontier[:candidates], key=lambda p: (decoding.tokens_per_step(gain(p)), counts[p]))
        accepted = accepted + (codes[len(best) - 1] == _code(best, topk))
        out.append(best)
        chosen.add(best)
    return tuple(out)
