"""A draft tree chosen per step at a fixed node budget (medusa_jax.decoding.dynamic): the selection
against brute force (Medusa heads) and a node-by-node reference (Hydra heads), the per-row arrays'
consistency, lossless greedy decoding with and without prompt lookup (loops, on-device loop,
engine), an oracle, and the tree spec's parsing, files and errors."""
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model
from test_hydra import DM, V, bigram_backbone, random_hydra

from medusa_jax.decoding.dynamic import DEPTH_COST, dynamic_draft, select_tree
from medusa_jax.decoding.engine import Engine
from medusa_jax.decoding.generate import generate, generate_device
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
                       temperature=jnp.zeros((B,)), top_p=jnp.ones((B,)))


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


def reference_hydra(hcfg, hp, lm, emb, hidden, root, D, k, W, T):
    """Node by node: head d on each of the W best depth-d paths, then the best T - 1 of all drafted."""
    drafted = []
    frontier = [(0.0, (int(root),))]
    for d in range(D):
        children = []
        for score, path in frontier:
            st = head_state(hcfg, hp, d, hidden[None], jnp.take(emb, jnp.asarray(path), axis=0)[None])
            t, lp = states_topk(hcfg, hp, st[None], lm, k, first=d, logprobs=True)
            for r in range(k):
                children.append((score + float(lp[0, 0, r]) - DEPTH_COST, path + (int(t[0, 0, r]),)))
        drafted += children
        frontier = sorted(children, key=lambda x: -x[0])[:W]
    return {p for _, p in sorted(drafted, key=lambda x: -x[0])[:T - 1]}


@pytest.mark.parametrize("budget,width", [(6, 1), (12, 2), (20, 3)])
def test_hydra_selection_equals_node_by_node_reference(tiny, budget, width):
    cfg, params = tiny
    hcfg, hp = random_hydra(cfg, params)
    k, D = 5, 3
    tree = dynamic_tree(budget, D, topk=k, width=width)
    dparams, dhcfg, dhp, _ = decoding_setup(cfg, params, (hcfg, hp), tree)
    hidden = jax.random.normal(jax.random.PRNGKey(6), (2, DM))
    root = jnp.asarray([4, 9], jnp.int32)
    arrays, tokens = dynamic_draft(cfg, dhcfg, dhp, dparams, state_for(cfg, params, hidden), root, tree)
    lm, emb = lm_head_matrix(cfg, dparams), token_embeddings(dparams)
    for b in range(2):
        nodes = check_arrays(arrays, tokens, b)
        assert set(nodes[1:]) == reference_hydra(dhcfg, dhp, lm, emb, hidden[b], root[b], D, k, width, budget)


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
    from medusa_jax.decoding.dynamic import node_confidence
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
    """Prompt lookup's copied chain joins the heads' candidates: under the heads' node with the same
    first token when there is one (that node then scores the better estimate), beside them when not,
    and not at all in a row whose n-gram did not occur. A node scores its parent's score plus its rate."""
    from medusa_jax.decoding.dynamic import DEPTH_COST, add_lookup_chains

    tokens = jnp.asarray([[10, 11, 12, 13]] * 3, jnp.int32)       # depth 1: 10, 11; depth 2 under 10: 12, 13
    scores = jnp.asarray([[-0.1, -1.0, -0.3, -2.0]] * 3)
    parents = jnp.asarray([[-1, -1, 0, 0]] * 3, jnp.int32)
    depths = np.asarray([1, 1, 2, 2], np.int32)
    copied = jnp.asarray([[11, 20, 21], [30, 31, 32], [10, 12, 14]], jnp.int32)[:, None]
    found = jnp.asarray([True, True, False])[:, None]
    cands = add_lookup_chains(tokens, scores, parents, depths, copied, found, [(-0.5, -0.1, -0.1)])
    t, s, p, d = cands
    c = DEPTH_COST
    assert d.tolist() == [1, 1, 2, 2, 1, 2, 3] and t.shape == (3, 7)
    assert p[0].tolist() == [-1, -1, 0, 0, -1, 1, 5]                  # the chain goes on under the heads' 11
    assert np.allclose(s[0, :4], [-0.1, -0.5 - c, -0.3, -2.0]) and s[0, 4] < -1e29
    assert np.allclose(s[0, 5:], [-0.6 - 2 * c, -0.7 - 3 * c])
    assert p[1].tolist() == [-1, -1, 0, 0, -1, 4, 5]                  # beside
    assert np.allclose(s[1, 4:], [-0.5 - c, -0.6 - 2 * c, -0.7 - 3 * c])
    assert (s[2, 4:] < -1e29).all() and np.allclose(s[2, :4], scores[2])  # no match: no chain
    arrays, toks = select_tree(*cands, jnp.asarray([1, 2, 3]), 5, 3)
    assert toks[0].tolist() == [1, 10, 11, 12, 20] and arrays.parents[0].tolist() == [-1, 0, 0, 1, 2]
    assert toks[1].tolist() == [2, 10, 12, 30, 31] and arrays.parents[1].tolist() == [-1, 0, 1, 0, 3]
    assert toks[2].tolist() == [3, 10, 11, 12, 13]


