"""`train.drift.measure_drift` (KL, top-1 agreement, perplexities of a tuned backbone against the
original) and the ``medusa-quality`` command, on tiny random Llamas."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_hf_model, tiny_config

from medusa_jax.models.llama import LlamaModel
from medusa_jax.train.drift import measure_drift

CFG = tiny_config()


@pytest.fixture(scope="module")
def models():
    @jax.jit  # (eagerly, op by op, these take seconds)
    def make():
        params = LlamaModel(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                                      jnp.zeros((1, 4), jnp.int32))["params"]
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        tuned = jax.tree_util.tree_unflatten(
            tree, [a + 0.05 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
        return params, tuned

    return make()


def _examples():
    rng = np.random.default_rng(0)
    out = []
    for L, start in ((20, 8), (60, 25), (150, 40)):  # buckets 128, 128, 256
        out.append((rng.integers(0, CFG.vocab_size, L).astype(np.int32), np.arange(L) >= start))
    return out


@jax.jit
def _logits(params, ids):
    return LlamaModel(CFG).apply({"params": params}, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None])[0]


def _reference(params_a, params_b, examples, max_len=512):
    """Mean KL(a || b), agreement and NLLs over the answer-token targets, each sequence alone in
    float64 numpy from full unpadded logits."""
    kl, agree, nll_a, nll_b, n = 0.0, 0, 0.0, 0.0, 0
    for ids, mask in examples:
        ids, mask = ids[:max_len], mask[:max_len]
        la = np.asarray(_logits(params_a, ids[None])[0], np.float64)  # each sequence alone, unpadded
        lb = np.asarray(_logits(params_b, ids[None])[0], np.float64)
        lpa = la - np.logaddexp.reduce(la, axis=-1, keepdims=True)
        lpb = lb - np.logaddexp.reduce(lb, axis=-1, keepdims=True)
        for t in np.nonzero(mask[1:])[0]:
            kl += float(np.sum(np.exp(lpa[t]) * (lpa[t] - lpb[t])))
            agree += int(np.argmax(la[t]) == np.argmax(lb[t]))
            nll_a -= lpa[t, ids[t + 1]]
            nll_b -= lpb[t, ids[t + 1]]
            n += 1
    return kl / n, agree / n, nll_a / n, nll_b / n, n


@pytest.mark.slow
def test_against_itself_nothing_drifts(models):
    params, _ = models
    d = measure_drift(CFG, params, params, _examples())
    assert abs(d["kl"]) < 1e-6 and d["top1_agreement"] == 1.0
    assert d["nll_original"] == d["nll_tuned"] and d["ppl_original"] == d["ppl_tuned"] and d["ppl_ratio"] == 1.0
    assert d["positions"] == sum(int(m[1:].sum()) for _, m in _examples()) and d["sequences"] == 3


def test_perturbed_copy_matches_a_direct_computation(models):
    params, tuned = models
    exs = _examples()
    d = measure_drift(CFG, params, tuned, exs)
    kl, agree, nll_a, nll_b, n = _reference(params, tuned, exs)
    assert d["kl"] > 1e-4
    assert d["positions"] == n
    np.testing.assert_allclose(d["kl"], kl, rtol=1e-4)
    np.testing.assert_allclose(d["nll_original"], nll_a, rtol=1e-5)
    np.testing.assert_allclose(d["nll_tuned"], nll_b, rtol=1e-5)
    assert abs(d["top1_agreement"] - agree) <= 1.0 / n  # at most one near-tie argmax flips
    assert 0 < d["top1_agreement"] < 1
    np.testing.assert_allclose(d["ppl_tuned"], math.exp(nll_b), rtol=1e-5)
    np.testing.assert_allclose(d["ppl_ratio"], d["ppl_tuned"] / d["ppl_original"], rtol=1e-9)


def test_padding_and_batching_do_not_change_the_sums(models):
    """A sequence alone, in a batch with a longer one of its bucket, or one per batch: the same sums."""
    params, tuned = models
    a, b, _ = _examples()
    alone = [measure_drift(CFG, params, tuned, [x]) for x in (a, b)]
    together = measure_drift(CFG, params, tuned, [a, b])
    one_per_batch = measure_drift(CFG, params, tuned, [a, b], batch_tokens=1)
    for d in (together, one_per_batch):
        assert d["positions"] == alone[0]["positions"] + alone[1]["positions"]
        for key in ("kl", "nll_original", "nll_tuned", "top1_agreement"):
            np.testing.assert_allclose(d[key] * d["positions"],
                                       sum(x[key] * x["positions"] for x in alone), rtol=2e-5)


def test_max_len_cuts_and_no_answer_gives_nan(models):
    params, tuned = models
    exs = _examples()
    d = measure_drift(CFG, params, tuned, exs[2:], max_len=128)
    assert d["positions"] == int(exs[2][1][1:128].sum())
    np.testing.assert_allclose(d["kl"], _reference(params, tuned, exs[2:], max_len=128)[0], rtol=1e-4)
    empty = measure_drift(CFG, params, tuned, [(exs[0][0], np.zeros(20, bool))])
    assert empty["positions"] == 0 and math.isnan(empty["kl"]) and empty["sequences"] == 1


# --------------------------------------------------------------------------------------------
# medusa-quality


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny HF backbone (model/), a perturbed copy of it (run/backbone/) and 40 self-distilled
    chats (data/)."""
    import torch

    root = tmp_path_factory.mktemp("quality")
    cfg = tiny_config(tie_word_embeddings=True)
    model, _ = random_hf_model(cfg, seed=3)
    model.save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.1." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "run" / "backbone")
    rng = np.random.RandomState(0)
    (root / "data").mkdir()
    with open(root / "data" / "samples.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": rng.randint(3, 128, 12).tolist(),
                                "response_ids": rng.randint(3, 64, 30).tolist(), "finish": "length"}) + "\n")
    return root


