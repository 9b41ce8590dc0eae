"""Exact (lossless) tree sampling: the first three emitted tokens of Medusa decoding with exact
acceptance follow plain ancestral sampling's joint distribution, for several trees, temperatures
0.7 and 1.0, top-p 0.9, top-k 3 and 4, both head types, with prompt lookup and with trees chosen per step (a dynamic
tree: `drafts.dynamic`); broken variants fail the same test.

The reference distribution is computed exactly (8 + 64 forwards of a V = 8 model), and the Medusa
samples (one batch row each, per-row keys, fixed seeds: deterministic) are compared with it by a
chi-square goodness-of-fit test over the 512 outcomes, pooling the cells expected to hold fewer
than 5 samples. The test passes at p > 0.001.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads, tiny_decoding_model
from scipy.stats import chi2

from medusa_jax.decoding import acceptance, sampling
from medusa_jax.decoding import step as step_module
from medusa_jax.drafts import drafter_for, dynamic
from medusa_jax.drafts import lookup as lookup_module
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.compile import clear_compiled
from medusa_jax.engine.generate import generate, generate_batch, generate_device
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.sampling import filtered_logits
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.decoding.tree import build_tree, dynamic_tree, with_lookup
from medusa_jax.decoding.tree_arrays import TreeArrays
from medusa_jax.models.llama import LlamaModel

jax.config.update("jax_default_matmul_precision", "highest")

V = 8
PROMPT = [1, 5, 3]
N = 12000        # samples per configuration
P_MIN = 1e-3     # chi-square p-value below which the distributions differ

# rank paths (medusa_choices); siblings at every depth, nodes with 2-3 children
TREE_A = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)], topk=3)
TREE_B = build_tree([(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)], topk=4)
# prompt lookup beside tree A: a root that occurred in the context gets the tokens after it as a chain
LOOKUP = PromptLookup(num_tokens=2, max_ngram=2, min_ngram=1)
# a tree of 8 nodes chosen per step from the heads' top 4 (depth 3; hydra heads expand 2 per depth)
TREE_DYN = dynamic_tree(8, 3, topk=4, width=2)
TREES = {"A": TREE_A, "B": TREE_B, "A+lookup": with_lookup(TREE_A, LOOKUP), "dyn": TREE_DYN,
         "dyn+lookup": with_lookup(TREE_DYN, LOOKUP._replace(matches=2))}  # two copied chains in the budget


@pytest.fixture(scope="module")
def model():
    """(cfg, params, next-token logits after the prompt and each continuation of 1 and 2 tokens:
    [V], [V, V], [V, V, V] float32)."""
    cfg, params = tiny_decoding_model(V)

    def last_logits(seqs):
        toks = jnp.asarray([PROMPT + list(s) for s in seqs], jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
        return LlamaModel(cfg).apply({"params": params}, toks, pos)[0][:, -1]

    logits = (last_logits([()])[0], last_logits([(a,) for a in range(V)]),
              last_logits([(a, b) for a in range(V) for b in range(V)]).reshape(V, V, V))
    return cfg, params, logits


def reference(logits, acc: Acceptance) -> np.ndarray:
    """[V, V, V] float64: plain ancestral sampling's probability of each first three tokens, exactly."""
    p1, p2, p3 = (np.asarray(jax.nn.softmax(filtered_logits(lg, acc.temperature, acc.top_p, top_k=acc.top_k), -1),
                             np.float64) for lg in logits)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint / joint.sum()


def chi_square_p(samples: np.ndarray, expected: np.ndarray) -> float:
    """p-value of `samples` [n, 3] (token triples) against `expected` [V, V, V] probabilities."""
    counts = np.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V ** 3)
    exp = expected.reshape(-1) * len(samples)
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    assert np.all(obs_c[~keep] == 0), "a sample has probability 0 under plain sampling"
    stat = float(np.sum((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]))
    return float(chi2.sf(stat, keep.sum() - 1))


def medusa_samples(cfg, params, heads, tree, acc, seed=0) -> np.ndarray:
    """First three tokens of N independent rows of exact Medusa sampling (`generate_device`)."""
    r = generate_device(cfg, params, [PROMPT] * N, max_new_tokens=3, heads=heads, tree=tree, acceptance=acc,
                        seed=seed, cache_size=32, progress=False)
    assert np.all(r.count == 3)
    assert r.hist[1:].sum() > 0, "no candidate was ever accepted: the test would not exercise the tree"
    return r.tokens


