"""Compute dtype: bfloat16 / float16 params compute in that dtype (activations, KV cache) with
float32 logits, and Medusa greedy output equals plain greedy output in every dtype."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads, rel_err, tiny_decoding_model

from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.tree import get_tree
from medusa_jax.evals import lossless
from medusa_jax.models.llama import LlamaModel, compute_dtype

V = 64
PROMPTS = [[1, 5, 9, 3, 7], [12], list(range(3, 40))]


def cast(tree, dt):
    return jax.tree_util.tree_map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    return cfg, params, random_heads(cfg, params, head_type="medusa")


@pytest.mark.slow
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_params_dtype_is_the_compute_dtype(tiny, dt):
    cfg, params, _ = tiny
    low = cast(params, dt)
    assert compute_dtype(low) == jnp.dtype(dt) and compute_dtype(params) == jnp.float32
    toks = jnp.asarray([PROMPTS[0]], jnp.int32)
    pos = jnp.arange(5)[None]
    logits, hidden, _ = LlamaModel(cfg).apply({"params": low}, toks, pos)
    ref = LlamaModel(cfg).apply({"params": params}, toks, pos)[0]
    assert logits.dtype == jnp.float32 and hidden.dtype == jnp.dtype(dt)
    # accumulated into float32, not rounded to the low dtype (where near logits would tie exactly)
    assert bool(jnp.any(logits != logits.astype(dt).astype(jnp.float32)))
    assert 1e-4 < rel_err(logits, ref) < 0.05  # computed in the low dtype: close, not equal
    state = start_state(cfg, low, PROMPTS[:2], 64)
    assert state.cache.k.dtype == jnp.dtype(dt) and state.hidden.dtype == jnp.dtype(dt)
    assert state.logits.dtype == jnp.float32
    # an explicit dtype overrides the params'
    assert LlamaModel(cfg, dtype=jnp.float32).apply({"params": low}, toks, pos)[1].dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_medusa_greedy_equals_plain_greedy_in_low_precision(tiny, dt):
    cfg, params, (hcfg, hp) = tiny
    low, heads = cast(params, dt), (hcfg, cast(hp, dt))
    tree = get_tree("small_8", num_heads=3)
    accepted = 0
    for p in PROMPTS:
        plain = generate(cfg, low, p, max_new_tokens=40, progress=False)
        med = generate(cfg, low, p, max_new_tokens=40, heads=heads, tree=tree, progress=False)
        dev = generate_device(cfg, low, [p], max_new_tokens=40, heads=heads, tree=tree, progress=False)
        c = lossless.compare(cfg, low, p, plain.tokens, med.tokens)  # the dtype's near-tie gap
        assert c.identical or c.near_tie, c
        assert dev.tokens[0, :dev.count[0]].tolist() == med.tokens
        accepted += med.steps < len(med.tokens)
    assert accepted  # candidates were accepted somewhere


def test_tie_gap_follows_the_dtype(tiny, monkeypatch):
    """A difference at the first token is a near-tie exactly when the top-2 gap there is below the
    threshold of the params' dtype, read from `lossless.TIE_GAPS` (where the thresholds are
    defined); each dtype's threshold is moved to either side of the measured gap, so that both
    answers are exercised whatever the tiny model's gap happens to be."""
    cfg, params, _ = tiny
    ids = PROMPTS[0]
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        p = cast(params, dt)
        g = lossless.top2_gap(cfg, p, ids)
        assert np.isfinite(g) and g > 0
        name = jnp.dtype(dt).name
        c = lossless.compare(cfg, p, ids, [1, 2], [3, 2])
        assert c.gap == pytest.approx(g) and c.first_diff == 0
        assert c.near_tie == (g < lossless.TIE_GAPS[name])
        for threshold, near_tie in ((2 * g, True), (g / 2, False)):
            monkeypatch.setitem(lossless.TIE_GAPS, name, threshold)
            assert lossless.compare(cfg, p, ids, [1, 2], [3, 2]).near_tie == near_tie, (name, threshold)
