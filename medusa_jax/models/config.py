"""Frozen, hashable configuration dataclasses.

`ModelConfig` describes a Llama-family backbone (Llama, Mistral, Qwen2, Qwen3). It is hashable so
it can be a static argument of jitted functions, and it is built from a Hugging Face
``config.json`` (`ModelConfig.from_hf_dict`) or from GGUF metadata (`medusa_jax.convert.gguf`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

#: Architectures the backbone implements, keyed by HF ``model_type``.
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

#: ``head_dim`` of a Qwen3 config.json without the key (``Qwen3Config``'s default, not
#: hidden_size // num_attention_heads as for the other families).
QWEN3_DEFAULT_HEAD_DIM = 128

#: The dtypes the backbone loads and computes in (``--dtype``; `convert.load.load_model`, the memory
#: plan). float64 loads as float32, as JAX without x64 computes.
DTYPES: Tuple[str, ...] = ("float32", "bfloat16", "float16")


#: Attention kinds a layer may have (``ModelConfig.layer_types``, transformers' names).
LAYER_TYPES: Tuple[str, ...] = ("full_attention", "sliding_attention")


class UnsupportedArchitectureError(ValueError):
    """Raised for a checkpoint whose architecture is not in `SUPPORTED_ARCHITECTURES`."""


def check_architecture(name: str, source: str = "") -> str:
    """Return the normalised architecture name or raise `UnsupportedArchitectureError`.

    Args:
      name: an HF ``model_type`` (e.g. "llama") or GGUF ``general.architecture``.
      source: where the name came from, for the message.
    """
    norm = (name or "").lower()
    if not norm:
        where = f"{source} names" if source else "the checkpoint names"
        raise UnsupportedArchitectureError(
            f"{where} no architecture (no model_type, and no architectures such as LlamaForCausalLM); "
            f"medusa_jax supports {', '.join(SUPPORTED_ARCHITECTURES)} (Llama family)")
    if norm not in SUPPORTED_ARCHITECTURES:
        where = f" in {source}" if source else ""
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}{where}; medusa_jax supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama family). Convert a model of one of these.")
    return norm


SUPPORTED_ACTIVATIONS = ("silu", "swish")
"""``hidden_act`` values of the MLP the model computes (SwiGLU: ``down(silu(gate(x)) * up(x))``)."""


def check_supported_variant(cfg: Mapping[str, Any], source: str = "config.json") -> None:
    """Raise `UnsupportedArchitectureError` for a config of a supported family that asks for what
    `models.llama` does not compute, rather than load it and decode wrongly: ``hidden_act`` other
    than SiLU (`SUPPORTED_ACTIVATIONS`; a missing one is SiLU, as in transformers' defaults),
    ``mlp_bias`` true (biases on gate/up/down), or a ``quantization_config`` (FP8, GPTQ, AWQ, ...:
    weights stored in a form the loader does not dequantize)."""
    act = cfg.get("hidden_act", "silu")
    problems = []
    if str(act).lower() not in SUPPORTED_ACTIVATIONS:
        problems.append(f"hidden_act {act!r} (the MLP computes SiLU only: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias true (the MLP's projections have no biases here)")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        problems.append(f"quantization_config (a {method!r}-quantized checkpoint; use the unquantized "
                        "float32/bfloat16/float16 checkpoint, or a GGUF file)")
    if problems:
        raise UnsupportedArchitectureError(
            f"{source}: this {cfg.get('model_type', '')} variant is not supported: {'; '.join(problems)}. "
            "Decoding it would give wrong outputs, so it is refused.")


def model_type_of(architectures: Any) -> str:
    """The ``model_type`` a config.json without one implies by its ``architectures`` (transformers'
    class names): ``["LlamaForCausalLM"]`` -> "llama"; "" when they name none of the families."""
    for name in architectures if isinstance(architectures, list) else []:
        if isinstance(name, str) and name.endswith("ForCausalLM"):
            kind = name[:-len("ForCausalLM")].lower()
            if kind in SUPPORTED_ARCHITECTURES:
                return kind
    return ""


#: What transformers' config classes (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) give
#: a key a config.json leaves out; a num_key_value_heads of None there means one per query head.
FAMILY_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
}


def kv_heads_of(cfg: Mapping[str, Any], arch: str) -> int:
    """A config.json's KV head count: ``num_key_value_heads``; one per query head when it is null
    (as every family's config class reads None); when the key is left out, the family's default in
    transformers (`FAMILY_DEFAULTS`), else one per query head."""
    if "num_key_value_heads" in cfg:
        given = cfg["num_key_value_heads"]
        return int(given if given is not None else cfg["num_attention_heads"])
    return int(FAMILY_DEFAULTS[arch]["num_key_value_heads"] or cfg["num_attention_heads"])


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_sizes(cfg: Mapping[str, Any], arch: str, source: str = "config.json") -> None:
    """Raise ValueError naming the field when a config.json's sizes cannot make a model: a size
    (`_SIZES`, ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings`` where given)
    that is missing, not an integer or below 1, query heads that are not a multiple of the KV
    heads, or (without ``head_dim``) a hidden size that the query heads do not divide."""
    problems = []
    for name in _SIZES + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = cfg.get(name)
        if v is None and name not in _SIZES:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{name} must be an integer >= 1, got {v!r}")
    if not problems:
        heads, kv = cfg["num_attention_heads"], kv_heads_of(cfg, arch)
        left_out = "" if "num_key_value_heads" in cfg else \
            f", transformers' default for {arch}: the config leaves it out"
        if heads % kv:
            problems.append(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv}{left_out})")
        if cfg.get("head_dim") is None and arch != "qwen3" and cfg["hidden_size"] % heads:
            problems.append(f"hidden_size ({cfg['hidden_size']}) must be a multiple of num_attention_heads ({heads}) "
                            "when there is no head_dim")
    if problems:
        raise ValueError(f"{source}: {'; '.join(problems)}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    kind: "llama3" (Llama 3.1 wavelength-dependent scaling) or "linear" (position interpolation).
    The other fields follow the HF ``rope_scaling`` / ``rope_parameters`` names.
    """
    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    All sizes are element counts. ``head_dim`` defaults to hidden_size // num_heads.
    ``eos_token_ids`` holds every id that ends generation.

    Per family (``arch``): qwen2 has q/k/v biases (``attention_bias``); qwen3 normalises each
    query and key head with an RMSNorm of its own before RoPE (`qk_norm`); llama's and qwen3's
    ``attention_bias`` biases q/k/v and the output projection (`o_proj_bias`).

    Sliding-window attention (transformers' names): ``sliding_window`` is the window W in tokens
    (query at position p sees keys at p - W + 1 .. p); ``layer_types`` gives each layer's kind,
    "full_attention" or "sliding_attention", and None means every layer uses the window when one is
    set (Mistral). `layer_windows` is the resulting per-layer window. The two are normalised (a
    uniform list becomes None, an unused window None), and a list of the wrong length, an unknown
    kind, sliding layers without a window or a window < 1 raise ValueError.
    """
    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "arch", check_architecture(self.arch))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        self._normalise_windows()

    def _normalise_windows(self):
        """Check `sliding_window` / `layer_types` and store them in one canonical form, so that equal
        layouts give equal (and equally hashed) configs: ``layer_types`` is None whenever every
        layer is alike, and ``sliding_window`` is None when no layer uses it."""
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or int(w) != w or w < 1):
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {w!r}")
        w = None if w is None else int(w)
        types = self.layer_types
        if types is not None:
            types = tuple(types)
            if len(types) != self.num_layers:
                raise ValueError(f"layer_types lists {len(types)} layers but the model has num_layers="
                                 f"{self.num_layers}; give one entry per layer")
            bad = sorted({t for t in types if t not in LAYER_TYPES})
            if bad:
                raise ValueError(f"unsupported layer type(s) {bad}; supported: {', '.join(LAYER_TYPES)}")
            if w is None and "sliding_attention" in types:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None; "
                                 "give the window size")
            if len(set(types)) == 1:  # uniform: the same as no list
                w = w if types[0] == "sliding_attention" else None
                types = None
        object.__setattr__(self, "sliding_window", w)
        object.__setattr__(self, "layer_types", types)

    @property
    def qk_norm(self) -> bool:
        """Whether each attention layer applies an RMSNorm (weight [head_dim], eps
        ``rms_norm_eps``) to every query head and every key head before RoPE (Qwen3's ``q_norm``
        / ``k_norm``; params ``attn/q_norm/scale`` and ``attn/k_norm/scale``)."""
        return self.arch == "qwen3"

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias: llama and qwen3 with
        ``attention_bias`` (transformers' ``LlamaAttention`` and ``Qwen3Attention`` give o_proj
        ``bias=attention_bias``, as q/k/v). Qwen2 never has one; mistral has no biases."""
        return self.attention_bias and self.arch in ("llama", "qwen3")

    @property
    def layer_windows(self) -> Tuple[Optional[int], ...]:
        """Per layer, the sliding window in tokens (a query at position p sees keys at positions
        p - window + 1 .. p) or None for full causal attention; ``num_layers`` entries."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        RoPE theta is read from ``rope_parameters['rope_theta']`` (transformers >= 5, which prefers
        it) or, without it, from ``rope_theta``. Keys a config leaves out take the family's
        defaults in transformers (`FAMILY_DEFAULTS`); q/k/v biases follow the family (Qwen2 always
        has them, Mistral never) whatever ``attention_bias`` says, as transformers builds them. ``head_dim`` defaults to
        hidden_size // num_attention_heads, except for qwen3 (`QWEN3_DEFAULT_HEAD_DIM`, as
        ``Qwen3Config``). Raises
        `UnsupportedArchitectureError` for a ``model_type`` outside `SUPPORTED_ARCHITECTURES`, or
        a variant of one that `models.llama` does not compute (`check_supported_variant`: an
        activation other than SiLU, MLP biases), and ValueError for an unsupported RoPE scaling
        type or a sliding-window layout that transformers cannot run either (see
        `sliding_layout_from_hf`).
        """
        arch = check_architecture(cfg.get("model_type") or model_type_of(cfg.get("architectures")), source)
        check_supported_variant(cfg, source)
        check_sizes(cfg, arch, source)
        rope_params = cfg.get("rope_parameters") or {}
        theta = rope_params.get("rope_theta")  # transformers 5's home for it, and what it reads first
        if theta is None:
            theta = cfg.get("rope_theta")
        if theta is None:
            theta = 10000.0
        scaling_dict = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_layers = int(cfg["num_hidden_layers"])
        window, layer_types = sliding_layout_from_hf(arch, cfg, num_layers, source)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            head_dim = QWEN3_DEFAULT_HEAD_DIM if arch == "qwen3" else 0
        max_positions = int(cfg.get("max_position_embeddings") or FAMILY_DEFAULTS[arch]["max_position_embeddings"])
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=kv_heads_of(cfg, arch),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling_from_dict(scaling_dict, max_positions, source),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias={"qwen2": True, "mistral": False}.get(arch, bool(cfg.get("attention_bias", False))),
            sliding_window=window,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """The inverse of `from_hf_dict`, used by tests to build transformers reference models.

        Raises ValueError for a layout the family's HF config cannot express (a window on a llama
        model, per-layer kinds on a mistral one)."""
        d = {
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.arch in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        inexpressible = (self.arch == "llama" and self.sliding_window is not None) or (
            self.arch == "mistral" and self.layer_types is not None)
        if inexpressible:
            raise ValueError(f"transformers' {self.arch} config cannot express this sliding-window layout "
                             f"(window {self.sliding_window}, layer_types {self.layer_types})")
        if self.arch == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.arch in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0
            d["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            scaling = {"rope_type": rs.kind, "factor": rs.factor}
            if rs.kind == "llama3":
                scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                               original_max_position_embeddings=rs.original_max_position_embeddings)
            d["rope_scaling"] = scaling
        return d

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def sliding_layout_from_hf(arch: str, cfg: Mapping[str, Any], num_layers: int,
                           source: str = "config.json") -> Tuple[Optional[int], Optional[Tuple[str, ...]]]:
    """(sliding_window, layer_types) for `ModelConfig` from an HF config dict, as transformers
    (5.x) runs each family:

    - llama: no window; ``LlamaModel`` ignores ``sliding_window`` and ``layer_types``.
    - mistral: ``sliding_window`` (4096 when the key is absent, as in ``MistralConfig``; null: no
      window) on every layer; ``layer_types`` is ignored, as ``MistralModel`` ignores it.
    - qwen2, qwen3: the window is ``sliding_window`` (default 4096) only when
      ``use_sliding_window`` is true; ``layer_types`` (legacy "attention" read as
      "full_attention") or, without it, layers at index >= ``max_window_layers`` (default 28) use
      it (``Qwen2Config.__post_init__``; ``Qwen3Config.__post_init__`` is the same).

    Raises ValueError (naming `source`) for what transformers cannot run either: a ``layer_types``
    list of the wrong length, a kind other than full_attention / sliding_attention, sliding layers
    listed while the window is off, or a window < 1.
    """
    def refuse(why: str) -> ValueError:
        return ValueError(f"{source}: unsupported sliding-window layout: {why}")

    if arch == "llama":
        return None, None
    window = cfg.get("sliding_window", 4096)
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise refuse(f"sliding_window must be a positive integer or null, got {window!r}")
    if arch == "mistral":
        return window, None
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    types = tuple("full_attention" if t == "attention" else t for t in types)
    if len(types) != num_layers:
        raise refuse(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise refuse(f"layer type(s) {bad}; medusa_jax runs {', '.join(LAYER_TYPES)}")
    if window is None and "sliding_attention" in types:
        raise refuse("layer_types lists sliding_attention layers but the window is off "
                     "(use_sliding_window false or sliding_window null); set both, or make every "
                     "layer full_attention")
    return window, types


def rope_scaling_from_dict(d: Optional[Mapping[str, Any]], max_position_embeddings: Optional[int] = None,
                           source: str = "config.json") -> Optional[RopeScaling]:
    """Parse an HF ``rope_scaling`` (or transformers 5's ``rope_parameters``) dict; None or type
    "default" gives None. A llama3 scaling without ``original_max_position_embeddings`` takes the
    model's `max_position_embeddings`, as transformers does (8192 when that is unknown too).

    Raises ValueError (naming `source`) for a scaling type other than "llama3" or "linear".
    """
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"{source}: RoPE scaling {kind!r} (rope_scaling / rope_parameters) is not supported; "
                         "supported: llama3, linear. Loading the model without it would decode wrongly, so it "
                         "is refused")
    original = d.get("original_max_position_embeddings") or max_position_embeddings or 8192
    return RopeScaling(
        kind=kind,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )
