"""Training: losses, config, frozen (Medusa-1) and joint (Medusa-2) training, resumption, export.

Everything runs on the tiny random backbone of configs/tiny.yaml with synthetic data in which token
t+k+2 is a fixed permutation of token t; the whole module takes well under two minutes on 2 cores.
"""
from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.config import TrainConfig, TrainConfigError
from medusa_jax.convert.medusa_format import load_heads
from medusa_jax.heads import MedusaHeads
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.train import trainer
from medusa_jax.train.checkpoint import batch_indices
from medusa_jax.train.losses import (NUM_RANKS, head_weights, heads_ce, rank_counts, shared_head_loss,
                                     topk_from_ranks, total_heads_loss)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def tiny(tmp_path, name: str, *overrides: str) -> TrainConfig:
    """configs/tiny.yaml with a smaller data set, writing to tmp_path/name."""
    return TrainConfig.from_yaml(TINY, ("synthetic_num_sequences=128", "log_every=5", f"out_dir={tmp_path / name}")
                                 + overrides)


def tree_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


# ------------------------------------------------------------------------------------------ losses

def _problem(K=3, N=37, D=16, V=50, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(K, N, D)), jnp.float32)
    w = jnp.asarray(r.normal(size=(D, V)), jnp.float32)
    lab = jnp.asarray(r.integers(0, V, (K, N)), jnp.int32)
    ok = jnp.asarray(r.random((K, N)) < 0.6).at[K - 1].set(False)  # the last head: no valid label
    return x, w, lab, ok


@pytest.mark.parametrize("chunk", [0, 8, 64])
def test_shared_head_loss_matches_autodiff(chunk):
    x, w, lab, ok = _problem()
    weights = jnp.asarray(head_weights(3, 0.8))

    def fused(x):
        per, cnt, ranks = shared_head_loss(x, w, lab, ok, chunk=chunk)
        return jnp.sum(weights * per), (per, ranks)

    def plain(x):
        per, cnt, ranks = heads_ce(jnp.einsum("knd,dv->knv", x, w), lab, ok)
        return jnp.sum(weights * per), (per, ranks)

    (la, (pa, ra)), ga = jax.value_and_grad(fused, has_aux=True)(x)
    (lb, (pb, rb)), gb = jax.value_and_grad(plain, has_aux=True)(x)
    np.testing.assert_allclose(pa, pb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ra, rb)
    assert float(pa[2]) == 0.0 and np.all(np.asarray(ga[2]) == 0)  # no valid label: 0 loss, 0 gradient
    no_grad = shared_head_loss(x, w, lab, ok, chunk=chunk, with_grad=False)[0]
    np.testing.assert_allclose(no_grad, pa, rtol=1e-6)


def test_head_without_valid_label_is_finite():
    x, w, lab, ok = _problem()
    none = jnp.zeros_like(ok)
    for fn in (lambda x: shared_head_loss(x, w, lab, none)[0], lambda x: heads_ce(jnp.einsum("knd,dv->knv", x, w),
                                                                                   lab, none)[0]):
        loss, g = jax.value_and_grad(lambda x: total_heads_loss(fn(x), 0.8))(x)
        assert np.isfinite(float(loss)) and float(loss) == 0.0
        assert np.all(np.isfinite(np.asarray(g)))


def test_ranks_and_topk():
    logits = jnp.asarray([[[0.0, 3.0, 1.0, 2.0]] * 3], jnp.float32)  # [K=1, N=3, V=4]
    lab = jnp.asarray([[1, 3, 0]], jnp.int32)  # ranks 0, 1, 3
    ok = jnp.asarray([[True, True, True]])
    r = np.asarray(rank_counts(logits, lab, ok))
    assert r.shape == (1, NUM_RANKS) and list(r[0, :4]) == [1, 1, 0, 1]
    acc = topk_from_ranks(r, np.array([3.0]), ks=(1, 2, 5))
    np.testing.assert_allclose(acc[:, 0], [1 / 3, 2 / 3, 1.0])
    np.testing.assert_allclose(head_weights(3, 0.8), [1.0, 0.8, 0.64])


# ------------------------------------------------------------------------------------------ config

def test_train_config_yaml_and_overrides(tmp_path):
    tc = TrainConfig.from_yaml(TINY, ("steps=7", "learning_rate=3e-4", "tree=null", "shared_lm_head=false"))
    assert (tc.steps, tc.learning_rate, tc.tree, tc.shared_lm_head, tc.model) == (7, 3e-4, None, False, "random")
    with pytest.raises(TrainConfigError, match="unknown"):
        TrainConfig.from_yaml(TINY, ("stepz=3",))
    with pytest.raises(TrainConfigError, match="steps must be int"):
        TrainConfig.from_yaml(TINY, ("steps=abc",))
    with pytest.raises(TrainConfigError, match="mode"):
        TrainConfig.from_yaml(TINY, ("mode=both",))
    for name in ("smollm2_medusa1.yaml", "smollm2_medusa2.yaml"):  # the shipped configs parse
        cfg = TrainConfig.from_yaml(os.path.join(ROOT, "configs", name))
        assert cfg.model is None and cfg.data == "data/distill/smollm2"


