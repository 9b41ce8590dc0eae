"""Prompt lookup: the n-gram draft against a plain-Python reference, lossless decoding with it
(greedy, batches, the cache's token ids), tree files that carry it, and bad settings."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads, tiny_decoding_model

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.engine.generate import generate, generate_batch, generate_device
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.drafts.lookup import ngram_draft
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.tree import get_tree, tree_to_json, with_lookup

jax.config.update("jax_default_matmul_precision", "highest")

V = 64


def reference_draft(context, lookup):
    """Plain Python: the latest earlier occurrence of the longest matching n-gram ending at the
    context's last token, and the k tokens after it (continued with the match's period)."""
    L = len(context) - 1
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        if L < n:
            continue
        pat = context[L - n + 1:]
        for e in range(L - 1, n - 2, -1):
            if context[e - n + 1:e + 1] == pat:
                period = L - e
                out = []
                for j in range(lookup.num_tokens):
                    i = e + 1 + j
                    while i > L:
                        i -= period
                    out.append(context[i])
                return out, True
    return None, False


@pytest.mark.parametrize("lookup", [PromptLookup(3, 3, 2), PromptLookup(5, 4, 1), PromptLookup(1, 2, 2)])
def test_ngram_draft_matches_reference(lookup):
    rng = np.random.default_rng(0)
    S, B = 40, 64
    tokens = rng.integers(0, 4, (B, S)).astype(np.int32)   # a small alphabet: many repeats
    lengths = rng.integers(0, S - 1, B).astype(np.int32)
    lengths[:3] = [0, 1, 2]
    root = rng.integers(0, 4, B).astype(np.int32)
    draft, found = jax.jit(ngram_draft, static_argnums=3)(jnp.asarray(tokens), jnp.asarray(lengths),
                                                          jnp.asarray(root), lookup)
    draft, found = np.asarray(draft), np.asarray(found)
    assert found.any() and not found.all()
    for b in range(B):
        ctx = tokens[b, :lengths[b]].tolist() + [int(root[b])]
        want, hit = reference_draft(ctx, lookup)
        assert bool(found[b]) == hit, b
        if hit:
            assert draft[b].tolist() == want, b


def test_ngram_draft_by_hand():
    # context 5 6 7 8 | 5 6 + root 7: the trigram "5 6 7" ended at slot 2, so copy 8 5 6;
    # past the root the span repeats with period 4
    toks = jnp.asarray([[5, 6, 7, 8, 5, 6, 0, 0]], jnp.int32)
    draft, found = ngram_draft(toks, jnp.asarray([6]), jnp.asarray([7]), PromptLookup(6, 3, 2))
    assert bool(found[0]) and draft[0].tolist() == [8, 5, 6, 7, 8, 5]
    draft, found = ngram_draft(toks, jnp.asarray([6]), jnp.asarray([9]), PromptLookup(3, 3, 2))
    assert not bool(found[0])


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    return (cfg, params) + random_heads(cfg, params, num_heads=3)


# prompts that repeat themselves, so that lookup drafts; and one that does not
PROMPTS = [[3, 9, 14, 2, 7, 3, 9, 14, 2, 7, 3, 9], list(range(1, 30)) + list(range(1, 12)), [12, 40]]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["chain2", [[0], [1], [0, 0]]], ids=["chain2", "tree3"])
def test_greedy_with_prompt_lookup_equals_plain(tiny, spec):
    cfg, params, hcfg, hp = tiny
    tree = with_lookup(get_tree(spec, topk=10, num_heads=3), PromptLookup(4, 3, 1))
    assert tree.step_size == 5 and tree.max_accepted == 4
    for prompt in PROMPTS:
        base = generate(cfg, params, prompt, max_new_tokens=150, eos_token_ids=())
        med = generate(cfg, params, prompt, max_new_tokens=150, heads=(hcfg, hp), tree=tree, eos_token_ids=())
        assert med.tokens == base.tokens
        r = generate_device(cfg, params, [prompt], max_new_tokens=150, heads=(hcfg, hp), tree=tree,
                            eos_token_ids=())
        assert r.tokens[0].tolist() == base.tokens and r.steps == med.steps
        assert len(r.hist) == 5 and int(r.hist.sum()) == r.steps


def successor_model():
    """A tiny Llama whose greedy next token is (x + 1) mod V: its layers add almost nothing to the
    embedding, and lm_head column y is the embedding of y - 1. Its output copies the prompt's runs."""
    cfg, params = tiny_decoding_model(V)
    small = lambda a: a * 0.01
    layers = {k: ({**v, "attn": {**v["attn"], "o_proj": {"kernel": small(v["attn"]["o_proj"]["kernel"])}},
                   "mlp": {**v["mlp"], "down_proj": {"kernel": small(v["mlp"]["down_proj"]["kernel"])}}})
              for k, v in params.items() if k.startswith("layers_")}
    emb = params["embed"]["embedding"]
    return cfg, {**params, **layers, "lm_head": {"kernel": jnp.roll(emb, 1, axis=0).T * 3}}


