"""Loading and formats: `load` (`load_model`: an HF directory, a GGUF file or the default model),
the converters (`hf`, `gguf`, `gguf_tokenizer`), the converted-model cache (`cache`) and the Medusa
head files (`medusa_format`: ours, the official format, vLLM's)."""
from medusa_jax.convert.load import LoadedModel, default_model_path, load_model
from medusa_jax.convert.medusa_format import export_official, export_vllm, load_heads, save_heads

__all__ = ["LoadedModel", "default_model_path", "export_official", "export_vllm", "load_heads", "load_model",
           "save_heads"]
