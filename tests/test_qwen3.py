"""Qwen3 and Llama 3.2 backbones (issue 27): parity with transformers through `load_model` and the
decoding path (prefill, then 20 greedy steps), the GGUF twins, and Medusa / Hydra decoding,
training and export on a Qwen3 backbone.

Qwen3 differs from Qwen2 by an RMSNorm on each query and key head before RoPE (``q_norm`` /
``k_norm``), an explicit ``head_dim`` (here 32 with hidden 64 and 4 heads, where hidden / heads is
16), no q/k/v biases and (optionally) tied embeddings. Llama 3.2 is a Llama with tied embeddings
and Llama-3 RoPE scaling (rope_type "llama3").
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (hf_state_dict, jax_logits, random_heads, random_hf_model, random_tokens, rel_err,
                      tiny_config, torch_logits)
from medusa_jax.models.config import ModelConfig, RopeScaling
from medusa_jax.convert.hf import params_from_hf_tensors
from medusa_jax.decoding.tree import PLAIN_TREE
from medusa_jax.decoding.prefill import cache_size_for, start_state
from medusa_jax.engine.generate import generate, generate_batch, generate_device
from medusa_jax.decoding.step import StepConfig, step
from medusa_jax.drafts import drafter_for
from medusa_jax.convert.load import load_model
from medusa_jax.models.layout import decoding_params
from medusa_jax.models.llama import LlamaModel
from medusa_jax.decoding.tree import get_tree
from medusa_jax.decoding.acceptance import Acceptance

TOL = 1e-4       # max abs logit difference from transformers
PROMPT_LEN = 100
NEW_TOKENS = 20


def qwen3_config(tied: bool, **kw) -> ModelConfig:
    """A tiny Qwen3: vocab 128, hidden 64, 2 layers, 4 query / 2 KV heads of head_dim 32 (not
    hidden / heads = 16), no biases."""
    return tiny_config("qwen3", head_dim=32, tie_word_embeddings=tied, **kw)


def llama32_config() -> ModelConfig:
    """A tiny Llama 3.2: tied embeddings and Llama 3.2 1B's RoPE (theta 5e5, rope_type llama3 with
    factor 32, low / high frequency factors 1 / 4, original context 8192; context 131072) and
    head_dim 64: three frequencies fall in the smoothed band, the longer ones are divided by 32."""
    return tiny_config("llama", hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=True,
                       rope_theta=500000.0, max_position_embeddings=131072,
                       rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192))


PARITY = {
    "qwen3_untied": lambda: qwen3_config(False),
    "qwen3_tied": lambda: qwen3_config(True),
    "llama32_tied_llama3_rope": llama32_config,
}


def hf_model(cfg: ModelConfig, seed: int):
    """`conftest.random_hf_model`, with every q_norm / k_norm weight (Qwen3) drawn from [0.5, 1.5]
    so that the per-head norms' scales matter as much as their normalisation.
    Returns (transformers model, our params with the same weights)."""
    import torch

    model, _ = random_hf_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    return model, params_from_hf_tensors(cfg, hf_state_dict(model))


@pytest.fixture(scope="module", params=sorted(PARITY))
def saved(request, tmp_path_factory):
    """(name, cfg, transformers model, `LoadedModel` from its save_pretrained directory)."""
    cfg = PARITY[request.param]()
    model, _ = hf_model(cfg, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, cfg, model, load_model(str(path), with_tokenizer=False)


def decoding_path_logits(cfg, params, prompt, n):
    """Our greedy tokens [n] and logits [n + 1, V] through the decoding path `generate` runs: the
    prefill (`start_state`), then n plain jitted `step`s in decoding layout. Row j of the logits is
    at position ``len(prompt) - 1 + j``."""
    params = decoding_params(params)
    state = start_state(cfg, params, [prompt], cache_size_for(cfg, len(prompt), n), progress=False)
    logits, tokens = [np.asarray(state.logits[0])], []
    for _ in range(n):
        out, state = step(StepConfig(cfg, None, drafter_for(PLAIN_TREE), Acceptance()), params, None, state)
        assert int(out.num_tokens[0]) == 1
        tokens.append(int(out.tokens[0, 0]))
        logits.append(np.asarray(state.logits[0]))
    return tokens, np.stack(logits)


def test_config_is_read_as_transformers_reads_it(saved):
    name, cfg, model, lm = saved
    assert lm.cfg == cfg
    hf = model.config
    assert lm.cfg.head_dim == hf.head_dim and lm.cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in lm.params) == (not cfg.tie_word_embeddings)
    attn = lm.params["layers_0"]["attn"]
    if cfg.arch == "qwen3":
        assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
        assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (cfg.head_dim,)
        assert "bias" not in attn["q_proj"] and "bias" not in attn["o_proj"]
        np.testing.assert_array_equal(attn["k_norm"]["scale"],
                                      model.model.layers[0].self_attn.k_norm.weight.detach().numpy())
    else:
        assert "q_norm" not in attn
        assert hf.rope_parameters["rope_type"] == "llama3" and lm.cfg.rope_scaling.factor == 32.0


def test_decoding_path_matches_transformers(saved):
    """A 100-token prompt and 20 greedy tokens: the prefill's and every step's logits equal
    transformers' logits of the same sequence (max abs difference <= 1e-4), and the tokens are
    transformers' greedy choices and `generate`'s output."""
    name, cfg, model, lm = saved
    prompt = [int(t) for t in random_tokens(cfg, (PROMPT_LEN,), seed=7)]
    tokens, ours = decoding_path_logits(lm.cfg, lm.params, prompt, NEW_TOKENS)
    ref = torch_logits(model, [prompt + tokens])[0, PROMPT_LEN - 1:]
    assert ours.shape == ref.shape == (NEW_TOKENS + 1, cfg.vocab_size)
    err = float(np.max(np.abs(ours - ref)))
    print(f"\n{name}: max abs logit difference {err:.2e} (logits up to {np.max(np.abs(ref)):.2f})")
    assert err <= TOL, name
    assert tokens == [int(t) for t in ref[:-1].argmax(-1)]
    assert generate(lm.cfg, lm.params, prompt, max_new_tokens=NEW_TOKENS, progress=False).tokens == tokens


def test_the_new_features_change_the_logits(saved):
    """The q/k norms (and their weights) and the Llama-3 RoPE scaling matter at this length, so
    the parity above could not pass with an implementation that ignored them."""
    name, cfg, model, lm = saved
    tokens = random_tokens(cfg, (1, PROMPT_LEN + NEW_TOKENS), seed=3)
    ref = torch_logits(model, tokens)
    assert float(np.max(np.abs(jax_logits(lm.cfg, lm.params, tokens) - ref))) <= TOL
    if cfg.arch == "qwen3":
        ones = jax.tree_util.tree_map(lambda x: x, lm.params)
        for i in range(cfg.num_layers):
            for norm in ("q_norm", "k_norm"):
                ones[f"layers_{i}"]["attn"][norm] = {"scale": np.ones(cfg.head_dim, np.float32)}
        variants = [(cfg, ones)]
        dropped = jax.tree_util.tree_map(lambda x: x, lm.params)  # no q/k norm at all (a llama model)
        for i in range(cfg.num_layers):
            del dropped[f"layers_{i}"]["attn"]["q_norm"], dropped[f"layers_{i}"]["attn"]["k_norm"]
        variants.append((cfg.replace(arch="llama"), dropped))
    else:
        variants = [(cfg.replace(rope_scaling=None), lm.params)]
    for c, p in variants:
        assert float(np.max(np.abs(jax_logits(c, p, tokens) - ref))) > 1e-2


def test_qwen3_config_defaults_follow_transformers():
    """A Qwen3 config.json without head_dim means Qwen3Config's 128, not hidden / heads; the
    attention bias defaults to off; the window keys read as Qwen2's."""
    from transformers import Qwen3Config

    d = qwen3_config(False).to_hf_dict()
    for k in ("head_dim", "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
              "layer_types"):
        d.pop(k)
    cfg = ModelConfig.from_hf_dict(d)
    hf = Qwen3Config(**{k: v for k, v in d.items() if k != "model_type"})
    assert cfg.head_dim == hf.head_dim == 128 and not cfg.attention_bias and not hf.attention_bias
    assert cfg.layer_windows == (None, None) and cfg.qk_norm and not cfg.o_proj_bias
    on = ModelConfig.from_hf_dict(dict(d, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert on.layer_windows == (None, 8)


@pytest.mark.slow
def test_qwen3_attention_bias_covers_the_output_projection():
    """Qwen3's attention_bias biases q, k, v and o (unlike Qwen2, whose o_proj has none), in the
    training layout and in the decoding one (fused q/k/v with their biases, o_proj's kept)."""
    cfg = qwen3_config(False, attention_bias=True)
    model, params = hf_model(cfg, seed=2)
    assert params["layers_1"]["attn"]["o_proj"]["bias"].shape == (cfg.hidden_size,)
    tokens = random_tokens(cfg, (2, 16), seed=4)
    assert float(np.max(np.abs(jax_logits(cfg, params, tokens) - torch_logits(model, tokens)))) <= TOL
    prompt = [int(t) for t in tokens[0, :12]]
    new, ours = decoding_path_logits(cfg, params, prompt, 4)
    assert float(np.max(np.abs(ours - torch_logits(model, [prompt + new])[0, 11:]))) <= TOL


# ------------------------------------------------------------------------------------------ GGUF

GGUF_CASES = {"qwen3_untied": lambda: qwen3_config(False), "qwen3_tied": lambda: qwen3_config(True),
              "llama32": llama32_config}


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_twin_loads_to_the_same_logits(tmp_path, name, monkeypatch):
    """A GGUF written as llama.cpp's convert_hf_to_gguf.py writes the model (qwen3: unpermuted q/k,
    ``attn_q_norm`` / ``attn_k_norm``, ``qwen3.attention.key_length``; llama: permuted q/k and the
    Llama-3 scaling as a ``rope_freqs`` tensor; tied: no ``output.weight``) loads through
    `load_model` to its HF twin's config and logits."""
    import gguf

    from medusa_jax.models.llama import rope_inv_freq
    from test_convert import write_gguf

    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    cfg = GGUF_CASES[name]()
    model, params = hf_model(cfg, seed=9)
    path = write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(model))
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in names) == (not cfg.tie_word_embeddings)
    assert ("blk.1.attn_k_norm.weight" in names) == (cfg.arch == "qwen3")
    assert ("rope_freqs.weight" in names) == (cfg.rope_scaling is not None)
    lm = load_model(path, with_tokenizer=False)
    assert lm.cfg.replace(rms_norm_eps=cfg.rms_norm_eps, rope_scaling=cfg.rope_scaling) == cfg
    np.testing.assert_allclose(rope_inv_freq(lm.cfg), rope_inv_freq(cfg), rtol=1e-5)
    for path_, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        got = lm.params
        for k in path_:
            got = got[k.key]
        np.testing.assert_array_equal(np.asarray(got), leaf, err_msg=str(path_))
    tokens = random_tokens(cfg, (1, PROMPT_LEN + NEW_TOKENS), seed=5)
    err = float(np.max(np.abs(jax_logits(lm.cfg, lm.params, tokens) - torch_logits(model, tokens))))
    print(f"\nGGUF {name}: max abs logit difference {err:.2e} over {tokens.shape[1]} tokens")
    assert err <= TOL


