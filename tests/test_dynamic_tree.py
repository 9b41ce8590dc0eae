"""A draft tree chosen per step at a fixed node budget (medusa_jax.drafts.dynamic): the selection
against brute force (Medusa heads) and a node-by-node reference (Hydra heads), the per-row arrays'
consistency, lossless greedy decoding with and without prompt lookup (loops, on-device loop,
engine), an oracle, and the tree spec's parsing, files and errors."""
import itertools
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model
from test_hydra import DM, V, bigram_backbone, random_hydra

from medusa_jax.drafts.dynamic import DEPTH_COST, dynamic_draft, select_tree
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.requests import Request
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.tree import (
    dynamic_tree,
    get_tree,
    tree_to_json,
    tree_with_budget,
    truncate_tree,
    with_lookup,
)
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import head_state, token_embeddings
from medusa_jax.heads.medusa import init_heads, prepare_heads
from medusa_jax.heads.topk import head_topk, states_topk
from medusa_jax.models.llama import lm_head_matrix

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    return cfg, params


def random_medusa(cfg, params, num_heads=4, seed=2, scale=0.5):
    hcfg = MedusaConfig(hidden_size=DM, vocab_size=V, num_heads=num_heads, num_layers=1)
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(hp))
    return hcfg, {k: jax.random.normal(kk, a.shape) * scale for kk, (k, a) in zip(keys, sorted(hp.items()))}


def check_arrays(arrays, tokens, b):
    """Row b's tree arrays are one consistent tree; returns its nodes as token paths (root first)."""
    mask, depth, parents, paths, valid = (np.asarray(a[b]) for a in arrays)
    toks = np.asarray(tokens[b])
    T = len(depth)
    assert parents[0] == -1 and depth[0] == 0 and (np.diff(depth) >= 0).all()  # by depth, root first
    nodes = []
    for i in range(T):
        d = depth[i]
        assert valid[i, :d + 1].all() and not valid[i, d + 1:].any() and paths[i, d] == i and paths[i, 0] == 0
        if i:
            assert parents[i] == paths[i, d - 1] and depth[parents[i]] == d - 1 and parents[i] < i
        assert set(np.flatnonzero(mask[i])) == set(paths[i, :d + 1].tolist())  # the ancestor mask
        nodes.append(tuple(toks[paths[i, :d + 1]].tolist()))
    assert len(set(nodes)) == T  # no node twice
    return nodes


def state_for(cfg, params, hidden):
    B = hidden.shape[0]
    return DecodeState(cache=None, logits=jnp.zeros((B, cfg.vocab_size)), hidden=hidden, key=None,
                       temperature=jnp.zeros((B,)), top_p=jnp.ones((B,)), top_k=jnp.zeros((B,), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2, 5, 16, 40])
def test_medusa_selection_is_the_best_first_top_t(tiny, budget):
    """Medusa heads: the T - 1 nodes are exactly the best T - 1 of all k^1 + ... + k^D paths by the
    sum of the heads' log-probabilities along the path (brute force)."""
    cfg, params = tiny
    hcfg, hp = random_medusa(cfg, params)
    k, D = 4, 3
    tree = dynamic_tree(budget, D, topk=k)
    dparams, dhcfg, dhp, _ = decoding_setup(cfg, params, (hcfg, hp), tree)
    hidden = jax.random.normal(jax.random.PRNGKey(5), (3, DM))
    root = jnp.asarray([3, 7, 11], jnp.int32)
    arrays, tokens = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden), root, tree)
    ids, logp = head_topk(dhcfg, dhp, hidden, lm_head_matrix(cfg, dparams), D, k, logprobs=True)
    ids, logp = np.asarray(ids), np.asarray(logp)
    for b in range(3):
        nodes = check_arrays(arrays, tokens, b)
        scored = []
        for d in range(1, D + 1):
            for ranks in itertools.product(range(k), repeat=d):
                s = sum(logp[j, b, r] for j, r in enumerate(ranks)) - DEPTH_COST * d
                scored.append((s, (int(root[b]),) + tuple(int(ids[j, b, r]) for j, r in enumerate(ranks))))
        scored.sort(key=lambda x: -x[0])
        if budget - 1 < len(scored):  # no tie at the cut (else either node would do)
            assert scored[budget - 2][0] > scored[budget - 1][0] + 1e-6
        assert set(nodes[1:]) == {p for _, p in scored[:budget - 1]}


