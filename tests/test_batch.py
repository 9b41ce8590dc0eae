"""Continuous batching (`generate_batch`): every prompt's output equals its own batch-1 output,
whatever the batch size, with rows refilled as they finish and the cache growing on the way."""
import jax
import pytest
from conftest import random_heads, tiny_decoding_model

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.engine.generate import generate, generate_batch, generate_device
from medusa_jax.decoding.tree import get_tree

jax.config.update("jax_default_matmul_precision", "highest")

V = 64
PROMPTS = [[1, 5, 9, 3, 7], [4, 4, 2, 8, 19, 33, 2, 6, 11, 60, 3], [12], [7, 7, 1], list(range(3, 40)),
           [30, 2], [9, 8, 7, 6, 5]]
EOS = (63,)  # ends the rows after 29 to 150 tokens: rows finish at different times


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    return cfg, params, random_heads(cfg, params), get_tree("small_8", num_heads=3)


def run_batch(cfg, params, batch_size, **kw):
    gen = generate_batch(cfg, params, PROMPTS, batch_size=batch_size, eos_token_ids=EOS, progress=False, **kw)
    results = {}
    while True:
        try:
            i, res = next(gen)
        except StopIteration as stop:
            return results, stop.value
        assert i not in results
        results[i] = res


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_batch_rows_equal_batch_one(tiny, batch_size):
    cfg, params, heads, tree = tiny
    for h, tr in ((None, None), (heads, tree)):
        results, stats = run_batch(cfg, params, batch_size, heads=h, tree=tr, max_new_tokens=150)
        assert sorted(results) == list(range(len(PROMPTS)))
        for i, p in enumerate(PROMPTS):
            ref = generate(cfg, params, p, max_new_tokens=150, eos_token_ids=EOS, progress=False)
            assert results[i].tokens == ref.tokens, (batch_size, i, h is None)
            assert results[i].stop_reason == ref.stop_reason
        if h is not None:
            assert stats.hist[1:].sum() > 0  # candidates were accepted
        assert max(stats.cache_sizes) > 128 > 0  # 37-token prompt + 150 new tokens: the cache grew
        assert sum(r.steps for r in results.values()) == stats.hist.sum()


@pytest.mark.slow
def test_batch_sampling_rows_equal_batch_one(tiny):
    cfg, params, heads, tree = tiny
    acc = Acceptance(temperature=0.9)
    results, _ = run_batch(cfg, params, 3, heads=heads, tree=tree, max_new_tokens=30, acceptance=acc, seed=5)
    for i, p in enumerate(PROMPTS):
        ref = generate(cfg, params, p, max_new_tokens=30, eos_token_ids=EOS, heads=heads, tree=tree,
                       acceptance=acc, seed=5 + i, progress=False)
        assert results[i].tokens == ref.tokens


def test_batch_arguments_are_checked(tiny):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        generate_batch(cfg, params, PROMPTS, batch_size=0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_batch(cfg, params, [[1], []])
    with pytest.raises(ValueError, match="seeds must be in"):
        generate_batch(cfg, params, [[1]], seed=-1)


@pytest.mark.slow
def test_exact_sampling_up_to_a_full_cache(tiny):
    """Near the cache's end the tree no longer fits and steps fall back to plain ones, which must
    take over the root an exact step drew: the streaming and on-device paths agree. In a batch the
    fallback is batch-wide (one static tree per step), so there a sampled row may draw differently
    from its batch-1 run near a full cache; greedy rows still equal batch 1."""
    cfg, params, heads, tree = tiny
    acc = Acceptance(temperature=1.0)
    for i, p in enumerate(PROMPTS[:3]):
        kw = dict(max_new_tokens=60, heads=heads, tree=tree, acceptance=acc, cache_size=40, progress=False)
        one = generate(cfg, params, p, seed=3 + i, **kw)
        dev = generate_device(cfg, params, [p], seed=3 + i, **kw)
        assert one.stop_reason == "cache_full" and len(p) + len(one.tokens) == 40
        assert dev.tokens[0, :dev.count[0]].tolist() == one.tokens
    results, _ = run_batch(cfg, params, 2, max_new_tokens=60, heads=heads, tree=tree, cache_size=40)
    for i, p in enumerate(PROMPTS):
        ref = generate(cfg, params, p, max_new_tokens=60, heads=heads, tree=tree, cache_size=40, eos_token_ids=EOS,
                       progress=False)
        assert results[i].tokens == ref.tokens and results[i].stop_reason == ref.stop_reason
