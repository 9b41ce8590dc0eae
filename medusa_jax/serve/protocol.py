"""OpenAI's request bodies for the server, as pydantic models: `ChatCompletionRequest`
(``/v1/chat/completions``) and `CompletionRequest` (``/v1/completions``), each field with its type,
range and default, the cross-field rules as validators; `check_request` validates a body and
gives the engine's settings (`Generation`), or a `RequestError` naming the field at fault (a 4xx
with OpenAI's error body). The response objects and stream chunks are `serve.responses`.

Reference: the OpenAI API's chat completions and completions requests, and vLLM's extensions of
them (its ``ChatCompletionRequest`` and ``CompletionRequest``). The fields are declared in the
order they are checked, and a request is answered for its first field at fault.
"""
from __future__ import annotations

import difflib
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from medusa_jax.decoding.args import MIN_REPETITION_PENALTY
from medusa_jax.decoding.logprobs import MAX_TOP_LOGPROBS
from medusa_jax.serve.errors import RequestError, error_body, refusal
from medusa_jax.serve.fields import (CONTEXT, FLAG, MESSAGES, MODELS, TOKEN_IDS, VOCAB, WHOLE, bad_words_field,
                                     check_flag, check_integer, check_token_ids, completion_prompts, integer,
                                     logit_bias_field, number, stop_sequences, whole)
from medusa_jax.serve.tools import ToolError, check_tools

__all__ = ["RequestError", "error_body", "Generation", "ChatCompletionRequest", "CompletionRequest", "check_request",
           "check_detokenize", "unknown_fields_note", "flag", "CHAT_FIELDS", "COMPLETION_FIELDS"]

#: Fields this server cannot honour, with their default values: refused with a 400 when a request
#: sets one to anything else (rather than ignored, which would answer another question than the
#: one asked); their defaults, null, and empty lists or objects are accepted, as clients send them.
#: A request model that declares one of them honours it (a chat's ``tools``, a completion's ``echo``).
UNSUPPORTED: Dict[str, Any] = {
    # OpenAI's
    "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "audio": None, "modalities": ["text"], "prediction": None, "web_search_options": None, "suffix": "",
    "best_of": 1, "echo": False,
    # vLLM's sampling and output extensions (its defaults)
    "use_beam_search": False, "length_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
    "echo_prompt": None, "chat_template": None, "mm_processor_kwargs": None, "documents": None}
#: OpenAI's request fields that ask nothing of the answer (bookkeeping for OpenAI's own platform):
#: accepted and ignored without a warning.
BOOKKEEPING = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
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
#: Any 64-bit integer (``seed``, ``top_k``: OpenAI and vLLM take them).
INT64 = (-2 ** 63, 2 ** 63 - 1)


@dataclass
class Generation:
    """A checked request: the prompt (messages, or a completion's prompts), the budget, sampling and
    stop settings, as the app hands them to the engine."""
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
    budget_field: str = "max_tokens"              # the field that set max_tokens (a chat's max_completion_tokens)

    def eos_override(self, eos: List[int]) -> Optional[List[int]]:
        """The ids that end this answer given the model's `eos` ids, as the engine's
        ``Request.stop_token_ids`` takes them: None for the model's own."""
        if not self.ignore_eos and not self.stop_token_ids:
            return None
        return sorted(set(([] if self.ignore_eos else list(eos)) + list(self.stop_token_ids or [])))


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


def _response_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format",
                           code="unsupported_parameter")
    return fmt


def _stream_options(options: Any, info: ValidationInfo) -> dict:
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {options!r}", "stream_options")
    if options and not info.data.get("stream", False):
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    return options


