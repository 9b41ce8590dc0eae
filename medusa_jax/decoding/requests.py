"""What a caller of the engine hands it and gets back: `Request` (prompt, budget, `SamplingParams`,
stop ids), the `RequestHandle` its events arrive on (token lists each step, then `Finished`), and
how a request ends (`FINISH_REASONS`)."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

#: Finish reasons of a request (`Finished.reason`).
FINISH_REASONS = ("eos", "stop", "length", "cache_full", "cancelled", "error")


class EngineStopped(RuntimeError):
    """`Engine.submit` after `Engine.stop`: nothing would run the request (`Engine.start` again first)."""


class SamplingParams(NamedTuple):
    """A request's sampling: temperature 0 = greedy; top_p in (0, 1]; seed in [0, 2**31) (the token at
    each position is chosen by that position's key from the seed: `decoding.sampling`); top_k >= 0
    (0 = every token; applied before top_p, as vLLM does).

    The penalties and min_p follow vLLM's `SamplingParams` (`decoding.processors`):
    presence_penalty and frequency_penalty in [-2, 2] (OpenAI's: subtracted once for a token the
    answer already holds, and once per occurrence); repetition_penalty > 0 (1: off; a token of the
    prompt or the answer has its logit divided by it when positive, multiplied when negative);
    min_p in [0, 1] (sampled rows only: tokens below min_p times the most likely token's
    probability are dropped). Greedy rows apply the penalties too, so a greedy answer with
    penalties is plain greedy decoding's with the same penalties."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


#: The `SamplingParams` fields that change the logits rather than how a token is drawn from them.
PENALTY_FIELDS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class Request:
    """What a caller asks for.

    prompt: token ids (chat template applied). max_new_tokens: the most tokens to emit (>= 1).
    sampling: `SamplingParams`. stop_token_ids: ids that end the answer (included in it); None: the
    model's EOS ids. request_id: any label (default: a counter). logprobs: None (the default), or
    N in [0, `decoding.logprobs.MAX_TOP_LOGPROBS`]: each emitted token's log-probability and the N
    most likely tokens at its position (`TokenLogprob`), as ``("logprobs", [...])`` events just
    before each ``("tokens", ...)`` event and in `Finished.logprobs`. logit_bias: token id -> a
    value added to its logit before every choice (OpenAI's ``logit_bias``: -100 bans a token, +100
    forces it), Medusa's verification included, so greedy answers stay plain greedy's with the
    same bias. min_tokens: the answer's stop ids (EOS, or `stop_token_ids`) are banned until it
    has this many tokens (vLLM's ``min_tokens``; at most max_new_tokens). allowed_token_ids: the
    only ids the answer may hold (vLLM's; None: all). bad_words: token id sequences the answer
    may not contain (vLLM's ``bad_words``, tokenized: a word's last token is banned right after its
    other tokens, when those are the answer's own).
    """
    prompt: Sequence[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: Optional[Sequence[int]] = None
    request_id: Optional[str] = None
    logprobs: Optional[int] = None
    logit_bias: Optional[Mapping[int, float]] = None
    min_tokens: int = 0
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[Sequence[int]]] = None


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability under the model (natural log, before temperature, top-k
    and top-p: `decoding.logprobs`) and the N most likely tokens at its position, as (id, logprob)
    pairs, most likely first."""
    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


@dataclass
class Finished:
    """How a request ended. reason: one of `FINISH_REASONS`; tokens: every token emitted; steps:
    decoding steps it took part in; prompt_tokens; reused_tokens: prompt tokens whose K/V came from
    the prefix cache; queue_s (from submission to the start of its prefill: the time it waited for the
    engine), prefill_s, first_token_s (from submission to the first token), decode_s
    (the wall time of the steps it took part in, from the tree's choice to the tokens handed out,
    compilation excluded); draft_tokens: the
    candidates verified for it; accepted_per_depth: [D] int, the steps that accepted at least d+1
    candidates (speculation stats); step_tokens: the tokens each step emitted; logprobs: one
    `TokenLogprob` per token when the request asked for them; error: the message when reason is
    "error"."""
    reason: str
    tokens: List[int] = field(default_factory=list)
    steps: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0
    draft_tokens: int = 0
    accepted_per_depth: List[int] = field(default_factory=list)
    step_tokens: List[int] = field(default_factory=list)
    logprobs: Optional[List[TokenLogprob]] = None
    error: str = ""

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per decoding step (the bonus token included)."""
        return len(self.tokens) / max(self.steps, 1)


class RequestHandle:
    """A submitted request: its events arrive on `events` (``("tokens", [ids])`` per step, then
    ``("done", Finished)``), or go to the ``on_event`` callback given to `Engine.submit`.
    Iterate it for the token lists; `result` waits for the end; `cancel` frees its row."""

    def __init__(self, request: Request, on_event: Optional[Callable[[str, object], None]] = None):
        self.request = request
        self.events: "queue.Queue" = queue.Queue()
        self._on_event = on_event
        self.cancelled = threading.Event()
        self.cancel_reason = "cancelled"
        self.finished: Optional[Finished] = None
        self._done = threading.Event()
        self.submitted = time.perf_counter()

    def _emit(self, kind: str, payload) -> None:
        if kind == "done":
            self.finished = payload
        if self._on_event is not None:
            self._on_event(kind, payload)
        else:
            self.events.put((kind, payload))
        if kind == "done":
            self._done.set()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request: its row is freed at the engine's next iteration; it finishes with
        `reason` ("cancelled", or "stop" for a caller that found a stop sequence in the text)."""
        self.cancel_reason = reason
        self.cancelled.set()

    def __iter__(self) -> Iterator[List[int]]:
        """The tokens of each step, until the request ends (handles without a callback only)."""
        while True:
            kind, payload = self.events.get()
            if kind == "done":
                return
            if kind == "tokens":
                yield payload

    def result(self, timeout: Optional[float] = None) -> Finished:
        """Wait for the end (the engine must be running: `Engine.start`, or `Engine.run` elsewhere).
        Raises TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id} did not finish within {timeout} s")
        return self.finished
