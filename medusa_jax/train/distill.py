"""Self-distillation: answer a pool of prompts with the backbone itself (Medusa paper, Sec. 2.3.2).

The heads are then trained on the backbone's own answers, so that they learn to predict what the
backbone will say (their acceptance at decoding time), not what some other model said.

Generation is *continuously batched* through the library's one batching decoder
(`medusa_jax.engine.generate.generate_batch`, plain decoding, no heads): B rows of one KV cache,
and when a row finishes (EOS or ``max_new_tokens``) the next prompt is prefilled into it, so no row
idles while others are still generating. Per-row cache lengths make this exact: each row's tokens
equal single-prompt greedy decoding.

Output, in ``out_dir``:
  ``samples.jsonl``: one line per finished prompt, flushed at once:
    ``{"id": pool id, "prompt_ids": [...], "response_ids": [...], "finish": "eos" | "length"}``
    (``response_ids`` end with the EOS token when it ended the answer);
  ``meta.json``: model path, max_new_tokens, temperature, seed, prompts file, max_prompt_tokens.
Re-run with the same arguments after an interruption, it continues where it stopped: ids already
in ``samples.jsonl`` are skipped, and a truncated last line (a kill mid-write) is dropped.

Command line::

    medusa-distill --out data/distill/smollm2 --target-tokens 300000
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from medusa_jax.chat import apply_chat_template
from medusa_jax.convert.load import load_model
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.engine.generate import generate_batch

#: File-name fragments of evaluation sets that must never be trained on.
EVAL_SET_MARKERS = ("mt_bench", "mt-bench", "spec-bench", "spec_bench", "specbench")


SAMPLES_FILE = "samples.jsonl"


META_FILE = "meta.json"


#: meta.json fields that must match when resuming (they define the data).
_META_KEYS = ("model", "max_new_tokens", "temperature", "seed", "prompts", "max_prompt_tokens")


class EvalSetError(ValueError):
    """The prompts file is an evaluation set (MT-Bench, Spec-Bench): never train on it."""


def default_prompts_path() -> str:
    """The checkout's ``data/prompt_pool_permissive.jsonl`` (data/SOURCES.md says where it comes from)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, "data", "prompt_pool_permissive.jsonl")


def same_source(recorded, given) -> bool:
    """Whether a model or prompt file that a ``meta.json`` records is `given` (a path): the same path,
    or the same file or directory name where the record is a bare name (the packaged model and the
    default pool are recorded by name, since this machine's install path does not travel with the
    data). Two full paths must agree (`given` relative to the working directory, links followed):
    fine-tunes often share a last name (``checkpoint-500``, ``final``), so a name alone does not
    identify one. Callers pass a given path made absolute, so that a model in the working directory
    is not read as a bare name."""
    recorded, given = os.path.normpath(str(recorded)), os.path.normpath(str(given))
    real = lambda p: os.path.realpath(os.path.expanduser(p))  # noqa: E731 - relative to here, links followed
    if recorded == given or real(recorded) == real(given):
        return True
    bare = lambda p: os.path.basename(p) == p  # noqa: E731
    return (bare(recorded) or bare(given)) and os.path.basename(recorded) == os.path.basename(given)


def check_not_eval_set(path: str) -> None:
    """Raise `EvalSetError` when `path`'s file name marks an evaluation set."""
    name = os.path.basename(os.fspath(path)).lower()
    if any(m in name for m in EVAL_SET_MARKERS):
        raise EvalSetError(f"{path}: this is an evaluation set (MT-Bench / Spec-Bench); never distill or "
                           "train on it. Use a training prompt pool such as data/prompt_pool_permissive.jsonl")


