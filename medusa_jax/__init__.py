"""medusa_jax: Medusa decoding heads for Llama-family models (Llama, Mistral, Qwen2) in JAX/Flax.

Public API (every step of decode.py and train.py)::

    import medusa_jax as mj
    model = mj.load_model()                      # HF dir, GGUF file, or the default SmolLM2 GGUF
    heads, tree, _ = mj.resolve_heads(model, None)   # shipped heads + their tree
    ids = mj.apply_chat_template(model.tokenizer, "Hello!")
    out = mj.generate(model.cfg, model.params, ids, heads=heads, tree=tree, max_new_tokens=128)
    fast = mj.generate_device(model.cfg, model.params, [ids], heads=heads, tree=tree)  # no per-step sync
    for i, res in mj.generate_batch(model.cfg, model.params, [ids, ids2], batch_size=4, heads=heads, tree=tree):
        ...                                      # prompts in rows, refilled as they finish
"""
from .config import MedusaConfig, ModelConfig, RopeScaling  # noqa: F401
from .kv_cache import KVCache, init_cache  # noqa: F401
from .models.llama import LlamaModel, lm_head_matrix  # noqa: F401
from .heads import MedusaHeads, init_heads, prepare_heads  # noqa: F401
from .lookup import PromptLookup  # noqa: F401
from .tree import TreeBuffers, build_tree, get_tree, with_lookup  # noqa: F401
from .verify import Acceptance, DecodeState, medusa_step  # noqa: F401
from .generate import (BatchStats, DeviceResult, GenerationResult, PromptTooLongError, generate,  # noqa: F401
                       generate_batch, generate_device, generate_jit, generate_stream, start_state)
from .loading import LoadedModel, apply_chat_template, default_model_path, load_model  # noqa: F401
from .convert.medusa_format import export_official, export_vllm, load_heads, save_heads  # noqa: F401
from .runtime import resolve_heads  # noqa: F401
