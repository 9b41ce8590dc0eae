"""Speed machinery: proposal vocabulary, cache growth, calibration, c(T) timing and the hardware-aware tree."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax import kernels
from medusa_jax.convert.medusa_format import HeadsFormatError, load_heads, save_heads
from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.tree import build_tree, with_lookup
from medusa_jax.decoding.tree_estimates import greedy_tree_search
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import MedusaHeads, frequent_tokens, init_heads, with_proposal_projection
from medusa_jax.heads.topk import head_topk
from medusa_jax.models.kv_cache import grow_cache, init_cache
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.tuning.calibrate import choose_tree, rank_accuracies
from medusa_jax.tuning.cost import overhead_breakdown, step_costs, step_seconds

jax.config.update("jax_default_matmul_precision", "highest")

V = 64


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    hcfg = MedusaConfig(hidden_size=32, vocab_size=V, num_heads=4, num_layers=1, shared_lm_head=True, topk=4)
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(1), len(hp))
    hp = {k: jax.random.normal(kk, a.shape) * 0.5 for kk, (k, a) in zip(keys, sorted(hp.items()))}
    return cfg, params, hcfg, hp


def _restricted(hcfg, hp, ids):
    return hcfg.replace(proposal_vocab_size=len(ids)), {**hp, "proposal_ids": jnp.asarray(ids, jnp.int32)}


def test_frequent_tokens_order_and_errors():
    ids = frequent_tokens([[3, 3, 5, 1], [5, 3, 7]], 4, 10)
    assert ids.tolist() == [3, 5, 1, 7]  # 3 x3, 5 x2, then 1 and 7 once each by id
    assert frequent_tokens([[2]], 3, 4).tolist() == [2, 0, 1]  # never-seen tokens fill up by id
    with pytest.raises(ValueError, match="size must be"):
        frequent_tokens([[1]], 0, 4)
    with pytest.raises(ValueError, match="outside"):
        frequent_tokens([[9]], 2, 4)


def test_head_topk_with_proposal_vocab_is_the_restricted_ranking(tiny):
    cfg, params, hcfg, hp = tiny
    lm = lm_head_matrix(cfg, params)
    ids = np.random.RandomState(0).choice(V, 24, replace=False)
    rcfg, rp = _restricted(hcfg, hp, ids)
    hidden = jax.random.normal(jax.random.PRNGKey(3), (5, 32))
    full = np.asarray(MedusaHeads(hcfg).apply({"params": hp}, hidden, lm))  # [K, 5, V]
    masked = np.full_like(full, -np.inf)
    masked[..., ids] = full[..., ids]
    want = np.argsort(-masked, axis=-1, kind="stable")[..., :4]
    got_gather = np.asarray(head_topk(rcfg, rp, hidden, lm, 4, 4))
    got_pre = np.asarray(head_topk(rcfg, with_proposal_projection(rcfg, rp, lm), hidden, lm, 4, 4))
    np.testing.assert_array_equal(got_gather, want)
    np.testing.assert_array_equal(got_pre, want)
    assert set(got_pre.ravel()) <= set(ids.tolist())


def test_proposal_vocab_keeps_greedy_output_lossless(tiny):
    cfg, params, hcfg, hp = tiny
    lm = lm_head_matrix(cfg, params)
    prompt = [4, 4, 2, 8, 19, 33]
    base = generate(cfg, params, prompt, max_new_tokens=80)
    rcfg, rp = _restricted(hcfg, hp, np.arange(0, V, 2))
    rp = with_proposal_projection(rcfg, rp, lm)
    tree = build_tree(greedy_tree_search(np.full((4, 4), 0.3), 20, 4), 4)
    med = generate(cfg, params, prompt, max_new_tokens=80, heads=(rcfg, rp), tree=tree)
    dev = generate_device(cfg, params, [prompt], max_new_tokens=80, heads=(rcfg, rp), tree=tree)
    assert med.tokens == base.tokens == dev.tokens[0, :int(dev.count[0])].tolist()


def test_proposal_ids_round_trip_and_bad_ids(tmp_path, tiny):
    cfg, params, hcfg, hp = tiny
    rcfg, rp = _restricted(hcfg, hp, [5, 1, 9, 30, 2])
    save_heads(str(tmp_path), rcfg, rp)
    cfg2, p2 = load_heads(str(tmp_path), cfg)
    assert cfg2.proposal_vocab_size == 5 and p2["proposal_ids"].tolist() == [5, 1, 9, 30, 2]
    assert p2["proposal_ids"].dtype == np.int32
    np.testing.assert_array_equal(p2["blocks_kernel"], np.asarray(hp["blocks_kernel"]))
    fn = os.path.join(tmp_path, "config.json")
    raw = json.load(open(fn))
    for bad, match in (([5, 5, 1, 2], "distinct"), ([1, 2, 3, V], f"go up to {V}, beyond its vocab_size {V}"),
                       ([1, 2], "at least topk")):
        raw["proposal_token_ids"] = bad
        json.dump(raw, open(fn, "w"))
        with pytest.raises(HeadsFormatError, match=match):
            load_heads(str(tmp_path))
    with pytest.raises(ValueError, match="topk=4 exceeds proposal_vocab_size=2"):
        hcfg.replace(proposal_vocab_size=2)


def test_grow_cache_keeps_entries():
    from medusa_jax.models.config import ModelConfig
    mc = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1)
    c = init_cache(mc, 1, 4)
    c = c.replace(k=c.k + 1.0, v=c.v + 2.0, lengths=jnp.array([3], jnp.int32))
    g = grow_cache(c, 8)
    assert g.size == 8 and int(g.lengths[0]) == 3
    np.testing.assert_array_equal(np.asarray(g.k[:, :, :, :4]), np.asarray(c.k))  # [L, B, KVH, S, Dh]
    assert float(jnp.abs(g.v[:, :, :, 4:]).sum()) == 0.0
    with pytest.raises(ValueError, match="shrink"):
        grow_cache(g, 4)


def test_rank_accuracies_count_each_rank_per_head(tiny):
    cfg, params, hcfg, hp = tiny
    lm = lm_head_matrix(cfg, params)
    hidden = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (30, 32)))
    top = np.asarray(head_topk(hcfg, hp, hidden, lm, 4, 4))  # [K, N, 4]
    # head k's label is its rank-(k % 4) token; head 3 has only 10 valid positions, 5 of them wrong
    labels = np.stack([top[k, :, k % 4] for k in range(4)]).astype(np.int32)
    valid = np.ones((4, 30), bool)
    valid[3, 10:] = False
    labels[3, :5] = [next(t for t in range(V) if t not in top[3, i]) for i in range(5)]
    acc, counts = rank_accuracies(hcfg, hp, lm, hidden, labels, valid, topk=4, batch=8)
    assert counts.tolist() == [30, 30, 30, 10]
    want = np.zeros((4, 4))
    want[0, 0] = want[1, 1] = want[2, 2] = 1.0
    want[3, 3] = 0.5
    np.testing.assert_allclose(acc, want)


def test_choose_tree_maximises_predicted_speedup():
    # 10 positions, 2 heads, topk 3 (3 = miss): rank vectors and how often they occur
    ranks = np.array([[0, 0]] * 3 + [[0, 1]] * 2 + [[1, 0]] * 2 + [[2, 3]] + [[3, 0]] * 2, np.int8)
    best, rows = choose_tree(ranks, {2: 1.2, 4: 1.3, 6: 2.5}, topk=3)
    assert [r["size"] for r in rows] == [1, 2, 4, 6]
    by = {r["size"]: r for r in rows}
    # T=2: (0,) accepted at 5 positions; T=4: + (1,) 2, (0, 0) 3 -> 10 / 10
    assert by[2]["predicted_tokens_per_step"] == pytest.approx(1.5)
    assert by[4]["predicted_tokens_per_step"] == pytest.approx(2.0)
    assert by[4]["medusa_choices"] == [[0], [0, 0], [1]]
    assert by[4]["predicted_speedup"] == pytest.approx(2.0 / 1.3)
    assert best is by[4]
    best, _ = choose_tree(ranks, {2: 3.0}, topk=3)
    assert best["size"] == 1  # nothing beats plain decoding at that cost
    with pytest.raises(ValueError, match="replay"):
        choose_tree(ranks, {2: 1.0}, topk=3, lookup=PromptLookup(3, 3, 2))


def test_choose_tree_with_prompt_lookup_replays_decoding():
    # one chat whose answer loops: the copy accepts what the heads never do, and a step verifies
    # max(T, k + 1) nodes, so a 2-node tree with a 3-token copy costs c(4)
    ids = np.array([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7])
    mask = np.arange(15) >= 3
    sources = np.array([[0, t] for t in range(2, 13)])
    ranks = np.full((11, 2), 3, np.int8)
    ranks[:, 0] = 0                                        # head 0 always right, head 1 never
    cost = {2: 1.1, 4: 1.25}
    best, rows = choose_tree(ranks, cost, 3, [(ids, mask)], sources, PromptLookup(3, 3, 2))
    by = {r["size"]: r for r in rows}
    assert by[2]["predicted_tokens_per_step"] == pytest.approx(2.0)          # 12 answer tokens in 6 steps
    # the first step finds no earlier n-gram (heads: 2 tokens), then copies of 3 accept all (4, 4),
    # and the last copy stops at the answer's end (2)
    assert by[2]["predicted_tokens_per_step_lookup"] == pytest.approx(3.0)
    assert by[2]["cost"] == 1.25 and by[2]["predicted_speedup"] == pytest.approx(3.0 / 1.25)
    with pytest.raises(KeyError):
        choose_tree(ranks, {2: 1.1}, 3, [(ids, mask)], sources, PromptLookup(3, 3, 2))


def test_step_costs_time_every_tree(tiny):
    cfg, params, hcfg, hp = tiny
    acc = np.full((4, 4), 0.2)
    trees = [build_tree(greedy_tree_search(acc, T, 4), 4) for T in (3, 9)]
    out = step_costs(cfg, params, (hcfg, hp), trees, [1, 2, 3], steps=4, repeats=1, cache_size=128, progress=False)
    assert set(out["cost"]) == set(out["plain_seconds"]) == {3, 9} and out["plain_s"] > 0
    # each tree against the plain step timed beside it (interleaved)
    assert all(out["seconds"][T] == pytest.approx(out["cost"][T] * out["plain_seconds"][T]) for T in (3, 9))
    assert out["plain_s"] == pytest.approx(np.mean(list(out["plain_seconds"].values())))
    br = overhead_breakdown(cfg, params, (hcfg, hp), trees[1], [1, 2, 3], steps=4, repeats=1, cache_size=128)
    assert br["tree_size"] == 9 and br["medusa_step_ms"] > 0 and br["heads_ms"] > 0
    st = start_state(cfg, params, [[1, 2, 3]], 16)
    with pytest.raises(ValueError, match="cache slots"):
        step_seconds(cfg, params, (hcfg, hp), trees[1], st, steps=4)


@pytest.mark.slow
def test_tune_command_saves_the_chosen_tree(tmp_path):
    """End to end on a tiny HF model: calibration, c(T), choice, saved with the heads and used by default."""
    from conftest import tiny_tune_run

    from medusa_jax.resolve import heads_calibration, predicted_tokens_per_step, resolve_heads

    lm, rc = tiny_tune_run(tmp_path, extra={"metrics": {"note": "kept"}}, args=["--dynamic-width", "0"])
    assert rc == 0
    cfg2, p2 = load_heads(str(tmp_path / "tuned"), lm.cfg)
    raw = json.load(open(tmp_path / "tuned" / "config.json"))
    report = raw["tree_search"]
    assert report["dynamic_rows"] == [] and report["dynamic_tree"] is None  # static trees only
    assert raw["metrics"] == {"note": "kept"}
    assert [r["size"] for r in report["rows"]] == [1, 2, 4]
    # c(T) timed at both cache sizes; the tree is chosen on their mean
    assert report["cost_cache_sizes"] == [64, 128] and set(report["cost_by_cache_size"]) == {"64", "128"}
    for row in report["rows"][1:]:  # with the default prompt lookup a step verifies max(T, 4) nodes
        T = max(row["size"], report["prompt_lookup"]["num_tokens"] + 1)
        by_size = [report["cost_by_cache_size"][S][str(T)] for S in ("64", "128")]
        assert row["cost"] == pytest.approx(np.mean(by_size), rel=1e-6)
    assert len(cfg2.medusa_choices) + 1 == report["chosen_size"] in (2, 4)
    # the roofline beside the timings: the backbone's weight bytes and the read bandwidth per cache size
    assert report["weight_bytes"] == sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(lm.params))
    bws = report["read_bandwidth_gbs_by_cache_size"]
    assert set(bws) == {"64", "128"} and all((b > 0.1) if kernels.in_use() else b is None for b in bws.values())
    # only response tokens (ids < 64) are frequent; the 64 proposal ids are exactly those
    assert cfg2.proposal_vocab_size == 64 and sorted(p2["proposal_ids"].tolist()) == list(range(64))
    assert np.asarray(report["rank_accuracies"]).shape == (3, 5)
    heads, tree, _ = resolve_heads(lm, str(tmp_path / "tuned"))
    projection = "proposal_lm_head_t" if heads[0].shared_lm_head else "proposal_lm_head"  # heads.prepare_heads
    assert tree.size == report["chosen_size"] and projection in heads[1]
    # chosen for decoding with the default prompt lookup, and predicted by replaying it
    assert report["prompt_lookup"] == {"num_tokens": 3, "max_ngram": 3, "min_ngram": 2, "matches": 1}
    assert report["predicted_by"] == "replay" and tree.lookup is not None
    pred, basis = predicted_tokens_per_step(tree, heads_calibration(str(tmp_path / "tuned")))
    assert pred == report["predicted_tokens_per_step_lookup"] and "with prompt lookup" in basis
    pred, basis = predicted_tokens_per_step(with_lookup(tree, None), heads_calibration(str(tmp_path / "tuned")))
    assert pred == report["predicted_tokens_per_step"] and "heads alone" in basis
    other = build_tree([(0,), (1,), (2,)], 5)                 # not the tuned tree: independent heads
    pred, basis = predicted_tokens_per_step(other, heads_calibration(str(tmp_path / "tuned")))
    acc = np.asarray(report["rank_accuracies"])
    assert pred == pytest.approx(1 + acc[0, :3].sum()) and "independent" in basis
    # a report per kind of weights (GGUF blocks decode with other step costs, so another tree):
    # decoding reads the one made on its own weights, the latest where there is none
    assert report["weights"] == "float32"
    raw["tree_search"] = {**report, "weights": "as-stored", "medusa_choices": [[0], [1]]}
    raw["tree_search_by_weights"] = {"float32": {**report, "medusa_choices": [[0], [0, 0], [0, 0, 0]]}}
    json.dump(raw, open(tmp_path / "tuned" / "config.json", "w"))
    assert heads_calibration(str(tmp_path / "tuned"), "as-stored")["medusa_choices"] == [[0], [1]]
    assert heads_calibration(str(tmp_path / "tuned"), "float32")["medusa_choices"] == [[0], [0, 0], [0, 0, 0]]
    _, tree, _ = resolve_heads(lm, str(tmp_path / "tuned"))  # lm holds float32 weights
    assert sorted(tree.medusa_choices) == [(0,), (0, 0), (0, 0, 0)]
    del raw["tree_search_by_weights"]
    json.dump(raw, open(tmp_path / "tuned" / "config.json", "w"))
    assert heads_calibration(str(tmp_path / "tuned"), "float32")["weights"] == "as-stored"


@pytest.mark.slow
def test_tune_fits_small_models_and_heads(tmp_path, capsys):
    """A model whose context is below the default cache sizes, and heads whose trees are smaller than
    prompt lookup's step: tune times what fits (the context's cache, a copy as long as the largest
    tree), says so, and saves its choice (it crashed on both); data distilled from another model is
    named in a note."""
    from conftest import tiny_tune_run

    lm, rc = tiny_tune_run(tmp_path, sizes="2,3", num_heads=1, topk=2, data_meta={"model": "/x/SmolLM2.gguf"},
                           args=["--dynamic-width", "0", "--cost-cache-sizes", "64,1024", "--prompt-lookup", "6"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "the model's context is 256 tokens; the steps are timed with KV caches of 64, 256 slots" in err
    assert "prompt lookup copies at most 2 tokens with them (not 6)" in err
    assert "holds another model's answers (its meta.json)" in err  # the data named another model
    report = json.load(open(tmp_path / "tuned" / "config.json"))["tree_search"]
    assert report["cost_cache_sizes"] == [64, 256] and report["prompt_lookup"]["num_tokens"] == 2
    assert [r["size"] for r in report["rows"]] == [1, 2, 3]


def _files(directory) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under `directory`."""
    out = {}
    for root, _, names in os.walk(directory):
        for n in names:
            fn = os.path.join(root, n)
            with open(fn, "rb") as f:
                out[os.path.relpath(fn, directory)] = (f.read(), os.stat(fn).st_mtime_ns)
    return out


