"""Config variants real checkpoints carry, loaded as transformers loads them (its logits are the
reference), or refused with a message that names what is unsupported: a tied config whose file
holds a head of its own, transformers 5's rope_parameters beside an old rope_theta, keys left out
(each family's defaults), bias keys a family ignores, quantized checkpoints; GGUF per-layer arrays
and split files."""
import json

import numpy as np
import pytest
from conftest import jax_logits, llama3_rope_scaling, random_hf_model, random_tokens, tiny_config, torch_logits
from test_convert import write_gguf

from medusa_jax.convert.hf import ConversionError, load_hf
from medusa_jax.convert.load import load_model
from medusa_jax.models.config import UnsupportedArchitectureError


def saved(tmp_path, cfg, edit):
    """A random `cfg` model saved as transformers saves it, its config.json changed by `edit`;
    (transformers' own load of that directory, the directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    model, _ = random_hf_model(cfg)
    d = tmp_path / "model"
    model.save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return ref, str(d)


def same_logits(ref, path):
    cfg, params = load_hf(path)
    tokens = random_tokens(cfg, (1, 12))
    np.testing.assert_allclose(jax_logits(cfg, params, tokens), torch_logits(ref, tokens), atol=1e-4)
    return cfg


VARIANTS = [
    ("tied config, the file's own lm_head", "llama", {}, lambda c: c.update(tie_word_embeddings=True)),
    ("rope_parameters and a different top-level rope_theta", "llama", {},
     lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=1e6)),
    ("mistral without num_key_value_heads (8)", "mistral", dict(num_heads=8, num_kv_heads=8, head_dim=8),
     lambda c: c.pop("num_key_value_heads")),
    ("qwen2 with attention_bias false (its q/k/v biases are always there)", "qwen2", {},
     lambda c: c.update(attention_bias=False)),
    ("mistral with attention_bias true (it has none)", "mistral", {}, lambda c: c.update(attention_bias=True)),
    ("qwen2 with num_key_value_heads null (one per query head)", "qwen2", dict(num_heads=8, num_kv_heads=8, head_dim=8),
     lambda c: c.update(num_key_value_heads=None)),
    ("qwen3 with num_key_value_heads null (one per query head)", "qwen3", dict(num_heads=8, num_kv_heads=8, head_dim=8),
     lambda c: c.update(num_key_value_heads=None)),
    ("llama3 RoPE without original_max_position_embeddings (the context's)", "llama",
     dict(max_position_embeddings=64, rope_scaling=llama3_rope_scaling()), lambda c: [
         d.pop("original_max_position_embeddings") for d in (c.get("rope_scaling"), c.get("rope_parameters"))
         if isinstance(d, dict) and "original_max_position_embeddings" in d]),
]


@pytest.mark.slow
@pytest.mark.parametrize("what,arch,kw,edit", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_config_variants_load_as_transformers_loads_them(tmp_path, what, arch, kw, edit):
    ref, path = saved(tmp_path, tiny_config(arch, **kw), edit)
    same_logits(ref, path)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_left_out_context_length_is_the_familys_default(tmp_path, arch):
    from transformers import AutoConfig

    ref, path = saved(tmp_path, tiny_config(arch), lambda c: c.pop("max_position_embeddings"))
    cfg, _ = load_hf(path)
    assert cfg.max_position_embeddings == AutoConfig.from_pretrained(path).max_position_embeddings


def test_unsupported_rope_and_pickled_weights_are_refused_with_what_to_do(tmp_path):
    _, path = saved(tmp_path, tiny_config(), lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match=r"config.json: RoPE scaling 'yarn' .* is not supported; supported: llama3"):
        load_hf(path)
    c = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(c, rope_scaling=None)))
    (tmp_path / "model" / "model.safetensors").rename(tmp_path / "model" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"only pytorch_model.bin: PyTorch pickles.*save_pretrained"):
        load_hf(path)


def test_a_quantized_checkpoint_is_refused_by_name(tmp_path):
    _, path = saved(tmp_path, tiny_config(), lambda c: None)
    c = json.loads(open(f"{path}/config.json").read())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    open(f"{path}/config.json", "w").write(json.dumps(c))
    with pytest.raises(UnsupportedArchitectureError, match="quantization_config \\(a 'fp8'-quantized checkpoint"):
        load_hf(path)


def _gguf_with(tmp_path, monkeypatch, patch):
    """A tiny llama GGUF written with `patch(writer)` applied after its name."""
    import gguf
    from conftest import hf_state_dict

    cfg = tiny_config()
    model, _ = random_hf_model(cfg)
    name = gguf.GGUFWriter.add_name

    def add_name(self, value):
        name(self, value)
        patch(self, cfg)
    monkeypatch.setattr(gguf.GGUFWriter, "add_name", add_name)
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, hf_state_dict(model))
    return model, str(path)


def test_gguf_per_layer_arrays_and_split_files(tmp_path, monkeypatch):
    import gguf

    def kv_array(values):
        def patch(w, cfg):  # written before write_gguf's own scalar, which the writer then refuses to repeat
            w.add_array(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=w.arch), values)
            monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda self, n: None)
        return patch

    model, path = _gguf_with(tmp_path, monkeypatch, kv_array([2, 2]))  # uniform: one value for all layers
    loaded = load_model(path, with_tokenizer=False)
    tokens = random_tokens(loaded.cfg, (1, 10))
    np.testing.assert_allclose(jax_logits(loaded.cfg, loaded.params, tokens), torch_logits(model, tokens), atol=1e-4)
    monkeypatch.undo()
    _, path = _gguf_with(tmp_path / "b", monkeypatch, kv_array([2, 4]))
    with pytest.raises(ConversionError, match=r"head_count_kv differs between layers \(\[2, 4\]\)"):
        load_model(path, with_tokenizer=False)
    monkeypatch.undo()
    _, path = _gguf_with(tmp_path / "c", monkeypatch,
                         lambda w, cfg: (w.add_uint16("split.count", 3), w.add_uint16("split.no", 0)))
    with pytest.raises(ConversionError, match="part 1 of a GGUF split into 3 files; merge them"):
        load_model(path, with_tokenizer=False)
