from .llama import LlamaModel, lm_head_matrix, rope_inv_freq  # noqa: F401
