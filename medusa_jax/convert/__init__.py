"""Weight conversion: Hugging Face directories, GGUF files, Medusa head files."""
