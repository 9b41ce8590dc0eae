"""The commands: argument parsing, printing and exit codes only. Nothing outside this package
imports it."""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

INTERRUPTED = 130
"""Exit status of a command stopped with Ctrl-C (128 + SIGINT, as a shell reports it)."""


def interruptible(main: Callable[..., int]) -> Callable[..., int]:
    """`main` whose Ctrl-C (KeyboardInterrupt) ends the command with one line on stderr and exit
    status `INTERRUPTED` instead of a traceback. What a command writes as it goes (distilled
    samples, benchmark rows, checkpoints) is written whole or not at all, so nothing is lost."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C)", file=sys.stderr)
            return INTERRUPTED

    return run


def prog_name(script: str, console_script: str) -> str:
    """The command's name for usage lines: `console_script` when it runs as that console script,
    else ``python <script>`` (a checkout's ``decode.py`` / ``train.py``)."""
    return console_script if os.path.basename(sys.argv[0]) == console_script else f"python {script}"
