"""The backbone: its configuration (`config`), the KV cache (`kv_cache`), the Llama-family Flax
model (`llama`) and its params in decoding layout (`layout`). Imports nothing of heads, decoding or
training."""
from medusa_jax.models.config import ModelConfig, RopeScaling, UnsupportedArchitectureError
from medusa_jax.models.kv_cache import KVCache, init_cache
from medusa_jax.models.llama import LlamaModel, lm_head_matrix

__all__ = ["KVCache", "LlamaModel", "ModelConfig", "RopeScaling", "UnsupportedArchitectureError", "init_cache",
           "lm_head_matrix"]
