"""What the server's routes call (`OpenAIServing`, after vLLM's serving classes): a completion's
request from its checked body to the engine's requests and back (`create_completion`), vLLM's
``/tokenize`` and ``/detokenize``, ``/health`` and the model card, and the server's life: the
engine started and stopped with the app (`lifespan`), and a shutdown's refusals and its grace's
end (`begin_shutdown`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import time
from typing import Any, List, Optional, Set, Union

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from medusa_jax.chat import template_takes_tools
from medusa_jax.decoding.requests import EngineStopped
from medusa_jax.serve import responses
from medusa_jax.serve.body import MAX_REQUEST_BYTES, parse_json, read_body
from medusa_jax.serve.choices import Choice, Echo
from medusa_jax.serve.echo import ClientGone, Echoer, echo_alone
from medusa_jax.serve.errors import RequestError
from medusa_jax.serve.metrics import Metrics
from medusa_jax.serve.prompts import (answer_budgets, bad_word_ids, check_tool_use, leave_out_unused_tools,
                                      tokenize_prompts)
from medusa_jax.serve.protocol import MAX_PROMPTS, Generation, check_detokenize, check_request, flag
from medusa_jax.serve.running import RunningRequest, engine_request
from medusa_jax.serve.text import AFTER_TOKENS, TextOffsets, TextStream, TokenPieces, marker_ids
from medusa_jax.serve.tools import TOOL_PARSERS

#: The headers of a server-sent event stream (no proxy buffering it).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def shutting_down(message: str = "the server is shutting down") -> RequestError:
    """The 503 of a request that came, or was read, once a shutdown began."""
    return RequestError(message, status=503, type="server_error")


class OpenAIServing:
    """The server's parts and its request handling (`serve.app.create_app` gives it its routes).

    Args:
      engine: the engine (``engine.engine.Engine``; its ``max_len`` is the context a request may use).
      tokenizer: the model's tokenizer (chat template, detokenization).
      model_name: the id clients name in ``model``.
      max_waiting: requests that may wait for a row; one more is refused with 429.
      max_tokens_default: the budget of a request without ``max_tokens`` (`prompts.answer_budgets`).
      max_request_bytes: the largest request body accepted (413 past it).
      tool_call_parser: one of `serve.tools.TOOL_PARSERS`, or None (no tool calls).
      exclude_tools_when_none: render a chat with ``tool_choice: "none"`` without its tools.
    Raises:
      ValueError: an unknown `tool_call_parser`.
    """

    def __init__(self, engine, tokenizer, model_name: str, *, max_waiting: int = 64,
                 max_tokens_default: Optional[int] = None, max_request_bytes: int = MAX_REQUEST_BYTES,
                 tool_call_parser: Optional[str] = None, exclude_tools_when_none: bool = False):
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose one of {', '.join(TOOL_PARSERS)}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_waiting, self.max_tokens_default = max_waiting, max_tokens_default
        self.max_request_bytes, self.exclude_tools_when_none = max_request_bytes, exclude_tools_when_none
        self.tools = TOOL_PARSERS.get(tool_call_parser)
        self.takes_tools = template_takes_tools(tokenizer)  # the template is the server's, fixed
        self.context = engine.max_len
        self.metrics = Metrics(engine, model_name)
        self.shutting_down = False  # new requests get 503
        self.cancelling = False  # the shutdown's grace ran out: the running requests are ended
        self.model = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "medusa_jax",
                      "max_model_len": self.context}  # OpenAI's model object
        # prompts are tokenized off the event loop, one at a time (a tokenizer is not made to be entered
        # by several threads at once)
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-tokenize")
        self.pieces = TokenPieces(tokenizer)  # each token's bytes and text, for logprobs
        # the tool-call markers' ids, kept in a tool answer's text
        self.markers = marker_ids(tokenizer, self.pieces, self.tools.markers) if self.tools else frozenset()
        self.echoer = Echoer(engine, tokenizer, self.pieces, self.tokenize_pool, max(max_waiting, MAX_PROMPTS),
                             cancelled=lambda: self.cancelling)
        # the running requests: at the end of the shutdown grace they are answered from here, without
        # waiting for the engine, which cannot be interrupted while it compiles a new shape
        self.live: Set[RunningRequest] = set()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        """The app's lifespan: the engine runs (in its thread) while the app does."""
        self.engine.start()
        try:
            yield
        finally:
            self.shutting_down = True
            await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
            self.tokenize_pool.shutdown(wait=False)
            self.echoer.shutdown()

    def begin_shutdown(self, cancel: bool = False) -> None:
        """Refuse new requests (503) from now on; with `cancel`, end the running and waiting ones too
        (each gets the server_shutdown error at once, even while the engine is busy compiling), as
        the shutdown grace runs out. Call it on the event loop's thread."""
        self.shutting_down = True
        if cancel:
            self.cancelling = True  # prompts being scored for an echo stop at their next chunk
            for running in list(self.live):
                running.end_for_shutdown()
            self.engine.cancel_all()

    def health(self) -> dict:
        """``/health``: the engine's running and waiting requests and the prompts being scored;
        RequestError 503 once a shutdown began."""
        if self.shutting_down:
            raise shutting_down()
        return {"status": "ok", "running": self.engine.live, "waiting": self.engine.waiting,
                "scoring": self.echoer.scoring}

    def model_card(self, model_id: str) -> dict:
        """OpenAI's model object of `model_id`; RequestError 404 for a model not served."""
        if model_id != self.model_name:
            raise RequestError(f"the model {model_id!r} does not exist; this server serves {self.model_name}",
                               "model", status=404, code="model_not_found")
        return self.model

    async def read_json(self, request: Request) -> Any:
        """The request's body parsed as JSON. Raises RequestError: 503 once a shutdown began, 413 for
        a body over the limit (`body.read_body`), 400 for one that is not JSON."""
        if self.shutting_down:
            raise shutting_down()
        return parse_json(await read_body(request, self.max_request_bytes))

    def check(self, body: Any, chat: bool) -> Generation:
        """`protocol.check_request` for this server's model, context and vocabulary."""
        return check_request(body, [self.model_name], self.context, chat, self.engine.cfg.vocab_size)

    async def create_completion(self, request: Request, body: Any, chat: bool) -> Union[dict, Response]:
        """The answer to a ``/v1/chat/completions`` (`chat`) or ``/v1/completions`` request `body`:
        OpenAI's response object, or its stream of chunks (``stream``); a 499 when the client went
        away before the answer.

        Raises:
          RequestError: the body's first field at fault (4xx, `protocol.check_request`); a prompt
            that does not fit or a budget past the context (`serve.prompts`); more choices than
            the engine's rows and queue take (400), or a full queue now (429, ``Retry-After``); a
            shutdown (503); a choice that failed in the engine (500, not streaming).
        """
        gen = self.check(body, chat)
        check_tool_use(gen, self.tools, self.takes_tools, self.exclude_tools_when_none)
        prompts = await tokenize_prompts(gen, chat, self.tokenizer, self.tokenize_pool, self.context,
                                         room=0 if gen.max_tokens == 0 else 1)  # echo alone: the whole context
        limits = answer_budgets(gen, prompts, chat, self.context, self.max_tokens_default)
        bad_words = bad_word_ids(self.tokenizer, gen)
        total = self._engine_requests(gen, prompts)
        # each choice takes a row, or a place in the queue once the free rows are taken: checked before
        # an echo's scoring (a refused request spends none) and again after it, with nothing awaited
        # before the submissions, so that concurrent requests cannot all pass it
        if gen.echo:
            self._refuse_if_queue_full(total)
        try:
            echoes = (await self.echoer.echoes(gen, prompts, request.is_disconnected) if gen.echo
                      else [None] * len(prompts))
        except ClientGone:
            return Response(status_code=499)
        self._refuse_if_queue_full(total)
        rid = responses.new_id(chat)
        if gen.max_tokens == 0:
            return echo_alone(gen, rid, prompts, echoes, self.pieces)
        running = self._submit(gen, chat, rid, prompts, limits, echoes, bad_words, total)
        if gen.stream:
            return StreamingResponse(running.stream(request), media_type="text/event-stream", headers=SSE_HEADERS)
        answer = await running.collect(request)
        return Response(status_code=499) if answer is None else answer

    def _engine_requests(self, gen: Generation, prompts: List[List[int]]) -> int:
        """The engine requests of a request (its prompts times ``n``; none for an echo alone);
        RequestError when they could never all have a row or a place in the queue."""
        total = 0 if gen.max_tokens == 0 else len(prompts) * gen.n
        if total > self.engine.max_batch + self.max_waiting:
            raise RequestError(f"{total} choices need a row or a place in the queue each; this server has "
                               f"{self.engine.max_batch} rows and queues {self.max_waiting} (--max-batch, "
                               "--max-waiting)", "n" if len(prompts) == 1 else "prompt")
        return total

    def _refuse_if_queue_full(self, total: int) -> None:
        """RequestError 429 (``Retry-After: 1``) when `total` more engine requests would queue more than
        ``max_waiting`` requests behind the free rows."""
        engine = self.engine
        if total and max(0, engine.waiting + total - max(0, engine.max_batch - engine.live)) > self.max_waiting:
            raise RequestError(f"{engine.queued} requests are waiting for a row; try again shortly", status=429,
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def _submit(self, gen: Generation, chat: bool, rid: str, prompts: List[List[int]], limits: List[int],
                echoes: List[Optional[Echo]], bad_words: Optional[List[List[int]]], total: int) -> RunningRequest:
        """Each choice's engine request submitted (choice k * n + j: prompt k's j-th, `engine_request`),
        with its text stream (stop sequences, tool-call markers) and offsets: the `RunningRequest`.
        RequestError: the engine refused one (400, naming the prompt), or stopped (503)."""
        running = RunningRequest(gen, chat, rid, sum(len(ids) for ids in prompts), total, self.pieces, self.metrics,
                                 self.live)
        calls_tools = gen.tool_choice == "auto"  # the answers are read for tool calls
        continues = not chat or gen.continue_final_message  # the answers continue the prompt's text
        try:
            for (ids, limit, echo), j in itertools.product(zip(prompts, limits, echoes), range(gen.n)):
                handle = self.engine.submit(engine_request(gen, ids, limit, j, self.engine.eos, bad_words),
                                            on_event=running.callback())
                text = TextStream(self.tokenizer, gen.stop, gen.include_stop, gen.stop_token_ids or (), gen.min_tokens,
                                  self.markers if calls_tools else frozenset(), self.pieces.special,
                                  after=ids[-AFTER_TOKENS:] if continues else ())
                offsets = TextOffsets(self.pieces, start=len(echo.text) if echo else 0)  # an echo: after the prompt
                running.add(Choice(handle, text, offsets, self.tools if calls_tools else None, echo,
                                   None if gen.parallel_tool_calls else 1))
        except (ValueError, EngineStopped) as e:
            running.cancel_unfinished()
            if isinstance(e, EngineStopped):  # the shutdown stopped the engine while this request was read
                raise shutting_down() from None
            raise RequestError(str(e), "messages" if chat else "prompt") from None
        running.start()
        return running

    async def tokenize(self, body: Any, chat: bool) -> dict:
        """vLLM's ``/tokenize``: the token ids the server would feed the model for a completion's
        ``prompt`` (one) or a chat's ``messages`` (with the same template fields as a chat request),
        their ``count`` and the context (``max_model_len``); ``return_token_strs``: each token's text.
        A prompt longer than the context is counted, not refused. RequestError as
        `protocol.check_request`, and for several prompts."""
        gen = self.check(body, chat)
        if not chat and len(gen.prompts) != 1:
            raise RequestError(f"prompt: /tokenize takes one prompt, got {len(gen.prompts)}", "prompt")
        leave_out_unused_tools(gen, self.exclude_tools_when_none)  # the ids a chat request would be fed
        ids = (await tokenize_prompts(gen, chat, self.tokenizer, self.tokenize_pool, self.context, fit=False))[0]
        out = {"count": len(ids), "max_model_len": self.context, "tokens": ids}
        if flag(body, "return_token_strs", False):
            out["token_strs"] = [self.pieces.text(t) for t in ids]
        return out

    def detokenize(self, body: Any) -> dict:
        """vLLM's ``/detokenize``: the text of ``tokens`` (ids in the vocabulary), special tokens kept;
        RequestError as `protocol.check_detokenize`."""
        ids = check_detokenize(body, [self.model_name], self.engine.cfg.vocab_size)
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
