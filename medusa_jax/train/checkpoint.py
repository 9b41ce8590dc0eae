"""What a training run keeps on disk: Orbax checkpoints, the data order, metrics, the export.

A checkpoint holds, under ``out_dir/checkpoints/<step>/``:

* ``state``: a pytree ``{"params": what is trained, "opt_state": the Optax state, "step": int}``
  (Orbax ``StandardSave``; arrays restored with the dtypes and structure of a template);
* ``meta``: JSON with the step, the data-order RNG (seed, epoch, index within the epoch: the
  data order of an epoch is a pure function of the seed and the epoch number, see
  `medusa_jax.train.trainer.epoch_permutation`), the training config, and free fields.

Saving is synchronous (a killed run never leaves a half-written checkpoint behind that Orbax
would pick up: Orbax writes to a temporary directory and renames it when complete) and keeps the
last ``keep`` checkpoints.

The data order is a pure function of (seed, step) (`batch_indices`), so nothing but the step has to
be restored for the data; `MetricsLog` drops the metrics lines of steps after the checkpoint a run
resumes from, so ``metrics.jsonl`` reads like that of an uninterrupted run. `export` writes the
final heads (and the backbone after joint training).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np

from medusa_jax.convert.hf import save_hf
from medusa_jax.convert.medusa_format import save_heads
from medusa_jax.convert.tuned_layers import save_tuned_layers
from medusa_jax.decoding.tree import get_tree
from medusa_jax.decoding.tree_estimates import greedy_tree_search
from medusa_jax.models.llama import lm_head_matrix


class Checkpointer:
    """Save and restore training state with an Orbax ``CheckpointManager``.

    Args:
      directory: checkpoint directory (created; made absolute, as Orbax requires).
      keep: how many of the latest checkpoints to keep (older ones are deleted).
    """

    def __init__(self, directory: str, keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=int(keep), create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        """The step of the newest complete checkpoint, or None when there is none."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write the checkpoint of `step` (overwrites nothing: a step already saved is skipped).

        Args:
          step: the number of optimizer steps done.
          state: pytree of arrays (jax or numpy), e.g. {"params", "opt_state", "step"}.
          meta: JSON-serialisable dict (data-order RNG, config, ...).
        """
        ocp = self._ocp
        if step in self.manager.all_steps():
            return
        state = jax.tree_util.tree_map(np.asarray, state)
        self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(dict(meta))))
        self.manager.wait_until_finished()

    def restore(self, template: Any, step: Optional[int] = None) -> Tuple[int, Any, dict]:
        """Restore a checkpoint into the structure and dtypes of `template`.

        Args:
          template: a pytree shaped like the saved state (e.g. the freshly initialised state).
          step: which checkpoint; None: the latest.
        Returns:
          (step, state as numpy arrays in template's structure, meta dict).
        Raises:
          FileNotFoundError: no checkpoint (or not that step) in the directory.
          ValueError: the saved state does not match the template (different model or heads).
        """
        ocp = self._ocp
        step = self._existing_step(step)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), template)
        try:
            out = self.manager.restore(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.directory}: checkpoint {step} does not match this training setup "
                             f"(different model, heads or mode?): {e}. Use another out_dir or --no-resume.") from e
        state = jax.tree_util.tree_map(np.asarray, out["state"])
        return int(step), state, dict(out["meta"])

    def _existing_step(self, step: Optional[int]) -> int:
        """`step`, or the latest when None; FileNotFoundError when there is no such checkpoint."""
        if step is None:
            step = self.latest_step()
        if step is None or step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint{'' if step is None else f' for step {step}'} in "
                                    f"{self.directory}")
        return int(step)

    def restore_meta(self, step: Optional[int] = None) -> dict:
        """The meta dict of a checkpoint (None: the latest) without reading its arrays.
        Raises FileNotFoundError when there is no such checkpoint."""
        ocp = self._ocp
        step = self._existing_step(step)
        return dict(self.manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def close(self) -> None:
        """Finish pending writes and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


# ------------------------------------------------------------------------------ data order, metrics

@functools.lru_cache(maxsize=2)
def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The data order of one epoch: a permutation of range(n) from (seed, epoch) only."""
    return np.random.default_rng([seed, epoch, n]).permutation(n)


def batch_indices(n: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Indices of step `step`'s batch: items [step*batch, (step+1)*batch) of the stream of epochs
    ``epoch_permutation(n, seed, 0) ++ epoch_permutation(n, seed, 1) ++ ...``."""
    out, start = [], step * batch
    while sum(len(o) for o in out) < batch:
        e, off = divmod(start, n)
        take = epoch_permutation(n, seed, e)[off:off + batch - sum(len(o) for o in out)]
        out.append(take)
        start += len(take)
    return np.concatenate(out)


class MetricsLog:
    """``out_dir/metrics.jsonl`` (one JSON object per line, each with a "step") and
    ``out_dir/accuracy.png`` (`plot_accuracy`), redrawn whenever a line with validation accuracies
    is written and by `plot`.

    Lines of steps after `start_step` (the step a run resumes from; -1 keeps none) are dropped on
    opening. With ``write=False`` (the other processes of a multi-process run) nothing is read or
    written; the records are still kept in memory.
    """

    def __init__(self, out_dir: str, start_step: int, write: bool = True):
        self.path, self.png = os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "accuracy.png")
        self.enabled = write
        kept = []
        if write and os.path.isfile(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("step", 0) <= start_step:
                        kept.append(rec)
        self.records = kept
        self._plotted: Optional[int] = None  # len(records) at the last drawing
        if write:
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, rec: dict) -> None:
        self.records.append(rec)
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if "val_top1" in rec:
            self.plot()

    def plot(self) -> None:
        """Redraw accuracy.png from every record so far (skipped when nothing changed since the last)."""
        if self.enabled and self._plotted != len(self.records):
            plot_accuracy(self.records, self.png)
            self._plotted = len(self.records)


