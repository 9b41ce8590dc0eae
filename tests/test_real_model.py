"""The real model (SmolLM2-135M-Instruct from its GGUF): greedy decoding against transformers,
Medusa with zero-initialised and with the shipped heads against plain greedy, and the decode.py command."""
import json

import numpy as np
import pytest
import torch

from medusa_jax.chat import apply_chat_template
from medusa_jax.engine.generate import generate
from medusa_jax.decoding.tree import get_tree
from medusa_jax.evals import lossless
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import init_heads
from medusa_jax.models.llama import lm_head_matrix

pytestmark = pytest.mark.real_model

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in two sentences why the sky is blue."]


def test_greedy_matches_transformers_generate(smollm2, smollm2_hf):
    for prompt in PROMPTS:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        ours = generate(smollm2.cfg, smollm2.params, ids, max_new_tokens=64)
        with torch.no_grad():
            out = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                      eos_token_id=list(smollm2.cfg.eos_token_ids), pad_token_id=2)
        theirs = out[0, len(ids):].tolist()
        assert ours.tokens == theirs, prompt
        assert len(ours.tokens) > 5


def test_medusa_zero_heads_equal_plain_greedy(smollm2):
    cfg, params = smollm2.cfg, smollm2.params
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=4)
    heads = (hcfg, init_heads(hcfg, lm_head_matrix(cfg, params)))
    tree = get_tree("small_16", num_heads=4)
    for prompt in PROMPTS[1:]:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        plain = generate(cfg, params, ids, max_new_tokens=64)
        med = generate(cfg, params, ids, max_new_tokens=64, heads=heads, tree=tree)
        c = lossless.compare(cfg, params, ids, plain.tokens, med.tokens)
        assert c.identical or c.near_tie, c
        assert med.steps < len(med.tokens)  # zero heads still accept repeated tokens now and then


@pytest.mark.parametrize("name, head_type", [(None, "hydra"), ("medusa1", "medusa")])
def test_shipped_heads_are_lossless_and_accept(smollm2, name, head_type):
    """Both shipped heads (the default hydra heads and `--heads medusa1`) with their saved trees:
    the output is plain greedy's, token for token, in fewer steps than tokens."""
    from medusa_jax import resolve

    cfg, params = smollm2.cfg, smollm2.params
    heads, tree, note = resolve.resolve_heads(smollm2, name)
    assert note == "" and heads[0].head_type == head_type and heads[0].proposal_vocab_size == 8192
    total = steps = 0
    for prompt in PROMPTS:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        plain = generate(cfg, params, ids, max_new_tokens=48)
        med = generate(cfg, params, ids, max_new_tokens=48, heads=heads, tree=tree)
        c = lossless.compare(cfg, params, ids, plain.tokens, med.tokens)
        assert c.identical or c.near_tie, (prompt, c)
        total, steps = total + len(med.tokens), steps + med.steps
    assert total / steps > 1.15, total / steps


def test_top2_gap_is_the_logit_gap(smollm2):
    ids = apply_chat_template(smollm2.tokenizer, PROMPTS[0])
    from conftest import jax_logits

    from medusa_jax.evals.lossless import top2_gap
    logits = np.sort(jax_logits(smollm2.cfg, smollm2.params, np.asarray([ids]))[0, -1])
    assert abs(top2_gap(smollm2.cfg, smollm2.params, ids) - (logits[-1] - logits[-2])) < 1e-4


