"""Frozen, hashable configuration dataclasses.

`ModelConfig` describes a Llama-family backbone (Llama, Mistral, Qwen2). It is hashable so it can
be a static argument of jitted functions, and it is built from a Hugging Face ``config.json``
(`ModelConfig.from_hf_dict`) or from GGUF metadata (`medusa_jax.convert.gguf`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

#: Architectures the backbone implements, keyed by HF ``model_type``.
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = ("llama", "mistral", "qwen2")


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
    def layer_windows(self) -> Tuple[Optional[int], ...]:
        """Per layer, the sliding window in tokens (a query at position p sees keys at positions
        p - window + 1 .. p) or None for full causal attention; ``num_layers`` entries."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        RoPE theta is read from ``rope_theta`` or, when that is missing or None, from
        ``rope_parameters['rope_theta']`` (transformers >= 5). Raises
        `UnsupportedArchitectureError` for a ``model_type`` outside `SUPPORTED_ARCHITECTURES`,
        and ValueError for an unsupported RoPE scaling type or a sliding-window layout that
        transformers cannot run either (see `sliding_layout_from_hf`).
        """
        arch = check_architecture(cfg.get("model_type", ""), source)
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta")
        if theta is None:
            theta = rope_params.get("rope_theta", 10000.0)
        scaling_dict = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_layers = int(cfg["num_hidden_layers"])
        window, layer_types = sliding_layout_from_hf(arch, cfg, num_layers, source)
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=int(cfg.get("head_dim") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling_from_dict(scaling_dict),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
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
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
        inexpressible = (self.arch == "llama" and self.sliding_window is not None) or (
            self.arch == "mistral" and self.layer_types is not None)
        if inexpressible:
            raise ValueError(f"transformers' {self.arch} config cannot express this sliding-window layout "
                             f"(window {self.sliding_window}, layer_types {self.layer_types})")
        if self.arch == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.arch == "qwen2":
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
    - qwen2: the window is ``sliding_window`` (default 4096) only when ``use_sliding_window`` is
      true; ``layer_types`` (legacy "attention" read as "full_attention") or, without it, layers at
      index >= ``max_window_layers`` (default 28) use it (``Qwen2Config.__post_init__``).

    Raises ValueError (naming `source`) for what transformers cannot run either: a ``layer_types``
    list of the wrong length, a kind other than full_attention / sliding_attention, sliding layers
    listed while the window is off, or a window < 1.
    """
    def refuse(why: str) -> ValueError:
        return ValueError(f"{source}: unsupported sliding-window layout: {why}")

    if arch == "llama":
        return None, None
    window = cfg.get("sliding_window", 4096)
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
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