def reference_hydra(hcfg, hp, lm, emb, hidden, root, D, k, W, T, chains=(), rates=()):
    """Node by node, nodes keyed by their paths: depth by depth, head d on each expanded path, then
    each copied chain's next token under its own node (`chains`: token lists, the latest match first,
    scored by `rates`; the same path keeps the better score), then the W best of the depth (the
    heads' and the chains' alike; never more than the T - 1 - d a tree can hold there) are expanded;
    the best T - 1 of all drafted."""
    drafted = {}
    frontier = [(0.0, (int(root),))]
    chain_at = [(int(root),)] * len(chains)
    for d in range(max([D] + [len(ch) for ch in chains])):
        level = {}
        if d < D:
            for score, path in frontier:
                st = head_state(hcfg, hp, d, hidden[None], jnp.take(emb, jnp.asarray(path), axis=0)[None])
                t, lp = states_topk(hcfg, hp, st[None], lm, k, first=d, logprobs=True)
                for r in range(k):
                    level[path + (int(t[0, 0, r]),)] = score + float(lp[0, 0, r]) - DEPTH_COST
        for c, chain in enumerate(chains):
            if d < len(chain):
                parent = chain_at[c]
                node = parent + (int(chain[d]),)
                s = (drafted.get(parent, 0.0) if d else 0.0) + rates[c][d] - DEPTH_COST
                level[node] = max(level.get(node, -1e30), s)
                chain_at[c] = node
        drafted.update(level)
        frontier = [(s, p) for p, s in sorted(level.items(), key=lambda x: -x[1])[:min(W, T - 1 - d)]]
    return {p for p, _ in sorted(drafted.items(), key=lambda x: -x[1])[:T - 1]}


def hydra_setup(tiny, budget, width, k, D, seed):
    """What the hydra selection tests share: random hydra heads on the tiny backbone, a `dynamic:budget:width`
    tree of depth D over the heads' top k, two rows' hidden states [2, DM] and roots [2], and the
    reference's lm_head and embeddings."""
    cfg, params = tiny
    tree = dynamic_tree(budget, D, topk=k, width=width)
    dparams, dhcfg, dhp, _ = decoding_setup(cfg, params, random_hydra(cfg, params), tree)
    hidden = jax.random.normal(jax.random.PRNGKey(seed), (2, DM))
    return SimpleNamespace(tree=tree, dparams=dparams, dhcfg=dhcfg, dhp=dhp, hidden=hidden,
                           root=jnp.asarray([4, 9], jnp.int32), state=state_for(cfg, params, hidden),
                           lm=lm_head_matrix(cfg, dparams), emb=token_embeddings(dparams))


@pytest.mark.slow
@pytest.mark.parametrize("budget,width", [(6, 1), (12, 2), (20, 3)])
def test_hydra_selection_equals_node_by_node_reference(tiny, budget, width):
    k, D = 5, 3
    h = hydra_setup(tiny, budget, width, k, D, seed=6)
    arrays, tokens = dynamic_draft(tiny[0], h.dhcfg, h.dhp, h.dparams, h.state, h.root, h.tree)
    for b in range(2):
        nodes = check_arrays(arrays, tokens, b)
        assert set(nodes[1:]) == reference_hydra(h.dhcfg, h.dhp, h.lm, h.emb, h.hidden[b], h.root[b], D, k, width,
                                                 budget)


