"""A checked request's prompts as the engine takes them: the tools its chat template is shown
(`check_tool_use`), each prompt's token ids, tokenized off the event loop and checked to fit the
context (`tokenize_prompts`), each prompt's budget of new tokens (`answer_budgets`) and its bad
words' token ids (`bad_word_ids`). Each refusal is a `RequestError` naming the field."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import List, Optional

from medusa_jax.chat import NO_PLACE_FOR_TOOLS, render_chat
from medusa_jax.decoding.args import PromptTooLongError, check_prompt_room, new_token_room
from medusa_jax.serve.errors import RequestError
from medusa_jax.serve.protocol import COMPLETIONS_MAX_TOKENS, MAX_BAD_WORD_TOKENS, Generation
from medusa_jax.serve.text import bad_words_ids
from medusa_jax.serve.tools import TOOL_PARSERS, ToolCallParser

#: A prompt longer than this many characters per token of the context is first tokenized only up to
#: that many characters (`surely_too_long`): ordinary text runs 3-5 characters per token, so a prompt
#: that long almost never fits, and the probe refuses it in milliseconds instead of tokenizing
#: megabytes (seconds each, while the other requests' prompts wait for the tokenizer).
PROBE_CHARS_PER_TOKEN = 16


def surely_too_long(tokenizer, texts: List[str], context: int) -> Optional[int]:
    """A lower bound on the tokens of a prompt made of `texts` (a chat's message contents, or a
    completion's prompt) when it shows that the prompt cannot fit `context`, else None (the
    prompt must be tokenized whole to tell). Only prompts over ``PROBE_CHARS_PER_TOKEN *
    context`` characters are probed, by tokenizing that many of their first characters: the
    whole prompt has at least those tokens, less one per text for tokens that may merge across
    where the probe joins or cuts them."""
    limit = PROBE_CHARS_PER_TOKEN * context
    if sum(len(t) for t in texts) <= limit:
        return None
    probe = "".join(texts)[:limit]
    n = len(tokenizer.encode(probe, add_special_tokens=False)) - len(texts) - 1
    return n if n >= context else None


def check_tool_use(gen: Generation, parser: Optional[ToolCallParser], takes_tools: bool,
                   exclude_when_none: bool) -> None:
    """A chat's tools as its template is shown them (`gen.tools` set to None when it is not).

    Args:
      parser: the server's tool-call parser (None: started without ``--tool-call-parser``).
      takes_tools: whether the chat template shows tools (`chat.template_takes_tools`).
      exclude_when_none: vLLM's ``--exclude-tools-when-tool-choice-none``.
    Raises:
      RequestError: ``tool_choice: "auto"`` without a parser; tools to call with a template that
        cannot show them.
    """
    if gen.tool_choice == "auto" and parser is None:
        raise RequestError(f"tool calls need the server started with --tool-call-parser ({', '.join(TOOL_PARSERS)}"
                           ": the format the model writes them in); or give tool_choice 'none'", "tool_choice")
    if gen.tools and not takes_tools:
        if gen.tool_choice != "none":
            raise RequestError(NO_PLACE_FOR_TOOLS, "tools")
        gen.tools = None  # not to be called, and the template would not show them: nothing is lost
    leave_out_unused_tools(gen, exclude_when_none)


def leave_out_unused_tools(gen: Generation, exclude_when_none: bool) -> None:
    """With `exclude_when_none` (vLLM's ``--exclude-tools-when-tool-choice-none``), a chat with
    ``tool_choice: "none"`` is rendered without its tools."""
    if exclude_when_none and gen.tool_choice == "none":
        gen.tools = None


async def tokenize_prompts(gen: Generation, chat: bool, tokenizer, pool: concurrent.futures.Executor, context: int,
                           fit: bool = True, room: int = 1) -> List[List[int]]:
    """The token ids of each of the request's prompts (a chat's one, rendered by its template).

    Tokenized in `pool`'s thread, off the event loop: a long prompt's tokenization must not stall
    the other requests' streams. Unless not `fit`, each prompt is checked to fit `context` (tokens)
    with `room` positions left (1: for an answer; 0: the prompt alone, a completion's echo), a
    prompt far too long refused from its first characters alone (`surely_too_long`).
    Raises:
      RequestError: naming the prompt (``messages`` or ``prompt``, "prompt k: " when there are
        several) that does not fit (code ``context_length_exceeded``), or that the chat template or
        the tokenizer refused.
    """
    field = "messages" if chat else "prompt"
    run = asyncio.get_running_loop().run_in_executor
    if chat:
        items = [(functools.partial(render_chat, tokenizer, gen.messages, gen.add_generation_prompt,
                                    gen.continue_final_message, gen.template_kwargs, gen.tools),
                  [m["content"] for m in gen.messages])]
    else:  # a string, or token ids
        items = [((lambda p=p: list(p)), []) if isinstance(p, list) else
                 ((lambda p=p: list(tokenizer.encode(p))), [p]) for p in gen.prompts]
    out = []
    for k, (encode, texts) in enumerate(items):
        where = f"prompt {k}: " if len(items) > 1 else ""
        at_least = await run(pool, surely_too_long, tokenizer, texts, context + 1 - room) if fit else None
        if at_least is not None:
            raise RequestError(f"{where}the prompt has more than {at_least} tokens (from its first "
                               f"{PROBE_CHARS_PER_TOKEN * context} characters alone) but the model's context is "
                               f"{context}; shorten it", field, code="context_length_exceeded")
        try:
            ids = await run(pool, encode)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            what = ("the chat template could not render these messages" if chat
                    else "the prompt could not be tokenized")
            raise RequestError(f"{where}{what}: {e}", field) from None
        try:
            if fit:
                check_prompt_room(len(ids), context, room=room)
        except PromptTooLongError as e:
            raise RequestError(f"{where}{e}", field, code="context_length_exceeded") from None
        out.append(ids)
    return out


def answer_budgets(gen: Generation, prompts: List[List[int]], chat: bool, context: int,
                   max_tokens_default: Optional[int] = None) -> List[int]:
    """Each prompt's ``max_tokens``: the request's, or without one `max_tokens_default`, else the
    rest of the context for a chat and `protocol.COMPLETIONS_MAX_TOKENS` (16) for a completion (as
    OpenAI and vLLM default them), at most the rest of the context.
    Raises:
      RequestError: a ``max_tokens`` (or ``max_completion_tokens``) past the rest of the context
        after its prompt (code ``context_length_exceeded``); ``min_tokens`` above a budget.
    """
    where = lambda k: f"prompt {k}: " if len(prompts) > 1 else ""  # noqa: E731
    limits = []
    for k, ids in enumerate(prompts):
        budget = new_token_room(len(ids), context)
        default = max_tokens_default or (budget if chat else COMPLETIONS_MAX_TOKENS)
        limits.append(gen.max_tokens if gen.max_tokens is not None else min(default, budget))
        if limits[-1] > budget:
            raise RequestError(f"{where(k)}{gen.budget_field} {limits[-1]} is too large: the prompt has {len(ids)} "
                               f"tokens and the context is {context}, so at most {budget} new tokens fit",
                               gen.budget_field, code="context_length_exceeded")
        if gen.min_tokens > limits[-1]:
            raise RequestError(f"min_tokens ({gen.min_tokens}) must be at most {gen.budget_field} ({limits[-1]}"
                               f"{', its default here' if gen.max_tokens is None else ''})", "min_tokens")
    return limits


def bad_word_ids(tokenizer, gen: Generation) -> Optional[List[List[int]]]:
    """The token ids of the request's ``bad_words`` (`serve.text.bad_words_ids`), None for none;
    RequestError for a word of more than `protocol.MAX_BAD_WORD_TOKENS` tokens."""
    ids = bad_words_ids(tokenizer, gen.bad_words) if gen.bad_words else None
    long_word = next((w for w in ids or () if len(w) > MAX_BAD_WORD_TOKENS), None)
    if long_word is not None:
        raise RequestError(f"bad_words: a word of {len(long_word)} tokens; each may have at most "
                           f"{MAX_BAD_WORD_TOKENS}", "bad_words")
    return ids
