"""OpenAI's response objects and stream chunks for the server: ``chat.completion``,
``chat.completion.chunk``, ``text_completion``, the ``usage`` and ``logprobs`` objects; the server
adds a ``speculation`` object (steps, tokens per step, draft and accepted tokens, summed over a
request's choices). The requests they answer are checked by `serve.protocol`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional


def finish_reason(engine_reason: str) -> str:
    """OpenAI's finish_reason of the engine's (`engine.engine.Finished.reason`)."""
    return {"eos": "stop", "stop": "stop", "length": "length", "cache_full": "length"}.get(engine_reason, engine_reason)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(fins: List[Any]) -> dict:
    """The server's ``speculation`` object of a finished request: its choices' `engine.engine.Finished`
    summed (tokens per step over all their steps)."""
    steps, tokens = sum(f.steps for f in fins), sum(len(f.tokens) for f in fins)
    return {"steps": steps, "tokens_per_step": round(tokens / max(steps, 1), 4),
            "draft_tokens": sum(f.draft_tokens for f in fins),
            "accepted_tokens": sum(max(len(f.tokens) - f.steps, 0) for f in fins),
            "prompt_tokens_reused": sum(f.reused_tokens for f in fins)}


#: The log-probability reported for one too small for a float (JSON has no -Infinity; vLLM's value).
LOGPROB_FLOOR = -9999.0


def logprobs_obj(entries: List[Any], chat: bool, pieces, offsets=None, text_offset: Optional[List[int]] = None) -> dict:
    """OpenAI's ``logprobs`` object of some answer tokens (`decoding.requests.TokenLogprob`s).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}], "refusal": null}``; completion (legacy): ``{"tokens", "token_logprobs",
    "top_logprobs": [{token: logprob}] (the alternatives and the chosen token, as vLLM),
    "text_offset"}``; an echoed prompt's first token, which nothing precedes, has a null logprob
    and top_logprobs (its entry's ``logprob`` is None). `pieces`: the tokens' own bytes and text
    (`serve.text.TokenPieces`); `offsets`: the answer's `serve.text.TextOffsets` so far (completions;
    advanced here), or `text_offset`: the entries' offsets, known (an echoed prompt's)."""
    lp = lambda x: None if x is None else max(float(x), LOGPROB_FLOOR)  # noqa: E731
    if chat:
        item = lambda t, x: {"token": pieces.text(t), "logprob": lp(x), "bytes": list(pieces.bytes(t))}  # noqa: E731
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, x) for t, x in e.top])
                            for e in entries], "refusal": None}
    return {"tokens": [pieces.text(e.token) for e in entries], "token_logprobs": [lp(e.logprob) for e in entries],
            "top_logprobs": [None if e.logprob is None else
                             dict([(pieces.text(t), lp(x)) for t, x in e.top] + [(pieces.text(e.token), lp(e.logprob))])
                             for e in entries],
            "text_offset": list(text_offset) if text_offset is not None else [offsets.next(e.token) for e in entries]}


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two consecutive parts of a completion's legacy ``logprobs`` object as one (an echoed prompt's,
    then its answer's)."""
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def choice(index: int, chat: bool, text: Optional[str], reason: str, logprobs: Optional[dict] = None,
           tool_calls: Optional[List[dict]] = None) -> dict:
    """One choice of a non-streaming response: its text (a chat's assistant message, with its
    `tool_calls` when it has some: `serve.tools.tool_call` objects), finish_reason and
    `logprobs_obj` (None when the request asked for none)."""
    out: Dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            out["message"]["tool_calls"] = tool_calls
    else:
        out["text"] = text
    return out


def completion(rid: str, model: str, chat: bool, choices: List[dict], usage_obj: dict, fins: List[Any],
               created: Optional[int] = None) -> dict:
    """The non-streaming response object: `choices` (`choice`), `usage_obj` (`usage`: the prompt once,
    the choices' answer tokens summed), the ``speculation`` of the choices' `fins`; `created`: when
    the request came (default: now)."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage_obj, "speculation": speculation(fins)}


def chunk(rid: str, model: str, chat: bool, created: int, text: Optional[str] = None, reason: Optional[str] = None,
          role: bool = False, usage_obj: Optional[dict] = None, spec: Optional[dict] = None,
          include_usage: bool = False, logprobs: Optional[dict] = None, index: int = 0,
          tool_calls: Optional[List[dict]] = None) -> dict:
    """One streamed chunk: a text delta, the first (the role), a chat's `tool_calls` (each whole, with
    its index in the message, as OpenAI's deltas number them) or the last (finish_reason); with
    `usage_obj`, the usage chunk (no choices); with `include_usage`, the others carry ``"usage":
    null`` (as OpenAI's do when the stream's usage was asked for)."""
    out: Dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "system_fingerprint": None}
    if usage_obj is not None:
        out["choices"], out["usage"] = [], usage_obj
        if spec is not None:
            out["speculation"] = spec
        return out
    if chat:
        delta: Dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(tool_calls)]
        out["choices"] = [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]
    else:
        out["choices"] = [{"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}]
    if include_usage:
        out["usage"] = None
    return out
