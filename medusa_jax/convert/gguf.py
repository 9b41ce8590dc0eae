"""GGUF file (llama.cpp) -> (ModelConfig, params), through the ``gguf`` package's reader.

Every tensor is dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1,
Q8_0, the K-quants, the I-quants: whatever the installed package implements), reshaped to the
torch layout (GGUF lists dimensions innermost first, so the torch shape is the reversed GGUF
shape), renamed to the Hugging Face names and handed to `convert.hf.params_from_hf_tensors`,
which checks that every tensor is mapped, present and of the right shape.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q`` / ``attn_k`` (weights and
biases) of ``llama``-architecture files so that its RoPE can rotate adjacent pairs; this module
undoes that per head (query heads for q, KV heads for k), exactly as transformers'
``LlamaTensorProcessor`` does. ``qwen2`` and ``qwen3`` files are stored unpermuted (NeoX-style
RoPE); a ``qwen3`` file also holds each layer's ``attn_q_norm`` / ``attn_k_norm`` weights
[head_dim] and its ``qwen3.attention.key_length`` (head_dim, which may differ from
embedding_length / head_count). Mistral models are written with architecture ``llama``. Tied
embeddings are a file without ``output.weight``.

Llama-3.1 RoPE scaling is stored by llama.cpp as a ``rope_freqs.weight`` tensor of per-frequency
divisors rather than as metadata; `load_gguf` recovers the equivalent `RopeScaling` and checks
that it reproduces the tensor.
"""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Any, Dict, Optional, Tuple

import gguf
import numpy as np
from gguf.quants import dequantize
from tqdm.auto import tqdm

from medusa_jax.convert.hf import ConversionError, params_from_hf_tensors
from medusa_jax.kernels import BlockWeight
from medusa_jax.models.config import ModelConfig, RopeScaling, check_architecture
from medusa_jax.models.llama import rope_inv_freq

#: First four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # qwen3
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_MISSING = object()


def gguf_to_hf_name(name: str) -> Optional[str]:
    """GGUF tensor name -> HF name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Returns None for a name outside the Llama-family mapping.
    """
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def hf_to_gguf_name(name: str) -> Optional[str]:
    """The inverse of `gguf_to_hf_name` (None for an HF name without a GGUF counterpart)."""
    for g, h in _TOP_LEVEL.items():
        if name == h:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        for g, h in _BLOCK.items():
            if m.group(2) == h:
                return f"blk.{m.group(1)}.{g}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a q or k projection.

    Args:
      w: [n_head * head_dim, ...] weight ([out, in]) or bias ([out]) as stored in the GGUF.
      n_head: query heads for ``attn_q``, KV heads for ``attn_k``.
    Returns:
      the HF-layout array, same shape and dtype. Within each head llama.cpp interleaves the two
      rotary halves (rows ``0, Dh/2, 1, Dh/2+1, ...``); this puts them back as ``[first half,
      second half]``.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field_value(field) -> Any:
    """Decode one GGUF metadata field to a Python scalar, str or list."""

    def one(part, vtype):
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        return [one(field.parts[i], sub) for i in field.data]
    return one(field.parts[field.data[0]], main)


def read_gguf_metadata(reader) -> Dict[str, Any]:
    """All metadata of an open ``gguf.GGUFReader`` as ``{key: value}``, skipping the big
    tokenizer arrays (tokens, merges, scores, token types)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type"}
    return {k: field_value(f) for k, f in reader.fields.items()
            if k not in skip and not k.startswith("GGUF.")}


def open_gguf(path: str):
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped, nothing dequantized yet).

    Raises:
      FileNotFoundError: no such file.
      ConversionError: not a GGUF file (wrong magic bytes), or a truncated/corrupt one.
    """

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError... on bad files
        raise ConversionError(f"{path}: cannot read GGUF file ({type(e).__name__}: {e}); it may be "
                              "truncated or corrupted") from e


def _llama3_scaling_from_freqs(factors: np.ndarray, cfg: ModelConfig, orig_ctx: int,
                               source: str) -> Optional[RopeScaling]:
    """Recover Llama-3 `RopeScaling` from llama.cpp's ``rope_freqs`` divisors [head_dim/2].

    llama.cpp divides each inverse frequency by ``factors[i]``: 1 for short wavelengths,
    ``factor`` for long ones and ``1 / ((1 - s) / factor + s)`` in between, with
    ``s = (orig_ctx / wavelen - low) / (high - low)`` linear in 1 / wavelen. The in-between points
    give (low, high) by least squares; the result must reproduce every divisor.
    """

    f = np.asarray(factors, np.float64).reshape(-1)
    if f.shape[0] != cfg.head_dim // 2:
        raise ConversionError(f"{source}: rope_freqs.weight has {f.shape[0]} entries, expected "
                              f"head_dim/2 = {cfg.head_dim // 2}")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(f.max())
    base_inv = rope_inv_freq(cfg.replace(rope_scaling=None)).astype(np.float64)
    medium = (f > 1 + 1e-4) & (f < factor - 1e-4 * factor)
    low, high = 1.0, 4.0
    if medium.sum() >= 2:
        s = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
        x = base_inv[medium] / (2 * math.pi)  # 1 / wavelen
        a, b = np.linalg.lstsq(np.stack([x, -np.ones_like(x)], 1), s, rcond=None)[0]
        if a > 0:
            low, high = b * orig_ctx / a, orig_ctx * (1 + b) / a
    scaling = RopeScaling(kind="llama3", factor=factor, low_freq_factor=float(low),
                          high_freq_factor=float(high), original_max_position_embeddings=int(orig_ctx))
    got = rope_inv_freq(cfg.replace(rope_scaling=scaling)).astype(np.float64)
    want = base_inv / f
    if not np.allclose(got, want, rtol=1e-3, atol=0):
        raise ConversionError(f"{source}: rope_freqs.weight is not a Llama-3 RoPE scaling that "
                              "medusa_jax can represent")
    return scaling


