"""Command-line plumbing: heads/tree resolution, text streaming, lossless-check and bench summaries."""
import io
import os
from types import SimpleNamespace

import pytest

from medusa_jax import resolve
from medusa_jax.chat import load_first_turns
from medusa_jax.cli import common
from medusa_jax.convert.medusa_format import save_heads
from medusa_jax.evals.lossless import first_difference
from medusa_jax.evals.speed import markdown_table, summarize
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import HeadsMismatchError, init_heads
from medusa_jax.models.config import ModelConfig

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CFG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


def _heads_dir(tmp_path, hidden=16, vocab=50, choices=None, k=3):
    hcfg = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=k, medusa_choices=choices)
    d = tmp_path / f"heads_{hidden}_{vocab}"
    save_heads(str(d), hcfg, init_heads(hcfg))
    return str(d)


def test_resolve_heads_reads_saved_tree_and_overrides(tmp_path):
    model = SimpleNamespace(cfg=CFG)
    d = _heads_dir(tmp_path, choices=[(0,), (1,), (0, 0)])
    heads, tree, note = resolve.resolve_heads(model, d)
    assert note == "" and heads[0].num_heads == 2  # prepared for the tree: its depth-2 heads only
    assert heads[1]["blocks_kernel"].shape[0] == 2
    assert tree.medusa_choices == ((0,), (1,), (0, 0))
    _, tree2, _ = resolve.resolve_heads(model, d, "chain2")
    assert tree2.medusa_choices == ((0,), (0, 0))
    with pytest.raises(ValueError, match="deeper|exceeds|depth"):
        resolve.resolve_heads(model, d, "chain5")


def test_default_tree_is_cut_to_the_heads_depth(tmp_path):
    _, tree, _ = resolve.resolve_heads(SimpleNamespace(cfg=CFG), _heads_dir(tmp_path, k=2))
    assert tree.max_depth <= 2 and tree.size > 2


def test_resolve_heads_mismatch_and_missing(tmp_path, monkeypatch):
    model = SimpleNamespace(cfg=CFG)
    with pytest.raises(HeadsMismatchError, match="32"):
        resolve.resolve_heads(model, _heads_dir(tmp_path, hidden=32))
    with pytest.raises(FileNotFoundError):
        resolve.resolve_heads(model, str(tmp_path / "nope"))
    monkeypatch.setattr(resolve, "DEFAULT_HEADS_DIR", str(tmp_path / "none"))
    heads, tree, note = resolve.resolve_heads(model, None)  # no heads: prompt lookup alone
    assert heads is None and "prompt lookup only" in note and tree.size == 1 and tree.lookup is not None
    heads, tree, note = resolve.resolve_heads(model, None, prompt_lookup=0)
    assert heads is None and tree is None and "plainly" in note
    assert resolve.resolve_heads(model, None, use_medusa=False) == (None, None, "")


def test_shipped_heads_names_resolve_to_their_directories(tmp_path, monkeypatch):
    """`--heads medusa1` names the shipped Medusa-1 heads; paths, None and "zero" pass through, and an
    existing local path of the same name wins."""
    d = _heads_dir(tmp_path, choices=[(0,), (0, 0)])
    monkeypatch.setitem(resolve.SHIPPED_HEADS, "medusa1", d)
    monkeypatch.chdir(tmp_path)
    assert resolve.heads_location("medusa1") == d
    assert [resolve.heads_location(x) for x in (None, "zero", d)] == [None, "zero", d]
    heads, tree, _ = resolve.resolve_heads(SimpleNamespace(cfg=CFG), "medusa1")
    assert tree.medusa_choices == ((0,), (0, 0))
    common.preflight(None, "medusa1", "chain2")  # the shipped name passes the early checks
    (tmp_path / "medusa1").mkdir()
    assert resolve.heads_location("medusa1") == "medusa1"


def test_text_streamer_holds_back_partial_characters():
    class Tok:
        pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9 ok"}

        def decode(self, ids, skip_special_tokens=True):
            return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    s = common.TextStreamer(Tok(), stream=out)
    s.push([1])
    s.push([2])
    assert out.getvalue() == "caf"
    s.push([3])
    s.end()
    assert out.getvalue() == "café ok\n"


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_load_first_turns_reads_mt_bench():
    recs = load_first_turns(os.path.join(DATA, "FastChat_mt_bench_question.jsonl"))
    assert len(recs) == 80 and recs[0]["id"] == 81 and recs[0]["category"] == "writing"
    assert recs[0]["prompt"].startswith("Compose an engaging travel blog post")


