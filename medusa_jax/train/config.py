"""The training configuration: `TrainConfig`, built from YAML (`TrainConfig.from_yaml`), every field
documented beside it."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import yaml

from medusa_jax.decoding.tree import get_tree
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.sharding import parse_mesh

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
    file is a field below, documented beside it (unknown keys raise `TrainConfigError`). Sources:
    Cai et al. 2024, "Medusa", Sec. 2.2 (Medusa-1 / Medusa-2 training) and Sec. 2.3.2
    (self-distillation). The heads' fields are checked by `MedusaConfig` itself.
    """
    # ---- backbone
    #: path of an HF directory or GGUF file; None: the default SmolLM2-135M-Instruct GGUF
    #: (`medusa_jax.convert.load.load_model`); "random": a tiny random backbone built in-process
    #: from the ``random_*`` fields (tests, CI).
    model: Optional[str] = None
    #: sizes of the "random" backbone (Llama, untied embeddings).
    random_vocab_size: int = 64
    random_hidden_size: int = 64
    random_intermediate_size: int = 128
    random_num_layers: int = 2
    random_num_heads: int = 4
    random_num_kv_heads: int = 2
    #: std of the random backbone's token embedding (normal); the other params keep Flax's default
    #: init. A large embedding keeps the current token visible in the hidden state.
    random_init_std: float = 1.0

    # ---- data
    #: a self-distillation directory (``samples.jsonl`` from ``medusa-distill``), or "synthetic":
    #: sequences that follow a random permutation f of the vocabulary (x[t+1] = f(x[t])), so that
    #: token t+k+2 = f^(k+2)(token t) is a deterministic function of token t.
    data: str = "data/distill/smollm2"
    #: size of the synthetic set; the first synthetic_prompt_len tokens of each sequence are masked
    #: out like a prompt.
    synthetic_num_sequences: int = 256
    synthetic_seq_len: int = 32
    synthetic_prompt_len: int = 4
    #: fraction of the sequences held out for validation (split by sequence), in [0, 1).
    val_fraction: float = 0.02
    #: sequences are truncated to this many tokens.
    max_seq_len: int = 1024
    #: cap on validation positions used per evaluation (0: all).
    max_val_positions: int = 4096

    # ---- heads (`MedusaConfig`)
    #: K; head k predicts token t+k+2.
    num_heads: int = 4
    #: residual blocks per head.
    num_layers: int = 1
    #: heads end in the base lm_head, frozen and shared (True) or in their own copies of it,
    #: trained (False).
    shared_lm_head: bool = True
    #: candidates per head at decoding time (stored with the exported heads).
    topk: int = 10
    #: tree stored with the exported heads: None (none), a preset name of
    #: `medusa_jax.decoding.tree.PRESETS`, a tree file, or "search" (greedy search from the final
    #: validation rank accuracies, Medusa Sec. 3.3.1, with tree_nodes tree tokens). A name or file is
    #: resolved when the config is built (`get_tree` with topk and num_heads, as the export does), so
    #: an unknown one, or one deeper than num_heads, is refused before training.
    tree: Optional[str] = None
    #: tree tokens (root included) for tree="search".
    tree_nodes: int = 16
    #: a heads directory (`load_heads`) to start from instead of fresh heads (e.g. the Medusa-1
    #: heads before joint training); None: fresh heads (zero blocks, which reproduce the base
    #: model's next-token logits). Its K, L and shared_lm_head must match the fields above; Medusa
    #: heads may start hydra heads (their path weights start at zero: the same heads).
    init_heads: Optional[str] = None
    #: "medusa" (the paper's heads: head k reads h_t) or "hydra" (Ankner et al. 2024: head k also
    #: reads the embeddings of tokens t+1..t+k+1, trained with teacher forcing on the data's true
    #: tokens; `medusa_jax.heads.hydra`).
    head_type: str = "medusa"
    #: "hard" (cross-entropy on the data's token t+k+2) or "soft" (KL divergence from the
    #: backbone's own distribution over token t+k+2, softmax(h_{t+k+1} @ lm_head /
    #: soft_temperature), computed from the same hidden states: no extra backbone pass).
    loss_targets: str = "hard"
    #: temperature T > 0 of the soft targets (T > 1 flattens them).
    soft_temperature: float = 1.0
    #: a training position is inside a repetition loop when the `loop_ngram` tokens ending at its
    #: root token t+1 already occurred earlier in the sequence
    #: (`medusa_jax.train.data.repetition_mask`).
    loop_ngram: int = 32
    #: fraction in [0, 1] of the loop positions kept for training (a fixed random draw): 1 keeps
    #: all, 0 drops them. Validation keeps them all and also reports val_noloop_top1/top5 on the
    #: positions outside loops.
    loop_weight: float = 1.0
    #: 0 = the heads' loss is over the whole vocabulary; N > 0 = over the N most frequent training
    #: tokens only (`medusa_jax.heads.medusa.frequent_tokens`), the proposal vocabulary the exported
    #: heads then decode with (``proposal_ids``): the vocabulary projection, most of a step, costs
    #: N/V as much. Labels outside it are left out of the loss and count as misses in the
    #: validation accuracies (decoding cannot propose them either). Frozen mode with a shared
    #: lm_head only.
    proposal_vocab: int = 0

    # ---- optimisation (Optax AdamW, linear warm-up then cosine decay, global-norm clipping)
    #: "frozen" (Medusa-1: only the heads train; the backbone's hidden states are computed once) or
    #: "joint" (Medusa-2: backbone and heads).
    mode: str = "frozen"
    #: optimizer steps in total (in joint mode heads_warmup_steps of them are heads-only).
    steps: int = 1000
    #: training positions per step in frozen mode; sequences per step in joint mode.
    batch_size: int = 256
    #: peak learning rate of the backbone (joint); the heads' is learning_rate *
    #: heads_lr_multiplier (both modes).
    learning_rate: float = 1e-3
    #: learning-rate multiplier of the heads.
    heads_lr_multiplier: float = 1.0
    #: linear warm-up steps from 0 to the peak (per parameter group; the backbone's schedule starts
    #: after heads_warmup_steps).
    warmup_steps: int = 50
    #: the cosine decay ends at peak * min_lr_ratio.
    min_lr_ratio: float = 0.1
    #: AdamW decoupled weight decay (not applied to biases and norm scales).
    weight_decay: float = 0.0
    #: AdamW moments and epsilon.
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    #: clip gradients to this global norm (0: no clipping).
    grad_clip: float = 1.0
    #: head k's loss weight is loss_decay**k (Medusa's lambda_k = 0.8^k).
    loss_decay: float = 0.8
    #: "float32" or "bfloat16": input dtype of the heads' vocabulary projection during training
    #: (float32 accumulation, softmax and loss in float32 either way); bfloat16 halves the lm_head's
    #: memory and made the loss with its gradient 1.46x faster on the project's 2-core AVX512-BF16
    #: CPU (`shared_head_loss`, docs/performance.md).
    head_matmul_dtype: str = "float32"
    #: positions per chunk of the heads' vocabulary projection (0: whole batch at once); bounds
    #: memory at about 3 * K * loss_chunk * V floats (5 * K * loss_chunk * V with soft targets).
    loss_chunk: int = 0
    #: weight of the backbone's own loss in joint mode; the heads' summed loss has weight 1.
    #: Medusa-2 (Sec. 2.2.2) writes L_LM + lambda_0 * L_heads with lambda_0 = 0.2, the same up to a
    #: constant factor as lambda_base = 5.
    lambda_base: float = 5.0
    #: backbone loss in joint mode: "ce" (cross-entropy on the data's next tokens) or "kl" (KL
    #: divergence from the frozen original model's distribution, suits self-distilled data).
    base_loss: str = "ce"
    #: joint mode: heads-only steps before the backbone trains (Medusa-2's two-stage recipe).
    heads_warmup_steps: int = 0
    #: joint mode: 0 = the whole backbone trains (embeddings, every layer, norm, lm_head); N > 0 =
    #: only its top N decoder layers: the residual stream entering layer L - N is computed once per
    #: training sequence and cached (`medusa_jax.train.layer_cache`, in out_dir/hidden or
    #: hidden_dir), so a step runs forward and backward through N layers and the heads only; the
    #: embeddings, final norm and lm_head stay the original's (so proposal_vocab is allowed), and
    #: the export is those N layers only (`convert.tuned_layers`, beside the heads).
    train_layers: int = 0
    #: joint mode: the export guard. The trained backbone's mean KL(original || tuned) per answer
    #: token on the validation chats (nats/token, `medusa_jax.train.drift`) may not exceed this;
    #: above it the run is checkpointed but neither heads nor backbone are exported (an error says
    #: why). Raise it to accept the drift: the finished run is then exported without training.
    #: Default from two measurements on SmolLM2-135M's held-out chats (docs/performance.md): the
    #: perplexity of the original's answers rose 2.2x (KL 0.0015: +0.33%) to 3.2x (KL 0.021:
    #: +6.5%) the KL, so 0.005 keeps it within about 1.5%.
    max_kl: float = 0.005

    # ---- run
    #: where metrics, plots, checkpoints and the exported heads go.
    out_dir: str = "runs/medusa"
    #: seed of the split, the data order (per epoch, from seed and epoch) and the random backbone.
    seed: int = 0
    #: frozen mode: tokens per batch when computing the hidden states once.
    hidden_batch_tokens: int = 4096
    #: frozen mode: keep the computed hidden states in out_dir/hidden (numpy), reused when resuming.
    cache_hidden: bool = True
    #: where that cache lives instead of out_dir/hidden, so that runs of other head types or
    #: targets on the same backbone, data and num_heads share it (a cache is used only when its
    #: fingerprint matches; None: out_dir/hidden).
    hidden_dir: Optional[str] = None
    #: steps between metrics lines (mean of the steps since the last line).
    log_every: int = 10
    #: steps between validation evaluations (0: only at the end).
    eval_every: int = 200
    #: steps between Orbax checkpoints (0: only at the end).
    checkpoint_every: int = 200
    #: how many checkpoints to keep.
    keep_checkpoints: int = 2
    #: joint mode with train_layers 0: also write the whole trained backbone (an HF directory) to out_dir/backbone.
    save_backbone: bool = True
    #: ``"DATAxMODEL"``, the device mesh the training steps run on (`medusa_jax.sharding`: the
    #: batch split on 'data', heads and backbone Megatron-style on 'model'); "1x1": one device.
    #: Results equal one device's up to float32 round-off, so a run may resume on another mesh.
    mesh: str = "1x1"

    def __post_init__(self):
        problems = []
        try:
            parse_mesh(self.mesh)
        except ValueError as e:
            problems.append(f"mesh: {e}")
        if self.mode not in TRAIN_MODES:
            problems.append(f"mode must be one of {TRAIN_MODES}, got {self.mode!r}")
        if self.head_matmul_dtype not in ("float32", "bfloat16"):
            problems.append(f"head_matmul_dtype must be 'float32' or 'bfloat16', got {self.head_matmul_dtype!r}")
        if self.base_loss not in ("ce", "kl"):
            problems.append(f"base_loss must be 'ce' or 'kl', got {self.base_loss!r}")
        if self.loss_targets not in LOSS_TARGETS:
            problems.append(f"loss_targets must be one of {LOSS_TARGETS}, got {self.loss_targets!r}")
        proposal_ok = True
        if self.proposal_vocab < 0:
            problems.append(f"proposal_vocab must be >= 0, got {self.proposal_vocab}")
            proposal_ok = False
        elif self.proposal_vocab and ((self.mode != "frozen" and not self.train_layers) or not self.shared_lm_head):
            problems.append("proposal_vocab needs a frozen lm_head shared by the heads (shared_lm_head true, and mode "
                            "'frozen' or 'joint' with train_layers > 0); set proposal_vocab: 0")
            proposal_ok = False
        try:  # the heads' own fields, checked where the heads define them
            MedusaConfig(hidden_size=1, vocab_size=max(self.proposal_vocab, self.topk, 1), num_heads=self.num_heads,
                         num_layers=self.num_layers, shared_lm_head=self.shared_lm_head, topk=self.topk,
                         proposal_vocab_size=self.proposal_vocab if proposal_ok else 0, head_type=self.head_type)
        except ValueError as e:
            problems.append(str(e).replace("proposal_vocab_size", "proposal_vocab"))
        if isinstance(self.tree, str) and self.tree.startswith("dynamic:"):
            problems.append(f"tree: {self.tree!r} is chosen per step while decoding and cannot be stored with the "
                            "heads; give a static tree (a preset, a file or 'search') and decode with "
                            f"--tree {self.tree}, or let medusa-tune choose")
        elif self.tree is not None and self.tree != "search" and self.topk >= 1 and self.num_heads >= 1:
            try:  # the export's own call (checkpoint.export), so a tree that passes here is stored at the end
                get_tree(self.tree, self.topk, self.num_heads)
            except ValueError as e:
                try:  # a good tree, too deep for the heads?
                    depth = get_tree(self.tree, self.topk).max_depth
                except ValueError:
                    problems.append(f"tree: {e} (tree also takes 'search', a search on the validation accuracies, "
                                    "or null, no tree)")
                else:
                    chain = f" (e.g. chain{self.num_heads})" if self.num_heads <= 5 else ""
                    problems.append(f"tree {self.tree!r} has depth {depth} but num_heads is {self.num_heads}: give a "
                                    f"tree at most {self.num_heads} deep{chain} or num_heads >= {depth}")
        if not 0.0 <= self.loop_weight <= 1.0:
            problems.append(f"loop_weight must be in [0, 1], got {self.loop_weight}")
        if self.train_layers < 0:
            problems.append(f"train_layers must be >= 0 (0 = the whole backbone), got {self.train_layers}")
        elif self.train_layers and self.mode != "joint":
            problems.append(f"train_layers ({self.train_layers}) needs mode 'joint' (the frozen mode trains no layer)")
        if not self.max_kl > 0:
            problems.append(f"max_kl must be > 0 nats/token, got {self.max_kl}")
        if not self.soft_temperature > 0:
            problems.append(f"soft_temperature must be > 0, got {self.soft_temperature}")
        for name in ("steps", "batch_size", "max_seq_len", "hidden_batch_tokens", "log_every",
                     "keep_checkpoints", "topk", "tree_nodes", "loop_ngram"):
            if getattr(self, name) < 1 and not any(p.startswith(f"{name} ") for p in problems):  # (said once)
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "heads_warmup_steps", "eval_every", "checkpoint_every",
                     "loss_chunk", "max_val_positions", "synthetic_prompt_len"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not (self.learning_rate > 0 and self.heads_lr_multiplier > 0):  # NaN fails too
            problems.append("learning_rate and heads_lr_multiplier must be > 0")
        problems += self._float_problems()
        if self.mode == "joint" and self.heads_warmup_steps >= self.steps:
            problems.append(f"heads_warmup_steps ({self.heads_warmup_steps}) must be < steps ({self.steps})")
        if problems:
            raise TrainConfigError("invalid training config: " + "; ".join(problems))

    def _float_problems(self) -> list:
        """Float fields that are NaN or infinite (a NaN passes every ``<`` check and would train
        NaN heads), and the optimizer's and loss's ranges that `__post_init__` does not check
        elsewhere."""
        out = [f"{f.name} must be a finite number, got {getattr(self, f.name)}" for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))]
        if out:
            return out
        ranges = {"weight_decay": (self.weight_decay >= 0, ">= 0"), "adam_b1": (0 <= self.adam_b1 < 1, "in [0, 1)"),
                  "adam_b2": (0 <= self.adam_b2 < 1, "in [0, 1)"), "adam_eps": (self.adam_eps > 0, "> 0"),
                  "grad_clip": (self.grad_clip >= 0, ">= 0 (0 = off)"), "loss_decay": (self.loss_decay > 0, "> 0"),
                  "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  "random_init_std": (self.random_init_std > 0, "> 0"), "lambda_base": (self.lambda_base >= 0, ">= 0")}
        return [f"{name} must be {what}, got {getattr(self, name)}" for name, (ok, what) in ranges.items() if not ok]

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
          TrainConfigError: a file that cannot be read (missing, a directory) or is not valid YAML,
            not a mapping, an override without '=' or whose value is not valid YAML, or any
            `from_dict` error; the message is one line.
        """

        d: dict = {}
        sources: dict = {}
        if path is not None:
            try:
                with open(path) as f:
                    text = f.read()
            except OSError as e:
                what = "is a directory" if os.path.isdir(path) else (e.strerror or str(e)).lower()
                raise TrainConfigError(f"{path}: cannot read the training config ({what}); give a YAML file such "
                                       "as configs/tiny.yaml") from None
            except ValueError as e:  # UnicodeDecodeError: not a text file
                raise TrainConfigError(f"{path}: not a text file ({e}); give a YAML training config") from None
            loaded = _load_yaml(text, f"{path}: not valid YAML")
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
            d[k] = _load_yaml(v, f"{overrides_label} {item}: the value is not valid YAML") if v.strip() else ""
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

    close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close else
            "no known key is close to it")
    return (f"{source}: unknown training config key {key!r}; {hint} (`train.py --print-config` lists every "
            "key; medusa_jax.train.config.TrainConfig documents them)")


def _load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error raises `TrainConfigError` with one line: `what`, then the
    problem and where it is."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        detail = (f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
                  if mark is not None and getattr(e, "problem", None) else " ".join(str(e).split()))
        raise TrainConfigError(f"{what}: {detail}") from None


def _yaml_key_location(path: str, text: str, key: str) -> str:
    """``"path, line N"`` of a top-level YAML key (plain ``key:`` lines only), or just the path."""

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
