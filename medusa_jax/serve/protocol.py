"""OpenAI's request and response schemas for the server: checked request bodies (every error names its
field and becomes a 4xx with OpenAI's error body), and the response objects and stream chunks.

Reference: the OpenAI API's chat completions and completions objects (``chat.completion``,
``chat.completion.chunk``, ``text_completion``, the ``usage`` object, ``stream_options``); the
server adds a ``speculation`` object (steps, tokens per step, draft and accepted tokens).
"""
from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from medusa_jax.chat import check_messages, check_text

#: Fields of OpenAI's requests that this server cannot honour: refused with a 400 rather than ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "audio", "modalities",
               "prediction", "web_search_options", "suffix", "best_of", "echo")
#: The most stop sequences a request may give (OpenAI's limit).
MAX_STOP = 4


class RequestError(ValueError):
    """A request the server refuses: `status` (4xx), OpenAI's error `type` and `code`, the `param`."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Generation:
    """A checked request: the prompt (messages or text), the budget, sampling and stop settings."""
    messages: Optional[List[dict]]
    prompt: Optional[str]
    max_tokens: Optional[int]
    temperature: float
    top_p: float
    seed: int
    stop: List[str]
    stream: bool
    include_usage: bool
    model: str


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    """Field `name` as a finite float in [low, high] ((low, high] with `open_low`); `default`
    when absent or null; RequestError naming the field and the interval otherwise."""
    v = body.get(name, default)
    if v is None:
        return default
    interval = f"{'(' if open_low else '['}{low}, {high}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a number, got {v!r}", name)
    if not (low < v if open_low else low <= v) or not v <= high:
        raise RequestError(f"{name} must be in {interval}, got {v}", name)
    return float(v)


def _integer(body: dict, name: str, low: int, high: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if not low <= v <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {v}", name)
    return v


def check_request(body: Any, models: List[str], context: int, chat: bool) -> Generation:
    """The request body of ``/v1/chat/completions`` (`chat`) or ``/v1/completions``, checked.

    Args:
      body: the parsed JSON. models: the names served (a request's ``model`` must be one, or absent).
      context: the model's context in tokens (``max_tokens`` above it is refused).
    Raises:
      RequestError: a body that is not an object, an unknown model (404), a missing or malformed
        field, ``n`` > 1, a field this server does not support; the message names the field.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", "model")
    if model is not None and model not in models:
        raise RequestError(f"the model {model!r} does not exist; this server serves {', '.join(models)}", "model",
                           status=404, code="model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}, False):
            raise RequestError(f"{name} is not supported by this server", name, code="unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("logprobs are not supported by this server", "logprobs", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise RequestError(f"{name} must be a number, got {v!r}", name)
        if v not in (None, 0, 0.0):
            raise RequestError(f"{name} is not supported by this server (only 0)", name,
                               code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format",
                           code="unsupported_parameter")
    n = _integer(body, "n", 1, 128)
    if n not in (None, 1):
        raise RequestError(f"n must be 1 (one choice per request), got {n}", "n", code="unsupported_parameter")
    messages = prompt = None
    if chat:
        if "messages" not in body:
            raise RequestError("messages is required", "messages")
        try:
            messages = check_messages(body["messages"])
        except ValueError as e:
            field = str(e).split(":")[0] if str(e).startswith("messages") else "messages"
            raise RequestError(str(e), field) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string (or a list of one string), got {type(prompt).__name__}",
                               "prompt")
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        try:
            check_text(prompt, "prompt")
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
    max_tokens = _integer(body, "max_completion_tokens", 1, context) if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, context)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP}, got {body.get('stop')!r}",
                           "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    if options and not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    seed = _integer(body, "seed", 0, 2 ** 31 - 1)
    if seed is None:  # each request samples on its own, as OpenAI's do; a seed makes it repeatable
        seed = secrets.randbelow(2 ** 31)
    return Generation(messages=messages, prompt=prompt, max_tokens=max_tokens,
                      temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                      top_p=_number(body, "top_p", 1.0, 0, 1, open_low=True), seed=seed,
                      stop=stop, stream=stream, include_usage=include_usage, model=model or models[0])


def finish_reason(engine_reason: str) -> str:
    """OpenAI's finish_reason of the engine's (`decoding.engine.Finished.reason`)."""
    return {"eos": "stop", "stop": "stop", "length": "length", "cache_full": "length"}.get(engine_reason, engine_reason)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(fin) -> dict:
    """The server's ``speculation`` object of a finished request (`decoding.engine.Finished`)."""
    return {"steps": fin.steps, "tokens_per_step": round(fin.tokens_per_step, 4), "draft_tokens": fin.draft_tokens,
            "accepted_tokens": max(len(fin.tokens) - fin.steps, 0), "prompt_tokens_reused": fin.reused_tokens}


def completion(rid: str, model: str, chat: bool, text: str, reason: str, prompt_tokens: int, fin,
               completion_tokens: Optional[int] = None) -> dict:
    """The non-streaming response object; `completion_tokens` (default: all of ``fin.tokens``) is the
    answer's token count when a stop sequence ended it."""
    choice: Dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, len(fin.tokens) if completion_tokens is None else completion_tokens),
            "speculation": speculation(fin)}


def chunk(rid: str, model: str, chat: bool, created: int, text: Optional[str] = None, reason: Optional[str] = None,
          role: bool = False, usage_obj: Optional[dict] = None, spec: Optional[dict] = None) -> dict:
    """One streamed chunk: a text delta, the first (the role) or the last (finish_reason); with
    `usage_obj`, the usage chunk (no choices)."""
    out: Dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model}
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
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]
    return out
