"""``medusa-plan``: the memory plan of one decoding step on a device mesh, from the compiled step,
with nothing allocated (`medusa_jax.evals.memory`).

``medusa-plan --config llama-2-7b --mesh 1x8 --dtype bfloat16 --max-len 4096 --batch 8``

Compiling for a mesh needs its data x model devices: `main` asks the CPU platform for that many
simulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count``) before JAX starts its
backend, so the plan runs on any machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from medusa_jax.cli import interruptible
from medusa_jax.evals.memory import ACCEPTANCES, DEFAULT_TREE_NODES, DTYPES, PRESETS, format_plan, plan

_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def ensure_host_devices(count: int) -> bool:
    """Ask JAX's CPU platform for `count` simulated devices, unless ``XLA_FLAGS`` already sets a
    count: appends ``--xla_force_host_platform_device_count=<count>`` to ``os.environ["XLA_FLAGS"]``.
    JAX reads the flag when its backend starts (the first ``jax.devices()`` or computation), not
    at import, so call this before anything touches the backend; afterwards it has no effect.
    Other platforms (GPU, TPU) ignore it. Returns True when the flag was added."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_DEVICES_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = (flags + " " if flags else "") + f"{_HOST_DEVICES_FLAG}={int(count)}"
    return True


@interruptible
def main(argv=None) -> int:
    """The command line (see the module docstring). Returns 0, or 2 after an ``error: ...`` line on
    stderr for a bad config, mesh, size or too few devices."""
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog="medusa-plan", formatter_class=HelpFormatter,
        description="Per-device memory of one Medusa decoding step on a DATAxMODEL device mesh, from XLA's "
                    "compilation of the step on abstract inputs: nothing is allocated, and on a CPU the mesh's "
                    "devices are simulated.")
    p.add_argument("--config", required=True, metavar="CONFIG",
                   help="a Hugging Face config.json, a directory holding one, or a preset: " + ", ".join(PRESETS))
    p.add_argument("--mesh", default="1x1", metavar="DATAxMODEL",
                   help="device mesh: DATA-way batch split times MODEL-way Megatron split (MODEL must divide the "
                        "query and KV heads)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="dtype of the params, Medusa heads, KV cache and activations (logits stay float32)")
    p.add_argument("--max-len", type=int, default=4096, metavar="S",
                   help="KV cache slots per row (prompt plus output), at most the model's context")
    p.add_argument("--batch", type=int, default=8, metavar="B", help="rows decoded together")
    p.add_argument("--medusa-heads", type=int, default=4, metavar="K",
                   help="Medusa heads (one residual block each, sharing the backbone's lm_head); 0: plain decoding")
    p.add_argument("--tree-nodes", type=int, default=None, metavar="T",
                   help=f"tree tokens with the root; default: up to {DEFAULT_TREE_NODES}, the official mc_sim_7b_63 "
                        "tree cut to depth K (larger T: a greedy tree on stand-in accuracies)")
    p.add_argument("--acceptance", choices=ACCEPTANCES, default="greedy",
                   help="acceptance rule of the step: greedy (temperature 0), or sampling with exact or typical "
                        "acceptance (more temporaries)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    from medusa_jax.sharding import parse_mesh

    try:
        data, model = parse_mesh(args.mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ensure_host_devices(data * model)  # before anything starts JAX's backend
    try:
        result = plan(args.config, mesh=args.mesh, dtype=args.dtype, max_len=args.max_len, batch=args.batch,
                      medusa_heads=args.medusa_heads, tree_nodes=args.tree_nodes, acceptance=args.acceptance)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