def test_select_tree_on_hand_made_scores():
    # candidates: depth 1: a(0) b(1); depth 2: a->c(2), b->d(3), a->e(4)
    tokens = jnp.asarray([[10, 11, 12, 13, 14]], jnp.int32)
    scores = jnp.asarray([[-0.1, -1.0, -0.3, -2.0, -0.5]])
    parents = jnp.asarray([[-1, -1, 0, 1, 0]], jnp.int32)
    arrays, toks = select_tree(tokens, scores, parents, np.asarray([1, 1, 2, 2, 2]), jnp.asarray([5]), 4, 2)
    assert toks.tolist() == [[5, 10, 12, 14]]  # a, then its children c and e (b scores below e)
    assert arrays.parents.tolist() == [[-1, 0, 1, 1]] and arrays.depth.tolist() == [[0, 1, 2, 2]]
    assert arrays.retrieve_indices.tolist() == [[[0, 0, 0], [0, 1, 0], [0, 1, 2], [0, 1, 3]]]


PROMPTS = [[1, 5, 9, 3, 7], [12], [2, 4, 2, 4, 2, 4, 2]]


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("spec,lookup", [("dynamic:8", None), ("dynamic:24:3", None), ("dynamic:12", PromptLookup()),
                                         ("dynamic:10", PromptLookup(2, 2, 1, matches=3))])
def test_dynamic_greedy_equals_plain_greedy(tiny, head_type, spec, lookup):
    cfg, params = tiny
    hcfg, hp = random_hydra(cfg, params) if head_type == "hydra" else random_medusa(cfg, params)
    tree = with_lookup(get_tree(spec, num_heads=hcfg.num_heads), lookup)
    assert tree.size == int(spec.split(":")[1]) and tree.max_depth == 4
    heads = prepare_heads(hcfg, hp, lm_head_matrix(cfg, params), depth=tree.max_depth)
    base = {}
    for prompt in PROMPTS:
        base[tuple(prompt)] = generate(cfg, params, prompt, max_new_tokens=48).tokens
        med = generate(cfg, params, prompt, max_new_tokens=48, heads=heads, tree=tree)
        assert med.tokens == base[tuple(prompt)] and sum(med.tokens_per_step) == 48
    r = generate_device(cfg, params, PROMPTS, max_new_tokens=48, heads=heads, tree=tree, eos_token_ids=())
    for i, prompt in enumerate(PROMPTS):
        assert r.tokens[i, :48].tolist() == base[tuple(prompt)]
    engine = Engine(cfg, params, heads=heads, tree=tree, max_batch=2, speculation="always", eos_token_ids=())
    handles = [engine.submit(Request(p, 48)) for p in PROMPTS]
    engine.run()
    assert [h.finished.tokens for h in handles] == [base[tuple(p)] for p in PROMPTS]


def test_oracle_hydra_heads_fill_the_deepest_path():
    """Heads that know the bigram backbone's next token give it probability ~1 at every depth: the
    dynamic tree's best path is the chain of true tokens, and every step accepts the whole depth."""
    cfg, params = bigram_backbone()
    K = 4
    hcfg = MedusaConfig(hidden_size=DM, vocab_size=V, num_heads=K, num_layers=1, head_type="hydra")
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    big = 1e3 * jnp.diag(params["norm"]["scale"])
    for k in range(K):
        hp[f"path_residual_{k}"] = hp[f"path_residual_{k}"].at[k].set(big)
    tree = get_tree("dynamic:6:1", num_heads=K)
    heads = prepare_heads(hcfg, hp, lm_head_matrix(cfg, params), depth=tree.max_depth)
    base = generate(cfg, params, [3, 9, 27], max_new_tokens=60)
    med = generate(cfg, params, [3, 9, 27], max_new_tokens=60, heads=heads, tree=tree)
    assert med.tokens == base.tokens
    assert all(n == K + 1 for n in med.tokens_per_step[:-1]), med.tokens_per_step


