"""The commands: argument parsing, printing and exit codes only. Nothing outside this package
imports it."""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

INTERRUPTED = 130
"""Exit status of a command stopped with Ctrl-C (128 + SIGINT, as a shell reports it)."""
BROKEN_PIPE = 141
"""Exit status of a command whose output's reader went away (128 + SIGPIPE, as for ``yes | head``)."""


def interruptible(main: Callable[..., int]) -> Callable[..., int]:
    """`main` whose Ctrl-C (KeyboardInterrupt) ends the command with one line on stderr and exit
    status `INTERRUPTED` instead of a traceback. What a command writes as it goes (distilled
    samples, benchmark rows, checkpoints) is written whole or not at all, so nothing is lost.
    When the reader of its standard output goes away early (``| head``), it ends quietly with
    `BROKEN_PIPE` (Python's recipe: standard output goes to /dev/null, so that the interpreter's
    last flush at exit does not fail again)."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()
            return status
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C)", file=sys.stderr)
            return INTERRUPTED
        except BrokenPipeError:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # a standard output without a descriptor (a test's capture)
                pass
            return BROKEN_PIPE

    return run


def prog_name(script: str, console_script: str) -> str:
    """The command's name for usage lines: `console_script` when it runs as that console script,
    else ``python <script>`` (a checkout's ``decode.py`` / ``train.py``)."""
    return console_script if os.path.basename(sys.argv[0]) == console_script else f"python {script}"
