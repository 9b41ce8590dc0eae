"""Tool calling (OpenAI's ``tools`` and ``tool_choice``): the request's tools checked (`check_tools`),
and the calls in a model's answer found by one of vLLM's tool-call formats (`TOOL_PARSERS`), whole
or while the answer streams (`ToolCallParser.releasable`).

The model is told about the tools by its chat template (transformers' ``apply_chat_template(...,
tools=...)``, as vLLM does); it answers a call in the text its training taught it, which a parser
turns into OpenAI's ``tool_calls``:

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3 and most newer chat models; vLLM's
  ``hermes_tool_parser.py``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block
  per call; the text before the first block is the message's content.
- ``llama3_json`` (Llama 3.1-3.3's templates; vLLM's ``llama_tool_parser.py``): an answer that is a
  JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``,
  optionally after ``<|python_tag|>`` (a special token, left out of the text).
- ``pythonic`` (Llama 3.2's and Llama 4's pythonic templates, ToolACE; vLLM's
  ``pythonic_tool_parser.py``): an answer that is a Python list of calls with keyword arguments of
  literal values, ``[get_weather(city="Paris"), get_time()]``.
- ``mistral`` (Mistral's instruct models; vLLM's ``mistral_tool_parser.py``): ``[TOOL_CALLS]`` then
  a JSON list of ``{"name", "arguments"}`` objects (v0.3's tokenizer), or ``name[ARGS]{...}`` per
  call (newer ones); the text before it is content. The markers are special tokens, which the
  answer's text keeps for this parser (`ToolCallParser.markers`), and the calls' ids are 9 letters
  and digits, the only ids Mistral's chat templates take back.

An answer that starts a call but does not finish it as valid JSON is given back as plain content,
whole, as vLLM gives it: nothing the model wrote is lost. The text is parsed as the model wrote it
(after stop sequences); decoding (greedy, sampling, Medusa's trees) is unchanged by tools.
``tool_choice`` ``"required"`` or a named function would need decoding constrained to a call
(vLLM's guided decoding), which this server does not have: `check_tools` refuses them.
"""
from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from typing import Any, Dict, List, Optional, Tuple

#: OpenAI's limits: tools per request, and a function name's characters.
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class ToolError(ValueError):
    """A malformed ``tools`` or ``tool_choice``; `field` names where (``tools[0].function.name``)."""

    def __init__(self, message: str, field: str, code: Optional[str] = None):
        super().__init__(f"{field}: {message}")
        self.field, self.code = field, code


