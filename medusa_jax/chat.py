"""Chats in and out of token ids: the chat template (one user turn, or whole chats), the ids that end
an assistant's turn, and prompt files (their first turns)."""
from __future__ import annotations

import json
import re
from typing import List, Optional, Sequence

#: End-of-turn markers of common chat templates; when a tokenizer's chat template uses one, its
#: id is added to the EOS ids so generation stops at the end of the assistant's turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


#: The roles a chat message may have ("developer", OpenAI's name for the system message of its
#: newer models, is taken as "system", which chat templates know; "tool": a tool's result).
ROLES = ("system", "user", "assistant", "tool", "developer")


def check_text(text: str, where: str) -> str:
    """`text` if it is valid Unicode (encodable as UTF-8); else ValueError naming `where` and the
    position (a lone surrogate such as ``"\\ud800"`` in a JSON string decodes to such a str)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF  # surrogateescape
                else f"a lone surrogate U+{code:04X}")
        raise ValueError(f"{where}: not valid Unicode text ({what}, at character {e.start})") from None
    return text


#: Content parts read as text, by type, and the key that holds their text: OpenAI's text parts, the
#: Responses API's input and output text, and an assistant's refusal (as vLLM reads them).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _content(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of content parts, each of a type in
    `TEXT_PARTS` (joined with newlines, as vLLM joins them)."""
    if isinstance(content, list):
        if not content:
            raise ValueError(f"{where}.content: an empty list of content parts; give a string or text parts")
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            key = TEXT_PARTS.get(kind) if isinstance(part, dict) and isinstance(kind, str) else None
            if key is None:
                raise ValueError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported, got {kind!r}")
            if not isinstance(part.get(key), str):
                got = "nothing" if key not in part else type(part[key]).__name__
                raise ValueError(f"{where}.content[{j}].{key}: a {kind} part needs a string {key!r}, "
                                 f"got {got}")
            texts.append(part[key])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")
    return check_text(content, f"{where}.content")