def test_dynamic_tree_specs_files_and_errors(tmp_path):
    t = get_tree("dynamic:16", num_heads=3)
    assert (t.size, t.max_depth, t.num_paths, t.step_size, t.max_accepted, t.dynamic.width) == (16, 3, 16, 16, 3, 4)
    assert get_tree("dynamic:3", num_heads=4).max_depth == 2  # no deeper than the budget allows
    assert get_tree("dynamic:16:2", topk=8).dynamic.width == 2 and get_tree("dynamic:16:2", topk=8).topk == 8
    assert t == get_tree("dynamic:16", num_heads=3) and t != get_tree("dynamic:16:2", num_heads=3)
    assert hash(t) == hash(get_tree("dynamic:16", num_heads=3))
    path = tmp_path / "tree.json"
    tree_to_json(with_lookup(t, PromptLookup()), path)
    assert json.loads(path.read_text())["dynamic"] == {"budget": 16, "width": 4}
    assert get_tree(str(path), num_heads=3) == with_lookup(t, PromptLookup())
    assert get_tree(t, num_heads=2).max_depth == 2  # fewer heads: shallower
    assert tree_with_budget(t, 8).size == 8 and tree_with_budget(t, 1).size == 1 and tree_with_budget(t, 99) is t
    assert truncate_tree(t, 1).max_depth == 1 and truncate_tree(t, 1).size == 11  # 1 + topk at depth 1
    for bad, match in [("dynamic:", "dynamic:T"), ("dynamic:x", "dynamic:T"), ("dynamic:1", "at least 2"),
                       ("dynamic:8:0", "width"), ("dynamic:99999", "more nodes")]:
        with pytest.raises(ValueError, match=match):
            get_tree(bad, num_heads=4)
    with pytest.raises(ValueError, match="budget"):
        (tmp_path / "bad.json").write_text('{"dynamic": {"width": 2}}')
        get_tree(str(tmp_path / "bad.json"))


