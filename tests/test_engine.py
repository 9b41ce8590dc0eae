"""The step-level engine: every request's answer equals its decoding alone (greedy: plain greedy's;
sampled: plain sampling's for its seed), whatever the batch, the arrival times, the tree choice and
prefix reuse; cancellation frees the row; errors stay with their request."""
import threading

import jax
import numpy as np
import pytest
from conftest import random_heads, tiny_decoding_model

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import PromptTooLongError
from medusa_jax.engine.chooser import TreeChooser
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.generate import generate
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.requests import EngineStopped, Request, SamplingParams
from medusa_jax.decoding.tree import build_tree, get_tree, with_lookup

jax.config.update("jax_default_matmul_precision", "highest")

V = 64
TREE = with_lookup(get_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)], topk=4), PromptLookup(num_tokens=3, max_ngram=3,
                                                                               min_ngram=2))


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    cfg = cfg.replace(max_position_embeddings=1024)
    heads = random_heads(cfg, params, num_heads=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, size=int(rng.integers(2, 60))).tolist() for _ in range(16)]
    return cfg, params, heads, prompts


def alone(cfg, params, prompt, n, heads=None, tree=None, acc=Acceptance(), seed=0):
    return generate(cfg, params, prompt, max_new_tokens=n, heads=heads, tree=tree, acceptance=acc, seed=seed,
                    progress=False).tokens


def run_staggered(engine, requests, arrive_every=3):
    """Submit the requests a few engine steps apart (arrivals while others decode); their answers."""
    handles, pending = [], list(requests)
    step = 0
    while pending or not engine.idle():
        if pending and step % arrive_every == 0:
            handles.append(engine.submit(pending.pop(0)))
        engine.step()
        step += 1
    return [list(h.finished.tokens) for h in handles], handles


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [1, 4, 16])
@pytest.mark.parametrize("medusa", [False, True])
def test_greedy_answers_equal_decoding_alone(tiny, max_batch, medusa):
    cfg, params, heads, prompts = tiny
    h, tree = (heads, TREE) if medusa else (None, None)
    engine = Engine(cfg, params, heads=h, tree=tree, max_batch=max_batch, speculation="adaptive")
    got, handles = run_staggered(engine, [Request(p, 24) for p in prompts])
    for p, g in zip(prompts, got):
        assert g == alone(cfg, params, p, 24), p
    assert all(hd.finished.reason in ("eos", "length") for hd in handles)
    if medusa:
        assert len(engine.chooser.trees) == 3 and all(n > 0 for n in engine.chooser.chosen)  # every tree ran


@pytest.mark.slow
def test_sampled_rows_equal_the_same_request_alone(tiny):
    """Rows with their own temperature, top-p, top-k and seed beside greedy rows: each equals its
    request decoded alone (and, by the coupling of decoding.sampling, plain sampling with that seed)."""
    cfg, params, heads, prompts = tiny
    settings = [SamplingParams(0.0), SamplingParams(0.8, 1.0, 7), SamplingParams(1.0, 0.9, 3, 6),
                SamplingParams(1.3, 1.0, 5, 4)]
    reqs = [Request(p, 20, settings[i % 4]) for i, p in enumerate(prompts[:8])]
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=4, speculation="adaptive")
    got, _ = run_staggered(engine, reqs, arrive_every=2)
    for r, g in zip(reqs, got):
        s = r.sampling
        acc = Acceptance(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        assert g == alone(cfg, params, r.prompt, 20, heads, TREE, acc, s.seed)
        assert g == alone(cfg, params, r.prompt, 20, acc=acc, seed=s.seed)  # plain sampling, same seed


@pytest.mark.slow
def test_n_choices_of_one_prompt_prefill_it_once(tiny):
    """Requests with the same prompt waiting together (a server's n choices) share one prefill: each
    still answers as its request alone (its own seed and settings), the prompt is prefilled once,
    and the others count it as reused; a different prompt beside them is prefilled on its own."""
    cfg, params, heads, prompts = tiny
    prompt, other = prompts[3] * 6, prompts[4]  # several chunks at a chunk size of 16
    settings = [SamplingParams(0.9, 1.0, 11), SamplingParams(0.9, 1.0, 12), SamplingParams(0.0),
                SamplingParams(1.2, 0.9, 13, 5)]
    reqs = [Request(prompt, 16, s) for s in settings] + [Request(other, 16, SamplingParams(0.9, 1.0, 14))]
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=8, prefill_chunk=16, speculation="always")
    handles = [engine.submit(r) for r in reqs]
    engine.run()
    assert engine.stats["prefill_tokens"] == len(prompt) + len(other)
    assert [h.finished.reused_tokens for h in handles] == [0, len(prompt), len(prompt), len(prompt), 0]
    for r, h in zip(reqs, handles):
        s = r.sampling
        acc = Acceptance(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        assert h.finished.tokens == alone(cfg, params, r.prompt, 16, heads, TREE, acc, s.seed)


def test_prefix_reuse_gives_the_same_answers(tiny):
    """Turn 2 begins with turn 1's prompt and answer: with reuse its K/V come from turn 1's cache
    (most of the prompt is not prefilled again) and the answer is the same as without."""
    cfg, params, heads, prompts = tiny
    answers = {}
    for budget in (0, 64 << 20):
        engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=2, prefix_cache_bytes=budget)
        first = engine.submit(Request(prompts[0] + prompts[1], 16))
        engine.run()
        turn2 = prompts[0] + prompts[1] + first.finished.tokens + prompts[2][:9]
        second = engine.submit(Request(turn2, 16))
        engine.run()
        answers[budget] = (first.finished.tokens, second.finished.tokens, second.finished.reused_tokens)
    assert answers[0][:2] == answers[64 << 20][:2]
    assert answers[0][2] == 0
    assert answers[64 << 20][2] >= len(prompts[0] + prompts[1]) + len(answers[0][0]) - 1
    assert answers[0][1] == alone(cfg, params, prompts[0] + prompts[1] + answers[0][0] + prompts[2][:9], 16)