def test_qwen3_gguf_is_cached_and_read_back(tmp_path, monkeypatch):
    """The converted-model cache stores and returns a Qwen3 model whole (q/k norms, head_dim)."""
    from medusa_jax.convert import cache
    from test_convert import write_gguf

    monkeypatch.setenv("MEDUSA_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEDUSA_JAX_NO_CACHE", raising=False)
    cfg = qwen3_config(True)
    model, _ = hf_model(cfg, seed=4)
    path = write_gguf(tmp_path / "q.gguf", cfg, hf_state_dict(model))
    first = load_model(path, with_tokenizer=False)
    hit = cache.load_cached(path, np.float32)
    assert hit is not None and hit[0] == first.cfg
    second = load_model(path, with_tokenizer=False)
    assert second.cfg == first.cfg and second.cfg.head_dim == 32
    a, b = jax.tree_util.tree_leaves_with_path(first.params), jax.tree_util.tree_leaves_with_path(second.params)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))
    assert "q_norm" in second.params["layers_0"]["attn"]


# ------------------------------------------------------------------ decoding, training, export

V = 64
PROMPTS = [[1, 5, 9, 3, 7], [4, 4, 2, 8, 19, 33, 2, 6, 11, 60, 3], [12]]


@pytest.fixture(scope="module")
def tiny_qwen3():
    """(cfg, params) of a tiny Qwen3 made in JAX: vocab 64, hidden 32, 4 query / 2 KV heads of
    head_dim 16 (hidden / heads = 8), tied embeddings, 2-D weights scaled by 3 (varied greedy
    output, as `conftest.tiny_decoding_model`) and every RMSNorm scale, q/k norms included, drawn
    from [0.5, 1.5]."""
    cfg = ModelConfig(arch="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=1024,
                      eos_token_ids=())
    params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                                  jnp.zeros((1, 4), jnp.int32))["params"]
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 64))

    def draw(path, a):
        if path[-1].key == "scale":
            return jax.random.uniform(next(keys), a.shape, minval=0.5, maxval=1.5)
        return a * 3 if a.ndim == 2 else a
    return cfg, jax.tree_util.tree_map_with_path(draw, params)


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_medusa_and_hydra_greedy_equal_plain_greedy(tiny_qwen3, head_type):
    """Random Medusa / Hydra heads on the Qwen3 backbone: `generate`, `generate_device` and
    `generate_batch` give plain greedy's tokens, with candidates accepted on the way."""
    cfg, params = tiny_qwen3
    heads = random_heads(cfg, params, num_heads=4, head_type=head_type)
    tree = get_tree("small_16", num_heads=4)
    n = 100
    base = [generate(cfg, params, p, max_new_tokens=n, progress=False).tokens for p in PROMPTS]
    assert len(set(base[1])) > 10  # varied output
    accepted = 0
    for p, ref in zip(PROMPTS, base):
        med = generate(cfg, params, p, max_new_tokens=n, heads=heads, tree=tree, progress=False)
        assert med.tokens == ref
        accepted += n - med.steps
    assert accepted > 0
    dev = generate_device(cfg, params, PROMPTS, max_new_tokens=n, heads=heads, tree=tree, progress=False)
    for b, ref in enumerate(base):
        assert dev.tokens[b, :int(dev.count[b])].tolist() == ref
    batch = dict(generate_batch(cfg, params, PROMPTS, batch_size=2, max_new_tokens=n, heads=heads, tree=tree,
                                progress=False))
    assert [batch[i].tokens for i in range(len(PROMPTS))] == base