def test_fit_confidence_recovers_the_acceptance_rate_per_depth():
    """Proposals whose true acceptance is exp(logprob) ** 2 at depth 0 and exp(logprob) at depth 1:
    the fitted map gives those rates back (within sampling error), nondecreasing and <= 1."""
    from medusa_jax.tuning.confidence import fit_confidence

    rng = np.random.default_rng(0)
    K, P, k = 2, 40000, 3
    logprob = np.log(rng.uniform(0.02, 1.0, (K, P, k))).astype(np.float32)
    truth = np.stack([np.exp(logprob[0]) ** 2, np.exp(logprob[1])])
    hit = rng.uniform(size=(K, P, k)) < truth
    valid = np.ones((K, P), bool)
    valid[1, : P // 2] = False  # head 1 labelled on half the positions only
    knots, values = fit_confidence(logprob, hit, valid, bins=16)
    assert list(knots) == sorted(knots) and len(values) == K
    for d, want in enumerate([lambda p: p ** 2, lambda p: p]):
        v = np.asarray(values[d])
        assert (np.diff(v) >= 0).all() and (v <= 0).all()
        inner = [(x, y) for x, y in zip(knots, v) if np.log(0.05) < x < np.log(0.95)]
        assert inner and all(abs(np.exp(y) - want(np.exp(x))) < 0.05 for x, y in inner), (d, inner)
    with pytest.raises(ValueError, match="no labelled"):
        fit_confidence(logprob, hit, np.zeros((K, P), bool))


def test_confidence_scores_nodes_and_travels_with_the_tree(tiny, tmp_path):
    """A confidence map replaces the heads' log-probabilities as node scores (a map that makes depth 2
    worthless keeps the whole budget at depth 1); it survives tree files, budgets and depth cuts,
    and `resolve.with_confidence` gives a dynamic tree the heads' saved map."""
    from medusa_jax.drafts.dynamic import node_confidence
    from medusa_jax.resolve import with_confidence

    cfg, params = tiny
    hcfg, hp = random_medusa(cfg, params)
    knots = (-3.0, -1.0, 0.0)
    conf = (knots, ((-3.0, -0.5, 0.0), (-30.0, -30.0, -30.0)))  # depth 2 and below: never accepted
    tree = dynamic_tree(6, 3, topk=5, confidence=conf)
    lp = jnp.asarray([-40.0, -2.0, -1.0, -0.5, 0.0])
    assert np.allclose(node_confidence(tree.dynamic, 0, lp), [-3.0, -1.75, -0.5, -0.25, 0.0])
    assert np.allclose(node_confidence(tree.dynamic, 3, lp), -30.0)  # past the rows: the last one
    dparams, dhcfg, dhp, _ = decoding_setup(cfg, params, (hcfg, hp), tree)
    hidden = jax.random.normal(jax.random.PRNGKey(5), (2, DM))
    arrays, tokens = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden),
                                   jnp.asarray([3, 7], jnp.int32), tree)
    assert np.asarray(arrays.depth).tolist() == [[0, 1, 1, 1, 1, 1]] * 2  # the top 5 of head 0 only
    plain = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden), jnp.asarray([3, 7], jnp.int32),
                          dynamic_tree(6, 3, topk=5))[0]
    assert np.asarray(plain.depth).max() > 1  # without the map the heads' own scores go deeper
    path = tmp_path / "t.json"
    tree_to_json(tree, path)
    back = get_tree(str(path), num_heads=3)
    assert back.dynamic == tree.dynamic and back == tree
    assert tree_with_budget(tree, 4).dynamic.confidence == conf
    assert truncate_tree(tree, 2).dynamic.confidence == conf
    saved = {"knots": list(knots), "values": [list(v) for v in conf[1]]}
    assert with_confidence(dynamic_tree(6, 3, topk=5), saved).dynamic.confidence == conf
    assert with_confidence(tree, {"knots": [0.0, 1.0], "values": [[-1.0, 0.0]]}) is tree  # its own map stays
    static = get_tree([(0,), (1,)])
    assert with_confidence(static, saved) is static
    with pytest.raises(ValueError, match="confidence"):
        dynamic_tree(6, 3, confidence=((0.0, -1.0), ((-1.0, 0.0),)))  # knots not increasing
    with pytest.raises(ValueError, match="confidence"):
        dynamic_tree(6, 3, confidence=((-1.0, 0.0), ((-1.0, 0.5),)))  # a probability above 1


