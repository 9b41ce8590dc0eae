"""Parity of the Flax backbone with transformers (eager attention) on tiny random models, and
consistency of the KV-cache paths (prefill + single-token steps, right-padded batches)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_logits, llama3_rope_scaling, random_hf_model, random_tokens, rel_err, tiny_config, torch_logits

from medusa_jax.models.kv_cache import init_cache
from medusa_jax.models.llama import LlamaModel

TOL = 1e-4

CASES = {
    "llama_gqa_untied": lambda: tiny_config("llama"),
    "llama3_rope": lambda: tiny_config("llama", rope_scaling=llama3_rope_scaling()),
    "mistral_window": lambda: tiny_config("mistral", sliding_window=4),
    "qwen2_bias": lambda: tiny_config("qwen2"),
    "llama_tied": lambda: tiny_config("llama", tie_word_embeddings=True),
    "llama_bias": lambda: tiny_config("llama", attention_bias=True),  # q/k/v and o_proj biases
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(name, cfg, torch model, params) for each tiny architecture variant."""
    cfg = CASES[request.param]()
    model, params = random_hf_model(cfg, seed=len(request.param))
    return request.param, cfg, model, params


def test_config_features_are_present(case):
    name, cfg, model, params = case
    layer = params["layers_0"]["attn"]
    assert ("bias" in layer["q_proj"]) == (name in ("qwen2_bias", "llama_bias"))
    assert ("bias" in layer["o_proj"]) == (name == "llama_bias")  # transformers' Llama biases o_proj too
    assert ("lm_head" in params) == (name != "llama_tied")
    assert cfg.num_kv_heads < cfg.num_heads  # GQA everywhere
    if name == "mistral_window":
        assert model.config.sliding_window == 4
    if name == "llama3_rope":
        assert model.config.rope_parameters["rope_type"] == "llama3"


def test_logits_match_transformers(case):
    name, cfg, model, params = case
    tokens = random_tokens(cfg, (2, 12), seed=1)
    ours, ref = jax_logits(cfg, params, tokens), torch_logits(model, tokens)
    assert ours.shape == ref.shape == (2, 12, cfg.vocab_size) and ours.dtype == np.float32
    assert rel_err(ours, ref) < TOL, name


@pytest.mark.parametrize("feature", ["sliding_window", "rope_scaling"])
def test_features_change_the_logits(feature):
    """The window and the RoPE scaling must matter at this length, or the parity tests above
    could not catch an implementation that ignores them."""
    name = {"sliding_window": "mistral_window", "rope_scaling": "llama3_rope"}[feature]
    cfg = CASES[name]()
    model, params = random_hf_model(cfg, seed=3)
    tokens = random_tokens(cfg, (1, 12), seed=2)
    with_feature = jax_logits(cfg, params, tokens)
    without = jax_logits(cfg.replace(**{feature: None}), params, tokens)
    assert rel_err(without, with_feature) > 1e-3
    assert rel_err(with_feature, torch_logits(model, tokens)) < TOL