def test_bench_summary_figures():
    rows = [dict(category="a", new_tokens=100, plain_s=4.0, medusa_s=2.0, medusa_steps=50, hist=[10, 30, 10],
                 identical=True, near_tie=False),
            dict(category="b", new_tokens=60, plain_s=2.0, medusa_s=1.5, medusa_steps=40, hist=[20, 20, 0],
                 identical=True, near_tie=False)]
    s = summarize(rows, depth=2)
    assert s["a"]["speedup"] == 2.0 and s["a"]["tokens_per_step"] == 2.0
    assert s["overall"]["plain_tok_s"] == pytest.approx(160 / 6.0)
    assert s["overall"]["speedup"] == pytest.approx(6.0 / 3.5)
    assert s["a"]["acceptance_per_depth"] == pytest.approx([40 / 50, 10 / 50])
    table = markdown_table(s)
    assert "| overall | 2 |" in table and "2.00x" in table


def test_spec_bench_six_tasks_and_even_per_category_pick():
    from medusa_jax.evals.speed import per_category, spec_bench_groups
    recs = spec_bench_groups(load_first_turns(os.path.join(DATA, "Spec-Bench_question.jsonl")))
    cats = {r["category"] for r in recs}
    assert cats == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    picked = per_category(recs, 20)
    assert len(picked) == 120
    mt = [r for r in picked if r["category"] == "mt_bench"]
    assert len({r["subcategory"] for r in mt}) == 8  # spread over MT-bench's eight categories
    # MT-bench alone keeps its own categories
    mtb = spec_bench_groups(load_first_turns(os.path.join(DATA, "FastChat_mt_bench_question.jsonl")))
    assert len({r["category"] for r in mtb}) == 8
    assert [r["id"] for r in per_category(mtb, 2)][:4] == [81, 86, 91, 96]


def test_speed_note_for_a_tree_predicted_slow_or_larger_than_tune_timed():
    """decode.py and bench warn when tune, on this kind of device, replayed a tree at fewer tokens a
    step than its step costs (c(T) at the step's size, mean over cache sizes), or never timed a
    step as large; nothing for a tree predicted faster, one tune made no replay for, or another
    device's calibration."""
    import jax

    from medusa_jax.decoding.lookup import PromptLookup
    from medusa_jax.decoding.tree import build_tree, get_tree, with_lookup
    from medusa_jax.resolve import speed_note
    tree = build_tree([(0,), (1,)], topk=2)
    dev = str(jax.devices()[0].device_kind)
    costs = {"256": {"2": 1.1, "3": 1.3, "4": 1.5}, "512": {"2": 1.1, "3": 1.1, "4": 1.5}}
    cal = {"device": dev, "chosen_size": 3, "medusa_choices": [[0], [1]], "predicted_by": "replay",
           "rank_accuracies": [[0.5, 0.1]], "predicted_tokens_per_step": 1.1, "cost_by_cache_size": costs}
    note = speed_note(tree, cal)  # replayed 1.1 tokens a step at c(3) = 1.2
    assert "0.92x" in note and "1.20 plain steps" in note and "--no-medusa" in note, note
    assert speed_note(tree, {**cal, "device": "other"}) == "" and speed_note(tree, None) == ""
    assert speed_note(tree, {**cal, "predicted_tokens_per_step": 1.3}) == ""  # faster
    assert speed_note(build_tree([(0,)], topk=2), cal) == ""  # not replayed (rank accuracies only), timed
    # with prompt lookup (k = 3) the static step runs 4 tokens: c(4) = 1.5 against the lookup's replay
    looked = {**cal, "prompt_lookup": PromptLookup(3, 3, 2)._asdict(), "predicted_tokens_per_step_lookup": 1.4}
    assert "0.93x" in speed_note(with_lookup(tree, PromptLookup(3, 3, 2)), looked)
    faster = {**looked, "predicted_tokens_per_step_lookup": 1.6}
    assert speed_note(with_lookup(tree, PromptLookup(3, 3, 2)), faster) == ""
    # a step larger than any tune timed: static (5 tokens with a 4-token copy) and dynamic trees
    note = speed_note(with_lookup(tree, PromptLookup(4, 3, 2)), cal)
    assert "runs 5 tokens a step" in note and "only up to 4 tokens (4 cost 1.50 plain steps; it chose 3)" in note
    assert "--sizes 4,5" in note
    dynamic = get_tree("dynamic:64", topk=10, num_heads=4)
    assert speed_note(dynamic, cal) == ""  # tune timed no dynamic tree: nothing known
    dcal = {**cal, "dynamic_cost_by_cache_size": {"256": {"2": 1.2, "8": 3.2}},
            "dynamic_rows": [{"size": 2, "dynamic": {"budget": 2, "width": 4}, "predicted_tokens_per_step": 1.5}]}
    assert "runs 64 tokens a step" in speed_note(dynamic, dcal) and "8 cost 3.20" in speed_note(dynamic, dcal)
    assert speed_note(get_tree("dynamic:2", topk=10, num_heads=4), dcal) == ""  # 1.5 tokens at c(2) = 1.2
    assert speed_note(get_tree("dynamic:8", topk=10, num_heads=4), dcal) == ""  # timed, never replayed


