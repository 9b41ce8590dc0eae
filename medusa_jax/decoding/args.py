"""Argument checks shared by every generation entry point (`check_generation_args`)."""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

import jax
import numpy as np

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.logprobs import MAX_TOP_LOGPROBS
from medusa_jax.decoding.requests import Request
from medusa_jax.decoding.sampling import SEED_LIMIT, check_top_k
from medusa_jax.decoding.tree import TreeBuffers, check_depth
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import check_heads_match
from medusa_jax.models.config import ModelConfig


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context (or the requested cache)."""


CONTEXT = "the model's context (max_position_embeddings)"
"""`check_prompt_room`'s `where` for the model's whole context."""


def new_token_room(prompt_len: int, slots: int) -> int:
    """How many new tokens a prompt of `prompt_len` tokens leaves room for in `slots` KV-cache
    positions: ``slots - prompt_len`` (new tokens take positions prompt_len .. slots - 1; the last
    one is never written to the cache), at least 0. The one rule every entry point applies: the
    engine, `check_generation_args`, `prefill.cache_size_for`, the server and the CLIs."""
    return max(0, int(slots) - int(prompt_len))


def check_prompt_room(prompt_len: int, slots: int, where: str = CONTEXT, what: str = "the prompt",
                      room: int = 1) -> None:
    """Raise `PromptTooLongError` when a prompt of `prompt_len` tokens leaves fewer than `room` of
    `slots` positions for new tokens (`new_token_room`; room 0: a prompt scored alone, which may fill
    them all). `where` names the positions for the message (`CONTEXT`, or e.g. "the KV cache
    (cache_size)"), `what` the prompt."""
    if int(slots) - int(prompt_len) >= room:
        return
    if room == 0:
        raise PromptTooLongError(f"{what} has {prompt_len} tokens but {where} holds {slots} positions: shorten it")
    left = "one position is" if room == 1 else f"{room} positions are"
    raise PromptTooLongError(f"{what} has {prompt_len} tokens but {where} holds {slots} positions, so it "
                             f"can have at most {max(slots - room, 0)} tokens ({left} left for "
                             "an answer): shorten it")


_ONE_PROMPT = ("decodes one prompt: pass a list (or 1-D array) of token ids, or a [1, T] array; for "
               "several prompts use generate_device(prompts=[[...], [...]])")


_PROMPTS = ("takes a batch of prompts: a list of token-id lists (or a [B, T] array), e.g. "
            "prompts=[[1, 2, 3], [4, 5]]; for one prompt pass [ids]")


def as_int(x: Any, what: str) -> int:
    """`x` as a Python int (int, numpy integer, 0-d integer array); ValueError naming `what` otherwise."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{what} must be an integer, got the bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {type(x).__name__} {x!r}") from None


def _token_ids(p: Any, caller: str, what: str) -> Optional[List[int]]:
    """One prompt as a list of ints, or None when `p` is not a flat sequence of ids (nested)."""
    if isinstance(p, str):
        raise ValueError(f"{caller}() takes token ids, not text ({what} is a str): tokenize it first, "
                         "e.g. medusa_jax.apply_chat_template(tokenizer, text)")
    if isinstance(p, (np.ndarray, jax.Array)):
        arr = np.asarray(p)
        if arr.ndim != 1:
            return None
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{caller}(): {what} must hold integer token ids, got an array of {arr.dtype}")
        return arr.astype(np.int64).tolist()
    if not isinstance(p, Sequence):
        raise ValueError(f"{caller}(): {what} must be a list or array of token ids, got {type(p).__name__}")
    if any(isinstance(t, (Sequence, np.ndarray, jax.Array)) and not isinstance(t, str)
           and np.ndim(t) > 0 for t in p):
        return None
    return [as_int(t, f"{what}[{i}] (a token id)") for i, t in enumerate(p)]


def _prompt_lists(prompts: Any, caller: str, batch: bool, first_index: int) -> List[List[int]]:
    """`check_generation_args`' prompts as lists of ints (one list when not `batch`); ValueError
    saying what the entry point takes when they are of another shape or kind."""
    if not batch:
        p = prompts
        if isinstance(p, (np.ndarray, jax.Array)) and np.ndim(p) == 2 and np.shape(p)[0] == 1:
            p = np.asarray(p)[0]
        ids = _token_ids(p, caller, "the prompt")
        if ids is None and isinstance(p, Sequence) and len(p) == 1:
            ids = _token_ids(p[0], caller, "the prompt")
        if ids is None:
            got = (f"an array of shape {np.shape(p)}" if hasattr(p, "shape") else f"{len(p)} prompts")
            raise ValueError(f"{caller}() {_ONE_PROMPT}; got {got}")
        return [ids]
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
        prompts = list(np.asarray(prompts))
    if isinstance(prompts, (str, np.ndarray, jax.Array)) or not isinstance(prompts, Sequence):
        raise ValueError(f"{caller}() {_PROMPTS}; got {type(prompts).__name__}"
                         + (f" of shape {np.shape(prompts)}" if hasattr(prompts, "shape") else ""))
    if len(prompts) == 0:
        raise ValueError(f"no prompts given: {caller}() {_PROMPTS}")
    if not any(isinstance(p, (Sequence, np.ndarray, jax.Array)) and not isinstance(p, str) for p in prompts):
        raise ValueError(f"{caller}() {_PROMPTS}; got a flat sequence of {len(prompts)} ids")
    out = []
    for b, p in enumerate(prompts):
        ids = _token_ids(p, caller, f"prompt {first_index + b}")
        if ids is None:
            raise ValueError(f"{caller}(): prompt {first_index + b} is not a flat list of token ids; "
                             f"{caller}() {_PROMPTS}")
        out.append(ids)
    return out


def _check_prompts_fit(cfg: ModelConfig, out: List[List[int]], caller: str, batch: bool, cache_size: Any,
                       first_index: int) -> None:
    """Every prompt non-empty, its ids in the vocabulary, and room left after it in `cache_size`
    (or the model's context); ValueError or PromptTooLongError otherwise."""
    V = cfg.vocab_size
    for b, ids in enumerate(out):
        if not ids:
            raise ValueError("empty prompt: give at least one token (after the chat template)")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < V), None)
        if bad is not None:
            where = f" of prompt {first_index + b}" if batch else ""
            raise ValueError(f"{caller}(): token id {ids[bad]} at position {bad}{where} is outside the model's "
                             f"vocabulary [0, {V}); were the ids made by another model's tokenizer?")
    ctx = cfg.max_position_embeddings
    slots, room_in = ctx, CONTEXT
    if cache_size is not None:
        slots, room_in = as_int(cache_size, "cache_size"), "the KV cache (cache_size)"
        if not 1 <= slots <= ctx:
            raise ValueError(f"{caller}(): cache_size={slots} is outside [1, {ctx}]: the model's context "
                             f"(max_position_embeddings) is {ctx} positions, and no position beyond "
                             f"{ctx - 1} is decoded. Pass cache_size <= {ctx}, or None to size the cache "
                             "from the prompt and max_new_tokens")
    for b, ids in enumerate(out):
        what = f"{caller}(): prompt {first_index + b}" if batch else f"{caller}(): the prompt"
        check_prompt_room(len(ids), slots, room_in, what)


