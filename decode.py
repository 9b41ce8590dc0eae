#!/usr/bin/env python
"""Chat with a Llama-family model, decoding with Medusa heads: ``python decode.py --help``.

The command lives in `medusa_jax.cli.decode` (also ``medusa-decode`` and
``python -m medusa_jax.cli.decode``); this file runs it from a checkout.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # medusa_jax from this checkout

from medusa_jax.cli.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
