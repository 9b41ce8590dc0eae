"""One request while the engine answers it (`RunningRequest`): its choices' events, from the
engine's thread to the event loop through one asyncio queue, and its answer: OpenAI's stream of
chunks (server-sent events) or one response object. Also each choice's engine request
(`engine_request`)."""
from __future__ import annotations

import asyncio
import functools
import time
from typing import AsyncIterator, List, Optional, Set

from starlette.requests import Request

from medusa_jax.decoding.requests import Finished
from medusa_jax.decoding.requests import Request as EngineRequest
from medusa_jax.decoding.requests import SamplingParams
from medusa_jax.serve import responses
from medusa_jax.serve.choices import Choice, sse
from medusa_jax.serve.errors import RequestError
from medusa_jax.serve.metrics import Metrics
from medusa_jax.serve.protocol import Generation
from medusa_jax.serve.text import TokenPieces

#: The server's message when a shutdown's grace ran out before an answer's end.
CUT_BY_SHUTDOWN = "the server is shutting down; the answer was cut"


def engine_request(gen: Generation, ids: List[int], max_tokens: int, j: int, eos: List[int],
                   bad_words: Optional[List[List[int]]]) -> EngineRequest:
    """The engine's request for choice `j` of prompt `ids` (at most `max_tokens` new tokens): the
    request's settings, sampling with seed ``gen.seed + j`` (greedy choices are all alike); `eos`:
    the model's end-of-sequence ids; `bad_words`: their token ids (`serve.prompts.bad_word_ids`)."""
    sampling = SamplingParams(gen.temperature, gen.top_p, (gen.seed + j) % 2 ** 31, gen.top_k, gen.min_p,
                              gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty)
    return EngineRequest(ids, max_tokens, sampling, gen.eos_override(eos), logprobs=gen.logprobs,
                         logit_bias=gen.logit_bias, min_tokens=gen.min_tokens,
                         allowed_token_ids=gen.allowed_token_ids, bad_words=bad_words)


