"""OpenAI's request schemas for the server: checked request bodies (every error names its field and
becomes a 4xx with OpenAI's error body); the response objects and stream chunks are `serve.responses`.

Reference: the OpenAI API's chat completions and completions objects (``chat.completion``,
``chat.completion.chunk``, ``text_completion``, the ``usage`` and ``logprobs`` objects,
``stream_options``); the server adds a ``speculation`` object (steps, tokens per step, draft and
accepted tokens, summed over a request's choices).
"""
from __future__ import annotations

import math
import re
import difflib
import secrets
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from medusa_jax.chat import check_messages, check_text
from medusa_jax.serve.tools import ToolError, check_tools
from medusa_jax.decoding.args import MIN_REPETITION_PENALTY
from medusa_jax.decoding.logprobs import MAX_TOP_LOGPROBS

#: Fields this server cannot honour, with their default values: refused with a 400 when a request
#: sets one to anything else (rather than ignored, which would answer another question than the
#: one asked); their defaults, null, and empty lists or objects are accepted, as clients send them.
UNSUPPORTED: Dict[str, Any] = {
    # OpenAI's
    "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "audio": None, "modalities": ["text"], "prediction": None, "web_search_options": None, "suffix": "",
    "best_of": 1, "echo": False,  # echo: a completion's is honoured (`check_request`)
    # vLLM's sampling and output extensions (its defaults)
    "use_beam_search": False, "length_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
    "echo_prompt": None, "chat_template": None, "mm_processor_kwargs": None, "documents": None}
#: OpenAI's request fields that ask nothing of the answer (bookkeeping for OpenAI's own platform):
#: accepted and ignored without a warning.
BOOKKEEPING = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
#: The fields `check_request` reads in both kinds of request (or refuses: `UNSUPPORTED`).
_GENERATION_FIELDS = frozenset(UNSUPPORTED) | BOOKKEEPING | {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "response_format",
    # vLLM's
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "allowed_token_ids", "bad_words", "add_special_tokens"}
#: Every field a ``/v1/chat/completions`` request may send that the server reads; others are
#: ignored, as vLLM ignores them, with a warning in the server's log (`unknown_fields_note`).
CHAT_FIELDS = _GENERATION_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
                                    "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