def test_lookup_chain_competes_for_the_slots():
    """Prompt lookup's copied chain joins the heads' candidates depth by depth: under the heads' node
    with the same token when there is one (that node then scores the better estimate), beside them
    when not, and not at all in a row whose n-gram did not occur. A node scores its parent's score
    plus its rate."""
    from medusa_jax.drafts.dynamic import add_chain_tokens

    c = DEPTH_COST
    copied = jnp.asarray([[11, 20], [30, 31], [10, 12]], jnp.int32)[:, None]     # [B, m=1, 2]
    found = jnp.asarray([True, True, False])[:, None]
    # depth 1: the heads drafted 10, 11 under the root
    t1, s1, p1, node, sc = add_chain_tokens(jnp.asarray([[10, 11]] * 3, jnp.int32), jnp.asarray([[-0.1, -1.0]] * 3),
                                            jnp.full((3, 2), -1, jnp.int32), 0, jnp.full((3, 1), -1, jnp.int32),
                                            jnp.zeros((3, 1)), copied[:, :, 0], found, [-0.5])
    assert t1[0].tolist() == [10, 11, 11] and p1[0].tolist() == [-1, -1, -1]
    assert np.allclose(s1[0, :2], [-0.1, -0.5 - c]) and s1[0, 2] < -1e29 and node[0, 0] == 1  # merged into 11
    assert np.allclose(s1[1], [-0.1, -1.0, -0.5 - c]) and node[1, 0] == 2                        # beside
    assert np.allclose(s1[2, :2], [-0.1, -1.0]) and s1[2, 2] < -1e29                           # no match: no node
    # depth 2 (candidates 3..): the heads drafted 12, 13 under node 0; 20 and 31 hang under the chains' nodes
    t2, s2, p2, node2, sc2 = add_chain_tokens(jnp.asarray([[12, 13]] * 3, jnp.int32), jnp.asarray([[-0.3, -2.0]] * 3),
                                              jnp.zeros((3, 2), jnp.int32), 3, node, sc, copied[:, :, 1], found, [-0.1])
    assert p2[0].tolist() == [0, 0, 1] and np.isclose(s2[0, 2], -0.6 - 2 * c) and node2[0, 0] == 5
    assert p2[1].tolist() == [0, 0, 2] and np.isclose(s2[1, 2], -0.6 - 2 * c)
    assert s2[2, 2] < -1e29 and np.allclose(s2[2, :2], [-0.3, -2.0])
    tokens, scores = jnp.concatenate([t1, t2], 1), jnp.concatenate([s1, s2], 1)
    arrays, toks = select_tree(tokens, scores, jnp.concatenate([p1, p2], 1), np.asarray([1, 1, 1, 2, 2, 2]),
                               jnp.asarray([1, 2, 3]), 5, 2)
    assert toks[0].tolist() == [1, 10, 11, 12, 20] and arrays.parents[0].tolist() == [-1, 0, 0, 1, 2]
    assert toks[1].tolist() == [2, 10, 30, 12, 31] and arrays.parents[1].tolist() == [-1, 0, 0, 1, 2]
    assert toks[2].tolist() == [3, 10, 11, 12, 13]