def _check_sampling(acceptance: Any, seed: Any, max_new_tokens: Optional[int], caller: str, batch: bool,
                    n_prompts: int) -> None:
    """`check_generation_args`' acceptance, seed (one int, or one per prompt in a batch) and
    max_new_tokens; ValueError otherwise."""
    if acceptance is not None:
        if not isinstance(acceptance, Acceptance):
            raise ValueError(f"{caller}(): acceptance takes a medusa_jax.decoding.acceptance.Acceptance(temperature=...), "
                             f"got {type(acceptance).__name__}")
        try:
            acceptance.check()
        except ValueError as e:
            raise ValueError(f"{caller}(): {e}") from None
    if isinstance(seed, (Sequence, np.ndarray)) and not isinstance(seed, str):
        if not batch or len(seed) != n_prompts:
            raise ValueError(f"{caller}(): seed takes an int" + (f" or one int per prompt ({n_prompts})" if batch else "")
                             + f", got a sequence of {len(seed)}")
        for s in seed:
            as_int(s, "each seed")
    else:
        as_int(seed, "seed")
    if max_new_tokens is not None:
        n = as_int(max_new_tokens, "max_new_tokens")
        if n < 1:
            raise ValueError(f"{caller}(): max_new_tokens must be >= 1 (the most new tokens to generate), got {n}")


def _eos_ids(cfg: ModelConfig, eos_token_ids: Any, caller: str) -> Tuple[int, ...]:
    """`eos_token_ids` (None: the config's; one id; a sequence of ids) as a tuple of ids in the
    vocabulary; ValueError otherwise."""
    if eos_token_ids is None:
        eos = tuple(cfg.eos_token_ids)
    elif isinstance(eos_token_ids, (int, np.integer)) and not isinstance(eos_token_ids, bool):
        eos = (int(eos_token_ids),)
    elif isinstance(eos_token_ids, (Sequence, np.ndarray, jax.Array)) and not isinstance(eos_token_ids, str):
        eos = tuple(as_int(e, "each of eos_token_ids") for e in eos_token_ids)
    else:
        raise ValueError(f"{caller}(): eos_token_ids takes None, a token id or a list of token ids, "
                         f"got {type(eos_token_ids).__name__}")
    if any(not 0 <= e < cfg.vocab_size for e in eos):
        raise ValueError(f"{caller}(): eos_token_ids {list(eos)} must be in the vocabulary [0, {cfg.vocab_size})")
    return eos


