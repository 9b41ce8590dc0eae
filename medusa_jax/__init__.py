"""medusa_jax: Medusa decoding heads for Llama-family models (Llama, Mistral, Qwen2, Qwen3) in JAX/Flax.

Public API (every step of decode.py and train.py)::

    import medusa_jax as mj
    model = mj.load_model()                      # HF dir, GGUF file, or the default SmolLM2 GGUF
    heads, tree, _ = mj.resolve_heads(model, None)   # shipped heads + their tree
    ids = mj.apply_chat_template(model.tokenizer, "Hello!")
    out = mj.generate(model.cfg, model.params, ids, heads=heads, tree=tree, max_new_tokens=128)
    tuned = mj.apply_tuned_layers(model, "heads_dir")   # Medusa-2: the backbone layers trained with the heads
    fast = mj.generate_device(model.cfg, model.params, [ids], heads=heads, tree=tree)  # no per-step sync
    for i, res in mj.generate_batch(model.cfg, model.params, [ids, ids2], batch_size=4, heads=heads, tree=tree):
        ...                                      # prompts in rows, refilled as they finish

The packages behind it, by role (docs/design-notes.md, "Layout"): `models` (the backbone),
`heads` (Medusa and Hydra heads), `decoding` (the tree, the step that verifies a draft, prefill),
`drafts` (the draft methods, one `Drafter` each), `engine` (the engine, the on-device loop and the
entry points), `convert` (loading and head formats), `train`, `tuning`, `evals`, `serve` and `cli`
(the commands).
"""
from medusa_jax.chat import apply_chat_template
from medusa_jax.convert.load import LoadedModel, default_model_path, load_model
from medusa_jax.convert.medusa_format import export_official, export_vllm, load_heads, save_heads
from medusa_jax.convert.tuned_layers import TunedLayersError, apply_tuned_layers, merge_to_hf, save_tuned_layers
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import PromptTooLongError
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.proposal import Drafter
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.step import medusa_step
from medusa_jax.decoding.tree import TreeBuffers, build_tree, get_tree, with_lookup
from medusa_jax.drafts import drafter_for
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.generate import (
    BatchStats,
    DeviceResult,
    GenerationResult,
    generate,
    generate_batch,
    generate_device,
    generate_stream,
)
from medusa_jax.engine.loop import generate_jit
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import MedusaHeads, init_heads, prepare_heads
from medusa_jax.models.config import ModelConfig, RopeScaling
from medusa_jax.models.kv_cache import KVCache, init_cache
from medusa_jax.models.llama import LlamaModel, lm_head_matrix
from medusa_jax.resolve import resolve_heads

__all__ = [
    "Acceptance", "BatchStats", "DecodeState", "DeviceResult", "Drafter", "Engine", "GenerationResult", "KVCache", "LlamaModel",
    "LoadedModel", "MedusaConfig", "MedusaHeads", "ModelConfig", "PromptLookup", "PromptTooLongError",
    "RopeScaling", "TreeBuffers", "TunedLayersError", "apply_chat_template", "apply_tuned_layers", "build_tree",
    "default_model_path", "drafter_for", "export_official", "export_vllm", "generate", "generate_batch", "generate_device",
    "generate_jit", "generate_stream", "get_tree", "init_cache", "init_heads", "lm_head_matrix", "load_heads",
    "load_model", "medusa_step", "merge_to_hf", "prepare_heads", "resolve_heads", "save_heads", "save_tuned_layers",
    "start_state", "with_lookup",
]