def test_several_lookup_matches_share_their_common_prefix():
    """Two copied chains (the latest match, then the one before): where the second repeats the first
    (or the heads') token under the same parent it goes on from that node, at its first own token it
    branches, scored with the later matches' rate."""
    from medusa_jax.drafts.dynamic import add_chain_tokens

    c = DEPTH_COST
    copied = jnp.asarray([[[30, 31, 32], [30, 31, 40]],           # the same first two tokens
                          [[30, 31, 32], [41, 42, 43]],           # nothing in common
                          [[10, 12, 50], [30, 31, 32]]], jnp.int32)  # chain 0 follows the heads' 10
    found = jnp.asarray([[True, True], [True, True], [True, False]])
    rates = [(-0.5, -0.1, -0.1), (-1.0, -0.2, -0.3)]
    node, score = jnp.full((3, 2), -1, jnp.int32), jnp.zeros((3, 2))
    heads = [([10, 11], [-0.1, -1.0], [-1, -1]), ([12, 13], [-0.3, -2.0], [0, 0]), ([], [], [])]
    blocks, offset = [], 0
    for d, (ht, hs, hp) in enumerate(heads):
        blk = add_chain_tokens(jnp.asarray([ht] * 3, jnp.int32).reshape(3, -1),
                               jnp.asarray([hs] * 3, jnp.float32).reshape(3, -1),
                               jnp.asarray([hp] * 3, jnp.int32).reshape(3, -1), offset, node, score,
                               copied[:, :, d], found, [r[d] for r in rates])
        node, score = blk[3], blk[4]
        blocks.append(blk[:3])
        offset += blk[0].shape[1]
    t, s, p = (jnp.concatenate([b[i] for b in blocks], 1) for i in range(3))
    assert t.shape == (3, 10)   # depth 1: 10 11 c0 c1 (0-3); depth 2: 12 13 c0 c1 (4-7); depth 3: c0 c1 (8-9)
    # row 0: chain 1 is chain 0 for two tokens (its slots unused), then 40 under chain 0's 31 (slot 6)
    assert (s[0, [3, 7]] < -1e29).all() and p[0, 9] == 6 and t[0, 9] == 40
    assert np.allclose(s[0, [2, 6, 8]], [-0.5 - c, -0.6 - 2 * c, -0.7 - 3 * c])
    assert np.isclose(s[0, 9], -0.6 - 2 * c - 0.3 - c)
    # row 1: its own branch from the root, with the later rates
    assert p[1, [3, 7, 9]].tolist() == [-1, 3, 7]
    assert np.allclose(s[1, [3, 7, 9]], [-1.0 - c, -1.2 - 2 * c, -1.5 - 3 * c])
    # row 2: chain 0 shares the heads' 10 and 12 (12 raised to the better estimate), 50 hangs under 12
    assert (s[2, [2, 6]] < -1e29).all() and p[2, 8] == 4 and np.isclose(s[2, 0], -0.1)
    assert np.isclose(s[2, 4], -0.2 - c) and np.isclose(s[2, 8], -0.3 - 2 * c)
    assert (s[2, [3, 7, 9]] < -1e29).all()  # the second match was not found
    depths = np.asarray([1] * 4 + [2] * 4 + [3] * 2, np.int32)
    arrays, toks = select_tree(t, s, p, depths, jnp.asarray([1, 2, 3]), 5, 3)
    for r in range(3):  # ancestor-closed, and no two siblings share a token
        kids = {}
        for n in range(1, 5):
            par = int(arrays.parents[r, n])
            assert 0 <= par < n
            kids.setdefault(par, []).append(int(toks[r, n]))
        assert all(len(v) == len(set(v)) for v in kids.values())
    arrays, toks = select_tree(t[:1], s[:1], p[:1], depths, jnp.asarray([1]), 8, 3)
    assert toks[0].tolist() == [1, 10, 11, 30, 12, 31, 32, 40]
    assert arrays.parents[0].tolist() == [-1, 0, 0, 0, 1, 3, 5, 5]


@pytest.mark.slow
@pytest.mark.parametrize("budget,width", [(8, 2), (14, 3)])
def test_hydra_heads_expand_copied_nodes(tiny, budget, width):
    """With prompt lookup, the heads also draft below a copied token (node-by-node reference): the
    chains' nodes compete for the expansion, the copy longer than the heads are deep goes on alone."""
    k, D = 4, 3
    h = hydra_setup(tiny, budget, width, k, D, seed=7)

    def reference(b, *chains_and_rates):
        return reference_hydra(h.dhcfg, h.dhp, h.lm, h.emb, h.hidden[b], h.root[b], D, k, width, budget,
                               *chains_and_rates)

    plain = [reference(b) for b in range(2)]
    # row 0: chain 0 follows the heads' best path for two tokens, chain 1 shares its first token;
    # row 1: a chain of tokens the heads do not propose, and no second match
    best = max(plain[0], key=len)
    copied = np.asarray([[[best[1], best[2], 5, 6, 7], [best[1], 8, 9, 10, 11]],
                         [[12, 13, 14, 15, 1], [0, 0, 0, 0, 0]]], np.int32)
    found = np.asarray([[True, True], [True, False]])
    rates = h.tree.dynamic.lookup_rates(5, 2)
    lk = with_lookup(h.tree, PromptLookup(5, 2, 1, 2))
    arrays, tokens = dynamic_draft(tiny[0], h.dhcfg, h.dhp, h.dparams, h.state, h.root, lk,
                                   (jnp.asarray(copied), jnp.asarray(found)))
    rows = []
    for b in range(2):
        nodes = check_arrays(arrays, tokens, b)
        assert set(nodes[1:]) == reference(b, [copied[b, c].tolist() for c in range(2) if found[b, c]], rates)
        rows.append(nodes)
    assert any(len(n) == 6 for r in rows for n in r)                          # a copy deeper than the heads
    copies = {(9,) + tuple(copied[1, 0, :j]) for j in range(1, 6)}
    assert any(n[:2] == (9, 12) and n not in copies for n in rows[1])        # the heads' token below a copied one