def _cached_run(cfg, params, prompt, steps, size=32):
    """Prefill `prompt` [B, P] into a cache, then feed `steps` [B, N] one token at a time.

    Returns logits [B, P + N, V] assembled from the prefill and the single-token calls.
    """
    model = LlamaModel(cfg)
    B, P = prompt.shape
    cache = init_cache(cfg, B, size)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, _, cache = model.apply({"params": params}, jnp.asarray(prompt), pos, cache)
    out = [np.asarray(logits)]
    for j in range(steps.shape[1]):
        pos = cache.lengths[:, None]
        logits, _, cache = model.apply({"params": params}, jnp.asarray(steps[:, j:j + 1]), pos, cache)
        out.append(np.asarray(logits))
    assert np.all(np.asarray(cache.lengths) == P + steps.shape[1])
    return np.concatenate(out, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa_untied", "mistral_window", "qwen2_bias", "llama_bias"])
def test_prefill_then_decode_equals_full_forward(name):
    cfg = CASES[name]()
    _, params = random_hf_model(cfg, seed=4)
    tokens = random_tokens(cfg, (2, 11), seed=5)
    full = jax_logits(cfg, params, tokens)
    stepped = _cached_run(cfg, params, tokens[:, :6], tokens[:, 6:])
    assert rel_err(stepped, full) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa_untied", "mistral_window"])
def test_right_padded_batch_matches_single_rows(name):
    """Rows of different lengths, right-padded in one prefill (num_new = true lengths), then
    single-token steps: each row's logits equal those of the row run alone."""
    cfg = CASES[name]()
    _, params = random_hf_model(cfg, seed=6)
    model = LlamaModel(cfg)
    lens = [5, 9]
    T, steps = max(lens), 3
    rows = [random_tokens(cfg, (1, n + steps), seed=10 + i)[0] for i, n in enumerate(lens)]
    padded = np.zeros((2, T), np.int32)
    for i, n in enumerate(lens):
        padded[i, :n] = rows[i][:n]
    cache = init_cache(cfg, 2, 24)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    logits, _, cache = model.apply({"params": params}, jnp.asarray(padded), pos, cache,
                                   num_new=jnp.asarray(lens, jnp.int32))
    assert list(np.asarray(cache.lengths)) == lens
    prefill = np.asarray(logits)
    step_logits = []
    for j in range(steps):
        tok = np.array([[rows[i][n + j]] for i, n in enumerate(lens)], np.int32)
        logits, _, cache = model.apply({"params": params}, jnp.asarray(tok), cache.lengths[:, None], cache)
        step_logits.append(np.asarray(logits)[:, 0])
    step_logits = np.stack(step_logits, axis=1)  # [2, steps, V]
    for i, n in enumerate(lens):
        alone = jax_logits(cfg, params, rows[i][None, :])[0]  # [n + steps, V]
        assert rel_err(prefill[i, :n], alone[:n]) < TOL
        assert rel_err(step_logits[i], alone[n:]) < TOL


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's fusions; a GPU's fusions recompute "
                    "the cheap cos/sin inside each kernel by design")
def test_rope_tables_are_computed_once_per_forward():
    """Each layer's queries and keys share one (cos, sin) table per forward: the compiled decoding
    step of a 6-layer model evaluates at most one cosine and one sine op per conditional branch
    (XLA fused them into every layer's RoPE, 2 per layer, before; docs/performance.md)."""
    from conftest import tiny_decoding_model

    from medusa_jax.decoding.acceptance import Acceptance
    from medusa_jax.decoding.prefill import start_state
    from medusa_jax.decoding.step import StepConfig, medusa_step
    from medusa_jax.decoding.tree import PLAIN_TREE
    from medusa_jax.drafts import drafter_for

    cfg, _ = tiny_decoding_model()
    cfg = cfg.replace(num_layers=6)
    params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                                  jnp.zeros((1, 4), jnp.int32))["params"]
    state = start_state(cfg, params, [[1, 2, 3]], 32, progress=False)
    step = jax.jit(lambda p, s: medusa_step(StepConfig(cfg, None, drafter_for(PLAIN_TREE), Acceptance()), p, None, s))
    hlo = step.lower(params, state).compile().as_text()
    ops = [line for line in hlo.splitlines() if " cosine(" in line]
    assert 1 <= len(ops) <= 2, ops[:4]


def test_llama_attention_bias_loads_and_decodes_as_transformers(tmp_path):
    """A Llama checkpoint with ``attention_bias`` (biases on q, k, v and o_proj, as transformers'
    LlamaAttention has them) loads from its directory and decodes, in the decoding layout, to
    transformers' greedy tokens."""
    import torch

    from medusa_jax.convert.load import load_model
    from medusa_jax.engine.generate import generate

    cfg = CASES["llama_bias"]()
    model, _ = random_hf_model(cfg, seed=3)
    model.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), with_tokenizer=False)
    assert lm.cfg.attention_bias and lm.cfg.o_proj_bias
    prompt = [int(t) for t in random_tokens(cfg, (9,), seed=2)]
    ours = generate(lm.cfg, lm.params, prompt, max_new_tokens=8, eos_token_ids=()).tokens
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_act": "relu"}, "hidden_act 'relu'"),
    ({"mlp_bias": True}, "mlp_bias true"),
])
def test_variants_the_model_does_not_compute_are_refused(change, message):
    """A config asking for what `LlamaModel` does not compute (another activation, MLP biases) is
    refused when it is read, never loaded to decode wrongly; SiLU (by either name) loads."""
    from medusa_jax.models.config import ModelConfig, UnsupportedArchitectureError

    d = dict(tiny_config("llama").to_hf_dict())
    for act in ("silu", "swish", None):
        ok = dict(d, hidden_act=act) if act else d
        assert ModelConfig.from_hf_dict(ok).arch == "llama"
    with pytest.raises(UnsupportedArchitectureError, match=message):
        ModelConfig.from_hf_dict(dict(d, **change))
