"""The jitted training steps (frozen: heads on cached positions; joint: backbone and heads on
sequences), their placement on a mesh, and validation."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from medusa_jax import sharding
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import teacher_forced_states, token_embeddings
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import LlamaModel, lm_head_matrix
from medusa_jax.train import data as D
from medusa_jax.train.config import TrainConfig
from medusa_jax.train.hidden import sequence_positions
from medusa_jax.train.losses import (
    NUM_RANKS,
    heads_ce,
    heads_kl,
    kl_to_teacher_sums,
    masked_ce_sums,
    safe_mean,
    shared_head_loss,
    topk_from_ranks,
    total_heads_loss,
)
from medusa_jax.train.optim import clip_grads


def heads_loss(hcfg: MedusaConfig, tc: TrainConfig, hp, lm, emb, batch: dict, with_grad=True):
    """A batch of positions (`data.positions_batch`: hidden [N, D], labels/valid/path_tokens [K, N],
    teacher [K, N, D] for soft targets) -> (weighted loss, (per-head loss [K], counts [K], ranks [K, R])).

    Medusa heads read h_t; hydra heads also the embeddings (`emb` [V, D]) of the true tokens
    t+1..t+k+1 (teacher forcing, Ankner et al. 2024, Sec. 3). Hard targets: cross-entropy on the
    labels; soft: KL divergence from the backbone's distribution ``softmax(teacher_k @ lm / T)``.
    """
    hidden, lab, ok = batch["hidden"], batch["labels"], batch["valid"]
    if hcfg.head_type == "hydra":
        path = jnp.take(emb, jnp.transpose(batch["path_tokens"]), axis=0)      # [N, K, D]
        states = teacher_forced_states(hcfg, hp, hidden, path)
    else:
        states = MedusaHeads(hcfg).apply({"params": hp}, hidden, method=MedusaHeads.head_states)
    dt = jnp.dtype(tc.head_matmul_dtype)
    teacher = batch.get("teacher")
    if hcfg.shared_lm_head:
        per, cnt, ranks = shared_head_loss(states, lm.astype(dt), lab, ok, tc.loss_chunk, with_grad,
                                           teacher=teacher, temperature=tc.soft_temperature)
    else:
        logits = jnp.einsum("knd,kdv->knv", states.astype(dt), hp["lm_head"].astype(dt),
                            preferred_element_type=jnp.float32)
        if teacher is None:
            per, cnt, ranks = heads_ce(logits, lab, ok)
        else:
            t_logits = jnp.einsum("knd,dv->knv", teacher.astype(dt), lm.astype(dt), preferred_element_type=jnp.float32)
            per, cnt, ranks = heads_kl(logits, t_logits, lab, ok, tc.soft_temperature)
    return total_heads_loss(per, tc.loss_decay), (per, cnt, ranks)


def make_frozen_step(hcfg: MedusaConfig, tc: TrainConfig, opt):
    """Jitted ``(heads, opt_state, lm [D, V], emb [V, D], batch) -> (heads, opt_state, stats)`` with
    `batch` from `data.positions_batch`; only the heads are differentiated."""
    def step(hp, opt_state, lm, emb, batch):
        (loss, (per, cnt, ranks)), g = jax.value_and_grad(
            lambda p: heads_loss(hcfg, tc, p, lm, emb, batch), has_aux=True)(hp)
        g, gnorm = clip_grads(g, tc.grad_clip)
        upd, opt_state = opt.update(g, opt_state, hp)
        return optax.apply_updates(hp, upd), opt_state, dict(loss=loss, head_loss=per, counts=cnt, ranks=ranks,
                                                              grad_norm=gnorm)
    return jax.jit(step, donate_argnums=(0, 1))


def sequence_batch(hidden, tokens, lab, ok, K: int, soft: bool) -> dict:
    """A joint-mode batch in the frozen layout: hidden [B, T, D], tokens [B, T], lab/ok [K, B, T] ->
    `data.positions_batch`'s dict over the B*T positions (teacher: h_{t+k+1}, no gradient)."""
    B, T, Dm = hidden.shape
    path = jnp.stack([jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1))) for k in range(K)])   # [K, B, T]
    batch = {"hidden": hidden.reshape(B * T, Dm), "labels": lab.reshape(K, B * T), "valid": ok.reshape(K, B * T),
             "path_tokens": path.reshape(K, B * T)}
    if soft:
        h = jax.lax.stop_gradient(hidden)
        batch["teacher"] = jnp.stack([jnp.pad(h[:, k + 1:], ((0, 0), (0, k + 1), (0, 0)))
                                      for k in range(K)]).reshape(K, B * T, Dm)
    return batch


