"""The optimizer: Optax AdamW with linear warm-up then cosine decay, and global-norm clipping."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from medusa_jax.train.config import TrainConfig


def schedule(tc: TrainConfig, peak: float, steps: int):
    warm = min(tc.warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), peak * tc.min_lr_ratio)


def _decay_mask(params):
    def keep(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not ("bias" in name or "scale" in name)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tc: TrainConfig, peak: float, steps: int) -> optax.GradientTransformation:
    """AdamW with linear warm-up to `peak` then cosine decay over `steps` (clipping is done outside,
    over every trained parameter together)."""
    return optax.adamw(schedule(tc, peak, steps), tc.adam_b1, tc.adam_b2, tc.adam_eps,
                       weight_decay=tc.weight_decay, mask=_decay_mask)


def clip_grads(grads, max_norm: float):
    norm = optax.global_norm(grads)
    if max_norm > 0:
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    return grads, norm
