"""One training step of tiny Medusa heads, on one device or on a mesh, for tests/mesh/test_sharding.py.

`one_step(mode, mesh)` runs `trainer.make_frozen_step` or `make_joint_step` once from fixed,
seeded inputs, with the inputs placed as `trainer.train` places them, and returns the loss and
the updated params as numpy.

Run as a script it is one process of a multi-process run (`medusa_jax.distributed`)::

    python tests/mesh/dp_step.py --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I --out F.npz

Every process takes part in the data-parallel step on a (processes x 1) mesh; process 0 writes
the losses and params of a frozen and a joint step to F.npz.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
# 8 query / 4 KV heads so that a model axis of 2 or 4 divides them
OVERRIDES = ("random_num_heads=8", "random_num_kv_heads=4", "batch_size=8", "max_seq_len=32", "warmup_steps=0",
             "learning_rate=1e-2", "adam_eps=1e-3")


def one_step(mode: str, mesh=None) -> dict:
    """{"loss": float, "params": {...numpy...}} after one `mode` ("frozen" or "joint") step."""
    import jax
    import jax.numpy as jnp

    from medusa_jax import sharding
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.models.llama import lm_head_matrix
    from medusa_jax.train import data as D
    from medusa_jax.train import hidden, optim, steps, trainer
    from medusa_jax.train.config import TrainConfig

    tc = TrainConfig.from_yaml(CONFIG, OVERRIDES + (f"mode={mode}",))
    bb = hidden.build_backbone(tc)
    cfg, K = bb.cfg, tc.num_heads
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=K,
                        num_layers=tc.num_layers, shared_lm_head=True)
    lm = jnp.asarray(lm_head_matrix(cfg, bb.params))
    heads = trainer.initial_heads(tc, hcfg, cfg, lm)
    # non-zero blocks, so that the step's gradients reach every head param
    heads = {k: v + 0.05 * jax.random.normal(jax.random.PRNGKey(i), v.shape) for i, (k, v) in enumerate(sorted(heads.items()))}
    rng = np.random.default_rng(0)
    if mode == "frozen":
        N = 16
        opt = optim.make_optimizer(tc, tc.learning_rate, tc.steps)
        params, state = heads, opt.init(heads)
        batch = {"hidden": rng.normal(size=(N, cfg.hidden_size)).astype(np.float32),
                 "labels": rng.integers(0, cfg.vocab_size, size=(K, N)).astype(np.int32),
                 "valid": rng.random((K, N)) < 0.9,
                 "path_tokens": rng.integers(0, cfg.vocab_size, size=(K, N)).astype(np.int32)}
        emb = jnp.asarray(token_embeddings(bb.params))
        params, state = sharding.shard_params((params, state), mesh)
        lm, emb = steps.place_projections(lm, emb, mesh)
        step = steps.make_frozen_step(hcfg, tc, opt)
        params, state, st = step(params, state, lm, emb, steps.place_frozen_batch(batch, mesh))
    else:
        opts = {"heads": optim.make_optimizer(tc, tc.learning_rate, tc.steps),
                "backbone": optim.make_optimizer(tc, tc.learning_rate, tc.steps)}
        params = {"heads": heads, "backbone": bb.params}
        state = {k: opts[k].init(params[k]) for k in opts}
        tokens = rng.integers(0, cfg.vocab_size, size=(8, 32)).astype(np.int32)
        mask = np.ones_like(tokens, bool)
        mask[:, :4] = False
        params, state = sharding.shard_params((params, state), mesh)
        step = steps.make_joint_step(cfg, hcfg, tc, opts, True)
        params, state, st = step(params, state, None, *steps.place_joint_batch(
            tokens, tokens, *D.head_targets(tokens, mask, K), *D.base_targets(tokens, mask), mesh))
    return {"loss": float(np.asarray(st["loss"])), "params": steps.to_host(params)}


def flat(tree, prefix: str = "") -> dict:
    """{"a/b/c": array} of a nested dict of arrays."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from medusa_jax import distributed, sharding

    distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    import jax

    assert jax.process_count() == a.num_processes, jax.process_count()
    mesh = sharding.make_mesh(jax.device_count(), 1)
    out = {}
    for mode in ("frozen", "joint"):
        r = one_step(mode, mesh)
        out[f"{mode}/loss"] = np.float64(r["loss"])
        out.update({f"{mode}/params/{k}": v for k, v in flat(r["params"]).items()})
    if jax.process_index() == 0:
        np.savez(a.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