class RunningRequest:
    """A request's choices in the engine (`choices`, choice k * n + j: prompt k's j-th), whose
    events (choice index, kind, payload) come through one queue, and its answer (`stream` or
    `collect`). While it runs it is in the server's `live` set, from which a shutdown whose grace
    ran out ends it (`end_for_shutdown`).

    Args:
      gen, chat, rid: the checked request, whether it is a chat, the response's id.
      prompt_tokens: its prompts' tokens (``usage.prompt_tokens``).
      total: its engine requests (the prompts times ``n``).
      pieces: the tokens' texts and bytes (log-probabilities); metrics: the server's (vLLM's names).
      live: the server's running requests.
    Must be made on the event loop's thread (its queue is fed there).
    """

    def __init__(self, gen: Generation, chat: bool, rid: str, prompt_tokens: int, total: int, pieces: TokenPieces,
                 metrics: Metrics, live: Set["RunningRequest"]):
        self.gen, self.chat, self.rid, self.prompt_tokens = gen, chat, rid, prompt_tokens
        self.pieces, self.metrics, self.live = pieces, metrics, live
        self.loop = asyncio.get_running_loop()
        self.events: "asyncio.Queue" = asyncio.Queue()
        self.remaining = total  # choices not yet ended (counted on the engine's thread)
        self.choices: List[Choice] = []
        self.t0 = 0.0

    def on_event(self, i: int, kind: str, payload) -> None:
        """The engine's callback of choice `i` (on the engine's thread): the event goes on the queue."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (i, kind, payload))
        if kind == "done":  # the last choice's end is in the queue: nothing left for a shutdown to answer
            self.remaining -= 1
            if not self.remaining:
                self.loop.call_soon_threadsafe(self.live.discard, self)

    def callback(self):
        """The `on_event` of the choice to be added next (`add`)."""
        return functools.partial(self.on_event, len(self.choices))

    def add(self, choice: Choice) -> None:
        """Choice `choice`, submitted with `callback`'s `on_event`, is the request's next."""
        self.choices.append(choice)

    def start(self) -> None:
        """Every choice submitted: the request is live, its clock starts."""
        self.live.add(self)
        self.t0 = time.perf_counter()

    def cancel_unfinished(self) -> None:
        """Cancel the engine requests of the choices that have not ended (their rows are freed at the
        engine's next iteration)."""
        for c in self.choices:
            if c.fin is None:
                c.handle.cancel()

    def end_for_shutdown(self) -> None:
        """End each choice still running with a "cancelled" end, at once, even while the engine is
        busy (compiling a new shape, which cannot be interrupted). On the event loop's thread."""
        for i, c in enumerate(self.choices):
            handle = c.handle
            if handle.finished is None and not handle.cancelled.is_set():  # a stopped one ends by itself
                self.events.put_nowait((i, "done", Finished("cancelled", prompt_tokens=len(handle.request.prompt))))

    async def _events(self, request: Request) -> AsyncIterator[tuple]:
        """The events (choice, kind, payload) until each choice has sent ("done", Finished); stops
        early (the caller cancels) when the client disconnects, which is checked at least once a
        second whether or not tokens are flowing (a non-streaming request's client is heard from
        no other way)."""
        checked, n = self.loop.time(), len(self.choices)
        while n:
            try:
                item = await asyncio.wait_for(self.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                item = None
            if (item is None or item[1] != "done") and self.loop.time() - checked >= 1.0:
                checked = self.loop.time()
                if await request.is_disconnected():
                    return
            if item is None:
                continue
            yield item
            n -= item[1] == "done"

    def _observe(self, tokens: List[int], handle) -> None:
        """vLLM's time to first token and inter-token latency of `tokens`, just arrived."""
        now = time.perf_counter()
        last = getattr(handle, "_last_token_at", None)
        if last is None:
            self.metrics.observe_first_token(now - self.t0)
            self.metrics.observe_tokens(0.0, len(tokens) - 1)
        else:
            self.metrics.observe_tokens(now - last, len(tokens))
        handle._last_token_at = now

    def _logprobs(self, c: Choice) -> Optional[dict]:
        """The logprobs object of the tokens a chunk of choice `c` carries (None when not asked)."""
        if self.gen.logprobs is None:
            return None
        obj = responses.logprobs_obj(c.pending, self.chat, self.pieces, c.offsets)
        c.sent_tokens += len(c.pending)
        c.pending.clear()
        return obj

    async def stream(self, request: Request) -> AsyncIterator[str]:
        """The answer as server-sent events: each choice's first chunk (a chat's role, a completion's
        echoed prompt), its text deltas with their logprobs, its tool calls and its finish_reason;
        with ``include_usage`` the usage chunk; then ``data: [DONE]``. A failed choice or one cut by
        a shutdown ends the stream with an error event. A client that disconnects cancels the rest."""
        gen, chat = self.gen, self.chat
        part = functools.partial(responses.chunk, self.rid, gen.model, chat, gen.created,
                                 include_usage=gen.include_usage)
        try:
            for i, c in enumerate(self.choices):
                if chat:
                    yield sse(part(role=True, text="", index=i))
                elif c.echo:  # the prompt first, in a chunk of its own
                    yield sse(part(text=c.echo.text, logprobs=c.echo.logprobs(self.pieces, gen.logprobs is not None),
                                   index=i))
            async for i, kind, payload in self._events(request):
                c = self.choices[i]
                if kind == "tokens":
                    self._observe(payload, c.handle)
                    delta = c.feed(payload)
                    if delta:
                        yield sse(part(text=delta, logprobs=self._logprobs(c), index=i))
                    continue
                if kind == "logprobs":
                    c.add_logprobs(payload)
                    continue
                c.fin = payload
                failure = self._failure([c])
                if failure is not None:
                    yield sse(failure.body())
                    yield "data: [DONE]\n\n"
                    return
                delta = c.final()
                if delta:
                    yield sse(part(text=delta, logprobs=self._logprobs(c), index=i))
                if c.calls:
                    yield sse(part(tool_calls=c.calls, index=i))
                yield sse(part(reason=c.reason(), logprobs=self._logprobs(c) if c.pending else None, index=i))
            choices = self.choices
            if any(c.fin is None for c in choices):
                return
            fins = [c.fin for c in choices]
            if gen.include_usage:
                yield sse(responses.chunk(self.rid, gen.model, chat, gen.created,
                                          usage_obj=responses.usage(self.prompt_tokens, sum(c.used() for c in choices)),
                                          spec=responses.speculation(fins)))
            self.metrics.observe_end(time.perf_counter() - self.t0, fins)
            yield "data: [DONE]\n\n"
        finally:
            self.live.discard(self)
            self.cancel_unfinished()  # the client disconnected (or the server is cancelling this task)

    @staticmethod
    def _failure(choices: List[Choice]) -> Optional[RequestError]:
        """The error that ends the request when one of `choices` (ended) failed in the engine (500),
        or was ended by the server, not by a stop sequence (a shutdown: 503)."""
        failed = next((c.fin for c in choices if c.fin.reason == "error"), None)
        if failed is not None:
            return RequestError(f"the request failed: {failed.error}", status=500, type="server_error")
        if any(c.fin.reason == "cancelled" and not c.stopped for c in choices):
            return RequestError(CUT_BY_SHUTDOWN, status=503, type="server_error", code="server_shutdown")
        return None

    async def collect(self, request: Request) -> Optional[dict]:
        """The whole answer (``chat.completion`` or ``text_completion``) once every choice ended;
        None when the client went away first (its choices are cancelled).
        Raises:
          RequestError: 500 when a choice failed in the engine; 503 ``server_shutdown`` when a
            shutdown's grace ran out before the end.
        """
        try:
            async for i, kind, payload in self._events(request):
                c = self.choices[i]
                if kind == "tokens":
                    self._observe(payload, c.handle)
                    c.feed(payload)
                elif kind == "logprobs":
                    c.add_logprobs(payload)
                else:
                    c.fin = payload
        finally:
            self.live.discard(self)
            self.cancel_unfinished()
        if any(c.fin is None for c in self.choices):  # the client went away
            return None
        failure = self._failure(self.choices)
        if failure is not None:
            raise failure
        return self._answer()

    def _answer(self) -> dict:
        """The response object of the ended choices (each choice's content after an echoed prompt,
        its logprobs, finish_reason and tool calls; the usage and the speculation counts)."""
        gen, chat, out = self.gen, self.chat, []
        for i, c in enumerate(self.choices):
            c.final()
            lp = None if gen.logprobs is None else responses.logprobs_obj(c.pending, chat, self.pieces, c.offsets)
            content = c.content()
            if c.echo:
                content = c.echo.text + content
                lp = lp and responses.joined_logprobs(c.echo.logprobs(self.pieces, True), lp)
            out.append(responses.choice(i, chat, content, c.reason(), lp, c.calls))
        fins = [c.fin for c in self.choices]
        self.metrics.observe_end(time.perf_counter() - self.t0, fins)
        return responses.completion(self.rid, gen.model, chat, out,
                                    responses.usage(self.prompt_tokens, sum(c.used() for c in self.choices)),
                                    fins, gen.created)
