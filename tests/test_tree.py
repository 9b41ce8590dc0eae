import itertools
import json

import numpy as np
import pytest

from medusa_jax.decoding.tree import (
    PRESETS,
    TreeBuffers,
    build_tree,
    get_tree,
    random_tree,
    tree_to_json,
    tree_with_budget,
    truncate_tree,
)
from medusa_jax.decoding.tree_estimates import expected_acceptance_length, greedy_tree_search

HAND = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_hand_built_tree():
    t = build_tree(HAND, topk=10)
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
    assert t.medusa_choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (t.size, t.max_depth, t.num_paths, t.topk) == (7, 3, 3, 10)
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(t.tree_indices, [0, 1, 2, 11, 12, 11, 21])
    mask = np.array([[1, 0, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0, 0],
                     [1, 0, 1, 0, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0, 0],
                     [1, 1, 0, 0, 1, 0, 0],
                     [1, 0, 1, 0, 0, 1, 0],
                     [1, 1, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(t.ancestor_mask, mask)
    np.testing.assert_array_equal(t.retrieve_indices, [[0, 1, 4, 0], [0, 2, 5, 0], [0, 1, 3, 6]])
    np.testing.assert_array_equal(t.valid, [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert t.ancestor_mask.dtype == bool and t.valid.dtype == bool
    for a in (t.depth, t.tree_indices, t.parents, t.retrieve_indices):
        assert a.dtype == np.int32
    assert "T=7" in repr(t)


def test_tree_indices_other_topk():
    t = build_tree(HAND, topk=4)
    np.testing.assert_array_equal(t.tree_indices, [0, 1, 2, 5, 6, 5, 9])


def test_arrays_read_only():
    t = build_tree(HAND)
    for a in (t.ancestor_mask, t.depth, t.tree_indices, t.parents, t.retrieve_indices, t.valid):
        with pytest.raises(ValueError):
            a[0] = 0


def test_trivial_tree():
    for t in (build_tree([]), get_tree([])):
        assert (t.size, t.max_depth, t.num_paths) == (1, 0, 1)
        np.testing.assert_array_equal(t.retrieve_indices, [[0]])
        np.testing.assert_array_equal(t.valid, [[True]])
        np.testing.assert_array_equal(t.ancestor_mask, [[True]])
        np.testing.assert_array_equal(t.tree_indices, [0])
        np.testing.assert_array_equal(t.parents, [-1])


def test_mc_sim_7b_63():
    t = get_tree("mc_sim_7b_63")
    assert len(t.medusa_choices) == 63 and t.size == 64
    # the official list's deepest path is (0,0,0,0) / (0,0,0,1): depth 4, retrieve width 5
    assert t.max_depth == 4 and t.retrieve_indices.shape[1] == 5
    assert np.bincount(t.depth).tolist() == [1, 10, 28, 23, 2]
    for i in range(1, t.size):
        expect = t.ancestor_mask[t.parents[i]].copy()
        expect[i] = True
        np.testing.assert_array_equal(t.ancestor_mask[i], expect)
    # leaves = nodes without children
    assert t.num_paths == t.size - len(set(t.parents[1:].tolist()))


def _check_invariants(t: TreeBuffers):
    paths = ((),) + t.medusa_choices
    index = {p: i for i, p in enumerate(paths)}
    for i, p in enumerate(paths):
        assert t.depth[i] == len(p)
        assert t.parents[i] == (index[p[:-1]] if p else -1)
        prefixes = {index[p[:k]] for k in range(len(p) + 1)}
        assert set(np.flatnonzero(t.ancestor_mask[i]).tolist()) == prefixes
        if p:
            assert t.tree_indices[i] == 1 + (len(p) - 1) * t.topk + p[-1]
    seen = set()
    for row, ok in zip(t.retrieve_indices, t.valid):
        n = int(ok.sum())
        assert ok[:n].all() and not ok[n:].any()
        assert (row[n:] == 0).all() and row[0] == 0
        chain = row[:n].tolist()
        for a, b in zip(chain, chain[1:]):
            assert t.parents[b] == a
        leaf = chain[-1]
        assert leaf not in t.parents  # a leaf: nobody's parent
        seen.update(chain)
    assert seen == set(range(t.size))
    assert t.num_paths == sum(1 for i in range(t.size) if i not in set(t.parents.tolist()))
    assert t.retrieve_indices.shape == t.valid.shape == (t.num_paths, t.max_depth + 1)
    assert len({tuple(r) for r in t.retrieve_indices.tolist()}) == t.num_paths


@pytest.mark.parametrize("seed", range(12))
def test_random_tree_invariants(seed):
    n, depth, topk = 1 + seed * 3, 3 + seed % 3, 3 + seed % 4
    choices = random_tree(n, max_depth=depth, topk=topk, seed=seed)
    assert len(choices) == n - 1 and max(map(len, choices), default=0) <= depth
    t = build_tree(choices, topk=topk, num_heads=depth)
    assert t.size == n
    _check_invariants(t)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_valid(name):
    t = get_tree(name)
    _check_invariants(t)
    if name.startswith("chain"):
        d = int(name[5:])
        assert t.size == d + 1 and t.num_paths == 1 and t.max_depth == d
        np.testing.assert_array_equal(t.retrieve_indices, [list(range(d + 1))])
    if name.startswith("small_"):
        assert t.size == int(name[6:])
        # taken from the head of the listed (acceptance-ordered) official tree, without skips
        assert set(t.medusa_choices) == set(PRESETS["mc_sim_7b_63"][:t.size - 1])


def test_small_8_shape():
    assert get_tree("small_8").medusa_choices == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


@pytest.mark.parametrize("choices, topk, heads, msg", [
    ([(0,), (0, 0, 0)], 10, None, "no parent (0, 0)"),
    ([(0,), (0, 1)], 10, 1, "depth 2 but the heads have only 1"),
    ([(10,)], 10, None, "rank 10 outside [0, topk=10)"),
    ([(0,), (0, -1)], 10, None, "rank -1 outside"),
    ([(0,), (1,), (0,)], 10, None, "duplicate path (0,)"),
    ([(0,), ()], 10, None, "empty path"),
    ([(0,), (0, 1.0)], 10, None, "non-integer entry 1.0"),
    ([(0,), ("a",)], 10, None, "non-integer entry 'a'"),
    ([(True,)], 10, None, "non-integer entry True"),
    ([0, 1], 10, None, "write a depth-1 node as (r,)"),
    ([(0,)], 0, None, "topk must be a positive integer"),
    ("mc", 10, None, "must be a sequence of paths"),
])
def test_validation_errors(choices, topk, heads, msg):
    with pytest.raises(ValueError) as e:
        build_tree(choices, topk=topk, num_heads=heads)
    assert msg in str(e.value)


def test_numpy_integers_accepted():
    t = build_tree([np.array([0]), (np.int64(1),), [0, np.int32(1)]])
    assert t.medusa_choices == ((0,), (1,), (0, 1))
    assert all(type(r) is int for p in t.medusa_choices for r in p)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError) as e:
        get_tree("no_such_tree")
    assert "mc_sim_7b_63" in str(e.value) and "chain3" in str(e.value)


def test_hash_eq():
    a = build_tree(HAND)
    b = build_tree(list(reversed(HAND)))
    assert a == b and hash(a) == hash(b) and a is not b
    assert {a: 1}[b] == 1
    assert a != build_tree(HAND, topk=5)
    assert a != build_tree(HAND[:-1])
    assert a != "tree"


def test_get_tree_files(tmp_path):
    j = tmp_path / "t.json"
    text = tree_to_json(build_tree(HAND, topk=4), j)
    assert json.loads(text) == {"medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
                                "topk": 4}
    assert get_tree(str(j)) == build_tree(HAND, topk=4)
    assert get_tree(j, topk=10) == build_tree(HAND, topk=10)
    (tmp_path / "l.json").write_text(json.dumps([[1], [0], [0, 0]]))
    assert get_tree(str(tmp_path / "l.json")).medusa_choices == ((0,), (1,), (0, 0))
    (tmp_path / "t.yaml").write_text("medusa_choices:\n  - [0]\n  - [0, 0]\n")
    assert get_tree(str(tmp_path / "t.yaml")) == get_tree("chain2")
    (tmp_path / "bad.json").write_text(json.dumps({"choices": [[0]]}))
    with pytest.raises(ValueError, match="medusa_choices"):
        get_tree(str(tmp_path / "bad.json"))
    assert tree_to_json([(1,), (0,)]) == '{"medusa_choices": [[0], [1]], "topk": 10}'


def test_unparsable_tree_files_name_the_file(tmp_path):
    """A tree file that is not JSON (or YAML) is a ValueError naming the file, in one line."""
    for name, text, message in [("bad.json", "[[0],[0,\n", "not valid JSON: Expecting value: line 2 column 1"),
                                ("bad.yaml", "a: [b\n", "not valid YAML: expected ',' or ']'"),
                                ("bin.json", b"\xff\xfe", "not valid JSON: 'utf-8' codec can't decode")]:
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError) as e:
            get_tree(str(path))
        assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value), str(e.value)


def test_get_tree_passthrough_and_heads():
    t = get_tree("chain3")
    assert get_tree(t) is t
    assert get_tree(t, topk=4).topk == 4
    with pytest.raises(ValueError, match="the heads have only 2"):
        get_tree("chain3", num_heads=2)
    with pytest.raises(ValueError, match="the heads have only 2"):
        get_tree(t, num_heads=2)


def test_truncate_tree():
    t = build_tree(HAND)
    t2 = truncate_tree(t, 2)
    assert t2.medusa_choices == ((0,), (1,), (0, 0), (0, 1), (1, 0)) and t2.max_depth == 2
    np.testing.assert_array_equal(t2.retrieve_indices, [[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    np.testing.assert_array_equal(t2.ancestor_mask, t.ancestor_mask[:6, :6])
    assert truncate_tree(t, 1).medusa_choices == ((0,), (1,))
    assert truncate_tree(t, 0).size == 1
    assert truncate_tree(t, 3) is t and truncate_tree(t, 9) is t
    big = truncate_tree(get_tree("mc_sim_7b_63"), 3)
    assert big.size == 62 and big.max_depth == 3
    with pytest.raises(ValueError):
        truncate_tree(t, -1)


def test_tree_with_budget():
    t = get_tree("mc_sim_7b_63")
    for n in (1, 2, 5, 11, 12, 30, 47, 63):
        b = tree_with_budget(t, n)
        assert b.size == n
        assert b.medusa_choices == t.medusa_choices[:n - 1]
        _check_invariants(b)  # would fail on a missing parent (build_tree validates)
        np.testing.assert_array_equal(b.ancestor_mask, t.ancestor_mask[:n, :n])
    assert tree_with_budget(t, 64) is t and tree_with_budget(t, 100) is t
    with pytest.raises(ValueError):
        tree_with_budget(t, 0)


def test_expected_acceptance_chain():
    acc = [[0.8, 0.1], [0.6, 0.1], [0.5, 0.1]]
    want = 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5
    assert expected_acceptance_length(PRESETS["chain3"], acc) == pytest.approx(want)
    assert expected_acceptance_length(get_tree("chain3", topk=2), acc) == pytest.approx(want)
    # hand tree on 3 heads: (0,)=.8 (1,)=.1 (0,0)=.48 (0,1)=.08 (1,0)=.06 (0,0,0)=.24
    assert expected_acceptance_length(HAND, acc) == pytest.approx(0.8 + 0.1 + 0.48 + 0.08 + 0.06 + 0.24)
    assert expected_acceptance_length([], acc) == 0.0
    with pytest.raises(ValueError, match="the heads have only 3"):
        expected_acceptance_length(PRESETS["chain4"], acc)
    with pytest.raises(ValueError):
        expected_acceptance_length([(2,)], acc)
    with pytest.raises(ValueError, match="probabilities"):
        expected_acceptance_length([(0,)], [[1.5]])
    with pytest.raises(ValueError, match="2-D"):
        expected_acceptance_length([(0,)], [0.5])


def test_greedy_tree_search_hand_case():
    acc = [[0.6, 0.35], [0.5, 0.2]]
    # path probs: (0,)=.6 (1,)=.35 (0,0)=.3 (1,0)=.175 (0,1)=.12 (1,1)=.07
    assert greedy_tree_search(acc, 5, topk=2) == ((0,), (1,), (0, 0), (1, 0))
    assert greedy_tree_search(acc, 3, topk=2) == ((0,), (1,))
    assert greedy_tree_search(acc, 1, topk=2) == ()
    assert greedy_tree_search(acc, 100, topk=2) == ((0,), (1,), (0, 0), (1, 0), (0, 1), (1, 1))
    assert greedy_tree_search(acc, 100, topk=1) == ((0,), (0, 0))
    # exact tie (1,) vs (0,0) at 0.25: the shallower node first
    assert greedy_tree_search([[0.5, 0.25], [0.5, 0.5]], 3, topk=2) == ((0,), (1,))
    with pytest.raises(ValueError):
        greedy_tree_search(acc, 0)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_tree_search_optimal_and_prefix_closed(seed):
    rng = np.random.default_rng(seed)
    acc = np.sort(rng.uniform(0, 1, (3, 4)), axis=1)[:, ::-1] * np.array([[0.9], [0.7], [0.5]])
    n = 9
    greedy = greedy_tree_search(acc, n, topk=4)
    assert len(greedy) == n - 1
    for k in range(len(greedy) + 1):  # every prefix is a valid (prefix-closed) tree
        build_tree(greedy[:k], topk=4, num_heads=3)
    best = expected_acceptance_length(greedy, acc)
    # brute force: the n-1 most probable paths of all 4+16+64 form the optimum
    allp = [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)]
    probs = sorted((float(np.prod([acc[i, r] for i, r in enumerate(p)])) for p in allp), reverse=True)
    assert best == pytest.approx(sum(probs[:n - 1]))
    for s in range(10):
        assert expected_acceptance_length(random_tree(n, 3, 4, seed=s), acc) <= best + 1e-12


def test_random_tree_errors_and_determinism():
    assert random_tree(20, 3, 3, seed=1) == random_tree(20, 3, 3, seed=1)
    assert random_tree(1, 3, 3) == ()
    assert len(random_tree(1 + 2 + 4, 2, 2, seed=0)) == 6  # full tree
    with pytest.raises(ValueError):
        random_tree(8, 2, 2)
    with pytest.raises(ValueError):
        random_tree(0, 2, 2)


def test_usable_as_jit_static_arg():
    jax = pytest.importorskip("jax")
    traces = []

    def f(x, tree):
        traces.append(tree.size)
        return x[tree.tree_indices]

    g = jax.jit(f, static_argnums=1)
    x = jax.numpy.arange(1 + 3 * 10)
    np.testing.assert_array_equal(g(x, build_tree(HAND)), [0, 1, 2, 11, 12, 11, 21])
    g(x, build_tree(list(reversed(HAND))))
    assert traces == [7]  # equal trees hit the jit cache