@pytest.mark.slow
def test_copies_score_by_the_ngram_they_matched(tiny, tmp_path):
    """`lookup_ngram_confidence`: the latest match's chain scores by the row of the n-gram size its row
    matched (other sizes and later matches by `lookup_confidence`); a sure 3-gram copy takes the
    budget, the same copy after a 1-gram none of it. The rows survive tree files, budgets, depth cuts
    and `resolve.with_confidence`, and malformed ones are refused."""
    from medusa_jax.resolve import with_confidence

    cfg, params = tiny
    hcfg, hp = random_hydra(cfg, params)
    by_n = {3: [-0.001], 1: [-30.0]}
    tree = dynamic_tree(6, 3, topk=4, width=2, lookup_confidence=[[-0.2, -0.1], [-1.0]], lookup_ngram_confidence=by_n)
    assert tree.dynamic.lookup_ngram_confidence == ((1, (-30.0,)), (3, (-0.001,)))
    table = tree.dynamic.lookup_rate_table(3, 2, 4)
    assert table.shape == (2, 3, 5)
    assert np.allclose(table[0, :, 3], -0.001) and np.allclose(table[0, :, 1], -30.0)
    assert np.allclose(table[0, :, 2], [-0.2, -0.1, -0.1]) and np.allclose(table[1, :, 3], -1.0)  # no row: pooled
    dparams, dhcfg, dhp, _ = decoding_setup(cfg, params, (hcfg, hp), tree)
    hidden = jax.random.normal(jax.random.PRNGKey(8), (3, DM))
    root = jnp.asarray([4, 9, 11], jnp.int32)
    copied = jnp.asarray([[[50, 51, 52, 53, 54]]] * 3, jnp.int32)
    found = jnp.ones((3, 1), bool)
    ngram = jnp.asarray([3, 1, 2], jnp.int32)
    lk = with_lookup(tree, PromptLookup(5, 3, 1))
    arrays, tokens = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden), root, lk,
                                   (copied, found, ngram))
    nodes = [check_arrays(arrays, tokens, b) for b in range(3)]
    assert {(4, 50), (4, 50, 51), (4, 50, 51, 52), (4, 50, 51, 52, 53)} <= set(nodes[0])  # after a sure 3-gram
    assert not any(n[1] == 50 for n in nodes[1][1:])                          # after a 1-gram: no copied node
    pooled = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden), root, lk, (copied, found))
    assert np.asarray(pooled[1][2]).tolist() == np.asarray(tokens[2]).tolist()  # a size without a row: pooled
    path = tmp_path / "t.json"
    tree_to_json(lk, path)
    assert json.loads(path.read_text())["dynamic"]["lookup_ngram_confidence"] == {"1": [-30.0], "3": [-0.001]}
    assert get_tree(str(path), num_heads=3) == lk
    assert tree_with_budget(tree, 4).dynamic.lookup_ngram_confidence == tree.dynamic.lookup_ngram_confidence
    assert truncate_tree(tree, 2).dynamic.lookup_ngram_confidence == tree.dynamic.lookup_ngram_confidence
    saved = with_confidence(dynamic_tree(6, 3, topk=4), None, None, {"3": [-0.001], "1": [-30.0]})
    assert saved.dynamic.lookup_ngram_confidence == tree.dynamic.lookup_ngram_confidence
    for bad in ({0: [-1.0]}, {2: []}, {2: [0.5]}, {"x": [-1.0]}, [(2,)]):
        with pytest.raises(ValueError, match="lookup_ngram_confidence"):
            dynamic_tree(6, 3, lookup_ngram_confidence=bad)