def test_accepted_copies_shorten_decoding(tiny):
    cfg, params = successor_model()
    _, _, hcfg, hp = tiny
    prompt = list(range(V)) + list(range(12))
    base = generate(cfg, params, prompt, max_new_tokens=40, eos_token_ids=())
    assert base.tokens == [(12 + i) % V for i in range(40)]
    tree = get_tree("chain2", topk=10, num_heads=3)
    heads_only = generate_device(cfg, params, [prompt], max_new_tokens=40, heads=(hcfg, hp), tree=tree,
                                 eos_token_ids=())
    r = generate_device(cfg, params, [prompt], max_new_tokens=40, heads=(hcfg, hp),
                        tree=with_lookup(tree, PromptLookup(4, 3, 2)), eos_token_ids=())
    assert r.tokens[0].tolist() == heads_only.tokens[0].tolist() == base.tokens
    # the prompt holds the whole cycle: every copy of 4 is accepted, so most steps emit 5 tokens
    assert int(r.hist[4]) >= 6 and r.steps <= 10 < heads_only.steps


def test_batch_with_prompt_lookup_equals_plain(tiny):
    cfg, params, hcfg, hp = tiny
    tree = with_lookup(get_tree("chain2", topk=10, num_heads=3), PromptLookup(3, 3, 2))
    bases = [generate(cfg, params, p, max_new_tokens=60, eos_token_ids=()).tokens for p in PROMPTS]
    out = dict(generate_batch(cfg, params, PROMPTS, batch_size=2, max_new_tokens=60, heads=(hcfg, hp),
                              tree=tree, eos_token_ids=(), progress=False))
    assert [out[i].tokens for i in range(len(PROMPTS))] == bases


