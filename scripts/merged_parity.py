"""The merged Medusa-2 checkpoint against medusa_jax's tuned backbone (issue 31): the base model with the
tuned layers of a heads directory put in (`cli.common.load_backbone`), written as one HF directory
(`convert.tuned_layers.merge_to_hf`, what ``medusa-merge`` does), loaded by transformers; logits of
both on a few held-out chats, and the largest absolute difference; beside it the same figure for the
untuned base model written the same way (`convert.hf.save_hf`), the float32 agreement to expect.

    .venv/bin/python scripts/merged_parity.py --heads runs/smollm2_medusa2/heads [--chats 4] [--out DIR]
    .venv/bin/python scripts/merged_parity.py --stand-in-layers 4 [--stand-in-scale 0.05]
    .venv/bin/python scripts/merged_parity.py --stand-in-layers 4 --float64

``--stand-in-layers N`` needs no training run: the top N decoder layers of the base, every weight
moved by normal noise of `--stand-in-scale` times that tensor's standard deviation (seeded), saved
beside a copy of the shipped heads as Medusa-2 tuned layers (`convert.tuned_layers.save_tuned_layers`):
the merge and the export do not care how the layers were tuned.

Both float32 runs (ours and transformers') round differently over 30 layers, so each is also
compared with transformers' float64 run of the same checkpoint: ``ours_vs_float64`` beside
``transformers_float32_vs_float64``. That run is not float64 throughout, though: transformers'
RMSNorm, attention softmax and RoPE tables compute in float32 whatever the dtype (transformers 5's
modeling_llama), so its round-off partly matches its own float32 run's. ``--float64`` adds our own
float64 forward (under ``jax.enable_x64``, params cast to float64: everything but the RoPE tables in
float64, `models.llama.accumulation_dtype`): ``ours_float64_vs_transformers_float64`` compares the two
implementations with little round-off left, ``ours_vs_ours_float64`` and
``transformers_float32_vs_ours_float64`` say how far each float32 forward is from the float64 logits.

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


def stand_in_heads(base, model_path, layers: int, scale: float, seed: int = 0) -> str:
    """A heads directory (a copy of the shipped heads) holding the top `layers` decoder layers of
    `base` (a `LoadedModel` of `model_path`), each weight tensor plus normal(0, `scale` * its std)
    noise, as Medusa-2 tuned layers."""
    import shutil

    import jax

    from medusa_jax.convert.tuned_layers import save_tuned_layers
    from medusa_jax.resolve import DEFAULT_HEADS_DIR

    chosen = list(range(base.cfg.num_layers - layers, base.cfg.num_layers))
    rng = np.random.default_rng(seed)

    def moved(path, a):
        a = np.asarray(a)
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if not any(name.startswith(f"layers_{i}/") for i in chosen):
            return a
        return (a + rng.normal(0.0, scale * float(a.std() or 1.0), a.shape)).astype(a.dtype)
    tuned = jax.tree_util.tree_map_with_path(moved, base.params)
    out = tempfile.mkdtemp(prefix="medusa2_stand_in_")
    shutil.copytree(DEFAULT_HEADS_DIR, out, dirs_exist_ok=True)
    save_tuned_layers(out, base.cfg, base.params, tuned, chosen, base_model=model_path or "SmolLM2-135M-Instruct")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default=None, help="a heads directory with backbone_layers.safetensors")
    p.add_argument("--stand-in-layers", type=int, default=None, metavar="N",
                   help="instead of --heads: the base's top N layers moved by seeded noise, as tuned layers")
    p.add_argument("--stand-in-scale", type=float, default=0.05,
                   help="the stand-in noise, as a fraction of each weight tensor's standard deviation")
    p.add_argument("--model", default=None, help="the base model (default: the default SmolLM2 GGUF)")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "distill", "smollm2"))
    p.add_argument("--chats", type=int, default=4, help="held-out chats to compare on")
    p.add_argument("--out", default=None, help="where to write the merged directory (default: a temporary one)")
    p.add_argument("--float64", action="store_true",
                   help="compare our float64 forward with transformers' float64 one (not float32's)")
    args = p.parse_args()
    if (args.heads is None) == (args.stand_in_layers is None):
        p.error("give one of --heads DIR and --stand-in-layers N")
    import jax
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

    def logits(model, ids, float64: bool = False) -> np.ndarray:
        params = model.params
        if float64:
            params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        out = np.asarray(model.model.apply({"params": params}, jnp.asarray(ids),
                                           jnp.arange(ids.shape[1], dtype=jnp.int32)[None])[0])
        assert out.dtype == (np.float64 if float64 else np.float32), out.dtype
        return out.astype(np.float64)

    def compare(model, hf_dir: str) -> dict:
        worst = {}
        hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
        hf64 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, local_files_only=True).eval()
        for ids in chats:
            ours = logits(model, ids)
            with torch.no_grad():
                t = torch.from_numpy(ids.astype(np.int64))
                theirs, theirs64 = hf32(t).logits.double().numpy(), hf64(t).logits.numpy()
            diffs = {"ours_vs_transformers": ours - theirs, "ours_vs_float64": ours - theirs64,
                     "transformers_float32_vs_float64": theirs - theirs64}
            if args.float64:
                with jax.enable_x64(True):
                    ours64 = logits(model, ids, float64=True)
                diffs.update({"ours_float64_vs_transformers_float64": ours64 - theirs64,
                              "ours_vs_ours_float64": ours - ours64,
                              "transformers_float32_vs_ours_float64": theirs - ours64})
            for key, d in diffs.items():
                worst[key] = max(worst.get(key, 0.0), float(np.abs(d).max()))
        return worst

    base = load_model(args.model)
    heads = args.heads or stand_in_heads(base, args.model, args.stand_in_layers, args.stand_in_scale)
    tuned = load_backbone(args.model, heads, "float32")
    out = args.out or tempfile.mkdtemp(prefix="medusa2_merged_")
    merge_to_hf(tuned, out)
    merged = compare(tuned, out)
    base_dir = tempfile.mkdtemp(prefix="medusa2_base_")
    save_hf(base_dir, base.cfg, base.params, base.tokenizer)
    print(json.dumps({"merged": out, "heads": heads, "chats": len(chats), "tokens": sum(c.shape[1] for c in chats),
                      "max_abs_logit_diff": merged, "base_max_abs_logit_diff": compare(base, base_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