@pytest.mark.slow
def test_a_scored_prompt_is_prefilled_from_its_scoring_cache(tiny):
    """`Engine.prompt_logprobs(keep=True)` (a loglikelihood request: echo, logprobs and an answer)
    leaves the prompt's K/V in the prefix cache: the answer that follows prefills the last prompt
    token only and is the same as without; without `keep` nothing is kept."""
    cfg, params, heads, prompts = tiny
    prompt = (prompts[5] * 8)[:300]  # two scoring chunks of 256
    ref = alone(cfg, params, prompt, 12)
    for keep in (False, True):
        engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=2, prefix_cache_bytes=64 << 20)
        scored = engine.prompt_logprobs(prompt, 2, keep=keep)
        assert len(scored) == len(prompt) and scored[0] is None and scored[1].token == prompt[1]
        handle = engine.submit(Request(prompt, 12))
        engine.run()
        assert handle.finished.tokens == ref
        assert handle.finished.reused_tokens == (len(prompt) - 1 if keep else 0)
    kept = len(engine.prefix.entries)
    engine.prompt_logprobs(prompt[:engine.prefix.min_tokens], 0, keep=True)  # too short to be worth keeping
    assert len(engine.prefix.entries) == kept


def test_prefix_lookup_takes_the_latest_of_equal_matches_that_fits():
    """Of entries sharing as long a prefix, the latest is taken, and one too large for the request's
    cache is passed over (an earlier, larger entry hid a fitting one: a loglikelihood request's
    scoring cache beside a longer prompt's)."""
    import jax.numpy as jnp

    from medusa_jax.decoding.prefix_cache import PrefixCache

    def kv(slots):
        return jnp.zeros((1, 1, slots, 2)), jnp.zeros((1, 1, slots, 2))

    cache = PrefixCache(1 << 20, min_tokens=4)
    x = list(range(100))
    cache.add(x[:90], *kv(128))  # shares 40 tokens with the prompt, but has 128 slots
    cache.add(x[:40], *kv(64))   # shares the same 40 and fits a 64-slot cache
    n, entry = cache.lookup(x[:40] + [7, 7], max_slots=64)
    assert n == 40 and entry.k.shape[2] == 64
    n, entry = cache.lookup(x[:40] + [7, 7])  # no bound: the latest of the equal matches
    assert n == 40 and entry.k.shape[2] == 64
    assert cache.lookup(x[:80], max_slots=32) == (0, None)  # nothing fits
    assert cache.lookup(x[:80])[0] == 79