@pytest.mark.slow
def test_training_and_export_on_qwen3(tiny_qwen3, tmp_path):
    """A frozen (Medusa-1) run and a joint (Medusa-2) run on the Qwen3 backbone: the heads export
    and load back; the joint run's backbone is written as a Qwen3 HF directory (q/k norms included)
    that medusa_jax and transformers load to the same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from medusa_jax.train.config import TrainConfig
    from medusa_jax.convert.medusa_format import load_heads
    from medusa_jax.train import hidden
    from medusa_jax.train import trainer

    cfg, params = tiny_qwen3
    bb = hidden.Backbone(cfg, params, "random")
    tiny_yaml = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
    common = ("synthetic_num_sequences=64", "steps=4", "eval_every=0", "checkpoint_every=0", "log_every=2",
              "warmup_steps=1", "tree=null", "max_val_positions=256")
    frozen = TrainConfig.from_yaml(tiny_yaml, common + (f"out_dir={tmp_path / 'frozen'}",))
    res = trainer.train(frozen, backbone=bb, progress=False)
    assert res.steps_done == 4 and len(res.metrics["val_top1"]) == frozen.num_heads
    hcfg, hp = load_heads(res.heads_dir, cfg)
    assert hcfg.hidden_size == cfg.hidden_size and set(hp) >= {"blocks_kernel", "blocks_bias"}
    out = generate(cfg, params, PROMPTS[1], max_new_tokens=30, heads=(hcfg, hp),
                   tree=get_tree("chain3", num_heads=hcfg.num_heads), progress=False)
    assert out.tokens == generate(cfg, params, PROMPTS[1], max_new_tokens=30, progress=False).tokens

    joint = TrainConfig.from_yaml(tiny_yaml, common + ("mode=joint", "batch_size=4", "learning_rate=3e-3", "max_kl=100",
                                                       f"out_dir={tmp_path / 'joint'}"))
    res = trainer.train(joint, backbone=bb, progress=False)
    moved = res.backbone_params["layers_0"]["attn"]["q_norm"]["scale"]
    assert not np.array_equal(moved, np.asarray(params["layers_0"]["attn"]["q_norm"]["scale"]))  # trained
    path = os.path.join(joint.out_dir, "backbone")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3"
    saved = load_model(path, with_tokenizer=False)
    assert saved.cfg == cfg
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = random_tokens(cfg, (1, 24), seed=1)
    ours = jax_logits(saved.cfg, saved.params, tokens)
    assert rel_err(ours, jax_logits(cfg, res.backbone_params, tokens)) < 1e-6
    assert rel_err(ours, torch_logits(ref, tokens)) < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next", "gemma3"])
def test_other_architectures_are_still_refused_by_name(tmp_path, model_type):
    """Qwen3's siblings (MoE, Next) and other families stay refused, with their name."""
    from medusa_jax.models.config import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError

    assert "qwen3" in SUPPORTED_ARCHITECTURES
    (tmp_path / "config.json").write_text(json.dumps(dict(qwen3_config(False).to_hf_dict(), model_type=model_type)))
    with pytest.raises(UnsupportedArchitectureError, match=f"unsupported architecture '{model_type}'.*qwen3"):
        load_model(str(tmp_path))
