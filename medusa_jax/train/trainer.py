"""Train Medusa heads: frozen backbone (Medusa-1) or jointly with the backbone (Medusa-2).

Cai et al. 2024, "Medusa", Sec. 2.2. Head k (0-based) reads the backbone's last hidden state at t
and is trained with cross-entropy on token t+k+2, weighted ``loss_decay**k`` (Sec. 2.2.1).

* ``frozen`` (Medusa-1): the backbone's hidden states are computed once (batched by length, jitted,
  ``compute_logits=False``) and reused across epochs; training runs on a flat dataset of positions
  (hidden [D] at t, labels of every head) shuffled across sequences, keeping only positions where
  at least one head has a valid label. Only the heads get gradients and optimizer state. With a
  shared lm_head the loss is `losses.shared_head_loss` (no lm_head gradient, fused backward).
* ``joint`` (Medusa-2, Sec. 2.2.2): backbone and heads; loss = ``lambda_base * L_base +
  sum_k decay^k L_k`` with L_base the next-token cross-entropy, or the KL divergence from the frozen
  original model (``base_loss: kl``, for self-distilled data, Sec. 2.3.2). The heads have their own
  learning-rate multiplier, and the first ``heads_warmup_steps`` steps train the heads only (the
  backbone's optimizer and schedule start after them). With ``train_layers: N`` only the top N
  decoder layers train: the residual stream entering layer L - N is computed once per sequence
  (`layer_cache.LayerInputs`), a step runs N layers and the heads, the teacher is the original's
  same N layers, and the export is those layers only, beside the heads. Validation reports the
  backbone's drift (``val_kl``, ``val_top1_agreement``, `drift.measure_drift`), and a run whose
  final ``val_kl`` exceeds ``max_kl`` is checkpointed but not exported (`BackboneDriftError`).

Two options apply to both modes:

* ``head_type: hydra`` (Ankner et al. 2024, Sec. 3; `medusa_jax.heads.hydra`): head k also reads the
  embeddings of tokens t+1..t+k+1, trained with teacher forcing on the data's true tokens (what
  decoding sees on the path it accepts).
* ``loss_targets: soft``: head k at t learns the backbone's own distribution over token t+k+2,
  ``softmax(h_{t+k+1} @ lm_head / soft_temperature)``, with a KL divergence. In frozen mode the
  cached hidden state at t+k+1 gives it (`data.Positions.target_rows`): no extra backbone pass.

And two to frozen mode:

* ``proposal_vocab: N``: the heads' loss runs over the N most frequent training tokens only (the
  proposal vocabulary they then decode with, `proposal_vocabulary`): labels outside it leave the
  loss and count as validation misses; soft targets are the backbone's distribution renormalised
  over it. The vocabulary projection, most of a step, costs N/V as much.
* ``loop_weight`` < 1: positions inside verbatim repetition loops of the distilled answers
  (`loop_flags`) are kept with that probability; validation also reports ``val_noloop_top1/5``.

Optax AdamW, linear warm-up + cosine decay, global-norm clipping. The data order of epoch e is a
permutation drawn from (seed, e) only (`checkpoint.batch_indices`), so a run resumed from an Orbax
checkpoint (`checkpoint.Checkpointer`) ends with the same params as an uninterrupted one.

Outputs in ``out_dir``: ``metrics.jsonl``, ``accuracy.png``, ``checkpoints/``, ``heads/`` (our
format, `medusa_jax.convert.medusa_format.save_heads`, with the final metrics), and in joint mode
``backbone/`` (an HF directory: config.json + model.safetensors, loadable by `load_model`).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax import sharding
from medusa_jax.convert.load import ConversionError, check_model_path
from medusa_jax.convert.medusa_format import load_heads, read_heads_config
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import from_medusa, token_embeddings
from medusa_jax.heads.medusa import init_heads
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.train import data as D
from medusa_jax.train.checkpoint import Checkpointer, MetricsLog, batch_indices, export
from medusa_jax.train.config import TrainConfig
from medusa_jax.train.distill import SAMPLES_FILE
from medusa_jax.train.drift import measure_drift
from medusa_jax.train.examples import distilled_for_another_model, load_examples, proposal_vocabulary
from medusa_jax.train.hidden import (Backbone, build_backbone, compute_positions, frozen_positions, note,
                                     padded_sequences)
from medusa_jax.train.layer_cache import LayerInputs, first_trained_layer, merged_backbone, top_layers
from medusa_jax.train.losses import topk_from_ranks
from medusa_jax.train.optim import make_optimizer, schedule
from medusa_jax.train.steps import (
    evaluate_positions,
    make_frozen_step,
    make_joint_step,
    place_frozen_batch,
    place_joint_batch,
    place_projections,
    restrict_batch,
    restrict_labels,
    to_host,
)

#: Config fields that may change between a checkpoint and its resumption: they change neither the
#: trained params (up to float rounding: loss_chunk) nor the data order. ``steps`` may change too
#: (`check_resume`); any other difference refuses to resume.
_RESUME_FREE = ("out_dir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "cache_hidden",
                "hidden_dir", "hidden_batch_tokens", "tree", "tree_nodes", "save_backbone", "max_val_positions", "topk",
                "loss_chunk", "mesh", "max_kl")


#: Of those, the fields the export depends on: a finished run is exported again when one changes.
_EXPORT_FIELDS = ("tree", "tree_nodes", "topk", "save_backbone", "max_val_positions", "max_kl")


#: How to get past a run in out_dir that cannot be continued, for messages.
_START_OVER = ("to start over in that out_dir use --no-resume (train(resume=False)); to keep that run, "
               "train elsewhere with --set out_dir=DIR")


class ResumeConflictError(ValueError):
    """out_dir holds a checkpoint that this config cannot continue (other settings, or more steps
    done than asked for)."""


class TrainingDivergedError(ValueError):
    """The training loss became NaN or infinite: the run stops before it writes such params."""


class BackboneDriftError(ValueError):
    """The jointly trained backbone drifted from the original beyond ``max_kl`` (validation KL per
    token): the run is checkpointed, nothing is exported."""


@dataclass
class TrainResult:
    """What `train` returns. heads_params / backbone_params are numpy pytrees (backbone_params only
    in joint mode); metrics holds the last evaluation (val_loss, val_top1, val_top5 per head, ranks);
    steps_done < steps only when stopped early with ``stop_at_step``; heads_dir is None then.
    already_finished: out_dir held this run, finished with the same settings: nothing was trained
    or written, heads_params and metrics were read back from heads_dir (backbone_params is None)."""
    heads_cfg: MedusaConfig
    heads_params: dict
    backbone_params: Optional[dict]
    metrics: dict
    steps_done: int
    heads_dir: Optional[str]
    already_finished: bool = False


def initial_heads(tc: TrainConfig, hcfg: MedusaConfig, mcfg: ModelConfig, lm) -> dict:
    """Fresh heads (`init_heads`) or those of ``tc.init_heads``. Medusa heads may start hydra heads
    (`heads.hydra.from_medusa`: zero path weights, so the same logits). Raises ValueError when the loaded
    heads' K, L, shared_lm_head or head type differ from the config, HeadsMismatchError when they do
    not fit."""
    if not tc.init_heads:
        return init_heads(hcfg, lm)
    cfg, p = load_heads(tc.init_heads, mcfg)
    got = (cfg.num_heads, cfg.num_layers, cfg.shared_lm_head)
    if got != (hcfg.num_heads, hcfg.num_layers, hcfg.shared_lm_head):
        raise ValueError(f"init_heads {tc.init_heads}: (num_heads, num_layers, shared_lm_head) = {got}, but the "
                         f"config asks for {(hcfg.num_heads, hcfg.num_layers, hcfg.shared_lm_head)}")
    if cfg.head_type != hcfg.head_type:
        if (cfg.head_type, hcfg.head_type) != ("medusa", "hydra"):
            raise ValueError(f"init_heads {tc.init_heads}: {cfg.head_type} heads cannot start {hcfg.head_type} "
                             "heads (only Medusa heads can start hydra heads); set init_heads: null or "
                             f"head_type: {cfg.head_type}")
        cfg, p = from_medusa(cfg, p)
        note(f"init_heads {tc.init_heads}: Medusa heads start these hydra heads (path weights at zero)")
    return {k: jnp.asarray(v) for k, v in p.items() if k != "proposal_ids"}  # decoding-only field


def latest_checkpoint(ck_dir: str) -> Optional[Tuple[int, dict]]:
    """(step, meta) of the newest checkpoint in `ck_dir` (meta only, no arrays are read), or None
    when the directory holds none."""
    if not os.path.isdir(ck_dir):
        return None
    ck = Checkpointer(ck_dir)
    try:
        step = ck.latest_step()
        return None if step is None else (step, ck.restore_meta(step))
    finally:
        ck.close()


def check_resume(tc: TrainConfig, step: int, old: dict) -> Optional[str]:
    """Whether `tc` may continue the checkpoint of `step` made with config `old` (a `to_dict`).

    Resuming is allowed when every field outside `_RESUME_FREE` is unchanged, except ``steps``,
    which may grow (or shrink down to `step`): the warm-up + cosine schedule is then laid over the
    new total, so the learning rate jumps at `step` and the heads differ from those of one
    uninterrupted run of the new length.
    Returns: None, or a notice to show when ``steps`` changed (it names both learning rates).
    Raises:
      ResumeConflictError: other fields differ (the message lists each old -> new value), or the
        checkpoint is already past ``tc.steps``; it says how to start over or train elsewhere.
    """
    out, old_steps = os.path.abspath(tc.out_dir), int(old.get("steps", step))
    what = (f"a finished run ({step}/{old_steps} steps)" if step >= old_steps else
            f"an unfinished run (checkpoint at step {step} of {old_steps})")
    new = tc.to_dict()
    diff = [k for k in new if k not in _RESUME_FREE and k != "steps" and old.get(k) != new[k]]
    if diff:
        changes = ", ".join(f"{k} {old.get(k)!r} -> {new[k]!r}" for k in (diff + ["steps"] * (old_steps != tc.steps)))
        raise ResumeConflictError(f"{out} holds {what} made with other settings ({changes}); {_START_OVER}")
    if tc.steps < step:
        raise ResumeConflictError(f"{out} holds {what}, already past steps={tc.steps}; {_START_OVER}")
    if tc.steps == old_steps:
        return None
    lr = lambda n: float(schedule(tc, tc.learning_rate * tc.heads_lr_multiplier, n)(step))
    return (f"continuing the run in {out} from step {step} to {tc.steps} steps (it was set up for {old_steps}): "
            f"the learning-rate schedule now spans {tc.steps} steps, so the heads' learning rate at step {step} "
            f"is {lr(tc.steps):.3g} instead of {lr(old_steps):.3g}, and the heads will differ from those of one "
            f"uninterrupted {tc.steps}-step run")


def _finished_result(tc: TrainConfig, out_dir: str, step: int) -> Optional[TrainResult]:
    """The TrainResult of a finished run read back from its export, or None when out_dir/heads is
    missing or was exported with other export settings (tree, topk, ...)."""
    heads_dir = os.path.join(out_dir, "heads")
    try:
        raw = read_heads_config(heads_dir)
        with open(os.path.join(out_dir, "train_config.json")) as f:
            exported_with = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    if any(exported_with.get(k) != getattr(tc, k) for k in _EXPORT_FIELDS) or exported_with.get("steps") != step:
        return None
    hcfg, hp = load_heads(heads_dir)
    return TrainResult(hcfg, hp, None, raw.get("metrics") or {}, step, heads_dir, already_finished=True)


def _val_sequences(tc: TrainConfig, val_ex):
    """The first validation sequences holding at most about max_val_positions answer tokens."""
    picked, total = [], 0
    for ex in val_ex:
        if tc.max_val_positions and total >= tc.max_val_positions:
            break
        picked.append(ex)
        total += int(ex[1].sum())
    return picked


def _record(tc: TrainConfig, acc: dict, step: int, n_items: int, seconds: float, joint: bool) -> dict:
    """A metrics line from the sums of the step stats since the last line."""
    n = acc["n"]
    train_acc = topk_from_ranks(acc["ranks"], acc["counts"])
    rec = {"step": step, "epoch": round(step * tc.batch_size / n_items, 4),
           "lr": float(schedule(tc, tc.learning_rate * tc.heads_lr_multiplier, tc.steps)(step - 1)),
           "loss": round(acc["loss"] / n, 5), "head_loss": (acc["head_loss"] / n).round(5).tolist(),
           "train_top1": train_acc[0].round(4).tolist(), "grad_norm": round(acc["grad_norm"] / n, 4),
           "step_time_s": round(seconds / n, 4)}
    if joint:
        hw = tc.heads_warmup_steps
        rec["lr_backbone"] = float(schedule(tc, tc.learning_rate, tc.steps - hw)(step - 1 - hw)) if step > hw else 0.0
        rec["base_loss"] = round(acc["base_loss"] / n, 5)
    return rec


def check_run_inputs(tc: TrainConfig, model: bool = True) -> None:
    """What `train` checks before it loads or writes anything: the model is an HF directory or a GGUF
    file (`convert.load.check_model_path`; unless ``model: random``, or `model` is False: a backbone
    given to `train`), the data directory holds the self-distilled samples (unless ``data:
    synthetic``), and neither out_dir nor hidden_dir is a file.
    Raises: FileNotFoundError (no such model, no samples.jsonl in ``tc.data``), ConversionError (a
    model file that is not GGUF), FileExistsError (out_dir or hidden_dir a file)."""
    if model and tc.model != "random":
        try:
            check_model_path(tc.model)
        except (FileNotFoundError, ConversionError) as e:
            raise type(e)(f"model {e}") from None
    if tc.data != "synthetic" and not os.path.isfile(os.path.join(tc.data, SAMPLES_FILE)):
        raise FileNotFoundError(f"data {tc.data}: no {SAMPLES_FILE} there; make it with `medusa-distill --out "
                                f"{tc.data}` (or set data: synthetic for a smoke test)")
    if os.path.exists(tc.out_dir) and not os.path.isdir(tc.out_dir):
        raise FileExistsError(f"out_dir {tc.out_dir}: exists and is not a directory; give a directory (it is "
                              "created if missing)")
    if tc.hidden_dir and os.path.exists(tc.hidden_dir) and not os.path.isdir(tc.hidden_dir):
        raise FileExistsError(f"hidden_dir {tc.hidden_dir}: exists and is not a directory; give a directory (it is "
                              "created if missing) or null (out_dir/hidden)")


@dataclass
class _Run:
    """What one run's steps, evaluations and export read (`_setup_run`; the mode's fields from
    `_joint_setup` / `_frozen_setup`; lm_train and emb placed on the mesh by `train`)."""
    tc: TrainConfig
    bb: Backbone
    hcfg: MedusaConfig
    joint: bool
    first: Optional[int]  # the first decoder layer that trains (`first_trained_layer`); None: all or none
    train_ex: list
    val_ex: list
    proposal_ids: Optional[np.ndarray]  # the proposal vocabulary [N] (`proposal_vocabulary`), or None
    remap: Optional[np.ndarray]  # [V] index into it, -1 outside; None without one
    lm_train: Any  # the lm_head [D, V] (or its N proposal columns) in head_matmul_dtype
    emb: Any  # the token embeddings [V, D] (hydra heads' paths), frozen
    mesh: Any
    progress: bool
    n_items: int = 0  # what an epoch runs over: chats (joint mode) or positions (frozen mode)
    step_fns: Optional[dict] = None  # joint: {whether the backbone trains: the jitted step}
    frozen_step: Any = None  # frozen: the jitted step
    inputs: Optional[LayerInputs] = None  # joint with train_layers: the top layers' cached inputs
    train_pos: Optional[D.Positions] = None  # frozen: the training positions
    val: Optional[D.Positions] = None  # frozen: the validation positions (None without)
    val_noloop: Optional[D.Positions] = None  # frozen: those outside repetition loops (None without)

    @property
    def top(self) -> bool:
        """Joint mode on the top train_layers layers only."""
        return self.first is not None


def _finished_run(tc: TrainConfig, out_dir: str, ck_dir: str) -> Optional[TrainResult]:
    """The export of the run in out_dir when it is this run, finished with the same settings (a
    notice says nothing trains); None when there is something to train or to export again (a notice
    says which). Raises ResumeConflictError as `check_resume` does."""
    point = latest_checkpoint(ck_dir)
    if point is None:
        return None
    notice = check_resume(tc, point[0], point[1].get("config", {}))
    if notice:
        note(notice)
    elif point[0] == tc.steps:
        done = _finished_result(tc, out_dir, point[0])
        if done is not None:
            note(f"{out_dir} already holds this run, finished ({point[0]}/{tc.steps} steps) with the same "
                 f"settings; nothing was trained. Its heads: {done.heads_dir}. To train longer: --set "
                 f"steps=N (N > {tc.steps}); to train again from scratch: --no-resume; for a separate run: "
                 "--set out_dir=DIR")
            return done
        note(f"{out_dir} holds this run, finished ({point[0]}/{tc.steps} steps); exporting its heads again "
             f"(export settings changed or {os.path.join(out_dir, 'heads')} is missing)")
    return None


def _setup_run(tc: TrainConfig, bb: Backbone, mesh, out_dir: str, progress: bool):
    """The run's heads config, examples (notes on stderr when they are another model's or hold no
    validation chat), proposal vocabulary, lm_head and embeddings, and the mode's optimizer and
    data. Returns (`_Run`, initial params, their optimizer state)."""
    mcfg, joint = bb.cfg, tc.mode == "joint"
    if mesh is not None and joint:
        sharding.check_model_axis(mcfg, mesh.shape["model"])
    hcfg = MedusaConfig(hidden_size=mcfg.hidden_size, vocab_size=mcfg.vocab_size, num_heads=tc.num_heads,
                        num_layers=tc.num_layers, shared_lm_head=tc.shared_lm_head, topk=tc.topk,
                        base_model=os.path.basename(os.path.normpath(bb.path)), head_type=tc.head_type)
    lm0 = jnp.asarray(lm_head_matrix(mcfg, bb.params))
    emb = jnp.asarray(token_embeddings(bb.params))  # hydra heads' path embeddings (frozen)
    train_ex, val_ex = load_examples(tc, mcfg.vocab_size)
    if tc.data != "synthetic" and (other := distilled_for_another_model(tc.data, bb.path)):
        note(other)
    if not val_ex:
        note(f"val_fraction={tc.val_fraction} holds out none of the {len(train_ex)} chats: no validation accuracy"
             + (" and no tree searched on it (the heads are saved without one)" if tc.tree == "search" else "")
             + "; distill more chats or raise val_fraction")
    proposal_ids, remap = proposal_vocabulary(tc, train_ex, mcfg.vocab_size)
    # cast once: the frozen steps take it as is; with a proposal vocabulary only its columns
    lm_train = (lm0 if proposal_ids is None else lm0[:, proposal_ids]).astype(tc.head_matmul_dtype)
    heads0 = initial_heads(tc, hcfg, mcfg, lm0)
    run = _Run(tc, bb, hcfg, joint, first_trained_layer(tc, mcfg), train_ex, val_ex, proposal_ids, remap,
               lm_train, emb, mesh, progress)
    params, opt_state = (_joint_setup if joint else _frozen_setup)(run, heads0, out_dir)
    return run, params, opt_state


def _joint_setup(run: _Run, heads0: dict, out_dir: str):
    """Joint mode: the heads' and the backbone's optimizers (the backbone's starts after
    heads_warmup_steps), the steps, and with train_layers the top layers' cached inputs. Returns
    (params {"heads", "backbone"}, optimizer state)."""
    tc, bb = run.tc, run.bb
    opts = {"heads": make_optimizer(tc, tc.learning_rate * tc.heads_lr_multiplier, tc.steps),
            "backbone": make_optimizer(tc, tc.learning_rate, tc.steps - tc.heads_warmup_steps)}
    backbone = top_layers(bb.params, run.first, bb.cfg.num_layers) if run.top else bb.params
    params = {"heads": heads0, "backbone": backbone}
    opt_state = {k: opts[k].init(params[k]) for k in opts}
    run.step_fns = {b: make_joint_step(bb.cfg, run.hcfg, tc, opts, b, run.first) for b in (False, True)}
    run.n_items = len(run.train_ex)
    if run.top:  # the residual stream entering the first trained layer, once per sequence visited
        run.inputs = LayerInputs(tc, bb, run.train_ex, run.first, out_dir)
    return params, opt_state


def _frozen_setup(run: _Run, heads0: dict, out_dir: str):
    """Frozen mode: the heads' optimizer and step, and the positions (`frozen_positions`). Returns
    (the heads' params, their optimizer state)."""
    tc = run.tc
    opt = make_optimizer(tc, tc.learning_rate * tc.heads_lr_multiplier, tc.steps)
    opt_state = opt.init(heads0)
    run.frozen_step = make_frozen_step(run.hcfg, tc, opt)
    run.train_pos, run.val, run.val_noloop = frozen_positions(tc, run.bb, run.train_ex, run.val_ex, out_dir,
                                                              run.progress)
    run.n_items = run.train_pos.num_positions
    return heads0, opt_state


def _evaluate(run: _Run, p) -> dict:
    """The validation metrics of params `p` ({} without validation data): the heads' loss and
    accuracies (frozen mode: also outside repetition loops), in joint mode through the trained
    backbone, with its drift from the original (``val_kl``, ``val_top1_agreement``)."""
    tc, hcfg, bb = run.tc, run.hcfg, run.bb
    if not run.joint:
        if run.val is None or not run.val.num_positions:
            return {}
        out = evaluate_positions(hcfg, tc, p, run.lm_train, run.emb, run.val, run.remap)
        if run.val_noloop is not None:  # the same heads outside repetition loops (`loop_flags`)
            clean = evaluate_positions(hcfg, tc, p, run.lm_train, run.emb, run.val_noloop, run.remap)
            out.update({"val_noloop_top1": clean["val_top1"], "val_noloop_top5": clean["val_top5"]})
        return out
    if not run.val_ex:
        return {}
    tuned, seqs = merged_backbone(bb.params, p["backbone"], run.first), _val_sequences(tc, run.val_ex)
    v = compute_positions(Backbone(bb.cfg, tuned, bb.path), seqs, tc.num_heads, tc.max_seq_len,
                          tc.hidden_batch_tokens, progress=False)
    if run.top:
        out = evaluate_positions(hcfg, tc, p["heads"], run.lm_train, run.emb, v, run.remap)
    else:
        out = evaluate_positions(hcfg, tc, p["heads"], lm_head_matrix(bb.cfg, tuned), token_embeddings(tuned), v)
    drift = measure_drift(bb.cfg, bb.params, tuned, seqs, tc.max_seq_len, tc.hidden_batch_tokens)
    return {**out, "val_kl": round(drift["kl"], 6), "val_top1_agreement": round(drift["top1_agreement"], 5)}


def _save_checkpoint(run: _Run, ck: Checkpointer, s: int, params, opt_state) -> None:
    """Checkpoints step `s` with where it is in the data order."""
    tc, n_items = run.tc, run.n_items
    meta = {"step": s, "seed": tc.seed, "data_items": n_items, "epoch": (s * tc.batch_size) // n_items,
            "index_in_epoch": (s * tc.batch_size) % n_items, "config": tc.to_dict()}
    ck.save(s, {"params": params, "opt_state": opt_state, "step": np.int64(s)}, meta)


def _one_step(run: _Run, params, opt_state, ref, step: int):
    """Runs training step `step` (0-based) on its batch (`batch_indices`). Returns (params,
    optimizer state, the step's stats, on the device)."""
    tc = run.tc
    idx = batch_indices(run.n_items, tc.batch_size, tc.seed, step)
    if not run.joint:
        batch = restrict_batch(D.positions_batch(run.train_pos, idx, soft=tc.loss_targets == "soft"), run.remap)[0]
        return run.frozen_step(params, opt_state, run.lm_train, run.emb, place_frozen_batch(batch, run.mesh))
    tokens, mask = padded_sequences([run.train_ex[i] for i in idx], tc.batch_size, tc.max_seq_len)
    lab, ok = restrict_labels(*D.head_targets(tokens, mask, tc.num_heads), run.remap)
    x = run.inputs.batch(idx, tc.batch_size) if run.top else tokens
    consts = (run.lm_train, run.emb) if run.top else ()
    return run.step_fns[step >= tc.heads_warmup_steps](
        params, opt_state, ref, *place_joint_batch(x, tokens, lab, ok, *D.base_targets(tokens, mask), run.mesh),
        *consts)


def _train_steps(run: _Run, ck: Checkpointer, metrics: MetricsLog, params, opt_state, ref, step: int, end: int):
    """Trains from `step` up to `end`, writing a metrics line every log_every steps (with the
    validation metrics every eval_every steps and at the last) and a checkpoint every
    checkpoint_every steps before the last. Returns (params, optimizer state, step reached, the last
    validation metrics). Raises TrainingDivergedError when the loss is NaN or infinite."""
    tc = run.tc
    acc, last_eval = None, {}
    if step == 0 and tc.eval_every:  # the starting point of the accuracy curves
        metrics.write({"step": 0, "epoch": 0.0, **_evaluate(run, params)})
    t_log = time.perf_counter()
    if run.top and step < end:  # every sequence the remaining steps visit, before the first step
        run.inputs.ensure(np.concatenate([batch_indices(run.n_items, tc.batch_size, tc.seed, s)
                                          for s in range(step, end)]), run.progress)
    bar = tqdm(total=tc.steps, initial=step, desc=f"train ({tc.mode})", disable=not run.progress, dynamic_ncols=True)
    while step < end:
        params, opt_state, st = _one_step(run, params, opt_state, ref, step)
        st = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), st)
        if not np.isfinite(st["loss"]):
            bar.close()
            kept = f"; the last checkpoint ({tc.out_dir}/checkpoints) is kept" if tc.checkpoint_every else ""
            raise TrainingDivergedError(
                f"the training loss became {float(st['loss'])} at step {step + 1} (learning_rate "
                f"{tc.learning_rate}): nothing of this step is saved{kept}; train again with a lower "
                "learning_rate")
        acc = dict(st, n=1) if acc is None else {k: acc[k] + st.get(k, 1) for k in acc}
        step += 1
        bar.update(1)
        is_eval = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
        if step % tc.log_every == 0 or is_eval or step == end:
            rec = _record(tc, acc, step, run.n_items, time.perf_counter() - t_log, run.joint)
            if is_eval:
                last_eval = _evaluate(run, params)
                rec.update(last_eval)
            metrics.write(rec)
            bar.set_postfix(loss=rec["loss"], top1=rec.get("val_top1", rec["train_top1"])[0])
            acc, t_log = None, time.perf_counter()
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
            _save_checkpoint(run, ck, step, params, opt_state)
    bar.close()
    return params, opt_state, step, last_eval


