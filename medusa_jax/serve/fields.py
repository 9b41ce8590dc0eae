"""The field checks of the request models (`serve.protocol`), as pydantic validators to annotate a
field with: ``temperature: Annotated[float, number(0.0, 2.0)] = 1.0``.

Each check takes what OpenAI's API and vLLM take, and no more: JSON's numbers as the field's type
(an integral float such as ``7.0`` for an integer field, as vLLM's pydantic models take it; never
a boolean or a numeric string, which pydantic's lax mode would take), in the field's range; and
raises a `RequestError` whose message names the field, what it takes and what it got. A bound
given as a string (``integer(0, CONTEXT)``) is read from the validation context that
`protocol.check_request` passes: `CONTEXT` (the model's context in tokens), `VOCAB` (its
vocabulary size), `MODELS` (the names served).
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Union

from pydantic import BeforeValidator, ValidationInfo

from medusa_jax.chat import check_messages, check_text
from medusa_jax.serve.errors import RequestError

#: The validation context's keys (`pydantic.BaseModel.model_validate`'s ``context``).
CONTEXT, VOCAB, MODELS = "context", "vocab_size", "models"

Bound = Union[int, float, str]  # a number, or the validation context's key holding it


def bound(value: Bound, info: ValidationInfo) -> Any:
    """`value`, or the validation context's value under that key when it is a string."""
    return info.context[value] if isinstance(value, str) else value


