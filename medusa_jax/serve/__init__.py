"""The OpenAI-compatible HTTP server on the decoding engine: `app` (routes, streaming, failure
behaviour), `protocol` (request checks, response objects), `metrics` (Prometheus, vLLM's names).
Uses decoding only through `decoding.engine`; its command is `medusa_jax.cli.serve`."""
from medusa_jax.serve.app import create_app

__all__ = ["create_app"]