def check_tools(tools: Any, tool_choice: Any) -> Tuple[Optional[List[dict]], str]:
    """A request's ``tools`` and ``tool_choice``, checked as OpenAI checks them.

    Args:
      tools: None, or a list of at most `MAX_TOOLS` ``{"type": "function", "function": {"name",
        "description"?, "parameters"?, "strict"?}}`` (names of 1-64 letters, digits, ``_`` and ``-``,
        each once; ``parameters`` a JSON Schema object).
      tool_choice: None, ``"none"`` or ``"auto"``.
    Returns:
      (the tools as the chat template takes them, or None for none; the choice: "none" or "auto",
      default "auto" with tools, as OpenAI's).
    Raises:
      ToolError: naming the field; for ``"required"`` or a named function, which this server cannot
        force (no guided decoding).
    """
    if tools is not None and not isinstance(tools, list):
        raise ToolError(f"expected a list of {{'type': 'function', 'function': {{...}}}}, got {type(tools).__name__}",
                        "tools")
    tools = tools or None
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"expected an object {{'type': 'function', 'function': {{...}}}}, got {tool!r}", where)
        if tool.get("type") != "function":
            raise ToolError(f"only tools of type 'function' are supported, got {tool.get('type')!r}", f"{where}.type",
                            code="unsupported_parameter")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError("expected an object with the function's name, description and parameters",
                            f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError(f"a name of 1-64 letters, digits, '_' and '-' is required, got {name!r}",
                            f"{where}.function.name")
        if name in names:
            raise ToolError(f"the function {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError("must be a string", f"{where}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError("must be a JSON Schema object", f"{where}.function.parameters")
    if tool_choice is None:
        return tools, "auto" if tools else "none"
    if tool_choice == "required" or isinstance(tool_choice, dict):
        what = "'required'" if tool_choice == "required" else "a named function"
        raise ToolError(f"{what} is not supported by this server (it would need decoding constrained to a "
                        "call); give 'auto' and say in the prompt which tool to use", "tool_choice",
                        code="unsupported_parameter")
    if tool_choice not in ("none", "auto"):
        raise ToolError(f"expected 'none' or 'auto', got {tool_choice!r}", "tool_choice")
    if tool_choice == "auto" and not tools:
        raise ToolError("'auto' needs tools: give the tools the model may call", "tool_choice")
    return tools, tool_choice


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def mistral_call_id() -> str:
    """A call id as Mistral's chat templates require them back: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def tool_call(name: str, arguments: Any, call_id: Optional[str] = None) -> dict:
    """OpenAI's tool call object: the id (default a fresh `new_call_id`), the function's name and its
    arguments as a JSON string. Raises ValueError or TypeError for an empty name or arguments that
    are not JSON (NaN, infinities, sets, bytes), and UnicodeEncodeError (a ValueError) for text that
    is not UTF-8 (a lone surrogate, which a JSON ``\\ud800`` escape gives)."""
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    if not name:
        raise ValueError("a tool call needs a function name")
    name.encode("utf-8"), text.encode("utf-8")  # the response must be UTF-8
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _tool_call(name: str, arguments: Any, call_id: Optional[str] = None) -> Optional[dict]:
    """`tool_call`, or None for arguments that are not a JSON object."""
    if not isinstance(arguments, dict):
        return None
    try:
        return tool_call(name, arguments, call_id)
    except (ValueError, TypeError, RecursionError):
        return None


class ToolCallParser:
    """One tool-call format: `parse` splits a whole answer into content and calls; `releasable` says
    how much of an answer streamed so far is surely content (may be sent before the answer ends).
    ``markers``: special tokens whose text the answer must keep for `parse` to see (special tokens
    are otherwise left out of it)."""
    markers: Tuple[str, ...] = ()

    def parse(self, text: str) -> Tuple[Optional[str], List[dict]]:
        """(content, calls) of the answer `text`: calls as `tool_call` objects ([] when the answer
        calls nothing, or starts a call it does not finish: the content is then `text` whole);
        content None when the calls are all there is."""
        raise NotImplementedError

    def releasable(self, text: str) -> int:
        """How many leading characters of `text` (the answer so far) are content whatever follows.
        Never fewer for a longer text that extends it."""
        raise NotImplementedError


def _call(obj: Any, arguments_keys: Tuple[str, ...], call_id: Optional[str] = None) -> Optional[dict]:
    """`tool_call` of a decoded JSON call ``{"name", <one of arguments_keys>: {...}}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    return _tool_call(obj["name"], args, call_id)


def _held_tag_tail(text: str, tag: str) -> int:
    """`releasable` for a format whose calls start at `tag`: the text before the tag, less a tail
    that may begin it."""
    start = text.find(tag)
    if start >= 0:
        return start
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the last one may lack its
    end tag, as an answer cut by EOS at the call's end does); the content is the text before the first."""
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for closed, open_end in self.BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(closed or open_end), ("arguments", "parameters"))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def releasable(self, text):
        return _held_tag_tail(text, self.START)


class Llama3JsonParser(ToolCallParser):
    """An answer that is one or more JSON calls ``{"name": ..., "parameters": {...}}`` separated by
    ``;`` (whitespace around them allowed); any other answer is content."""

    def parse(self, text):
        body = text.strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
            if at < len(body) and body[at] != "{":
                return text, []
        return None, calls

    def releasable(self, text):
        body = text.lstrip()
        return 0 if not body or body.startswith("{") else len(text)


class PythonicParser(ToolCallParser):
    """An answer that is a Python list of calls, ``[f(a=1, b="x"), g()]``: each a function's name with
    keyword arguments whose values are literals (strings, numbers, True/False/None, lists, dicts;
    read with `ast.literal_eval`, nothing run); any other answer is content."""

    def parse(self, text):
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(kw.arg is not None for kw in node.keywords)):
                return text, []
            try:
                call = _tool_call(node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not literals
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def releasable(self, text):
        body = text.lstrip()
        return 0 if not body or body.startswith("[") else len(text)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls ``[{"name": ..., "arguments": {...}}, ...]``
    (or one such object), or by ``name[ARGS]{...}`` for each call (``[TOOL_CALLS]`` again before each
    further one); the text before the first ``[TOOL_CALLS]`` is the content. Call ids are
    `mistral_call_id`s."""
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (START, ARGS)

    def parse(self, text):
        start = text.find(self.START)
        if start < 0:
            return text, []
        rest = text[start + len(self.START):]
        calls = self._json_calls(rest) if rest.lstrip()[:1] in ("[", "{") else self._args_calls(rest)
        if not calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls

    def _json_calls(self, rest: str) -> List[dict]:
        try:
            obj = json.loads(rest)
        except (ValueError, RecursionError):
            return []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, ("arguments", "parameters"), mistral_call_id()) for o in objs]
        return calls if calls and None not in calls else []

    def _args_calls(self, rest: str) -> List[dict]:
        """``name[ARGS]{...}`` calls, ``[TOOL_CALLS]`` between them, read in order (a marker inside
        a string argument is the argument's text), or [] when `rest` is anything else."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            name, sep, _ = rest[at:].partition(self.ARGS)
            if not sep or not FUNCTION_NAME.fullmatch(name.strip()):
                return []
            at += len(name) + len(self.ARGS)
            while at < len(rest) and rest[at].isspace():
                at += 1
            try:
                args, at = decoder.raw_decode(rest, at)
            except (ValueError, RecursionError):
                return []
            call = _tool_call(name.strip(), args, mistral_call_id())
            if call is None:
                return []
            calls.append(call)
            tail = rest[at:].lstrip()
            if not tail:
                return calls
            if not tail.startswith(self.START):
                return []
            at = len(rest) - len(tail) + len(self.START)

    def releasable(self, text):
        return _held_tag_tail(text, self.START)


#: The tool-call formats by vLLM's ``--tool-call-parser`` names.
TOOL_PARSERS: Dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                           "pythonic": PythonicParser(), "mistral": MistralParser()}