def test_data_order_is_a_function_of_seed_and_step():
    a = np.concatenate([batch_indices(10, 4, 3, s) for s in range(5)])  # 2 epochs exactly
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:]) == list(range(10))
    assert not np.array_equal(a[:10], a[10:])  # a new order each epoch
    np.testing.assert_array_equal(batch_indices(10, 4, 3, 3), a[12:16])
    assert not np.array_equal(batch_indices(10, 4, 4, 0), a[:4])


# ------------------------------------------------------------------------------------------ training

@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """One full tiny frozen run (the shipped config, smaller data), its backbone and a copy of it."""
    tmp = tmp_path_factory.mktemp("frozen")
    tc = tiny(tmp, "run")
    bb = trainer.build_backbone(tc)
    before = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), bb.params)
    res = trainer.train(tc, backbone=bb, progress=False)
    return tc, bb, before, res


def test_frozen_learns_permutation_and_keeps_backbone(frozen_run):
    tc, bb, before, res = frozen_run
    assert res.steps_done == tc.steps
    assert min(res.metrics["val_top1"]) >= 0.95, res.metrics["val_top1"]
    assert tree_equal(bb.params, before)  # the backbone is bit-identical
    assert set(res.heads_params) == {"blocks_kernel", "blocks_bias"}  # shared lm_head: only blocks train
    with open(os.path.join(tc.out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert recs[0]["step"] == 0 and "val_top1" in recs[0] and recs[-1]["step"] == tc.steps
    assert all(len(r["head_loss"]) == tc.num_heads and "lr" in r for r in recs[1:])
    assert any("val_top5" in r for r in recs[1:])
    with open(os.path.join(tc.out_dir, "accuracy.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_exported_heads_load_back(frozen_run):
    tc, bb, _, res = frozen_run
    cfg, params = load_heads(res.heads_dir, bb.cfg)
    assert (cfg.num_heads, cfg.num_layers, cfg.shared_lm_head) == (tc.num_heads, tc.num_layers, True)
    assert cfg.medusa_choices and all(len(p) <= tc.num_heads for p in cfg.medusa_choices)  # tree: search
    with open(os.path.join(res.heads_dir, "config.json")) as f:
        extra = json.load(f)
    assert extra["metrics"]["val_top1"] == res.metrics["val_top1"] and "val_top5" in extra["metrics"]
    hidden = jax.random.normal(jax.random.PRNGKey(1), (2, 5, bb.cfg.hidden_size))
    lm = lm_head_matrix(bb.cfg, bb.params)
    a = MedusaHeads(cfg).apply({"params": params}, hidden, lm)
    b = MedusaHeads(res.heads_cfg).apply({"params": res.heads_params}, hidden, lm)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_equals_uninterrupted(frozen_run, tmp_path):
    _, bb, _, _ = frozen_run
    over = ("steps=30", "checkpoint_every=10", "eval_every=10")
    full = trainer.train(tiny(tmp_path, "full", *over), backbone=bb, progress=False)
    tc = tiny(tmp_path, "cut", *over)
    part = trainer.train(tc, backbone=bb, stop_at_step=25, progress=False)  # "killed" after step 25
    assert part.steps_done == 25 and part.heads_dir is None
    assert not tree_equal(part.heads_params, full.heads_params)
    resumed = trainer.train(tc, backbone=bb, progress=False)  # restarts from the step-20 checkpoint
    assert resumed.steps_done == 30
    assert tree_equal(resumed.heads_params, full.heads_params)
    with open(os.path.join(tc.out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == sorted(set(steps)) and steps[-1] == 30  # no duplicated lines after resuming


def test_joint_trains_backbone(frozen_run, tmp_path):
    _, bb, before, _ = frozen_run
    tc = tiny(tmp_path, "joint", "mode=joint", "steps=6", "heads_warmup_steps=3", "batch_size=4",
              "eval_every=0", "base_loss=kl", "learning_rate=3e-3", "heads_lr_multiplier=2", "tree=null")
    warm = trainer.train(tc, backbone=bb, stop_at_step=3, progress=False)
    assert tree_equal(warm.backbone_params, before)  # heads-only warm-up: backbone untouched
    assert not tree_equal(warm.heads_params, trainer.init_heads(warm.heads_cfg))
    res = trainer.train(tc, backbone=bb, resume=False, progress=False)
    assert not tree_equal(res.backbone_params, before)
    assert tree_equal(bb.params, before)  # the caller's params (and the KL teacher) are not modified
    from medusa_jax.loading import load_model
    saved = load_model(os.path.join(tc.out_dir, "backbone"), with_tokenizer=False)  # an HF directory
    assert saved.cfg.hidden_size == bb.cfg.hidden_size and tree_equal(saved.params, res.backbone_params)
    with open(os.path.join(tc.out_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    assert last["lr_backbone"] > 0 and np.isfinite(last["base_loss"]) and "val_top1" in last


def test_cli_stop_and_resume(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_cli", os.path.join(ROOT, "train.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["--config", TINY, "--no-progress", "--set", "steps=12", "checkpoint_every=5", "eval_every=0",
            "synthetic_num_sequences=64", f"out_dir={tmp_path / 'cli'}"]
    assert cli.main(args + ["--stop-at-step", "7"]) == 0
    assert "resume" in capsys.readouterr().err
    assert cli.main(args) == 0
    assert "val top-1" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "cli" / "heads" / "medusa_lm_head.safetensors")
    assert cli.main(["--config", TINY, "--set", "nonsense=1"]) == 2
