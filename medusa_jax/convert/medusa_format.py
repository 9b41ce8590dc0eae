"""Medusa head files: load the official and vLLM formats, save ours, export to both.

Formats (docs/design-notes.md, "Head file formats"):

* Official (FasterDecoding/Medusa, ``medusa/model/medusa_model.py``): a directory with
  ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and
  ``medusa_lm_head.pt`` or ``medusa_lm_head.safetensors``, the state dict of
  ``ModuleList[Sequential(ResBlock * L, Linear(D, V, bias=False))]``::

      {h}.{l}.linear.weight  [D, D]  torch [out, in]
      {h}.{l}.linear.bias    [D]     (optional here: a missing bias loads as zeros)
      {h}.{L}.weight         [V, D]  head h's lm_head; absent in the shared variant
                                     (config ``"version": "2"``), which uses the base lm_head

  The head and layer counts come from the keys; config.json may say fewer heads (first-release hub
  configs say 2 where the weights hold 5) but no other count (see `load_heads`).
* vLLM (``vllm/model_executor/models/medusa.py``): ``config.json`` with ``model_type: "medusa"``,
  ``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``,
  ``medusa_fc_bias`` (the blocks have a bias only when true); weights ``blocks.{h}.layers.{l}.weight
  | bias`` and ``lm_heads.{h}.weight`` (or one ``lm_head.weight`` when ``original_lm_head``), and
  with ``truncated_vocab_size`` N < ``vocab_size`` a ``token_map`` [N] of the token ids the heads
  score (their lm_heads [N, D] or [V, D]): our proposal vocabulary.
* Ours (`save_heads`): the official safetensors format plus ``medusa_choices``, ``topk``,
  ``shared_lm_head``, optionally ``proposal_token_ids`` (the tokens the heads may propose; see
  `MedusaConfig.proposal_vocab_size`) and free extra fields (metrics, training info) in ``config.json``.
  Hydra heads (``"head_type": "hydra"``, `medusa_jax.heads.hydra`; Ankner et al. 2024) add, per head h,
  the weights of their first block that read the path's token embeddings::

      hydra.{h}.path_linear.weight    [D, (h+1)*D]  torch [out, in]; in = [e(x_{t+1}) ; ... ; e(x_{t+h+1})]
      hydra.{h}.path_residual.weight  [D, (h+1)*D]  the same inputs into the residual stream

  (the reference code's first-block ``linear`` and ``res_connection`` over ``[h_t ; e ...]`` without
  their h_t columns, which are ``{h}.0.linear.weight`` and the identity). The official and vLLM
  formats have no place for them: exporting hydra heads there is refused.

Params are the `medusa_jax.heads.medusa.MedusaHeads` layout (kernels [in, out]); files hold torch's
[out, in]. ``.pt`` files are read with ``torch.load(weights_only=True)`` only, and torch is imported
only for ``.pt`` files. Safetensors are parsed here (header checked against the file size) so that
bf16 files load without torch and truncated files fail with `HeadsFormatError`.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
from safetensors import safe_open

from medusa_jax.convert.hf import ConversionError, save_file
from medusa_jax.heads.config import HEAD_TYPES, MedusaConfig
from medusa_jax.heads.hydra import PATH_KERNEL, PATH_RESIDUAL, check_path_params
from medusa_jax.heads.medusa import check_heads_match, heads_params_to_numpy
from medusa_jax.models.config import ModelConfig

OFFICIAL_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_FILES = OFFICIAL_FILES + VLLM_FILES
OUR_KEYS = ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path", "hidden_size",
             "vocab_size", "version", "medusa_choices", "topk", "shared_lm_head", "proposal_token_ids", "head_type")
_HYDRA_RE = re.compile(r"^hydra\.(\d+)\.(path_linear|path_residual)\.weight$")


class HeadsFormatError(ConversionError):
    """A Medusa head file that cannot be read: corrupt or truncated, unknown or inconsistent tensors."""


# ---------------------------------------------------------------------------------------- reading

def _read_safetensors(fn: str, dtype) -> Dict[str, np.ndarray]:
    """Read a .safetensors file (through the safetensors library) into name -> array; float tensors
    (bf16 included) are cast to `dtype`. A truncated or corrupt file raises HeadsFormatError."""

    try:
        with safe_open(fn, framework="numpy") as f:
            raw = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own types for a bad header or short data
        raise HeadsFormatError(f"{fn}: not a valid safetensors file ({e}); it is truncated or corrupted "
                               "(re-download or re-export it)") from e
    return {name: (a.astype(dtype) if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16" else a)
            for name, a in raw.items()}


def _read_pt(fn: str, dtype) -> Dict[str, np.ndarray]:
    """Read a torch state dict with ``torch.load(map_location="cpu", weights_only=True)``."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{fn}: reading a .pt head file needs torch (pip install torch); or convert "
                          "it once to medusa_lm_head.safetensors where torch is installed") from e
    try:
        sd = torch.load(fn, map_location="cpu", weights_only=True)
    except Exception as e:
        raise HeadsFormatError(f"{fn}: cannot read the .pt file ({type(e).__name__}: {e}); it is truncated, "
                               "corrupted, or holds more than tensors (only weights_only loading is allowed)") from e
    if not isinstance(sd, Mapping):
        raise HeadsFormatError(f"{fn}: expected a state dict (name -> tensor), got {type(sd).__name__}")
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise HeadsFormatError(f"{fn}: entry {k!r} is a {type(v).__name__}, not a tensor")
        v = v.detach().cpu()
        out[k] = (v.float().numpy().astype(dtype) if v.is_floating_point() else v.numpy())
    return out


