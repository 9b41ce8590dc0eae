"""``medusa-chat``: a multi-turn chat on the step-level engine, in the terminal.

Each answer streams as it is decoded (Medusa heads, prompt lookup), and the conversation keeps its
KV cache from turn to turn (prefix reuse: only the new turn is prefilled). A one-line banner names
the model and ``/help``. Commands: ``/help`` (lists them), ``/reset`` (forget the conversation),
``/system TEXT`` (a new system message; the conversation restarts), ``/exit`` (or ``/quit``); Ctrl-C stops the current answer and keeps the conversation (before the
answer begins, the message is not sent; at the prompt, the line is dropped; piped, it ends the chat
with status 130). Tokens per second, tokens per
step and the reused prompt tokens of each turn go to stderr. Standard input may be piped: one user
turn per line (``printf 'Hi\\nAnd then?\\n' | medusa-chat``).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from medusa_jax.cli import interruptible


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli import common

    p = argparse.ArgumentParser(prog="medusa-chat", description="Chat with the model, turn after turn, decoding "
                                "with Medusa heads (greedy answers identical to plain greedy).",
                                formatter_class=common.HelpFormatter,
                                epilog="commands: /help, /reset, /system TEXT (empty: none), /exit or /quit; //TEXT sends a "
                                "message that begins with /; Ctrl-C stops the current answer (at the prompt it drops "
                                "the line; Ctrl-D quits)")
    common.add_model_args(p)
    p.add_argument("--system", default=None, help="a system message for the conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the most tokens of one answer")
    p.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="memory for the conversation's KV cache between turns, in MiB (0: prefill every turn anew)")
    common.add_dtype_arg(p)
    common.add_acceptance_args(p, seeds_help="answer i of the session (counting from 0, across /reset) uses "
                                             "(seed + i) mod 2**31")
    common.add_penalty_args(p)
    common.add_lookup_arg(p)
    return p


@interruptible
def main(argv: Optional[List[str]] = None) -> int:
    from medusa_jax.cli import common

    p = build_parser()
    args = p.parse_args(argv)
    acc = common.acceptance_from_args(p, args)
    penalties = common.penalties_from_args(p, args)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefix_cache_mb < 0:
        p.error(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    common.check_text_arg(p, args.system, "--system")

    from medusa_jax.chat import check_text, render_chat
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request
    from medusa_jax.decoding.sampling import prompt_seed

    try:
        model, heads, tree, note, _ = common.setup_decoding(args, use_medusa=not args.no_medusa)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}", file=sys.stderr)
    engine = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=1, speculation="always",
                    acceptance="exact" if acc.mode == "greedy" else acc.method,
                    posterior_threshold=acc.posterior_threshold, posterior_alpha=acc.posterior_alpha,
                    prefix_cache_bytes=args.prefix_cache_mb << 20).start()
    interactive = sys.stdin.isatty()
    print(banner(model, heads), file=sys.stderr, flush=True)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become surrogates, refused by line (check_text)
        sys.stdin.reconfigure(errors="surrogateescape")
    system = args.system
    messages: List[dict] = []
    turn = 0
    try:
        while True:
            try:
                line = input("you> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            except KeyboardInterrupt:
                if not interactive:
                    raise
                print("\n[Ctrl-D or /exit quits]", file=sys.stderr)  # Ctrl-C at the prompt drops the line
                continue
            if not interactive and line == "":
                break
            text = line.strip()
            if not text:
                continue
            try:
                check_text(text, "the message")
            except ValueError as e:
                print(f"error: {e}; not sent", file=sys.stderr)
                continue
            command, rest = (text.split(maxsplit=1) + [""])[:2]
            if command in ("/exit", "/quit", "/reset", "/help") and rest.strip():
                print(f"{command} takes no text; {COMMANDS}", file=sys.stderr)
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/help":
                print(HELP, file=sys.stderr)
                continue
            if command == "/reset":
                messages = []
                print("[the conversation is forgotten]", file=sys.stderr)
                continue
            if command == "/system":
                system = rest.strip() or None
                messages = []
                print("[new system message; the conversation restarts]" if system else
                      "[no system message; the conversation restarts]", file=sys.stderr)
                continue
            if text.startswith("//"):  # a message that begins with "/"
                text = text[1:]
            elif text.startswith("/"):
                print(f"unknown command {command!r}; {COMMANDS}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": text})
            try:
                prompt = render_chat(model.tokenizer,
                                     ([{"role": "system", "content": system}] if system else []) + messages)
                handle = engine.submit(Request(prompt, args.max_new_tokens,
                                               acc.sampling(prompt_seed(args.seed, turn))._replace(**penalties)))
            except ValueError as e:  # the conversation outgrew the context (or this message alone fills it)
                print(f"error: {e}" + ("; /reset starts a new conversation" if len(messages) > 1 else ""),
                      file=sys.stderr)
                messages.pop()
                continue
            except KeyboardInterrupt:  # before its answer began: as if not sent
                print("\n[stopped; the message was not sent]", file=sys.stderr)
                messages.pop()
                continue
            printer = common.TextStreamer(model.tokenizer)
            fin, stopped = _answer(handle, printer)
            if stopped and not fin.tokens:  # stopped before its first token (in the prefill): not sent
                print("[stopped before the answer began; the message was not sent]", file=sys.stderr)
                messages.pop()
                continue
            if stopped:
                print("[stopped]", file=sys.stderr)
            answer = model.tokenizer.decode(fin.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            turn += 1
            rate = len(fin.tokens) / fin.decode_s if fin.decode_s > 0 else 0.0
            cut = {"length": "; cut at --max-new-tokens",
                   "cache_full": "; cut: the conversation fills the model's context (/reset starts a new one)"}
            print(f"[{len(fin.tokens)} tokens, {rate:.1f} tok/s, {fin.tokens_per_step:.2f} tokens/step, "
                  f"{fin.reused_tokens} of {fin.prompt_tokens} prompt tokens reused, first token after "
                  f"{fin.first_token_s:.2f}s{cut.get(fin.reason, '')}]", file=sys.stderr, flush=True)
    finally:
        engine.stop()
    return 0


#: The commands, as the messages that name them list them.
COMMANDS = ("commands: /help, /reset, /system TEXT, /exit (or /quit); start a message with // to send one that "
            "begins with /")

#: What /help prints.
HELP = """commands:
  /help          this list
  /reset         forget the conversation (a new one starts)
  /system TEXT   a new system message (no TEXT: none); the conversation restarts
  /exit, /quit   leave the chat (Ctrl-D too)
  //TEXT         send "/TEXT" (a message that begins with /)
Ctrl-C stops the answer being written and keeps what came (at the prompt it drops the line)."""


def banner(model, heads) -> str:
    """The one line medusa-chat prints (on stderr) before the first prompt: the model, how it
    decodes, and where the commands are listed."""
    import os

    how = "medusa heads" if heads is not None else "plain decoding"
    return f"[medusa-chat: {os.path.basename(str(model.path).rstrip('/'))}, {how}; type a message, /help lists " \
           "the commands, Ctrl-D quits]"


def _answer(handle, printer):
    """Stream `handle`'s answer through `printer`; Ctrl-C (once or more) stops it and keeps what
    came. Returns (the engine's `Finished`, whether Ctrl-C stopped it)."""
    stopped = False
    try:
        for chunk in handle:
            printer.push(chunk)
    except KeyboardInterrupt:
        stopped = True
        handle.cancel()
    while True:
        try:
            fin = handle.result(timeout=60)
            break
        except KeyboardInterrupt:  # another Ctrl-C while it stops: it is stopping already
            stopped = True
            handle.cancel()
    printer.end()
    return fin, stopped


if __name__ == "__main__":
    sys.exit(main())
