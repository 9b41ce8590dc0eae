"""A cache of converted models, so that a second run starts in seconds.

Converting a GGUF file means parsing it and dequantizing every tensor (about 12 s for the
135M-parameter default model on this project's 2-core CPU). The converted params, the config
and the tokenizer are stored once under ``~/.cache/medusa_jax/models/<key>/`` (or
``$MEDUSA_JAX_CACHE_DIR/models``) as one ``.npy`` file per parameter (``params/``, listed in
``params.json``; a matrix kept as GGUF blocks, ``load_model(weights="as-stored")``, as its uint8
blocks, the format after a ``#`` in its name), ``model_config.json`` and the tokenizer's own files, and read back on later
runs. The ``.npy`` files are memory-mapped copy-on-write: numpy aligns their data to 64 bytes, so
JAX's CPU backend uses the mapped pages in place instead of copying 0.5 GB (the pages are read
from the OS file cache as they are first touched, and a write never reaches the file). The key covers the file's
absolute path, size and modification time, the params dtype and this module's format version,
so a changed file is converted again. Set ``MEDUSA_JAX_NO_CACHE=1`` to disable the cache. Models
whose converted params would exceed `MAX_CACHE_BYTES` are not cached (a 7B model in float32
would take 28 GB of disk).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Optional, Tuple

import numpy as np

from medusa_jax.kernels import BlockWeight
from medusa_jax.models.config import ModelConfig, RopeScaling

#: Bumped whenever what is stored (or how the converter builds it) changes.
CACHE_FORMAT = 1
#: Converted params larger than this are not cached.
MAX_CACHE_BYTES = 4 << 30
_SEP = "/"
_FMT = "#"  # params/x/kernel_t#q4_1: GGUF blocks of that format (`kernels.BlockWeight`)
#: dtypes that ``.npy`` files store natively (bfloat16 is not one of them: such params are not cached).
_NPY_DTYPES = ("float16", "float32", "float64")


def cache_root() -> Optional[str]:
    """The models cache directory, or None when caching is disabled (``MEDUSA_JAX_NO_CACHE``)."""
    if os.environ.get("MEDUSA_JAX_NO_CACHE"):
        return None
    base = os.environ.get("MEDUSA_JAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "medusa_jax")
    return os.path.join(base, "models")


def cache_key(path: str, dtype, as_stored: bool = False) -> str:
    """A hex key for a model file: absolute path, size, mtime (ns), dtype, whether quantized
    tensors are kept as stored, and `CACHE_FORMAT`."""
    st = os.stat(path)
    kind = np.dtype(dtype).name + ("+as-stored" if as_stored else "")
    ident = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, kind, CACHE_FORMAT])
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _flatten(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if _SEP in str(k):
                raise ValueError(f"param name {k!r} contains {_SEP!r}")
            out.update(_flatten(v, f"{prefix}{k}{_SEP}"))
        return out
    if isinstance(tree, BlockWeight):  # its blocks, the format in the name
        return {f"{prefix[:-1]}{_FMT}{tree.fmt}": np.ascontiguousarray(np.asarray(tree.blocks))}
    return {prefix[:-1]: np.ascontiguousarray(np.asarray(tree))}


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, arr in flat.items():
        *parents, leaf = name.split(_SEP)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        leaf, _, fmt = leaf.partition(_FMT)
        node[leaf] = BlockWeight(arr, fmt) if fmt else arr
    return tree


def config_to_json(cfg: ModelConfig) -> dict:
    """Every field of `cfg` as JSON-ready values (the inverse of `config_from_json`)."""
    return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
    """Rebuild a `ModelConfig` written by `config_to_json` (lists become tuples).

    Raises TypeError / ValueError when the fields no longer match this version's ModelConfig.
    """
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(d) != fields:
        raise TypeError(f"stored config fields {sorted(set(d) ^ fields)} differ from ModelConfig's")
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
    if kw.get("rope_scaling") is not None:
        kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    return ModelConfig(**kw)


def load_cached(path: str, dtype, as_stored: bool = False) -> Optional[Tuple[ModelConfig, dict, str]]:
    """(cfg, params of numpy arrays and `kernels.BlockWeight`, tokenizer directory) from the
    cache, or None on a miss (or an unreadable / stale entry, which is then removed)."""
    root = cache_root()
    if root is None:
        return None
    entry = os.path.join(root, cache_key(path, dtype, as_stored))
    if not os.path.isfile(os.path.join(entry, "complete")):
        return None
    try:
        with open(os.path.join(entry, "model_config.json")) as f:
            cfg = config_from_json(json.load(f))
        with open(os.path.join(entry, "params.json")) as f:
            index = json.load(f)
        params = _unflatten({name: np.load(os.path.join(entry, "params", file), mmap_mode="c")
                             for name, file in index.items()})
        return cfg, params, os.path.join(entry, "tokenizer")
    except Exception:  # a damaged or outdated entry: convert again
        shutil.rmtree(entry, ignore_errors=True)
        return None


def store(path: str, dtype, cfg: ModelConfig, params: dict, tokenizer=None, as_stored: bool = False) -> Optional[str]:
    """Write a converted model to the cache (atomically: a temporary directory renamed into place).

    as_stored: the params hold `kernels.BlockWeight` matrices (a separate entry from the float one).
    Returns the entry's directory, or None when caching is disabled, the dtype is not a native
    numpy float, the params exceed `MAX_CACHE_BYTES`, or the cache directory cannot be written (the run goes on uncached).
    """
    root = cache_root()
    if root is None or np.dtype(dtype).name not in _NPY_DTYPES:
        return None
    flat = _flatten(params)
    if sum(a.nbytes for a in flat.values()) > MAX_CACHE_BYTES:
        return None
    entry = os.path.join(root, cache_key(path, dtype, as_stored))
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
        os.makedirs(os.path.join(tmp, "params"))
        index = {name: f"{i:05d}.npy" for i, name in enumerate(flat)}
        for name, file in index.items():
            np.save(os.path.join(tmp, "params", file), flat[name])
        with open(os.path.join(tmp, "params.json"), "w") as f:
            json.dump(index, f)
        with open(os.path.join(tmp, "model_config.json"), "w") as f:
            json.dump(config_to_json(cfg), f)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"path": os.path.abspath(path)}, f)
        open(os.path.join(tmp, "complete"), "w").close()
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        return entry
    except OSError:  # a read-only or full disk: run uncached
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
