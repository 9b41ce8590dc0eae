"""The HTTP face of the engine: an OpenAI-compatible ASGI app (FastAPI on Starlette; SSE streaming).

Routes: ``POST /v1/chat/completions`` (messages through the model's chat template),
``POST /v1/completions`` (prompts as text or token ids, several per request; ``echo`` with the prompt
tokens' log-probabilities from `Engine.prompt_logprobs`), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus, vLLM's metric names: `serve.metrics`), and vLLM's ``POST /tokenize``
and ``/detokenize``.

The engine runs in its own thread (`decoding.engine.Engine.start`); a request is submitted to it from
the event loop, and its events come back through an asyncio queue fed with
``loop.call_soon_threadsafe``, so the event loop never waits on JAX. What the server promises:
a bad request gets a 4xx with OpenAI's error body naming the field, and nothing else changes; a full
queue answers 429 with ``Retry-After``; a client that disconnects cancels its request, whose row is
freed at the engine's next iteration; an error inside one request ends that request (an SSE error
event when streaming), never the server or the other requests; at shutdown the server stops taking
requests (uvicorn closes its sockets; a request already read gets 503) and ends the engine's.
A request's ``n`` choices per prompt are engine requests (choice k * n + j: prompt k's, sampling with
seed + j) whose events share one queue; their log-probabilities carry each token's own bytes
(`serve.text.TokenPieces`).
Besides OpenAI's fields, vLLM's commonest extensions are honoured (`protocol.check_request`), and
browser pages may call it (CORS, ``allowed_origins``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import logging
import time
from typing import AsyncIterator, List, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from medusa_jax.chat import NO_PLACE_FOR_TOOLS, render_chat, template_takes_tools
from medusa_jax.decoding.args import PromptTooLongError, check_prompt_room, new_token_room
from medusa_jax.decoding.engine import Engine
from medusa_jax.decoding.requests import EngineStopped, Finished
from medusa_jax.decoding.requests import Request as EngineRequest
from medusa_jax.decoding.requests import SamplingParams
from medusa_jax.serve import protocol, responses
from medusa_jax.serve.choices import Choice, sse
from medusa_jax.serve.echo import ClientGone, Echoer, echo_alone
from medusa_jax.serve.metrics import Metrics
from medusa_jax.serve.protocol import RequestError
from medusa_jax.serve.text import AFTER_TOKENS, TextOffsets, TextStream, TokenPieces, bad_words_ids, marker_ids
from medusa_jax.serve.tools import TOOL_PARSERS


#: Where the server's own warnings go (`medusa-serve` prints them beside uvicorn's log).
log = logging.getLogger("medusa_jax.serve")

#: The largest request body read by default (bytes): far above any prompt that fits a context (a
#: 32k-token prompt is ~150 KB of text), so only a runaway or hostile client reaches it (413).
MAX_REQUEST_BYTES = 16 * 1024 * 1024


#: A prompt longer than this many characters per token of the context is first tokenized only up to
#: that many characters (`surely_too_long`): ordinary text runs 3-5 characters per token, so a prompt
#: that long almost never fits, and the probe refuses it in milliseconds instead of tokenizing
#: megabytes (seconds each, while the other requests' prompts wait for the tokenizer).
PROBE_CHARS_PER_TOKEN = 16


def surely_too_long(tokenizer, texts: List[str], context: int) -> Optional[int]:
    """A lower bound on the tokens of a prompt made of `texts` (a chat's message contents, or a
    completion's prompt) when it shows that the prompt cannot fit `context`, else None (the
    prompt must be tokenized whole to tell). Only prompts over ``PROBE_CHARS_PER_TOKEN *
    context`` characters are probed, by tokenizing that many of their first characters: the
    whole prompt has at least those tokens, less one per text for tokens that may merge across
    where the probe joins or cuts them."""
    limit = PROBE_CHARS_PER_TOKEN * context
    if sum(len(t) for t in texts) <= limit:
        return None
    probe = "".join(texts)[:limit]
    n = len(tokenizer.encode(probe, add_special_tokens=False)) - len(texts) - 1
    return n if n >= context else None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes kept; a larger one is refused (RequestError, status
    413) once read through (its bytes past the limit are discarded, not kept, so that the client
    gets the 413 on a clean connection), or at once when it declares or sends more than twice the
    limit (the connection is then closed under it)."""
    too_large = f"the request body is larger than this server's limit of {limit} bytes; send a shorter prompt"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 2 * limit:
        raise RequestError(too_large, status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 2 * limit:
            break
    if size > limit:
        raise RequestError(too_large, status=413, code="request_too_large")
    return b"".join(chunks)


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
      max_request_bytes: the largest request body accepted; a larger one gets 413 (`read_body`).
      allowed_origins: the web origins whose pages may call the server from a browser (CORS, with any
        method and header, as vLLM's ``--allowed-origins``); ``"*"``: any; empty: no CORS headers.
      tool_call_parser: how the model writes a tool call, one of `serve.tools.TOOL_PARSERS` (vLLM's
        ``--tool-call-parser``); None: chats with ``tools`` need ``tool_choice: "none"``.
      exclude_tools_when_none: a chat with ``tool_choice: "none"`` is rendered without its tools
        (vLLM's ``--exclude-tools-when-tool-choice-none``), so that the model, shown none, writes a
        message as OpenAI's "none" promises; by default the template shows them (vLLM's default) and
        a call the model writes anyway comes back as content.
    Raises:
      ValueError: an unknown `tool_call_parser`.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose one of {', '.join(TOOL_PARSERS)}")
    tools = TOOL_PARSERS.get(tool_call_parser)
    takes_tools = template_takes_tools(tokenizer)  # the template is the server's, fixed
    context = engine.max_len
    metrics = Metrics(engine, model_name)
    state = {"shutting_down": False, "started": time.time(), "cancel": False}
    # prompts are tokenized off the event loop, one at a time (a tokenizer is not made to be entered
    # by several threads at once)
    tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-tokenize")
    pieces = TokenPieces(tokenizer)  # each token's bytes and text, for logprobs
    markers = marker_ids(tokenizer, pieces, tools.markers) if tools else frozenset()  # kept in a tool answer's text
    echoer = Echoer(engine, tokenizer, pieces, tokenize_pool, max(max_waiting, protocol.MAX_PROMPTS),
                    cancelled=lambda: state["cancel"])

    # each running request's event queue and engine handles (one per choice): at the end of the shutdown grace the
    # requests are answered from here, without waiting for the engine, which cannot be interrupted
    # while it compiles a new shape
    live: dict = {}

    def begin_shutdown(cancel: bool = False) -> None:
        """Refuse new requests (503) from now on; with `cancel`, end the running and waiting ones too
        (each gets the server_shutdown error at once, even while the engine is busy compiling), as
        the shutdown grace runs out. Call it on the event loop's thread."""
        state["shutting_down"] = True
        if cancel:
            state["cancel"] = True  # prompts being scored for an echo stop at their next chunk
            for events, handles in list(live.items()):
                for i, handle in enumerate(handles):
                    if handle.finished is None and not handle.cancelled.is_set():  # a stopped one ends by itself
                        events.put_nowait((i, "done", Finished("cancelled", prompt_tokens=len(handle.request.prompt))))
            engine.cancel_all()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            state["shutting_down"] = True
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            tokenize_pool.shutdown(wait=False)
            echoer.shutdown()

    app = FastAPI(title="medusa_jax", description="OpenAI-compatible server with Medusa decoding",
                  lifespan=lifespan, docs_url=None, redoc_url=None)  # their pages load scripts from a CDN
    app.state.engine, app.state.metrics, app.state.begin_shutdown = engine, metrics, begin_shutdown
    if allowed_origins:  # browser pages (chat UIs) calling the API: their preflight OPTIONS and CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    def error(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
              code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
        return JSONResponse(protocol.error_body(message, type, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, e: RequestError):
        return error(e.status, str(e), e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = str(e.detail)
        if e.status_code == 404:  # as OpenAI words it, with the routes there are
            message = (f"Invalid URL ({request.method} {request.url.path}): this server serves "
                       "/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health and "
                       "/metrics")
        return error(e.status_code, message, headers=getattr(e, "headers", None))  # 405: Allow

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception):
        return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: health probes
    async def health():
        if state["shutting_down"]:
            return error(503, "the server is shutting down", "server_error")
        return {"status": "ok", "running": engine.live, "waiting": engine.waiting, "scoring": echoer.scoring}

    model_card = {"id": model_name, "object": "model", "created": int(state["started"]), "owned_by": "medusa_jax",
                  "max_model_len": context}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"the model {model_id!r} does not exist; this server serves {model_name}", "model",
                               status=404, code="model_not_found")
        return model_card

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize``: the token ids the server would feed the model for a completion's
        ``prompt`` (one) or a chat's ``messages`` (with the same template fields as a chat request),
        their ``count`` and the context (``max_model_len``); ``return_token_strs``: each token's text.
        A prompt longer than the context is counted, not refused."""
        body = await json_body(request)
        chat = isinstance(body, dict) and "messages" in body
        warn_unknown(body, (protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS) | {"return_token_strs"},
                     "/tokenize")
        gen = protocol.check_request(body, [model_name], context, chat, engine.cfg.vocab_size)
        if not chat and len(gen.prompts) != 1:
            raise RequestError(f"prompt: /tokenize takes one prompt, got {len(gen.prompts)}", "prompt")
        unused_tools_left_out(gen)  # the ids a chat request would be fed
        ids = (await tokenized(gen, chat, fit=False))[0]
        out = {"count": len(ids), "max_model_len": context, "tokens": ids}
        if protocol.flag(body, "return_token_strs", False):
            out["token_strs"] = [pieces.text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize``: the text of ``tokens`` (ids in the vocabulary), special tokens kept."""
        body = await json_body(request)
        warn_unknown(body, frozenset({"model", "tokens"}), "/detokenize")
        ids = protocol.check_detokenize(body, [model_name], engine.cfg.vocab_size)
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    def warn_unknown(body, known: frozenset, endpoint: str) -> None:
        """Log a warning naming the fields of `body` the server does not read (ignored, as vLLM
        ignores them: `protocol.unknown_fields_note`)."""
        note = protocol.unknown_fields_note(body, known, endpoint)
        if note:
            log.warning(note)

    def unused_tools_left_out(gen: protocol.Generation) -> None:
        if exclude_tools_when_none and gen.tool_choice == "none":
            gen.tools = None

    async def json_body(request: Request):
        """The request's body parsed as JSON (a 503 while shutting down; RequestError for a body that
        is too large or not JSON)."""
        if state["shutting_down"]:
            raise RequestError("the server is shutting down", status=503, type="server_error")
        raw = await read_body(request, max_request_bytes)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError("the request body nests too deeply to parse") from None

    async def generate(request: Request, chat: bool):
        body = await json_body(request)
        warn_unknown(body, protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS,
                     "/v1/chat/completions" if chat else "/v1/completions")
        gen = protocol.check_request(body, [model_name], context, chat, engine.cfg.vocab_size)
        field = "messages" if chat else "prompt"
        if gen.tool_choice == "auto" and tools is None:
            raise RequestError(f"tool calls need the server started with --tool-call-parser ({', '.join(TOOL_PARSERS)}"
                               ": the format the model writes them in); or give tool_choice 'none'", "tool_choice")
        if gen.tools and not takes_tools:
            if gen.tool_choice != "none":
                raise RequestError(NO_PLACE_FOR_TOOLS, "tools")
            gen.tools = None  # not to be called, and the template would not show them: nothing is lost
        unused_tools_left_out(gen)
        prompts = await tokenized(gen, chat, room=0 if gen.max_tokens == 0 else 1)  # echo alone: the whole context
        where = lambda k: f"prompt {k}: " if len(prompts) > 1 else ""  # noqa: E731
        budget_field = ("max_completion_tokens" if chat and body.get("max_completion_tokens") is not None
                        else "max_tokens")
        limits = []  # each prompt's max_tokens
        for k, ids in enumerate(prompts):
            budget = new_token_room(len(ids), context)
            default = max_tokens_default or (budget if chat else protocol.COMPLETIONS_MAX_TOKENS)
            limits.append(gen.max_tokens if gen.max_tokens is not None else min(default, budget))
            if limits[-1] > budget:
                raise RequestError(f"{where(k)}{budget_field} {limits[-1]} is too large: the prompt has {len(ids)} "
                                   f"tokens and the context is {context}, so at most {budget} new tokens fit",
                                   budget_field, code="context_length_exceeded")
            if gen.min_tokens > limits[-1]:
                raise RequestError(f"min_tokens ({gen.min_tokens}) must be at most {budget_field} ({limits[-1]}"
                                   f"{', its default here' if gen.max_tokens is None else ''})", "min_tokens")
        bad_words = bad_words_ids(tokenizer, gen.bad_words) if gen.bad_words else None
        long_word = next((w for w in bad_words or () if len(w) > protocol.MAX_BAD_WORD_TOKENS), None)
        if long_word is not None:
            raise RequestError(f"bad_words: a word of {len(long_word)} tokens; each may have at most "
                               f"{protocol.MAX_BAD_WORD_TOKENS}", "bad_words")
        total = 0 if gen.max_tokens == 0 else len(prompts) * gen.n  # engine requests (echo alone: none)
        if total > engine.max_batch + max_waiting:
            raise RequestError(f"{total} choices need a row or a place in the queue each; this server has "
                               f"{engine.max_batch} rows and queues {max_waiting} (--max-batch, --max-waiting)",
                               "n" if len(prompts) == 1 else "prompt")
        # each choice takes a row, or a place in the queue once the free rows are taken: checked before
        # an echo's scoring (a refused request spends none) and again after it, with nothing awaited
        # before the submissions, so that concurrent requests cannot all pass it
        def refused() -> Optional[JSONResponse]:
            if total and max(0, engine.waiting + total - max(0, engine.max_batch - engine.live)) > max_waiting:
                return error(429, f"{engine.queued} requests are waiting for a row; try again shortly",
                             "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            return None

        if gen.echo and (full := refused()) is not None:
            return full
        try:
            echoes = await echoer.echoes(gen, prompts, request.is_disconnected) if gen.echo else [None] * len(prompts)
        except ClientGone:
            return Response(status_code=499)
        if (full := refused()) is not None:
            return full
        rid = responses.new_id(chat)
        if gen.max_tokens == 0:
            return echo_alone(gen, rid, prompts, echoes, pieces)
        loop = asyncio.get_running_loop()
        events: "asyncio.Queue" = asyncio.Queue()  # (choice index, kind, payload) of all the choices
        remaining = [total]

        def on_event(i: int, kind: str, payload) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, (i, kind, payload))
            if kind == "done":  # the last choice's end is in the queue: nothing left for a shutdown to answer
                remaining[0] -= 1
                if not remaining[0]:
                    loop.call_soon_threadsafe(live.pop, events, None)

        choices = []
        calls_tools = gen.tool_choice == "auto"  # the answers are read for tool calls
        continues = not chat or gen.continue_final_message  # the answers continue the prompt's text
        try:  # choice k * n + j: prompt k's j-th, sampling with seed + j (greedy choices are all alike)
            for (ids, limit, echo), j in itertools.product(zip(prompts, limits, echoes), range(gen.n)):
                sampling = SamplingParams(gen.temperature, gen.top_p, (gen.seed + j) % 2 ** 31, gen.top_k, gen.min_p,
                                          gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty)
                handle = engine.submit(EngineRequest(ids, limit, sampling, gen.eos_override(engine.eos),
                                                     logprobs=gen.logprobs, logit_bias=gen.logit_bias,
                                                     min_tokens=gen.min_tokens, allowed_token_ids=gen.allowed_token_ids,
                                                     bad_words=bad_words),
                                       on_event=functools.partial(on_event, len(choices)))
                text = TextStream(tokenizer, gen.stop, gen.include_stop, gen.stop_token_ids or (), gen.min_tokens,
                                  markers if calls_tools else frozenset(), pieces.special,
                                  after=ids[-AFTER_TOKENS:] if continues else ())
                offsets = TextOffsets(pieces, start=len(echo.text) if echo else 0)  # an echo: after the prompt
                choices.append(Choice(handle, text, offsets, tools if calls_tools else None,
                                      echo, None if gen.parallel_tool_calls else 1))
        except (ValueError, EngineStopped) as e:
            for c in choices:
                c.handle.cancel()
            if isinstance(e, EngineStopped):  # the shutdown stopped the engine while this request was read
                return error(503, "the server is shutting down", "server_error")
            raise RequestError(str(e), field) from None
        live[events] = [c.handle for c in choices]
        t0 = time.perf_counter()
        prompt_tokens = sum(len(ids) for ids in prompts)
        if gen.stream:
            return StreamingResponse(stream(request, choices, events, gen, prompt_tokens, rid, chat, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for i, kind, payload in _events(request, events, len(choices)):
                c = choices[i]
                if kind == "tokens":
                    _observe(t0, payload, c.handle)
                    c.feed(payload)
                elif kind == "logprobs":
                    c.add_logprobs(payload)
                else:
                    c.fin = payload
        finally:
            live.pop(events, None)
            for c in choices:
                if c.fin is None:
                    c.handle.cancel()
        if any(c.fin is None for c in choices):  # the client went away
            return Response(status_code=499)
        failed = next((c.fin for c in choices if c.fin.reason == "error"), None)
        if failed is not None:
            return error(500, f"the request failed: {failed.error}", "server_error")
        if any(c.fin.reason == "cancelled" and not c.stopped for c in choices):  # ended by the server (shutdown)
            return error(503, "the server is shutting down; the answer was cut", "server_error",
                         code="server_shutdown")
        out = []
        for i, c in enumerate(choices):
            c.final()
            lp = None if gen.logprobs is None else responses.logprobs_obj(c.pending, chat, pieces, c.offsets)
            content = c.content()
            if c.echo:
                content = c.echo.text + content
                lp = lp and responses.joined_logprobs(c.echo.logprobs(pieces, True), lp)
            out.append(responses.choice(i, chat, content, c.reason(), lp, c.calls))
        metrics.observe_end(time.perf_counter() - t0, [c.fin for c in choices])
        return responses.completion(rid, gen.model, chat, out,
                                   responses.usage(prompt_tokens, sum(c.used() for c in choices)),
                                   [c.fin for c in choices], gen.created)

    async def tokenized(gen: protocol.Generation, chat: bool, fit: bool = True, room: int = 1) -> List[List[int]]:
        """The token ids of each of the request's prompts (a chat's one, rendered by its template),
        each checked to fit the context with `room` positions left (1: for an answer; 0: the prompt
        alone) unless not `fit`; RequestError naming the prompt otherwise.
        Tokenized off the event loop, in a worker thread: a long prompt's tokenization must not stall
        the other requests' streams."""
        field = "messages" if chat else "prompt"
        run = asyncio.get_running_loop().run_in_executor
        if chat:
            items = [(functools.partial(render_chat, tokenizer, gen.messages, gen.add_generation_prompt,
                                        gen.continue_final_message, gen.template_kwargs, gen.tools),
                      [m["content"] for m in gen.messages])]
        else:  # a string, or token ids
            items = [((lambda p=p: list(p)), []) if isinstance(p, list) else
                     ((lambda p=p: list(tokenizer.encode(p))), [p]) for p in gen.prompts]
        out = []
        for k, (encode, texts) in enumerate(items):
            where = f"prompt {k}: " if len(items) > 1 else ""
            at_least = await run(tokenize_pool, surely_too_long, tokenizer, texts, context + 1 - room) if fit else None
            if at_least is not None:
                raise RequestError(f"{where}the prompt has more than {at_least} tokens (from its first "
                                   f"{PROBE_CHARS_PER_TOKEN * context} characters alone) but the model's context is "
                                   f"{context}; shorten it", field, code="context_length_exceeded")
            try:
                ids = await run(tokenize_pool, encode)
            except Exception as e:  # noqa: BLE001 - a template that refuses these messages
                what = ("the chat template could not render these messages" if chat
                        else "the prompt could not be tokenized")
                raise RequestError(f"{where}{what}: {e}", field) from None
            try:
                if fit:
                    check_prompt_room(len(ids), context, room=room)
            except PromptTooLongError as e:
                raise RequestError(f"{where}{e}", field, code="context_length_exceeded") from None
            out.append(ids)
        return out

    def _observe(t0: float, tokens: List[int], handle) -> None:
        now = time.perf_counter()
        last = getattr(handle, "_last_token_at", None)
        if last is None:
            metrics.observe_first_token(now - t0)
            metrics.observe_tokens(0.0, len(tokens) - 1)
        else:
            metrics.observe_tokens(now - last, len(tokens))
        handle._last_token_at = now

    async def _events(request: Request, events: "asyncio.Queue", n: int) -> AsyncIterator[tuple]:
        """The engine's events (choice, kind, payload) of one request's `n` choices until each has
        sent ("done", Finished); stops early (the caller cancels) when the client disconnects, which
        is checked at least once a second whether or not tokens are flowing (a non-streaming
        request's client is heard from no other way)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while n:
            try:
                item = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                item = None
            if (item is None or item[1] != "done") and loop.time() - checked >= 1.0:
                checked = loop.time()
                if await request.is_disconnected():
                    return
            if item is None:
                continue
            yield item
            n -= item[1] == "done"

    async def stream(request: Request, choices: list, events: "asyncio.Queue", gen: protocol.Generation,
                     prompt_tokens: int, rid: str, chat: bool, t0: float) -> AsyncIterator[str]:
        created = gen.created
        part = functools.partial(responses.chunk, rid, gen.model, chat, created, include_usage=gen.include_usage)

        def logprobs(c: "Choice") -> Optional[dict]:  # the logprobs of the tokens a chunk of choice c carries
            if gen.logprobs is None:
                return None
            obj = responses.logprobs_obj(c.pending, chat, pieces, c.offsets)
            c.sent_tokens += len(c.pending)
            c.pending.clear()
            return obj
        try:
            for i, c in enumerate(choices):
                if chat:
                    yield sse(part(role=True, text="", index=i))
                elif c.echo:  # the prompt first, in a chunk of its own
                    lp = c.echo.logprobs(pieces, gen.logprobs is not None)
                    yield sse(part(text=c.echo.text, logprobs=lp, index=i))
            async for i, kind, payload in _events(request, events, len(choices)):
                c = choices[i]
                if kind == "tokens":
                    _observe(t0, payload, c.handle)
                    delta = c.feed(payload)
                    if delta:
                        yield sse(part(text=delta, logprobs=logprobs(c), index=i))
                    continue
                if kind == "logprobs":
                    c.add_logprobs(payload)
                    continue
                c.fin = payload
                if c.fin.reason == "error":
                    yield sse(protocol.error_body(f"the request failed: {c.fin.error}", "server_error"))
                    yield "data: [DONE]\n\n"
                    return
                if c.fin.reason == "cancelled" and not c.stopped:  # ended by the server (shutdown)
                    yield sse(protocol.error_body("the server is shutting down; the answer was cut", "server_error",
                                                  code="server_shutdown"))
                    yield "data: [DONE]\n\n"
                    return
                delta = c.final()
                if delta:
                    yield sse(part(text=delta, logprobs=logprobs(c), index=i))
                if c.calls:
                    yield sse(part(tool_calls=c.calls, index=i))
                yield sse(part(reason=c.reason(), logprobs=logprobs(c) if c.pending else None, index=i))
            if any(c.fin is None for c in choices):
                return
            if gen.include_usage:
                yield sse(responses.chunk(rid, gen.model, chat, created,
                                         usage_obj=responses.usage(prompt_tokens, sum(c.used() for c in choices)),
                                         spec=responses.speculation([c.fin for c in choices])))
            metrics.observe_end(time.perf_counter() - t0, [c.fin for c in choices])
            yield "data: [DONE]\n\n"
        finally:
            live.pop(events, None)
            for c in choices:
                if c.fin is None:  # the client disconnected (or the server is cancelling this task)
                    c.handle.cancel()

    return app

