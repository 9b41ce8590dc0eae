"""Penalties (presence, frequency, repetition) and min_p: the functions against a numpy transcription
of vLLM's sampler, answers against a plain forward over them, and Medusa steps choosing exactly
what plain steps choose (greedy and sampled), a variant that forgets the tree paths' tokens failing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads, tiny_decoding_model

from medusa_jax.decoding import compile as compile_mod
from medusa_jax.decoding import processors
from medusa_jax.engine.engine import Engine
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.requests import Request, SamplingParams
from medusa_jax.decoding.tree import dynamic_tree, get_tree, with_lookup
from medusa_jax.models.llama import LlamaModel

jax.config.update("jax_default_matmul_precision", "highest")

V = 64
TREE = with_lookup(get_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)], topk=4),
                   PromptLookup(num_tokens=3, max_ngram=3, min_ngram=1))


@pytest.fixture(scope="module")
def tiny():
    return tiny_setup()


def tiny_setup():
    """A tiny random model of `V` tokens, 3 random medusa heads and 8 random prompts."""
    cfg, params = tiny_decoding_model(V)
    heads = random_heads(cfg, params, num_heads=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, V, size=int(rng.integers(3, 40))).tolist() for _ in range(8)]
    return cfg, params, heads, prompts


def vllm_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's ``apply_penalties`` for one row, in numpy: [V] logits, token lists."""
    counts = np.bincount(np.asarray(output, int), minlength=logits.shape[-1]).astype(np.float32)
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, int), minlength=logits.shape[-1]) > 0)
    r = np.where(seen, repetition, 1.0)
    out = np.where(logits > 0, logits / r, logits * r)
    return out - frequency * counts - presence * (counts > 0)


def test_counts_and_penalties_match_numpy():
    rng = np.random.default_rng(0)
    B, S, T, Vs = 3, 12, 5, 9
    tokens = rng.integers(0, Vs, (B, S)).astype(np.int32)
    lengths, prompt_len = np.array([12, 7, 0], np.int32), np.array([4, 7, 0], np.int32)
    counts, in_prompt = processors.context_counts(jnp.asarray(tokens), jnp.asarray(lengths),
                                                  jnp.asarray(prompt_len), Vs)
    for b in range(B):
        np.testing.assert_array_equal(counts[b], np.bincount(tokens[b, prompt_len[b]:lengths[b]], minlength=Vs))
        np.testing.assert_array_equal(in_prompt[b], np.bincount(tokens[b, :prompt_len[b]], minlength=Vs) > 0)
    parents = [-1, 0, 0, 1, 3]
    anc = np.zeros((T, T), bool)
    for t in range(T):
        a = t
        while a >= 0:
            anc[t, a], a = True, parents[a]
    tree_tokens = rng.integers(0, Vs, (B, T)).astype(np.int32)
    per_node = processors.path_counts(counts, jnp.asarray(np.broadcast_to(anc, (B, T, T))), jnp.asarray(tree_tokens))
    for b in range(B):
        for t in range(T):
            path = tree_tokens[b, anc[t]]
            np.testing.assert_array_equal(per_node[b, t], np.asarray(counts[b]) + np.bincount(path, minlength=Vs))
    pen = np.array([[0.5, 0.3, 1.4], [-1.0, 2.0, 0.6], [0.0, 0.0, 1.0]], np.float32)
    logits = rng.normal(size=(B, Vs)).astype(np.float32) * 3
    got = processors.penalized(jnp.asarray(logits), jnp.asarray(pen), counts, in_prompt)
    for b in range(B):
        want = vllm_penalties(logits[b], tokens[b, :prompt_len[b]], tokens[b, prompt_len[b]:lengths[b]], *pen[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6)
    # min_p: a token survives iff its tempered probability is at least min_p times the largest
    min_p, temp = np.array([0.2, 0.0, 0.5], np.float32), np.array([0.7, 1.0, 0.0], np.float32)
    kept = np.isfinite(processors.min_p_filtered(jnp.asarray(logits), jnp.asarray(min_p), jnp.asarray(temp)))
    p = np.exp(logits[0] / 0.7 - np.max(logits[0] / 0.7))
    np.testing.assert_array_equal(kept[0], p >= 0.2)
    assert kept[1].all() and kept[2].all()  # min_p 0; a greedy row


def _raw_logits(cfg, params, prompt, answer):
    """[len(answer), V] float32 logits of one plain forward over prompt + answer."""
    ids = jnp.asarray([list(prompt) + list(answer)], jnp.int32)
    logits = LlamaModel(cfg).apply({"params": params}, ids, jnp.arange(ids.shape[1])[None])[0][0]
    return np.asarray(logits[len(prompt) - 1:-1], np.float32)


def _answers(engine, requests):
    handles = [engine.submit(r) for r in requests]
    while not engine.idle():
        engine.step()
    return [list(h.finished.tokens) for h in handles], handles


SETTINGS = [dict(presence_penalty=1.5), dict(frequency_penalty=2.0, repetition_penalty=1.5),
            dict(frequency_penalty=-1.0, repetition_penalty=0.7), dict(repetition_penalty=1.8, min_p=0.2), {}]


@pytest.mark.slow
def test_greedy_penalties_are_vllms(tiny):
    """Each greedy token is the argmax of vLLM's penalties applied to a plain forward's logits over
    the answer so far, and the penalties change the answers."""
    cfg, params, _, prompts = tiny
    reqs = [Request(p, 24, SamplingParams(**s)) for p, s in zip(prompts, SETTINGS)]
    got, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    unpenalized, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"),
                              [Request(r.prompt, 24) for r in reqs])
    assert sum(g != u for g, u in zip(got[:4], unpenalized[:4])) >= 3 and got[4] == unpenalized[4]
    for r, answer in zip(reqs, got):
        raw = _raw_logits(cfg, params, r.prompt, answer)
        s = r.sampling
        for j, tok in enumerate(answer):
            x = vllm_penalties(raw[j], r.prompt, answer[:j], s.presence_penalty, s.frequency_penalty,
                               s.repetition_penalty)
            assert x[tok] >= x.max() - 1e-4, (j, tok, int(np.argmax(x)))


