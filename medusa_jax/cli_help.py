"""The ``--help`` formatter shared by the command-line tools (train.py, ``python -m medusa_jax.check``,
``bench``, ``tune``, ``train.distill``).

argparse's `ArgumentDefaultsHelpFormatter` appends ``(default: X)`` to every option, which prints
``(default: None)`` or ``(default: False)`` where the help already says what happens without the
flag, and a second default where the help text names one itself. `HelpFormatter` appends the
default only when it tells the reader something.
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`argparse.ArgumentDefaultsHelpFormatter` that appends ``(default: X)`` only when the help text
    does not mention a default itself and X is a real value (not None, not an empty list, not the
    off state of a ``store_true`` / ``store_false`` flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or default == [] or (action.nargs == 0 and isinstance(default, bool)
                                     and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        return super()._get_help_string(action)
