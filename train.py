#!/usr/bin/env python
"""Train Medusa heads: ``python train.py --config configs/smollm2_hydra.yaml``; ``--help`` for more.

The command lives in `medusa_jax.cli.train` (also ``medusa-train`` and
``python -m medusa_jax.cli.train``); this file runs it from a checkout.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # medusa_jax from this checkout

from medusa_jax.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