def gguf_config(reader, source: str = "GGUF") -> Tuple[ModelConfig, str]:
    """Build the `ModelConfig` from an open reader's metadata and tensor shapes.

    Returns:
      (config, the file's own ``general.architecture``), the latter deciding the q/k permutation.
    Raises:
      UnsupportedArchitectureError: architecture not llama/mistral/qwen2/qwen3.
      ConversionError: a required key is missing, partial rotary embeddings, an unsupported
        RoPE scaling type, a sliding-window pattern that is not one bool per layer, head counts or
        MLP sizes that differ between layers, or one part of a split GGUF.
    A ``llama`` file with a sliding window is a Mistral model (llama.cpp writes Mistral as llama).
    """
    meta = read_gguf_metadata(reader)
    file_arch = str(meta.get("general.architecture", ""))
    arch = check_architecture(file_arch, source)

    def get(key, default=_MISSING):
        full = f"{file_arch}.{key}"
        if full in meta:
            return meta[full]
        if default is _MISSING:
            raise ConversionError(f"{source}: missing metadata key {full!r}")
        return default

    def one(key, default=_MISSING) -> int:
        """An integer key that llama.cpp may also write per layer (an array): one value for all."""
        v = get(key, default)
        if isinstance(v, (list, tuple, np.ndarray)):
            values = {int(x) for x in v}
            if len(values) != 1:
                raise ConversionError(f"{source}: {file_arch}.{key} differs between layers ({sorted(values)}); "
                                      "models whose layers differ in shape are not supported")
            v = values.pop()
        return int(v)

    parts = int(meta.get("split.count", 1) or 1)
    if parts > 1:
        raise ConversionError(f"{source}: part {int(meta.get('split.no', 0)) + 1} of a GGUF split into {parts} files; "
                              "merge them into one first (llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConversionError(f"{source}: missing tensor 'token_embd.weight'")
    hidden = int(get("embedding_length"))
    num_heads = one("attention.head_count")
    head_dim = int(get("attention.key_length", hidden // num_heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(f"{source}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
                              f"head_dim={head_dim}) are not supported")
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ConversionError(f"{source}: value_length {value_dim} != key_length {head_dim} is not supported")
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(meta[key]) not in eos:
            eos.append(int(meta[key]))
    window, layer_types = _sliding_layout(get, int(get("block_count")), source)
    if window and arch == "llama":
        arch = "mistral"
    cfg = ModelConfig(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=one("feed_forward_length"),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=one("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
        eos_token_ids=tuple(eos),
    )
    kind = str(get("rope.scaling.type", "none")).lower()
    if kind == "linear":
        cfg = cfg.replace(rope_scaling=RopeScaling(kind="linear", factor=float(get("rope.scaling.factor"))))
    elif kind not in ("none", ""):
        raise ConversionError(f"{source}: unsupported RoPE scaling type {kind!r}; supported: linear, "
                              "llama3 (as a rope_freqs tensor)")
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"], source)
        orig = int(get("rope.scaling.original_context_length", 8192))
        cfg = cfg.replace(rope_scaling=_llama3_scaling_from_freqs(factors, cfg, orig, source))
    return cfg, file_arch


def _sliding_layout(get, num_layers: int, source: str) -> Tuple[Optional[int], Optional[Tuple[str, ...]]]:
    """(sliding_window, layer_types) from llama.cpp's ``attention.sliding_window`` (tokens; absent
    or 0: no window) and ``attention.sliding_window_pattern`` (one bool per layer, true = the layer
    uses the window; absent: every layer does). Raises ConversionError for a pattern that is not
    one bool per layer."""
    window = get("attention.sliding_window", None)
    window = int(window) if window else None
    pattern = get("attention.sliding_window_pattern", None)
    if window is None or pattern is None:
        return window, None
    if not (isinstance(pattern, list) and len(pattern) == num_layers
            and all(isinstance(p, bool) for p in pattern)):
        raise ConversionError(f"{source}: attention.sliding_window_pattern must be one bool per layer "
                              f"({num_layers}), got {pattern!r}")
    return window, tuple("sliding_attention" if p else "full_attention" for p in pattern)


def _dequantize(tensor, source: str) -> np.ndarray:
    """One reader tensor -> float32 numpy array in torch layout (reversed GGUF shape)."""

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ConversionError(f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                              f"the installed gguf package cannot dequantize ({e})") from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        return np.asarray(arr, dtype=np.float32).reshape(shape)
    except ValueError as e:
        raise ConversionError(f"{source}: tensor {tensor.name} holds {np.size(arr)} values, its shape "
                              f"{shape} needs {math.prod(shape)}; the file may be corrupted") from e


#: GGUF tensor types that `load_gguf(as_stored=True)` keeps as the file stores them (the product
#: kernels' block formats, `kernels.BLOCK_BYTES`).
STORED_TYPES = {gguf.GGMLQuantizationType.Q8_0: "q8_0", gguf.GGMLQuantizationType.Q4_0: "q4_0",
                gguf.GGMLQuantizationType.Q4_1: "q4_1"}


def _as_stored(tensor, source: str) -> Optional[BlockWeight]:
    """A 2-D tensor of a `STORED_TYPES` type as a `BlockWeight` over the file's own bytes ([N, K]
    torch layout: row n holds output n's K / 32 blocks), or None for any other tensor."""
    fmt = STORED_TYPES.get(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if fmt is None or len(shape) != 2 or shape[1] % 32:
        return None
    data = np.asarray(tensor.data)
    row_bytes = shape[1] // 32 * gguf.GGML_QUANT_SIZES[tensor.tensor_type][1]
    if data.dtype != np.uint8 or data.size != shape[0] * row_bytes:
        raise ConversionError(f"{source}: tensor {tensor.name} holds {data.size} bytes, its {fmt} shape {shape} "
                              f"needs {shape[0] * row_bytes}; the file may be corrupted")
    return BlockWeight(data.reshape(shape[0], row_bytes), fmt)


def load_gguf(path: str, dtype=np.float32, reader=None, progress: bool = False,
              as_stored: bool = False) -> Tuple[ModelConfig, dict]:
    """Load a Llama/Mistral/Qwen2/Qwen3 GGUF file into (ModelConfig, params of numpy arrays).

    Args:
      path: a ``.gguf`` file (any quantization the ``gguf`` package can dequantize).
      dtype: numpy dtype of the params (dequantized values are computed in float32).
      reader: the file already opened with `open_gguf` (None: open it here).
      progress: a tqdm bar on stderr over the tensors being dequantized.
      as_stored: keep the 2-D tensors of a `STORED_TYPES` type (Q8_0, Q4_0, Q4_1) as the file
        stores them, as `kernels.BlockWeight` ([out, in] blocks: linear weights under
        ``kernel_t``, the embedding under ``embedding``; q/k rows unpermuted as whole rows), for
        decoding with the block kernels; every other tensor is dequantized. Requires float32.
    Returns:
      (cfg, params) with the `LlamaModel` params tree; ``cfg.eos_token_ids`` holds the file's
      ``tokenizer.ggml.eos_token_id`` (plus eot / eom ids when present).
    Raises:
      FileNotFoundError: no such file.
      UnsupportedArchitectureError: ``general.architecture`` not llama/mistral/qwen2/qwen3.
      ConversionError: not a GGUF file, a truncated/corrupt one, a tensor type that cannot be
        dequantized, missing metadata, or an unmapped/missing/mis-shaped tensor.
    """
    reader = reader if reader is not None else open_gguf(path)
    cfg, file_arch = gguf_config(reader, source=path)
    permuted = file_arch == "llama"
    hf: Dict[str, np.ndarray] = {}
    unmapped = []

    # on a terminal the bar is erased when done; elsewhere (a log, a pipe) erasing leaves a fragment
    # before the next output, so the bar ends with its line instead
    on_terminal = getattr(sys.stderr, "isatty", lambda: False)()
    for tensor in tqdm(reader.tensors, desc=f"converting {os.path.basename(path)} (cached for later runs)",
                       unit="tensor", disable=not progress, leave=not on_terminal, file=sys.stderr):
        if tensor.name == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling by gguf_config
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            unmapped.append(tensor.name)
            continue
        arr = _as_stored(tensor, path) if as_stored else None
        arr = arr if arr is not None else _dequantize(tensor, path)
        heads = cfg.num_heads if ".self_attn.q_proj." in name else (
            cfg.num_kv_heads if ".self_attn.k_proj." in name else 0)
        if permuted and heads and arr.shape[0] == heads * cfg.head_dim:  # else the shape check reports it
            arr = (BlockWeight(unpermute_qk(arr.blocks, heads), arr.fmt) if isinstance(arr, BlockWeight)
                   else unpermute_qk(arr, heads))
        hf[name] = arr
    if unmapped:
        raise ConversionError(f"{path}: unmapped GGUF tensor(s) {sorted(unmapped)[:8]} for a {cfg.arch} "
                              f"model with {cfg.num_layers} layers")
    return cfg, params_from_hf_tensors(cfg, hf, dtype=dtype, source=path)