def read_tensors(fn: str, dtype=np.float32) -> Dict[str, np.ndarray]:
    """Read a .safetensors, .pt or .bin weight file into name -> numpy array (floats as `dtype`)."""
    if fn.endswith(".safetensors"):
        return _read_safetensors(fn, dtype)
    if fn.endswith((".pt", ".bin", ".pth")):
        return _read_pt(fn, dtype)
    raise HeadsFormatError(f"{fn}: unknown weight file type; expected .safetensors or .pt")


def _resolve(path: str) -> Tuple[str, Optional[str]]:
    """path (directory or weight file) -> (weight file, config.json or None)."""
    expected = (f"a Medusa heads directory (config.json + {' or '.join(OFFICIAL_FILES)}; vLLM: "
                f"{' or '.join(VLLM_FILES)}) or one of those weight files")
    if os.path.isdir(path):
        for name in WEIGHT_FILES:
            if os.path.isfile(os.path.join(path, name)):
                cfg = os.path.join(path, "config.json")
                return os.path.join(path, name), (cfg if os.path.isfile(cfg) else None)
        inside = sorted(d for d in os.listdir(path) if any(os.path.isfile(os.path.join(path, d, name))
                                                           for name in WEIGHT_FILES))
        hint = f" (a training run's directory? its heads are in {os.path.join(path, inside[0])})" if inside else ""
        raise FileNotFoundError(f"{path}: no Medusa head weights found; expected {expected}{hint}")
    if os.path.isfile(path):
        cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
        return path, (cfg if os.path.isfile(cfg) else None)
    raise FileNotFoundError(f"{path}: no such file or directory; expected {expected}")


