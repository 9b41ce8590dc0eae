"""Misused generation arguments get a clear error naming what the argument takes (one checker,
`decoding.args.check_generation_args`, behind every entry point), and no position beyond the model's
context is ever decoded."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax.decoding.args import PromptTooLongError
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.generate import generate, generate_batch, generate_device, generate_stream
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.requests import Request
from medusa_jax.decoding.tree import get_tree
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import HeadsMismatchError, init_heads
from medusa_jax.models.llama import lm_head_matrix

V, CTX = 64, 64
PROMPT = [5, 9, 3, 7]


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama whose context (max_position_embeddings) is 64, and 2 fresh heads with a tree."""
    cfg, params = tiny_decoding_model(V)
    cfg = cfg.replace(max_position_embeddings=CTX)
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=V, num_heads=2)
    heads = (hcfg, init_heads(hcfg, lm_head_matrix(cfg, params)))
    return cfg, params, heads, get_tree("chain2", num_heads=2)


def test_generate_refuses_two_prompts(tiny):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError) as e:
        generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    msg = str(e.value)
    assert msg.startswith("generate() decodes one prompt: pass a list (or 1-D array) of token ids")
    assert "generate_device(prompts=[[...], [...]])" in msg and "got 2 prompts" in msg
    with pytest.raises(ValueError, match=r"generate\(\) decodes one prompt.*got an array of shape \(2, 3\)"):
        generate(cfg, params, np.ones((2, 3), np.int32), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"generate_stream\(\) decodes one prompt"):
        generate_stream(cfg, params, [[1, 2], [3, 4]])  # checked when called, before the first step


