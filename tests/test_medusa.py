"""Medusa decoding: lossless greedy output, acceptance by hand, oracle heads, typical acceptance."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax.drafts import heads as draft
from medusa_jax.decoding.acceptance import Acceptance, evaluate_posterior
from medusa_jax.decoding.compile import clear_compiled
from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.tree import build_tree, get_tree, random_tree
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import init_heads
from medusa_jax.models.llama import lm_head_matrix

jax.config.update("jax_default_matmul_precision", "highest")

V = 64
PROMPTS = [[1, 5, 9, 3, 7], [4, 4, 2, 8, 19, 33, 2, 6, 11, 60, 3], [12]]


@pytest.fixture(scope="module")
def tiny():
    """A GQA tiny Llama with weights scaled up so that greedy output is varied, and 5 random heads."""
    cfg, params = tiny_decoding_model(V)
    hcfg = MedusaConfig(hidden_size=32, vocab_size=V, num_heads=5, num_layers=1, shared_lm_head=True)
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(1), len(hp))
    hp = {k: jax.random.normal(kk, a.shape) * 0.5 for kk, (k, a) in zip(keys, sorted(hp.items()))}
    return cfg, params, hcfg, hp


def plain(cfg, params, prompt, n, **kw):
    return generate(cfg, params, prompt, max_new_tokens=n, **kw)


TREES = ["chain3", "mc_sim_7b_63", random_tree(20, 5, 10, seed=3)]


@pytest.mark.slow
@pytest.mark.parametrize("tree_spec", TREES, ids=["chain3", "mc_sim_7b_63", "random20"])
def test_medusa_greedy_equals_plain_greedy(tiny, tree_spec):
    cfg, params, hcfg, hp = tiny
    tree = get_tree(tree_spec, topk=10, num_heads=hcfg.num_heads)
    for prompt in PROMPTS:
        base = plain(cfg, params, prompt, 200)
        assert len(base.tokens) == 200 and base.steps == 200
        med = generate(cfg, params, prompt, max_new_tokens=200, heads=(hcfg, hp), tree=tree)
        assert med.tokens == base.tokens
        assert med.steps == len(med.tokens_per_step) and sum(med.tokens_per_step) == 200
        # on the device; the cache starts at 128 slots and grows to 256 on the way
        r = generate_device(cfg, params, [prompt], max_new_tokens=200, heads=(hcfg, hp), tree=tree,
                            eos_token_ids=())
        assert r.cache_sizes[0] == 128 and len(r.cache_sizes) >= 2
        assert int(r.count[0]) == 200
        assert r.tokens[0].tolist() == base.tokens
        assert int(r.hist.sum()) == r.steps == med.steps
        p = generate_device(cfg, params, [prompt], max_new_tokens=200, eos_token_ids=())
        assert p.tokens[0].tolist() == base.tokens and p.steps == 200


def oracle_proposer(sequence, topk):
    """A stand-in for the heads that proposes the base model's own future greedy tokens.

    Head k's candidates for the step whose root sits at position L: rank `rank_of(L, k)` is the
    true token at L + k + 1, the other ranks are wrong tokens.
    """
    seq = jnp.asarray(sequence, jnp.int32)

    def propose(heads_cfg, head_params, state, base_lm_head, depth, k_top):
        L = state.cache.lengths  # [B]
        ks = jnp.arange(depth)[:, None]
        pos = jnp.clip(L[None, :] + ks + 1, 0, seq.shape[0] - 1)          # [D, B]
        true = seq[pos]
        ranks = jnp.arange(k_top)[None, None, :]
        wrong = (true[..., None] + 1 + ranks) % V
        return jnp.where(ranks == head_params["rank"][ks][..., None], true[..., None], wrong).astype(jnp.int32)
    return propose


@pytest.mark.slow
@pytest.mark.parametrize("tree_spec,rank", [("chain4", 0), ("mc_sim_7b_63", 0), ("mc_sim_7b_63", 1)])
def test_oracle_heads_accept_every_candidate(tiny, monkeypatch, tree_spec, rank):
    """Perfect heads give depth + 1 tokens every step and still the plain greedy output: this
    exercises the KV compaction of every accepted node (also off the leftmost path with rank 1)."""
    cfg, params, hcfg, _ = tiny
    tree = get_tree(tree_spec, topk=10, num_heads=hcfg.num_heads)
    prompt = PROMPTS[1]
    n = 120
    base = plain(cfg, params, prompt, n + 10)
    seq = list(prompt) + base.tokens
    monkeypatch.setattr(draft, "propose_candidates", oracle_proposer(seq, tree.topk))
    jax.clear_caches()
    clear_compiled()
    # rank 1 on the first head only: the tree must pick a path through (1, 0, 0, ...) when it exists
    head_rank = jnp.array([rank] + [0] * (hcfg.num_heads - 1))
    med = generate(cfg, params, prompt, max_new_tokens=n, heads=(hcfg, {"rank": head_rank}), tree=tree)
    assert med.tokens == base.tokens[:n]
    D = tree.max_depth
    if rank == 0 or (1,) + (0,) * (D - 1) in tree.medusa_choices:
        assert all(t == D + 1 for t in med.tokens_per_step[:-1])
    else:
        deepest = max(len(p) for p in tree.medusa_choices if p[0] == 1)
        assert all(t == deepest + 1 for t in med.tokens_per_step[:-1])
    jax.clear_caches()
    clear_compiled()


def test_eos_inside_accepted_chunk_ends_output_exactly(tiny, monkeypatch):
    cfg, params, hcfg, _ = tiny
    prompt = PROMPTS[0]
    base = plain(cfg, params, prompt, 60)
    seq = list(prompt) + base.tokens
    # choose an EOS that first appears at output index i with i % 5 == 2: depth 2 of a chain-4 step
    idx = next(i for i in range(5, 60) if i % 5 == 2 and base.tokens[i] not in base.tokens[:i])
    eos = base.tokens[idx]
    monkeypatch.setattr(draft, "propose_candidates", oracle_proposer(seq, 10))
    jax.clear_caches()
    clear_compiled()
    hp = {"rank": jnp.zeros(hcfg.num_heads, jnp.int32)}
    tree = get_tree("chain4", num_heads=hcfg.num_heads)
    med = generate(cfg, params, prompt, max_new_tokens=60, heads=(hcfg, hp), tree=tree, eos_token_ids=[eos])
    ref = plain(cfg, params, prompt, 60, eos_token_ids=[eos])
    assert med.tokens == ref.tokens == base.tokens[:idx + 1]
    assert med.stop_reason == ref.stop_reason == "eos"
    assert med.tokens_per_step[-1] == 3  # root, depth 1, depth 2 (the EOS); depths 3-4 dropped
    r = generate_device(cfg, params, [prompt], max_new_tokens=60, heads=(hcfg, hp), tree=tree, eos_token_ids=[eos])
    assert r.tokens[0, :int(r.count[0])].tolist() == ref.tokens
    jax.clear_caches()
    clear_compiled()


@pytest.mark.slow
def test_prompt_near_cache_end(tiny):
    """The prompt ends 10 tokens before the cache end: no write past it, same output as plain."""
    cfg, params, hcfg, hp = tiny
    prompt = PROMPTS[1]
    S = len(prompt) + 10
    ref = plain(cfg, params, prompt, 50, cache_size=S)
    assert len(ref.tokens) == 10 and ref.stop_reason == "cache_full"
    for spec in ["chain3", "mc_sim_7b_63"]:
        tree = get_tree(spec, num_heads=hcfg.num_heads)
        med = generate(cfg, params, prompt, max_new_tokens=50, heads=(hcfg, hp), tree=tree, cache_size=S)
        assert med.tokens == ref.tokens and med.stop_reason == "cache_full"
        r = generate_device(cfg, params, [prompt], max_new_tokens=50, heads=(hcfg, hp), tree=tree, cache_size=S)
        assert r.tokens[0, :int(r.count[0])].tolist() == ref.tokens and r.cache_sizes == (S,)


def _logits_for(argmaxes, T, V=16, scale=10.0, seed=0):
    """[1, T, V] logits whose argmax at node i is argmaxes[i]."""
    rng = np.random.RandomState(seed)
    lg = rng.uniform(-1, 0, (1, T, V)).astype(np.float32)
    for i, a in enumerate(argmaxes):
        lg[0, i, a] = scale
    return jnp.asarray(lg)


def test_greedy_acceptance_by_hand():
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
    tree = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], topk=2)
    tokens = jnp.array([[7, 3, 5, 9, 4, 8, 2]], jnp.int32)
    # argmax at root = 5 (matches node 2 = (1,)), at node 2 = 8 (matches node 5), at node 5 = anything
    logits = _logits_for([5, 1, 8, 1, 1, 6, 1], 7)
    best, acc_len = evaluate_posterior(logits, tokens, tree, Acceptance())
    path = tree.retrieve_indices[int(best[0])]
    assert int(acc_len[0]) == 2 and path[:3].tolist() == [0, 2, 5]
    # the longer, leftmost path: root->3 (node 1), node1->9 (node 3), node3->2 (node 6): 3 accepted
    logits = _logits_for([3, 9, 1, 2, 1, 1, 1], 7)
    best, acc_len = evaluate_posterior(logits, tokens, tree, Acceptance())
    assert int(acc_len[0]) == 3 and tree.retrieve_indices[int(best[0])].tolist() == [0, 1, 3, 6]
    # nothing matches
    best, acc_len = evaluate_posterior(_logits_for([0] * 7, 7), tokens, tree, Acceptance())
    assert int(acc_len[0]) == 0


def test_token_zero_is_not_mistaken_for_padding():
    """The true next token is id 0 everywhere and the root token is 0: padded entries of the
    retrieve rows (node 0) must not count as matches."""
    tree = build_tree([(0,), (1,), (0, 0)], topk=2)   # paths: [0,1,3], [0,2,pad]
    tokens = jnp.array([[0, 5, 0, 6]], jnp.int32)     # node 2 = (1,) holds token 0
    logits = _logits_for([0, 0, 0, 0], 4)
    best, acc_len = evaluate_posterior(logits, tokens, tree, Acceptance())
    assert int(acc_len[0]) == 1
    assert tree.retrieve_indices[int(best[0])][:2].tolist() == [0, 2]


def test_typical_acceptance_matches_formula():
    rng = np.random.RandomState(0)
    tree = get_tree(random_tree(24, 4, 5, seed=1), topk=5)
    T, Vv = tree.size, 12
    for trial in range(20):
        logits = rng.normal(0, 2, (1, T, Vv)).astype(np.float32)
        tokens = rng.randint(0, Vv, (1, T)).astype(np.int32)
        temp, thr, alpha = [(0.7, 0.09, 0.3), (1.0, 0.2, 0.5), (1.3, 0.05, 0.1)][trial % 3]
        acc = Acceptance(temperature=temp, posterior_threshold=thr, posterior_alpha=alpha, method="typical")
        best, acc_len = evaluate_posterior(jnp.asarray(logits), jnp.asarray(tokens), tree, acc)
        # numpy reference
        z = logits[0] / temp
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ent = -(p * np.log(p)).sum(-1)
        lens, scores = [], []
        for row, ok in zip(tree.retrieve_indices, tree.valid):
            n, s = 0, 0.0
            for j in range(1, len(row)):
                if not ok[j]:
                    break
                par, ch = row[j - 1], row[j]
                pc = p[par, tokens[0, ch]]
                if pc > min(thr, alpha * np.exp(-ent[par])):
                    n += 1
                    s += np.log(pc)
                else:
                    break
            lens.append(n)
            scores.append(s)
        lens = np.array(lens)
        assert int(acc_len[0]) == lens.max()
        cand = [i for i in range(len(lens)) if lens[i] == lens.max()]
        expect = max(cand, key=lambda i: scores[i])
        assert int(best[0]) == expect or abs(scores[int(best[0])] - scores[expect]) < 1e-5


def test_typical_acceptance_at_low_temperature_equals_greedy():
    rng = np.random.RandomState(1)
    tree = get_tree("mc_sim_7b_63", topk=10)
    T = tree.size
    for _ in range(10):
        logits = jnp.asarray(rng.normal(0, 3, (1, T, 30)).astype(np.float32))
        pred = np.asarray(jnp.argmax(logits, -1))[0]
        # candidates agree with the argmax often enough to get long paths
        tokens = np.where(rng.rand(T) < 0.6, pred[tree.parents.clip(0)], rng.randint(0, 30, T))
        tokens = jnp.asarray(tokens[None].astype(np.int32))
        _, g_len = evaluate_posterior(logits, tokens, tree, Acceptance())
        _, t_len = evaluate_posterior(logits, tokens, tree, Acceptance(temperature=1e-4, method="typical"))
        assert int(g_len[0]) == int(t_len[0])


def test_sampling_with_typical_acceptance_runs_and_is_reproducible(tiny):
    cfg, params, hcfg, hp = tiny
    tree = get_tree("small_8", num_heads=hcfg.num_heads)
    acc = Acceptance(temperature=0.8, method="typical")
    a = generate(cfg, params, PROMPTS[0], max_new_tokens=40, heads=(hcfg, hp), tree=tree, acceptance=acc, seed=3)
    b = generate(cfg, params, PROMPTS[0], max_new_tokens=40, heads=(hcfg, hp), tree=tree, acceptance=acc, seed=3)
    c = generate(cfg, params, PROMPTS[0], max_new_tokens=40, heads=(hcfg, hp), tree=tree, acceptance=acc, seed=4)
    assert a.tokens == b.tokens and len(a.tokens) == 40
    assert a.tokens != c.tokens
    assert all(0 <= t < V for t in a.tokens)


def test_tree_deeper_than_heads_is_an_error(tiny):
    cfg, params, hcfg, hp = tiny
    small = hcfg.replace(num_heads=2)
    hp2 = jax.tree_util.tree_map(lambda a: a[:2], hp)
    with pytest.raises(ValueError, match="but the heads have only 2"):
        generate(cfg, params, PROMPTS[0], max_new_tokens=5, heads=(small, hp2), tree=get_tree("chain3"))


def test_empty_prompt_is_an_error(tiny):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError, match="empty prompt"):
        generate(cfg, params, [], max_new_tokens=5)
