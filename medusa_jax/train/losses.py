"""Training losses and accuracies for Medusa heads (Cai et al. 2024, "Medusa", Sec. 2.2).

Medusa-1 (frozen backbone, Sec. 2.2.1) minimises ``sum_k lambda_k * L_k`` where ``L_k`` is the
cross-entropy of head k (0-based here; it predicts token t+k+2 from the hidden state at t) and
``lambda_k = decay**k`` (the paper's 0.8^k, counted from the first head). Medusa-2 (joint training,
Sec. 2.2.2) adds ``lambda_0 * L_base``, the backbone's own next-token loss, either a cross-entropy
on the labels or, for self-distilled data (Sec. 2.3.2), the KL divergence from the original frozen
model's distribution to the trained one.

Every per-head quantity is a masked mean over the positions where that head has a valid label; a
head with no valid label in a batch contributes exactly 0 (never NaN): the sums are divided by
``max(count, 1)``.

`shared_head_loss` is the fast path when the heads end in the base model's frozen, shared lm_head
(`MedusaConfig.shared_lm_head`): it streams over chunks of positions, never stores the [K, N, V]
logits, and computes the gradient with respect to the head states, ``(softmax - onehot) @ W^T``, in
the same pass (a `jax.custom_vjp`), so a training step costs two [*, D] x [D, V] matmuls per head
and position and memory is bounded by the chunk size.

Soft targets (``loss_targets: soft``): instead of the data's token t+k+2, head k learns the
backbone's own distribution over that token, ``softmax(h_{t+k+1} @ lm_head / T)``, from the cached
hidden state at t+k+1 (no extra backbone pass): `shared_head_loss` with ``teacher``, `heads_kl`.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

#: Ranks counted by the accuracy histograms (``rank_counts``): the label's rank among the logits,
#: 0 = top-1, counted when below NUM_RANKS (10, the default Medusa top-k). A label's rank is the
#: number of logits strictly greater than the label's logit, so ties count in its favour.
NUM_RANKS = 10
#: The accuracies reported in the metrics: top-1 and top-5.
TOPK: Tuple[int, ...] = (1, 5)


def head_weights(num_heads: int, decay: float = 0.8) -> np.ndarray:
    """Per-head loss weights ``lambda_k = decay**k`` (Medusa Sec. 2.2.1), float32 [K]."""
    return (float(decay) ** np.arange(num_heads)).astype(np.float32)


def safe_mean(total: jax.Array, count: jax.Array) -> jax.Array:
    """``total / count`` where count > 0, else 0 (a head with no valid label adds nothing)."""
    count = count.astype(jnp.float32)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def _label_rank(logits: jax.Array, label_logit: jax.Array) -> jax.Array:
    """How many logits exceed the label's: [..., V], [...] -> [...] int32 (0 = top-1). A NaN label
    logit (diverged heads) gets the largest int32, past every rank histogram, rather than 0 (no
    comparison with NaN is true)."""
    rank = jnp.sum(logits > label_logit[..., None], axis=-1, dtype=jnp.int32)
    return jnp.where(jnp.isnan(label_logit), jnp.int32(np.iinfo(np.int32).max), rank)


def _rank_hist(rank: jax.Array, valid: jax.Array) -> jax.Array:
    """[K, ...] ranks and valid -> [K, NUM_RANKS] float32 counts of valid positions per rank."""
    axes = tuple(range(1, rank.ndim))
    return jnp.stack([jnp.sum((rank == r) & valid, axis=axes, dtype=jnp.float32)
                      for r in range(NUM_RANKS)], axis=-1)


def rank_counts(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Histogram of the label's rank among each head's logits (ranks < NUM_RANKS).

    Args:
      logits: [K, ..., V] float.
      labels: [K, ...] int32 (any value where not valid).
      valid: [K, ...] bool.
    Returns:
      [K, NUM_RANKS] float32: entry [k, r] counts valid positions where head k ranks the label r-th.
      Divided by the valid counts this is the ``head_accuracies`` table of
      `medusa_jax.decoding.tree_estimates.greedy_tree_search`; its cumulative sum gives top-k accuracies
      (`topk_from_ranks`).
    """
    labels = jnp.clip(labels, 0, logits.shape[-1] - 1)
    lab = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return _rank_hist(_label_rank(logits, lab), valid)