def test_generate_device_refuses_a_flat_prompt(tiny):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError) as e:
        generate_device(cfg, params, [1, 2, 3], max_new_tokens=4)
    msg = str(e.value)
    assert msg.startswith("generate_device() takes a batch of prompts: a list of token-id lists")
    assert "for one prompt pass [ids]" in msg and "got a flat sequence of 3 ids" in msg
    with pytest.raises(ValueError, match=r"generate_device\(\) takes a batch of prompts.*shape \(3,\)"):
        generate_device(cfg, params, np.array([1, 2, 3]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"no prompts given"):
        generate_device(cfg, params, [], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"start_state\(\) takes a batch of prompts"):
        start_state(cfg, params, [1, 2, 3], 16)


@pytest.mark.parametrize("entry", ["generate", "generate_stream", "generate_device", "start_state"])
def test_cache_beyond_the_context_is_refused(tiny, entry):
    cfg, params, _, _ = tiny
    calls = {
        "generate": lambda: generate(cfg, params, PROMPT, max_new_tokens=100, cache_size=128),
        "generate_stream": lambda: generate_stream(cfg, params, PROMPT, max_new_tokens=100, cache_size=128),
        "generate_device": lambda: generate_device(cfg, params, [PROMPT], max_new_tokens=100, cache_size=128),
        "start_state": lambda: start_state(cfg, params, [PROMPT], 128),
    }
    with pytest.raises(ValueError) as e:
        calls[entry]()
    msg = str(e.value)
    assert msg.startswith(f"{entry}(): cache_size=128 is outside [1, 64]")
    assert "max_position_embeddings) is 64 positions" in msg and "no position beyond 63" in msg


def test_default_cache_never_passes_the_context(tiny):
    """Asked for more tokens than the context holds, both loops stop at position 63."""
    cfg, params, heads, tree = tiny
    r = generate(cfg, params, PROMPT, max_new_tokens=200)
    assert r.stop_reason == "cache_full" and len(PROMPT) + len(r.tokens) == CTX
    d = generate_device(cfg, params, [PROMPT], max_new_tokens=200, heads=heads, tree=tree, eos_token_ids=())
    assert max(d.cache_sizes) == CTX and len(PROMPT) + int(d.count[0]) == CTX
    assert d.tokens[0, :int(d.count[0])].tolist() == r.tokens
    with pytest.raises(PromptTooLongError, match=r"the prompt has 64 tokens but the model's context "
                       r"\(max_position_embeddings\) holds 64 positions, so it can have at most 63 tokens"):
        generate(cfg, params, [1] * CTX, max_new_tokens=1)
    with pytest.raises(PromptTooLongError, match=r"the prompt has 8 tokens but the KV cache \(cache_size\) holds 8"):
        generate(cfg, params, [1] * 8, max_new_tokens=1, cache_size=8)


def test_the_prompt_room_check_names_the_room_an_answer_needs():
    from medusa_jax.decoding.args import check_prompt_room

    check_prompt_room(63, 64)
    check_prompt_room(64, 64, room=0)  # scored alone, a prompt may fill the context
    check_prompt_room(60, 64, room=4)
    with pytest.raises(PromptTooLongError, match=r"has 65 tokens but the model's context \(max_position_embeddings\) "
                       r"holds 64 positions: shorten it"):
        check_prompt_room(65, 64, room=0)
    with pytest.raises(PromptTooLongError, match=r"so it can have at most 60 tokens \(4 positions are left for an "
                       r"answer\)"):
        check_prompt_room(61, 64, room=4)


def test_every_entry_point_draws_the_prompt_limit_at_the_same_length(tiny):
    """One rule (`args.new_token_room`): a prompt of context - 1 tokens gets one new token from
    generate (with heads and a tree) and generate_batch alike; one of the whole context is refused
    by every entry point up front with the same message, before anything is decoded."""
    cfg, params, heads, tree = tiny
    longest = [1 + i % 7 for i in range(CTX - 1)]
    r = generate(cfg, params, longest, max_new_tokens=5, heads=heads, tree=tree)
    assert len(r.tokens) == 1 and r.stop_reason == "cache_full"
    (_, b), = list(generate_batch(cfg, params, [longest], max_new_tokens=5))
    assert b.tokens == r.tokens
    over = longest + [1]
    for call in (lambda: generate(cfg, params, over, max_new_tokens=1),
                 lambda: list(generate_batch(cfg, params, [longest, over], max_new_tokens=1)),
                 lambda: list(generate_batch(cfg, params, iter([longest, over]), max_new_tokens=1)),
                 lambda: Engine(cfg, params).submit(Request(over, 1))):
        with pytest.raises(PromptTooLongError, match=f"has {CTX} tokens .* at most {CTX - 1} tokens"):
            call()


def test_arrays_are_accepted_as_prompts(tiny):
    cfg, params, _, _ = tiny
    ref = generate(cfg, params, PROMPT, max_new_tokens=6).tokens
    assert len(ref) == 6
    for p in (np.array(PROMPT, np.int32), jnp.array(PROMPT), np.array([PROMPT], np.int64), [PROMPT],
              tuple(np.int64(t) for t in PROMPT)):
        assert generate(cfg, params, p, max_new_tokens=6).tokens == ref
    rows = np.array([PROMPT, [1, 2, 3, 4]], np.int32)
    a = generate_device(cfg, params, rows, max_new_tokens=6)
    b = generate_device(cfg, params, [jnp.array(PROMPT), [1, 2, 3, 4]], max_new_tokens=6)
    assert a.tokens[0].tolist() == ref and a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("prompt, message", [
    ([5, 64, 3], r"generate\(\): token id 64 at position 1 is outside the model's vocabulary \[0, 64\)"),
    ([-1, 2], r"token id -1 at position 0 is outside the model's vocabulary"),
    ("hello", r"generate\(\) takes token ids, not text .*tokenize it first"),
    ([1.0, 2.0], r"the prompt\[0\] \(a token id\) must be an integer, got float 1.0"),
    ([True, 2], r"must be an integer, got the bool True"),
    (np.array([1.0, 2.0]), r"must hold integer token ids, got an array of float64"),
    ([], r"empty prompt"),
    (np.zeros((1, 2, 3), np.int32), r"decodes one prompt.*shape \(1, 2, 3\)"),
])
def test_bad_prompts(tiny, prompt, message):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError, match=message):
        generate(cfg, params, prompt, max_new_tokens=4)