def _include_usage(v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return v


def _no_continuous_usage(v: Any) -> bool:
    if v not in (None, False):  # vLLM's: usage in every chunk
        raise RequestError("stream_options.continuous_usage_stats is not supported by this server (only the "
                           "final usage chunk, include_usage)", "stream_options.continuous_usage_stats",
                           code="unsupported_parameter")
    return False


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` (only with ``stream: true``)."""
    model_config = ConfigDict(extra="ignore")

    include_usage: Annotated[bool, BeforeValidator(_include_usage)] = False  # a last chunk with the usage
    continuous_usage_stats: Annotated[bool, BeforeValidator(_no_continuous_usage)] = False  # vLLM's: refused


def _top_k(v: Any, info: ValidationInfo) -> int:
    """vLLM's ``top_k`` as the engine takes it: -1 or 0 (every token): 0; k >= 1: k, at most the
    vocabulary (every token then)."""
    k = check_integer(v, "top_k", *INT64)
    if k < -1:
        raise RequestError(f"top_k must be -1 or 0 (every token) or at least 1, got {k}", "top_k")
    return 0 if k < 0 else min(k, info.context[VOCAB], 2 ** 31 - 1)


def _special_tokens(chat: bool) -> BeforeValidator:
    """vLLM's ``add_special_tokens``: only its default (a chat's False: the template has them; a
    completion's True: the tokenizer adds them)."""
    def check(special: Any) -> bool:
        if special is not (not chat):
            why = "the tokenizer adds its special tokens" if not chat else "the chat template has them"
            raise RequestError(f"add_special_tokens={special!r} is not supported by this server (only {not chat}: "
                               f"{why})", "add_special_tokens", code="unsupported_parameter")
        return special
    return BeforeValidator(check)


def _chat_logprobs(v: Any) -> bool:
    """A chat's ``logprobs`` flag: a boolean, or 0 and 1 (as vLLM's pydantic takes them)."""
    if isinstance(v, bool):
        return v
    if whole(v) not in (0, 1):
        raise RequestError(f"logprobs must be a boolean, got {v!r}", "logprobs")
    return whole(v) == 1


def _zero_needs_echo(max_tokens: int, echo: bool) -> None:
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens must be at least 1 (0 only with echo: true, which answers the prompt "
                           "alone)", "max_tokens")


def _checked_tools(tools: Any, choice: Any) -> tuple:
    """`serve.tools.check_tools`, its ToolError as a RequestError."""
    try:
        return check_tools(tools, choice)
    except ToolError as e:
        raise RequestError(str(e), e.field, code=e.code) from None


#: Field types both kinds of request share.
Penalty = Annotated[float, number(-2.0, 2.0)]
ResponseFormat = Annotated[Optional[Dict[str, Any]], BeforeValidator(_response_format)]
Stream = Annotated[StreamOptions, BeforeValidator(_stream_options)]
Seed = Annotated[Optional[int], integer(*INT64)]
TopK = Annotated[int, BeforeValidator(_top_k)]
TokenIds = Annotated[Optional[List[int]], TOKEN_IDS]
#: Checked with the field after it, ``bad_words`` (`_Request._allowed_ids_not_empty`).
AllowedIds = Annotated[Optional[List[int]], TOKEN_IDS]
#: Validated when absent too: `_Request._allowed_ids_not_empty`.
BadWords = Annotated[Optional[List[str]], bad_words_field(MAX_BAD_WORDS), Field(validate_default=True)]
Flag = Annotated[bool, FLAG]


class _Request(BaseModel):
    """What both request models check before their fields: the body is an object, its ``model``
    is served (else 404), it sets no `UNSUPPORTED` field that the model does not declare, nor a
    field of `REFUSED`; and the fields sent as null are taken as absent (but a required one's)."""
    model_config = ConfigDict(extra="ignore")
    #: Fields the request may not send (any value but null), and why.
    REFUSED: ClassVar[Dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _before_fields(cls, body: Any, info: ValidationInfo) -> dict:
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        model, models = body.get("model"), info.context[MODELS]
        if model is not None and not isinstance(model, str):
            raise RequestError(f"model must be a string, got {model!r}", "model")
        if model is not None and model not in models:
            raise RequestError(f"the model {model!r} does not exist; this server serves {', '.join(models)}", "model",
                               status=404, code="model_not_found")
        for name, default in UNSUPPORTED.items():
            if name not in cls.model_fields and not _is_default(body.get(name), default):
                raise RequestError(f"{name} is not supported by this server (only {default!r})", name,
                                   code="unsupported_parameter")
        for name, why in cls.REFUSED.items():
            if body.get(name) is not None:
                raise RequestError(why, name)
        required = {name for name, f in cls.model_fields.items() if f.is_required()}
        return {k: v for k, v in body.items() if v is not None or k in required}

    @field_validator("bad_words", check_fields=False)
    @classmethod
    def _allowed_ids_not_empty(cls, words: Optional[List[str]], info: ValidationInfo) -> Optional[List[str]]:
        """``allowed_token_ids`` may not be empty (no token could be chosen); checked once
        ``bad_words`` is, as the server always has (a request at fault in both is answered for
        ``bad_words``)."""
        if info.data.get("allowed_token_ids") == []:
            raise RequestError("allowed_token_ids is empty, so no token could be chosen; give at least one id",
                               "allowed_token_ids")
        return words

    def _common(self, models: List[str]) -> dict:
        """The `Generation` fields both kinds of request set alike."""
        return dict(temperature=0.0 if self.top_k == 1 else self.temperature,  # top_k 1: greedy
                    top_p=self.top_p, stop=self.stop, stream=self.stream,
                    # any 64-bit seed; the engine's are [0, 2**31): the same number below 2**31 (decode.py
                    # --seed N gives the same answer), others by their remainder; unseeded: each its own
                    seed=secrets.randbelow(2 ** 31) if self.seed is None else self.seed % 2 ** 31,
                    include_usage=self.stream_options.include_usage, model=self.model or models[0],
                    created=int(time.time()), stop_token_ids=self.stop_token_ids or None, ignore_eos=self.ignore_eos,
                    top_k=self.top_k, include_stop=self.include_stop_str_in_output, n=self.n,
                    logit_bias=self.logit_bias, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                    min_p=self.min_p, min_tokens=self.min_tokens, allowed_token_ids=self.allowed_token_ids,
                    bad_words=self.bad_words)


class ChatCompletionRequest(_Request):
    """The body of ``/v1/chat/completions``: OpenAI's fields (``tools`` with ``tool_choice`` "none" or
    "auto": `serve.tools.check_tools`) and vLLM's commonest extensions (``top_k``, ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...,
    ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``)."""
    model: Optional[str] = None                   # absent: the one served
    logprobs: Annotated[bool, BeforeValidator(_chat_logprobs)] = False
    top_logprobs: Annotated[Optional[int], integer(0, MAX_TOP_LOGPROBS)] = None  # needs logprobs
    logit_bias: Annotated[Optional[Dict[int, float]], logit_bias_field(MAX_LOGIT_BIAS)] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, number(MIN_REPETITION_PENALTY, 2.0)] = 1.0  # vLLM's; 1: off
    min_p: Annotated[float, number(0.0, 1.0)] = 0.0  # vLLM's; 0: off
    response_format: ResponseFormat = None        # only {"type": "text"}
    n: Annotated[int, integer(1, MAX_CHOICES)] = 1
    messages: Annotated[List[Dict[str, Any]], MESSAGES]
    max_tokens: Annotated[Optional[int], WHOLE] = None  # in [0, context] unless max_completion_tokens is given
    # wins over max_tokens, as in vLLM (max_tokens then only needs to be an integer); validated when
    # absent too, to check max_tokens' range
    max_completion_tokens: Optional[int] = Field(None, validate_default=True)
    min_tokens: Annotated[int, integer(0, CONTEXT)] = 0  # vLLM's; at most the budget (checked by the app)
    stop: Annotated[List[str], stop_sequences(MAX_STOP)] = Field(default_factory=list)
    stream: Flag = False
    stream_options: Stream = Field(default_factory=StreamOptions)
    seed: Seed = None                             # absent: a random one
    temperature: Annotated[float, number(0.0, 2.0)] = 1.0
    top_k: TopK = 0                               # vLLM's; 0: every token
    add_special_tokens: Annotated[bool, _special_tokens(chat=True)] = False
    stop_token_ids: TokenIds = None               # vLLM's
    allowed_token_ids: AllowedIds = None          # vLLM's
    bad_words: BadWords = None                    # vLLM's
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Literal["none", "auto"] = Field(None, validate_default=True)  # default: "auto" with tools
    parallel_tool_calls: Flag = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # vLLM's: the template's variables
    add_generation_prompt: Flag = True            # vLLM's
    continue_final_message: Flag = False          # vLLM's: needs add_generation_prompt false
    top_p: Annotated[float, number(0, 1, open_low=True)] = 1.0
    ignore_eos: Flag = False                      # vLLM's
    include_stop_str_in_output: Flag = False      # vLLM's

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: Optional[int], info: ValidationInfo) -> Optional[int]:
        if top is not None and not info.data.get("logprobs"):
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return top

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _budget(cls, v: Any, info: ValidationInfo) -> Optional[int]:
        max_tokens, context = info.data.get("max_tokens"), info.context[CONTEXT]
        if v is not None:
            if max_tokens is not None:
                check_integer(max_tokens, "max_tokens", *INT64)
            return check_integer(v, "max_completion_tokens", 1, context)
        if max_tokens is not None:
            check_integer(max_tokens, "max_tokens", 0, context)
            _zero_needs_echo(max_tokens, echo=False)
        return None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, tools: Any) -> Optional[List[dict]]:
        return _checked_tools(tools, None)[0]

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> str:
        return _checked_tools(info.data.get("tools"), choice)[1]

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_variables(cls, kwargs: Any) -> Optional[Dict[str, Any]]:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise RequestError(f"chat_template_kwargs must be an object of named values, got {kwargs!r}",
                               "chat_template_kwargs")
        taken = sorted(set(kwargs) & TEMPLATE_CALL_ARGS)
        if taken:
            raise RequestError(f"chat_template_kwargs: {', '.join(taken)} set how the template is called, not a "
                               "variable of it; give template variables only (e.g. enable_thinking)",
                               "chat_template_kwargs")
        return kwargs or None

    @field_validator("continue_final_message")
    @classmethod
    def _continues_the_assistant(cls, continues: bool, info: ValidationInfo) -> bool:
        if continues:
            if info.data.get("add_generation_prompt"):
                raise RequestError("continue_final_message needs add_generation_prompt false (the answer goes on "
                                   "inside the last message, not in a new one)", "add_generation_prompt")
            messages = info.data.get("messages")
            if messages and messages[-1]["role"] != "assistant":
                raise RequestError(f"continue_final_message: the last message must be the assistant's to continue, "
                                   f"got {messages[-1]['role']!r}", "messages")
        return continues

    def generation(self, models: List[str]) -> Generation:
        """The engine's settings of this request (`models`: the names served, the first the default)."""
        budget = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return Generation(messages=self.messages, prompts=None, max_tokens=getattr(self, budget),
                          budget_field=budget, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                          tools=self.tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls,
                          template_kwargs=self.chat_template_kwargs, add_generation_prompt=self.add_generation_prompt,
                          continue_final_message=self.continue_final_message, **self._common(models))


class CompletionRequest(_Request):
    """The body of ``/v1/completions``: OpenAI's fields (several prompts, as text or token ids;
    ``logprobs``, the alternatives per token; ``echo``, the prompt before the answer, with its
    tokens' log-probabilities with ``logprobs``, and alone with ``max_tokens: 0``, as vLLM) and
    vLLM's commonest extensions (as `ChatCompletionRequest`'s)."""
    REFUSED: ClassVar[Dict[str, str]] = {
        "top_logprobs": "top_logprobs is a chat field; a completion's logprobs gives the number of alternatives"}

    model: Optional[str] = None                   # absent: the one served
    logprobs: Annotated[Optional[int], integer(0, MAX_TOP_LOGPROBS)] = None  # 0: the chosen token's own
    logit_bias: Annotated[Optional[Dict[int, float]], logit_bias_field(MAX_LOGIT_BIAS)] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, number(MIN_REPETITION_PENALTY, 2.0)] = 1.0  # vLLM's; 1: off
    min_p: Annotated[float, number(0.0, 1.0)] = 0.0  # vLLM's; 0: off
    response_format: ResponseFormat = None        # only {"type": "text"}
    n: Annotated[int, integer(1, MAX_CHOICES)] = 1
    echo: Flag = False
    # a string, token ids, or a list of them; validated when absent too (it is required)
    prompt: Annotated[List[Union[str, List[int]]], completion_prompts(MAX_PROMPTS, MAX_CHOICES)] = Field(
        None, validate_default=True)
    max_tokens: Annotated[Optional[int], integer(0, CONTEXT)] = None  # 0: only with echo; absent: 16
    min_tokens: Annotated[int, integer(0, CONTEXT)] = 0  # vLLM's; at most the budget (checked by the app)
    stop: Annotated[List[str], stop_sequences(MAX_STOP)] = Field(default_factory=list)
    stream: Flag = False
    stream_options: Stream = Field(default_factory=StreamOptions)
    seed: Seed = None                             # absent: a random one
    temperature: Annotated[float, number(0.0, 2.0)] = 1.0
    top_k: TopK = 0                               # vLLM's; 0: every token
    add_special_tokens: Annotated[bool, _special_tokens(chat=False)] = True
    stop_token_ids: TokenIds = None               # vLLM's
    allowed_token_ids: AllowedIds = None          # vLLM's
    bad_words: BadWords = None                    # vLLM's
    top_p: Annotated[float, number(0, 1, open_low=True)] = 1.0
    ignore_eos: Flag = False                      # vLLM's
    include_stop_str_in_output: Flag = False      # vLLM's

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, max_tokens: Optional[int], info: ValidationInfo) -> Optional[int]:
        if max_tokens is not None:
            _zero_needs_echo(max_tokens, info.data.get("echo", False))
        return max_tokens

    def generation(self, models: List[str]) -> Generation:
        """The engine's settings of this request (`models`: the names served, the first the default)."""
        return Generation(messages=None, prompts=self.prompt, max_tokens=self.max_tokens, logprobs=self.logprobs,
                          echo=self.echo, **self._common(models))


#: Every field a ``/v1/chat/completions`` request may send that the server reads (or refuses:
#: `UNSUPPORTED`); others are ignored, as vLLM ignores them, with a warning in the server's log
#: (`unknown_fields_note`).
CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields) | frozenset(UNSUPPORTED) | BOOKKEEPING
#: Every field a ``/v1/completions`` request may send that the server reads (or refuses).
COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(UNSUPPORTED) | BOOKKEEPING


def check_request(body: Any, models: List[str], context: int, chat: bool, vocab_size: int = 2 ** 31) -> Generation:
    """The request body of ``/v1/chat/completions`` (`chat`: `ChatCompletionRequest`) or
    ``/v1/completions`` (`CompletionRequest`), validated, as the engine's settings.

    Args:
      body: the parsed JSON. models: the names served (a request's ``model`` must be one, or absent).
      context: the model's context in tokens (``max_tokens`` above it is refused).
      vocab_size: token ids (``stop_token_ids``, ``logit_bias``, a prompt's) must be below it.
    Raises:
      RequestError: a body that is not an object, an unknown model (404), a missing or malformed
        field, a field this server does not support; for the first field at fault, which the
        message names, with what it takes.
    """
    schema = ChatCompletionRequest if chat else CompletionRequest
    try:
        request = schema.model_validate(body, context={MODELS: models, CONTEXT: context, VOCAB: vocab_size})
    except ValidationError as e:
        raise refusal(e) from None
    return request.generation(models)


def flag(body: dict, name: str, default: bool) -> bool:
    """Field `name` of a request `body` as a boolean (`default` when absent or null); RequestError
    naming it otherwise."""
    v = body.get(name)
    return default if v is None else check_flag(v, name)


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
    return check_token_ids(body["tokens"], "tokens", vocab_size)