def _read_config(fn: Optional[str]) -> dict:
    if fn is None:
        return {}
    try:
        with open(fn) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadsFormatError(f"{fn}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise HeadsFormatError(f"{fn}: expected a JSON object")
    return raw


_OFFICIAL_RE = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_VLLM_RE = re.compile(r"^(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)|lm_heads\.(\d+)\.weight|lm_head\.weight|token_map)$")


#: Module prefixes a head file may carry on every name (the original ``MedusaModel.medusa_head``,
#: vLLM's ``medusa_heads``); names are read with it removed.
NAME_PREFIXES = ("medusa_heads.", "medusa_head.")


def _normalise_names(tensors: Mapping[str, np.ndarray],
                     source: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Remove a `NAME_PREFIXES` prefix from every name.

    Returns (canonical name -> array, canonical name -> the name in the file). Raises HeadsFormatError,
    naming both, when two names of the file become the same parameter (e.g. ``0.0.linear.weight`` and
    ``medusa_head.0.0.linear.weight``): which one the file means cannot be told.
    """
    out: Dict[str, np.ndarray] = {}
    origin: Dict[str, str] = {}
    for name, arr in tensors.items():
        key = next((name[len(p):] for p in NAME_PREFIXES if name.startswith(p)), name)
        if key in out:
            raise HeadsFormatError(f"{source}: tensors {origin[key]!r} and {name!r} are the same parameter "
                                   f"{key!r}; the file is ambiguous: keep one of them (delete the other) and "
                                   "save the file again")
        out[key], origin[key] = arr, name
    return out, origin


def _group(tensors, source: str, vllm: bool, origin: Mapping[str, str]):
    """Sort tensors into weights[h][l], biases[h][l], lm[h]. Unknown names, and two names for one
    head's lm_head, raise HeadsFormatError (naming the tensors as the file spells them)."""
    weights, biases, lm, shared_lm = {}, {}, {}, None
    for name, arr in tensors.items():
        if vllm:
            m = _VLLM_RE.match(name)
            if m and m.group(1) is not None:
                h, l, kind = int(m.group(1)), int(m.group(2)), m.group(3)
                (weights if kind == "weight" else biases).setdefault(h, {})[l] = arr
                continue
            if m and m.group(4) is not None:
                lm[int(m.group(4))] = arr
                continue
            if name == "lm_head.weight":
                shared_lm = arr
                continue
            if name == "token_map":
                continue  # checked against truncated_vocab_size by the caller
        else:
            m = _OFFICIAL_RE.match(name)
            if m:
                h, l, kind = int(m.group(1)), int(m.group(2)), m.group(3)
                target = {"linear.weight": weights, "linear.bias": biases, "weight": lm}[kind]
                if kind == "weight":
                    if h in lm:
                        raise HeadsFormatError(
                            f"{source}: head {h} has two lm_head weights, {origin[f'{h}.{lm[h][0]}.weight']!r} and "
                            f"{origin[name]!r}; keep the one whose middle index is the head's block count")
                    lm[h] = (l, arr)
                else:
                    target.setdefault(h, {})[l] = arr
                continue
        fmt = "vLLM (blocks.{h}.layers.{l}.weight|bias, lm_heads.{h}.weight)" if vllm else \
            "official ({h}.{l}.linear.weight|bias, {h}.{L}.weight)"
        raise HeadsFormatError(f"{source}: unexpected tensor {origin[name]!r} for the {fmt} Medusa format")
    if shared_lm is not None and lm:
        raise HeadsFormatError(
            f"{source}: holds both {origin['lm_head.weight']!r} (one projection for every head) and per-head "
            f"{', '.join(repr(origin[f'lm_heads.{h}.weight']) for h in sorted(lm))}; the file is ambiguous: keep "
            "one kind (delete the other)")
    return weights, biases, lm, shared_lm


def _config_count(raw: dict, key: str, source: str) -> Optional[int]:
    """config.json's integer field `key`, or None when absent. Raises HeadsFormatError when it is not a
    non-negative integer."""
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise HeadsFormatError(f"{source}: config.json's {key} must be a non-negative integer, got {v!r}")
    return v


def _check_counts(raw: dict, vllm: bool, K: int, L: int, source: str) -> None:
    """The head and layer counts of config.json against those of the tensors (see `load_heads`).

    Raises HeadsFormatError, naming both numbers, when the layer counts differ or config.json says
    more heads than the file holds. Fewer heads in config.json is the first-release hub quirk and
    is accepted (the tensors' count wins).
    """
    heads_key, layers_key = ("num_heads", "num_hidden_layers") if vllm else ("medusa_num_heads", "medusa_num_layers")
    cfg_k, cfg_l = _config_count(raw, heads_key, source), _config_count(raw, layers_key, source)
    if cfg_l is not None and cfg_l != L:
        raise HeadsFormatError(f"{source}: config.json says {layers_key}={cfg_l} but the tensors hold {L} block "
                               f"layer(s) per head; the weight file does not belong to this config.json "
                               "(or is incomplete): re-export or re-download the heads")
    if cfg_k is not None and cfg_k > K:
        raise HeadsFormatError(f"{source}: config.json says {heads_key}={cfg_k} but the tensors hold {K} head(s); "
                               "the weight file is incomplete or belongs to other heads: re-export or re-download them")


def _assemble(tensors, raw: dict, source: str, vllm: bool, model_cfg: Optional[ModelConfig],
              origin: Mapping[str, str]):
    """Tensors (torch layout) -> (K, L, D, V, kernels [K,L,D,D] [in,out], biases [K,L,D], lm [K,D,V] | None)."""
    weights, biases, lm, shared_lm = _group(tensors, source, vllm, origin)
    heads = sorted(set(weights) | set(biases) | set(lm))
    if heads and heads != list(range(len(heads))):
        raise HeadsFormatError(f"{source}: head indices {heads} are not 0..{len(heads) - 1}")
    if heads:
        K = len(heads)
    else:  # only vLLM's one shared lm_head.weight: zero-layer heads; only the config knows K
        K = _config_count(raw, "num_heads" if vllm else "medusa_num_heads", source)
        if not K:
            raise HeadsFormatError(f"{source}: no head tensors and no head count in config.json")
    layer_sets = {h: sorted(weights.get(h, {})) for h in range(K)}
    L = len(layer_sets[0])
    _check_counts(raw, vllm, K, L, source)
    for h, ls in layer_sets.items():
        if ls != list(range(L)):
            raise HeadsFormatError(f"{source}: head {h} has block weights for layers {ls}, "
                                   f"expected 0..{L - 1} as head 0 has")
        extra = sorted(set(biases.get(h, {})) - set(ls))
        if extra:
            raise HeadsFormatError(f"{source}: head {h} has biases for layers {extra} without weights")
    # lm heads: all or none
    if vllm:
        lm_arrs = [lm.get(h) for h in range(K)]
        if raw.get("original_lm_head") and shared_lm is None and lm.get(0) is not None:
            shared_lm = lm[0]
        if shared_lm is not None:
            lm_arrs = [shared_lm] * K
    else:
        lm_arrs = []
        for h in range(K):
            if h in lm:
                idx, arr = lm[h]
                if idx != L:
                    raise HeadsFormatError(f"{source}: head {h}'s lm_head is {h}.{idx}.weight but the head has "
                                           f"{L} blocks, so it should be {h}.{L}.weight")
                lm_arrs.append(arr)
            else:
                lm_arrs.append(None)
    have = [a is not None for a in lm_arrs]
    if any(have) and not all(have):
        raise HeadsFormatError(f"{source}: only heads {[h for h in range(K) if have[h]]} of {K} have an lm_head")
    has_lm = all(have)

    def size(key, fallback_model):
        v = raw.get(key)
        if v is None and model_cfg is not None:
            v = getattr(model_cfg, fallback_model)
        return None if v is None else int(v)

    D = weights[0][0].shape[-1] if L else (lm_arrs[0].shape[-1] if has_lm else size("hidden_size", "hidden_size"))
    V = lm_arrs[0].shape[0] if has_lm else size("vocab_size", "vocab_size")
    if D is None or V is None:
        raise HeadsFormatError(f"{source}: cannot tell the {'hidden size' if D is None else 'vocabulary size'} "
                               "from the tensors; add hidden_size and vocab_size to config.json or pass model_cfg")
    for key, got in (("hidden_size", D), ("vocab_size", V)):
        if raw.get(key) is not None and int(raw[key]) != got:
            raise HeadsFormatError(f"{source}: config.json says {key}={raw[key]} but the tensors have {got}")
    kern = np.zeros((K, L, D, D), np.float32)
    bias = np.zeros((K, L, D), np.float32)
    for h in range(K):
        for l in range(L):
            w, b = weights[h][l], biases.get(h, {}).get(l)
            if w.shape != (D, D) or (b is not None and b.shape != (D,)):
                raise HeadsFormatError(f"{source}: head {h} block {l}: weight {tuple(w.shape)}, bias "
                                       f"{None if b is None else tuple(b.shape)}; expected ({D}, {D}) and ({D},)")
            kern[h, l] = w.T
            if b is not None:
                bias[h, l] = b
    lm_out = None
    if has_lm:
        lm_out = np.zeros((K, D, V), np.float32)
        for h, arr in enumerate(lm_arrs):
            if arr.shape != (V, D):
                raise HeadsFormatError(f"{source}: head {h} lm_head has shape {tuple(arr.shape)}, expected ({V}, {D})")
            lm_out[h] = arr.T
    return K, L, D, V, kern, bias, lm_out


def read_heads_config(path: str) -> dict:
    """The config.json fields of a heads directory or weight file (ours: also ``metrics``,
    ``training``, ``tree_search``; {} when there is no config.json).
    Raises FileNotFoundError when `path` holds no known weight file, HeadsFormatError for bad JSON."""
    return _read_config(_resolve(path)[1])


def load_heads(path: str, model_cfg: Optional[ModelConfig] = None, num_heads: Optional[int] = None,
               dtype=np.float32) -> Tuple[MedusaConfig, dict]:
    """Load Medusa heads (official .pt / .safetensors, ours, or vLLM) as (MedusaConfig, params).

    Args:
      path: a directory holding config.json and medusa_lm_head.safetensors or medusa_lm_head.pt
        (vLLM: model.safetensors or pytorch_model.bin), or a direct path to such a weight file (a
        config.json beside it is read if present). Safetensors wins when both exist.
      model_cfg: the backbone; when given, hidden size and vocabulary are checked against it (and it
        supplies them when neither the tensors nor config.json do).
      num_heads: keep only the first num_heads heads (tree paths deeper than that are dropped).
      dtype: numpy dtype of the returned params.
    Returns:
      (MedusaConfig, {"blocks_kernel" [K, L, D, D] ([in, out]), "blocks_bias" [K, L, D], and
      "lm_head" [K, D, V] unless the heads share the base lm_head, and for hydra heads (our config's
      ``"head_type": "hydra"``) "path_kernel_k" / "path_residual_k" [k+1, D, D]}), numpy arrays.
      The heads are shared when the file holds no lm_head tensors (official ``"version": "2"``), or
      our config says ``shared_lm_head: true``.
    Head and layer counts: K and L come from the tensor names (a name may carry one
      `NAME_PREFIXES` prefix). config.json's layer count (``medusa_num_layers``; vLLM
      ``num_hidden_layers``) must equal L. Its head count (``medusa_num_heads``; vLLM ``num_heads``)
      may be smaller than K: official files then keep all K (the first-release hub configs of
      FasterDecoding/Medusa say 2 heads where the weights hold 5, and the original code loads them
      all the same), vLLM files the first ``num_heads`` (vLLM builds that many). It may not be
      larger (the file would be missing heads).
    vLLM files are read as vLLM builds them: block biases only with ``medusa_fc_bias: true`` (its
      default is false, and a file's biases are then unused); ``logit_scale`` (a positive factor on
      every head's logits) is accepted and not applied: it leaves each head's ranking, hence its
      drafts, unchanged; a truncated vocabulary (``token_map``, `_vllm_untruncated`) becomes the
      heads' proposal vocabulary, so that they propose the tokens vLLM's would.
    Raises:
      FileNotFoundError: no such path, or a directory without a known weight file.
      HeadsFormatError (a ValueError): corrupt or truncated file; a file with no tensors; unknown or
        mis-shaped tensors; two names for one parameter (e.g. ``0.0.linear.weight`` and
        ``medusa_head.0.0.linear.weight``, or vLLM's ``lm_head.weight`` beside ``lm_heads.{h}.weight``),
        naming both; config.json's layer count != the tensors', or its head count > the tensors'
        (naming both numbers); fewer heads in the file than num_heads; an unknown head_type; hydra path
        weights that are missing or mis-shaped, or present under a config that does not say hydra; a
        vLLM truncated vocabulary without a valid token_map.
      HeadsMismatchError (a ValueError): heads that do not fit model_cfg.
      ImportError: a .pt file and no torch.
    """
    weights_fn, cfg_fn = _resolve(path)
    raw = _read_config(cfg_fn)
    tensors = read_tensors(weights_fn, np.float32)
    if not tensors:
        counts = ", ".join(f"{k}={raw[k]}" for k in ("medusa_num_heads", "medusa_num_layers", "num_heads",
                                                     "num_hidden_layers") if k in raw)
        raise HeadsFormatError(f"{weights_fn}: holds no tensors (0 heads, 0 layers)"
                               + (f" but config.json says {counts}" if counts else "")
                               + "; the export was interrupted or wrote nothing: re-export or re-download the heads")
    head_type = raw.get("head_type", "medusa")
    if head_type not in HEAD_TYPES:
        raise HeadsFormatError(f"{cfg_fn}: head_type {head_type!r} is not one of {HEAD_TYPES}")
    hydra_tensors = {k: tensors.pop(k) for k in [k for k in tensors if _HYDRA_RE.match(k)]}
    if hydra_tensors and head_type != "hydra":
        said = (f"{cfg_fn} says head_type={head_type!r}" if "head_type" in raw else
                f"{cfg_fn} sets no head_type (so {head_type!r})" if raw else "there is no config.json beside it")
        raise HeadsFormatError(f"{weights_fn}: holds hydra path weights ({sorted(hydra_tensors)[0]!r}, ...) but "
                               f"{said}; set \"head_type\": \"hydra\" in its config.json (or re-export the heads "
                               "with save_heads)")
    if not tensors:
        raise HeadsFormatError(f"{weights_fn}: holds no Medusa block tensors beside the hydra path weights")
    stripped, origin = _normalise_names(tensors, weights_fn)
    vllm = raw.get("model_type") == "medusa" or any(
        k.startswith(("blocks.", "lm_heads.")) or k == "lm_head.weight" for k in stripped)
    token_map = None
    if vllm:
        stripped, token_map = _vllm_untruncated(stripped, raw, weights_fn)
    K, L, D, V, kern, bias, lm = _assemble(stripped, raw, weights_fn, vllm, model_cfg, origin)
    if vllm:  # as vLLM's MedusaModel builds the heads from its config
        if not raw.get("medusa_fc_bias", False):
            bias = np.zeros_like(bias)  # layers without biases: vLLM leaves the file's biases unused
        cfg_k = _config_count(raw, "num_heads", weights_fn)
        if cfg_k is not None and 0 < cfg_k < K:  # it builds num_heads heads; later ones in the file are unused
            K, kern, bias = cfg_k, kern[:cfg_k], bias[:cfg_k]
            lm = None if lm is None else lm[:cfg_k]
        scale = raw.get("logit_scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise HeadsFormatError(f"{weights_fn}: config.json's logit_scale must be a number > 0, got {scale!r}")
    if raw.get("shared_lm_head") is True and lm is not None:
        lm = None  # our own config: the per-head copies are copies of the base lm_head
    if raw.get("shared_lm_head") is False and lm is None:
        raise HeadsFormatError(f"{weights_fn}: config.json says shared_lm_head=false but the file holds no "
                               "per-head lm_head tensors")
    if num_heads is not None:
        if num_heads < 1 or num_heads > K:
            raise HeadsFormatError(f"{weights_fn}: asked for {num_heads} Medusa heads but the file holds {K} "
                                   f"(config.json says {raw.get('medusa_num_heads', raw.get('num_heads'))}); "
                                   f"use num_heads <= {K} or train more heads")
        K, kern, bias = num_heads, kern[:num_heads], bias[:num_heads]
        lm = None if lm is None else lm[:num_heads]
    choices = raw.get("medusa_choices")
    if choices is not None:
        choices = tuple(tuple(int(r) for r in p) for p in choices if len(p) <= K) or None
    topk = _config_count(raw, "topk", weights_fn)
    topk = 10 if topk is None else topk
    if token_map is not None:  # vLLM proposes each head's top-1: a small token_map is fine there
        topk = min(topk, len(token_map))
    ids = _proposal_ids(raw.get("proposal_token_ids"), V, topk, weights_fn) if token_map is None else token_map
    if head_type == "hydra" and L < 1:
        raise HeadsFormatError(f"{weights_fn}: hydra heads need at least one block layer, the file holds none")
    cfg = MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, num_layers=L, shared_lm_head=lm is None,
                       topk=topk, medusa_choices=choices,
                       base_model=str(raw.get("base_model_name_or_path") or ""),
                       proposal_vocab_size=0 if ids is None else len(ids), head_type=head_type)
    if model_cfg is not None:
        check_heads_match(cfg, model_cfg, source=path)
    params = {"blocks_kernel": kern.astype(dtype), "blocks_bias": bias.astype(dtype)}
    if lm is not None:
        params["lm_head"] = lm.astype(dtype)
    if head_type == "hydra":
        params.update({k: v.astype(dtype) for k, v in _hydra_params(hydra_tensors, K, D, weights_fn).items()})
    if ids is not None:
        params["proposal_ids"] = ids
    return cfg, params


def _vllm_untruncated(tensors: Mapping[str, np.ndarray], raw: dict,
                      source: str) -> Tuple[Dict[str, np.ndarray], Optional[np.ndarray]]:
    """vLLM's truncated vocabulary as our proposal vocabulary.

    With ``truncated_vocab_size`` N < ``vocab_size`` V, vLLM's heads score only the N tokens of
    ``token_map`` [N] (their lm_heads' rows: [N, D], or [V, D] that it slices by token_map) and set
    every other logit to -inf. Returns (tensors with each [N, D] lm_head scattered into the token_map
    rows of a [V, D] of zeros, token_map as int32 [N]): heads with that proposal vocabulary propose
    exactly vLLM's tokens. Without truncation: (tensors, None) (vLLM ignores a token_map then).
    Raises HeadsFormatError for sizes that are not non-negative integers, a missing token_map, one
    that is not N distinct integer ids in [0, V), or an lm_head with neither N nor V rows.
    """
    trunc, vocab = _config_count(raw, "truncated_vocab_size", source), _config_count(raw, "vocab_size", source)
    if trunc is None or vocab is None or trunc >= vocab:
        return dict(tensors), None
    N, V = trunc, vocab
    tm = tensors.get("token_map")
    if tm is None:
        raise HeadsFormatError(f"{source}: config.json says truncated_vocab_size={N} < vocab_size={V} but the file "
                               "holds no token_map (the ids of the N tokens the heads score), which vLLM needs too: "
                               "add it, or set truncated_vocab_size to vocab_size")
    tm = np.asarray(tm)
    if tm.shape != (N,) or not np.issubdtype(tm.dtype, np.integer) or N < 1 or tm.min() < 0 \
            or tm.max() >= V or len(np.unique(tm)) != N:
        raise HeadsFormatError(f"{source}: token_map must be truncated_vocab_size={N} distinct integer token ids in "
                               f"[0, {V}); got shape {tuple(tm.shape)}, dtype {tm.dtype}")
    out = dict(tensors)
    for name, arr in tensors.items():
        m = _VLLM_RE.match(name)
        if not m or (m.group(4) is None and name != "lm_head.weight"):  # not an lm_head
            continue
        if arr.ndim == 2 and arr.shape[0] == N:
            full = np.zeros((V, arr.shape[1]), arr.dtype)
            full[tm] = arr
            out[name] = full
        elif arr.ndim != 2 or arr.shape[0] != V:
            raise HeadsFormatError(f"{source}: {name} has shape {tuple(arr.shape)}; with a token_map of {N} ids it "
                                   f"should hold their {N} rows, or all {V}")
    return out, tm.astype(np.int32)


def _hydra_params(tensors: Mapping[str, np.ndarray], K: int, D: int, source: str) -> Dict[str, np.ndarray]:
    """``hydra.{h}.path_linear|path_residual.weight`` [D, (h+1)*D] (torch layout) -> our
    ``path_kernel_h`` / ``path_residual_h`` [h+1, D, D] ([in, out]) for heads 0..K-1 (later heads in
    the file are dropped, as `load_heads(num_heads=...)` drops their blocks). Raises HeadsFormatError
    for a missing or mis-shaped tensor."""
    out = {}
    for h in range(K):
        for kind, name in (("path_linear", PATH_KERNEL), ("path_residual", PATH_RESIDUAL)):
            key = f"hydra.{h}.{kind}.weight"
            w = tensors.get(key)
            if w is None or tuple(w.shape) != (D, (h + 1) * D):
                raise HeadsFormatError(f"{source}: hydra head {h} needs {key!r} of shape ({D}, {(h + 1) * D}) "
                                       f"(its path of {h + 1} token embeddings), got "
                                       f"{'nothing' if w is None else tuple(w.shape)}; re-export the heads with "
                                       "save_heads")
            out[name.format(h)] = np.ascontiguousarray(w.T.reshape(h + 1, D, D))
    return out


def _proposal_ids(raw_ids, V: int, topk: int, source: str) -> Optional[np.ndarray]:
    """config.json's ``proposal_token_ids`` (distinct ids in [0, V), at least topk) as int32, or None."""
    if raw_ids is None:
        return None
    try:
        ids = np.asarray(raw_ids, np.int64)
    except (TypeError, ValueError):
        ids = np.zeros((0, 0))
    if ids.ndim == 1 and ids.size and ids.min() >= 0 and ids.max() >= V:
        raise HeadsFormatError(f"{source}: config.json's proposal_token_ids go up to {int(ids.max())}, beyond its "
                               f"vocab_size {V}: is vocab_size right (the model's vocabulary)? Otherwise fix or "
                               "delete proposal_token_ids (the heads then propose from the whole vocabulary)")
    if ids.ndim != 1 or ids.size < max(topk, 1) or ids.min() < 0 or len(np.unique(ids)) != ids.size:
        raise HeadsFormatError(f"{source}: config.json's proposal_token_ids must be at least topk={topk} distinct "
                               f"token ids in [0, {V}); fix or delete the field (the heads then propose from "
                               "the whole vocabulary)")
    return ids.astype(np.int32)


# ---------------------------------------------------------------------------------------- writing

def _check_params(cfg: MedusaConfig, p: Dict[str, np.ndarray]) -> None:
    K, L, D, V = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    want = {"blocks_kernel": (K, L, D, D), "blocks_bias": (K, L, D)}
    if not cfg.shared_lm_head:
        want["lm_head"] = (K, D, V)
    if cfg.proposal_vocab_size:
        want["proposal_ids"] = (cfg.proposal_vocab_size,)
    for k, shape in want.items():
        if k not in p or tuple(p[k].shape) != shape:
            raise ValueError(f"head params {k!r}: {None if k not in p else tuple(p[k].shape)}, expected {shape} "
                             "for this MedusaConfig")
    if cfg.head_type == "hydra":
        check_path_params(cfg, p)


def _medusa_only(cfg: MedusaConfig, fmt: str) -> None:
    """Raise ValueError for heads other than the paper's: `fmt` has no place for their weights."""
    if cfg.head_type != "medusa":
        raise ValueError(f"{fmt} stores only the paper's Medusa heads; these are {cfg.head_type} heads, whose first "
                         "blocks also read the path's token embeddings, which that format cannot hold. Save them "
                         "with save_heads (our format: medusa_jax, decode.py --heads DIR), or train Medusa heads "
                         "(head_type: medusa) to export")


def _lm_heads_torch(cfg, p, base_lm_head, need: bool, what: str):
    """[K, V, D] per-head lm_heads in torch layout: own copies, or the base lm_head repeated."""
    if not cfg.shared_lm_head:
        return np.transpose(p["lm_head"], (0, 2, 1))
    if not need:
        return None
    if base_lm_head is None:
        raise ValueError(f"{what}: the heads share the base lm_head; pass base_lm_head [D, V] to write copies of it"
                         + (" (or include_lm_head=False for the legacy version-2 layout, which only "
                            "medusa_model_legacy.py reads)" if what == "export_official" else ""))
    base = np.asarray(base_lm_head, np.float32)
    if base.shape != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"base_lm_head has shape {base.shape}, expected [D, V] = ({cfg.hidden_size}, {cfg.vocab_size})")
    return np.broadcast_to(base.T[None], (cfg.num_heads, cfg.vocab_size, cfg.hidden_size))


def _official_tensors(cfg, p, lm_torch, dtype) -> Dict[str, np.ndarray]:
    out = {}
    for h in range(cfg.num_heads):
        for l in range(cfg.num_layers):
            out[f"{h}.{l}.linear.weight"] = p["blocks_kernel"][h, l].T
            out[f"{h}.{l}.linear.bias"] = p["blocks_bias"][h, l]
        if lm_torch is not None:
            out[f"{h}.{cfg.num_layers}.weight"] = lm_torch[h]
    return {k: np.ascontiguousarray(v, dtype=dtype) for k, v in out.items()}


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _write(path: str, filename: str, tensors: Dict[str, np.ndarray], config: dict, fmt: str) -> str:
    """Write config.json and the weight file atomically; remove other known weight files in `path`.
    Raises ValueError when there are no tensors (a file that `load_heads` would refuse)."""
    if not tensors:
        raise ValueError("these heads have no tensors to write (0 block layers and the shared base lm_head): "
                         "they are the base model's own next-token head; use init_heads (or --heads zero) "
                         "instead of a file, or give them at least one block layer")
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, filename)
    tmp = target + ".tmp"
    if fmt == "pt":
        import torch
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, tmp)
    else:
        save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, target)
    for other in WEIGHT_FILES:  # a stale file of another format would shadow or confuse loading
        if other != filename and os.path.isfile(os.path.join(path, other)):
            os.remove(os.path.join(path, other))
    cfg_tmp = os.path.join(path, "config.json.tmp")
    with open(cfg_tmp, "w") as f:
        json.dump(config, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(cfg_tmp, os.path.join(path, "config.json"))
    return target


def _official_config(cfg: MedusaConfig, shared_in_file: bool, base_model: Optional[str] = None) -> dict:
    d = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
         "base_model_name_or_path": cfg.base_model if base_model is None else base_model,
         "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    if shared_in_file:
        d["version"] = "2"
    return d


def save_heads(path: str, cfg: MedusaConfig, params, base_lm_head=None,
               extra: Optional[Mapping[str, Any]] = None, dtype=np.float32) -> str:
    """Save heads in our format: the official safetensors format plus our config fields.

    Writes ``path/config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
    ``base_model_name_or_path``, ``hidden_size``, ``vocab_size``, ``"version": "2"`` when shared,
    ``medusa_choices``, ``topk``, ``shared_lm_head``, ``proposal_token_ids`` when the heads propose
    from a truncated vocabulary, ``head_type`` for hydra heads, and every field of `extra`) and
    ``path/medusa_lm_head.safetensors`` (float32 or `dtype`, torch layout, no lm_head tensors when
    shared; hydra heads add their ``hydra.{h}.path_linear|path_residual.weight``, see the module
    docstring). Loading casts the weights back to float32.

    Args:
      path: output directory (created).
      cfg, params: the heads (`MedusaHeads` params, optionally wrapped in {"params": ...}).
      base_lm_head: [D, V], only shape-checked (shared heads are stored without it).
      extra: JSON-serialisable fields to add, e.g. {"metrics": {...}}; may not override ours.
      dtype: np.float32, or np.float16 for half the file size (the shipped heads; drafts change
        by rounding only, and verification keeps the output exact).
    Returns the weight file's path. Raises ValueError for params that do not match cfg, heads with
    no tensors (0 layers and shared), an `extra` key that collides with a format field, or another dtype.
    """
    if np.dtype(dtype) not in (np.float32, np.float16):
        raise ValueError(f"dtype must be float32 or float16, got {np.dtype(dtype)}")
    p = heads_params_to_numpy(params)
    _check_params(cfg, p)
    if base_lm_head is not None and tuple(np.shape(base_lm_head)) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"base_lm_head has shape {tuple(np.shape(base_lm_head))}, expected [D, V] = "
                         f"({cfg.hidden_size}, {cfg.vocab_size})")
    config = _official_config(cfg, cfg.shared_lm_head)
    config.update(shared_lm_head=cfg.shared_lm_head, topk=cfg.topk,
                  medusa_choices=None if cfg.medusa_choices is None else [list(c) for c in cfg.medusa_choices])
    if cfg.proposal_vocab_size:
        config["proposal_token_ids"] = [int(i) for i in p["proposal_ids"]]
    for k, v in (extra or {}).items():
        if k in config or k in OUR_KEYS:
            raise ValueError(f"extra field {k!r} collides with a Medusa config field")
        config[k] = v
    if cfg.head_type != "medusa":
        config["head_type"] = cfg.head_type
    lm = _lm_heads_torch(cfg, p, None, False, "save_heads")
    tensors = _official_tensors(cfg, p, lm, dtype)
    if cfg.head_type == "hydra":
        D = cfg.hidden_size
        for h in range(cfg.num_heads):
            for kind, name in (("path_linear", PATH_KERNEL), ("path_residual", PATH_RESIDUAL)):
                tensors[f"hydra.{h}.{kind}.weight"] = np.ascontiguousarray(
                    p[name.format(h)].reshape((h + 1) * D, D).T, dtype=dtype)
    return _write(path, OFFICIAL_FILES[0], tensors, config, "safetensors")