def _finish(run: _Run, ck: Checkpointer, params, opt_state, step: int, last_eval: dict, out_dir: str,
            primary: bool) -> TrainResult:
    """The run's result; when it reached ``steps``: its last checkpoint, the drift guard (joint mode)
    and the export (by the primary process). Raises BackboneDriftError (`check_drift`)."""
    tc = run.tc
    np_params = to_host(params)
    heads_p, backbone_p = (np_params["heads"], np_params["backbone"]) if run.joint else (np_params, None)
    if run.top:
        backbone_p = merged_backbone(to_host(run.bb.params), backbone_p, run.first)
    heads_dir = None
    out_cfg = run.hcfg
    if run.proposal_ids is not None:  # the exported heads decode with the vocabulary they were trained on
        heads_p = {**heads_p, "proposal_ids": np.asarray(run.proposal_ids, np.int32)}
        out_cfg = run.hcfg.replace(proposal_vocab_size=len(run.proposal_ids))
    if step >= tc.steps:
        _save_checkpoint(run, ck, step, params, opt_state)
        last_eval = last_eval or _evaluate(run, params)
    ck.close()
    if step >= tc.steps:
        if run.joint:
            check_drift(tc, last_eval)
        if primary:
            heads_dir = export(tc, out_cfg, heads_p, backbone_p, run.bb, last_eval, out_dir,
                               tuned_layers=list(range(run.first, run.bb.cfg.num_layers)) if run.top else None)
    return TrainResult(out_cfg, heads_p, backbone_p, last_eval, step, heads_dir)