def test_cancel_frees_the_row_and_the_others_finish(tiny):
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=2)
    handles = [engine.submit(Request(p, 40)) for p in prompts[:3]]
    for _ in range(4):
        engine.step()
    handles[0].cancel()
    engine.run()
    assert handles[0].finished.reason == "cancelled"
    for h, p in zip(handles[1:], prompts[1:3]):
        assert h.finished.tokens == alone(cfg, params, p, 40)
    assert engine.stats["finished"]["cancelled"] == 1 and engine.idle()


def test_a_long_prefill_lets_arrivals_in_and_cancelled_requests_out_between_its_chunks(tiny, monkeypatch):
    """With no row decoding a prefill runs chunk after chunk in one engine iteration; a request that
    arrives meanwhile is taken between two chunks (the shortest first: it is answered before the long
    prompt's prefill ends), and a request cancelled meanwhile ends there, not after the whole prompt."""
    from medusa_jax.decoding import prefill

    cfg, params, _, prompts = tiny
    engine = Engine(cfg, params, max_batch=4, prefill_chunk=16)
    long_prompt = (prompts[0] * 40)[:400]
    order, late = [], {}
    real = prefill.PrefillJob.run_chunk

    def run_chunk(job, max_tokens=None):
        order.append(len(job.prompt))
        if len(order) == 2:  # a short request and a cancellation arrive during the long prefill
            late["short"] = engine.submit(Request(prompts[1], 8))
            late["gone"] = engine.submit(Request(prompts[2], 8))
            late["gone"].cancel()
        return real(job, max_tokens)

    monkeypatch.setattr(prefill.PrefillJob, "run_chunk", run_chunk)
    long = engine.submit(Request(long_prompt, 8))
    engine.step()  # the long prefill's first chunks, then the short prompt's whole prefill
    assert order[:3] == [400, 400, len(prompts[1])], order
    assert late["gone"].finished.reason == "cancelled" and long.finished is None
    engine.run()
    assert late["short"].finished.tokens == alone(cfg, params, prompts[1], 8)
    assert long.finished.tokens == alone(cfg, params, long_prompt, 8)


def test_cancel_all_ends_every_request_wherever_it_is(tiny):
    """`Engine.cancel_all` (the server's shutdown): decoding, prefilling, waiting and just submitted
    requests all end "cancelled"; one a stop sequence ended keeps its reason."""
    cfg, params, _, prompts = tiny
    engine = Engine(cfg, params, max_batch=2)
    handles = [engine.submit(Request(p, 40)) for p in prompts[:4]]
    for _ in range(3):
        engine.step()
    handles[0].cancel("stop")
    late = engine.submit(Request(prompts[5], 40))  # still in the inbox
    engine.cancel_all()
    engine.run()
    assert handles[0].finished.reason == "stop"
    assert [h.finished.reason for h in handles[1:] + [late]] == ["cancelled"] * 4
    assert engine.idle()


def test_a_turn_that_fills_the_context_is_reused_by_the_next(tiny):
    """A chat turn cut because the context is full ("cache_full") leaves its K/V in the prefix cache
    like any other; the next turn (most of it that turn) is not prefilled again, and answers as without."""
    cfg, params, _, prompts = tiny
    first_prompt = (prompts[0] * 10)[:110]
    answers = {}
    for budget in (0, 64 << 20):
        engine = Engine(cfg, params, max_batch=2, max_len=128, prefix_cache_bytes=budget)
        first = engine.submit(Request(first_prompt, 64))
        engine.run()
        assert first.finished.reason == "cache_full" and 0 < len(first.finished.tokens) < 64
        turn2 = first_prompt + first.finished.tokens[:-6] + prompts[1][:2]  # an edited turn that fits
        second = engine.submit(Request(turn2, 2))
        engine.run()
        answers[budget] = (second.finished.tokens, second.finished.reused_tokens)
    assert answers[0][0] == answers[64 << 20][0] and answers[0][1] == 0
    assert answers[64 << 20][1] >= len(first_prompt)


def test_queued_counts_only_requests_beyond_the_free_rows(tiny):
    """What a server's queue limit counts: a burst that the free rows will take is not queued, in
    the inbox, being prefilled or decoding."""
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, max_batch=4)
    handles = [engine.submit(Request(p, 30)) for p in prompts[:6]]
    assert (engine.waiting, engine.queued) == (6, 2)  # all in the inbox: 4 will get a row
    engine.step()  # rows admitted or being prefilled: still 2 beyond the 4 rows
    assert engine.live >= 1 and engine.queued == 2
    engine.run()
    assert engine.queued == 0 and all(h.finished is not None for h in handles)


