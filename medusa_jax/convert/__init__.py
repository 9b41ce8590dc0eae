"""Loading and formats: `load` (`load_model`: an HF directory, a GGUF file or the default model),
the converters (`hf`, `gguf`, `gguf_tokenizer`), the converted-model cache (`cache`), the Medusa
head files (`medusa_format`: ours, the official format, vLLM's) and Medusa-2's tuned backbone
layers saved beside the heads (`tuned_layers`)."""
from medusa_jax.convert.hf import save_hf
from medusa_jax.convert.load import LoadedModel, default_model_path, load_model
from medusa_jax.convert.medusa_format import export_official, export_vllm, load_heads, save_heads
from medusa_jax.convert.tuned_layers import (LAYERS_FILE, TunedLayersError, apply_tuned_layers, merge_to_hf,
                                             read_tuned_layers, save_tuned_layers, tuned_layers_path)

__all__ = ["LAYERS_FILE", "LoadedModel", "TunedLayersError", "apply_tuned_layers", "default_model_path",
           "export_official", "export_vllm", "load_heads", "load_model", "merge_to_hf", "read_tuned_layers",
           "save_heads", "save_hf", "save_tuned_layers", "tuned_layers_path"]
