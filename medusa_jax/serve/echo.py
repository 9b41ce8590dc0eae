"""A completion's ``echo``: each prompt given back before its answer, with its tokens' own
log-probabilities when ``logprobs`` is asked (what lm-evaluation-harness's loglikelihood requests
read), and the answer of an echo alone (``max_tokens: 0``)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Awaitable, Callable, List, Optional

from fastapi.responses import StreamingResponse

from medusa_jax.engine.engine import Engine
from medusa_jax.decoding.requests import EngineStopped, TokenLogprob
from medusa_jax.serve import protocol, responses
from medusa_jax.serve.choices import Echo, sse
from medusa_jax.serve.protocol import RequestError
from medusa_jax.serve.text import TextOffsets, TokenPieces


#: Seconds between two looks at the shutdown and the client while a prompt is scored (`Echoer._score`).
POLL_S = 0.5


class ClientGone(Exception):
    """The client of a request being scored disconnected (`Echoer.echoes`): nothing to answer."""


class Echoer:
    """Makes a request's `Echo` of each prompt. The prompts' log-probabilities are computed one prompt
    at a time in a worker thread of their own, beside the engine's steps (`Engine.prompt_logprobs`);
    at most `max_scoring` prompts wait to be scored.

    Args:
      engine: the engine whose backbone scores the prompts.
      tokenizer, pieces: the model's tokenizer and its tokens' texts (`serve.text.TokenPieces`).
      tokenize_pool: the server's one tokenizer thread (a tokenizer is not made to be entered by
        several threads at once).
      max_scoring: prompts that may wait to be scored; more get 429.
      cancelled: asked between a scoring's chunks; True (the shutdown grace ran out) stops it.
    Attributes: ``scoring``: the prompts being scored or waiting to be (``/health`` shows it).
    """

    def __init__(self, engine: Engine, tokenizer, pieces: TokenPieces,
                 tokenize_pool: concurrent.futures.Executor, max_scoring: int, cancelled: Callable[[], bool]):
        self.engine, self.tokenizer, self.pieces = engine, tokenizer, pieces
        self.tokenize_pool, self.max_scoring, self.cancelled = tokenize_pool, max_scoring, cancelled
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-score")
        self.scoring = 0

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)

    async def echoes(self, gen: protocol.Generation, prompts: List[List[int]],
                     disconnected: Optional[Callable[[], Awaitable[bool]]] = None) -> List[Echo]:
        """Each prompt as the completion echoes it: the prompt's own text when it came as text (its ids'
        text, special tokens kept, otherwise), and with ``logprobs`` its tokens' log-probabilities and
        where each token's text starts (`offsets`). When an answer follows (``max_tokens`` > 0), the
        scoring's KV cache is kept for its prefill (`Engine.prompt_logprobs`'s ``keep``).
        `disconnected` (the request's ``is_disconnected``) is asked every `POLL_S` while a prompt is
        scored: a client gone stops its scoring at the next chunk.
        Raises RequestError: 429 when more than ``max_scoring`` prompts would wait to be scored; 503
        ``server_shutdown`` as soon as the shutdown's grace runs out (`cancelled`), the scoring
        stopping at its next chunk. ClientGone when `disconnected` said so."""
        if gen.logprobs is not None and self.scoring + len(prompts) > self.max_scoring:
            raise RequestError(f"{self.scoring} prompts are waiting to be scored; try again shortly", status=429,
                               type="rate_limit_error", code="queue_full")
        run = asyncio.get_running_loop().run_in_executor
        out, queued = [], len(prompts) if gen.logprobs is not None else 0
        self.scoring += queued
        try:
            for p, ids in zip(gen.prompts, prompts):
                text = p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False,
                                                                          clean_up_tokenization_spaces=False)
                if gen.logprobs is None:
                    out.append(Echo(text, [], []))
                    continue
                try:
                    scored = await self._score(ids, gen.logprobs, gen.max_tokens != 0, disconnected)
                finally:
                    self.scoring -= 1
                    queued -= 1
                offsets = await run(self.tokenize_pool, self.offsets, p, ids)
                out.append(Echo(text, [TokenLogprob(ids[0], None)] + scored[1:], offsets))
        finally:
            self.scoring -= queued
        return out

    async def _score(self, ids: List[int], top: int, keep: bool,
                     disconnected: Optional[Callable[[], Awaitable[bool]]]) -> list:
        """`Engine.prompt_logprobs` of one prompt in the scoring thread, watched from the event loop:
        the shutdown's end answers at once (the thread stops at its next chunk, which may take seconds,
        past the grace), and so does a client gone."""
        stop = threading.Event()
        job = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(
            self.engine.prompt_logprobs, ids, top, stop=lambda: stop.is_set() or self.cancelled(), keep=keep))
        try:
            while True:
                done, _ = await asyncio.wait([job], timeout=POLL_S)
                if done:
                    return job.result()  # EngineStopped: the engine stopped (shutdown)
                if self.cancelled():
                    raise EngineStopped("the shutdown's grace ran out")
                if disconnected is not None and await disconnected():
                    raise ClientGone("the client disconnected while its prompts were scored")
        except EngineStopped:
            raise RequestError("the server is shutting down; the prompt's scoring was cut", status=503,
                               type="server_error", code="server_shutdown") from None
        finally:
            stop.set()  # a scoring still running ends at its next chunk; its outcome is not wanted
            job.add_done_callback(lambda f: f.cancelled() or f.exception())

    def offsets(self, prompt, ids: List[int]) -> List[int]:
        """Where each prompt token's text starts in the echoed text: for a text prompt, the
        tokenizer's own character offsets (a token it added, as BOS, at 0); for token ids, their
        texts' lengths summed, special tokens included (as the echo decodes them)."""
        if isinstance(prompt, str) and getattr(self.tokenizer, "is_fast", False):
            spans = self.tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]
            if len(spans) == len(ids):
                return [start for start, _ in spans]
        offsets = TextOffsets(self.pieces, specials=True)
        return [offsets.next(t) for t in ids]


def echo_alone(gen: protocol.Generation, rid: str, prompts: List[List[int]], echoes: List[Echo],
               pieces: TokenPieces):
    """A completion with ``echo`` and ``max_tokens: 0`` (vLLM's): each prompt's `n` choices are the
    prompt itself (finish_reason "length"), no token generated; streamed as one chunk per choice."""
    out = [responses.choice(k * gen.n + j, False, e.text, "length", e.logprobs(pieces, gen.logprobs is not None))
           for k, e in enumerate(echoes) for j in range(gen.n)]
    used = responses.usage(sum(len(ids) for ids in prompts), 0)
    if not gen.stream:
        return responses.completion(rid, gen.model, False, out, used, [], gen.created)

    def chunks():
        for c in out:
            yield sse(responses.chunk(rid, gen.model, False, gen.created, c["text"], "length",
                                     include_usage=gen.include_usage, logprobs=c["logprobs"], index=c["index"]))
        if gen.include_usage:
            yield sse(responses.chunk(rid, gen.model, False, gen.created, usage_obj=used,
                                     spec=responses.speculation([])))
        yield "data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