#: MedusaConfig.head_type values: "medusa" = the paper's heads (Cai et al. 2024, Sec. 2.1.1: head k
#: reads h_t only); "hydra" = sequentially dependent heads (Ankner et al. 2024, "Hydra", Sec. 3: head k
#: also reads the embeddings of the tokens on its path, root first; `medusa_jax.hydra`).
HEAD_TYPES: Tuple[str, ...] = ("medusa", "hydra")


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads (Cai et al. 2024, Sec. 2.1.1), or Hydra heads (Ankner et al. 2024).

    num_heads: K; head k (0-based) reads the hidden state at t and predicts token t+k+2.
    num_layers: residual blocks ``x + silu(W x + b)`` per head (hydra: >= 1; the first block also
      reads the path's token embeddings, see `medusa_jax.hydra`).
    head_type: "medusa" (head k reads h_t only) or "hydra" (head k reads h_t and the embeddings of
      tokens t+1..t+k+1 on its path; a tree node's children are then proposed from that node's
      own path, depth by depth).
    shared_lm_head: True: the heads end in the base model's frozen lm_head (the official format's
      ``"version": "2"`` variant); False: each head has its own copy ([K, D, V] extra params).
    topk: candidates taken from each head (ranks in medusa_choices are < topk).
    medusa_choices: the tree as a tuple of rank paths, or None for the default preset.
    base_model: name or path of the backbone the heads were trained for (informational).
    proposal_vocab_size: 0 = the heads propose from the whole vocabulary; N > 0 = only from N
      frequent tokens (params ``proposal_ids [N]``), which cuts the heads' vocabulary projection
      per step by V / N (vLLM's ``truncated_vocab_size``). Verification always uses the full
      vocabulary, so the output does not change; only rare tokens are never proposed.
    """
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    topk: int = 10
    medusa_choices: Optional[Tuple[Tuple[int, ...], ...]] = None
    base_model: str = ""
    proposal_vocab_size: int = 0
    head_type: str = "medusa"

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        if self.head_type == "hydra" and self.num_layers < 1:
            raise ValueError("hydra heads need num_layers >= 1: their first block reads the path's token "
                             "embeddings (Ankner et al. 2024, Sec. 3)")
        if not 0 <= self.proposal_vocab_size <= self.vocab_size:
            raise ValueError(f"proposal_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                             f"got {self.proposal_vocab_size}")
        if self.proposal_vocab_size and self.topk > self.proposal_vocab_size:
            raise ValueError(f"topk={self.topk} exceeds proposal_vocab_size={self.proposal_vocab_size}")
        if self.medusa_choices is not None:
            object.__setattr__(self, "medusa_choices",
                               tuple(tuple(int(r) for r in path) for path in self.medusa_choices))

    def replace(self, **kw) -> "MedusaConfig":
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------------- training

#: TrainConfig.mode values: "frozen" = Medusa-1 (heads only, Sec. 2.2.1 of the Medusa paper),
#: "joint" = Medusa-2 (backbone and heads, Sec. 2.2.2).
TRAIN_MODES: Tuple[str, ...] = ("frozen", "joint")
#: TrainConfig.loss_targets values: "hard" = the data's tokens; "soft" = the backbone's distribution.
LOSS_TARGETS: Tuple[str, ...] = ("hard", "soft")


class TrainConfigError(ValueError):
    """A training config with an unknown key, a value of the wrong type or an invalid value."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything `train.py` / `medusa_jax.train.trainer.train` needs; built from YAML.

    Load with `TrainConfig.from_yaml(path, overrides=["steps=10", ...])`; every key of the YAML
    file is a field below (unknown keys raise `TrainConfigError`). Sources: Cai et al. 2024,
    "Medusa", Sec. 2.2 (Medusa-1 / Medusa-2 training) and Sec. 2.3.2 (self-distillation).

    Backbone:
      model: path of an HF directory or GGUF file; None: the default SmolLM2-135M-Instruct GGUF
        (`medusa_jax.loading.load_model`); "random": a tiny random backbone built in-process from
        the ``random_*`` fields (tests, CI).
      random_vocab_size, random_hidden_size, random_intermediate_size, random_num_layers,
      random_num_heads, random_num_kv_heads: sizes of the "random" backbone (Llama, untied
        embeddings).
      random_init_std: std of the random backbone's token embedding (normal); the other params
        keep Flax's default init. A large embedding keeps the current token visible in the
        hidden state.
    Data:
      data: a self-distillation directory (``samples.jsonl`` from ``python -m
        medusa_jax.train.distill``), or "synthetic": sequences that follow a random permutation f
        of the vocabulary (x[t+1] = f(x[t])), so that token t+k+2 = f^(k+2)(token t) is a
        deterministic function of token t.
      synthetic_num_sequences, synthetic_seq_len, synthetic_prompt_len: size of the synthetic set;
        the first synthetic_prompt_len tokens of each sequence are masked out like a prompt.
      val_fraction: fraction of the sequences held out for validation (split by sequence).
      max_seq_len: sequences are truncated to this many tokens.
      max_val_positions: cap on validation positions used per evaluation (0: all).
    Heads (`MedusaConfig`):
      num_heads: K; head k predicts token t+k+2. num_layers: residual blocks per head.
      shared_lm_head: heads end in the base lm_head, frozen and shared (True) or in their own
        copies of it, trained (False).
      topk: candidates per head at decoding time (stored with the exported heads).
      tree: tree stored with the exported heads: None (none), a preset name of
        `medusa_jax.tree.PRESETS`, a tree file, or "search" (greedy search from the final
        validation rank accuracies, Medusa Sec. 3.3.1, with tree_nodes tree tokens).
      tree_nodes: tree tokens (root included) for tree="search".
      head_type: "medusa" (the paper's heads: head k reads h_t) or "hydra" (Ankner et al. 2024:
        head k also reads the embeddings of tokens t+1..t+k+1, trained with teacher forcing on the
        data's true tokens; `medusa_jax.hydra`).
      init_heads: a heads directory (`load_heads`) to start from instead of fresh heads (e.g. the
        Medusa-1 heads before joint training); None: fresh heads (zero blocks, which reproduce the
        base model's next-token logits). Its K, L and shared_lm_head must match the fields above;
        Medusa heads may start hydra heads (their path weights start at zero: the same heads).
      proposal_vocab: 0 = the heads' loss is over the whole vocabulary; N > 0 = over the N most
        frequent training tokens only (`medusa_jax.heads.frequent_tokens`), the proposal
        vocabulary the exported heads then decode with (``proposal_ids``): the vocabulary
        projection, most of a step, costs N/V as much. Labels outside it are left out of the loss
        and count as misses in the validation accuracies (decoding cannot propose them either).
        Frozen mode with a shared lm_head only.
    Targets:
      loss_targets: "hard" (cross-entropy on the data's token t+k+2) or "soft" (KL divergence from
        the backbone's own distribution over token t+k+2, softmax(h_{t+k+1} @ lm_head /
        soft_temperature), computed from the same hidden states: no extra backbone pass).
      soft_temperature: temperature T > 0 of the soft targets (T > 1 flattens them).
      loop_ngram: a training position is inside a repetition loop when the `loop_ngram` tokens
        ending at its root token t+1 already occurred earlier in the sequence
        (`medusa_jax.train.data.repetition_mask`).
      loop_weight: fraction in [0, 1] of the loop positions kept for training (a fixed random
        draw): 1 keeps all, 0 drops them. Validation keeps them all and also reports
        val_noloop_top1/top5 on the positions outside loops.
    Optimisation (Optax AdamW, linear warm-up then cosine decay, global-norm clipping):
      mode: "frozen" (Medusa-1: only the heads train; the backbone's hidden states are computed
        once) or "joint" (Medusa-2: backbone and heads).
      steps: optimizer steps in total (in joint mode heads_warmup_steps of them are heads-only).
      batch_size: training positions per step in frozen mode; sequences per step in joint mode.
      learning_rate: peak learning rate of the backbone (joint); the heads' is learning_rate *
        heads_lr_multiplier (both modes).
      heads_lr_multiplier: learning-rate multiplier of the heads.
      warmup_steps: linear warm-up steps from 0 to the peak (per parameter group; the backbone's
        schedule starts after heads_warmup_steps).
      min_lr_ratio: the cosine decay ends at peak * min_lr_ratio.
      weight_decay: AdamW decoupled weight decay (not applied to biases and norm scales).
      adam_b1, adam_b2, adam_eps: AdamW moments and epsilon.
      grad_clip: clip gradients to this global norm (0: no clipping).
      loss_decay: head k's loss weight is loss_decay**k (Medusa's lambda_k = 0.8^k).
      head_matmul_dtype: "float32" or "bfloat16": input dtype of the heads' vocabulary projection
        during training (float32 accumulation, softmax and loss in float32 either way);
        bfloat16 halves the lm_head's memory and made the loss with its gradient 1.46x faster on
        the project's 2-core AVX512-BF16 CPU (`shared_head_loss`, docs/performance.md).
      loss_chunk: positions per chunk of the heads' vocabulary projection (0: whole batch at once);
        bounds memory at about 3 * K * loss_chunk * V floats (5 * K * loss_chunk * V with soft targets).
      lambda_base: weight of the backbone's own loss in joint mode; the heads' summed loss has
        weight 1. Medusa-2 (Sec. 2.2.2) writes L_LM + lambda_0 * L_heads with lambda_0 = 0.2, the
        same up to a constant factor as lambda_base = 5.
      base_loss: backbone loss in joint mode: "ce" (cross-entropy on the data's next tokens) or
        "kl" (KL divergence from the frozen original model's distribution, suits self-distilled data).
      heads_warmup_steps: joint mode: heads-only steps before the backbone trains (Medusa-2's
        two-stage recipe).
    Run:
      out_dir: where metrics, plots, checkpoints and the exported heads go.
      seed: seed of the split, the data order (per epoch, from seed and epoch) and the random
        backbone.
      hidden_batch_tokens: frozen mode: tokens per batch when computing the hidden states once.
      cache_hidden: frozen mode: keep the computed hidden states in out_dir/hidden (numpy), reused
        when resuming.
      hidden_dir: where that cache lives instead of out_dir/hidden, so that runs of other head
        types or targets on the same backbone, data and num_heads share it (a cache is used only when
        its fingerprint matches; None: out_dir/hidden).
      log_every: steps between metrics lines (mean of the steps since the last line).
      eval_every: steps between validation evaluations (0: only at the end).
      checkpoint_every: steps between Orbax checkpoints (0: only at the end).
      keep_checkpoints: how many checkpoints to keep.
      save_backbone: joint mode: also save the trained backbone params (numpy .npz) to out_dir.
      mesh: ``"DATAxMODEL"``, the device mesh the training steps run on (`medusa_jax.sharding`:
        the batch split on 'data', heads and backbone Megatron-style on 'model'); "1x1": one
        device. Results equal one device's up to float32 round-off, so a run may resume on
        another mesh.
    """
    # backbone
    model: Optional[str] = None
    random_vocab_size: int = 64
    random_hidden_size: int = 64
    random_intermediate_size: int = 128
    random_num_layers: int = 2
    random_num_heads: int = 4
    random_num_kv_heads: int = 2
    random_init_std: float = 1.0
    # data
    data: str = "data/distill/smollm2"
    synthetic_num_sequences: int = 256
    synthetic_seq_len: int = 32
    synthetic_prompt_len: int = 4
    val_fraction: float = 0.02
    max_seq_len: int = 1024
    max_val_positions: int = 4096
    # heads
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    topk: int = 10
    tree: Optional[str] = None
    tree_nodes: int = 16
    init_heads: Optional[str] = None
    head_type: str = "medusa"
    loss_targets: str = "hard"
    soft_temperature: float = 1.0
    loop_ngram: int = 32
    loop_weight: float = 1.0
    proposal_vocab: int = 0
    # optimisation
    mode: str = "frozen"
    steps: int = 1000
    batch_size: int = 256
    learning_rate: float = 1e-3
    heads_lr_multiplier: float = 1.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    loss_decay: float = 0.8
    head_matmul_dtype: str = "float32"
    loss_chunk: int = 0
    lambda_base: float = 5.0
    base_loss: str = "ce"
    heads_warmup_steps: int = 0
    # run
    out_dir: str = "runs/medusa"
    seed: int = 0
    hidden_batch_tokens: int = 4096
    cache_hidden: bool = True
    hidden_dir: Optional[str] = None
    log_every: int = 10
    eval_every: int = 200
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    save_backbone: bool = True
    mesh: str = "1x1"

    def __post_init__(self):
        problems = []
        try:
            from .sharding import parse_mesh
            parse_mesh(self.mesh)
        except ValueError as e:
            problems.append(f"mesh: {e}")
        if self.mode not in TRAIN_MODES:
            problems.append(f"mode must be one of {TRAIN_MODES}, got {self.mode!r}")
        if self.head_matmul_dtype not in ("float32", "bfloat16"):
            problems.append(f"head_matmul_dtype must be 'float32' or 'bfloat16', got {self.head_matmul_dtype!r}")
        if self.base_loss not in ("ce", "kl"):
            problems.append(f"base_loss must be 'ce' or 'kl', got {self.base_loss!r}")
        if self.head_type not in HEAD_TYPES:
            problems.append(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        elif self.head_type == "hydra" and self.num_layers < 1:
            problems.append("head_type 'hydra' needs num_layers >= 1 (the first block reads the path embeddings)")
        if self.loss_targets not in LOSS_TARGETS:
            problems.append(f"loss_targets must be one of {LOSS_TARGETS}, got {self.loss_targets!r}")
        if self.proposal_vocab < 0:
            problems.append(f"proposal_vocab must be >= 0, got {self.proposal_vocab}")
        elif self.proposal_vocab and (self.mode != "frozen" or not self.shared_lm_head):
            problems.append("proposal_vocab needs mode 'frozen' and shared_lm_head true (it restricts the shared, "
                            "frozen lm_head); set proposal_vocab: 0")
        elif self.proposal_vocab and self.topk > self.proposal_vocab:
            problems.append(f"topk={self.topk} exceeds proposal_vocab={self.proposal_vocab}")
        if not 0.0 <= self.loop_weight <= 1.0:
            problems.append(f"loop_weight must be in [0, 1], got {self.loop_weight}")
        if not self.soft_temperature > 0:
            problems.append(f"soft_temperature must be > 0, got {self.soft_temperature}")
        for name in ("steps", "batch_size", "num_heads", "max_seq_len", "hidden_batch_tokens", "log_every",
                     "keep_checkpoints", "topk", "tree_nodes", "loop_ngram"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_layers", "warmup_steps", "heads_warmup_steps", "eval_every", "checkpoint_every",
                     "loss_chunk", "max_val_positions", "synthetic_prompt_len"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.learning_rate <= 0 or self.heads_lr_multiplier <= 0:
            problems.append("learning_rate and heads_lr_multiplier must be > 0")
        if self.mode == "joint" and self.heads_warmup_steps >= self.steps:
            problems.append(f"heads_warmup_steps ({self.heads_warmup_steps}) must be < steps ({self.steps})")
        if problems:
            raise TrainConfigError("invalid training config: " + "; ".join(problems))

    # ---- loading

    @classmethod
    def field_types(cls) -> dict:
        """{field name: (base type, optional)} for every field, used to coerce YAML values."""
        out = {}
        for f in dataclasses.fields(cls):
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            optional = t.startswith("Optional[")
            base = t[len("Optional["):-1] if optional else t
            out[f.name] = ({"int": int, "float": float, "bool": bool, "str": str}[base], optional)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config",
                  sources: Optional[Mapping[str, str]] = None) -> "TrainConfig":
        """Build from a mapping, coercing each value to its field's type.

        Ints are accepted for float fields, "1e-3"-style strings for numbers, "true"/"false" for
        booleans, and null / "none" for Optional fields.
        Args:
          d: {field name: value}.
          source: where the values came from, named in error messages.
          sources: {field name: where that value came from} for keys whose origin differs from
            `source` (e.g. ``"--set steps=x"``).
        Raises:
          TrainConfigError: an unknown key (naming where it came from and the closest known keys),
            a value of the wrong type, or an invalid value (see the field docs).
        """
        types = cls.field_types()
        where = lambda k: (sources or {}).get(k, source)
        for k in d:
            if k not in types:
                raise TrainConfigError(unknown_key_message(k, types, where(k)))
        kw = {k: _coerce(k, v, *types[k], where(k)) for k, v in d.items()}
        return cls(**kw)

    @classmethod
    def from_yaml(cls, path: Optional[str] = None, overrides: Tuple[str, ...] = (),
                  overrides_label: str = "--set") -> "TrainConfig":
        """Load a YAML file (a mapping of fields; None: all defaults) and apply ``key=value`` overrides.

        Override values are parsed as YAML scalars (``steps=10``, ``model=null``,
        ``learning_rate=3e-4``) and win over the file. Errors about a file key name the file and
        the key's line; errors about an override name ``overrides_label`` and the override.
        Raises:
          FileNotFoundError: no such file. TrainConfigError: not a mapping, an override without
            '=', or any `from_dict` error.
        """
        import yaml

        d: dict = {}
        sources: dict = {}
        if path is not None:
            with open(path) as f:
                text = f.read()
            loaded = yaml.safe_load(text)
            if loaded is not None and not isinstance(loaded, dict):
                raise TrainConfigError(f"{path}: expected a mapping of training config fields, got "
                                       f"{type(loaded).__name__}")
            d.update(loaded or {})
            sources.update({k: _yaml_key_location(path, text, k) for k in d})
        for item in overrides:
            if "=" not in item:
                raise TrainConfigError(f"{overrides_label} {item!r}: expected KEY=VALUE, e.g. "
                                       f"{overrides_label} steps=100")
            k, v = item.split("=", 1)
            k = k.strip()
            d[k] = yaml.safe_load(v) if v.strip() else ""
            sources[k] = f"{overrides_label} {item}"
        return cls.from_dict(d, source=path or "config", sources=sources)

    def to_dict(self) -> dict:
        """All fields as a plain dict (JSON / YAML serialisable)."""
        return dataclasses.asdict(self)

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)


def unknown_key_message(key: str, known, source: str) -> str:
    """The error message for an unknown training config key: where it came from and the closest
    known keys (`difflib.get_close_matches`), never the whole list of keys."""
    import difflib

    close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close else
            "no known key is close to it")
    return (f"{source}: unknown training config key {key!r}; {hint} (`train.py --print-config` lists every "
            "key; medusa_jax.config.TrainConfig documents them)")


def _yaml_key_location(path: str, text: str, key: str) -> str:
    """``"path, line N"`` of a top-level YAML key (plain ``key:`` lines only), or just the path."""
    import re

    for n, line in enumerate(text.splitlines(), 1):
        if re.match(rf"{re.escape(str(key))}\s*:", line):
            return f"{path}, line {n}"
    return path


def _coerce(key: str, value: Any, typ: type, optional: bool, source: str) -> Any:
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if optional:
            return None
        raise TrainConfigError(f"{source}: {key} may not be null")
    bad = TrainConfigError(f"{source}: {key} must be {typ.__name__}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes")
        raise bad
    if typ is str:
        if isinstance(value, (dict, list, bool)):
            raise bad
        return str(value)
    if isinstance(value, bool):
        raise bad
    try:
        num = float(value) if isinstance(value, str) else value
    except ValueError:
        raise bad from None
    if typ is int:
        if not isinstance(num, (int, float)) or float(num) != int(num):
            raise bad
        return int(num)
    if not isinstance(num, (int, float)):
        raise bad
    return float(num)