def export_official(path: str, cfg: MedusaConfig, params, base_lm_head=None, fmt: str = "pt",
                    include_lm_head: bool = True, dtype=np.float32, base_model: Optional[str] = None) -> str:
    """Export in the original FasterDecoding/Medusa format (config.json + medusa_lm_head.pt|.safetensors).

    Args:
      path: output directory.
      fmt: "pt" (the only file the original ``MedusaModel.from_pretrained`` reads,
        medusa/model/medusa_model.py; needs torch) or "safetensors" (what its legacy training
        script writes; for tools that read that).
      include_lm_head: for shared heads, write ``{h}.{L}.weight`` = base_lm_head.T for every head:
        the original code always builds per-head lm_heads and loads with ``strict=False``, so heads
        written without them load there with random lm_heads and no error. False writes shared heads
        without lm_heads and ``"version": "2"``, which only ``medusa_model_legacy.py`` reads. Heads
        with their own lm_head always write them.
      base_lm_head: [D, V]; required when the heads are shared and include_lm_head.
      dtype: numpy float dtype of the written tensors (float32 or float16).
      base_model: config.json's ``base_model_name_or_path`` (default: the heads' `base_model`, a
        file name): the original loader reads the backbone's config from it, so give the backbone's
        Hugging Face id or directory (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct").
    Returns the weight file's path; raises ValueError as `save_heads` does, and for hydra heads
    (the format has no place for their path weights). The original ties the
    blocks of a head when L > 1 (``[ResBlock(D)] * L`` repeats one module); a warning is given when
    exported blocks differ. Its current loader also builds 5 heads whatever config.json says
    (``medusa_num_heads = 5``): a 4-head export gets a fifth, random head there, which trees of depth
    at most 4 (its ``mc_sim_7b_63``) never use.
    """
    if fmt not in ("pt", "safetensors"):
        raise ValueError(f"fmt must be 'pt' or 'safetensors', got {fmt!r}")
    _medusa_only(cfg, "the official Medusa format (export_official)")
    p = heads_params_to_numpy(params)
    _check_params(cfg, p)
    lm = _lm_heads_torch(cfg, p, base_lm_head, include_lm_head, "export_official")
    if cfg.num_layers > 1 and not all(np.array_equal(p["blocks_kernel"][:, 0], p["blocks_kernel"][:, l])
                                      for l in range(1, cfg.num_layers)):
        warnings.warn("the original Medusa code shares one ResBlock across the layers of a head "
                      "([ResBlock(D)] * L); these heads have distinct blocks, so there the last block "
                      "of each head is loaded into all its layers (medusa_jax and vLLM load them as they are)")
    config = _official_config(cfg, lm is None, base_model)
    return _write(path, OFFICIAL_FILES[0] if fmt == "safetensors" else OFFICIAL_FILES[1],
                  _official_tensors(cfg, p, lm, dtype), config, fmt)


