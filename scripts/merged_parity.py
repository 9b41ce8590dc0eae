"""The merged Medusa-2 checkpoint against medusa_jax's tuned backbone (issue 31): the base model with the
tuned layers of a heads directory put in (`cli.common.load_backbone`), written as one HF directory
(`convert.tuned_layers.merge_to_hf`, what ``medusa-merge`` does), loaded by transformers; logits of
both on a few held-out chats, and the largest absolute difference; beside it the same figure for the
untuned base model written the same way (`convert.hf.save_hf`), the float32 agreement to expect.

    .venv/bin/python scripts/merged_parity.py --heads runs/smollm2_medusa2/heads [--chats 4] [--out DIR]

Needs torch (the test extra). Prints one JSON line: max |logits difference| over every position, for
the merged model and for the base.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="a heads directory with backbone_layers.safetensors")
    p.add_argument("--model", default=None, help="the base model (default: the default SmolLM2 GGUF)")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "distill", "smollm2"))
    p.add_argument("--chats", type=int, default=4, help="held-out chats to compare on")
    p.add_argument("--out", default=None, help="where to write the merged directory (default: a temporary one)")
    args = p.parse_args()
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from medusa_jax.cli.common import load_backbone
    from medusa_jax.convert.hf import save_hf
    from medusa_jax.convert.load import load_model
    from medusa_jax.convert.tuned_layers import merge_to_hf
    from medusa_jax.train import data as D

    _, val = D.split_train_val(D.load_distilled(args.data), 0.04, 0)
    chats = [np.asarray(ids[:512], np.int32)[None] for ids, _ in val[:args.chats]]

    def worst(model, hf_dir: str) -> float:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
        out = 0.0
        for ids in chats:
            ours = np.asarray(model.model.apply({"params": model.params}, jnp.asarray(ids),
                                                jnp.arange(ids.shape[1], dtype=jnp.int32)[None])[0])
            with torch.no_grad():
                theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
            out = max(out, float(np.abs(ours - theirs).max()))
        return out

    tuned = load_backbone(args.model, args.heads, "float32")
    out = args.out or tempfile.mkdtemp(prefix="medusa2_merged_")
    merge_to_hf(tuned, out)
    merged = worst(tuned, out)
    base = load_model(args.model)
    base_dir = tempfile.mkdtemp(prefix="medusa2_base_")
    save_hf(base_dir, base.cfg, base.params, base.tokenizer)
    print(json.dumps({"merged": out, "chats": len(chats), "tokens": sum(c.shape[1] for c in chats),
                      "max_abs_logit_diff": merged, "base_max_abs_logit_diff": worst(base, base_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