def topk_from_ranks(ranks: np.ndarray, counts: np.ndarray, ks: Sequence[int] = TOPK) -> np.ndarray:
    """Top-k accuracies from rank histograms: [K, NUM_RANKS], [K] -> [len(ks), K] float64.

    A head without a valid position gets accuracy 0.
    """
    ranks, counts = np.asarray(ranks, np.float64), np.asarray(counts, np.float64)
    cum = np.cumsum(ranks, axis=-1)
    return np.stack([cum[:, k - 1] / np.maximum(counts, 1.0) for k in ks])


def masked_ce_sums(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Summed cross-entropy over valid positions, per leading index.

    Args:
      logits: [K, ..., V] float (any float dtype; computed in float32).
      labels: [K, ...] int32; entries where not valid are ignored (any value, even out of range).
      valid: [K, ...] bool.
    Returns:
      [K] float32 sums of ``-log softmax(logits)[label]`` over the valid positions (0 where none).
    """
    logits = logits.astype(jnp.float32)
    labels = jnp.clip(labels, 0, logits.shape[-1] - 1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    lab = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    ce = jnp.where(valid, lse - lab, 0.0)
    return jnp.sum(ce, axis=tuple(range(1, ce.ndim)))


def heads_ce(logits: jax.Array, labels: jax.Array, valid: jax.Array):
    """Per-head mean cross-entropy and top-1/top-5 counts from full logits (autodiff path).

    Args:
      logits: [K, ..., V]; labels: [K, ...] int32; valid: [K, ...] bool.
    Returns:
      (loss [K] float32 masked means, 0 for a head without a valid label;
       counts [K] float32 valid positions per head;
       ranks [K, NUM_RANKS] float32 label-rank histogram (`rank_counts`), no gradient).
    """
    counts = jnp.sum(valid, axis=tuple(range(1, valid.ndim)), dtype=jnp.float32)
    loss = safe_mean(masked_ce_sums(logits, labels, valid), counts)
    return loss, counts, jax.lax.stop_gradient(rank_counts(logits, labels, valid))


def _pad_chunks(x: jax.Array, n_pad: int, chunk: int) -> jax.Array:
    """[K, N, ...] -> [N_chunks, K, chunk, ...] (zero padded)."""
    K, N = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, n_pad - N)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((K, n_pad // chunk, chunk) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _shared_chunk(x, w, lab, ok, t, temperature):
    """One chunk: x [K, c, D], w [D, V], lab [K, c], ok [K, c], t None or teacher states [K, c, D]
    -> (loss_sum [K], ranks [K, R], dx [K, c, D]). Hard labels: cross-entropy; teacher: KL divergence
    from ``softmax(t @ w / temperature)``."""
    logits = jnp.einsum("kcd,dv->kcv", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = m[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1))
    lab_logit = jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
    okf = ok.astype(jnp.float32)
    correct = _rank_hist(_label_rank(logits, lab_logit), ok)
    q = jnp.exp(logits - lse[..., None])
    if t is None:
        loss_sum = jnp.sum((lse - lab_logit) * okf, axis=1)
        # d ce / d x = (softmax - onehot) @ W^T; the onehot part is the label's column of W.
        dx = jnp.einsum("kcv,dv->kcd", (q * okf[..., None]).astype(w.dtype), w, preferred_element_type=jnp.float32)
        dx = dx - jnp.moveaxis(jnp.take(w, lab, axis=1), 0, -1).astype(jnp.float32) * okf[..., None]
    else:
        tlogp = jax.nn.log_softmax(jnp.einsum("kcd,dv->kcv", t.astype(w.dtype), w,
                                              preferred_element_type=jnp.float32) / temperature, axis=-1)
        p = jnp.exp(tlogp)
        # both sides' log-probabilities the same way, so that an identical teacher gives exactly 0
        kl = kl_divergence(tlogp, jax.nn.log_softmax(logits, axis=-1))
        loss_sum = jnp.sum(kl * okf, axis=1)
        # d KL(p || softmax(z)) / d z = softmax(z) - p
        dx = jnp.einsum("kcv,dv->kcd", ((q - p) * okf[..., None]).astype(w.dtype), w,
                        preferred_element_type=jnp.float32)
    return loss_sum, correct, dx.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _shared_ce(states, lm_head, labels, valid, teacher, chunk, with_grad, temperature):
    out = _shared_fwd(states, lm_head, labels, valid, teacher, chunk, with_grad, temperature)[0]
    return out


def _shared_fwd(states, lm_head, labels, valid, teacher, chunk, with_grad, temperature):
    K, N, D = states.shape
    labels = jnp.clip(labels, 0, lm_head.shape[1] - 1)
    c = max(1, min(chunk, N)) if chunk else N
    n_pad = -(-N // c) * c
    xs = (_pad_chunks(states, n_pad, c), _pad_chunks(labels, n_pad, c), _pad_chunks(valid, n_pad, c),
          None if teacher is None else _pad_chunks(teacher, n_pad, c))

    def body(args):
        x, lab, ok, t = args
        loss, cor, dx = _shared_chunk(x, lm_head, lab, ok, t, temperature)
        return loss, cor, (dx if with_grad else jnp.zeros((), x.dtype))

    loss, cor, dx = jax.lax.map(body, xs)
    if with_grad:
        dx = jnp.moveaxis(dx, 0, 1).reshape(K, n_pad, D)[:, :N]
    return (jnp.sum(loss, 0), jnp.sum(cor, 0)), dx


def _shared_bwd(chunk, with_grad, temperature, dx, g):
    g_loss = g[0]
    if not with_grad:
        raise ValueError("shared_head_loss(..., with_grad=False) cannot be differentiated")
    return (dx * g_loss[:, None, None].astype(dx.dtype), None, None, None, None)


_shared_ce.defvjp(_shared_fwd, _shared_bwd)


def shared_head_loss(states: jax.Array, lm_head: jax.Array, labels: jax.Array, valid: jax.Array,
                     chunk: int = 0, with_grad: bool = True, teacher: Optional[jax.Array] = None,
                     temperature: float = 1.0):
    """Per-head loss through a shared, frozen lm_head, chunked, with a fused gradient: cross-entropy
    on hard labels, or with `teacher` the KL divergence from the backbone's own distribution (soft
    targets).

    The projection is ``logits_k = states_k @ lm_head``; the lm_head gets no gradient (it is the
    frozen base lm_head; in joint training it is updated only by the backbone loss), so the
    backward needs only ``dlogits @ lm_head^T``, which is computed chunk by chunk during the
    forward pass and kept ([K, N, D], small), not the [K, N, V] logits.

    Soft targets (`teacher` given): head k at position t learns ``p = softmax(teacher_k @ lm_head / T)``,
    where ``teacher_k`` is the backbone's hidden state at t+k+1, i.e. the base model's own
    distribution over token t+k+2, computed from the cached hidden states with no extra backbone
    pass; the loss is ``KL(p || softmax(states_k @ lm_head))`` (the same gradient as the
    cross-entropy against p; 0 when the head matches the backbone). This is the teacher-distillation
    objective of Hydra++ (Ankner et al. 2024; reference code ``hydra/train/train.py``, which uses
    T = 1). The labels then only feed the rank histogram.

    Args:
      states: [K, N, D] float, each head's state before its projection (`MedusaHeads.head_states`).
      lm_head: [D, V] float, the base lm_head (`lm_head_matrix`); treated as a constant. Its dtype
        is the matmul dtype: bfloat16 (inputs rounded to bfloat16, float32 accumulation, softmax and
        loss in float32) made this loss with its gradient 1.46x faster at K=4, N=256, D=576,
        V=49,152 on the project's 2-core AVX512-BF16 CPU (docs/performance.md, 2026-11-29).
      labels: [K, N] int32 targets (any value where not valid).
      valid: [K, N] bool.
      chunk: positions per chunk (0: all at once). Memory is about 3 * K * chunk * V floats (hard
        labels), 5 * K * chunk * V with a teacher.
      with_grad: compute the gradient in the forward pass (False for evaluation: about half the
        cost; the result then cannot be differentiated).
      teacher: None (hard labels) or [K, N, D] float, the backbone's hidden states whose projection
        is each head's target distribution (no gradient).
      temperature: T > 0 of the target distribution (soft targets only; T > 1 flattens it).
    Returns:
      (loss [K] float32 masked mean CE (or KL) per head, 0 for a head without a valid label;
       counts [K] float32 valid positions per head;
       ranks [K, NUM_RANKS] float32 label-rank histogram (`rank_counts`), no gradient).
    Raises:
      ValueError: shapes that do not agree (at trace time), a temperature <= 0, or differentiating
        with_grad=False.
    """
    if states.ndim != 3 or labels.shape != states.shape[:2] or valid.shape != labels.shape:
        raise ValueError(f"states [K, N, D], labels and valid [K, N] expected, got {states.shape}, "
                         f"{labels.shape}, {valid.shape}")
    if lm_head.shape[0] != states.shape[-1]:
        raise ValueError(f"lm_head {lm_head.shape} is not [D, V] for states of size D={states.shape[-1]}")
    if teacher is not None and teacher.shape != states.shape:
        raise ValueError(f"teacher {teacher.shape} must be [K, N, D] like the states {states.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher is not None:
        teacher = jax.lax.stop_gradient(teacher)
    loss_sum, correct = _shared_ce(states, jax.lax.stop_gradient(lm_head), labels.astype(jnp.int32),
                                   valid.astype(bool), teacher, int(chunk), bool(with_grad), float(temperature))
    counts = jnp.sum(valid, axis=1, dtype=jnp.float32)
    return safe_mean(loss_sum, counts), counts, jax.lax.stop_gradient(correct)


def kl_divergence(teacher_logp: jax.Array, student_logp: jax.Array) -> jax.Array:
    """``KL(p || q) = sum_v p (log p - log q)`` over the last axis from log-probabilities [..., V]
    float32 (``log_softmax`` of each side, computed the same way), clamped at 0: the divergence is
    never negative, and round-off near 0 (two distributions equal up to the last bit) must not make
    it so. Returns [...] float32."""
    p = jnp.exp(teacher_logp)
    kl = jnp.sum(jnp.where(p > 0, p * (teacher_logp - student_logp), 0.0), axis=-1)
    return jnp.maximum(kl, 0.0)


def heads_kl(logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array, valid: jax.Array,
             temperature: float = 1.0):
    """Per-head mean ``KL(softmax(teacher_logits / T) || softmax(logits))`` from full logits (the
    autodiff path of soft targets, for heads with their own lm_heads; see `shared_head_loss`).

    Args:
      logits: [K, N, V] the heads' logits; teacher_logits: [K, N, V] the backbone's logits at
        t+k+1 (no gradient); labels [K, N] int32 (for the rank histogram only); valid [K, N] bool.
      temperature: T > 0 of the target distribution.
    Returns:
      (loss [K] float32 masked means, counts [K] float32, ranks [K, NUM_RANKS] float32, no gradient).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature, axis=-1)
    kl = kl_divergence(t, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    counts = jnp.sum(valid, axis=tuple(range(1, valid.ndim)), dtype=jnp.float32)
    loss = safe_mean(jnp.sum(jnp.where(valid, kl, 0.0), axis=tuple(range(1, kl.ndim))), counts)
    return loss, counts, jax.lax.stop_gradient(rank_counts(logits, labels, valid))


def kl_to_teacher_sums(student_logits: jax.Array, teacher_logits: jax.Array, valid: jax.Array) -> jax.Array:
    """Summed ``KL(teacher || student)`` over valid positions (Medusa Sec. 2.3.2, self-distillation).

    Args:
      student_logits, teacher_logits: [..., V] float (teacher gets no gradient).
      valid: [...] bool.
    Returns:
      scalar float32 sum over valid positions of ``sum_v p_t (log p_t - log p_s)``.
    """
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    kl = kl_divergence(t, jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1))
    return jnp.sum(jnp.where(valid, kl, 0.0))


def total_heads_loss(per_head: jax.Array, decay: float) -> jax.Array:
    """``sum_k decay**k * per_head[k]`` (Medusa Sec. 2.2.1). per_head: [K] float32 -> scalar."""
    return jnp.sum(jnp.asarray(head_weights(per_head.shape[0], decay)) * per_head)
