"""Medusa-2's tuned backbone layers: the top decoder layers trained jointly with the heads, saved
beside the heads as `LAYERS_FILE`, put into the base model when it loads (`apply_tuned_layers`) or
merged into a whole Hugging Face directory (`merge_to_hf`).

The file is a safetensors file of float32 tensors in HF naming and torch layout
(``model.layers.{i}.self_attn.q_proj.weight`` [out, in], ...), every tensor of the listed layers and
nothing else. Its safetensors metadata holds, under ``"medusa_jax"``, a JSON object::

    {"format_version": 1, "base_model": "SmolLM2-135M-Instruct.Q4_1.gguf",   # a name, not a path
     "arch": "llama", "num_layers": 30, "hidden_size": 576, "vocab_size": 49152,
     "layers": [28, 29],
     "base_sha256": "...",   # the base model's same tensors, float32 (`tensors_sha256`)
     "sha256": "...",        # the stored (tuned) tensors, float32
     "sha256_by_dtype": {"bfloat16": {"base": "...", "tuned": "..."}, "float16": {...}}}

``sha256_by_dtype`` holds the same checksums over the tensors rounded to a lower compute dtype, so a
base loaded with ``--dtype bfloat16`` is checked too. Applying checks the architecture, the stored
tensors against ``sha256`` (a corrupt file), and the base's layers against ``base_sha256`` (layers
tuned from another base); a model whose layers already are the tuned ones (a merged model) is
returned as it is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from medusa_jax.convert.gguf import gguf_config, open_gguf
from medusa_jax.convert.hf import (ConversionError, expected_hf_shapes, hf_tensors_from_params, layer_prefix,
                                   load_hf_config, param_path, safetensors_files, save_file, save_hf)
from medusa_jax.convert.load import LoadedModel, check_model_path
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import compute_dtype

#: The tuned layers' file name inside a heads directory.
LAYERS_FILE = "backbone_layers.safetensors"

#: The safetensors metadata key of the JSON description.
META_KEY = "medusa_jax"

FORMAT_VERSION = 1

#: Lower compute dtypes whose rounded checksums the file also stores (``sha256_by_dtype``).
LOW_DTYPES = ("bfloat16", "float16")

_FIELDS = {"base_model": str, "arch": str, "num_layers": int, "hidden_size": int, "vocab_size": int,
           "layers": list, "base_sha256": str, "sha256": str}

_REEXPORT = "re-export it from the training run (or delete it to decode with the base model's own layers)"


class TunedLayersError(ConversionError):
    """A tuned-layers file that cannot be used: corrupt, malformed, for another architecture, or
    tuned from another base model. A ValueError; the message is one line naming the file."""


def format_layers(layers: Sequence[int]) -> str:
    """Layer indices as text for messages: [28, 29] -> "28-29", [3] -> "3", [1, 3, 4] -> "1, 3-4"."""
    runs: List[List[int]] = []
    for i in sorted(int(x) for x in layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def tensors_sha256(tensors: Mapping[str, np.ndarray], dtype="float32") -> str:
    """SHA-256 hex digest of tensors: over their sorted names, each name, its shape and its values
    as little-endian float32 bytes, after rounding to `dtype` ("float32", "bfloat16" or "float16";
    rounding is idempotent, so tensors already of that precision hash the same)."""
    dt = jnp.dtype(dtype)
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if dt != np.float32:
            a = a.astype(np.float32).astype(dt)
        a = np.ascontiguousarray(a, dtype="<f4")
        h.update(f"{name}{tuple(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _layer_names(cfg: ModelConfig, layers: Sequence[int]) -> Dict[str, tuple]:
    """HF name -> torch shape of every tensor of decoder layers `layers` of `cfg`."""
    prefixes = tuple(layer_prefix(i) for i in layers)
    return {n: s for n, s in expected_hf_shapes(cfg).items() if n.startswith(prefixes)}


def _check_layers(layers, num_layers: int, what: str) -> List[int]:
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= int(i) < num_layers:
            raise ValueError(f"{what}: layer {i!r} is not a decoder layer index in [0, {num_layers})")
        out.append(int(i))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"{what}: layers must be a non-empty list of distinct indices, got {list(layers)}")
    return sorted(out)


def save_tuned_layers(directory: str, cfg: ModelConfig, base_params, tuned_params, layers: Sequence[int],
                      base_model: str) -> str:
    """Write decoder layers `layers` of `tuned_params` to ``directory/LAYERS_FILE`` (atomically).

    Args:
      directory: the heads directory (created when missing).
      cfg: the backbone's config.
      base_params, tuned_params: `LlamaModel` params trees (numpy or jax arrays, any float dtype;
        ``kernel`` layout) of the base model as loaded (float32, as `load_model` gives by default,
        so that decoding checks it) and of the jointly trained one.
      layers: the decoder layers that were trained, e.g. [28, 29].
      base_model: what the base model is called: a file or directory name (a path is cut to its
        last component, since a machine's paths mean nothing elsewhere).
    Returns: the file's path.
    Raises: ValueError for layers outside [0, num_layers), repeated or none; KeyError for params
      without a tensor of those layers.
    """
    layers = _check_layers(layers, cfg.num_layers, "save_tuned_layers")
    tuned = hf_tensors_from_params(cfg, tuned_params, layers)
    base = hf_tensors_from_params(cfg, base_params, layers)
    base_model = os.path.basename(os.path.normpath(base_model)) or base_model
    meta = {"format_version": FORMAT_VERSION, "base_model": base_model, "arch": cfg.arch,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "layers": layers, "base_sha256": tensors_sha256(base), "sha256": tensors_sha256(tuned),
            "sha256_by_dtype": {d: {"base": tensors_sha256(base, d), "tuned": tensors_sha256(tuned, d)}
                                for d in LOW_DTYPES}}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LAYERS_FILE)
    tmp = path + ".tmp"
    save_file(tuned, tmp, metadata={"format": "pt", META_KEY: json.dumps(meta)})
    os.replace(tmp, path)
    return path


def tuned_layers_path(heads_path: Optional[str]) -> Optional[str]:
    """The tuned-layers file of a heads location, or None when there is none.

    `heads_path`: a heads directory, a file inside one (its weights, its config.json, or
    `LAYERS_FILE` itself), or None / "zero" / a shipped heads name that is not a path (None)."""
    if not heads_path or heads_path == "zero":
        return None
    if os.path.isfile(heads_path):
        if os.path.basename(heads_path) == LAYERS_FILE:
            return heads_path
        heads_path = os.path.dirname(os.path.abspath(heads_path))
    path = os.path.join(heads_path, LAYERS_FILE)
    return path if os.path.isfile(path) else None


def _locate(directory: str) -> str:
    path = tuned_layers_path(directory)
    if path is None:
        raise FileNotFoundError(f"{directory}: no {LAYERS_FILE}; these heads were trained with a frozen backbone "
                                "(Medusa-1): there are no tuned layers to apply")
    return path


def read_tuned_layers(directory: str) -> Optional[dict]:
    """The metadata of the tuned layers in `directory` (a heads directory or a file in it; see
    `tuned_layers_path`), checked for its fields' types; None when there is no `LAYERS_FILE`.

    Raises: TunedLayersError for a file that is not valid safetensors (truncated, corrupt header) or
      whose metadata is missing or malformed."""
    path = tuned_layers_path(directory)
    if path is None:
        return None
    try:
        with safe_open(path, framework="numpy") as f:
            raw = (f.metadata() or {}).get(META_KEY)
    except Exception as e:  # safetensors' own error types for a bad header
        raise TunedLayersError(f"{path}: not a valid safetensors file ({e}); it is truncated or corrupted: "
                               f"{_REEXPORT}") from e
    if raw is None:
        raise TunedLayersError(f"{path}: no {META_KEY!r} metadata: not a file written by medusa_jax's "
                               f"save_tuned_layers; {_REEXPORT}")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TunedLayersError(f"{path}: its {META_KEY!r} metadata is not valid JSON ({e}); {_REEXPORT}") from e
    if not isinstance(meta, dict):
        raise TunedLayersError(f"{path}: its {META_KEY!r} metadata is not a JSON object; {_REEXPORT}")
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise TunedLayersError(f"{path}: format_version {version!r} is newer than this medusa_jax reads "
                               f"({FORMAT_VERSION}); upgrade medusa_jax")
    for key, kind in _FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise TunedLayersError(f"{path}: its metadata's {key!r} is {meta.get(key)!r}, expected a "
                                   f"{kind.__name__}; {_REEXPORT}")
    try:
        meta["layers"] = _check_layers(meta["layers"], meta["num_layers"], f"{path}: its metadata")
    except ValueError as e:
        raise TunedLayersError(f"{e}; {_REEXPORT}") from e
    return meta


def _source_name(cfg_source: Optional[str]) -> str:
    return f"the model {cfg_source}" if cfg_source else "the model"


def check_tuned_layers(directory: str, cfg: ModelConfig, cfg_source: Optional[str] = None,
                       verify: bool = True) -> dict:
    """Check that the tuned layers in `directory` fit a model of config `cfg`, before or after it
    loads: the metadata (`read_tuned_layers`), its architecture, layer count, hidden and vocabulary
    sizes against `cfg`, the file's tensor names and shapes (every tensor of the listed layers and
    nothing else) and, with `verify`, the stored tensors against the metadata's ``sha256``.
    `cfg_source` (the model's path) is named in messages.

    Returns: the metadata, with ``"path"``: the file.
    Raises: FileNotFoundError without `LAYERS_FILE`; TunedLayersError for anything that does not fit.
    """
    path = _locate(directory)
    meta = read_tuned_layers(path)
    got = (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    want = (meta["arch"], meta["num_layers"], meta["hidden_size"], meta["vocab_size"])
    if got != want:
        raise TunedLayersError(
            f"{path}: these layers were tuned for a {want[0]} model with {want[1]} layers, hidden size {want[2]} and "
            f"vocabulary {want[3]} ({meta['base_model']}), but {_source_name(cfg_source)} is a {got[0]} model with "
            f"{got[1]} layers, hidden size {got[2]} and vocabulary {got[3]}; pass --model the base they were "
            f"trained on ({meta['base_model']})")
    expected = _layer_names(cfg, meta["layers"])
    with safe_open(path, framework="numpy") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing:
        raise TunedLayersError(f"{path}: missing tensor(s) {missing[:4]} ({len(missing)} in all) of the layers "
                               f"{format_layers(meta['layers'])} it lists; the file is incomplete: {_REEXPORT}")
    if extra:
        raise TunedLayersError(f"{path}: unexpected tensor(s) {extra[:4]} ({len(extra)} in all): not of the layers "
                               f"{format_layers(meta['layers'])} it lists, or not of a {cfg.arch} model like "
                               f"{_source_name(cfg_source)}; {_REEXPORT}")
    for n, shape in expected.items():
        if shapes[n] != shape:
            raise TunedLayersError(f"{path}: tensor {n} has shape {shapes[n]}, but {_source_name(cfg_source)} "
                                   f"needs {shape}; pass --model the base they were trained on ({meta['base_model']})")
    if verify:
        _read_tensors(path, meta)
    return {**meta, "path": path}


def _read_tensors(path: str, meta: dict) -> Dict[str, np.ndarray]:
    """The stored tensors (float32), checked against the metadata's ``sha256``."""
    try:
        with safe_open(path, framework="numpy") as f:
            tensors = {n: np.asarray(f.get_tensor(n), dtype=np.float32) for n in f.keys()}
    except Exception as e:
        raise TunedLayersError(f"{path}: cannot read its tensors ({e}); it is truncated or corrupted: "
                               f"{_REEXPORT}") from e
    if tensors_sha256(tensors) != meta["sha256"]:
        raise TunedLayersError(f"{path}: its tensors do not match the checksum it was saved with: the file is "
                               f"corrupted; {_REEXPORT}")
    return tensors


def _base_layers_from_hf(model_dir: str, names) -> Dict[str, np.ndarray]:
    """The tensors `names` read from an HF directory's safetensors, as `load_hf` reads them (float32)."""
    out: Dict[str, np.ndarray] = {}
    for fn in safetensors_files(model_dir):
        with safe_open(fn, framework="numpy") as f:
            for n in set(f.keys()) & set(names):
                out[n] = np.asarray(f.get_tensor(n)).astype(np.float32)
    return out


def check_before_load(heads_path: Optional[str], model_path: Optional[str]) -> Optional[dict]:
    """`check_tuned_layers` for the heads at `heads_path` and the model at `model_path`, without
    loading the model: its config is read from config.json or the GGUF metadata, and for an HF
    directory its layers are checked against the metadata's ``base_sha256`` too (a GGUF base is
    checked once it is loaded and dequantized, by `apply_tuned_layers`).

    Args: heads_path: as `tuned_layers_path` takes; model_path: an HF directory, a GGUF file or None
      (the default model).
    Returns: the metadata (with ``"path"``), or None when the heads have no `LAYERS_FILE`.
    Raises: TunedLayersError (see `check_tuned_layers`, and the base check of `apply_tuned_layers`);
      FileNotFoundError / ConversionError from `load.check_model_path` for a bad model path.
    """
    if tuned_layers_path(heads_path) is None:
        return None
    model_path, kind = check_model_path(model_path)
    cfg = load_hf_config(model_path) if kind == "hf" else gguf_config(open_gguf(model_path), source=model_path)[0]
    meta = check_tuned_layers(heads_path, cfg, cfg_source=model_path)
    if kind == "hf":
        base = _base_layers_from_hf(model_path, _layer_names(cfg, meta["layers"]))
        if len(base) == len(_layer_names(cfg, meta["layers"])):  # else load_hf reports what is missing
            _check_base(meta, tensors_sha256(base), meta["base_sha256"], meta["sha256"], model_path, "float32")
    return meta


def _check_base(meta: dict, have: str, base_sum: str, tuned_sum: str, model_path: str, dtype: str) -> bool:
    """True when the model's layers already are the tuned ones, False when they are the base's;
    TunedLayersError otherwise."""
    if have == tuned_sum:
        return True
    if have != base_sum:
        raise TunedLayersError(
            f"{meta['path']}: these layers were tuned from another base model ({meta['base_model']}): layers "
            f"{format_layers(meta['layers'])} of {model_path} ({dtype}) differ from the ones they were trained from; "
            f"pass --model the base they were trained on")
    return False


def _expected_sums(meta: dict, dtype: str, path: str):
    if dtype == "float32":
        return meta["base_sha256"], meta["sha256"]
    sums = (meta.get("sha256_by_dtype") or {}).get(dtype)
    if not isinstance(sums, dict) or not {"base", "tuned"} <= set(sums):
        raise TunedLayersError(f"{path}: holds no {dtype} checksums of its base, so a {dtype} model cannot be "
                               f"checked against it; load the model in float32 (--dtype float32)")
    return sums["base"], sums["tuned"]


def _leaf_paths(tree, prefix=()) -> set:
    if isinstance(tree, Mapping):
        return set().union(*(_leaf_paths(v, prefix + (k,)) for k, v in tree.items())) if tree else set()
    return {prefix}


def _place(new: np.ndarray, old):
    """`new` as a jax array placed like `old` (same devices and sharding when `old` is a jax array)."""
    sharding = getattr(old, "sharding", None)
    return jax.device_put(new, sharding) if sharding is not None else jnp.asarray(new)


def apply_tuned_layers(model: LoadedModel, directory: str) -> LoadedModel:
    """`model` with its decoder layers replaced by the tuned ones in `directory`.

    Args:
      model: a `LoadedModel` as `load_model` gives it (params in float32, bfloat16 or float16, on one
        device or a mesh; ``kernel`` layout).
      directory: a heads directory holding `LAYERS_FILE`, or a file in it (`tuned_layers_path`).
    Returns:
      a new `LoadedModel` whose params are a new top-level dict: the tuned layers' subtrees
      (``layers_{i}``) are new arrays in the model's dtype, placed like the arrays they replace;
      every other subtree is the model's own (shared, not copied). ``tuned_layers`` is the file's
      path. A model whose layers already are the tuned ones (a merged model) comes back with its
      params unchanged (``result.params is model.params``).
    Raises:
      FileNotFoundError: no `LAYERS_FILE` there.
      TunedLayersError: the file is corrupt, malformed or for another architecture (see
        `check_tuned_layers`), or the model's layers are not the base the layers were tuned from.
    """
    meta = check_tuned_layers(directory, model.cfg, cfg_source=model.path, verify=False)
    path = meta["path"]
    tuned = _read_tensors(path, meta)
    dtype = compute_dtype(model.params)
    base_sum, tuned_sum = _expected_sums(meta, dtype.name, path)
    have = tensors_sha256(hf_tensors_from_params(model.cfg, model.params, meta["layers"]), dtype.name)
    if _check_base(meta, have, base_sum, tuned_sum, model.path, dtype.name):
        return dataclasses.replace(model, tuned_layers=path)
    new: dict = {}
    for name, arr in tuned.items():
        keys, transpose = param_path(name, model.cfg)
        node = new
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = np.ascontiguousarray(arr.T if transpose else arr).astype(dtype)
    params = dict(model.params)
    for layer, subtree in new.items():
        old = model.params[layer]
        if _leaf_paths(old) != _leaf_paths(subtree):
            raise TunedLayersError(f"{path}: {layer}'s params in memory are {sorted(_leaf_paths(old))}, the file "
                                   f"gives {sorted(_leaf_paths(subtree))}; apply the layers to the params "
                                   "load_model returns (not decoding_params' layout)")
        params[layer] = jax.tree_util.tree_map(lambda n, o: _place(n, o), subtree, _as_dict(old))
    return dataclasses.replace(model, params=params, tuned_layers=path)


def _as_dict(tree):
    """A Mapping tree as nested dicts (so that its structure matches the new layer's)."""
    return {k: _as_dict(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def merge_to_hf(model: LoadedModel, out_dir: str, overwrite: bool = False) -> str:
    """Write `model` (e.g. with `apply_tuned_layers`' layers) as a whole Hugging Face directory that
    transformers' ``AutoModelForCausalLM.from_pretrained`` and `load_model` read: config.json,
    model.safetensors (float32) and the tokenizer when the model has one (`hf.save_hf`).

    Args:
      model: a `LoadedModel`; out_dir: the directory to write.
      overwrite: write into an `out_dir` that exists and holds files (those of the same names are
        replaced); never the model's own directory or a heads directory.
    Returns: `out_dir`.
    Raises:
      FileExistsError: `out_dir` is a file, or a non-empty directory without `overwrite`.
      ValueError: `out_dir` is the model's own directory or holds Medusa heads or tuned layers (it
        would overwrite them); a config transformers cannot express.
    """
    check_merge_target(out_dir, model.path, overwrite)
    return save_hf(out_dir, model.cfg, model.params, model.tokenizer)


def check_output_dir(out_dir: str, overwrite: bool, source: str, whose: str,
                     forbidden: Tuple[frozenset, str] = (frozenset(), "")) -> None:
    """A directory a command writes into, checked before any slow work: `source` (`whose`: e.g. "the
    base model's") is read from, so `out_dir` may not be its own directory; with `forbidden`, a
    (file names, reason) pair, it may not hold those files either; and without `overwrite` it must
    be new or empty (`medusa-merge`, `medusa-export`).

    Raises:
      FileExistsError: `out_dir` is a file, or a non-empty directory without `overwrite`.
      ValueError: `out_dir` is `source`'s own directory, or holds a `forbidden` file.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not a directory; choose a new output directory")
    if os.path.isdir(out_dir):
        if os.path.realpath(out_dir) == os.path.realpath(source):
            raise ValueError(f"{out_dir}: is {whose} own directory; writing there would overwrite it: "
                             "choose a new output directory")
        held = set(os.listdir(out_dir))
        if held & forbidden[0]:
            raise ValueError(f"{out_dir}: {forbidden[1]}; choose a new output directory")
        if held and not overwrite:
            raise FileExistsError(f"{out_dir}: exists and is not empty; choose a new output directory (or "
                                  "overwrite it: --overwrite, or overwrite=True)")


def check_merge_target(out_dir: str, model_path: str, overwrite: bool = False) -> None:
    """What `merge_to_hf` checks before it writes into `out_dir` (``medusa-merge`` checks it before
    the slow model load): `model_path` is the base model's file or directory.

    Raises:
      FileExistsError: `out_dir` is a file, or a non-empty directory without `overwrite`.
      ValueError: `out_dir` is the base model's own directory, or holds Medusa heads or tuned layers.
    """
    check_output_dir(out_dir, overwrite, model_path, "the base model's",
                     (frozenset({LAYERS_FILE, "medusa_lm_head.safetensors", "medusa_lm_head.pt"}),
                      "holds Medusa heads or tuned layers, which writing the model there would mix with (or "
                      "overwrite, config.json)"))