def check_messages(messages: Sequence[dict]) -> List[dict]:
    """``[{"role", "content"}, ...]`` as plain dicts, checked: a non-empty list of messages whose
    role is one of `ROLES` ("developer" becomes "system") and whose content is a string or a list
    of text parts (OpenAI's; joined with newlines) of valid Unicode, possibly empty, and its
    ``name`` when it has one. Any role may come last, as OpenAI's API allows: the chat template
    then renders what follows it (a new assistant turn after an assistant's message or a lone
    system message). Tool calling, as
    OpenAI's messages carry it: an assistant's ``tool_calls`` (its content may then be null) kept
    with their arguments decoded to objects (`_tool_calls`), and a tool's result (role "tool")
    with its ``tool_call_id``. Raises ValueError naming the message and the field
    (``messages[2].role``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: give a non-empty list of {'role', 'content'} messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        role = "system" if role == "developer" else role
        if "content" not in m and role != "assistant":
            raise ValueError(f"{where}.content: missing; give the {role} message's text")
        content = m.get("content")
        content = "" if role == "assistant" and content is None else _content(content, where)  # (tool calls: null)
        out.append({"role": role, "content": content})
        if role == "assistant" and m.get("tool_calls"):
            out[-1]["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ValueError(f"{where}.tool_call_id: a tool's result needs the id of the call it answers "
                                 f"(a string), got {m.get('tool_call_id')!r}")
            out[-1]["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):  # the speaker (or the tool), for templates that show it
            out[-1]["name"] = check_text(m["name"], f"{where}.name")
    return out


def _tool_calls(calls, where: str) -> List[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]``, the arguments a JSON string) in the form chat templates render:
    the arguments decoded to an object, as vLLM passes them (templates write them with
    ``tojson``). Raises ValueError naming the field."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls: expected a list of tool calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"{at}: expected {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        fn = call["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function.name: the called function's name (a string) is required")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError as e:
                raise ValueError(f"{at}.function.arguments: not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments: must be a JSON object, as a string")
        if not isinstance(call.get("id", ""), str):
            raise ValueError(f"{at}.id: must be a string")
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def render_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
                tools: Optional[List[dict]] = None) -> List[int]:
    """Token ids of a whole chat through the tokenizer's chat template (transformers'
    ``apply_chat_template``); with `add_generation_prompt`, ready for the assistant's next answer;
    with `continue_final_message`, ending inside the last message (an assistant's answer to be
    continued from its text: vLLM's "assistant prefill"); `template_kwargs`: more variables for the
    template (e.g. Qwen3's ``enable_thinking``); `tools`: OpenAI's tool definitions, for a template
    that tells the model about them (`template_takes_tools`). Raises ValueError for a tokenizer
    without a chat template, or tools and a template that has no place for them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    extra = dict(template_kwargs or {})
    if continue_final_message:
        extra["continue_final_message"] = True
    if tools:
        if not template_takes_tools(tokenizer):
            raise ValueError(NO_PLACE_FOR_TOOLS)
        extra["tools"] = list(tools)
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **extra)
    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


#: Why tools are refused with a template that never reads them (`render_chat`, the server's 400).
NO_PLACE_FOR_TOOLS = ("the model's chat template has no place for tools, so the model would never see them; serve "
                      "it with a chat template that renders tools (medusa-serve --chat-template)")


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders OpenAI-style tool definitions (it reads a
    ``tools`` variable, as Qwen2.5's, Qwen3's, Hermes' and Llama 3.1's do)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (e.g. "default" and "tool_use")
        template = "\n".join(str(t) for t in template.values())
    return bool(re.search(r"\btools\b", template))


def encode_raw(tokenizer, prompt: str) -> List[int]:
    """Token ids of `prompt` as it is, without a chat template (for base models, which have none):
    the tokenizer's own special tokens (e.g. BOS) added as ``tokenizer.encode`` adds them.
    Raises ValueError for a prompt that is not a str or is empty."""
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt must be a str, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("the prompt is empty; give some text to continue")
    return [int(t) for t in tokenizer.encode(prompt)]


def apply_chat_template(tokenizer, prompt: str, system: Optional[str] = None) -> List[int]:
    """Token ids of a single user turn, ready for the assistant's answer.

    Args:
      tokenizer: a transformers tokenizer with a chat template.
      prompt: the user's message.
      system: an optional system message (None: the template's default, if any).
    Returns:
      a list of int token ids, ending with the template's generation prompt
      (``add_generation_prompt=True``).
    Raises:
      ValueError: a prompt that is not a str, empty or whitespace-only, or a tokenizer without a chat
        template.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt must be a str (the user's message), got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("the prompt is empty; give some text to answer")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    return render_chat(tokenizer, messages)


def end_of_turn_ids(tokenizer) -> List[int]:
    """Ids that end an assistant turn, in order: the tokenizer's EOS, then the chat template's
    end-of-turn token (`END_OF_TURN_TOKENS`) when the template uses one that is in the vocabulary."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN_TOKENS:
        if t in template and t in vocab and int(vocab[t]) not in ids:
            ids.append(int(vocab[t]))
    return ids


def load_first_turns(path: str, limit: Optional[int] = None) -> List[dict]:
    """Records {"index", "id", "category", "prompt", "line"} from a JSONL file: one object per line with a
    "prompt" string, or MT-bench / Spec-Bench questions with "turns" (the first turn is used);
    blank lines are skipped and a UTF-8 byte-order mark is allowed. ``limit``: only the first N.

    Raises:
      ValueError: naming the file and line, for a line that is not such an object, an empty prompt,
        or a file without prompts; for an unreadable file (missing, a directory, not UTF-8).
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    out: List[dict] = []
    for n, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object with a 'prompt' string, got {type(rec).__name__}")
        if isinstance(rec.get("prompt"), str):
            text = rec["prompt"]
        elif isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
            text = rec["turns"][0]
        else:
            raise ValueError(f"{where}: needs a 'prompt' string (or a 'turns' list of strings)")
        if not text.strip():
            raise ValueError(f"{where}: the prompt is empty")
        check_text(text, where)
        out.append({"index": len(out), "id": rec.get("question_id", rec.get("id")),
                    "category": rec.get("category", ""), "prompt": text, "line": n})
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out
