from .llama import LlamaModel, rope_inv_freq  # noqa: F401
