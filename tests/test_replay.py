"""medusa_jax.tuning.replay: exact acceptance on chats whose answers are the backbone's own greedy answers."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads, tiny_decoding_model

from medusa_jax.engine.generate import generate
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.drafts.lookup import ngram_draft, ngram_drafts
from medusa_jax.decoding.tree import build_tree, dynamic_tree, with_lookup
from medusa_jax.heads.hydra import token_embeddings
from medusa_jax.heads.medusa import with_proposal_projection
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.train.hidden import Backbone, compute_positions, position_sources
from medusa_jax.tuning.replay import (
    Replay,
    dynamic_accepted,
    lookup_drafts,
    lookup_draft,
    lookup_match,
    lookup_matches,
    path_ranks,
    rank_accuracies_of,
    replay,
    search_tree,
    tree_accepted,
)


def _prefix_closed_sets(nodes, size):
    for combo in itertools.combinations(nodes, size):
        s = set(combo)
        if all(p[:-1] in s or len(p) == 1 for p in s):
            yield combo


def test_search_tree_is_the_best_tree_by_brute_force():
    rng = np.random.default_rng(0)
    # skewed ranks with correlated depths (a position that misses early tends to miss later)
    ranks = np.minimum(rng.geometric(0.45, size=(400, 3)) - 1, 3).astype(np.int8)
    ranks[rng.random(400) < 0.3, 1:] = 3
    topk = 3
    nodes = [p for d in (1, 2, 3) for p in itertools.product(range(topk), repeat=d)]
    for T in (2, 3, 4, 5):
        best = max(int(tree_accepted(ranks, c).sum()) for c in _prefix_closed_sets(nodes, T - 1))
        got = search_tree(ranks, T, topk)
        assert len(got) == T - 1 and int(tree_accepted(ranks, got).sum()) == best
        assert all(len(p) == 1 or p[:-1] in got[:i] for i, p in enumerate(got))  # every prefix is a tree
    with pytest.raises(ValueError, match="num_nodes"):
        search_tree(ranks, 0)


def test_tree_accepted_and_rank_accuracies_by_hand():
    ranks = np.array([[0, 0, 1], [0, 2, 0], [1, 0, 0], [3, 0, 0], [0, 0, 0]], np.int8)   # topk 3: 3 = miss
    assert tree_accepted(ranks, [(0,), (0, 0), (1,), (0, 0, 1)]).tolist() == [3, 1, 1, 0, 2]
    assert tree_accepted(ranks, []).tolist() == [0] * 5
    valid = np.ones((3, 5), bool)
    valid[2, 4] = False                                       # head 2 has no label at the last position
    acc, counts = rank_accuracies_of(ranks, valid, 3)
    assert counts.tolist() == [5, 5, 4]
    np.testing.assert_allclose(acc, [[3 / 5, 1 / 5, 0], [4 / 5, 0, 1 / 5], [3 / 4, 1 / 4, 0]])
    with pytest.raises(ValueError, match="no calibration position"):
        rank_accuracies_of(ranks, np.zeros((3, 5), bool), 3)


@pytest.mark.parametrize("lookup", [PromptLookup(3, 3, 2), PromptLookup(5, 4, 1), PromptLookup(2, 2, 2),
                                    PromptLookup(3, 3, 1, matches=3)])
def test_lookup_draft_matches_the_device_search(lookup):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 4, 40), np.tile([5, 6, 7], 10), np.concatenate([rng.integers(0, 50, 20), [9, 9, 9, 9]]),
            rng.integers(0, 1000, 30)]
    for seq in seqs:
        for L in range(1, len(seq)):                       # context seq[:L], root seq[L]
            want_draft, found = ngram_draft(jnp.asarray(np.pad(seq[:L], (0, 64 - L)))[None], jnp.array([L]),
                                            jnp.array([seq[L]]), lookup)
            got = lookup_draft(seq[:L + 1], lookup)
            assert (got is not None) == bool(found[0])
            if got is not None:
                assert got.tolist() == np.asarray(want_draft[0]).tolist()
            drafts, founds, ngram = ngram_drafts(jnp.asarray(np.pad(seq[:L], (0, 64 - L)))[None], jnp.array([L]),
                                                 jnp.array([seq[L]]), lookup)
            every, n = lookup_match(seq[:L + 1], lookup)  # the latest first, as many as occurred
            assert [d.tolist() for d in lookup_matches(seq[:L + 1], lookup)] == [d.tolist() for d in every]
            assert int(ngram[0]) == n and (n == 0) == (not every)
            assert n == 0 or lookup.min_ngram <= n <= lookup.max_ngram
            assert np.asarray(founds[0]).tolist() == [c < len(every) for c in range(lookup.matches)]
            assert [d.tolist() for d in every] == np.asarray(drafts[0, :len(every)]).tolist()


def test_replay_by_hand():
    ids = np.array([1, 2, 3, 4, 5, 6])
    mask = np.array([0, 0, 1, 1, 1, 1], bool)                # answer 3 4 5 6, decoded from token 2 (t = 1)
    src = np.array([[0, t] for t in range(5)])
    assert replay([(ids, mask)], src, np.zeros(5, int)) == {"tokens": 4, "steps": 4, "lookup_steps": 0,
                                                            "lookup_tokens": 0}
    # accepting 1 everywhere: steps at t = 1 (emits 3 4) and t = 3 (5 6); never past the answer
    assert replay([(ids, mask)], src, np.ones(5, int))["steps"] == 2
    assert replay([(ids, mask)], src, np.full(5, 9))["tokens"] == 4
    loop = np.array([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9])
    m = np.arange(12) >= 6
    r = replay([(loop, m)], np.zeros((0, 2), int), np.zeros(0, int), PromptLookup(3, 3, 2))
    # the step at t = 5 (root 7) copies 8 9 7 from the earlier loop and accepts all: then 8 9 at t = 9
    assert r == {"tokens": 6, "steps": 2, "lookup_steps": 2, "lookup_tokens": 6}


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_replay_equals_greedy_decoding_of_the_models_own_answers(head_type):
    """The exactness claim: on chats whose answers are the backbone's greedy answers, the replay gives
    the steps greedy Medusa decoding takes, for the heads alone and with prompt lookup."""
    cfg, params = tiny_decoding_model()
    hcfg, hp = random_heads(cfg, params, 3, head_type, scale=0.3)
    lm = lm_head_matrix(cfg, params)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    prompts = [[3, 9, 14, 2, 7, 3, 9, 14], list(range(1, 20)), [12, 40, 12, 40, 5]]
    chats = []
    for p in prompts:
        answer = generate(cfg, params, p, max_new_tokens=60, eos_token_ids=()).tokens
        chats.append((np.array(p + answer, np.int32), np.array([False] * len(p) + [True] * len(answer))))
    pos = compute_positions(Backbone(cfg, params, "tiny"), chats, 3, 128, 512, progress=False)
    ranks = path_ranks(hcfg, jhp, lm, pos, 10, token_embeddings(params) if head_type == "hydra" else None, batch=16)
    assert ranks.shape == (pos.num_positions, 3)
    sources = position_sources(chats, 3)
    for choices in ([[0], [1], [0, 0]], list(search_tree(ranks, 6, 10))):
        tree = build_tree([tuple(c) for c in choices], 10)
        accepted = tree_accepted(ranks, tree.medusa_choices)
        for lookup in (None, PromptLookup(3, 3, 2)):
            decoded = [generate(cfg, params, p, max_new_tokens=60, heads=(hcfg, hp), tree=with_lookup(tree, lookup),
                                eos_token_ids=()) for p in prompts]
            assert all(d.tokens == c[0][len(p):].tolist() for d, c, p in zip(decoded, chats, prompts))
            r = replay(chats, sources, accepted, lookup)
            assert r["steps"] == sum(d.steps for d in decoded) and r["tokens"] == 180


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_dynamic_replay_equals_greedy_decoding_of_the_models_own_answers(head_type):
    """The same claim for trees chosen per step: `dynamic_accepted` drafts the tree at every position
    and the replay gives the steps greedy decoding with that dynamic tree takes."""
    cfg, params = tiny_decoding_model()
    hcfg, hp = random_heads(cfg, params, 3, head_type, scale=0.3)
    lm = lm_head_matrix(cfg, params)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    prompts = [[3, 9, 14, 2, 7, 3, 9, 14], list(range(1, 20)), [12, 40, 12, 40, 5]]
    chats = []
    for p in prompts:
        answer = generate(cfg, params, p, max_new_tokens=60, eos_token_ids=()).tokens
        chats.append((np.array(p + answer, np.int32), np.array([False] * len(p) + [True] * len(answer))))
    pos = compute_positions(Backbone(cfg, params, "tiny"), chats, 3, 128, 512, progress=False)
    sources = position_sources(chats, 3)
    emb = token_embeddings(params) if head_type == "hydra" else None
    for tree in (dynamic_tree(6, 3, 10, width=2), dynamic_tree(12, 2, 10, width=3)):
        accepted = dynamic_accepted(hcfg, jhp, lm, pos, tree, emb, batch=16)
        assert accepted.shape == (pos.num_positions,) and accepted.max() > 0
        decoded = [generate(cfg, params, p, max_new_tokens=60, heads=(hcfg, hp), tree=tree, eos_token_ids=())
                   for p in prompts]
        r = replay(chats, sources, accepted)
        assert r["steps"] == sum(d.steps for d in decoded) and r["tokens"] == 180
    # prompt lookup's copied chain inside the budget: each position's copy found as decoding finds it
    for lk, tree in [(PromptLookup(2, 2, 1), dynamic_tree(6, 3, 10, width=2)), (PromptLookup(2, 2, 1), dynamic_tree(4, 3, 10)),
                     (PromptLookup(2, 2, 1, matches=2), dynamic_tree(6, 3, 10, width=2)),  # two chains in the budget
                     (PromptLookup(3, 3, 1, matches=2), dynamic_tree(  # copies scored by the n-gram they matched
                         6, 3, 10, width=2, lookup_ngram_confidence={1: [-3.0], 3: [-0.01, -0.02]}))]:
        drafts = lookup_drafts(chats, sources, lk)
        assert drafts[1][:, 0].any() and not drafts[1][:, 0].all() and drafts[0].shape[1] == lk.matches
        tree = with_lookup(tree, lk)
        accepted = dynamic_accepted(hcfg, jhp, lm, pos, tree, emb, batch=16, lookup_drafts=drafts)
        decoded = [generate(cfg, params, p, max_new_tokens=60, heads=(hcfg, hp), tree=tree, eos_token_ids=())
                   for p in prompts]
        assert all(d.tokens == a for d, a in zip(decoded, [c[0][len(p):].tolist() for c, p in zip(chats, prompts)]))
        r = replay(chats, sources, accepted)
        assert r["steps"] == sum(d.steps for d in decoded) and r["tokens"] == 180


def test_search_tree_for_decoding_steps():
    """With a `Replay`, nodes are chosen for the fewest decoding steps: the first node is the best
    one-node tree by brute force, and every size's tree is prefix-closed."""
    rng = np.random.default_rng(3)
    chats = []
    for i in range(6):
        ids = rng.integers(0, 30, 80)
        mask = np.arange(80) >= 20
        chats.append((ids, mask))
    sources = np.array([[i, t] for i in range(6) for t in range(19, 78)])
    ranks = np.minimum(rng.geometric(0.5, size=(len(sources), 3)) - 1, 4).astype(np.int8)
    decoding = Replay(chats, sources)
    got = search_tree(ranks, 7, 4, decoding)
    assert len(got) == 6 and all(len(p) == 1 or p[:-1] in got[:i] for i, p in enumerate(got))
    steps = {r: decoding.run(tree_accepted(ranks, [(r,)], 4))["steps"] for r in range(4)}
    assert decoding.run(tree_accepted(ranks, got[:1], 4))["steps"] == min(steps.values())
    # the count-based search's first node is the most frequent rank, found by both here
    assert search_tree(ranks, 2, 4) == ((int(np.bincount(ranks[:, 0], minlength=5)[:4].argmax()),),)


