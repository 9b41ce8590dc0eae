"""Memory plan of one decoding step on a device mesh, from the compiled step, with nothing allocated.

``medusa-plan --config llama-2-7b --mesh 1x8 --dtype bfloat16 --max-len 4096 --batch 8``

The decoding step (`medusa_jax.decoding.step.step`, the jitted `medusa_jax.decoding.step.medusa_step`) is
lowered and compiled by XLA for abstract inputs (`jax.ShapeDtypeStruct` with their
`NamedSharding`), exactly as decoding lays them out on a ``DATAxMODEL`` mesh
(`medusa_jax.sharding`: Megatron-style on 'model', rows on 'data'):

- backbone params: the shapes of ``LlamaModel(cfg).init`` (`jax.eval_shape`), every leaf in
  ``--dtype`` (as ``load_model(dtype=...)`` stores them), placed by `sharding.spec_for`;
- Medusa heads: ``MedusaHeads`` with one residual block each and the backbone's shared lm_head,
  readied for the tree as decoding readies them (`heads.medusa.prepare_heads`: only the first
  tree-depth heads are kept), in ``--dtype``;
- KV cache: k, v ``[L, B, KVH, S, Dh]`` in ``--dtype``, B on 'data' and KVH on 'model'
  (`sharding.cache_spec`), lengths ``[B]`` int32 and token ids ``[B, S]`` int32 (counted with the
  decode state);
- decode state: logits ``[B, V]`` float32, hidden ``[B, D]``, per-row keys ``[B, 2]`` uint32 and
  next_token ``[B]`` int32, rows on 'data'.

The figures are per device, in bytes: what one device holds of each input (its shard,
``NamedSharding.shard_shape``), XLA's temporaries (``compiled.memory_analysis()``) and the step's
outputs that do not reuse a donated input. ``total = params + heads + KV cache + state +
unaliased outputs + temporaries`` is the step's peak. XLA's own argument size is reported beside
the sum of the inputs' shards as a cross-check. Prefill (chunks of `decoding.prefill.PREFILL_CHUNK` tokens)
is not planned; its temporaries scale with the chunk, not the tree.

Devices: compiling for a mesh needs its data x model devices. `main` asks the CPU platform for
that many simulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count``) before JAX
starts, so the plan runs on any machine; on a machine whose default devices are too few, the
CPU's are used. The figures are then those of XLA's CPU compiler: weights, KV cache and state are
the same on any platform, temporaries are not. XLA:CPU has no native bfloat16 / float16 dots or
scatters and converts their whole operands to float32, so a bfloat16 plan's temporaries hold about
two bytes per weight and per cache entry more (llama-2-7b on 1x8, bfloat16, S 4096, B 8: 7.1 GiB
of temporaries, float32: 0.17 GiB); the result's ``notes`` say so. A GPU or TPU compile makes no
such copies.

The default tree (``--tree-nodes``, T tokens with the root): the first T - 1 nodes of the
official ``mc_sim_7b_63`` tree (FasterDecoding/Medusa, `decoding.tree.MC_SIM_7B_63`, acceptance order) of
depth <= K; 64 by default (the whole tree when K >= 4). A larger T than that tree holds is the
greedy tree (`decoding.tree.greedy_tree_search`, Medusa Sec. 3.3.1) on a stand-in accuracy table
(`STAND_IN_ACCURACY`). With K = 0 the step is plain decoding (`decoding.tree.PLAIN_TREE`, T = 1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

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
