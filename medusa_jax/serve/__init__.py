"""The OpenAI-compatible HTTP server on the decoding engine: `app` (the app and its routes),
`serving` (what the routes call), `protocol` (the request bodies as pydantic models), `running` (a
request in the engine, streamed or whole), `responses` (response objects), `metrics` (Prometheus,
vLLM's names).
Uses decoding only through `engine.engine`; its command is `medusa_jax.cli.serve`."""
from medusa_jax.serve.app import create_app

__all__ = ["create_app"]