@pytest.mark.slow
def test_sampled_min_p_keeps_likely_tokens(tiny):
    cfg, params, _, prompts = tiny
    reqs = [Request(p, 32, SamplingParams(1.5, 1.0, seed, min_p=0.3)) for seed, p in enumerate(prompts[:4])]
    got, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    free, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"),
                       [Request(r.prompt, 32, r.sampling._replace(min_p=0.0)) for r in reqs])
    low = 0
    for r, answer, other in zip(reqs, got, free):
        raw = _raw_logits(cfg, params, r.prompt, answer) / 1.5
        p = np.exp(raw - raw.max(axis=-1, keepdims=True))
        assert all(p[j, t] >= 0.3 - 1e-5 for j, t in enumerate(answer)), r.prompt
        raw = _raw_logits(cfg, params, r.prompt, other) / 1.5
        p = np.exp(raw - raw.max(axis=-1, keepdims=True))
        low += sum(p[j, t] < 0.3 for j, t in enumerate(other))
    assert low > 0  # without min_p the same seeds do draw such tokens


def _heads_and_tree(cfg, params, heads, kind):
    """The test's heads and tree: a static tree, a dynamic one (medusa heads), a dynamic one with
    hydra heads (whose drafts see the rows' penalties: `processors.draft_adjuster`); all with prompt
    lookup."""
    lookup = PromptLookup(num_tokens=3, max_ngram=3, min_ngram=1)
    if kind == "static":
        return heads, TREE
    if kind == "dynamic":
        return heads, with_lookup(dynamic_tree(6, 3, topk=4), lookup)
    return random_heads(cfg, params, num_heads=3, head_type="hydra"), with_lookup(dynamic_tree(6, 3, topk=4, width=2),
                                                                                  lookup)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "dynamic", "hydra"])
@pytest.mark.parametrize("sampled", [False, True])
def test_medusa_with_penalties_chooses_what_plain_steps_choose(tiny, sampled, kind, monkeypatch):
    """Rows with penalties and min_p beside a row without: Medusa's answers are plain decoding's,
    token for token, whatever the tree; with the tree paths' own tokens left out of the counts
    they are not (static tree, greedy)."""
    cfg, params, heads, prompts = tiny
    heads, tree = _heads_and_tree(cfg, params, heads, kind)
    base = SamplingParams(0.9, 0.95, 11) if sampled else SamplingParams()
    reqs = [Request(p, 40, base._replace(**s)) for p, s in zip(prompts, SETTINGS)]
    plain, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    medusa, handles = _answers(Engine(cfg, params, heads=heads, tree=tree, max_batch=4, speculation="always"), reqs)
    assert medusa == plain
    accepted = sum(sum(h.finished.step_tokens) - h.finished.steps for h in handles[:4])
    assert accepted > 3, accepted  # the tree's nodes past the root were chosen from, with their paths' counts
    if kind != "static" or sampled:  # the path counts are the same code for every tree and mode; greedy on the
        # static tree shows their effect (sampled, the answers rarely reach a node whose path repeats a token)
        return

    def no_path(counts, ancestor_mask, tree_tokens):
        return jnp.broadcast_to(counts[:, None, :], tree_tokens.shape + counts.shape[-1:])

    assert _answers_with(monkeypatch, "path_counts", no_path, Engine(cfg, params, heads=heads, tree=tree, max_batch=4,
                                                                     speculation="always"), reqs) != plain