def test_kv_cache_usage_and_queue_time(tiny):
    """vLLM's kv_cache_usage_perc: the live rows' prompt and output tokens over max_batch * max_len
    slots, 0 when idle; a request that waited for the only row reports that wait as its queue time."""
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, max_batch=1, max_len=256)
    assert engine.kv_cache_usage == 0.0
    first, second = engine.submit(Request(prompts[0], 12)), engine.submit(Request(prompts[1], 12))
    seen = []
    while first.finished is None:
        row = next((r for r in engine.rows if r is not None), None)
        if row is not None:
            assert row.handle is first
            seen.append((engine.kv_cache_usage, (len(prompts[0]) + len(row.tokens)) / 256))
        engine.step()
    engine.run()
    assert seen and all(abs(got - want) < 1e-9 for got, want in seen) and seen[-1][0] > seen[0][0] - 1e-9
    assert engine.kv_cache_usage == 0.0
    assert second.finished.queue_s > first.finished.queue_s >= 0
    assert second.finished.queue_s >= first.finished.first_token_s  # it waited for the first answer at least


def test_background_thread_serves_concurrent_submitters(tiny):
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=4).start()
    results = {}

    def client(i):
        h = engine.submit(Request(prompts[i], 12))
        streamed = [t for chunk in h for t in chunk]
        results[i] = (streamed, h.result(timeout=300).tokens)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        engine.stop()
    for i in range(8):
        streamed, final = results[i]
        assert streamed == final == alone(cfg, params, prompts[i], 12)
    # stopped, the engine refuses new requests rather than queueing them where nothing runs them; started
    # again, it answers
    with pytest.raises(EngineStopped, match="the engine was stopped"):
        engine.submit(Request(prompts[0], 4))
    assert engine.idle()
    engine.start()
    try:
        assert engine.submit(Request(prompts[0], 4)).result(600).tokens == alone(cfg, params, prompts[0], 4)
    finally:
        engine.stop()


def test_bad_requests_are_refused_and_errors_stay_with_their_request(tiny, monkeypatch):
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, max_batch=2, max_len=128)
    for req, match in [(Request([], 4), "empty"), (Request([V + 3], 4), "outside the model's vocabulary"),
                       (Request([1] * 200, 4), r"KV cache \(max_len=128\) holds 128"), (Request([1], 0), "max_new_tokens"),
                       (Request([1], 4, SamplingParams(-1.0)), "temperature"),
                       (Request([1], 4, SamplingParams(1.0, 0.0)), "top_p"),
                       (Request([1], 4, SamplingParams(1.0, 1.0, 0, -1)), "top_k"),
                       (Request([1], 4, SamplingParams(1.0, 1.0, 0, 2.5)), "top_k")]:
        with pytest.raises((ValueError, PromptTooLongError), match=match):
            engine.submit(req)
    good = engine.submit(Request(prompts[0], 8))
    engine.run()
    assert good.finished.tokens == alone(cfg, params, prompts[0], 8)


def test_chooser_takes_the_fastest_tree_per_batch():
    trees = [build_tree([], topk=1), build_tree([(0,)], topk=1), build_tree([(0,), (0, 0)], topk=1)]
    ch = TreeChooser(trees, "adaptive", explore_every=1000)
    # every tree is tried twice first, so that one slow first call (9 s here) does not rule tree 1 out
    for want, secs, gain in [(0, 1.0, 1.0), (0, 1.0, 1.0), (1, 9.0, 1.9), (1, 1.2, 1.9), (2, 1.3, 2.5), (2, 1.4, 2.5)]:
        assert ch.choose(4, 4) == want
        ch.update(want, 4, secs, gain)
    assert ch.seconds[(1, 4)] == 1.2 and ch.gain == [1.0, 1.9, 2.5]
    assert ch.choose(4, 4) == 2  # 2.5 / 1.3 beats 1.9 / 1.2 and 1 / 1
    for i, secs in enumerate([1.0, 3.0, 4.0] * 2):  # at 16 rows the trees cost too much
        ch.update(i % 3, 16, secs, [1.0, 1.9, 2.5][i % 3])
    assert ch.choose(16, 16) == 0 and ch.choose(4, 4) == 2
    assert TreeChooser(trees, "off").choose(4, 4) == 0 and TreeChooser(trees, "always").choose(4, 4) == 2