def test_quality_compares_the_held_out_chats(run_dir, tmp_path, capsys):
    from medusa_jax.cli import quality
    from medusa_jax.train import data as D

    out = tmp_path / "q.json"
    rc = quality.main(["--tuned", str(run_dir / "run" / "backbone"), "--model", str(run_dir / "model"), "--data",
                       str(run_dir / "data"), "--val-fraction", "0.2", "--limit", "3", "--max-new-tokens", "6",
                       "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "KL divergence" in text and "top-1 agreement" in text and "greedy answers identical" in text
    r = json.loads(out.read_text())
    _, val = D.split_train_val(D.load_distilled(str(run_dir / "data")), 0.2, 0)
    # every answer token is a target (the first one predicted from the prompt's last token)
    assert r["drift"]["sequences"] == len(val) and r["drift"]["positions"] == 30 * len(val)
    assert r["drift"]["kl"] > 0 and r["greedy"]["prompts"] == 3 == len(r["rows"])
    assert [row["id"] for row in r["rows"]] == [ex.id for ex in val[:3]]
    assert all(len(row["original"]) == 6 for row in r["rows"])


def test_quality_of_a_model_against_itself_reads_the_run_config(run_dir, tmp_path, capsys):
    """The run's train_config.json next to --tuned gives the split; a model against itself: KL 0."""
    from medusa_jax.cli import quality

    (run_dir / "self").mkdir(exist_ok=True)
    for f in (run_dir / "model").iterdir():
        (run_dir / "self" / "backbone").mkdir(exist_ok=True)
        (run_dir / "self" / "backbone" / f.name).write_bytes(f.read_bytes())
    (run_dir / "self" / "train_config.json").write_text(json.dumps(
        {"data": str(run_dir / "data"), "val_fraction": 0.1, "seed": 1, "max_seq_len": 64,
         "model": str(run_dir / "model")}))
    out = tmp_path / "q.json"
    assert quality.main(["--tuned", str(run_dir / "self" / "backbone"), "--limit", "2", "--max-new-tokens", "4",
                         "--json", str(out), "--no-progress"]) == 0
    assert "train_config.json" in capsys.readouterr().err
    r = json.loads(out.read_text())
    assert (r["val_fraction"], r["seed"], r["max_seq_len"]) == (0.1, 1, 64)
    assert r["drift"]["kl"] < 1e-6 and r["drift"]["top1_agreement"] == 1.0
    assert r["greedy"]["identical_share"] == 1.0 and r["greedy"]["first_diff_median"] is None


@pytest.mark.parametrize("case", ["missing", "not_a_model", "heads_without_layers", "missing_data", "bad_fraction",
                                  "other_shape", "no_val"])
def test_quality_bad_input_exits_2(case, run_dir, tmp_path, capsys):
    from medusa_jax.cli import quality

    tuned, model, data, extra = run_dir / "run" / "backbone", run_dir / "model", run_dir / "data", []
    if case == "missing":
        tuned = tmp_path / "nope"
    elif case == "not_a_model":
        tuned = tmp_path
    elif case == "heads_without_layers":
        (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
        tuned = tmp_path
    elif case == "missing_data":
        data = tmp_path / "nodata"
    elif case == "bad_fraction":
        extra = ["--val-fraction", "1.5"]
    elif case == "other_shape":
        random_hf_model(tiny_config(tie_word_embeddings=True, num_layers=3), seed=0)[0].save_pretrained(tmp_path)
        tuned = tmp_path
    elif case == "no_val":
        extra = ["--val-fraction", "1e-9"]
    argv = ["--tuned", str(tuned), "--model", str(model), "--data", str(data), "--no-progress", *extra]
    capsys.readouterr()
    if case == "bad_fraction":
        with pytest.raises(SystemExit) as e:
            quality.main(argv)
        assert e.value.code == 2
        return
    assert quality.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err


def test_quality_of_tuned_layers_in_a_heads_directory(run_dir, tmp_path):
    """--tuned a heads directory with backbone_layers.safetensors (the tuned top layer applied to
    --model) gives the figures of the whole tuned backbone."""
    from medusa_jax.cli import quality
    from medusa_jax.convert import tuned_layers as tl
    from medusa_jax.convert.load import load_model

    assert quality.LAYERS_FILE == tl.LAYERS_FILE  # named twice: --help loads no JAX
    base, tuned = (load_model(str(run_dir / d), with_tokenizer=False) for d in ("model", "run/backbone"))
    tl.save_tuned_layers(str(tmp_path / "heads"), base.cfg, base.params, tuned.params, [1], "model")
    common = ["--model", str(run_dir / "model"), "--data", str(run_dir / "data"), "--val-fraction", "0.2",
              "--limit", "2", "--max-new-tokens", "4", "--no-progress", "--json"]
    assert quality.main(["--tuned", str(tmp_path / "heads"), *common, str(tmp_path / "a.json")]) == 0
    assert quality.main(["--tuned", str(run_dir / "run" / "backbone"), *common, str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["tuned_kind"] == "layers" and b["tuned_kind"] == "hf"
    assert a["drift"]["kl"] > 0
    np.testing.assert_allclose(a["drift"]["kl"], b["drift"]["kl"], rtol=1e-5)
    assert [r["tuned"] for r in a["rows"]] == [r["tuned"] for r in b["rows"]]


def test_quality_of_a_run_on_a_random_backbone_says_there_is_nothing_to_compare(run_dir, tmp_path, capsys):
    """A smoke-test run (model: random) has no original model: one line saying so, not a note about the
    default model followed by a shape error."""
    from medusa_jax.cli import quality

    (tmp_path / "run" / "backbone").mkdir(parents=True)
    for f in (run_dir / "model").iterdir():
        (tmp_path / "run" / "backbone" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({"model": "random", "data": "synthetic"}))
    assert quality.main(["--tuned", str(tmp_path / "run" / "backbone"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --tuned {tmp_path / 'run' / 'backbone'}: its run trained a random backbone") \
        and "\n" not in err, err