def test_exact_sampling_with_prompt_lookup_runs(tiny):
    cfg, params, hcfg, hp = tiny
    tree = with_lookup(get_tree("chain2", topk=10, num_heads=3), PromptLookup(3, 3, 2))
    acc = Acceptance(temperature=0.7)
    a = generate(cfg, params, PROMPTS[0], max_new_tokens=40, heads=(hcfg, hp), tree=tree, acceptance=acc, seed=3)
    b = generate(cfg, params, PROMPTS[0], max_new_tokens=40, heads=(hcfg, hp), tree=tree, acceptance=acc, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 40 and all(0 <= t < V for t in a.tokens)


def test_cache_keeps_the_token_ids(tiny):
    cfg, params, hcfg, hp = tiny
    prompt = PROMPTS[1]
    st = start_state(cfg, params, [prompt, prompt[:7]], 64)
    assert np.asarray(st.cache.tokens)[0, :len(prompt)].tolist() == prompt
    assert np.asarray(st.cache.tokens)[1, :7].tolist() == prompt[:7]


def test_tree_file_round_trip_and_bad_settings(tmp_path):
    tree = with_lookup(get_tree("chain2"), {"num_tokens": 4, "max_ngram": 3, "min_ngram": 1})
    path = tmp_path / "tree.json"
    tree_to_json(tree, path)
    assert json.loads(path.read_text())["prompt_lookup"] == {"num_tokens": 4, "max_ngram": 3, "min_ngram": 1,
                                                             "matches": 1}
    again = get_tree(str(path))
    assert again == tree and again.lookup == PromptLookup(4, 3, 1)
    assert get_tree("chain2") != tree and get_tree("chain2").lookup is None
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        with_lookup(tree, PromptLookup(3, 1, 2))
    for k in (0, 65):
        with pytest.raises(ValueError, match=rf"prompt lookup copies 1 to 64 tokens \(num_tokens\), got {k}"):
            with_lookup(tree, {"num_tokens": k})
    with pytest.raises(ValueError, match="unknown prompt_lookup keys"):
        with_lookup(tree, {"tokens": 3})
    with pytest.raises(ValueError, match="matches >= 1"):
        with_lookup(get_tree("dynamic:6"), {"matches": 0})
    with pytest.raises(ValueError, match="only inside a tree chosen per step"):  # a static tree verifies one chain
        with_lookup(tree, {"matches": 2})
    two = with_lookup(get_tree("dynamic:6"), {"matches": 2})
    tree_to_json(two, path)
    assert get_tree(str(path)) == two and two.lookup.matches == 2
    path.write_text(json.dumps({"medusa_choices": [[0]], "prompt_lookup": 3}))
    with pytest.raises(ValueError, match="must be a dict"):
        get_tree(str(path))


def test_a_lookup_that_never_finds_decodes_as_the_heads_alone(tiny):
    # the padded, data-selected buffers (verify.padded_arrays) verify the heads' tree exactly as the
    # tree itself does: same tokens, same steps, same tokens per step
    cfg, params, hcfg, hp = tiny
    tree = get_tree([[0], [1], [0, 0], [0, 1], [1, 0]], topk=10, num_heads=3)
    never = with_lookup(tree, PromptLookup(num_tokens=6, max_ngram=90, min_ngram=90))
    for prompt in PROMPTS[:2]:
        a = generate(cfg, params, prompt, max_new_tokens=80, heads=(hcfg, hp), tree=tree, eos_token_ids=())
        b = generate(cfg, params, prompt, max_new_tokens=80, heads=(hcfg, hp), tree=never, eos_token_ids=())
        assert a.tokens == b.tokens and a.tokens_per_step == b.tokens_per_step


def test_prompt_lookup_without_heads(tiny):
    # any model, no heads: the trivial tree with lookup settings copies from the context
    cfg, params = successor_model()
    prompt = list(range(V)) + list(range(12))
    alone = with_lookup(get_tree([]), PromptLookup(4, 3, 2))
    assert alone.step_size == 5 and alone.max_accepted == 4
    base = generate(cfg, params, prompt, max_new_tokens=40, eos_token_ids=())
    out = generate(cfg, params, prompt, max_new_tokens=40, tree=alone, eos_token_ids=())
    r = generate_device(cfg, params, [prompt], max_new_tokens=40, tree=alone, eos_token_ids=())
    assert out.tokens == r.tokens[0].tolist() == base.tokens and r.steps == out.steps <= 10
    cfg, params, _, _ = tiny  # a model that rarely repeats: still plain greedy's output
    for p in PROMPTS:
        assert (generate(cfg, params, p, max_new_tokens=50, tree=alone, eos_token_ids=()).tokens
                == generate(cfg, params, p, max_new_tokens=50, eos_token_ids=()).tokens)
    with pytest.raises(ValueError, match="a tree was given without heads"):
        generate(cfg, params, PROMPTS[0], max_new_tokens=4, tree=get_tree("chain2"))
    with pytest.raises(ValueError, match="a tree was given without heads"):
        generate(cfg, params, PROMPTS[0], max_new_tokens=4, tree=get_tree([]))


@pytest.mark.parametrize("lookup", [None, PromptLookup(3, 3, 2)], ids=["heads", "heads+lookup"])
def test_the_decoding_loop_never_copies_the_kv_cache(tiny, lookup):
    """XLA copies the cache into the result of a conditional whose branch writes it (every step:
    docs/design-notes.md). The compiled on-device loop must hold no cache-shaped copy."""
    import re

    from medusa_jax.decoding.setup import decoding_setup
    from medusa_jax.decoding.step import StepConfig
    from medusa_jax.drafts import drafter_for
    from medusa_jax.engine.loop import generate_jit, init_carry

    cfg, params, hcfg, hp = tiny
    tree = with_lookup(get_tree([[0], [1], [0, 0]], topk=10, num_heads=3), lookup)
    p, hc, hpp, tr = decoding_setup(cfg, params, (hcfg, hp), tree)
    state = start_state(cfg, p, [PROMPTS[0]], 64, progress=False)
    carry = init_carry(state, 16, tr.max_accepted)
    args = (p, hpp, carry, jnp.bool_(True), jnp.asarray([16, 2], jnp.int32))
    hlo = generate_jit.lower(StepConfig(cfg, hc, drafter_for(tr), Acceptance()), 16, (), False, *args).compile().as_text()
    shape = "f32[" + ",".join(str(d) for d in state.cache.k.shape) + "]"
    assert shape in hlo  # the loop carries the cache: the pattern below can match
    copies = [line for line in hlo.splitlines() if re.search(re.escape(shape) + r"\S* copy\(", line)]
    assert not copies, copies[:2]