def test_chooser_explores_only_compiled_trees():
    trees = [build_tree([], topk=1), build_tree([(0,)], topk=1)]
    ch = TreeChooser(trees, "adaptive", explore_every=4)
    for i, secs in [(0, 1.0), (0, 1.0), (1, 3.0), (1, 3.0)]:  # plain wins: 1/1 against 1.5/3
        ch.update(i, 16, secs, [1.0, 1.5][i])
    picks = []
    for _ in range(40):
        picks.append(ch.choose(16, 16, ready=lambda i: i == 0))
        ch.update(picks[-1], 16, 1.0, 1.0)
    assert picks == [0] * 40  # tree 1's step is not compiled for these shapes: no re-measurement
    explored = [ch.choose(16, 16, ready=lambda i: True) for _ in range(1)]
    assert explored == [1]  # once it is, the overdue re-measurement runs


def test_first_call_on_throwaway_copies_of_donated_arguments():
    """`aot(first_call=True)` calls a new executable once (the CPU runtime's per-executable setup is
    then paid with the compilation) on zero-filled copies of its donated arguments: the caller's
    arrays stay alive and unchanged, and the next request for it neither compiles nor calls again."""
    import functools

    import jax.numpy as jnp

    from medusa_jax.decoding import compile as comp

    calls = []

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(w, state):
        jax.debug.callback(lambda s: calls.append(float(s)), state.sum())
        return state + w @ w

    w, state = jnp.eye(4) * 2.0, jnp.full((4, 4), 3.0)
    comp.clear_compiled()
    fn = comp.aot(step, (), (w, state), first_call=True)
    assert calls == [0.0]  # one call, on zeros in place of the donated state
    assert not state.is_deleted() and float(state.sum()) == 48.0 and not w.is_deleted()
    assert comp.aot(step, (), (w, state), first_call=True) is fn and calls == [0.0]
    np.testing.assert_allclose(np.asarray(fn(w, state)), np.full((4, 4), 3.0) + 4.0 * np.eye(4))
    assert state.is_deleted() and calls == [0.0, 48.0]  # a real call donates as before


def test_a_stop_token_past_the_budget_ends_the_answer_by_length(tiny):
    """A Medusa step can accept the answer's last allowed token and a stop token after it: the stop
    token is cut off with the budget, so the answer ends by "length", not "eos"."""
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=16, speculation="always")
    cases = []
    for p in prompts[:6]:
        answer = alone(cfg, params, p, 24)
        for k in range(1, len(answer)):
            if answer[k] not in answer[:k] and answer[k] not in cfg.eos_token_ids:
                cases.append((answer[:k], engine.submit(Request(p, k, stop_token_ids=[answer[k]]))))
    engine.run()
    assert len(cases) >= 20
    for want, h in cases:
        assert list(h.finished.tokens) == want and h.finished.reason == "length", (want, h.finished)


def _reference_logprobs(cfg, params, prompt, answer):
    """[len(answer), V] log-softmax of one plain forward over prompt + answer: the distribution each
    answer token was chosen from."""
    import jax.numpy as jnp

    from medusa_jax.models.llama import LlamaModel
    ids = jnp.asarray([list(prompt) + list(answer)], jnp.int32)
    logits = LlamaModel(cfg).apply({"params": params}, ids, jnp.arange(ids.shape[1])[None])[0][0]
    return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1].astype(jnp.float32), axis=-1))