def train(tc: TrainConfig, resume: bool = True, stop_at_step: Optional[int] = None,
          backbone: Optional[Backbone] = None, progress: bool = True) -> TrainResult:
    """Train Medusa heads as `tc` says (see the module docstring); resumable.

    Args:
      tc: the training config.
      resume: continue from the latest checkpoint in ``out_dir/checkpoints`` when there is one
        (`check_resume` says which config changes are allowed; a larger ``steps`` continues a
        finished run, with a notice on stderr). A run already finished with the same settings
        trains and writes nothing: its export is returned with ``already_finished`` set (and a
        notice). False: start over (checkpoints and metrics.jsonl are deleted; the hidden-state
        cache stays).
      stop_at_step: return after this many steps without a final checkpoint or export (simulates
        an interruption; the next run resumes from the last checkpoint).
      backbone: a prebuilt `Backbone` (default `build_backbone(tc)`).
      progress: show tqdm progress bars.
    Returns: a `TrainResult`.
    Raises: ResumeConflictError (a ValueError: out_dir holds a run this config cannot continue,
      checked before anything is loaded or written), FileNotFoundError (model or data missing),
      ValueError (bad data, mismatched checkpoint or init_heads), TrainingDivergedError (a
      ValueError: the loss became NaN or infinite; nothing past the last checkpoint is written),
      BackboneDriftError (a ValueError, joint mode: the backbone drifted beyond max_kl; it is checkpointed,
      not exported).
    """
    check_run_inputs(tc, model=backbone is None)
    out_dir = os.path.abspath(tc.out_dir)
    ck_dir = os.path.join(out_dir, "checkpoints")
    if not resume:
        shutil.rmtree(ck_dir, ignore_errors=True)
    done = _finished_run(tc, out_dir, ck_dir)
    if done is not None:
        return done
    mesh = sharding.mesh_from_arg(tc.mesh)
    primary = jax.process_index() == 0  # the process that writes metrics and the export
    os.makedirs(out_dir, exist_ok=True)
    if primary:
        with open(os.path.join(out_dir, "train_config.json"), "w") as f:
            json.dump(tc.to_dict(), f, indent=2)
    run, params, opt_state = _setup_run(tc, backbone or build_backbone(tc), mesh, out_dir, progress)
    ck = Checkpointer(ck_dir, tc.keep_checkpoints)
    step = 0
    if resume and ck.latest_step() is not None:
        step, state, _ = ck.restore({"params": params, "opt_state": opt_state, "step": np.int64(0)})
        params, opt_state = jax.tree_util.tree_map(jnp.asarray, (state["params"], state["opt_state"]))
    else:  # copies: the steps donate their inputs, and bb.params must survive (teacher, export)
        params, opt_state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), (params, opt_state))
    metrics = MetricsLog(out_dir, step if step else -1, write=primary)  # from step 0: no earlier line is kept
    ref = run.bb.params if run.joint and (tc.base_loss == "kl" or run.top) else None
    if mesh is not None:  # Megatron-style on 'model' (`sharding.RULES`), optimizer states as their params
        params, opt_state, ref = sharding.shard_params((params, opt_state, ref), mesh)
        run.lm_train, run.emb = place_projections(run.lm_train, run.emb, mesh)
    end = min(tc.steps, stop_at_step if stop_at_step is not None else tc.steps)
    params, opt_state, step, last_eval = _train_steps(run, ck, metrics, params, opt_state, ref, step, end)
    metrics.plot()  # also for runs stopped early or without validation data
    return _finish(run, ck, params, opt_state, step, last_eval, out_dir, primary)


def check_drift(tc: TrainConfig, metrics: dict) -> None:
    """The export guard of joint training: raises `BackboneDriftError` when the validation KL
    (``metrics["val_kl"]``, nats per answer token) exceeds ``tc.max_kl``; warns when there is no
    validation data to measure it."""
    kl = metrics.get("val_kl")
    if kl is None:
        note("no validation chats (val_fraction 0): the backbone's drift from the original was not measured and "
             "the max_kl guard did not run")
        return
    if kl > tc.max_kl:
        raise BackboneDriftError(
            f"the trained backbone drifted from the original: validation KL(original || tuned) = {kl:.4g} nats/token "
            f"> max_kl = {tc.max_kl} (top-1 agreement {metrics.get('val_top1_agreement')}); nothing was exported. "
            f"Train again with a smaller learning_rate, a larger lambda_base or fewer train_layers (--no-resume), or "
            f"accept the drift with --set max_kl={kl * 1.01:.4g}: the finished run is then exported without training")
