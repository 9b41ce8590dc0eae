"""The HTTP face of the engine: an OpenAI-compatible ASGI app (FastAPI on Starlette; SSE streaming).

Routes: ``POST /v1/chat/completions`` (messages through the model's chat template),
``POST /v1/completions`` (prompts as text or token ids, several per request; ``echo`` with the prompt
tokens' log-probabilities from `Engine.prompt_logprobs`), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus, vLLM's metric names: `serve.metrics`), and vLLM's ``POST /tokenize``
and ``/detokenize``. Each route reads its body (`serve.body`), calls `serve.serving.OpenAIServing`
and answers what it returns; a `RequestError` raised on the way is answered with OpenAI's error body.

The engine runs in its own thread (`engine.engine.Engine.start`); a request is submitted to it from
the event loop, and its events come back through an asyncio queue fed with
``loop.call_soon_threadsafe`` (`serve.running.RunningRequest`), so the event loop never waits on
JAX. What the server promises: a bad request gets a 4xx with OpenAI's error body naming the field,
and nothing else changes; a full queue answers 429 with ``Retry-After``; a client that disconnects
cancels its request, whose row is freed at the engine's next iteration; an error inside one request
ends that request (an SSE error event when streaming), never the server or the other requests; at
shutdown the server stops taking requests (uvicorn closes its sockets; a request already read gets
503) and ends the engine's.
A request's ``n`` choices per prompt are engine requests (choice k * n + j: prompt k's, sampling with
seed + j) whose events share one queue; their log-probabilities carry each token's own bytes
(`serve.text.TokenPieces`).
Besides OpenAI's fields, vLLM's commonest extensions are honoured (`serve.protocol`), and
browser pages may call it (CORS, ``allowed_origins``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from medusa_jax.engine.engine import Engine
from medusa_jax.serve.body import MAX_REQUEST_BYTES, log, warn_unknown
from medusa_jax.serve.errors import RequestError, error_body
from medusa_jax.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from medusa_jax.serve.serving import OpenAIServing

__all__ = ["create_app", "log"]  # log: the server's warnings (`serve.body.log`)


def create_app(engine: Engine, tokenizer, model_name: str, *, max_waiting: int = 64,
               max_tokens_default: Optional[int] = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               allowed_origins: Sequence[str] = ("*",), tool_call_parser: Optional[str] = None,
               exclude_tools_when_none: bool = False) -> FastAPI:
    """The ASGI app serving `engine` (started by the app's lifespan if it is not running).

    Args:
      engine: the engine (its ``max_len`` is the context a request may use).
      tokenizer: the model's tokenizer (chat template, detokenization).
      model_name: the id clients name in ``model`` (``/v1/models`` lists it).
      max_waiting: requests that may wait for a row; one more is refused with 429.
      max_tokens_default: the budget of a request without ``max_tokens`` (default: the rest of the
        context for a chat, `protocol.COMPLETIONS_MAX_TOKENS` (16) for ``/v1/completions``, as OpenAI
        and vLLM default them).
      max_request_bytes: the largest request body accepted; a larger one gets 413 (`body.read_body`).
      allowed_origins: the web origins whose pages may call the server from a browser (CORS, with any
        method and header, as vLLM's ``--allowed-origins``); ``"*"``: any; empty: no CORS headers.
      tool_call_parser: how the model writes a tool call, one of `serve.tools.TOOL_PARSERS` (vLLM's
        ``--tool-call-parser``); None: chats with ``tools`` need ``tool_choice: "none"``.
      exclude_tools_when_none: a chat with ``tool_choice: "none"`` is rendered without its tools
        (vLLM's ``--exclude-tools-when-tool-choice-none``), so that the model, shown none, writes a
        message as OpenAI's "none" promises; by default the template shows them (vLLM's default) and
        a call the model writes anyway comes back as content.
    Returns:
      The app; ``app.state.begin_shutdown(cancel=False)`` (`OpenAIServing.begin_shutdown`) refuses new
      requests, and with ``cancel`` ends the running ones (the shutdown grace's end).
    Raises:
      ValueError: an unknown `tool_call_parser`.
    """
    serving = OpenAIServing(engine, tokenizer, model_name, max_waiting=max_waiting,
                            max_tokens_default=max_tokens_default, max_request_bytes=max_request_bytes,
                            tool_call_parser=tool_call_parser, exclude_tools_when_none=exclude_tools_when_none)
    app = FastAPI(title="medusa_jax", description="OpenAI-compatible server with Medusa decoding",
                  lifespan=serving.lifespan, docs_url=None, redoc_url=None)  # their pages load scripts from a CDN
    app.state.engine, app.state.metrics, app.state.begin_shutdown = engine, serving.metrics, serving.begin_shutdown
    if allowed_origins:  # browser pages (chat UIs) calling the API: their preflight OPTIONS and CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    add_routes(app, serving)
    return app


def error_response(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    """A response of HTTP `status` with OpenAI's error body (`errors.error_body`)."""
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


async def request_error(_request: Request, e: RequestError) -> JSONResponse:
    """A refused request's answer: its status, OpenAI's error body, its headers (a 429's Retry-After)."""
    return error_response(e.status, str(e), e.type, e.param, e.code, e.headers)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's errors (404: no such route, 405: another method; its Allow header kept) in OpenAI's body."""
    message = str(e.detail)
    if e.status_code == 404:  # as OpenAI words it, with the routes there are
        message = (f"Invalid URL ({request.method} {request.url.path}): this server serves "
                   "/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health and "
                   "/metrics")
    return error_response(e.status_code, message, headers=getattr(e, "headers", None))


async def internal_error(_request: Request, e: Exception) -> JSONResponse:
    """Any other exception: a 500 naming it (the server goes on)."""
    return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The server's routes on `app`, each reading its body, calling `serving` and answering what it
    returns (a dict as JSON)."""

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: health probes
    async def health():
        return serving.health()

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [serving.model]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        return serving.model_card(model_id)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await serving.read_json(request)
        warn_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
        return await serving.create_completion(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await serving.read_json(request)
        warn_unknown(body, COMPLETION_FIELDS, "/v1/completions")
        return await serving.create_completion(request, body, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize`` (`OpenAIServing.tokenize`): a chat's when the body has ``messages``."""
        body = await serving.read_json(request)
        chat = isinstance(body, dict) and "messages" in body
        warn_unknown(body, (CHAT_FIELDS if chat else COMPLETION_FIELDS) | {"return_token_strs"}, "/tokenize")
        return await serving.tokenize(body, chat)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize`` (`OpenAIServing.detokenize`)."""
        body = await serving.read_json(request)
        warn_unknown(body, frozenset({"model", "tokens"}), "/detokenize")
        return serving.detokenize(body)