@pytest.mark.slow
@pytest.mark.parametrize("medusa", [False, True])
def test_logprobs_are_the_models_own_whatever_the_tree(tiny, medusa):
    """Requests with logprobs: each token's log-probability and its top alternatives are those of
    one plain forward over the answer (greedy and sampled, Medusa steps or plain), in events just
    before each token list and in Finished; rows in the same batch that ask for none get none, and
    the tokens are the same as without logprobs."""
    cfg, params, heads, prompts = tiny
    h, tree = (heads, TREE) if medusa else (None, None)
    engine = Engine(cfg, params, heads=h, tree=tree, max_batch=4, speculation="always" if medusa else "off")
    reqs = [Request(prompts[0], 20, logprobs=3), Request(prompts[1], 20),
            Request(prompts[2], 20, SamplingParams(0.8, 0.9, 7), logprobs=0)]
    got, handles = run_staggered(engine, reqs, arrive_every=1)
    plain, _ = run_staggered(Engine(cfg, params, max_batch=4, speculation="off"),
                             [Request(r.prompt, r.max_new_tokens, r.sampling) for r in reqs], arrive_every=1)
    assert got == plain
    assert handles[1].finished.logprobs is None
    for r, hd in zip(reqs[::2], handles[::2]):
        fin = hd.finished
        events = []
        while not hd.events.empty():
            events.append(hd.events.get())
        kinds = [k for k, _ in events]
        assert kinds[-1] == "done" and kinds[:-1] == ["logprobs", "tokens"] * (len(kinds[:-1]) // 2)
        assert [e.token for k, p in events if k == "logprobs" for e in p] == fin.tokens
        ref = _reference_logprobs(cfg, params, r.prompt, fin.tokens)
        assert len(fin.logprobs) == len(fin.tokens)
        for j, e in enumerate(fin.logprobs):
            np.testing.assert_allclose(e.logprob, ref[j, e.token], atol=2e-4)
            assert len(e.top) == r.logprobs
            order = np.argsort(-ref[j], kind="stable")[:r.logprobs]
            assert [t for t, _ in e.top] == order.tolist()
            np.testing.assert_allclose([lp for _, lp in e.top], ref[j, order], atol=2e-4)
    if medusa:
        assert sum(handles[0].finished.step_tokens) > handles[0].finished.steps  # some steps accepted drafts
    with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 20\], got 21"):
        engine.submit(Request(prompts[0], 4, logprobs=21))


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True])
def test_logit_bias_steers_medusa_and_plain_steps_alike(tiny, sampled):
    """A request's logit_bias: a token banned (-100) never appears, a forced one (+100) is every
    token; with a bias, Medusa steps choose exactly what plain steps choose (greedy, and sampled for
    a seed), beside rows without one; bad biases are refused."""
    cfg, params, heads, prompts = tiny
    sp = SamplingParams(0.9, 0.95, 11) if sampled else SamplingParams()
    base = run_staggered(Engine(cfg, params, max_batch=4, speculation="off"), [Request(prompts[3], 16, sp)])[0][0]
    ban = {base[0]: -100.0, base[3]: -100.0}
    reqs = [Request(prompts[3], 16, sp, logit_bias=ban), Request(prompts[4], 16, sp),
            Request(prompts[5], 8, sp, logit_bias={7: 100.0})]
    plain, _ = run_staggered(Engine(cfg, params, max_batch=4, speculation="off"), reqs, arrive_every=1)
    medusa, handles = run_staggered(Engine(cfg, params, heads=heads, tree=TREE, max_batch=4, speculation="always"),
                                    reqs, arrive_every=1)
    assert medusa == plain
    assert base[0] not in medusa[0] and base[3] not in medusa[0] and medusa[2] == [7] * 8
    assert medusa[1] == run_staggered(Engine(cfg, params, max_batch=4, speculation="off"),
                                      [Request(prompts[4], 16, sp)])[0][0]  # unbiased rows unchanged
    assert sum(handles[1].finished.step_tokens) > handles[1].finished.steps  # drafts were accepted
    engine = Engine(cfg, params, max_batch=2)
    for bias, message in (({V: 1.0}, r"token 64 -> 1.0: ids must be in \[0, 64\)"),
                          ({3: float("nan")}, "finite"), ({"3": 1.0}, "must map token ids")):
        with pytest.raises(ValueError, match=message):
            engine.submit(Request(prompts[0], 4, logit_bias=bias))


@pytest.mark.slow
def test_adaptive_engine_re_measures_the_other_trees(tiny):
    """Once every tree is measured, the adaptive chooser still re-measures the ones it does not pick
    (every `explore_every` steps, where their steps are compiled), also for requests with logprobs
    and penalties, whose compiled steps' keys hold more than the tree and the shapes."""
    cfg, params, heads, prompts = tiny
    engine = Engine(cfg, params, heads=heads, tree=TREE, max_batch=1, speculation="adaptive")
    engine.chooser.explore_every = 4
    run_staggered(engine, [Request(prompts[0], 160, SamplingParams(presence_penalty=0.1), logprobs=1)])
    assert min(engine.chooser.chosen) > 2 * engine.chooser.min_measured, engine.chooser.chosen