def patched_samples(cfg, params, heads, tree, acc, seed=0) -> np.ndarray:
    """As `medusa_samples`, through a freshly traced `step.medusa_step` (so that a monkeypatched
    function is the one that runs)."""
    p, hcfg, hp, tr = decoding_setup(cfg, params, heads, tree)
    state = start_state(cfg, p, [PROMPT] * N, 32, seed, progress=False, temperature=acc.temperature,
                        top_p=acc.top_p, top_k=acc.top_k)
    step = jax.jit(functools.partial(step_module.medusa_step, step_module.StepConfig(cfg, hcfg, drafter_for(tr), acc)))
    out = [[] for _ in range(N)]
    while min(len(o) for o in out) < 3:
        o, state = step(p, hp, state)
        toks, n = np.asarray(o.tokens), np.asarray(o.num_tokens)
        for b in range(N):
            out[b].extend(toks[b, :n[b]].tolist())
    return np.asarray([o[:3] for o in out])


CASES = [("medusa", "A", 0.7, 1.0, 0), ("medusa", "B", 1.0, 1.0, 0), ("medusa", "A", 1.0, 0.9, 0),
         ("medusa", "B", 0.7, 0.9, 0), ("hydra", "A", 1.0, 1.0, 0), ("hydra", "B", 0.7, 0.9, 0),
         ("medusa", "A+lookup", 1.0, 1.0, 0), ("hydra", "A+lookup", 0.7, 0.9, 0), ("medusa", "dyn", 1.0, 1.0, 0),
         ("hydra", "dyn", 0.7, 0.9, 0), ("hydra", "dyn+lookup", 1.0, 1.0, 0),
         ("medusa", "B", 1.0, 1.0, 3), ("hydra", "dyn+lookup", 1.0, 0.9, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("head_type,tree_name,temperature,top_p,top_k", CASES)
def test_exact_sampling_matches_plain_sampling(model, head_type, tree_name, temperature, top_p, top_k):
    cfg, params, logits = model
    acc = Acceptance(temperature=temperature, top_p=top_p, method="exact", top_k=top_k)
    tree = TREES[tree_name]
    samples = medusa_samples(cfg, params, random_heads(cfg, params, head_type=head_type), tree, acc)
    p = chi_square_p(samples, reference(logits, acc))
    assert p > P_MIN, f"exact Medusa sampling differs from plain sampling (chi-square p = {p:.2g})"


@pytest.mark.parametrize("top_k", [0, 3])
def test_plain_sampling_passes_the_same_test(model, top_k):
    """The test's own calibration: plain sampling (no heads) against the exact reference; with
    top-k 3 no token outside each position's 3 most likely is ever drawn."""
    cfg, params, logits = model
    acc = Acceptance(temperature=1.0, top_k=top_k)
    r = generate_device(cfg, params, [PROMPT] * N, max_new_tokens=3, acceptance=acc, seed=7, cache_size=32,
                        progress=False)
    assert chi_square_p(r.tokens, reference(logits, acc)) > P_MIN
    if top_k:
        assert len(np.unique(r.tokens[:, 0])) == top_k


@pytest.mark.slow
def test_patched_path_reproduces_generate_device(model):
    """`patched_samples` (used for the broken variants below) runs the same computation."""
    cfg, params, logits = model
    acc = Acceptance(temperature=1.0)
    heads = random_heads(cfg, params)
    np.testing.assert_array_equal(patched_samples(cfg, params, heads, TREE_B, acc),
                                  medusa_samples(cfg, params, heads, TREE_B, acc))


_POSITION_KEYS = sampling.position_keys  # the real one, for the broken variant below


def _one_key_for_every_position(keys, positions):
    """Every position of a row chooses with the same noise: the tokens are no longer independent."""
    return _POSITION_KEYS(keys, jnp.zeros_like(positions))


def _candidates_against_the_argmax(logits, keys, positions, temperature, top_p, sampled=True, nucleus=True, top_k=0):
    """Candidates accepted when they are their parent's argmax, not the token the position's key chooses."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


_SAMPLE_TOKENS = sampling.sample_tokens


def _candidates_without_top_k(logits, keys, positions, temperature, top_p, sampled=True, nucleus=True, top_k=0):
    """Candidates accepted by the key's choice from the whole distribution, not its top-k."""
    return _SAMPLE_TOKENS(logits, keys, positions, temperature, top_p, sampled, nucleus)


_SELECT_TREE = dynamic.select_tree


def _every_earlier_node_visible(*args, **kwargs):
    """A dynamic tree whose nodes attend to every earlier node, not only their ancestors."""
    arrays, tokens = _SELECT_TREE(*args, **kwargs)
    T = arrays.depth.shape[1]
    return TreeArrays(jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), arrays.ancestor_mask.shape),
                      *arrays[1:]), tokens