def _answers_with(monkeypatch, name, broken, engine, requests):
    """`_answers` with ``processors.<name>`` replaced by `broken` (the compiled steps cleared before and after)."""
    monkeypatch.setattr(processors, name, broken)
    jax.clear_caches()
    compile_mod._COMPILED.clear()
    try:
        return _answers(engine, requests)[0]
    finally:
        monkeypatch.undo()
        jax.clear_caches()
        compile_mod._COMPILED.clear()
        compile_mod._CALLED.clear()


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    ("frequency_penalty", float("nan"), r"frequency_penalty must be a number in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a number in \[0.01, 2\] \(1 = off\), got 0.0"),
    ("repetition_penalty", 1e-40, r"repetition_penalty must be a number in \[0.01, 2\]"),
    ("min_p", 1.5, r"min_p must be a number in \[0, 1\], got 1.5"),
    ("min_p", "0.1", r"min_p must be a number")])
def test_bad_penalties_are_refused(tiny, field, value, message):
    cfg, params, _, prompts = tiny
    with pytest.raises(ValueError, match=message):
        Engine(cfg, params, max_batch=1).submit(Request(prompts[0], 4, SamplingParams(**{field: value})))


@pytest.mark.slow
def test_generate_takes_penalties_by_name(tiny):
    """`generate(penalties=...)` (decode.py's path): Medusa with penalties answers what the engine's
    plain steps answer with them; an unknown name or a bad value is refused before decoding."""
    from medusa_jax.decoding.acceptance import Acceptance
    from medusa_jax.engine.generate import generate

    cfg, params, heads, prompts = tiny
    kw = dict(repetition_penalty=1.6, frequency_penalty=0.3)
    got = generate(cfg, params, prompts[2], max_new_tokens=24, heads=heads, tree=TREE, penalties=kw,
                   progress=False).tokens
    want, _ = _answers(Engine(cfg, params, max_batch=1, speculation="off"),
                       [Request(prompts[2], 24, SamplingParams(**kw))])
    assert got == want[0] != generate(cfg, params, prompts[2], max_new_tokens=24, progress=False).tokens
    sampled = dict(min_p=0.2, presence_penalty=-0.5)
    got = generate(cfg, params, prompts[3], max_new_tokens=24, heads=heads, tree=TREE, penalties=sampled,
                   acceptance=Acceptance(temperature=0.8), seed=4, progress=False).tokens
    want, _ = _answers(Engine(cfg, params, max_batch=1, speculation="off"),
                       [Request(prompts[3], 24, SamplingParams(0.8, seed=4, **sampled))])
    assert got == want[0]
    with pytest.raises(ValueError, match="unknown penalties typo_penalty"):
        generate(cfg, params, prompts[2], max_new_tokens=4, penalties={"typo_penalty": 1.0}, progress=False)
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[0.01, 2\]"):
        generate(cfg, params, prompts[2], max_new_tokens=4, penalties={"repetition_penalty": 3}, progress=False)


@pytest.mark.slow
def test_typical_acceptance_judges_candidates_by_the_processed_logits(tiny):
    """Typical acceptance is not exact, but its posterior reads the processed logits too: with a
    token forced (logit_bias +100) every token is that one, the heads' other candidates rejected
    and prompt lookup's copies of it accepted; with penalties beside, nothing fails."""
    cfg, params, heads, prompts = tiny
    sp = SamplingParams(1.0, 1.0, 2, repetition_penalty=1.5)
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=2, speculation="always", acceptance="typical")
    got, handles = _answers(engine, [Request(prompts[0], 48, sp, logit_bias={7: 100.0}),
                                     Request(prompts[1], 48, sp._replace(presence_penalty=1.0))])
    assert got[0] == [7] * 48 and len(got[1]) == 48
    assert sum(handles[0].finished.step_tokens) - handles[0].finished.steps > 10  # the copies were accepted


