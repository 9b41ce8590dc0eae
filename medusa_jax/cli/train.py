#!/usr/bin/env python
"""Train Medusa heads: frozen backbone (Medusa-1) or jointly with it (Medusa-2).

    python train.py --config configs/smollm2_medusa1.yaml
    python train.py --config configs/tiny.yaml --set steps=50 --set out_dir=runs/try
    python train.py --config configs/smollm2_medusa1.yaml --no-resume      # start over

Every YAML field is documented in `medusa_jax.train.config.TrainConfig` and in the config files.
A run killed at any point continues from its last checkpoint when started again with the same
command (``--resume`` is the default) and ends with the same heads as an uninterrupted run. A
finished run continues when started again with a larger ``steps`` (the schedule then spans the new
total); a run in ``out_dir`` made with other settings is refused (exit code 2) rather than mixed
with this one: start over with ``--no-resume`` or pick another ``--set out_dir=DIR``.
Several devices: ``--mesh 2x4`` (or the config's ``mesh``); several processes (hosts): the same
command on each, with ``--coordinator HOST:PORT --num-processes N --process-id I``
(`medusa_jax.distributed`).
Outputs go to ``out_dir``: metrics.jsonl, accuracy.png, checkpoints/, heads/ (load them with
``python decode.py --heads OUT_DIR/heads``) and, in joint mode over the whole backbone, backbone/;
with ``train_layers: N`` the N tuned layers go beside the heads (backbone_layers.safetensors), and
``--heads OUT_DIR/heads`` loads them onto the base model. A joint run whose backbone drifted beyond
``max_kl`` exports nothing and exits with code 1 (the message says what to change). A config that
cannot be read or holds an invalid value (a ``tree`` the export could not store included) and an
``out_dir`` that cannot be created are refused at once, before the model loads (exit code 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from medusa_jax.cli import interruptible, prog_name


def parse_args(argv=None) -> argparse.Namespace:
    from medusa_jax import distributed
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(prog=prog_name("train.py", "medusa-train"),
                                description="Train Medusa heads (frozen backbone or joint).",
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML training config (see configs/; default: TrainConfig's defaults)")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config fields, e.g. --set steps=100 learning_rate=3e-4 model=null")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue the run in out_dir from its latest checkpoint; --no-resume deletes its "
                        "checkpoints and metrics and starts over")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="stop at step N >= 1 of the run (counted from its start, resumed steps included) "
                        "without a final checkpoint or export, as if killed, to try resumption: the same command "
                        "without --stop-at-step resumes from the last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="train on a device mesh, e.g. 2x4 (the config's `mesh` field; default: the config's, "
                        "1x1 = one device): the batch split on 'data', heads and (joint mode) backbone "
                        "Megatron-style on 'model'. On a CPU, simulate N devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    distributed.add_args(p)
    args = p.parse_args(argv)
    if args.stop_at_step is not None and args.stop_at_step < 1:
        p.error(f"--stop-at-step must be >= 1 (the step at which to stop), got {args.stop_at_step}")
    return args


class _AsConfigError:
    """Stands in for the parser in `common.make_out_dir`: its one-line message about a config field
    (out_dir) becomes a `TrainConfigError`, reported like the config's other errors."""

    @staticmethod
    def error(message: str):
        from medusa_jax.train.config import TrainConfigError
        raise TrainConfigError(message)


@interruptible
def main(argv=None) -> int:
    args = parse_args(argv)
    from medusa_jax import distributed
    from medusa_jax.train.config import TrainConfig, TrainConfigError

    overrides = tuple(args.overrides) + ((f"mesh={args.mesh}",) if args.mesh is not None else ())
    try:
        tc = TrainConfig.from_yaml(args.config, overrides)
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (TrainConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(tc.to_dict(), indent=2))
        return 0
    from medusa_jax.cli.common import enable_compilation_cache, make_out_dir
    from medusa_jax.train.trainer import ResumeConflictError, check_run_inputs, train

    try:  # checked (out_dir created) now: inputs that cannot make a run fail before the model loads
        check_run_inputs(tc)
        make_out_dir(_AsConfigError, tc.out_dir, flag="out_dir")
    except (TrainConfigError, OSError, ValueError) as e:  # ValueError: a model file that is not GGUF
        print(f"error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    try:
        res = train(tc, resume=args.resume, stop_at_step=args.stop_at_step, progress=not args.no_progress)
    except ResumeConflictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if res.heads_dir is None:
        if res.steps_done >= tc.steps:  # another process of a multi-process run
            import jax
            print(f"process {jax.process_index()}: trained {res.steps_done} steps; process 0 wrote the heads to "
                  f"{os.path.join(os.path.abspath(tc.out_dir), 'heads')}", file=sys.stderr)
        else:
            print(f"stopped at step {res.steps_done}/{tc.steps} (--stop-at-step); run the same command without "
                  "--stop-at-step to resume from the last checkpoint", file=sys.stderr)
        return 0
    m = res.metrics
    done = "already trained" if res.already_finished else "trained"
    kind = "Medusa" if tc.head_type == "medusa" else "hydra"
    soft = f", soft targets at T={tc.soft_temperature:g}" if tc.loss_targets == "soft" else ""
    print(f"{done} {tc.mode} {kind} heads ({tc.num_heads} heads, {res.steps_done} steps{soft}) -> {res.heads_dir}")
    if m.get("val_top1"):
        for k, (a1, a5) in enumerate(zip(m["val_top1"], m["val_top5"])):
            print(f"  head {k} (token t+{k + 2}): val top-1 {a1:.3f}  top-5 {a5:.3f}")
    if m.get("val_kl") is not None:
        what = f"top {tc.train_layers} layers" if tc.train_layers else "backbone"
        print(f"  tuned {what}: val KL(original || tuned) {m['val_kl']:.4f} nats/token (max_kl {tc.max_kl}), top-1 "
              f"agreement {m['val_top1_agreement']:.4f}; quality on the held-out chats: "
              f"python -m medusa_jax.cli.quality --tuned {res.heads_dir if tc.train_layers else tc.out_dir + '/backbone'}")
    print(f"metrics: {os.path.join(os.path.abspath(tc.out_dir), 'metrics.jsonl')}, plot: "
          f"{os.path.join(os.path.abspath(tc.out_dir), 'accuracy.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
