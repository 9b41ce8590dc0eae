"""Frozen, hashable configuration dataclasses.

`ModelConfig` describes a Llama-family backbone (Llama, Mistral, Qwen2). It is hashable so it can
be a static argument of jitted functions, and it is built from a Hugging Face ``config.json``
(`ModelConfig.from_hf_dict`) or from GGUF metadata (`medusa_jax.convert.gguf`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

#: Architectures the backbone implements, keyed by HF ``model_type``.
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = ("llama", "mistral", "qwen2")


class UnsupportedArchitectureError(ValueError):
    """Raised for a checkpoint whose architecture is not in `SUPPORTED_ARCHITECTURES`."""


def check_architecture(name: str, source: str = "") -> str:
    """Return the normalised architecture name or raise `UnsupportedArchitectureError`.

    Args:
      name: an HF ``model_type`` (e.g. "llama") or GGUF ``general.architecture``.
      source: where the name came from, for the message.
    """
    norm = (name or "").lower()
    if norm not in SUPPORTED_ARCHITECTURES:
        where = f" in {source}" if source else ""
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}{where}; medusa_jax supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama family). Convert a model of one of these.")
    return norm


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
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "arch", check_architecture(self.arch))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        RoPE theta is read from ``rope_theta`` or, when that is missing or None, from
        ``rope_parameters['rope_theta']`` (transformers >= 5). Raises
        `UnsupportedArchitectureError` for a ``model_type`` outside `SUPPORTED_ARCHITECTURES`,
        and ValueError for an unsupported RoPE scaling type.
        """
        arch = check_architecture(cfg.get("model_type", ""), source)
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta")
        if theta is None:
            theta = rope_params.get("rope_theta", 10000.0)
        scaling_dict = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window") if arch == "mistral" or cfg.get("use_sliding_window") else None
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=int(cfg.get("head_dim") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling_from_dict(scaling_dict),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """The inverse of `from_hf_dict`, used by tests to build transformers reference models."""
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
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
        if self.arch == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.arch == "qwen2" and self.sliding_window:
            d["use_sliding_window"] = True
            d["sliding_window"] = self.sliding_window
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


def rope_scaling_from_dict(d: Optional[Mapping[str, Any]]) -> Optional[RopeScaling]:
    """Parse an HF ``rope_scaling`` dict; None or type "default" gives None.

    Raises ValueError for a scaling type other than "llama3" or "linear".
    """
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, linear")
    return RopeScaling(
        kind=kind,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads (Cai et al. 2024, Sec. 2.1.1).

    num_heads: K; head k (0-based) reads the hidden state at t and predicts token t+k+2.
    num_layers: residual blocks ``x + silu(W x + b)`` per head.
    shared_lm_head: True: the heads end in the base model's frozen lm_head (the official format's
      ``"version": "2"`` variant); False: each head has its own copy ([K, D, V] extra params).
    topk: candidates taken from each head (ranks in medusa_choices are < topk).
    medusa_choices: the tree as a tuple of rank paths, or None for the default preset.
    base_model: name or path of the backbone the heads were trained for (informational).
    """
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    topk: int = 10
    medusa_choices: Optional[Tuple[Tuple[int, ...], ...]] = None
    base_model: str = ""

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.medusa_choices is not None:
            object.__setattr__(self, "medusa_choices",
                               tuple(tuple(int(r) for r in path) for path in self.medusa_choices))

    def replace(self, **kw) -> "MedusaConfig":
        return dataclasses.replace(self, **kw)