def test_decode_cli_json(capsys):
    from medusa_jax.cli import decode
    rc = decode.main(["--no-medusa", "--json", "--max-new-tokens", "32", "--prompt", "What is the capital of France?"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["mean_accepted"] == 1.0 and out["steps"] == out["new_tokens"]
    for key in ("text", "new_tokens", "steps", "mean_accepted", "tokens_per_s", "prefill_s", "decode_s"):
        assert key in out


def test_decode_cli_default_prompt_prints_its_question_first(smollm2, monkeypatch, capsys):
    """`make demo` (decode.py with no prompt) says which question it answers, on stdout before the
    answer; a prompt the user gave is not repeated."""
    from medusa_jax.cli import common, decode
    monkeypatch.setattr(common, "setup_decoding", lambda *a, **k: common.Setup(smollm2, None, None, None, None))
    assert decode.main(["--no-medusa", "--max-new-tokens", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{decode.DEFAULT_PROMPT_LABEL}: {decode.DEFAULT_PROMPT}\n\n"), out
    assert out.split("\n\n", 1)[1].strip()  # then the answer
    assert decode.main(["--no-medusa", "--max-new-tokens", "4", "--no-progress", "--prompt", "Hi"]) == 0
    assert "Question" not in capsys.readouterr().out


def test_decode_cli_rejects_empty_prompt(capsys):
    from medusa_jax.cli import decode
    with pytest.raises(SystemExit) as e:
        decode.main(["--prompt", "   "])
    assert e.value.code == 2
    assert "prompt from --prompt is empty" in capsys.readouterr().err


def test_decode_cli_prompts_file_in_input_order(tmp_path, capsys):
    """--prompts-file: one JSON line per prompt in input order, greedy answers equal to decoding each
    prompt alone, 'turns' records use the first turn, and a prompt longer than the context gets an
    error line while the others are answered (exit status 1)."""
    from medusa_jax.cli import decode
    f = tmp_path / "prompts.jsonl"
    recs = [{"question_id": 7, "turns": ["What is the capital of France?", "And of Spain?"]},
            {"prompt": "Name a prime number larger than 10."},
            {"prompt": "word " * 9000},
            {"id": "x", "prompt": "Say hello in French."}]
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    rc = decode.main(["--prompts-file", str(f), "--batch-size", "2", "--max-new-tokens", "24", "--no-progress"])
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert rc == 1 and err.strip().splitlines()[-1] == \
        "error: 1 of 4 prompts could not be answered (their lines have an 'error' field)", err
    assert [x["index"] for x in lines] == [0, 1, 2, 3] and [x["id"] for x in lines] == [7, None, None, "x"]
    assert "context" in lines[2]["error"] and "text" not in lines[2]
    for x, prompt in zip([lines[0], lines[1], lines[3]], [recs[0]["turns"][0], recs[1]["prompt"], recs[3]["prompt"]]):
        assert decode.main(["--json", "--max-new-tokens", "24", "--prompt", prompt]) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert x["text"] == alone["text"] and x["acceptance"] == "greedy" and x["medusa"]
    # --limit 2: the first two prompts only, answered as above
    assert decode.main(["--prompts-file", str(f), "--limit", "2", "--max-new-tokens", "24", "--no-progress"]) == 0
    first = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [(x["index"], x["id"], x["text"]) for x in first] == [(x["index"], x["id"], x["text"]) for x in lines[:2]]


def test_decode_cli_prompts_file_takes_the_penalties(tmp_path, capsys):
    """--prompts-file with penalties: each answer is the one --prompt gives with the same flags."""
    from medusa_jax.cli import decode
    f = tmp_path / "prompts.jsonl"
    prompts = ["List the colours of the rainbow, then list them again.", "Count from one to twenty."]
    f.write_text("\n".join(json.dumps({"prompt": x}) for x in prompts) + "\n")
    flags = ["--max-new-tokens", "32", "--repetition-penalty", "1.3", "--frequency-penalty", "0.4"]
    assert decode.main(["--prompts-file", str(f), "--no-progress"] + flags) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    for x, prompt in zip(lines, prompts):
        assert decode.main(["--json", "--prompt", prompt] + flags) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert decode.main(["--json", "--prompt", prompt, "--max-new-tokens", "32"]) == 0
        free = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert x["text"] == alone["text"] != free["text"]


def test_decode_cli_sampling_and_flag_errors(tmp_path, capsys):
    from medusa_jax.cli import decode
    rc = decode.main(["--json", "--max-new-tokens", "16", "--temperature", "0.7", "--prompt", "Hi!"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["acceptance"] == "exact" and out["new_tokens"] >= 1
    assert decode.main(["--prompt", "word " * 9000, "--max-new-tokens", "4"]) == 2  # before any decoding
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the prompt has ") and err[-1].endswith("shorten it"), err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    for argv, msg in [(["--batch-size", "2"], "--batch-size goes with --prompts-file"),
                      (["--limit", "2"], "--limit goes with --prompts-file"),
                      (["--prompts-file", str(bad), "--limit", "0"], "--limit must be >= 1, got 0"),
                      (["--acceptance", "greedy", "--temperature", "0.5"], "greedy decodes at temperature 0"),
                      (["--acceptance", "typical"], "give a --temperature > 0"),
                      (["--prompts-file", str(bad)], "line 2: needs a 'prompt' string"),
                      (["--prompts-file", str(tmp_path / "missing.jsonl")], "No such file")]:
        with pytest.raises(SystemExit) as e:
            decode.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err, argv


def test_bench_batch_rows_equal_batch_one_and_check_samples(tmp_path, capsys):
    """bench --batch-size 2: every batched row (plain and Medusa) equals plain greedy at batch 1;
    check --temperature 0.7 reports exact sampling's tokens/step, its answers equal to plain sampling's."""
    from medusa_jax.cli import bench, check
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [t]}) for i, t in
                                 enumerate(["What is the capital of France?", "Name three fruits.",
                                            "Write one sentence about the sea."])) + "\n")
    assert bench.main(["--prompts", str(prompts), "--max-new-tokens", "24", "--batch-size", "2",
                       "--out", str(tmp_path / "b")]) == 0
    res = json.load(open(tmp_path / "b" / "results.json"))
    (b,) = res["batches"]
    assert b["batch_size"] == 2
    for name in ("plain", "medusa"):
        assert b[name]["identical"] + b[name]["near_ties"] == 3 and b[name]["other_differences"] == 0
        assert b[name]["tokens"] == sum(r["new_tokens"] for r in res["rows"])
    assert "| medusa | 2 |" in capsys.readouterr().out
    assert check.main(["--prompts", str(prompts), "--max-new-tokens", "16", "--temperature", "0.7",
                       "--out", str(tmp_path / "c.json")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["acceptance"] == "exact" and summary["prompts"] == 3 and summary["mean_tokens_per_step"] >= 1
    assert summary["identical_to_plain_sampling"] == 3  # exact acceptance: plain sampling's tokens, seed for seed
    # a prompt past the context: one line naming the file's line and id, before any decoding
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "Hi"}) + "\n\n" + json.dumps({"prompt": "word " * 9000, "id": "x7"}) + "\n")
    for main, argv in ((check.main, []), (check.main, ["--temperature", "0.7"]),
                       (bench.main, ["--out", str(tmp_path / "b2")])):
        assert main(["--prompts", str(long), "--max-new-tokens", "4"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: {long}, line 3 (id x7): the prompt, in the chat template, has "), err
        assert "Traceback" not in "\n".join(err)



def test_heads_that_do_not_fit_the_model_get_a_note(smollm2, tmp_path, capsys):
    """Heads whose drafts this model never takes (here the shipped heads' files with random weights,
    as heads trained for another model of the same shape would be): the answer is plain greedy's,
    and decode.py says the drafts were hardly ever accepted, naming the model the heads record; the
    shipped heads on the same prompt get no note."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from medusa_jax import resolve
    from medusa_jax.cli import decode

    heads = tmp_path / "heads"
    shutil.copytree(resolve.DEFAULT_HEADS_DIR, heads)
    fn = heads / "medusa_lm_head.safetensors"
    rng = np.random.default_rng(0)
    save_file({k: (rng.standard_normal(v.shape) * 0.02).astype(v.dtype) for k, v in load_file(str(fn)).items()},
              str(fn))
    argv = ["--max-new-tokens", "64", "--prompt", "Write a short story about a robot.", "--no-progress"]
    texts = []
    for extra in (["--heads", str(heads)], [], ["--no-medusa"]):
        assert decode.main(argv + extra) == 0
        out, err = capsys.readouterr()
        texts.append(out)
        noted = "note: the drafts were hardly ever accepted" in err
        assert noted == (extra[:1] == ["--heads"]), err
        if noted:
            assert "these were trained for SmolLM2-135M-Instruct.Q4_1.gguf" in err
    assert texts[0] == texts[1] == texts[2]
    cal = resolve.heads_calibration(None, "as-stored")
    tree = resolve.resolve_heads(smollm2, None)[1]
    assert resolve.low_acceptance_note(1.02, 200, tree, cal) and not resolve.low_acceptance_note(1.02, 10, tree, cal)
    assert not resolve.low_acceptance_note(1.5, 200, tree, cal) and not resolve.low_acceptance_note(1.02, 200, tree, None)


def test_export_command_writes_what_the_reference_loaders_read(smollm2, tmp_path, capsys):
    """medusa-export: the shipped Medusa-1 heads (shared lm_head, a proposal vocabulary, a tree) to
    the official .pt (per-head copies of the base lm_head, the backbone's id as base model) and to
    vLLM's format (one lm_head with original_lm_head, the proposal vocabulary as token_map): read
    back, the blocks are the heads' and every lm_head is the base's (vLLM's: on the token_map's
    tokens, which stay the proposal vocabulary); what the formats cannot hold is named; hydra heads
    and a non-empty --out are refused in one line."""
    from medusa_jax import resolve
    from medusa_jax.cli import export
    from medusa_jax.convert.medusa_format import load_heads, read_tensors
    from medusa_jax.models.llama import lm_head_matrix

    hcfg, hp = load_heads(resolve.heads_location("medusa1"))
    base = np.asarray(lm_head_matrix(smollm2.cfg, smollm2.params), np.float32)
    for to, name in (("official", "medusa_lm_head.pt"), ("vllm", "model.safetensors")):
        out = tmp_path / to
        extra = ["--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct"] if to == "official" else []
        assert export.main(["--heads", "medusa1", "--to", to, "--out", str(out), "--no-progress"] + extra) == 0
        captured = capsys.readouterr()
        assert f"wrote {hcfg.num_heads} Medusa heads" in captured.out and name in captured.out
        assert "the tree (medusa_choices)" in captured.err
        assert ("proposal vocabulary" in captured.err) is (to == "official")
        lcfg, lp = load_heads(str(out), smollm2.cfg)
        assert lcfg.num_heads == hcfg.num_heads and not lcfg.shared_lm_head
        np.testing.assert_array_equal(lp["blocks_kernel"], hp["blocks_kernel"])
        ids = hp["proposal_ids"] if to == "vllm" else np.arange(base.shape[1])
        assert lcfg.proposal_vocab_size == (hcfg.proposal_vocab_size if to == "vllm" else 0)
        if to == "vllm":
            np.testing.assert_array_equal(lp["proposal_ids"], ids)
            assert "shared (original_lm_head)" in captured.out and "token_map" in captured.out
            t = read_tensors(str(out / name))
            assert "lm_head.weight" in t and t["lm_head.weight"].shape == (len(ids), base.shape[0])
        for h in range(lcfg.num_heads):
            np.testing.assert_array_equal(lp["lm_head"][h][:, ids], base[:, ids])
    raw = json.load(open(tmp_path / "official" / "config.json"))
    assert raw["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "version" not in raw
    assert f"{hcfg.num_heads - 1}.{hcfg.num_layers}.weight" in read_tensors(str(tmp_path / "official" / "medusa_lm_head.pt"))
    own = resolve.heads_location("medusa1")
    for argv, message in ((["--heads", "medusa1", "--to", "vllm", "--out", str(tmp_path / "vllm")],
                           "exists and is not empty"),
                          (["--heads", own, "--to", "official", "--out", own, "--overwrite"],
                           "is the heads' own directory"),
                          (["--heads", str(resolve.DEFAULT_HEADS_DIR), "--to", "vllm", "--out", str(tmp_path / "h")],
                           "these are hydra heads")):
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # vLLM's file is safetensors: an explicit 'pt' is refused, not ignored
        export.main(["--heads", "medusa1", "--to", "vllm", "--file-type", "pt", "--out", str(tmp_path / "v2")])
    assert e.value.code == 2 and "--file-type goes with --to official" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the official format always holds a copy per head
        export.main(["--heads", "medusa1", "--to", "official", "--lm-head-copies", "--out", str(tmp_path / "o2")])
    assert e.value.code == 2 and "--lm-head-copies goes with --to vllm" in capsys.readouterr().err
