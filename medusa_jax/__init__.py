"""medusa_jax: Medusa decoding heads for Llama-family models in JAX/Flax."""
from .config import ModelConfig, RopeScaling  # noqa: F401
from .kv_cache import KVCache, init_cache  # noqa: F401
from .models.llama import LlamaModel  # noqa: F401
