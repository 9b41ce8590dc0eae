"""bench: how each decoder is timed and counted (no timed assertions)."""
import pytest

from medusa_jax.cli import bench
from medusa_jax.evals import speed
from medusa_jax.evals.speed import TokenClock, markdown_table, rate, summarize


def test_token_clock_first_token_is_the_second_put():
    times = iter([10.0, 10.4, 10.5, 10.6])
    clock = TokenClock(clock=lambda: next(times))
    for value in (["prompt"], [5], [6], [7]):
        clock.put(value)
    clock.end()
    assert clock.times == [10.0, 10.4, 10.5, 10.6]
    assert clock.first_token_s == 10.4


def test_token_clock_without_a_new_token_says_so():
    clock = TokenClock(clock=lambda: 1.0)
    clock.put(["prompt"])
    with pytest.raises(RuntimeError, match="streamed 1 time"):
        clock.first_token_s


def test_rate_is_total_tokens_over_total_seconds_not_a_mean_of_rates():
    assert rate([100, 60], [4.0, 1.0]) == pytest.approx(32.0)  # the mean of rates would be 42.5
    with pytest.raises(ValueError, match="nothing was timed"):
        rate([3], [0.0])


def _row(cat, n, plain_s, hf_n, hf_s, hf_identical):
    return dict(category=cat, new_tokens=n, plain_s=plain_s, plain_prefill_s=0.5, medusa_s=plain_s / 2,
                medusa_steps=n // 2, hist=[0, n // 2], identical=True, near_tie=False,
                hf_tokens=hf_n, hf_decode_tokens=hf_n - 1, hf_s=hf_s, hf_prefill_s=0.25, hf_identical=hf_identical)


def test_summary_counts_transformers_decode_window_tokens_and_identical_outputs():
    rows = [_row("a", 100, 2.0, 100, 4.95, True), _row("b", 51, 1.0, 40, 3.0, False)]
    s = summarize(rows, depth=1)
    o = s["overall"]
    assert o["plain_tok_s"] == pytest.approx(151 / 3.0)
    # transformers' first token comes from its prefill: its decode window holds n - 1 tokens
    assert o["hf_tok_s"] == pytest.approx((99 + 39) / 7.95)
    assert o["plain_vs_hf"] == pytest.approx((151 / 3.0) / (138 / 7.95))
    assert (o["hf_identical"], s["a"]["hf_identical"], s["b"]["hf_identical"]) == (1, 1, 0)
    assert (o["plain_prefill_s"], o["hf_prefill_s"]) == (1.0, 0.5)
    assert s["a"]["hf_tok_s"] == pytest.approx(20.0)
    table = markdown_table(s)
    assert "identical to transformers" in table
    assert "| overall | 2 | 50.3 | 100.7 | 2.00x | 2.01 | 17.4 | 2.90x | 1/2 |" in table


def test_summary_without_transformers_has_no_peer_columns():
    row = _row("a", 10, 1.0, 10, 1.0, True)
    for k in ("hf_tokens", "hf_decode_tokens", "hf_s", "hf_prefill_s", "hf_identical"):
        del row[k]
    s = summarize([row], depth=1)
    assert "hf_tok_s" not in s["overall"] and "transformers" not in markdown_table(s)


@pytest.mark.slow
def test_hf_generate_matches_ours_and_splits_prefill_from_decode():
    pytest.importorskip("torch")
    from conftest import random_hf_model, tiny_config

    cfg = tiny_config(eos_token_ids=())
    hf_model, params = random_hf_model(cfg, seed=3)
    ids = [1, 17, 42, 99, 5, 63]
    free = speed.time_jit_generate(cfg, params, None, None, ids, 12, ())["tokens"]
    # an EOS id that first appears after a few tokens: both must stop there, EOS included
    k = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    eos = (free[k],)
    hf_model.generation_config.eos_token_id = eos[0]  # no EOS ids given: the model's default must not apply
    assert speed.time_hf_generate(hf_model, ids, 12, ())["tokens"] == free
    ours = speed.time_jit_generate(cfg, params, None, None, ids, 12, eos)
    hf = speed.time_hf_generate(hf_model, ids, 12, eos)
    assert ours["tokens"] == free[:k + 1]
    assert hf["tokens"] == ours["tokens"]
    assert hf["decode_tokens"] == k
    assert hf["prefill_s"] > 0 and hf["seconds"] > 0


def test_torch_threads_checked_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--prompts", "no-such-file.jsonl", "--hf", "--torch-threads", "0"])
    assert e.value.code == 2
    assert "--torch-threads must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be >= 1"):
        speed.load_hf_peer("unused", 0)


def test_out_and_prompt_choice_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    """--out that cannot be a directory, and --limit with --per-category, exit 2 with one line
    before the model is loaded (the model path does not exist)."""
    monkeypatch.chdir(tmp_path)  # where the default --out would go
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    taken = tmp_path / "taken"
    taken.write_text("x")
    for argv, message in [(["--out", str(taken)], f"--out {taken}: exists and is not a directory"),
                          (["--out", str(taken / "sub")], f"--out {taken / 'sub'}: cannot create the directory"),
                          (["--limit", "1", "--per-category", "1"],
                           "--limit and --per-category both choose the prompts: give one or the other"),
                          (["--batch-size", "1,x"], "--batch-size takes integers >= 1 separated by commas")]:
        with pytest.raises(SystemExit) as e:
            bench.main(["--prompts", str(prompts), "--model", str(tmp_path / "no-model")] + argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("medusa-bench: error: " + message), (argv, err)
    assert taken.read_text() == "x" and not (tmp_path / "bench_out").exists()
    out = tmp_path / "new" / "out"  # created up front; the missing model then fails the run
    assert bench.main(["--prompts", str(prompts), "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 2
    assert out.is_dir() and "--model" in capsys.readouterr().err


def test_summary_of_plain_greedy_on_the_other_weights():
    rows = []
    for cat, n, s in (("a", 100, 1.0), ("b", 50, 0.5)):
        row = _row(cat, n, s, n, 1.0, True)
        row.update(ref_tokens=n, ref_s=2 * s, ref_prefill_s=0.1, ref_identical=cat == "a")
        rows.append(row)
    o = summarize(rows, depth=1)["overall"]
    assert o["ref_tok_s"] == pytest.approx(150 / 3.0)
    assert o["plain_vs_ref"] == pytest.approx(2.0) and o["medusa_vs_ref"] == pytest.approx(4.0)
    assert (o["ref_identical"], o["ref_prefill_s"]) == (1, pytest.approx(0.2))
    assert "| 50.0 | 2.00x | 4.00x | 1/2 |" in markdown_table(summarize(rows, depth=1))