def _check_heads_and_tree(cfg: ModelConfig, heads: Any, tree: Any, caller: str) -> None:
    """Heads fitting the backbone given with a tree no deeper than them, or neither (a tree without
    heads only with prompt lookup and no depth); ValueError or HeadsMismatchError otherwise."""
    if heads is not None:
        if not (isinstance(heads, tuple) and len(heads) == 2 and isinstance(heads[0], MedusaConfig)):
            raise ValueError(f"{caller}(): heads takes (MedusaConfig, head params), e.g. from "
                             f"medusa_jax.load_heads(path), got {type(heads).__name__}")

        check_heads_match(heads[0], cfg)
        if tree is None:
            raise ValueError(f"{caller}(): heads given without a tree; pass tree=medusa_jax.decoding.tree.get_tree(...) "
                             "(or heads=None for plain decoding)")
    if tree is not None:
        if not isinstance(tree, TreeBuffers):
            raise ValueError(f"{caller}(): tree takes a TreeBuffers (medusa_jax.decoding.tree.get_tree(spec)), "
                             f"got {type(tree).__name__}")
        if heads is None and (tree.max_depth > 0 or tree.lookup is None):
            raise ValueError(f"{caller}(): a tree was given without heads; pass heads=(MedusaConfig, params) "
                             "too, or tree=None for plain decoding (without heads, a tree may only be the trivial "
                             "one with prompt lookup: medusa_jax.decoding.tree.with_lookup(get_tree([]), PromptLookup()))")
        if heads is not None:
            check_depth(tree.max_depth, heads[0].num_heads)


def check_generation_args(cfg: ModelConfig, prompts: Any, *, caller: str, batch: bool,
                          max_new_tokens: Optional[int] = None, cache_size: Optional[int] = None,
                          heads: Any = None, tree: Any = None, eos_token_ids: Any = None,
                          acceptance: Any = None, seed: Any = 0, check_decoding: bool = True,
                          first_index: int = 0) -> Tuple[List[List[int]], Tuple[int, ...]]:
    """Validate the arguments of every generation entry point (`generate`, `generate_stream`,
    `generate_device`, `start_state`) and normalise the prompts.

    Args:
      prompts: ``batch=False``: one prompt, a list / tuple / 1-D numpy or jax array of ints, or a
        [1, T] array (or a list holding one list). ``batch=True``: a list of such prompts, or a
        [B, T] integer array (each row a whole prompt). Every id must be in [0, cfg.vocab_size).
      caller: the entry point's name, for messages.
      max_new_tokens: an int >= 1 (None: not checked).
      cache_size: None, or S slots with longest prompt < S <= ``cfg.max_position_embeddings``: a
        larger cache would give positions the model was never trained on, so it is refused, not capped.
      heads: None or (MedusaConfig, head params) fitting the backbone (`heads.medusa.check_heads_match`).
      tree: a `TreeBuffers` no deeper than the heads; given exactly when heads are.
      eos_token_ids: None (the config's), one id, or a sequence of ids in [0, vocab_size).
      acceptance: None or an `Acceptance`; seed: an int.
      check_decoding: False checks only prompts and cache_size (`start_state`).
      first_index: the index of ``prompts[0]`` among all prompts, for messages (prompts read lazily).
    Returns:
      (prompts as lists of ints, eos ids tuple).
    Raises:
      ValueError: any argument of the wrong kind or out of range; the message says what it takes.
      PromptTooLongError: a prompt with no room left in `cache_size`.
      HeadsMismatchError: heads made for another backbone.
    """
    out = _prompt_lists(prompts, caller, batch, first_index)
    _check_prompts_fit(cfg, out, caller, batch, cache_size, first_index)
    if not check_decoding:
        return out, ()
    _check_sampling(acceptance, seed, max_new_tokens, caller, batch, len(out))
    eos = _eos_ids(cfg, eos_token_ids, caller)
    _check_heads_and_tree(cfg, heads, tree, caller)
    return out, eos


#: The smallest repetition penalty taken (vLLM takes any > 0; below ~1e-37 a positive float32 logit
#: divided by it overflows to inf, and far above that it is already every repeated token forced).
MIN_REPETITION_PENALTY = 0.01