def test_fit_lookup_confidence_by_hand():
    """Per depth, copied tokens accepted over those reached (the one before accepted, inside the answer);
    a second match's row counts only its tokens whose path differs from the first chain's."""
    from medusa_jax.tuning.confidence import fit_lookup_confidence

    chats = [(np.array([5, 6, 7, 8, 9, 10]), np.array([False, True, True, True, True, True]))]
    sources = np.array([[0, 0], [0, 1], [0, 2]])
    copied = np.array([[7, 8, 0], [8, 0, 10], [0, 10, 3]])  # truths 7 8 9 | 8 9 10 | 9 10 (then the end)
    got = fit_lookup_confidence(chats, sources, copied[:, None], np.array([[True], [True], [True]]))
    assert len(got) == 1 and np.allclose(np.exp(got[0]), [2 / 3, 1 / 2, 1e-3])
    second = np.array([[7, 9, 1], [0, 0, 0], [9, 10, 0]])  # shares 7 with the first chain; not found; all new
    got = fit_lookup_confidence(chats, sources, np.stack([copied, second], 1),
                                np.array([[True, True], [True, False], [True, True]]))
    assert np.allclose(np.exp(got[0]), [2 / 3, 1 / 2, 1e-3]) and np.allclose(np.exp(got[1]), [1.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="no copy"):
        fit_lookup_confidence(chats, sources, copied[:, None], np.zeros((3, 1), bool))


def test_fit_lookup_ngram_confidence_by_hand():
    """Per n-gram size, the latest match's row over the positions whose match was that long (sizes
    seen at fewer than `min_positions` positions left out; the later matches ignored)."""
    from medusa_jax.tuning.confidence import fit_lookup_ngram_confidence

    chats = [(np.array([5, 6, 7, 8, 9, 10]), np.array([False, True, True, True, True, True]))]
    sources = np.array([[0, 0], [0, 1], [0, 2]])
    copied = np.array([[7, 8, 0], [8, 0, 10], [0, 10, 3]])  # truths 7 8 9 | 8 9 10 | 9 10 (then the end)
    found = np.ones((3, 2), bool)
    got = fit_lookup_ngram_confidence(chats, sources, np.stack([copied, copied], 1), found, np.array([3, 3, 2]),
                                      min_positions=1)
    assert sorted(got) == [2, 3]
    assert np.allclose(np.exp(got[3]), [1.0, 1 / 2, 1e-3]) and np.allclose(np.exp(got[2]), [1e-3] * 3)
    assert fit_lookup_ngram_confidence(chats, sources, copied[:, None], found[:, :1], np.array([3, 3, 2]),
                                       min_positions=2) == {3: got[3]}
    assert fit_lookup_ngram_confidence(chats, sources, copied[:, None], found[:, :1], np.zeros(3, int)) == {}