def export_vllm(path: str, cfg: MedusaConfig, params, base_lm_head=None, dtype=np.float32,
                lm_head_copies: bool = False) -> str:
    """Export for vLLM's Medusa speculator (config.json + model.safetensors), as its
    ``vllm/model_executor/models/medusa.py`` reads them.

    Args:
      cfg, params: Medusa heads (`load_heads`, the trainer's); own lm_heads are written per head
        unless they are all equal.
      base_lm_head: [D, V] float, the base model's lm_head; required for heads that share it.
      dtype: the floating tensors' dtype (float32 or float16).
      lm_head_copies: heads sharing the base lm_head (or whose own lm_heads are all equal) are
        written with one ``lm_head.weight`` and ``original_lm_head: true`` (vLLM >= 0.6.5 shares it
        between the heads, a K-th of the bytes); True writes a copy per head (``lm_heads.{h}.weight``)
        for vLLM releases before that.
    A proposal vocabulary (``params["proposal_ids"]``, `MedusaConfig.proposal_vocab_size` N) becomes
    vLLM's ``token_map`` [N] int64 with ``truncated_vocab_size: N``, the lm_heads' rows [N, D] those
    tokens': vLLM's heads then propose from those N tokens, as ours do. Config: ``{model_type:
    "medusa", architectures: ["MedusaModel"], num_heads, num_hidden_layers, hidden_size, vocab_size,
    truncated_vocab_size, medusa_fc_bias: true, topk}`` (+ ``original_lm_head``). Returns the
    weight file's path. Raises ValueError for hydra heads (vLLM's Medusa speculator has no place
    for their path weights), for shared heads without base_lm_head, and as `save_heads` does.
    """
    _medusa_only(cfg, "vLLM's Medusa format (export_vllm)")
    p = heads_params_to_numpy(params)
    _check_params(cfg, p)
    ids = p.get("proposal_ids") if cfg.proposal_vocab_size else None
    lm = _lm_heads_torch(cfg, p, base_lm_head, True, "export_vllm")  # [K, V, D]
    # heads read back from such a file hold K equal copies: written once again
    one = not lm_head_copies and (cfg.shared_lm_head or all(np.array_equal(lm[0], lm[h]) for h in range(1, len(lm))))
    lm = lm[:1] if one else lm
    if ids is not None:
        lm = lm[:, ids]  # [K or 1, N, D]: the rows vLLM keeps (it slices a [V, D] one by token_map itself)
    tensors = {}
    for h in range(cfg.num_heads):
        for l in range(cfg.num_layers):
            tensors[f"blocks.{h}.layers.{l}.weight"] = p["blocks_kernel"][h, l].T
            tensors[f"blocks.{h}.layers.{l}.bias"] = p["blocks_bias"][h, l]
    for h in range(len(lm)):
        tensors["lm_head.weight" if one else f"lm_heads.{h}.weight"] = lm[h]
    tensors = {k: np.ascontiguousarray(v, dtype=dtype) for k, v in tensors.items()}
    if ids is not None:
        tensors["token_map"] = np.ascontiguousarray(ids, dtype=np.int64)
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.num_heads,
              "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.vocab_size if ids is None else len(ids),
              "medusa_fc_bias": True, "topk": cfg.topk}
    if one:
        config["original_lm_head"] = True
    return _write(path, VLLM_FILES[0], tensors, config, "safetensors")