def test_several_lookup_matches_share_their_common_prefix():
    """Two copied chains (the latest match, then the one before): where the second repeats the first
    (or the heads') tokens under the same parent it continues under that node, at its first own token
    it branches, scored with the later matches' rate; a heads' node deeper than depth 1 is shared too."""
    from medusa_jax.decoding.dynamic import DEPTH_COST, add_lookup_chains

    tokens = jnp.asarray([[10, 11, 12, 13]] * 3, jnp.int32)
    scores = jnp.asarray([[-0.1, -1.0, -0.3, -2.0]] * 3)
    parents = jnp.asarray([[-1, -1, 0, 0]] * 3, jnp.int32)
    depths = np.asarray([1, 1, 2, 2], np.int32)
    copied = jnp.asarray([[[30, 31, 32], [30, 31, 40]],           # the same first two tokens
                          [[30, 31, 32], [41, 42, 43]],           # nothing in common
                          [[10, 12, 50], [30, 31, 32]]], jnp.int32)  # chain 0 follows the heads' 10 -> 12
    found = jnp.asarray([[True, True], [True, True], [True, False]])
    rates = [(-0.5, -0.1, -0.1), (-1.0, -0.2, -0.3)]
    t, s, p, d = add_lookup_chains(tokens, scores, parents, depths, copied, found, rates)
    c = DEPTH_COST
    assert d.tolist() == [1, 1, 2, 2, 1, 2, 3, 1, 2, 3]
    # row 0: chain 1 is chain 0 for two tokens (slots 7, 8 unused), then 40 under chain 0's 31 (slot 5)
    assert (s[0, 7:9] < -1e29).all() and p[0, 9] == 5 and t[0, 9] == 40
    assert np.allclose(s[0, 4:7], [-0.5 - c, -0.6 - 2 * c, -0.7 - 3 * c]) and np.isclose(s[0, 9], -0.6 - 2 * c - 0.3 - c)
    # row 1: its own branch from the root, with the later rates
    assert p[1, 7:].tolist() == [-1, 7, 8] and np.allclose(s[1, 7:], [-1.0 - c, -1.2 - 2 * c, -1.5 - 3 * c])
    # row 2: chain 0 shares the heads' 10 and 12 (12 raised to the better estimate), 50 hangs under 12
    assert (s[2, 4:6] < -1e29).all() and p[2, 6] == 2 and np.isclose(s[2, 0], -0.1)
    assert np.isclose(s[2, 2], -0.2 - c) and np.isclose(s[2, 6], -0.3 - 2 * c)
    assert (s[2, 7:] < -1e29).all()  # the second match was not found
    arrays, toks = select_tree(t, s, p, d, jnp.asarray([1, 2, 3]), 5, 3)
    for r in range(3):  # ancestor-closed, and no two siblings share a token
        kids = {}
        for n in range(1, 5):
            par = int(arrays.parents[r, n])
            assert 0 <= par < n
            kids.setdefault(par, []).append(int(toks[r, n]))
        assert all(len(v) == len(set(v)) for v in kids.values())
    arrays, toks = select_tree(t[:1], s[:1], p[:1], d, jnp.asarray([1]), 8, 3)
    assert toks[0].tolist() == [1, 10, 11, 12, 30, 31, 32, 40] and arrays.parents[0].tolist() == [-1, 0, 0, 1, 0, 4, 5, 5]
