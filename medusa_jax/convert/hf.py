"""Hugging Face checkpoint directory (config.json + safetensors, sharded or not) -> (ModelConfig, params).

The name mapping (`params_from_hf_tensors`) is shared with the GGUF converter, which first renames
GGUF tensors to these HF names. Every tensor must be mapped, present and of the expected shape;
anything else raises `ConversionError` naming the tensor.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file as _save_file

from medusa_jax.kernels import BlockWeight
from medusa_jax.models.config import ModelConfig


class ConversionError(ValueError):
    """A checkpoint that cannot be converted: missing, unmapped or mis-shaped tensor, bad file."""


def save_file(tensors: Dict[str, np.ndarray], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    """`safetensors.numpy.save_file`, leaving the file readable as any file this process creates (0666
    less the umask): safetensors writes it 0600, so another account (a vLLM service's, say) could not
    read exported heads."""
    _save_file(tensors, path, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def expected_hf_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> torch shape ([out, in] for linear weights) for every tensor of `cfg`."""
    D, V, F = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:  # Qwen3: one RMSNorm weight per head dimension, shared by the heads
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return shapes


_LAYER_MAP = {
    "self_attn.q_proj": ("attn", "q_proj"), "self_attn.k_proj": ("attn", "k_proj"),
    "self_attn.v_proj": ("attn", "v_proj"), "self_attn.o_proj": ("attn", "o_proj"),
    "mlp.gate_proj": ("mlp", "gate_proj"), "mlp.up_proj": ("mlp", "up_proj"),
    "mlp.down_proj": ("mlp", "down_proj"),
}


def param_path(name: str, cfg: ModelConfig):
    """HF tensor name -> (path of keys in the `LlamaModel` params tree, transpose?): e.g.
    ``model.layers.3.self_attn.q_proj.weight`` -> (("layers_3", "attn", "q_proj", "kernel"), True)
    (torch [out, in] -> flax [in, out]). Raises KeyError for a name it does not map."""
    if name == "model.embed_tokens.weight":
        return ("embed", "embedding"), False
    if name == "model.norm.weight":
        return ("norm", "scale"), False
    if name == "lm_head.weight":
        return ("lm_head", "kernel"), True
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        layer = f"layers_{int(parts[2])}"
        rest = ".".join(parts[3:])
        if rest == "input_layernorm.weight":
            return (layer, "input_norm", "scale"), False
        if rest == "post_attention_layernorm.weight":
            return (layer, "post_attn_norm", "scale"), False
        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):  # Qwen3
            return (layer, "attn", rest.split(".")[1], "scale"), False
        mod, leaf = rest.rsplit(".", 1)
        if mod in _LAYER_MAP:
            return (layer, *_LAYER_MAP[mod], "kernel" if leaf == "weight" else "bias"), leaf == "weight"
    raise KeyError(name)


def params_from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float32,
                           source: str = "checkpoint") -> dict:
    """Map HF-named tensors to the `LlamaModel` params tree.

    Args:
      cfg: the model config the tensors must match.
      tensors: HF name -> array in torch layout (linear weights [out, in]), or a
        `kernels.BlockWeight` (GGUF blocks, [out, in]), kept as it is: a linear weight's under
        ``kernel_t`` (the decoding layout, `models.layout.decoding_params`), the embedding's under
        ``embedding``.
      dtype: numpy dtype of the returned leaves.
      source: named in error messages.
    Raises:
      ConversionError: a tensor that is unmapped, missing or of the wrong shape.
    A tied model may carry an ``lm_head.weight`` equal to the embedding; it is ignored (`load_hf`
    unties a config whose stored head differs from the embedding, as transformers then uses it).
    """
    expected = expected_hf_shapes(cfg)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unmapped = [n for n in tensors if n not in expected and n not in ignorable
                and not n.endswith("rotary_emb.inv_freq")]
    if unmapped:
        if all(f"model.{n}" in expected for n in unmapped):  # e.g. "embed_tokens.weight"
            raise ConversionError(f"{source}: the tensors are named {sorted(unmapped)[0]!r}, ... without the "
                                  "'model.' prefix: this is a base model without its language-model head "
                                  f"(saved from {cfg.arch.capitalize()}Model); decoding needs the ...ForCausalLM "
                                  "checkpoint")
        raise ConversionError(f"{source}: unmapped tensor(s) {sorted(unmapped)[:8]} for a {cfg.arch} model "
                              f"with {cfg.num_layers} layers; is the config right?")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ConversionError(f"{source}: missing tensor(s) {missing[:8]} ({len(missing)} in all); "
                              "the checkpoint is incomplete or truncated")
    params: dict = {}
    for name, shape in expected.items():
        arr = tensors[name]
        arr = arr if isinstance(arr, BlockWeight) else np.asarray(arr)
        if tuple(arr.shape) != shape:
            raise ConversionError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, expected {shape} "
                                  f"from the config")
        path, transpose = param_path(name, cfg)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if isinstance(arr, BlockWeight):  # kept as blocks, in the [out, in] layout of decoding
            node[path[-1] + ("_t" if transpose else "")] = arr
        else:
            node[path[-1]] = np.ascontiguousarray(arr.T if transpose else arr).astype(dtype)
    return params


