"""Sliding-window attention, per layer, as transformers runs each family's config.json: parity of
the logits (full forward, prefill + cached steps), the GGUF metadata, Medusa greedy == plain greedy
on a windowed model, and clear refusals for layouts transformers cannot run either."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_logits, random_hf_model, random_tokens, tiny_config, tiny_decoding_model, torch_logits

from medusa_jax.models.config import ModelConfig
from medusa_jax.models.kv_cache import init_cache
from medusa_jax.models.llama import LlamaModel

W = 8   # window
T = 24  # tokens: three windows long
TOL = 1e-4
F, S = "full_attention", "sliding_attention"


def hf_dict(model_type: str, num_layers: int, **window_keys) -> dict:
    """A tiny config.json dict (the sizes of `tiny_config`) with the given sliding-window keys."""
    d = tiny_config(model_type, sliding_window=None, num_layers=num_layers).to_hf_dict()
    for k in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
        d.pop(k, None)
    d.update(window_keys)
    return d


# name -> (config.json dict, the per-layer windows transformers runs)
LAYOUTS = {
    # the case: the window only on layers at index >= max_window_layers
    "qwen2_max_window_layers_1": (hf_dict("qwen2", 2, use_sliding_window=True, sliding_window=W,
                                          max_window_layers=1), (None, W)),
    "qwen2_all_windowed": (hf_dict("qwen2", 2, use_sliding_window=True, sliding_window=W,
                                   max_window_layers=0), (W, W)),
    "qwen2_window_off": (hf_dict("qwen2", 2, use_sliding_window=False, sliding_window=W,
                                 max_window_layers=0), (None, None)),
    "qwen2_max_window_layers_beyond": (hf_dict("qwen2", 2, use_sliding_window=True, sliding_window=W,
                                               max_window_layers=5), (None, None)),
    "qwen2_layer_types": (hf_dict("qwen2", 3, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                  layer_types=[S, F, S]), (W, None, W)),  # the list wins
    "qwen2_legacy_attention_name": (hf_dict("qwen2", 3, use_sliding_window=True, sliding_window=W,
                                            layer_types=["attention", S, F]), (None, W, None)),
    # Qwen3Config reads the window keys as Qwen2Config does
    "qwen3_max_window_layers_1": (hf_dict("qwen3", 2, use_sliding_window=True, sliding_window=W,
                                          max_window_layers=1), (None, W)),
    "qwen3_window_off": (hf_dict("qwen3", 2, use_sliding_window=False, sliding_window=W,
                                 max_window_layers=0), (None, None)),
    "qwen3_layer_types": (hf_dict("qwen3", 3, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                  layer_types=[S, "attention", S]), (W, None, W)),
    "mistral_window": (hf_dict("mistral", 2, sliding_window=W), (W, W)),
    "mistral_null_window": (hf_dict("mistral", 2, sliding_window=None), (None, None)),
    # MistralModel ignores layer_types (it only warns) and windows every layer
    "mistral_layer_types_ignored": (hf_dict("mistral", 2, sliding_window=W, layer_types=[F, S]), (W, W)),
    # LlamaModel has no sliding window at all
    "llama_window_keys_ignored": (hf_dict("llama", 2, use_sliding_window=True, sliding_window=W,
                                          layer_types=[S, S]), (None, None)),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request):
    """(name, cfg, torch model built from the raw config.json dict, params, expected windows)."""
    d, windows = LAYOUTS[request.param]
    cfg = ModelConfig.from_hf_dict(d)
    model, params = random_hf_model(cfg, seed=len(request.param), hf_dict=d)
    return request.param, cfg, model, params, windows


def test_layout_is_read_as_transformers_runs_it(layout):
    name, cfg, model, _, windows = layout
    assert cfg.layer_windows == windows, name
    if cfg.arch in ("qwen2", "qwen3"):  # transformers' own per-layer reading
        assert tuple(layer.self_attn.sliding_window for layer in model.model.layers) == windows


@pytest.mark.slow
def test_logits_match_transformers_beyond_the_window(layout):
    name, cfg, model, params, windows = layout
    tokens = random_tokens(cfg, (2, T), seed=1)
    ours, ref = jax_logits(cfg, params, tokens), torch_logits(model, tokens)
    assert float(np.max(np.abs(ours - ref))) <= TOL, name
    if any(windows):  # the window must matter here, or this test could not catch it being ignored
        unwindowed = jax_logits(cfg.replace(sliding_window=None, layer_types=None), params, tokens)
        assert float(np.max(np.abs(unwindowed[:, :W] - ref[:, :W]))) <= TOL  # inside the window: same
        assert float(np.max(np.abs(unwindowed[:, W:] - ref[:, W:]))) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_max_window_layers_1", "qwen2_layer_types"])
def test_prefill_then_cached_steps_match_transformers(name):
    """6 prompt tokens into a cache, then 18 single-token steps past the window: each step's
    logits equal transformers' full forward (the cache keeps every slot; the window is a mask)."""
    d, _ = LAYOUTS[name]
    cfg = ModelConfig.from_hf_dict(d)
    model, params = random_hf_model(cfg, seed=11, hf_dict=d)
    tokens = random_tokens(cfg, (2, T), seed=3)
    ref = torch_logits(model, tokens)
    lm = LlamaModel(cfg)
    cache = init_cache(cfg, 2, 32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    logits, _, cache = lm.apply({"params": params}, jnp.asarray(tokens[:, :6]), pos, cache)
    out = [np.asarray(logits)]
    for j in range(6, T):
        logits, _, cache = lm.apply({"params": params}, jnp.asarray(tokens[:, j:j + 1]), cache.lengths[:, None], cache)
        out.append(np.asarray(logits))
    assert float(np.max(np.abs(np.concatenate(out, axis=1) - ref))) <= TOL


def test_config_normalises_and_round_trips():
    mixed = tiny_config("qwen2", num_layers=3, sliding_window=W, layer_types=[F, S, S])
    assert mixed.layer_types == (F, S, S) and mixed.layer_windows == (None, W, W)
    assert ModelConfig.from_hf_dict(mixed.to_hf_dict()) == mixed
    hash(mixed)  # a static argument of jitted functions
    # uniform lists are the same config as no list; an unused window is dropped
    assert tiny_config("qwen2", sliding_window=W, layer_types=[S, S]) == tiny_config("qwen2", sliding_window=W)
    assert tiny_config("qwen2", sliding_window=W, layer_types=[F, F]) == tiny_config("qwen2")
    with pytest.raises(ValueError, match="cannot express"):
        tiny_config("mistral", sliding_window=W, layer_types=[F, S]).to_hf_dict()
    with pytest.raises(ValueError, match="cannot express"):
        tiny_config("llama", sliding_window=W).to_hf_dict()


@pytest.mark.parametrize("keys, message", [
    (dict(use_sliding_window=True, sliding_window=W, layer_types=[S]), "layer_types has 1 entries for num_hidden_layers=2"),
    (dict(use_sliding_window=True, sliding_window=W, layer_types=["chunked_attention", S]), "chunked_attention"),
    (dict(use_sliding_window=False, sliding_window=W, layer_types=[S, F]), "the window is off"),
    (dict(use_sliding_window=True, sliding_window=None, layer_types=[S, F]), "the window is off"),
    (dict(use_sliding_window=True, sliding_window=0, max_window_layers=0), "positive integer or null, got 0"),
])
def test_layouts_transformers_cannot_run_are_refused(keys, message):
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_hf_dict(hf_dict("qwen2", 2, **keys), source="cfg.json")
    assert str(e.value).startswith("cfg.json: unsupported sliding-window layout")


def test_model_config_refuses_bad_windows():
    with pytest.raises(ValueError, match="layer_types lists 1 layers but the model has num_layers=2"):
        tiny_config("qwen2", sliding_window=W, layer_types=[S])
    with pytest.raises(ValueError, match="sliding_window is None"):
        tiny_config("qwen2", layer_types=[S, F])
    with pytest.raises(ValueError, match="unsupported layer type"):
        tiny_config("qwen2", sliding_window=W, layer_types=["window_attention", F])
    with pytest.raises(ValueError, match="positive number of tokens"):
        tiny_config("mistral", sliding_window=-1)


@pytest.mark.parametrize("name", ["qwen2_max_window_layers_1", "qwen2_layer_types", "mistral_window"])
def test_gguf_sliding_window_metadata(tmp_path, name):
    """llama.cpp's ``attention.sliding_window`` (+ ``sliding_window_pattern``, one bool per layer)
    give the same per-layer windows and logits; Mistral is written as a llama file."""
    from conftest import hf_state_dict
    from test_convert import write_gguf

    from medusa_jax.convert.gguf import load_gguf

    d, windows = LAYOUTS[name]
    cfg = ModelConfig.from_hf_dict(d)
    model, _ = random_hf_model(cfg, seed=5, hf_dict=d)
    path = write_gguf(tmp_path / "w.gguf", cfg, hf_state_dict(model), arch="llama" if cfg.arch == "mistral" else None)
    cfg2, params2 = load_gguf(path)
    assert cfg2.arch == cfg.arch and cfg2.layer_windows == windows
    tokens = random_tokens(cfg, (1, T), seed=2)
    assert float(np.max(np.abs(jax_logits(cfg2, params2, tokens) - torch_logits(model, tokens)))) <= TOL


def test_gguf_bad_sliding_window_pattern(tmp_path):
    import gguf
    from conftest import hf_state_dict
    from test_convert import write_gguf

    from medusa_jax.convert.gguf import load_gguf
    from medusa_jax.convert.hf import ConversionError

    cfg = tiny_config("qwen2", num_layers=3, sliding_window=W, layer_types=[F, S, S])
    model, _ = random_hf_model(cfg, seed=5)
    real = gguf.GGUFWriter.add_sliding_window_pattern
    try:  # a pattern one layer short
        gguf.GGUFWriter.add_sliding_window_pattern = lambda self, p: real(self, p[:-1])
        path = write_gguf(tmp_path / "w.gguf", cfg, hf_state_dict(model))
    finally:
        gguf.GGUFWriter.add_sliding_window_pattern = real
    with pytest.raises(ConversionError, match="sliding_window_pattern must be one bool per layer"):
        load_gguf(path)


@pytest.mark.slow
def test_medusa_greedy_equals_plain_greedy_on_a_windowed_model(monkeypatch):
    """A windowed layer and a full one: plain greedy output changes with the window (so the window
    is live), and Medusa decoding (random heads, and oracle heads that accept every node, so that
    tree tokens attend across the window) still gives the plain greedy output."""
    from test_medusa import oracle_proposer

    from medusa_jax.drafts import heads as draft
    from medusa_jax.decoding.compile import clear_compiled
    from medusa_jax.engine.generate import generate, generate_device
    from medusa_jax.decoding.tree import get_tree
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.medusa import init_heads
    from medusa_jax.models.llama import lm_head_matrix

    base_cfg, params = tiny_decoding_model(64)
    cfg = base_cfg.replace(arch="qwen2", sliding_window=W, layer_types=(F, S))
    prompt, n = [4, 4, 2, 8, 19, 33, 2, 6, 11, 60, 3], 60
    ref = generate(cfg, params, prompt, max_new_tokens=n)
    assert ref.tokens != generate(base_cfg, params, prompt, max_new_tokens=n).tokens
    hcfg = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4, num_layers=1)
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(1), len(hp))
    hp = {k: jax.random.normal(kk, a.shape) * 0.5 for kk, (k, a) in zip(keys, sorted(hp.items()))}
    tree = get_tree("mc_sim_7b_63", topk=10, num_heads=4)
    assert generate(cfg, params, prompt, max_new_tokens=n, heads=(hcfg, hp), tree=tree).tokens == ref.tokens
    r = generate_device(cfg, params, [prompt], max_new_tokens=n, heads=(hcfg, hp), tree=tree, eos_token_ids=())
    assert r.tokens[0].tolist() == ref.tokens
    monkeypatch.setattr(draft, "propose_candidates", oracle_proposer(list(prompt) + ref.tokens + [0] * 8, 10))
    jax.clear_caches()
    clear_compiled()
    try:
        med = generate(cfg, params, prompt, max_new_tokens=n, heads=(hcfg, {"rank": jnp.zeros(4, jnp.int32)}),
                       tree=get_tree("chain4", num_heads=4))
        assert med.tokens == ref.tokens and all(t == 5 for t in med.tokens_per_step[:-1])
    finally:
        jax.clear_caches()
        clear_compiled()
