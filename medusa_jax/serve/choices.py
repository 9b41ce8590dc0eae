"""A request's choices while they run (`Choice`: text, stop sequences, tool calls, log-probabilities
not yet sent, a completion's echoed prompt) and the server-sent event of one stream chunk."""
from __future__ import annotations

import json
from typing import List, NamedTuple, Optional

from medusa_jax.serve import responses
from medusa_jax.serve.text import TextOffsets, TextStream, TokenPieces
from medusa_jax.serve.tools import ToolCallParser


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Echo(NamedTuple):
    """An echoed prompt (a completion's ``echo``): its text, and its tokens' log-probabilities
    (`Engine.prompt_logprobs`, the first token's logprob None) with where each token's text starts in
    `text` (both empty when no log-probabilities were asked for)."""
    text: str
    entries: list
    offsets: List[int]

    def logprobs(self, pieces: TokenPieces, asked: bool) -> Optional[dict]:
        """The prompt's part of a completion's ``logprobs`` object (None when not `asked`)."""
        return responses.logprobs_obj(self.entries, False, pieces, text_offset=self.offsets) if asked else None


class Choice:
    """One of a request's ``n`` choices while it runs: its engine handle, its text, whether a stop
    sequence ended it, its end, and the log-probabilities not yet sent (the tokens sent, and where
    the next one's text starts). With a tool-call parser (`serve.tools`), the text is the message's
    content up to where a tool call may start (held back until the end: `final` parses it), and
    `calls` the answer's tool calls."""

    def __init__(self, handle, text: TextStream, offsets: TextOffsets, tools: Optional[ToolCallParser] = None,
                 echo: Optional["Echo"] = None, max_calls: Optional[int] = None):
        self.handle, self.text, self.offsets, self.tools = handle, text, offsets, tools
        self.max_calls = max_calls  # OpenAI's parallel_tool_calls false: 1 (the answer's first call only)
        self.echo = echo  # a completion's echo: the prompt's text and log-probabilities, before the answer
        self.stopped, self.fin = False, None
        self.pending: list = []
        self.sent_tokens = 0
        self.content_sent = 0  # with tools: characters of the text sent as content
        self.answer: Optional[str] = None  # with tools: the content, after `final`
        self.calls: List[dict] = []

    def feed(self, tokens: List[int]) -> str:
        """The content delta of a step's tokens ("" once a stop sequence ended the choice); the token
        that completes a stop sequence cancels the engine's request and drops the log-probabilities
        of the tokens after it (not the answer's)."""
        if self.stopped:
            return ""
        delta, self.stopped = self.text.feed(tokens)
        if self.stopped:
            self.handle.cancel("stop")
            del self.pending[max(self.text.used - self.sent_tokens, 0):]
        return self._content(delta)

    def _content(self, delta: str) -> str:
        """The part of the text handed out (`delta`: its newest) that is surely content."""
        if self.tools is None:
            return delta
        out = self.text.text[:self.text.sent]
        end = max(self.tools.releasable(out), self.content_sent)
        delta, self.content_sent = out[self.content_sent:end], end
        return delta

    def add_logprobs(self, entries: list) -> None:
        if not self.stopped:
            self.pending.extend(entries)

    def final(self) -> str:
        """The content held back until the answer ended (a possible stop sequence's start, a possible
        tool call's); the answer's tool calls are parsed into `calls`."""
        delta = "" if self.stopped else self.text.feed([], final=True)[0]
        if self.tools is None:
            return delta
        self.answer, self.calls = self.tools.parse(self.text.text)
        self.calls = self.calls[:self.max_calls]
        delta = (self.answer or "")[self.content_sent:]
        self.content_sent += len(delta)
        return delta

    def content(self) -> Optional[str]:
        """The whole answer's content, after `final` (None: only tool calls)."""
        return self.text.text if self.tools is None else self.answer

    def reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "stop" if self.stopped else responses.finish_reason(self.fin.reason)

    def used(self) -> int:
        """The answer's tokens (up to a stop sequence's)."""
        return len(self.fin.tokens) if self.text.used is None else self.text.used