#: Every field a ``/v1/completions`` request may send that the server reads.
COMPLETION_FIELDS = _GENERATION_FIELDS | {"prompt"}
#: transformers' ``apply_chat_template`` arguments, which ``chat_template_kwargs`` may not set (the
#: server sets the ones it needs; the others would change what the call returns).
TEMPLATE_CALL_ARGS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
#: The most stop sequences a request may give: OpenAI's limit is 4, vLLM has none, and
#: lm-evaluation-harness's tasks send more than 4 (their ``until`` lists).
MAX_STOP = 64
#: The most choices (``n``) a request may ask for (OpenAI's limit); each takes an engine row.
MAX_CHOICES = 128
#: The most tokens a request's ``logit_bias`` may set (OpenAI's limit).
MAX_LOGIT_BIAS = 300
#: The most ``bad_words`` a request may give, and the most tokens of one.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32
#: The most prompts one ``/v1/completions`` request may give (each of its ``n`` choices takes a row).
MAX_PROMPTS = MAX_CHOICES
#: The budget of a ``/v1/completions`` request without ``max_tokens`` (OpenAI's and vLLM's default;
#: a chat's is the rest of the context, as theirs).
COMPLETIONS_MAX_TOKENS = 16


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
    """A checked request: the prompt (messages, or a completion's prompts), the budget, sampling and
    stop settings."""
    messages: Optional[List[dict]]
    prompts: Optional[List[Union[str, List[int]]]]  # a completion's: each text, or token ids
    max_tokens: Optional[int]                     # 0: a completion's echo alone
    temperature: float
    top_p: float
    seed: int
    stop: List[str]
    stream: bool
    include_usage: bool
    model: str
    created: int = 0                              # when the request came (Unix seconds)
    stop_token_ids: Optional[List[int]] = None    # vLLM's: ids that end the answer besides EOS
    ignore_eos: bool = False                      # vLLM's: EOS does not end the answer
    top_k: int = 0                                # vLLM's: the most likely tokens sampled from (0: all)
    include_stop: bool = False                    # vLLM's include_stop_str_in_output
    add_generation_prompt: bool = True            # vLLM's (chat): the template's assistant header
    continue_final_message: bool = False          # vLLM's (chat): continue the last (assistant) message
    template_kwargs: Optional[Dict[str, Any]] = None  # vLLM's chat_template_kwargs (e.g. enable_thinking)
    logprobs: Optional[int] = None                # alternatives per token when logprobs were asked for
    n: int = 1                                    # choices (choice i samples with seed + i)
    logit_bias: Optional[Dict[int, float]] = None  # token id -> added to its logit (None: none)
    presence_penalty: float = 0.0                 # OpenAI's, [-2, 2]
    frequency_penalty: float = 0.0                # OpenAI's, [-2, 2]
    repetition_penalty: float = 1.0               # vLLM's, [0.01, 2] (1: off)
    min_p: float = 0.0                            # vLLM's, [0, 1] (0: off)
    min_tokens: int = 0                           # vLLM's: no EOS, stop id or stop string before this many tokens
    allowed_token_ids: Optional[List[int]] = None  # vLLM's: the only ids the answer may hold
    bad_words: Optional[List[str]] = None         # vLLM's: words the answer may not contain
    tools: Optional[List[dict]] = None            # OpenAI's (chat): the functions the model may call
    tool_choice: str = "none"                     # "auto" (the default with tools): the answer may call them
    parallel_tool_calls: bool = True              # OpenAI's (chat): False keeps an answer's first call only
    echo: bool = False                            # a completion's: the prompt (and its logprobs) before the answer

    def eos_override(self, eos: List[int]) -> Optional[List[int]]:
        """The ids that end this answer given the model's `eos` ids, as the engine's
        ``Request.stop_token_ids`` takes them: None for the model's own."""
        if not self.ignore_eos and not self.stop_token_ids:
            return None
        return sorted(set(([] if self.ignore_eos else list(eos)) + list(self.stop_token_ids or [])))


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    """Field `name` as a finite float in [low, high] ((low, high] with `open_low`); `default`
    when absent or null; RequestError naming the field and the interval otherwise."""
    v = body.get(name, default)
    if v is None:
        return default
    interval = f"{'(' if open_low else '['}{low}, {high}]"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2 ** 64:  # beyond a float: out of any interval
        raise RequestError(f"{name} must be in {interval}, got an integer of {len(str(abs(v)))} digits", name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a number, got {v!r}", name)
    if not (low < v if open_low else low <= v) or not v <= high:
        raise RequestError(f"{name} must be in {interval}, got {v}", name)
    return float(v)


def _is_default(v: Any, default: Any) -> bool:
    """Whether a request's `v` (None: absent) asks for what `default` does: null always; an empty
    list or object where the default is a list or object; a bool only the same bool; else equal.
    (An empty object is not a default elsewhere: vLLM's ``guided_json: {}`` asks for any JSON.)"""
    if v is None:
        return True
    if isinstance(default, (list, dict)):
        return v == default or (isinstance(v, (list, dict)) and not v)
    if isinstance(v, bool) or isinstance(default, bool):
        return v is default
    return default is not None and v == default


def flag(body: dict, name: str, default: bool) -> bool:
    """Field `name` as a boolean (`default` when absent or null); RequestError naming it otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


def _whole(v: Any) -> Optional[int]:
    """`v` as an int when it is one, or a float with no fractional part (``7.0``: JSON has one number
    type, and vLLM's pydantic models take such floats for integer fields); None otherwise (bools too)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _integer(body: dict, name: str, low: int, high: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    n = _whole(v)
    if n is None:
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if not low <= n <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {n}", name)
    return n


def check_request(body: Any, models: List[str], context: int, chat: bool, vocab_size: int = 2 ** 31) -> Generation:
    """The request body of ``/v1/chat/completions`` (`chat`) or ``/v1/completions``, checked.

    OpenAI's fields include ``logprobs`` / ``top_logprobs`` (`_logprobs`), ``n`` (up to `MAX_CHOICES`), a
    completion's ``echo`` (the prompt before the answer; with ``logprobs``, the prompt tokens' own
    log-probabilities too, the first token's null; ``max_tokens: 0`` then answers the prompt alone, as
    vLLM does) and several prompts (`_completion_prompts`: choice ``i * n + j`` is prompt i's j-th),
    ``logit_bias`` (`_logit_bias`), ``presence_penalty`` / ``frequency_penalty`` ([-2, 2]) and a chat's
    ``tools`` with ``tool_choice`` "none" or "auto" (`serve.tools.check_tools`) and
    ``parallel_tool_calls`` (false: an answer's first call only); guided output is
    refused. Besides OpenAI's fields, vLLM's ``ignore_eos``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``top_k`` (-1 or 0: off; k >= 1: the k most likely tokens, cut
    before ``top_p``), ``repetition_penalty`` ([0.01, 2], 1: off), ``min_p`` ([0, 1]), ``min_tokens`` (at
    most ``max_tokens``), ``allowed_token_ids`` (non-empty), ``bad_words`` (at most `MAX_BAD_WORDS`
    strings; tokenized by the app: `serve.text.bad_words_ids`), and for chats
    ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` (passed to the
    template, e.g. Qwen3's ``enable_thinking``) are honoured; its other extensions are refused unless at
    their defaults.

    Args:
      body: the parsed JSON. models: the names served (a request's ``model`` must be one, or absent).
      context: the model's context in tokens (``max_tokens`` above it is refused).
      vocab_size: token ids in ``stop_token_ids`` must be below it.
    Raises:
      RequestError: a body that is not an object, an unknown model (404), a missing or malformed
        field, ``n`` outside [1, 128], a field this server does not support; the message names the field.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", "model")
    if model is not None and model not in models:
        raise RequestError(f"the model {model!r} does not exist; this server serves {', '.join(models)}", "model",
                           status=404, code="model_not_found")
    created = int(time.time())
    for name, default in UNSUPPORTED.items():
        if chat and name in ("tools", "tool_choice") or not chat and name == "echo":  # checked below
            continue
        if not _is_default(body.get(name), default):
            raise RequestError(f"{name} is not supported by this server (only {default!r})", name,
                               code="unsupported_parameter")
    logprobs = _logprobs(body, chat)
    logit_bias = _logit_bias(body, vocab_size)
    penalties = {name: _number(body, name, 0.0, -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = _number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 2.0)
    penalties["min_p"] = _number(body, "min_p", 0.0, 0.0, 1.0)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format",
                           code="unsupported_parameter")
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    messages = prompts = None
    echo = False if chat else flag(body, "echo", False)
    if chat:
        if "messages" not in body:
            raise RequestError("messages is required", "messages")
        try:
            messages = check_messages(body["messages"])
        except ValueError as e:
            field = str(e).split(":")[0] if str(e).startswith("messages") else "messages"
            raise RequestError(str(e), field) from None
    else:
        prompts = _completion_prompts(body.get("prompt"), vocab_size)
        if len(prompts) * n > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} choices; at most "
                               f"{MAX_CHOICES} per request", "prompt")
    if chat and body.get("max_completion_tokens") is not None:  # it wins over max_tokens (as in vLLM,
        _integer(body, "max_tokens", -2 ** 63, 2 ** 63 - 1)     # which then only needs to be an integer)
        max_tokens = _integer(body, "max_completion_tokens", 1, context)
    else:
        max_tokens = _integer(body, "max_tokens", 0, context)
        if max_tokens == 0 and not echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo: true, which answers the prompt "
                               "alone)", "max_tokens")
    penalties["min_tokens"] = _integer(body, "min_tokens", 0, context) or 0  # <= max_tokens: checked with its default
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
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {options!r}", "stream_options")
    if options and not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    if options.get("continuous_usage_stats") not in (None, False):  # vLLM's: usage in every chunk
        raise RequestError("stream_options.continuous_usage_stats is not supported by this server (only the "
                           "final usage chunk, include_usage)", "stream_options.continuous_usage_stats",
                           code="unsupported_parameter")
    # any 64-bit seed, as OpenAI and vLLM take them; the engine's seeds are [0, 2**31): the same
    # number below 2**31 (decode.py --seed N gives the same answer), others by their remainder (so
    # seeds 2**31 apart sample alike)
    seed = _integer(body, "seed", -2 ** 63, 2 ** 63 - 1)
    seed = secrets.randbelow(2 ** 31) if seed is None else seed % 2 ** 31  # unseeded: each request its own
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_k = _integer(body, "top_k", -2 ** 63, 2 ** 63 - 1)
    if top_k is not None and top_k < -1:
        raise RequestError(f"top_k must be -1 or 0 (every token) or at least 1, got {top_k}", "top_k")
    top_k = 0 if top_k is None or top_k < 0 else min(top_k, vocab_size, 2 ** 31 - 1)  # k >= V: every token
    special = body.get("add_special_tokens")  # vLLM's: the tokenizer's BOS etc. (chats: the template's alone)
    if special is not None and special is not (not chat):
        raise RequestError(f"add_special_tokens={special!r} is not supported by this server (only {not chat}: "
                           f"{'the tokenizer adds its special tokens' if not chat else 'the chat template has them'})",
                           "add_special_tokens", code="unsupported_parameter")
    if top_k == 1:  # only the most likely token: greedy, whatever the temperature
        temperature = 0.0
    stop_ids = _token_ids(body, "stop_token_ids", vocab_size)
    extras = {"allowed_token_ids": _token_ids(body, "allowed_token_ids", vocab_size), "bad_words": _bad_words(body)}
    if extras["allowed_token_ids"] == []:
        raise RequestError("allowed_token_ids is empty, so no token could be chosen; give at least one id",
                           "allowed_token_ids")
    if chat:
        try:
            extras["tools"], extras["tool_choice"] = check_tools(body.get("tools"), body.get("tool_choice"))
            extras["parallel_tool_calls"] = flag(body, "parallel_tool_calls", True)
        except ToolError as e:
            raise RequestError(str(e), e.field, code=e.code) from None
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            raise RequestError(f"chat_template_kwargs must be an object of named values, got {kwargs!r}",
                               "chat_template_kwargs")
        taken = sorted(set(kwargs or ()) & TEMPLATE_CALL_ARGS)
        if taken:
            raise RequestError(f"chat_template_kwargs: {', '.join(taken)} set how the template is called, not a "
                               "variable of it; give template variables only (e.g. enable_thinking)",
                               "chat_template_kwargs")
        extras["template_kwargs"] = kwargs or None
        extras["add_generation_prompt"] = flag(body, "add_generation_prompt", True)
        extras["continue_final_message"] = flag(body, "continue_final_message", False)
        if extras["continue_final_message"]:
            if extras["add_generation_prompt"]:
                raise RequestError("continue_final_message needs add_generation_prompt false (the answer goes on "
                                   "inside the last message, not in a new one)", "add_generation_prompt")
            if messages[-1]["role"] != "assistant":
                raise RequestError(f"continue_final_message: the last message must be the assistant's to continue, "
                                   f"got {messages[-1]['role']!r}", "messages")
    return Generation(messages=messages, prompts=prompts, max_tokens=max_tokens, temperature=temperature,
                      top_p=_number(body, "top_p", 1.0, 0, 1, open_low=True), seed=seed,
                      stop=stop, stream=stream, include_usage=include_usage, model=model or models[0],
                      created=created, stop_token_ids=stop_ids or None,
                      ignore_eos=flag(body, "ignore_eos", False), top_k=top_k,
                      include_stop=flag(body, "include_stop_str_in_output", False), logprobs=logprobs,
                      n=n, logit_bias=logit_bias, echo=echo, **penalties, **extras)


def unknown_fields_note(body: Any, known: frozenset, endpoint: str) -> Optional[str]:
    """A one-line warning naming the top-level fields of a request `body` that are not in `known`
    (e.g. `CHAT_FIELDS`), with the known field each most likely misspells; None when there are none
    (or `body` is not an object). The server ignores such fields, as vLLM does, and logs this, so
    that a misspelt ``temprature`` does not pass unseen."""
    if not isinstance(body, dict):
        return None
    unknown = sorted(str(name) for name in body if name not in known)
    if not unknown:
        return None
    shown = 8  # a line, however many a client sends

    def named(name: str) -> str:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75) if len(name) <= 64 else []
        return repr(name if len(name) <= 64 else name[:61] + "...") + (f" (did you mean {close[0]!r}?)" if close
                                                                      else "")
    names = ", ".join(named(n) for n in unknown[:shown]) + (f" and {len(unknown) - shown} more"
                                                           if len(unknown) > shown else "")
    many = len(unknown) > 1
    return (f"{endpoint}: ignored the request's unknown field{'s' if many else ''} {names}; the answer is as if "
            f"{'they were' if many else 'it was'} not sent")


def _completion_prompts(prompt: Any, vocab_size: int) -> List[Union[str, List[int]]]:
    """A completion's ``prompt`` as its list of prompts (OpenAI's forms): a string, token ids (a list
    of ints), or a list of strings and token-id lists (at most `MAX_PROMPTS`); RequestError for
    anything else, naming the prompt at fault when there are several."""
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    items = prompt if many else [prompt]
    if len(items) > MAX_PROMPTS:
        raise RequestError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out = []
    for k, p in enumerate(items):
        where = f"prompt {k}" if len(items) > 1 else "prompt"
        if isinstance(p, list) and p and all(_whole(t) is not None for t in p):
            ids = [_whole(t) for t in p]
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RequestError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size})",
                                   "prompt")
            out.append(ids)
            continue
        if not isinstance(p, str):
            what = "an empty list" if p == [] else type(p).__name__
            raise RequestError(f"{where} must be a string or a list of token ids, got {what}", "prompt")
        if not p:
            raise RequestError(f"{where} is empty", "prompt")
        try:
            out.append(check_text(p, where))
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
    return out


def check_detokenize(body: Any, models: List[str], vocab_size: int) -> List[int]:
    """The body of vLLM's ``/detokenize``: ``{"model"?, "tokens": [ids]}``; the ids (each in [0,
    `vocab_size`), possibly none). RequestError for a body that is not an object, an unknown model
    (404), or tokens that are not such a list."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model not in models:
        raise RequestError(f"the model {model!r} does not exist; this server serves {', '.join(models)}", "model",
                           status=404, code="model_not_found")
    if body.get("tokens") is None:
        raise RequestError("tokens is required: the token ids to turn into text", "tokens")
    return _token_ids(body, "tokens", vocab_size)