def plot_accuracy(records: Sequence[dict], path: str) -> None:
    """Two-panel PNG of a run's metrics.jsonl records at `path` (matplotlib, Agg backend).

    Left: the training loss (the weighted sum over heads, per metrics line; joint mode also the
    backbone's own loss) over steps. Right: per head k (one colour each), the training top-1 accuracy
    (thin line, from each metrics line's ``train_top1``) and the validation top-1 (markers, from the
    evaluation lines' ``val_top1``) of token t+k+2. Does nothing when no record has either.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tr = [r for r in records if "loss" in r]
    ev = [r for r in records if "val_top1" in r]
    if not tr and not ev:
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    if tr:
        steps = [r["step"] for r in tr]
        ax_loss.plot(steps, [r["loss"] for r in tr], color="black", label="heads (weighted sum)")
        if any("base_loss" in r for r in tr):
            ax_loss.plot(steps, [r.get("base_loss", float("nan")) for r in tr], color="grey", ls="--",
                         label="backbone")
        ax_loss.legend(fontsize=8)
    ax_loss.set(xlabel="step", ylabel="training loss (nats)", title="training loss")
    ax_loss.grid(alpha=0.3)
    K = len((tr or ev)[0].get("train_top1") or (ev or tr)[0].get("val_top1") or [])
    for k in range(K):
        color = f"C{k % 10}"
        pts = [(r["step"], r["train_top1"][k]) for r in tr if "train_top1" in r]
        if pts:
            ax_acc.plot(*zip(*pts), color=color, lw=1, alpha=0.6, label=f"head {k} train")
        if ev:
            ax_acc.plot([r["step"] for r in ev], [r["val_top1"][k] for r in ev], color=color, marker="o", ms=4,
                        lw=1.5, label=f"head {k} validation")
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy", ylim=(0, 1.02),
               title="top-1 of head k (token t+k+2): train (thin), validation (dots)")
    ax_acc.grid(alpha=0.3)
    if K:
        ax_acc.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


# ------------------------------------------------------------------------------------------ export

def export(tc, hcfg, heads_params, backbone_params, bb, metrics: dict, out_dir: str,
           tuned_layers: Optional[Sequence[int]] = None) -> str:
    """Write the trained heads and, in joint mode, the trained backbone.

    Args:
      tc: the `TrainConfig`; hcfg: the heads' `MedusaConfig`; heads_params: their params (numpy).
      backbone_params: the trained backbone's whole params (joint mode) or None (frozen).
      bb: the `trainer.Backbone` (its cfg, original params, path and tokenizer).
      metrics: the final evaluation (val_loss, val_top1, val_top5, val_rank_acc, val_positions;
        in joint mode val_kl and val_top1_agreement, the backbone's drift).
      out_dir: the run directory.
      tuned_layers: the decoder layers that trained (joint mode with train_layers > 0), or None.
    Writes ``out_dir/heads`` (`save_heads`: our format, the metrics and training info in
    ``extra``, the tree when ``tc.tree`` names one or asks for a greedy search on the validation
    rank accuracies). With `tuned_layers`, those layers go beside the heads
    (`convert.tuned_layers.save_tuned_layers`: decoding with ``--heads`` then loads them onto the
    base model); in joint mode over the whole backbone with save_backbone, ``out_dir/backbone``
    (config.json, model.safetensors and the tokenizer: an HF directory `load_model` reads).
    Returns the heads directory.
    """
    if tc.tree == "search" and metrics.get("val_rank_acc"):
        hcfg = hcfg.replace(medusa_choices=greedy_tree_search(np.asarray(metrics["val_rank_acc"]), tc.tree_nodes,
                                                              tc.topk))
    elif tc.tree and tc.tree != "search":
        hcfg = hcfg.replace(medusa_choices=get_tree(tc.tree, tc.topk, hcfg.num_heads).medusa_choices)
    whole = backbone_params is not None and not tuned_layers  # the lm_head itself trained
    lm = lm_head_matrix(bb.cfg, backbone_params) if whole else None
    drift = [k for k in ("val_kl", "val_top1_agreement") if k in metrics]  # joint mode
    extra = {"metrics": {k: metrics.get(k) for k in ("val_loss", "val_top1", "val_top5", "val_rank_acc",
                                                    "val_positions", *drift)},
             "training": {"mode": tc.mode, "steps": tc.steps, "batch_size": tc.batch_size, "data": tc.data,
                          "loss_decay": tc.loss_decay, "seed": tc.seed, "loss_targets": tc.loss_targets,
                          "soft_temperature": tc.soft_temperature, "proposal_vocab": tc.proposal_vocab,
                          "loop_weight": tc.loop_weight, "loop_ngram": tc.loop_ngram,
                          "backbone": backbone_record(tc, bb, out_dir, backbone_params is not None, tuned_layers)}}
    if backbone_params is not None:
        extra["training"].update(train_layers=tc.train_layers, lambda_base=tc.lambda_base, base_loss=tc.base_loss,
                                 learning_rate=tc.learning_rate, max_kl=tc.max_kl)
    heads_dir = os.path.join(out_dir, "heads")
    save_heads(heads_dir, hcfg, heads_params, base_lm_head=lm, extra=extra)
    if tuned_layers:
        save_tuned_layers(heads_dir, bb.cfg, bb.params, backbone_params, tuned_layers, base_model_name(tc, bb))
    elif whole and tc.save_backbone:
        save_hf(os.path.join(out_dir, "backbone"), bb.cfg, backbone_params, bb.tokenizer)
    return heads_dir


def base_model_name(tc, bb) -> str:
    """The model the config named, or the default packaged model's file name (not its install
    path, which is this machine's)."""
    return tc.model if tc.model else os.path.basename(os.path.normpath(bb.path))


def backbone_record(tc, bb, out_dir: str, trained: bool, tuned_layers: Optional[Sequence[int]] = None) -> str:
    """The backbone the heads were trained with, as their metadata records it: the saved joint
    backbone, the base model with the tuned layers saved beside the heads, or the base model."""
    if tuned_layers:
        return f"{base_model_name(tc, bb)} with layers {tuned_layers[0]}-{tuned_layers[-1]} tuned (backbone_layers)"
    if trained:
        return os.path.join(out_dir, "backbone")
    return base_model_name(tc, bb)