@pytest.mark.slow
def test_typical_acceptance_keeps_top_k_and_top_p_and_bans(tiny):
    """Typical acceptance judges candidates by the distribution a plain step samples from: with top-k
    1, or a nucleus of one token, every token is the greedy one (a candidate outside them has no
    probability), and a banned token (-inf: allowed_token_ids) is never emitted while candidates
    are still accepted (the entropy of a distribution with zeros is a number, not NaN)."""
    cfg, params, heads, prompts = tiny
    greedy, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), [Request(p, 32) for p in prompts[:3]])
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=4, speculation="always", acceptance="typical")
    allowed = sorted(set(range(0, V, 2)) | {greedy[2][0]})
    got, handles = _answers(engine, [Request(prompts[0], 32, SamplingParams(0.9, 1.0, 1, top_k=1)),
                                     Request(prompts[1], 32, SamplingParams(0.9, 1e-6, 2)),
                                     Request(prompts[2], 32, SamplingParams(0.9, 1.0, 3), allowed_token_ids=allowed)])
    assert got[:2] == greedy[:2]
    assert set(got[2]) <= set(allowed)
    assert all(sum(h.finished.step_tokens) > h.finished.steps for h in handles), "no candidate was accepted"


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True])
def test_min_tokens_bans_the_stop_ids_until_then(tiny, sampled):
    """min_tokens (vLLM's): the stop ids cannot end the answer before it has that many tokens; each
    early token is the argmax of a plain forward's logits without the stop ids (greedy), and Medusa
    chooses what plain steps choose."""
    cfg, params, heads, prompts = tiny
    sp = SamplingParams(0.9, 1.0, 5) if sampled else SamplingParams()
    free, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), [Request(p, 30, sp) for p in prompts[:4]])
    stops = [[a[1], a[3]] for a in free]  # tokens that would end each answer early
    reqs = [Request(p, 30, sp, stop_token_ids=s, min_tokens=m) for p, s, m in zip(prompts, stops, (12, 0, 30, 5))]
    plain, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    medusa, handles = _answers(Engine(cfg, params, heads=heads, tree=TREE, max_batch=4, speculation="always"), reqs)
    assert medusa == plain
    assert len(plain[1]) == 2  # min_tokens 0: the first stop id ends it, as without
    for r, a in zip(reqs, plain):
        assert len(a) >= r.min_tokens + (len(a) < 30) and not set(a[:r.min_tokens]) & set(r.stop_token_ids), (r, a)
        if not sampled:
            raw = _raw_logits(cfg, params, r.prompt, a)
            for j, tok in enumerate(a):
                x = raw[j].copy()
                if j < r.min_tokens:
                    x[r.stop_token_ids] = -np.inf
                assert x[tok] >= x.max() - 1e-4
    with pytest.raises(ValueError, match=r"min_tokens must be an int in \[0, max_new_tokens = 4\], got 5"):
        Engine(cfg, params, max_batch=1).submit(Request(prompts[0], 4, min_tokens=5))


def test_the_heads_draft_from_the_processed_logits():
    """`draft_adjuster`: the heads' logits over their proposal ids get each row's bias and penalties
    (from the context's counts), as the target's do, so that they draft what it would choose."""
    from types import SimpleNamespace

    rng = np.random.default_rng(3)
    B, S, Vs, J = 2, 10, 12, 2
    tokens = rng.integers(0, Vs, (B, S)).astype(np.int32)
    lengths, prompt_len = np.array([10, 6], np.int32), np.array([4, 6], np.int32)
    bias = np.zeros((B, Vs), np.float32)
    bias[0, 3], bias[1, 5] = 2.0, -1.5
    pen = np.array([[0.5, 0.25, 1.4], [0.0, 0.0, 1.0]], np.float32)
    procs = processors.LogitsProcessors(bias=jnp.asarray(bias), penalties=jnp.asarray(pen),
                                        prompt_len=jnp.asarray(prompt_len))
    state = SimpleNamespace(cache=SimpleNamespace(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths)),
                            logits=jnp.zeros((B, Vs)), temperature=jnp.zeros((B,)))
    adjust = processors.draft_adjuster(procs, state)
    ids = np.array([3, 5, 7, 0, 11], np.int32)
    logits = rng.normal(size=(J, B, 3, len(ids))).astype(np.float32) * 3
    got = np.asarray(adjust(jnp.asarray(logits), jnp.asarray(ids)))
    for j in range(J):
        for b in range(B):
            for i in range(3):
                full = np.zeros(Vs, np.float32)
                full[ids] = logits[j, b, i] + bias[b, ids]
                want = vllm_penalties(full, tokens[b, :prompt_len[b]], tokens[b, prompt_len[b]:lengths[b]], *pen[b])
                np.testing.assert_allclose(got[j, b, i], want[ids], rtol=1e-6)
    assert processors.draft_adjuster(processors.LogitsProcessors(min_p=jnp.ones((B,))), state) is None
    # banned tokens (allowed_token_ids): far below the rest, finite even when every proposal is banned
    banned = np.zeros((B, Vs), bool)
    banned[0, ids] = True
    banned[1, [5, 11]] = True
    adjust = processors.draft_adjuster(processors.LogitsProcessors(banned=jnp.asarray(banned)), state)
    got = np.asarray(adjust(jnp.asarray(logits), jnp.asarray(ids)))
    assert np.all(got[:, 0] == processors.DRAFT_BANNED) and np.all(np.isfinite(jax.nn.log_softmax(got, -1)))
    np.testing.assert_array_equal(got[:, 1, :, [0, 2, 3]], logits[:, 1, :, [0, 2, 3]])
    assert np.all(got[:, 1, :, [1, 4]] == processors.DRAFT_BANNED)