def _token_ids(body: dict, name: str, vocab_size: int) -> Optional[List[int]]:
    """Field `name` as a list of token ids in [0, `vocab_size`) (whole floats taken), or None when
    absent; RequestError naming the field otherwise."""
    raw = body.get(name)
    ids = [_whole(t) for t in raw] if isinstance(raw, list) else None
    if raw is not None and (ids is None or not all(t is not None and 0 <= t < vocab_size for t in ids)):
        raise RequestError(f"{name} must be a list of token ids in [0, {vocab_size}), got {raw!r}", name)
    return ids


def _bad_words(body: dict) -> Optional[List[str]]:
    """vLLM's ``bad_words``: at most `MAX_BAD_WORDS` non-empty strings (None when absent or empty)."""
    raw = body.get("bad_words")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(w, str) and w.strip() for w in raw):
        raise RequestError(f"bad_words must be a list of non-empty strings, got {raw!r}", "bad_words")
    if len(raw) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words may give at most {MAX_BAD_WORDS} words, got {len(raw)}", "bad_words")
    for w in raw:
        try:
            check_text(w, "bad_words")
        except ValueError as e:
            raise RequestError(str(e), "bad_words") from None
    return raw or None


def _logit_bias(body: dict, vocab_size: int) -> Optional[Dict[int, float]]:
    """OpenAI's ``logit_bias``: an object of token ids (as strings, or numbers) to values in
    [-100, 100] added to their logits (-100 bans a token, 100 forces it), at most
    `MAX_LOGIT_BIAS` of them; None when absent, empty or all zeros (nothing changes then)."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"logit_bias must be an object of token ids to numbers, got {raw!r}", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias may set at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}", "logit_bias")
    out, seen = {}, set()
    for key, value in raw.items():
        token = _whole(key) if not isinstance(key, str) else (int(key) if re.fullmatch(r"[0-9]{1,10}", key) else None)
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if token in seen:
            raise RequestError(f"logit_bias: token {token} is given twice (as {key!r} too)", "logit_bias")
        seen.add(token)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias: token {key} must map to a number in [-100, 100], got {value!r}",
                               "logit_bias")
        if value:
            out[token] = float(value)
    return out or None


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """The alternatives per token a request asks for with its log-probabilities, or None for none.
    A chat's ``logprobs`` is a flag (false or 0: none; true or 1) and ``top_logprobs`` the
    alternatives (which need the flag, as OpenAI says); a completion's ``logprobs`` is the number
    of alternatives (0: the chosen token's own log-probability; null: none). At most
    `MAX_TOP_LOGPROBS`, vLLM's default."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs is a chat field; a completion's logprobs gives the number of "
                               "alternatives", "top_logprobs")
        return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    flag = body.get("logprobs")
    if flag is not None and not isinstance(flag, bool):  # 0 and 1 as the flag, as vLLM's pydantic takes them
        if _whole(flag) not in (0, 1):
            raise RequestError(f"logprobs must be a boolean, got {flag!r}", "logprobs")
        flag = _whole(flag) == 1
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not flag:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if flag else None