@pytest.mark.slow
@pytest.mark.parametrize("module,name,broken,tree,top_k", [
    (sampling, "position_keys", _one_key_for_every_position, TREE_B, 0),
    (acceptance, "sample_tokens", _candidates_against_the_argmax, TREE_B, 0),
    (acceptance, "sample_tokens", _candidates_against_the_argmax, TREE_DYN, 0),
    (dynamic, "select_tree", _every_earlier_node_visible, TREE_DYN, 0),
    (acceptance, "sample_tokens", _candidates_without_top_k, TREE_B, 3)])
def test_broken_variants_fail_the_test(model, monkeypatch, module, name, broken, tree, top_k):
    """One key reused at every position, candidates accepted as the argmax instead of the
    key's choice, a dynamic tree's mask that lets a node see its siblings, or candidates checked
    against the whole distribution under top-k: each visibly changes the distribution (or emits a
    token plain sampling never draws), and the test must say so."""
    cfg, params, logits = model
    acc = Acceptance(temperature=1.0, top_k=top_k)
    heads = random_heads(cfg, params)
    expected = reference(logits, acc)
    monkeypatch.setattr(module, name, broken)  # where the step looks it up
    try:
        p = chi_square_p(patched_samples(cfg, params, heads, tree, acc), expected)
    except AssertionError:  # a sample plain sampling cannot draw
        p = 0.0
    assert p < P_MIN, f"the broken variant ({name}) passed the test (p = {p:.2g})"


@pytest.mark.slow
@pytest.mark.parametrize("head_type,tree_name,top_p", [("medusa", "A", 1.0), ("medusa", "B", 0.9),
                                                        ("hydra", "A+lookup", 1.0), ("medusa", "A+lookup", 0.8)])
def test_exact_sampling_emits_plain_sampling_token_for_token(model, head_type, tree_name, top_p):
    """The token at each position is chosen by that position's key (decoding.sampling), so exact
    Medusa sampling emits exactly plain sampling's tokens for the same seed, whatever the tree
    accepted, and candidates were accepted on the way."""
    cfg, params, _ = model
    heads = random_heads(cfg, params, head_type=head_type)
    acc = Acceptance(temperature=1.0, top_p=top_p)
    prompts = [PROMPT, [4, 4, 2, 6], [7], [1, 2, 3, 1, 2, 3, 1]]
    plain = generate_device(cfg, params, prompts, max_new_tokens=24, acceptance=acc, seed=11, progress=False)
    med = generate_device(cfg, params, prompts, max_new_tokens=24, heads=heads, tree=TREES[tree_name],
                          acceptance=acc, seed=11, progress=False)
    np.testing.assert_array_equal(med.tokens, plain.tokens)
    np.testing.assert_array_equal(med.count, plain.count)
    assert med.hist[1:].sum() > 0 and med.steps < plain.steps


@pytest.mark.slow
def test_exact_rows_do_not_depend_on_the_batch(model):
    """Per-row keys: a prompt's sampled output is the same alone (seed s) and as row b of a batch
    whose seed is s - b, with exact and typical acceptance."""
    cfg, params, logits = model
    heads = random_heads(cfg, params)
    prompts = [PROMPT, [4, 4, 2, 6], [7]]
    for method in ("exact", "typical"):
        acc = Acceptance(temperature=0.8, method=method)
        batch = generate_device(cfg, params, prompts, max_new_tokens=12, heads=heads, tree=TREE_A, acceptance=acc,
                                seed=10, progress=False)
        for b, pr in enumerate(prompts):
            one = generate(cfg, params, pr, max_new_tokens=12, heads=heads, tree=TREE_A, acceptance=acc,
                           seed=10 + b, progress=False)
            assert batch.tokens[b, :batch.count[b]].tolist() == one.tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", ["exact", "typical"])