def test_heads_without_a_tune_report_get_a_note_unless_a_tree_is_given():
    """Heads in the official or vLLM format have no tune report: decoding with their config's tree
    over the whole vocabulary says so, and names the command that tunes them."""
    from medusa_jax.decoding.tree import build_tree
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.resolve import untuned_note

    tree = build_tree([(0,), (1,), (0, 0)], topk=2)
    cfg = MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=32)
    note = untuned_note("/x/heads", (cfg, {}), tree, None)
    assert "no medusa-tune report" in note and f"{tree.size}-token tree" in note and "whole vocabulary" in note
    assert "`medusa-tune --heads /x/heads --proposal-vocab 8192 --out DIR`" in note
    mine = untuned_note("/x/heads", (cfg, {}), tree, None, None, "/my/model")  # the user's own backbone
    assert "`medusa-tune --model /my/model --data DISTILLED --heads /x/heads" in mine and "medusa-distill" in mine
    assert "whole vocabulary" not in untuned_note("/x/heads", (cfg.replace(proposal_vocab_size=16), {}), tree, None)
    for args in (("/x/heads", (cfg, {}), tree, {"device": "cpu"}),  # tuned
                 ("/x/heads", (cfg, {}), tree, None, "chain2"),  # a tree given
                 ("zero", (cfg, {}), tree, None), ("/x/heads", None, tree, None), ("/x/heads", (cfg, {}), None, None)):
        assert untuned_note(*args) == "", args


def test_prompt_files_are_checked_line_by_line(tmp_path):
    """bench, check and decode.py --prompts-file read prompts the same way: line-numbered errors,
    a byte-order mark allowed, the first turn of MT-bench records."""
    cases = {'{"text": "hi"}': "line 2: needs a 'prompt' string", '["a"]': "line 2: expected a JSON object",
             '{"turns": []}': "line 2: needs a 'prompt'", '{"prompt": 5}': "line 2: needs a 'prompt'",
             '{"prompt": "  "}': "line 2: the prompt is empty", "{oops": "line 2: not JSON"}
    for i, (bad, msg) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"prompt": "fine"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            load_first_turns(str(f))
    with pytest.raises(ValueError, match="no prompts"):
        (tmp_path / "empty.jsonl").write_text("\n\n")
        load_first_turns(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="No such file"):
        load_first_turns(str(tmp_path / "missing.jsonl"))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n{"question_id": 3, "turns": ["a", "b"]}\n{"prompt": "c"}\n')
    recs = load_first_turns(str(bom), limit=2)
    assert [(r["index"], r["id"], r["prompt"], r["line"]) for r in recs] == [(0, None, "hi", 1), (1, 3, "a", 2)]


def test_sampling_flags_refuse_nan_and_wrap_prompt_seeds(capsys):
    import argparse

    from medusa_jax.decoding.sampling import prompt_seed, row_keys
    p = argparse.ArgumentParser()
    common.add_acceptance_args(p)
    for argv, msg in [(["--temperature", "nan"], "finite"), (["--temperature", "inf"], "finite"),
                      (["--temperature", "0.7", "--acceptance", "typical", "--posterior-alpha", "nan"], "finite"),
                      (["--seed", str(2 ** 31)], "--seed must be in"), (["--top-k", "-3"], "--top-k must be in")]:
        with pytest.raises(SystemExit):
            common.acceptance_from_args(p, p.parse_args(argv))
        assert msg in capsys.readouterr().err
    assert prompt_seed(2 ** 31 - 1, 2) == 1
    assert row_keys(2 ** 31 - 1, 3)[2].tolist() == row_keys(1, 1)[0].tolist()