def layer_prefix(i: int) -> str:
    """The HF name prefix of decoder layer `i`'s tensors: ``model.layers.{i}.``."""
    return f"model.layers.{int(i)}."


def hf_tensors_from_params(cfg: ModelConfig, params: Mapping,
                           layers: Optional[Iterable[int]] = None) -> Dict[str, np.ndarray]:
    """The inverse of `params_from_hf_tensors`: HF name -> float32 numpy array in torch layout
    (linear weights [out, in]).

    Args:
      cfg: the model's config; params: its `LlamaModel` params tree (numpy or jax arrays, any float
        dtype; ``kernel`` layout, as `load_model` gives, not `decoding_params`' ``kernel_t``).
      layers: only the tensors of these decoder layers (names ``model.layers.{i}.*``), e.g. the
        layers Medusa-2 tuned (`convert.tuned_layers`); None: every tensor of the model.
    Raises KeyError for a params tree without a tensor the config expects.
    """
    prefixes = None if layers is None else tuple(layer_prefix(i) for i in layers)
    out = {}
    for name in expected_hf_shapes(cfg):
        if prefixes is not None and not name.startswith(prefixes):
            continue
        path, transpose = param_path(name, cfg)
        node = params
        for key in path:
            node = node[key]
        arr = np.asarray(node, dtype=np.float32)
        out[name] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def safetensors_files(path: str) -> Iterable[str]:
    """The safetensors files of an HF directory: its shard index's, else model.safetensors, else
    every ``*.safetensors`` in it. Raises ConversionError when there is none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, fn) for fn in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        bins = [fn for fn in os.listdir(path) if fn.endswith((".bin", ".pt", ".pth"))]
        found = f" (only {', '.join(sorted(bins)[:3])}: PyTorch pickles, which this loader does not read)" if bins else ""
        raise ConversionError(f"{path}: no model.safetensors, no model.safetensors.index.json and no "
                              f"*.safetensors file{found}; save the model as safetensors, e.g. with transformers: "
                              "AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)")
    return [os.path.join(path, fn) for fn in files]


def load_hf_config(path: str) -> ModelConfig:
    """Read ``config.json`` in an HF directory. Raises FileNotFoundError or ConversionError."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{cfg_path}: not valid JSON ({e})") from e
    return ModelConfig.from_hf_dict(raw, source=cfg_path)


def load_hf(path: str, dtype=np.float32) -> Tuple[ModelConfig, dict]:
    """Load an HF Llama/Mistral/Qwen2/Qwen3 directory into (ModelConfig, params of numpy arrays).

    Args:
      path: a directory with config.json and model.safetensors (or a sharded index).
      dtype: numpy dtype of the params (float32 by default; bf16 tensors are upcast).
    Raises:
      FileNotFoundError: no such directory or no config.json.
      UnsupportedArchitectureError: model_type not llama/mistral/qwen2/qwen3.
      ConversionError: no safetensors, a corrupt file, or an unmapped/missing/mis-shaped tensor.
    """

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory")
    cfg = load_hf_config(path)
    tensors: Dict[str, np.ndarray] = {}
    for fn in safetensors_files(path):
        if not os.path.exists(fn):
            raise ConversionError(f"{fn}: listed in the shard index but missing")
        try:
            with safe_open(fn, framework="numpy") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            if isinstance(e, ConversionError):
                raise
            raise ConversionError(f"{fn}: cannot read safetensors file ({e}); it may be truncated "
                                  "or corrupted") from e
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not np.array_equal(head, embed):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # a head of its own: transformers uses it
    return cfg, params_from_hf_tensors(cfg, tensors, dtype=dtype, source=path)


#: transformers' causal-LM class of each architecture, written as config.json's ``architectures``
#: (vLLM and other loaders read it; transformers itself goes by ``model_type``).
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


def save_hf(path: str, cfg: ModelConfig, params: Mapping, tokenizer: Any = None) -> str:
    """Write a Hugging Face model directory that `load_hf` and transformers'
    ``AutoModelForCausalLM.from_pretrained(path)`` read: ``config.json`` (``cfg.to_hf_dict()`` plus
    ``architectures``), ``model.safetensors`` (every tensor, float32, torch layout, one file) and,
    when `tokenizer` is given, its files (``tokenizer.save_pretrained``).

    Args:
      path: the directory (created when missing; files of those names in it are replaced).
      cfg: the model's config; params: its `LlamaModel` params tree (any float dtype; written as
        float32, so a float32 model round-trips exactly).
      tokenizer: a transformers tokenizer, or None (no tokenizer files).
    Returns: `path`.
    Raises:
      ValueError: a config transformers cannot express (`ModelConfig.to_hf_dict`).
      OSError: the directory cannot be written.
    """
    hf_cfg = cfg.to_hf_dict()  # before writing anything: it raises for an inexpressible layout
    hf_cfg.setdefault("architectures", [HF_ARCHITECTURES[cfg.arch]] if cfg.arch in HF_ARCHITECTURES else None)
    if hf_cfg["architectures"] is None:
        del hf_cfg["architectures"]
    os.makedirs(path, exist_ok=True)
    save_file(hf_tensors_from_params(cfg, params), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
