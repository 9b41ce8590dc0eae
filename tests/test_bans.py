"""vLLM's ``allowed_token_ids`` and ``bad_words``: the answers against a numpy transcription of vLLM's
bans over a plain forward, the recent tokens before each tree node against a direct walk of its
path, and Medusa steps choosing exactly what plain steps choose (greedy and sampled, static and
dynamic trees), a variant that reads only the cache's tokens before every node failing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_processors import TREE, V, _answers, _answers_with, _heads_and_tree, _raw_logits, tiny_setup

from medusa_jax.decoding import processors
from medusa_jax.engine.engine import Engine
from medusa_jax.decoding.requests import Request, SamplingParams
from medusa_jax.decoding.tree_arrays import padded_arrays, tree_rows

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def tiny():
    return tiny_setup()


def vllm_bans(logits, output, allowed, bad_words):
    """vLLM's ``apply_allowed_token_ids`` and ``apply_bad_words`` for one row, in numpy ([V] logits;
    bad words as token lists, looked for in the output tokens only)."""
    x = logits.copy()
    if allowed is not None:
        keep = np.zeros(len(x), bool)
        keep[allowed] = True
        x[~keep] = -np.inf
    for w in bad_words or ():
        if len(w) - 1 <= len(output) and list(output[len(output) - len(w) + 1:]) == list(w[:-1]):
            x[w[-1]] = -np.inf
    return x


def _bans(free):
    """Per row: allowed ids (or None) and bad words taken from its free answer (a token, a pair, a
    triple and a pair that only occurs later), so that they bite."""
    rng = np.random.default_rng(9)
    out = []
    for i, a in enumerate(free):
        allowed = sorted(rng.choice(V, V // 2, replace=False).tolist() + a[:2]) if i % 3 == 0 else None
        words = [[a[3]], a[5:7], a[8:11], a[15:17]] if i % 3 != 1 else [a[4:6], a[10:13], [a[20], a[21]]]
        out.append((allowed, words if i % 3 != 2 else words[1:]))
    return out


@pytest.mark.slow
def test_allowed_ids_and_bad_words_are_vllms(tiny):
    """Each greedy token is the argmax of vLLM's bans applied to a plain forward's logits over the
    answer so far, and the bans change the answers."""
    cfg, params, _, prompts = tiny
    free, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), [Request(p, 32) for p in prompts])
    reqs = [Request(p, 32, allowed_token_ids=al, bad_words=bw) for p, (al, bw) in zip(prompts, _bans(free))]
    got, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    assert sum(g != f for g, f in zip(got, free)) >= 6
    for r, answer in zip(reqs, got):
        raw = _raw_logits(cfg, params, r.prompt, answer)
        for j, tok in enumerate(answer):
            x = vllm_bans(raw[j], answer[:j], r.allowed_token_ids, r.bad_words)
            assert x[tok] >= x.max() - 1e-4, (j, tok, int(np.argmax(x)))
        for w in r.bad_words:
            assert not any(answer[k:k + len(w)] == w for k in range(len(answer))), (w, answer)
        assert r.allowed_token_ids is None or set(answer) <= set(r.allowed_token_ids)


def test_recent_tokens_walk_each_nodes_path_then_the_cache():
    rng = np.random.default_rng(1)
    tr = tree_rows(padded_arrays(TREE, TREE.size, TREE.num_paths, TREE.max_depth), 2)
    B, S, T, n = 2, 12, TREE.size, 4
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    lengths, prompt_len = np.array([9, 5], np.int32), np.array([3, 4], np.int32)
    tree_tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    ids, ok = processors.recent_tokens(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(prompt_len), n,
                                       jnp.asarray(tree_tokens), tr)
    root_ids, root_ok = processors.recent_tokens(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(prompt_len), n)
    parents = np.asarray(TREE.parents)
    for b in range(B):
        context = list(tokens[b, :lengths[b]])
        flags = [i >= prompt_len[b] for i in range(lengths[b])]
        assert list(np.asarray(root_ids)[b]) == context[::-1][:n]
        assert list(np.asarray(root_ok)[b]) == flags[::-1][:n]
        for t in range(T):
            path, at = [], t
            while at >= 0:
                path.insert(0, tree_tokens[b, at])
                at = parents[at]
            seq, seq_ok = context + path, flags + [True] * len(path)
            assert list(np.asarray(ids)[b, t]) == seq[::-1][:n], (b, t)
            assert list(np.asarray(ok)[b, t]) == seq_ok[::-1][:n], (b, t)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "dynamic", "hydra"])
@pytest.mark.parametrize("sampled", [False, True])
def test_medusa_with_bans_chooses_what_plain_steps_choose(tiny, sampled, kind, monkeypatch):
    """Rows with allowed ids and bad words beside rows without: Medusa's answers are plain
    decoding's, token for token; when every node looks only at the cache's tokens (not its path)
    they are not (static tree, greedy)."""
    cfg, params, heads, prompts = tiny
    heads, tree = _heads_and_tree(cfg, params, heads, kind)
    base = SamplingParams(0.9, 0.95, 11) if sampled else SamplingParams()
    free, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), [Request(p, 40, base) for p in prompts])
    bans = _bans(free)
    reqs = [Request(p, 40, base, allowed_token_ids=al if i < 6 else None, bad_words=bw if i < 6 else None)
            for i, (p, (al, bw)) in enumerate(zip(prompts, bans))]
    plain, _ = _answers(Engine(cfg, params, max_batch=4, speculation="off"), reqs)
    medusa, handles = _answers(Engine(cfg, params, heads=heads, tree=tree, max_batch=4, speculation="always"), reqs)
    assert medusa == plain
    assert plain[6:] == free[6:] and sum(p != f for p, f in zip(plain[:6], free[:6])) >= 4
    accepted = sum(sum(h.finished.step_tokens) - h.finished.steps for h in handles[:6])
    assert accepted > 3, accepted
    if kind != "static" or sampled:  # the same code for every tree and mode
        return
    real = processors.recent_tokens

    def cache_only(tokens, lengths, prompt_len, n, tree_tokens=None, tree=None):
        ids, ok = real(tokens, lengths, prompt_len, n)
        if tree_tokens is None:
            return ids, ok
        shape = tree_tokens.shape + (n,)
        return jnp.broadcast_to(ids[:, None], shape), jnp.broadcast_to(ok[:, None], shape)

    assert _answers_with(monkeypatch, "recent_tokens", cache_only,
                         Engine(cfg, params, heads=heads, tree=tree, max_batch=4, speculation="always"), reqs) != plain


@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[1, V]), rf"allowed_token_ids: token id {V} is outside the model's vocabulary"),
    (dict(allowed_token_ids="abc"), "allowed_token_ids must be a list of token ids"),
    (dict(bad_words=[[1, 2], []]), "bad_words: a word is an empty list"),
    (dict(bad_words=[[1, -3]]), r"bad_words\[0\]: token id -3 is outside"),
    (dict(allowed_token_ids=[4, 5], bad_words=[[5], [4], [4, 5]]), "every one of allowed_token_ids is a bad word")])
def test_bad_bans_are_refused(tiny, kwargs, message):
    cfg, params, _, prompts = tiny
    with pytest.raises(ValueError, match=message):
        Engine(cfg, params, max_batch=1).submit(Request(prompts[0], 4, **kwargs))


def test_generate_takes_the_bans_and_medusa_keeps_them(tiny):
    """The library's `generate` takes allowed_token_ids and bad_words (and logit_bias, min_tokens) as
    the engine's Request does: Medusa's greedy answer equals plain greedy's under the same bans, the
    bans change it, and a banned word never appears; a bad id is refused by name."""
    from medusa_jax.engine.generate import generate

    cfg, params, heads, prompts = tiny
    heads, tree = _heads_and_tree(cfg, params, heads, "dynamic")
    prompt = prompts[0]
    free = generate(cfg, params, prompt, max_new_tokens=32, progress=False).tokens
    words = [free[3:5], [free[8]]]
    allowed = sorted(set(range(V)) - {free[12]})
    kw = dict(max_new_tokens=32, progress=False, bad_words=words, allowed_token_ids=allowed,
              logit_bias={free[20]: -100.0}, min_tokens=4)
    plain = generate(cfg, params, prompt, **kw).tokens
    assert plain != free and free[12] not in plain and free[8] not in plain
    assert not any(plain[j:j + 2] == words[0] for j in range(len(plain) - 1))
    assert generate(cfg, params, prompt, heads=heads, tree=tree, **kw).tokens == plain
    with pytest.raises(ValueError, match="allowed_token_ids"):
        generate(cfg, params, prompt, max_new_tokens=4, progress=False, allowed_token_ids=[V + 5])


@pytest.mark.slow
def test_generate_batch_takes_the_same_settings_for_every_prompt(tiny):
    """`generate_batch` takes penalties, logit_bias, min_tokens, allowed_token_ids and bad_words for
    every prompt: each row's greedy answer, Medusa's or plain, is `generate`'s with the same
    settings; bad settings are refused before anything runs."""
    from medusa_jax.engine.generate import generate, generate_batch

    cfg, params, heads, prompts = tiny
    heads, tree = _heads_and_tree(cfg, params, heads, "dynamic")
    free = generate(cfg, params, prompts[0], max_new_tokens=24, progress=False).tokens
    kw = dict(max_new_tokens=24, penalties={"repetition_penalty": 1.3, "presence_penalty": 0.5},
              logit_bias={free[2]: -100.0}, min_tokens=3, allowed_token_ids=sorted(set(range(V)) - {free[5]}),
              bad_words=[free[7:9]])
    want = [generate(cfg, params, p, progress=False, **kw).tokens for p in prompts[:5]]
    assert want[0] != free
    for h, t in ((None, None), (heads, tree)):
        got = dict(generate_batch(cfg, params, prompts[:5], batch_size=2, heads=h, tree=t, progress=False, **kw))
        assert [got[i].tokens for i in range(5)] == want
    for bad, match in (({"penalties": {"typo_penalty": 1.0}}, "unknown penalties typo_penalty"),
                       ({"logit_bias": {V + 1: 1.0}}, "logit_bias"), ({"min_tokens": 30}, "min_tokens")):
        with pytest.raises(ValueError, match=match):
            generate_batch(cfg, params, prompts[:2], max_new_tokens=24, progress=False, **bad)