def test_bad_batch_prompts(tiny):
    cfg, params, _, _ = tiny
    with pytest.raises(ValueError, match=r"token id 99 at position 2 of prompt 1 is outside"):
        generate_device(cfg, params, [[1, 2], [3, 4, 99]], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_device(cfg, params, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1 is not a flat list of token ids"):
        generate_device(cfg, params, [[1, 2], [[3, 4]]], max_new_tokens=4)


@pytest.mark.parametrize("kw, message", [
    (dict(max_new_tokens=-3), r"generate\(\): max_new_tokens must be >= 1 \(the most new tokens to generate\), got -3"),
    (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer, got float 2.5"),
    (dict(cache_size=0), r"cache_size=0 is outside \[1, 64\]"),
    (dict(eos_token_ids=[2, 64]), r"eos_token_ids \[2, 64\] must be in the vocabulary \[0, 64\)"),
    (dict(eos_token_ids="2"), r"eos_token_ids takes None, a token id or a list of token ids, got str"),
    (dict(seed=1.5), r"seed must be an integer"),
    (dict(acceptance=0.7), r"acceptance takes a medusa_jax.decoding.acceptance.Acceptance"),
])
def test_bad_arguments(tiny, kw, message):
    cfg, params, _, _ = tiny
    args = dict(max_new_tokens=4)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        generate(cfg, params, PROMPT, **args)
    with pytest.raises(ValueError, match=message.replace(r"generate\(\)", r"generate_device\(\)")):
        generate_device(cfg, params, [PROMPT], **args)


def test_one_eos_id_is_accepted(tiny):
    cfg, params, _, _ = tiny
    ref = generate(cfg, params, PROMPT, max_new_tokens=8, eos_token_ids=())
    eos = ref.tokens[3]
    first = ref.tokens.index(eos)
    out = generate(cfg, params, PROMPT, max_new_tokens=8, eos_token_ids=eos)
    assert out.tokens == ref.tokens[:first + 1] and out.stop_reason == "eos"


def test_heads_and_tree_misuse(tiny):
    cfg, params, heads, tree = tiny
    with pytest.raises(ValueError, match=r"generate\(\): heads given without a tree; pass tree=medusa_jax.decoding.tree.get_tree"):
        generate(cfg, params, PROMPT, max_new_tokens=4, heads=heads)
    with pytest.raises(ValueError, match=r"generate_device\(\): a tree was given without heads"):
        generate_device(cfg, params, [PROMPT], max_new_tokens=4, tree=tree)
    with pytest.raises(ValueError, match=r"tree takes a TreeBuffers .*got str"):
        generate(cfg, params, PROMPT, max_new_tokens=4, heads=heads, tree="chain2")
    with pytest.raises(ValueError, match=r"heads takes \(MedusaConfig, head params\).*got dict"):
        generate(cfg, params, PROMPT, max_new_tokens=4, heads=heads[1], tree=tree)
    with pytest.raises(ValueError, match="tree has depth 3 but the heads have only 2"):
        generate(cfg, params, PROMPT, max_new_tokens=4, heads=heads, tree=get_tree("chain3"))
    other = (heads[0].replace(hidden_size=16), jax.tree_util.tree_map(lambda a: a, heads[1]))
    with pytest.raises(HeadsMismatchError, match=r"hidden size 16 \(heads\) != 32 \(backbone\)"):
        generate_device(cfg, params, [PROMPT], max_new_tokens=4, heads=other, tree=tree)
    # the config fits the backbone, but the params are other heads' (a smaller hidden size)
    narrow = dict(heads[1], blocks_kernel=jnp.zeros((2, 1, 16, 16)), blocks_bias=jnp.zeros((2, 1, 16)))
    with pytest.raises(HeadsMismatchError, match=r"'blocks_kernel' has shape \(2, 1, 16, 16\).*needs \(2, 1, 32, 32\)"):
        generate(cfg, params, PROMPT, max_new_tokens=4, heads=(heads[0], narrow), tree=tree)


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2x"], "DATAxMODEL"),
    (["--mesh", "0x4"], "DATAxMODEL"),
    (["--mesh", "64x64"], "needs 4096 devices, but JAX sees"),
])
def test_mesh_flag_misuse(argv, message, capsys):
    """--mesh is checked before the model is loaded; too few devices names XLA_FLAGS on a CPU."""
    from medusa_jax.cli import decode
    assert decode.main(argv + ["--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "devices" in message:
        assert "xla_force_host_platform_device_count=4096" in err


def test_train_mesh_and_distributed_misuse(capsys, monkeypatch):
    from medusa_jax.cli import train
    from medusa_jax import distributed
    for name in distributed.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert train.main(["--config", "configs/tiny.yaml", "--mesh", "2by4"]) == 2
    assert "mesh: --mesh takes DATAxMODEL" in capsys.readouterr().err
    for kw, message in [(dict(coordinator="127.0.0.1:1"), "also needs --num-processes and --process-id"),
                        (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=2), "outside 0..1"),
                        (dict(num_processes=2), "without a coordinator")]:
        with pytest.raises(ValueError, match=message):
            distributed.initialize(**kw)
    assert distributed.initialize() is False  # no settings: one process


@pytest.mark.parametrize("prog, argv, message", [
    ("medusa-check", ["--tie-gap", "-1"], "--tie-gap must be a finite number >= 0"),
    ("medusa-check", ["--tie-gap", "nan"], "--tie-gap must be a finite number >= 0"),
    ("medusa-check", ["--out", "{tmp}/no-dir/x.json"], "--out {tmp}/no-dir/x.json: no such directory to write it in"),
    ("medusa-check", ["--out", "{tmp}"], "--out {tmp}: is a directory; give a file name"),
    ("medusa-check", ["--heads", "zero", "--num-heads", "0"], "--num-heads must be >= 1"),
    ("medusa-serve", ["--shutdown-grace", "-1"], "--shutdown-grace must be a finite number of seconds >= 0"),
    ("medusa-check", ["--prompt-lookup", "65"], "argument --prompt-lookup: takes the tokens copied per draft, an "
                                               "integer in [0, 64] (0 = off), got '65'"),
    ("medusa-serve", ["--prompt-lookup", "-1"], "argument --prompt-lookup: takes the tokens copied per draft"),
])
def test_check_and_serve_flag_misuse(prog, argv, message, tmp_path, capsys):
    """Bad flags of medusa-check and medusa-serve exit 2 with one line before anything loads (the
    prompts file and the model do not exist)."""
    from medusa_jax.cli import check, serve

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--model", str(tmp_path / "no-model")]
    with pytest.raises(SystemExit) as e:
        if prog == "medusa-check":
            check.main(["--prompts", str(tmp_path / "no-prompts.jsonl")] + argv)
        else:
            serve.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"{prog}: error: " + message.replace("{tmp}", str(tmp_path))), err


def test_serve_says_a_taken_port_before_the_model_loads(monkeypatch, capsys):
    """medusa-serve on a port another server listens on exits 1 with one line naming the address,
    before the model loads (it used to load the model and print "serving ... on http://..." first)."""
    import socket

    from medusa_jax.cli import common, serve

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(common, "setup_decoding", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--port", str(port)]) == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"error: cannot serve on 127.0.0.1:{port}: the port is already in use "
                                        "(another server?); stop it or choose another with --port"], err
    assert "serving" not in out + err


@pytest.mark.parametrize("out, message", [("{tmp}/no-dir/q.json", "no such directory to write it in"),
                                          ("{tmp}", "is a directory; give a file name")])
def test_quality_json_flag_misuse(out, message, tmp_path, capsys):
    """medusa-quality --json that cannot be written exits 2 with one line before anything loads."""
    from medusa_jax.cli import quality

    out = out.replace("{tmp}", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        quality.main(["--tuned", str(tmp_path / "no-run"), "--json", out])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"medusa-quality: error: --json {out}: {message}")


def test_flags_that_have_no_effect_are_noted(capsys, tmp_path):
    """Flags plain or greedy decoding ignores are said so on stderr, not silently dropped."""
    from argparse import Namespace

    from medusa_jax.cli import common
    from medusa_jax.cli.decode import parse_args

    args = Namespace(tree="chain3", acceptance="typical", heads=None)
    assert common.unused_flag_notes(args, use_medusa=True) == []
    notes = common.unused_flag_notes(args, use_medusa=False)
    assert len(notes) == 2 and notes[0].startswith("--tree chain3 has no effect with --no-medusa")
    assert "--acceptance typical has no effect" in notes[1]
    notes = common.unused_flag_notes(Namespace(tree=None, heads="medusa1", prompt_lookup=3), use_medusa=False)
    assert notes == ["--heads medusa1 has no effect with --no-medusa (plain decoding runs no heads)",
                     "--prompt-lookup 3 has no effect with --no-medusa (plain decoding drafts nothing)"]
    assert common.unused_flag_notes(Namespace(prompt_lookup=0), use_medusa=False) == []  # off anyway
    # Medusa-2 heads: their tuned layers are the backbone even with --no-medusa (`load_backbone`)
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "backbone_layers.safetensors").write_bytes(b"")
    notes = common.unused_flag_notes(Namespace(heads=str(tmp_path / "m2")), use_medusa=False)
    assert notes == [f"--no-medusa runs no heads, but decodes with the tuned backbone layers of --heads "
                     f"{tmp_path / 'm2'} (Medusa-2): the tuned model's plain output; leave out --heads for the base "
                     "model's"]
    parse_args(["--prompt", "hi", "--posterior-threshold", "0.2"])
    assert "note: --posterior-threshold 0.2 has no effect with --acceptance greedy" in capsys.readouterr().err
    parse_args(["--prompt", "hi", "--temperature", "0.7", "--acceptance", "typical", "--posterior-alpha", "0.5"])
    assert "note:" not in capsys.readouterr().err
    parse_args(["--prompt", "hi", "--top-p", "0.5"])
    assert "note: --top-p 0.5 has no effect at temperature 0" in capsys.readouterr().err
    parse_args(["--prompt", "hi", "--top-p", "0.5", "--temperature", "0.7"])
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("settings, message", [
    (["tree=nosuch"], "invalid training config: tree: unknown tree 'nosuch': not a file; presets are"),
    (["tree=chain5"], "invalid training config: tree 'chain5' has depth 5 but num_heads is 4: give a tree at most "
                      "4 deep (e.g. chain4) or num_heads >= 5"),
    (["tree={tmp}"], "invalid training config: tree: unknown tree '{tmp}': not a file"),
    (["tree=[1"], "--set tree=[1: the value is not valid YAML: expected ',' or ']'"),
    (["tree=dynamic:8"], "invalid training config: tree: 'dynamic:8' is chosen per step while decoding"),
    (["out_dir={tmp}/file"], "out_dir {tmp}/file: exists and is not a directory; give a directory"),
    (["out_dir={tmp}/file/run"], "out_dir {tmp}/file/run: cannot create the directory"),
    (["hidden_dir={tmp}/file"], "hidden_dir {tmp}/file: exists and is not a directory"),
    (["data={tmp}/no-data"], "data {tmp}/no-data: no samples.jsonl there; make it with `medusa-distill --out"),
    (["model={tmp}/no.gguf"], "model {tmp}/no.gguf: no such file or directory; expected a Hugging Face model"),
    (["model={tmp}/file"], "model {tmp}/file: not a GGUF file"),
])
def test_train_settings_refused_before_training(settings, message, tmp_path, capsys, monkeypatch):
    """A tree the export could not store and an out_dir that cannot hold the run are refused with one
    line and exit 2 before the model loads or anything trains."""
    from medusa_jax.cli import train
    from medusa_jax.train import trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("trained with bad settings"))
    (tmp_path / "file").write_text("x")
    settings = [s.replace("{tmp}", str(tmp_path)) for s in settings]
    argv = ["--config", "configs/tiny.yaml", "--no-progress", "--set", f"out_dir={tmp_path / 'run'}", *settings]
    assert train.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: " + message.replace("{tmp}", str(tmp_path))), err