def test_tune_output_never_defaults_into_the_package(tmp_path, monkeypatch):
    import medusa_jax
    from medusa_jax import resolve
    from medusa_jax.tuning.calibrate import DEFAULT_OUT, OutputDirError, output_dir

    package = os.path.dirname(os.path.abspath(medusa_jax.__file__))
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "runs" / "heads"
    assert output_dir(None, None) == str(tmp_path / DEFAULT_OUT)  # shipped heads -> ./tuned_heads
    assert output_dir(resolve.DEFAULT_HEADS_DIR, None) == str(tmp_path / DEFAULT_OUT)
    assert output_dir(str(mine), None) == str(mine)  # the user's own heads: tuned in place
    assert output_dir(None, "elsewhere") == str(tmp_path / "elsewhere")
    assert output_dir(None, None, update_shipped=True) == os.path.abspath(resolve.DEFAULT_HEADS_DIR)
    medusa1 = resolve.SHIPPED_HEADS["medusa1"]  # the other shipped heads, by name
    assert output_dir("medusa1", None) == str(tmp_path / DEFAULT_OUT)
    assert output_dir("medusa1", None, update_shipped=True) == os.path.abspath(medusa1)
    for inside in (resolve.DEFAULT_HEADS_DIR, package, os.path.join(package, "assets", "new")):
        with pytest.raises(OutputDirError, match="inside the installed medusa_jax package.*--update-shipped-heads"):
            output_dir(None, inside)
    with pytest.raises(OutputDirError, match="either --out or --update-shipped-heads"):
        output_dir(None, "x", update_shipped=True)


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "abc"], "--sizes takes integers >= 1 separated by commas, got 'abc'"),
    (["--sizes", "4,0"], "--sizes takes integers >= 1 separated by commas"),
    (["--sizes", "1", "--prompt-lookup", "0"], "--sizes 1: no tree of 2 tokens or more"),
    (["--cost-cache-sizes", "256,x"], "--cost-cache-sizes takes integers >= 1 separated by commas"),
    (["--val-fraction", "2"], "--val-fraction must be in (0, 1)"),
    (["--val-fraction", "0"], "--val-fraction must be in (0, 1)"),
    (["--data", "no-such-dir"], "--data no-such-dir: no samples.jsonl there"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--repeats", "-1"], "--repeats must be >= 1"),
    (["--max-positions", "-5"], "--max-positions must be >= 0"),
    (["--proposal-vocab", "-1"], "--proposal-vocab must be >= 0"),
])
def test_tune_flags_checked_before_anything_loads(argv, message, tmp_path, capsys):
    """Bad flags exit 2 with one line before the model is loaded (the model path does not exist)."""
    from medusa_jax.cli import tune

    with pytest.raises(SystemExit) as e:
        tune.main(["--model", str(tmp_path / "no-model"), "--dry-run", "--no-progress"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("medusa-tune: error: " + message), err


def test_tune_command_refuses_out_inside_the_package(capsys):
    """Refused before anything is loaded; the shipped heads and the package are untouched."""
    import medusa_jax
    from medusa_jax import resolve
    from medusa_jax.cli import tune

    package = os.path.dirname(os.path.abspath(medusa_jax.__file__))
    target = os.path.join(package, "assets", "heads", "tuned-here")
    before = _files(resolve.DEFAULT_HEADS_DIR)
    assert tune.main(["--out", target, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {target} is inside the installed medusa_jax package")
    assert "--update-shipped-heads" in err and len(err.strip().splitlines()) == 1
    assert tune.main(["--out", resolve.DEFAULT_HEADS_DIR, "--no-progress"]) == 2
    assert not os.path.exists(target) and _files(resolve.DEFAULT_HEADS_DIR) == before
    # the flags conflict whether or not --dry-run would write anything
    assert tune.main(["--update-shipped-heads", "--out", target, "--dry-run", "--no-progress"]) == 2
    assert "give either --out or --update-shipped-heads" in capsys.readouterr().err


def test_tune_refuses_an_out_file_heads_of_another_model_and_a_proposal_vocab_past_the_vocabulary(tmp_path, capsys):
    """One line and exit 2 each, before the calibration (--out: before anything loads)."""
    from conftest import tiny_tune_run

    from medusa_jax.cli import tune

    (tmp_path / "file.yaml").write_text("x")
    with pytest.raises(SystemExit) as e:
        tune.main(["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "file.yaml"), "--no-progress"])
    assert e.value.code == 2
    assert "--out " + str(tmp_path / "file.yaml") + ": exists and is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tiny_tune_run(tmp_path, args=["--proposal-vocab", "100000"])
    assert e.value.code == 2
    assert "--proposal-vocab 100000 is larger than the model's vocabulary" in capsys.readouterr().err
    assert tune.main(["--model", str(tmp_path / "model"), "--heads", "medusa1", "--data", str(tmp_path / "data"),
                      "--val-fraction", "0.3", "--dry-run", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "vocab" in err[0], err
