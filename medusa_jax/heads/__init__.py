"""Draft heads: their configuration (`config`), Medusa heads (`medusa`), Hydra heads (`hydra`) and
their vocabulary projection and top-k (`topk`). Imports only `models` and `kernels`."""
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import HeadsMismatchError, MedusaHeads, init_heads, prepare_heads
from medusa_jax.heads.topk import head_topk

__all__ = ["HeadsMismatchError", "MedusaConfig", "MedusaHeads", "head_topk", "init_heads", "prepare_heads"]