def whole(v: Any) -> Optional[int]:
    """`v` as an int when it is one, or a float with no fractional part (``7.0``: JSON has one number
    type, and vLLM's pydantic models take such floats for integer fields); None otherwise (bools too)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def check_number(v: Any, name: str, low: float, high: float, open_low: bool = False) -> float:
    """`v` as a finite float in [low, high] ((low, high] with `open_low`); RequestError naming
    field `name` and the interval otherwise."""
    interval = f"{'(' if open_low else '['}{low}, {high}]"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2 ** 64:  # beyond a float: out of any interval
        raise RequestError(f"{name} must be in {interval}, got an integer of {len(str(abs(v)))} digits", name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a number, got {v!r}", name)
    if not (low < v if open_low else low <= v) or not v <= high:
        raise RequestError(f"{name} must be in {interval}, got {v}", name)
    return float(v)


def check_whole(v: Any, name: str) -> int:
    """`v` as an int (`whole`); RequestError naming field `name` otherwise."""
    n = whole(v)
    if n is None:
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    return n


def check_integer(v: Any, name: str, low: int, high: int) -> int:
    """`v` as an int (`whole`) in [low, high]; RequestError naming field `name` otherwise."""
    n = check_whole(v, name)
    if not low <= n <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {n}", name)
    return n


def check_flag(v: Any, name: str) -> bool:
    """`v` when it is a boolean; RequestError naming field `name` otherwise (1 and "true" too)."""
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


def check_token_ids(raw: Any, name: str, vocab_size: int) -> List[int]:
    """`raw` as a list of token ids in [0, `vocab_size`) (integral floats taken); RequestError
    naming field `name` otherwise."""
    ids = [whole(t) for t in raw] if isinstance(raw, list) else None
    if ids is None or not all(t is not None and 0 <= t < vocab_size for t in ids):
        raise RequestError(f"{name} must be a list of token ids in [0, {vocab_size}), got {raw!r}", name)
    return ids


def number(low: float, high: float, open_low: bool = False) -> BeforeValidator:
    """A float field in [low, high] ((low, high] with `open_low`): `check_number`."""
    return BeforeValidator(lambda v, info: check_number(v, info.field_name, low, high, open_low))


def integer(low: Bound, high: Bound) -> BeforeValidator:
    """An integer field in [low, high] (either bound may be a validation context's key): `check_integer`."""
    return BeforeValidator(lambda v, info: check_integer(v, info.field_name, bound(low, info), bound(high, info)))


#: A boolean field: `check_flag`.
FLAG = BeforeValidator(lambda v, info: check_flag(v, info.field_name))
#: An integer field whose range is checked later, with another field's: `check_whole`.
WHOLE = BeforeValidator(lambda v, info: check_whole(v, info.field_name))
#: A list of token ids in the model's vocabulary: `check_token_ids`.
TOKEN_IDS = BeforeValidator(lambda v, info: check_token_ids(v, info.field_name, info.context[VOCAB]))


def stop_sequences(most: int) -> BeforeValidator:
    """OpenAI's ``stop``: a non-empty string, or a list of at most `most` of them (a list either way)."""
    def check(raw: Any) -> List[str]:
        stop = [raw] if isinstance(raw, str) else raw
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > most:
            raise RequestError(f"stop must be a non-empty string or a list of at most {most}, got {raw!r}", "stop")
        return stop
    return BeforeValidator(check)


def bad_words_field(most: int) -> BeforeValidator:
    """vLLM's ``bad_words``: at most `most` non-empty strings of valid Unicode (None when absent or empty)."""
    def check(raw: Any) -> Optional[List[str]]:
        if raw is None:
            return None
        if not isinstance(raw, list) or not all(isinstance(w, str) and w.strip() for w in raw):
            raise RequestError(f"bad_words must be a list of non-empty strings, got {raw!r}", "bad_words")
        if len(raw) > most:
            raise RequestError(f"bad_words may give at most {most} words, got {len(raw)}", "bad_words")
        for w in raw:
            try:
                check_text(w, "bad_words")
            except ValueError as e:
                raise RequestError(str(e), "bad_words") from None
        return raw or None
    return BeforeValidator(check)


def logit_bias_field(most: int) -> BeforeValidator:
    """OpenAI's ``logit_bias``: an object of token ids (as decimal strings, or numbers) to values in
    [-100, 100] added to their logits (-100 bans a token, 100 forces it), at most `most` of them,
    each id once; as ``{id: value}`` without the zeros, None when nothing is left (nothing changes
    then)."""
    def check(raw: Any, info: ValidationInfo) -> Optional[Dict[int, float]]:
        vocab_size = info.context[VOCAB]
        if not isinstance(raw, dict):
            raise RequestError(f"logit_bias must be an object of token ids to numbers, got {raw!r}", "logit_bias")
        if len(raw) > most:
            raise RequestError(f"logit_bias may set at most {most} tokens, got {len(raw)}", "logit_bias")
        out, seen = {}, set()
        for key, value in raw.items():
            token = whole(key) if not isinstance(key, str) else (int(key) if re.fullmatch(r"[0-9]{1,10}", key)
                                                                 else None)
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
    return BeforeValidator(check)


def _messages(raw: Any) -> List[dict]:
    try:
        return check_messages(raw)
    except ValueError as e:
        field = str(e).split(":")[0] if str(e).startswith("messages") else "messages"
        raise RequestError(str(e), field) from None


#: A chat's ``messages`` (`chat.check_messages`: OpenAI's messages as plain dicts); the error names
#: the message and its field (``messages[2].role``).
MESSAGES = BeforeValidator(_messages)


def completion_prompts(most_prompts: int, most_choices: int) -> BeforeValidator:
    """A completion's ``prompt`` as its list of prompts (OpenAI's forms): a string, token ids (a list
    of ints), or a list of strings and token-id lists (at most `most_prompts`, and at most
    `most_choices` choices with the request's ``n``, a field checked before it); the error names the
    prompt at fault when there are several."""
    def check(prompt: Any, info: ValidationInfo) -> List[Union[str, List[int]]]:
        many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        items = prompt if many else [prompt]
        if len(items) > most_prompts:
            raise RequestError(f"prompt: at most {most_prompts} prompts per request, got {len(items)}", "prompt")
        out = [_prompt(p, f"prompt {k}" if len(items) > 1 else "prompt", info.context[VOCAB])
               for k, p in enumerate(items)]
        n = info.data.get("n", 1)
        if len(out) * n > most_choices:
            raise RequestError(f"{len(out)} prompts with n={n} ask for {len(out) * n} choices; at most "
                               f"{most_choices} per request", "prompt")
        return out
    return BeforeValidator(check)


def _prompt(p: Any, where: str, vocab_size: int) -> Union[str, List[int]]:
    """One of a completion's prompts: its token ids in the vocabulary, or its non-empty text."""
    if isinstance(p, list) and p and all(whole(t) is not None for t in p):
        ids = [whole(t) for t in p]
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size})",
                               "prompt")
        return ids
    if not isinstance(p, str):
        what = "an empty list" if p == [] else type(p).__name__
        raise RequestError(f"{where} must be a string or a list of token ids, got {what}", "prompt")
    if not p:
        raise RequestError(f"{where} is empty", "prompt")
    try:
        return check_text(p, where)
    except ValueError as e:
        raise RequestError(str(e), "prompt") from None
