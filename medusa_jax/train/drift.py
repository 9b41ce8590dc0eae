"""How far a tuned backbone drifts from the original: KL divergence, top-1 agreement and perplexity
on the answer tokens of chats (Medusa-2, Cai et al. 2024, Sec. 2.2.2 / 2.3.2).

Medusa-2 trains the backbone together with the heads; on self-distilled data (the original model's
own answers) the paper keeps the backbone's output distribution by training it with
``KL(original || tuned)`` (Sec. 2.3.2, self-distillation). `measure_drift` measures that quantity
and two plainer ones on held-out chats, for the trainer's validation and for ``medusa-quality``.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import LlamaModel
from medusa_jax.train import data as D
from medusa_jax.train.hidden import length_batches, padded_sequences, sequence_positions
from medusa_jax.train.losses import kl_to_teacher_sums, masked_ce_sums

Pair = Tuple[np.ndarray, np.ndarray]  # (ids [T] int32, loss_mask [T] bool)

#: Positions whose [V] logits are computed at once (per model): bounds the memory of the vocabulary
#: projection at 2 x LOGITS_CHUNK x V float32 (SmolLM2, V = 49,152: ~100 MB) whatever the batch.
LOGITS_CHUNK = 256


@functools.lru_cache(maxsize=4)
def drift_fn(cfg: ModelConfig, chunk: int = LOGITS_CHUNK):
    """The jitted per-batch sums of `measure_drift` (compiled once per [B, T] shape):

    ``fn(original_params, tuned_params, tokens [B, T] int32, targets [B, T] int32, valid [B, T] bool)``
    -> [5] float32: (sum of KL(original || tuned) in nats, positions where the two argmaxes agree,
    sum of -log p_original(target), sum of -log p_tuned(target), number of valid positions).

    Both backbones run without logits; the valid positions' final hidden states are then gathered
    (valid ones first) and projected to the vocabulary `chunk` positions at a time, only as many
    chunks as there are valid positions (a while loop), so [B, T, V] logits are never materialised
    and prompt and padding positions cost no vocabulary projection."""
    model = LlamaModel(cfg)

    def logits(params, h):
        return model.apply({"params": params}, h, method=LlamaModel.logits).astype(jnp.float32)

    @jax.jit
    def fn(original, tuned, tokens, targets, valid):
        pos = sequence_positions(tokens)
        ha = model.apply({"params": original}, tokens, pos, compute_logits=False)[1]
        hb = model.apply({"params": tuned}, tokens, pos, compute_logits=False)[1]
        n = tokens.shape[0] * tokens.shape[1]
        ha, hb = ha.reshape(n, -1), hb.reshape(n, -1)
        flat_valid, flat_targets = valid.reshape(n), targets.reshape(n)
        count = jnp.sum(flat_valid, dtype=jnp.int32)
        n_pad = -(-n // chunk) * chunk
        order = jnp.pad(jnp.argsort(~flat_valid, stable=True), (0, n_pad - n))  # valid positions first

        def body(state):
            i, sums = state
            idx = jax.lax.dynamic_slice(order, (i * chunk,), (chunk,))
            ok = i * chunk + jnp.arange(chunk) < count
            la, lb = logits(original, ha[idx]), logits(tuned, hb[idx])  # [chunk, V] float32 each
            tg = flat_targets[idx]
            agree = jnp.sum((jnp.argmax(la, -1) == jnp.argmax(lb, -1)) & ok, dtype=jnp.float32)
            ce = masked_ce_sums(jnp.stack([la, lb]), jnp.stack([tg, tg]), jnp.stack([ok, ok]))
            kl = kl_to_teacher_sums(lb, la, ok)  # teacher: the original model
            return i + 1, sums + jnp.stack([kl, agree, ce[0], ce[1]])

        _, sums = jax.lax.while_loop(lambda s: s[0] * chunk < count, body, (jnp.int32(0), jnp.zeros(4, jnp.float32)))
        return jnp.concatenate([sums, count.astype(jnp.float32)[None]])

    return fn


def _exp(x: float) -> float:
    return math.inf if x > 700 else math.exp(x)  # NaN stays NaN


def measure_drift(cfg: ModelConfig, original_params, tuned_params, examples: Sequence[Pair], max_len: int = 512,
                  batch_tokens: int = 4096, progress: bool = False) -> dict:
    """How far `tuned_params` drift from `original_params` on the answer tokens of `examples`.

    At every position t whose next token is an answer token (``loss_mask[t + 1]``, the
    `data.base_targets` of the trainer's backbone loss), both models' next-token distributions
    (float32 logits of ``LlamaModel(cfg)`` over the whole sequence, causal, no cache) are compared.

    Args:
      cfg: the `ModelConfig` of both backbones (same architecture and shapes).
      original_params, tuned_params: `LlamaModel` params trees (any compute dtype; logits float32).
      examples: (ids [T] int32, loss_mask [T] bool) pairs as `data.load_distilled` /
        `train.examples.load_examples` make them (loss_mask True on the answer tokens); sequences
        longer than `max_len` are cut to it.
      max_len: tokens per sequence at most.
      batch_tokens: tokens per batch: sequences sorted by length, padded to a multiple of
        `hidden.LENGTH_BUCKET`, as `hidden.compute_positions` batches them, but without empty
        rows: one compiled shape (`drift_fn`) per bucket for its full batches and one for its last;
        a fixed validation set measured again (the trainer's) compiles nothing more.
      progress: a tqdm bar (tokens) on stderr.
    Returns:
      a dict (floats, but ``positions`` and ``sequences`` ints):
        ``kl``: mean over the positions of ``KL(original || tuned) = sum_v p_o (log p_o - log p_t)``
          in nats/token, the self-distillation loss of Medusa Sec. 2.3.2 (0 for identical models);
        ``top1_agreement``: share of the positions where both models' argmax tokens agree;
        ``nll_original``, ``nll_tuned``: mean negative log-likelihood of the data's next token in
          nats/token (on self-distilled data: of the original model's own answers);
        ``ppl_original``, ``ppl_tuned``: exp of those; ``ppl_ratio``: ppl_tuned / ppl_original;
        ``positions``: the number of positions (answer-token targets within `max_len`);
        ``sequences``: ``len(examples)``.
      With no position, the means are NaN and ``positions`` is 0.
    """
    fn = drift_fn(cfg)
    sums = np.zeros(5, np.float64)
    bar = tqdm(total=sum(min(len(i), max_len) for i, _ in examples), desc="drift", unit="tok", leave=False,
               disable=not progress)
    for _, _, group in length_batches(examples, max_len, batch_tokens):
        tokens, mask = padded_sequences([examples[j] for j in group], len(group), max_len)
        targets, valid = D.base_targets(tokens, mask)
        if valid.any():
            sums += np.asarray(fn(original_params, tuned_params, jnp.asarray(tokens), jnp.asarray(targets),
                                  jnp.asarray(valid)), np.float64)
        bar.update(sum(min(len(examples[j][0]), max_len) for j in group))
    bar.close()
    kl, agree, nll_o, nll_t, n = sums
    mean = (lambda s: float(s / n)) if n else (lambda s: math.nan)
    nll_o, nll_t = mean(nll_o), mean(nll_t)
    ppl_o, ppl_t = _exp(nll_o), _exp(nll_t)
    return {"kl": mean(kl), "top1_agreement": mean(agree),
            "nll_original": nll_o, "nll_tuned": nll_t, "ppl_original": ppl_o, "ppl_tuned": ppl_t,
            "ppl_ratio": _exp(nll_t - nll_o), "positions": int(n), "sequences": len(examples)}