def test_sampled_rows_with_prompt_lookup_do_not_depend_on_the_batch(model, method, monkeypatch):
    """Issue 27: with prompt lookup on, each row chooses between the copied chain and the heads'
    tree by itself, so prompt i's sampled answer (seed + i) is the same at batch 1, 2 and 4. (Before,
    the whole batch verified the chain when half its rows found an n-gram: 1 row of 16 differed.)
    A tiny vocabulary makes n-grams recur, so rows disagree about the chain on many steps."""
    cfg, params, _ = model
    heads = random_heads(cfg, params)
    tree = TREES["A+lookup"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, size=int(rng.integers(3, 9))).tolist() for _ in range(16)]
    acc = Acceptance(temperature=1.0, method=method)

    def answers(batch_size):
        out = [None] * len(prompts)
        for i, res in generate_batch(cfg, params, prompts, batch_size=batch_size, max_new_tokens=40, heads=heads,
                                     tree=tree, acceptance=acc, seed=5, progress=False):
            out[i] = res.tokens
        return out

    runs = {b: answers(b) for b in (1, 2, 4)}
    for i in range(len(prompts)):
        assert runs[2][i] == runs[1][i], f"prompt {i}: batch 2 differs from batch 1"
        assert runs[4][i] == runs[1][i], f"prompt {i}: batch 4 differs from batch 1"
    # the test can fail: with the former batch-wide choice (the chain for every row when half the
    # rows found an n-gram) some row's typical answer changes with the batch
    real = lookup_module.ngram_draft

    def batch_wide(tokens, lengths, root, lookup):
        draft, found = real(tokens, lengths, root, lookup)
        return draft, jnp.broadcast_to(2 * jnp.sum(found.astype(jnp.int32)) >= found.shape[0], found.shape)

    monkeypatch.setattr(lookup_module, "ngram_draft", batch_wide)
    jax.clear_caches()
    clear_compiled()
    try:
        if method == "typical":
            assert answers(4) != runs[1], "the batch-wide choice gave the same answers: the test cannot fail"
        else:  # exact sampling is coupled to the positions' keys: no choice of draft changes its tokens
            assert answers(4) == runs[1]
    finally:
        monkeypatch.undo()
        jax.clear_caches()
        clear_compiled()


def test_acceptance_settings_are_checked(model):
    cfg, params, logits = model
    with pytest.raises(ValueError, match="greedy acceptance decodes at temperature 0"):
        generate(cfg, params, PROMPT, max_new_tokens=2, acceptance=Acceptance(temperature=0.5, method="greedy"))
    with pytest.raises(ValueError, match="not one of greedy, typical, exact"):
        generate(cfg, params, PROMPT, max_new_tokens=2, acceptance=Acceptance(temperature=0.5, method="speculative"))
    with pytest.raises(ValueError, match="one int per prompt"):
        generate_device(cfg, params, [PROMPT, PROMPT], max_new_tokens=2, seed=[1, 2, 3])
    with pytest.raises(ValueError, match="exact acceptance chooses each position.s token with the row.s key"):
        acceptance.evaluate_posterior(jnp.zeros((1, TREE_A.size, V)), jnp.zeros((1, TREE_A.size), jnp.int32), TREE_A,
                                  Acceptance(temperature=1.0))


@pytest.mark.parametrize("top_p", [1e-9, 1e-40, 1e-45, 5e-324, 0.0])
def test_the_nucleus_always_keeps_the_most_likely_token(top_p):
    """A top_p so small that float32 holds a denormal or 0 (or a flush-to-zero CPU reads it as 0)
    still leaves the most likely token: sampling is greedy then, never a NaN distribution."""
    logits = jnp.asarray([[0.5, 3.0, -1.0, 2.9], [1.1, 1.0, 0.0, -2.0]], jnp.float32)
    out = np.asarray(filtered_logits(logits, jnp.asarray([1.0, 0.5]), jnp.asarray([top_p, top_p])))
    np.testing.assert_array_equal(np.isfinite(out), [[False, True, False, False], [True, False, False, False]])
    assert np.isfinite(np.asarray(jax.nn.softmax(out, -1))).all()


def test_top_k_keeps_the_k_most_likely_tokens_then_the_nucleus():
    """top-k first, then the nucleus of the renormalised top-k (vLLM's and transformers' order);
    ties with the k-th token stay; k = 0 or k >= V keeps every token; per-row k."""
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.3, 0.3, 0.3, 0.1]], jnp.float32))
    kept = lambda **kw: np.isfinite(np.asarray(filtered_logits(logits, 1.0, **kw)))  # noqa: E731
    np.testing.assert_array_equal(kept(top_k=2), [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(kept(top_k=jnp.asarray([1, 0, 9])), [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    # top-3 of row 0 renormalised: 0.444, 0.333, 0.222; a nucleus of 0.7 needs the first two (0.778),
    # where over the whole distribution it would need the first two as well but stop at 0.7 of 1.0
    np.testing.assert_array_equal(kept(top_k=3, top_p=0.75)[0], [1, 1, 0, 0])
    np.testing.assert_array_equal(kept(top_k=2, top_p=0.5)[0], [1, 0, 0, 0])  # 0.4/0.7 = 0.57 >= 0.5
    np.testing.assert_array_equal(kept(top_p=0.5)[0], [1, 1, 0, 0])            # 0.4 < 0.5 without top-k