def check_penalties(s) -> None:
    """Raise ValueError unless a `SamplingParams`' min_p is in [0, 1], its presence and frequency
    penalties in [-2, 2] (OpenAI's range) and its repetition penalty in [`MIN_REPETITION_PENALTY`, 2]
    (vLLM's (0, 2], without the values whose division overflows)."""
    for name, low, high in (("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not low <= v <= high:
            raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {v!r}")
    r = s.repetition_penalty
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not MIN_REPETITION_PENALTY <= r <= 2:
        raise ValueError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 2] (1 = off), got {r!r}")


def checked_request(request: Request, vocab_size: int, max_len: int, where: str,
                    default_id: Callable[[], str]) -> Request:
    """`request` checked for an engine whose model has `vocab_size` tokens and whose rows hold
    `max_len` slots (`where` names that limit in the message), its prompt as ints and its id set
    (``default_id()`` when it has none).

    Raises ValueError saying what is wrong (an empty prompt, an id outside the vocabulary,
    max_new_tokens < 1, a min_tokens outside [0, max_new_tokens], a temperature < 0, top_p outside
    (0, 1], a top_k that is not an int in [0, 2**31), a seed outside [0, 2**31), penalties or a
    min_p out of range (`check_penalties`), logprobs outside [0, `MAX_TOP_LOGPROBS`], a logit_bias
    with an id outside the vocabulary or a value that is not a finite number, allowed_token_ids or
    bad_words that are not ids of the vocabulary: `check_token_sets`) and PromptTooLongError (a
    prompt that leaves no room for an answer)."""
    p = [int(t) for t in request.prompt]
    if not p:
        raise ValueError("the prompt is empty: give at least one token")
    bad = next((t for t in p if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    check_prompt_room(len(p), max_len, where)
    if int(request.max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    m = request.min_tokens
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 0 <= m <= int(request.max_new_tokens):
        raise ValueError(f"min_tokens must be an int in [0, max_new_tokens = {request.max_new_tokens}], got {m!r}")
    s = request.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
    check_top_k(s.top_k)
    if not 0 <= int(s.seed) < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**31), got {s.seed}")
    check_penalties(s)
    s = s._replace(min_p=float(s.min_p), presence_penalty=float(s.presence_penalty),
                   frequency_penalty=float(s.frequency_penalty), repetition_penalty=float(s.repetition_penalty))
    lp = request.logprobs
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {lp!r}")
    bias = request.logit_bias
    if bias:
        try:
            bias = {int(operator.index(t)): float(v) for t, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids (ints) to numbers, got {request.logit_bias!r}") from None
        bad = next(((t, v) for t, v in bias.items() if not 0 <= t < vocab_size or not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token {bad[0]} -> {bad[1]}: ids must be in [0, {vocab_size}) and values "
                             "finite numbers")
    allowed, bad_words = check_token_sets(request.allowed_token_ids, request.bad_words, vocab_size)
    rid = request.request_id if request.request_id is not None else default_id()
    return Request(prompt=p, max_new_tokens=int(request.max_new_tokens), sampling=s,
                   stop_token_ids=request.stop_token_ids, request_id=rid, logprobs=lp, logit_bias=bias or None,
                   min_tokens=int(m), allowed_token_ids=allowed, bad_words=bad_words)


def check_token_sets(allowed, bad_words, vocab_size: int) -> Tuple[Optional[List[int]], Optional[List[List[int]]]]:
    """A request's ``allowed_token_ids`` (None, or a non-empty list of ids) and ``bad_words`` (None,
    or token id sequences, each non-empty) as lists of ints; ValueError naming the field for an
    id outside [0, `vocab_size`), a value of another shape, or allowed ids that are all one-token
    bad words."""
    def ids(v, what: str) -> List[int]:
        try:
            out = [int(operator.index(t)) for t in v]
        except TypeError:
            raise ValueError(f"{what} must be a list of token ids (ints), got {v!r}") from None
        bad = next((t for t in out if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        return out

    if allowed is not None:
        allowed = ids(allowed, "allowed_token_ids")
        if not allowed:
            raise ValueError("allowed_token_ids is empty: no token could be chosen; give at least one id, or None")
    if bad_words:
        bad_words = [ids(w, f"bad_words[{i}]") for i, w in enumerate(bad_words)]
        if not all(bad_words):
            raise ValueError("bad_words: a word is an empty list of token ids")
    if allowed and bad_words and set(allowed) <= {w[0] for w in bad_words if len(w) == 1}:
        raise ValueError("every one of allowed_token_ids is a bad word, so no token could be chosen")
    return allowed, bad_words or None