def read_prompt_pool(path: str) -> List[Tuple[str, str]]:
    """[(id, prompt text)] from a JSONL file with a ``prompt`` field (``id`` defaults to the line number).

    Raises: EvalSetError for an evaluation set, FileNotFoundError (no such file), ValueError for a
      path that is not a readable file, a line that is not a JSON object with a ``prompt`` string;
      the messages are one line.
    """
    check_not_eval_set(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such prompts file; give a JSONL file with a 'prompt' field per line")
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; give a JSONL file with a 'prompt' field per line")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg}); each line holds one object "
                                     "with a 'prompt' string") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                    raise ValueError(f"{path}:{i + 1}: no 'prompt' string field")
                out.append((str(rec.get("id", i)), rec["prompt"]))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompts ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file; give a JSONL file with a 'prompt' field per line") from None
    return out


def read_samples(path: str, repair: bool = True) -> Dict[str, dict]:
    """Finished samples already in ``samples.jsonl``, by id ({} when the file does not exist).

    A last line cut short by a kill (no newline, or not valid JSON) is ignored and, with `repair`,
    removed from the file so that later appends start on a clean line.
    """
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    done: Dict[str, dict] = {}
    good_end = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: truncated
        line = data[pos:nl]
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            break
        if rec is not None:
            done[str(rec["id"])] = rec
        pos = good_end = nl + 1
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def generate_samples(cfg, params, prompts: Iterable[Tuple[str, Sequence[int]]], out_dir: str, *,
                     max_new_tokens: int = 256, batch_size: int = 128, temperature: float = 0.0,
                     seed: int = 0, target_tokens: Optional[int] = None, limit: Optional[int] = None,
                     cache_size: Optional[int] = None, eos_token_ids: Optional[Sequence[int]] = None,
                     progress: bool = True) -> dict:
    """Answer tokenized prompts with continuous batching; append to ``out_dir/samples.jsonl``.

    The answers are plain decoding's (no heads) through `medusa_jax.engine.generate.generate_batch`,
    which reads the prompts lazily: a prompt is taken only when a row is free and every answer
    before it was written, so the token target is checked against all the answers so far.

    Args:
      cfg, params: the backbone (`ModelConfig`, `LlamaModel` params).
      prompts: (id, prompt token ids) in the order to process (chat template applied); ids
        already in samples.jsonl are skipped (resume) but still count towards `limit`.
      max_new_tokens: answer budget per prompt (finish "length" when reached without EOS).
      batch_size: B rows decoded together.
      temperature: 0 greedy; > 0 sampling (the i-th prompt taken by this call draws with seed + i).
      target_tokens: stop taking new prompts once this many response tokens exist (those in the
        file included); rows in flight are finished. None: no target.
      limit: take only the first `limit` prompts of `prompts`.
      cache_size: S slots per row at most; default: longest prompt + max_new_tokens + 1, rounded up
        to 64 (prompts are materialised to find it when not given).
      eos_token_ids: default ``cfg.eos_token_ids``.
    Returns:
      {"written": samples written now, "tokens": response tokens written now, "total_tokens":
       in the file, "seconds": decode wall time, "tokens_per_s": written tokens / seconds}.
    Raises:
      ValueError: a prompt that does not fit in `cache_size` with its budget, or an empty prompt.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SAMPLES_FILE)
    done = read_samples(path)
    total = sum(len(r["response_ids"]) for r in done.values())
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_token_ids is None else eos_token_ids))
    it: Iterator = iter(prompts)
    if limit is not None:
        it = itertools.islice(it, limit)
    if cache_size is None:
        pending = list(it)
        longest = max((len(p) for i, p in pending if i not in done), default=1)
        cache_size = min(-(-(longest + max_new_tokens + 1) // 64) * 64, cfg.max_position_embeddings)
        it = iter(pending)
    S = cache_size
    taken: List[Tuple[str, List[int]]] = []  # (id, prompt ids) in the order generate_batch reads them

    def source() -> Iterator[List[int]]:
        for pid, ids in it:
            if target_tokens is not None and total >= target_tokens:
                return
            if pid in done:
                continue
            ids = [int(t) for t in ids]
            if not ids:
                raise ValueError(f"prompt {pid}: empty")
            if len(ids) + max_new_tokens > S:
                raise ValueError(f"prompt {pid}: {len(ids)} tokens + {max_new_tokens} new do not fit "
                                 f"in the cache of {S} slots")
            taken.append((pid, ids))
            yield ids

    bar = tqdm(total=target_tokens, initial=total, unit="tok", desc="distill", dynamic_ncols=True,
               mininterval=5.0, file=sys.stderr) if progress else None
    written = new_tokens = 0
    t0 = time.perf_counter()
    answers = generate_batch(cfg, params, source(), batch_size=batch_size, max_new_tokens=max_new_tokens,
                             acceptance=Acceptance(temperature=float(temperature)), seed=seed, eos_token_ids=eos,
                             cache_size=S, progress=False)
    with open(path, "a", encoding="utf-8") as f:
        for i, res in answers:
            pid, ids = taken[i]
            rec = {"id": pid, "prompt_ids": ids, "response_ids": res.tokens,
                   "finish": "eos" if res.stop_reason == "eos" else "length"}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            done[pid] = rec
            written += 1
            total += len(res.tokens)
            new_tokens += len(res.tokens)
            if bar is not None:
                bar.update(len(res.tokens))
                bar.set_postfix(samples=len(done), tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}",
                                refresh=False)
    if bar is not None:
        bar.close()
    secs = time.perf_counter() - t0
    return {"written": written, "tokens": new_tokens, "total_tokens": total, "seconds": secs,
            "tokens_per_s": new_tokens / secs if secs > 0 else 0.0}


def tokenized_prompts(tokenizer, pool: Sequence[Tuple[str, str]], seed: int, max_prompt_tokens: int,
                      skip_ids: Iterable[str] = ()) -> Iterator[Tuple[str, List[int]]]:
    """Shuffle `pool` with `seed` (numpy permutation) and yield (id, chat-templated ids), skipping
    prompts longer than `max_prompt_tokens` or empty. Ids in `skip_ids` are yielded with an empty
    list (already done; not tokenized) so that they still count towards a limit."""
    skip = set(skip_ids)
    order = np.random.default_rng(seed).permutation(len(pool))
    for i in order:
        pid, text = pool[int(i)]
        if pid in skip:
            yield pid, []
            continue
        if not text.strip():
            continue
        ids = apply_chat_template(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            yield pid, ids


def check_settings(*, target_tokens: Optional[int] = None, max_new_tokens: int = 256, batch_size: int = 128,
                   temperature: float = 0.0, seed: int = 0, limit: Optional[int] = None,
                   max_prompt_tokens: int = 256, flags: bool = False) -> None:
    """Check `distill`'s settings before anything loads or is written (meta.json records them).

    `flags`: name them as ``medusa-distill``'s flags (``--max-new-tokens``) rather than as
    ``distill()``'s arguments. Raises: ValueError, one line naming the first bad setting and what it
    takes.
    """
    def name(arg: str) -> str:
        return "--" + arg.replace("_", "-") if flags else f"distill(): {arg}"

    def integer(arg: str, value, low: int, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name(arg)} must be an integer >= {low} ({what}), got {value!r}")

    integer("max_new_tokens", max_new_tokens, 1, "response tokens per prompt at most")
    integer("batch_size", batch_size, 1, "prompts decoded together")
    integer("max_prompt_tokens", max_prompt_tokens, 1, "the longest prompt kept, in tokens")
    if target_tokens is not None:
        integer("target_tokens", target_tokens, 1, "response tokens to collect")
    if limit is not None:
        integer("limit", limit, 1, "prompts of the shuffled pool to take")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 31:
        raise ValueError(f"{name('seed')} must be an integer in [0, 2**31), got {seed!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def distill(out: str, model: Optional[str] = None, prompts: Optional[str] = None,
            target_tokens: Optional[int] = None, max_new_tokens: int = 256, batch_size: int = 128,
            temperature: float = 0.0, seed: int = 0, limit: Optional[int] = None,
            max_prompt_tokens: int = 256, progress: bool = True) -> dict:
    """Self-distil a prompt pool into ``out`` (see the module doc). Plain keyword arguments, so a
    YAML config can be passed as ``distill(**cfg)``.

    Args:
      out: output directory (created).
      model: backbone path (HF dir or GGUF); None: the default SmolLM2 GGUF.
      prompts: JSONL with a ``prompt`` field; None: `default_prompts_path()`.
      target_tokens: stop taking prompts once the file holds this many response tokens.
      max_new_tokens, batch_size, temperature, seed, limit: see `generate_samples`; `seed` also
        fixes the pool's shuffle.
      max_prompt_tokens: skip prompts longer than this after the chat template.
    The settings (`check_settings`), ``out`` and the prompts are checked before the model loads and
    before meta.json is written, so a refused run leaves no settings behind.
    Returns: `generate_samples`'s summary (``written`` 0 and ``total_tokens`` 0: no prompt of the pool
      fits ``max_prompt_tokens`` after the chat template; meta.json is written all the same).
    Raises:
      EvalSetError: `prompts` names an evaluation set.
      FileNotFoundError: no such prompts file.
      ValueError: a bad setting; ``out`` is not a directory; a prompts file that is not a readable
        JSONL file of prompts or holds none; max_new_tokens that leaves no room for a prompt in the
        model's context; ``out`` holds a meta.json made with different settings.
    """

    check_settings(target_tokens=target_tokens, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   temperature=temperature, seed=seed, limit=limit, max_prompt_tokens=max_prompt_tokens)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out}: exists and is not a directory; give an output directory (it is created if missing)")
    prompts_given = prompts is not None
    prompts = os.path.abspath(prompts or default_prompts_path())
    check_not_eval_set(prompts)
    pool = read_prompt_pool(prompts)
    if not pool:
        raise ValueError(f"no prompts in {prompts}: give a JSONL file with a 'prompt' field per line")
    lm = load_model(model)
    if max_new_tokens >= lm.cfg.max_position_embeddings:
        raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                         f"{lm.cfg.max_position_embeddings} tokens; give fewer")
    # the defaults by file name (this machine's install and checkout paths would not travel with the data)
    meta = {"model": os.path.abspath(lm.path) if model else os.path.basename(lm.path),
            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "seed": int(seed),
            "prompts": prompts if prompts_given else os.path.basename(prompts),
            "max_prompt_tokens": int(max_prompt_tokens), "eos_token_ids": list(lm.cfg.eos_token_ids)}
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, META_FILE)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        diff = [k for k in _META_KEYS if k in old and old[k] != meta[k]
                and not (k in ("model", "prompts") and same_source(old[k], meta[k]))]
        if diff:
            moved = (" (a model or prompt file that moved since: pass the path it records, or edit "
                     f"{META_FILE})") if set(diff) & {"model", "prompts"} else ""
            raise ValueError(f"{out} was made with different settings ({', '.join(f'{k}: {old[k]!r} != {meta[k]!r}' for k in diff)}); "
                             f"use the same arguments to resume, or another --out{moved}")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    done = read_samples(os.path.join(out, SAMPLES_FILE))
    S = min(-(-(max_prompt_tokens + max_new_tokens + 1) // 64) * 64, lm.cfg.max_position_embeddings)
    max_prompt_tokens = min(max_prompt_tokens, S - max_new_tokens)
    it = tokenized_prompts(lm.tokenizer, pool, seed, max_prompt_tokens, skip_ids=done.keys())
    return generate_samples(lm.cfg, lm.params, it, out, max_new_tokens=max_new_tokens,
                            batch_size=batch_size, temperature=temperature, seed=seed,
                            target_tokens=target_tokens, limit=limit, cache_size=S, progress=progress)
