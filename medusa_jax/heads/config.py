"""The heads' configuration: `MedusaConfig` (Medusa heads, Cai et al. 2024, Sec. 2.1.1, or Hydra
heads, Ankner et al. 2024), frozen and hashable so that it can be a static argument of jitted
functions."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

#: MedusaConfig.head_type values: "medusa" = the paper's heads (Cai et al. 2024, Sec. 2.1.1: head k
#: reads h_t only); "hydra" = sequentially dependent heads (Ankner et al. 2024, "Hydra", Sec. 3: head k
#: also reads the embeddings of the tokens on its path, root first; `medusa_jax.heads.hydra`).
HEAD_TYPES: Tuple[str, ...] = ("medusa", "hydra")


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads (Cai et al. 2024, Sec. 2.1.1), or Hydra heads (Ankner et al. 2024).

    num_heads: K; head k (0-based) reads the hidden state at t and predicts token t+k+2.
    num_layers: residual blocks ``x + silu(W x + b)`` per head (hydra: >= 1; the first block also
      reads the path's token embeddings, see `medusa_jax.heads.hydra`).
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
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(f"need hidden_size >= 1 and vocab_size >= 1, got {self.hidden_size}, {self.vocab_size}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.topk < 1:
            raise ValueError(f"topk (candidates per head) must be >= 1, got {self.topk}")
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