def make_joint_step(mcfg: ModelConfig, hcfg: MedusaConfig, tc: TrainConfig, opts, train_backbone: bool,
                    first_layer: Optional[int] = None):
    """Jitted joint step (Medusa-2) ``(params {"backbone", "heads"}, opt_state, ref, inputs, tokens
    [B, T], lab/ok [K, B, T], base_lab/base_ok [B, T], lm [D, V'], emb [V, D]) -> (params, opt_state,
    stats)``.

    first_layer None: the whole backbone trains; ``params["backbone"]`` is a full `LlamaModel` tree,
    `inputs` the tokens, `ref` the original params (the KL teacher; None with base_loss "ce"), and
    lm / emb are None (the heads read the trained backbone's).
    first_layer n (``train_layers = L - n``): ``params["backbone"]`` holds ``layers_n ..
    layers_{L-1}`` only, `inputs` is the residual stream entering layer n [B, T, D]
    (`layer_cache.LayerInputs`), `ref` the original full params (the rest of the model and the
    teacher's layers), lm the frozen lm_head as the heads read it (proposal columns, cast to
    head_matmul_dtype) and emb the frozen embeddings.
    With train_backbone False only the heads train (their warm-up); the backbone's optimizer state
    is left untouched. Loss: the heads' (`heads_loss`) + lambda_base * the backbone's (CE on the
    data's next tokens, or KL(original || trained) per answer token, Medusa Sec. 2.2.2 / 2.3.2).
    """
    model, K, top = LlamaModel(mcfg), hcfg.num_heads, first_layer is not None

    def forward(bb, ref, inputs, compute_logits):
        pos = sequence_positions(inputs[..., 0] if top else inputs)
        if not top:
            return model.apply({"params": bb}, inputs, pos, compute_logits=compute_logits)[:2]
        return model.apply({"params": {**ref, **bb}}, inputs, pos, first_layer, compute_logits=compute_logits,
                           method=LlamaModel.top_layers)

    def loss_fn(params, ref, inputs, tokens, lab, ok, blab, bok, lm, emb):
        bb = params["backbone"] if train_backbone else jax.lax.stop_gradient(params["backbone"])
        logits, hidden = forward(bb, ref, inputs, train_backbone)
        batch = sequence_batch(hidden, tokens, lab, ok, K, tc.loss_targets == "soft")
        if not top:
            lm, emb = lm_head_matrix(mcfg, bb), jax.lax.stop_gradient(token_embeddings(bb))
        loss, (per, cnt, ranks) = heads_loss(hcfg, tc, params["heads"], lm, emb, batch)
        base = jnp.zeros((), jnp.float32)
        if train_backbone:
            n = jnp.sum(bok, dtype=jnp.float32)
            if tc.base_loss == "kl":
                teacher = forward({} if top else ref, ref, inputs, True)[0]
                base = safe_mean(kl_to_teacher_sums(logits, jax.lax.stop_gradient(teacher), bok), n)
            else:
                base = safe_mean(masked_ce_sums(logits[None], blab[None], bok[None])[0], n)
            loss = loss + tc.lambda_base * base
        return loss, (per, cnt, ranks, base)

    def step(params, opt_state, ref, inputs, tokens, lab, ok, blab, bok, lm=None, emb=None):
        (loss, (per, cnt, ranks, base)), g = jax.value_and_grad(loss_fn, has_aux=True)(
            params, ref, inputs, tokens, lab, ok, blab, bok, lm, emb)
        if not train_backbone:
            g = {"heads": g["heads"]}
        g, gnorm = clip_grads(g, tc.grad_clip)
        new_params, new_state = dict(params), dict(opt_state)
        for name in g:
            upd, new_state[name] = opts[name].update(g[name], opt_state[name], params[name])
            new_params[name] = optax.apply_updates(params[name], upd)
        return new_params, new_state, dict(loss=loss, head_loss=per, counts=cnt, ranks=ranks, grad_norm=gnorm,
                                           base_loss=base)
    return jax.jit(step, donate_argnums=(0, 1))


def place_frozen_batch(batch: dict, mesh) -> dict:
    """A frozen-mode batch (`data.positions_batch`) on `mesh`, its N positions split on 'data':
    hidden [N, D] along axis 0; labels / valid / path_tokens [K, N] and teacher [K, N, D] along
    axis 1 (`sharding.put`: every process passes the same whole batch). Unchanged without a mesh."""
    if mesh is None:
        return batch
    return {k: sharding.put(v, mesh, sharding.batch_spec(v.ndim, 0 if k == "hidden" else 1)) for k, v in batch.items()}