def test_train_config_file_misuse(tmp_path, capsys):
    """--config that is a directory, missing or not valid YAML: one line naming the file, exit 2."""
    from medusa_jax.cli import train
    from medusa_jax.train.config import TrainConfig, TrainConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\nfoo: : :\n")
    for path, message in [(tmp_path, "cannot read the training config (is a directory); give a YAML file"),
                          (tmp_path / "none.yaml", "cannot read the training config (no such file or directory)"),
                          (bad, "not valid YAML: expected the node content, but found ':' (line 2, column 6)")]:
        assert train.main(["--config", str(path), "--print-config"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {path}: {message}"), err
        with pytest.raises(TrainConfigError, match="^" + str(path)):
            TrainConfig.from_yaml(str(path))


def test_train_stop_at_step_must_be_positive(capsys):
    from medusa_jax.cli import train

    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            train.main(["--config", "configs/tiny.yaml", "--stop-at-step", value])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == \
            f"python train.py: error: --stop-at-step must be >= 1 (the step at which to stop), got {value}"


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**31), got -1"),
    (["--limit", "-3"], "--limit must be an integer >= 1"),
    (["--limit", "0"], "--limit must be an integer >= 1"),
    (["--target-tokens", "0"], "--target-tokens must be an integer >= 1"),
    (["--target-tokens", "-5"], "--target-tokens must be an integer >= 1"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be an integer >= 1"),
    (["--prompts", "{tmp}"], "--prompts {tmp}: is a directory; give a JSONL file"),
    (["--prompts", "{tmp}/none.jsonl"], "--prompts {tmp}/none.jsonl: no such file"),
    (["--out", "{tmp}/file"], "--out {tmp}/file: exists and is not a directory"),
])
def test_distill_flag_misuse(argv, message, tmp_path, capsys, monkeypatch):
    """medusa-distill refuses bad flags by name with exit 2 before the model loads, and writes no
    meta.json, so the corrected command is not refused as "made with different settings"."""
    from medusa_jax.cli import distill as cli
    from medusa_jax.train import distill

    monkeypatch.setattr(distill, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("x")
    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"prompt": "hi"}\n')
    argv = ["--out", str(tmp_path / "out"), "--prompts", str(pool)] + [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("medusa-distill: error: " + message.replace("{tmp}", str(tmp_path))), err
    assert not (tmp_path / "out" / distill.META_FILE).exists()


def test_distill_settings_are_checked_before_the_model_loads(tmp_path, monkeypatch):
    """distill() itself refuses bad settings, an --out that is a file and a pool of no prompts before
    loading the model or writing meta.json."""
    from medusa_jax.train import distill

    monkeypatch.setattr(distill, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out"
    for kw, message in [(dict(max_new_tokens=0), r"distill\(\): max_new_tokens must be an integer >= 1"),
                        (dict(seed=-1), r"distill\(\): seed must be an integer in \[0, 2\*\*31\)"),
                        (dict(temperature=float("inf")), r"distill\(\): temperature must be a finite number"),
                        (dict(limit=0), r"distill\(\): limit must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            distill.distill(str(out), prompts=str(pool), **kw)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        distill.distill(str(tmp_path / "file"), prompts=str(pool))
    with pytest.raises(ValueError, match="is a directory; give a JSONL file"):
        distill.distill(str(out), prompts=str(tmp_path))
    for text, message in [("", "no prompts in"), ("\n\n", "no prompts in"), ("[1]\n", ":1: no 'prompt' string field"),
                          ('{"prompt": "a"}\nnot json\n', ":2: not valid JSON")]:
        pool.write_text(text)
        with pytest.raises(ValueError, match=message):
            distill.distill(str(out), prompts=str(pool))
    assert not (out / distill.META_FILE).exists()


def test_distill_empty_pool_is_an_error(tmp_path, capsys, monkeypatch):
    """An empty prompts file is said so (exit 2) rather than a silent success that writes nothing."""
    from medusa_jax.cli import distill as cli
    from medusa_jax.train import distill

    monkeypatch.setattr(distill, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    pool = tmp_path / "empty.jsonl"
    pool.write_text("")
    assert cli.main(["--out", str(tmp_path / "out"), "--prompts", str(pool)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"error: no prompts in {pool}: give a JSONL file with a 'prompt' field per line"
    assert not (tmp_path / "out" / distill.META_FILE).exists()


def test_distill_no_prompt_that_fits_is_an_error(tmp_path, capsys, monkeypatch):
    """A pool none of whose prompts fits --max-prompt-tokens is said so (exit 2), and the run's empty
    meta.json and samples.jsonl are removed, so the command with a larger limit runs there."""
    import os
    from types import SimpleNamespace

    from medusa_jax.cli import distill as cli
    from medusa_jax.train import distill

    cfg = SimpleNamespace(eos_token_ids=(2,), max_position_embeddings=512)
    monkeypatch.setattr(distill, "load_model", lambda *a, **k: SimpleNamespace(path="/m/x.gguf", cfg=cfg,
                                                                              params=None, tokenizer=None))
    monkeypatch.setattr(distill, "apply_chat_template", lambda tok, text: [1] * 10)
    monkeypatch.setattr(distill, "generate_batch", lambda *a, **k: iter(()))
    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out"
    assert cli.main(["--out", str(out), "--prompts", str(pool), "--max-prompt-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err.startswith(f"error: nothing to distill: no prompt of {pool} fits in --max-prompt-tokens 4 tokens"), err
    assert sorted(os.listdir(out)) == []


def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys):
    """--out is opened for writing up front (root passes os.access for /proc and /sys, where no
    file can be made); a file it created for the test is removed again."""
    from medusa_jax.cli import check

    with pytest.raises(SystemExit) as e:
        check.main(["--prompts", str(tmp_path / "p.jsonl"), "--out", "/proc/no-such-file.json"])
    assert e.value.code == 2
    assert "--out /proc/no-such-file.json: cannot be written" in capsys.readouterr().err
    from argparse import ArgumentParser

    from medusa_jax.cli.common import check_out_file
    check_out_file(ArgumentParser(), str(tmp_path / "new.json"))
    assert not (tmp_path / "new.json").exists()


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": -2}, "num_hidden_layers must be an integer >= 1, got -2"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": 66, "head_dim": None}, r"hidden_size \(66\) must be a multiple of num_attention_heads"),
    ({"vocab_size": "128"}, "vocab_size must be an integer >= 1, got '128'"),
])
def test_config_sizes_that_make_no_model_are_refused(change, message, tmp_path, capsys):
    """A hand-written config.json with impossible sizes is refused naming the field, by the loader
    and by medusa-plan (one line, status 2), not by a crash inside JAX."""
    from conftest import tiny_config

    from medusa_jax.cli import plan
    from medusa_jax.models.config import ModelConfig

    d = {k: v for k, v in dict(tiny_config("llama").to_hf_dict(), **change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert plan.main(["--config", str(tmp_path / "config.json"), "--max-len", "64", "--batch", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")


def test_model_type_is_taken_from_architectures_when_missing():
    from conftest import tiny_config

    from medusa_jax.models.config import ModelConfig, UnsupportedArchitectureError

    d = tiny_config("qwen2").to_hf_dict()
    del d["model_type"]
    assert ModelConfig.from_hf_dict(dict(d, architectures=["Qwen2ForCausalLM"])).arch == "qwen2"
    with pytest.raises(UnsupportedArchitectureError, match="no model_type, and no architectures such as"):
        ModelConfig.from_hf_dict(dict(d, architectures=["GPT2LMHeadModel"]))


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(capsys):
    from medusa_jax.cli import INTERRUPTED, interruptible

    @interruptible
    def main(argv=None) -> int:
        raise KeyboardInterrupt

    assert main() == INTERRUPTED == 130
    assert capsys.readouterr().err.strip() == "interrupted (Ctrl-C)"


def test_a_reader_that_closes_the_output_early_ends_a_command_quietly_with_status_141():
    """``decode.py ... | head -c 10``: a real pipe whose reader goes away; no BrokenPipeError
    traceback, neither from the command nor from the interpreter's last flush at exit."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from medusa_jax.cli import interruptible\n"
            "@interruptible\n"
            "def main():\n"
            "    for i in range(10 ** 6):\n"
            "        sys.stdout.write(f'token {i} '); sys.stdout.flush()\n"
            "        time.sleep(0.001) if i > 100 else None\n"
            "    return 0\n"
            "sys.exit(main())\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10) == b"token 0 to"
    p.stdout.close()
    rc, err = p.wait(timeout=120), p.stderr.read().decode()
    assert (rc, err) == (141, ""), err
