"""Chats in and out of token ids: the chat template (one user turn, or whole chats), the ids that end
an assistant's turn, and prompt files (their first turns)."""
from __future__ import annotations

import json
from typing import List, Optional

#: End-of-turn markers of common chat templates; when a tokenizer's chat template uses one, its
#: id is added to the EOS ids so generation stops at the end of the assistant's turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


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
      ValueError: empty or whitespace-only prompt, or a tokenizer without a chat template.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty; give some text to answer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def load_first_turns(path: str, limit: Optional[int] = None) -> List[dict]:
    """Records {"index", "id", "category", "prompt"} from a JSONL file: one object per line with a
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
        out.append({"index": len(out), "id": rec.get("question_id", rec.get("id")),
                    "category": rec.get("category", ""), "prompt": text})
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out