def place_joint_batch(inputs, tokens, lab, ok, blab, bok, mesh) -> tuple:
    """A joint-mode batch on `mesh`, its B sequences split on 'data': inputs ([B, T] tokens or the
    cached [B, T, D] layer inputs), tokens, blab, bok [B, T] along axis 0, lab / ok [K, B, T] along
    axis 1. Unchanged without a mesh."""
    if mesh is None:
        return inputs, tokens, lab, ok, blab, bok
    put = lambda x, axis: sharding.put(x, mesh, sharding.batch_spec(np.ndim(x), axis))
    return put(inputs, 0), put(tokens, 0), put(lab, 1), put(ok, 1), put(blab, 0), put(bok, 0)


def place_projections(lm, emb, mesh) -> tuple:
    """The frozen steps' constants on `mesh` as the backbone's own: lm [D, V] split like
    ``lm_head/kernel``, emb [V, D] like ``embed/embedding`` (`sharding.RULES`). Unchanged without
    a mesh."""
    if mesh is None:
        return lm, emb
    return (sharding.put(lm, mesh, sharding.spec_for("lm_head/kernel", lm.shape, mesh)),
            sharding.put(emb, mesh, sharding.spec_for("embed/embedding", emb.shape, mesh)))


def to_host(tree):
    """Every array of `tree` as numpy, gathered from all processes when it is split across them."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree_util.tree_map(np.asarray, tree)


def _summary(per_sum, counts, ranks, misses=0) -> dict:
    """Validation figures; `misses` [K]: positions left out of the loss that count as misses
    (labels outside the proposal vocabulary)."""
    counts = np.asarray(counts, np.float64)
    total = counts + misses
    acc = topk_from_ranks(ranks, total)
    return {"val_loss": (np.asarray(per_sum) / np.maximum(counts, 1)).round(5).tolist(),
            "val_top1": acc[0].round(5).tolist(), "val_top5": acc[1].round(5).tolist(),
            "val_positions": total.astype(int).tolist(),
            "val_rank_acc": (np.asarray(ranks) / np.maximum(total, 1)[:, None]).round(5).tolist()}


def restrict_batch(batch: dict, remap: Optional[np.ndarray]) -> Tuple[dict, np.ndarray]:
    """A `data.positions_batch` dict with its labels as indices into the proposal vocabulary.

    Args:
      remap: [V] int: index of each token id in the proposal vocabulary, -1 outside it; None: the
        whole vocabulary (the batch is returned as is).
    Returns:
      (batch with labels [K, B] mapped and valid [K, B] False where the label is outside,
       misses [K] int: the valid labels outside).
    """
    if remap is None:
        return batch, np.zeros(batch["labels"].shape[0], np.int64)
    lab = remap[batch["labels"]]
    outside = batch["valid"] & (lab < 0)
    return ({**batch, "labels": np.maximum(lab, 0).astype(np.int32), "valid": batch["valid"] & (lab >= 0)},
            outside.sum(axis=1))


@functools.lru_cache(maxsize=8)
def _eval_fn(hcfg: MedusaConfig, tc: TrainConfig):
    return jax.jit(lambda hp, lm, emb, batch: heads_loss(hcfg, tc, hp, lm, emb, batch, with_grad=False)[1])


def evaluate_positions(hcfg, tc, heads_params, lm, emb, pos: D.Positions, remap: Optional[np.ndarray] = None
                       ) -> dict:
    """Per-head validation loss, top-1/top-5 and rank accuracies on flat positions (batches of
    batch_size, the last one padded with invalid rows). emb: the backbone's input embeddings [V, D]
    (read by hydra heads). The loss is the training one (CE, or KL with soft targets); the
    accuracies count the data's tokens either way. With a proposal vocabulary (`lm` [D, N] its
    columns, `remap` as in `restrict_batch`) the ranks are within it and a label outside it is a miss."""
    K, R = hcfg.num_heads, NUM_RANKS
    tot, cnt, ranks, misses = np.zeros(K), np.zeros(K), np.zeros((K, R)), np.zeros(K)
    B, fn = tc.batch_size, _eval_fn(hcfg, tc)
    for batch in D.position_batches(pos, B, soft=tc.loss_targets == "soft"):
        batch, miss = restrict_batch(batch, remap)
        per, c, r = (np.asarray(x, np.float64) for x in fn(heads_params, lm, emb, batch))
        tot, cnt, ranks, misses = tot + per * c, cnt + c, ranks + r, misses + miss
    return _summary(tot, cnt, ranks, misses)


def restrict_labels(lab, ok, remap: Optional[np.ndarray]):
    """lab / ok [K, B, T] as indices into the proposal vocabulary (`remap` [V] int, -1 outside;
    None: unchanged): labels outside it leave the loss."""
    if remap is None:
        return lab, ok
    mapped = remap[np.asarray(lab)]
    return np.maximum(mapped, 0).astype(np.int32), np.asarray(ok) & (mapped >= 0)
