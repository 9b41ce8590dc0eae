"""Loading without torch: the GGUF tokenizer built from the file's metadata, the converted-model
cache, and decode.py's input handling (prompt sources, checks before the model load)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import hf_state_dict, random_hf_model, tiny_config
from test_convert import write_gguf

from medusa_jax.cli import decode
from medusa_jax.cli import common
from medusa_jax.convert import cache
from medusa_jax.convert.load import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world!", "  leading spaces\n\ttabs and\r\nnewlines", "naïve café 日本語 🤖 1234567",
         "def f(x):\n    return x**2  # comment", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", ""]


@pytest.mark.real_model
def test_gguf_tokenizer_equals_transformers(smollm2_path):
    """Our torch-free tokenizer is transformers' own GGUF tokenizer, token for token."""
    from transformers import AutoTokenizer

    from medusa_jax.convert.gguf import open_gguf
    from medusa_jax.convert.gguf_tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(open_gguf(smollm2_path), smollm2_path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.eos_token, ours.bos_token, ours.unk_token) == (ref.eos_token, ref.bos_token, ref.unk_token)
    assert ours.eos_token == "<|im_end|>" and ours.encode("<|im_end|>") == [2]


@pytest.mark.real_model
def test_default_model_loads_and_chats_without_torch(smollm2_path, tmp_path):
    """The base install has no torch: load the default model (first and cached run) and apply the
    chat template in a process where importing torch fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import medusa_jax as mj\n"
        "for _ in range(2):\n"
        "    m = mj.load_model()\n"
        "    ids = mj.apply_chat_template(m.tokenizer, 'What is 2+2?')\n"
        "    assert m.tokenizer.decode(ids[-4:]) == '<|im_start|>assistant\\n', ids\n"
        "    assert 2 in m.cfg.eos_token_ids\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "print('ok', len(ids))\n")
    env = dict(os.environ, MEDUSA_JAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
    assert "PyTorch was not found" not in out.stderr
    assert len(os.listdir(os.path.join(tmp_path, "models"))) == 1  # the second load was a cache hit


def _tiny_gguf(tmp_path, name="tiny.gguf"):
    cfg = tiny_config("llama", vocab_size=64)
    model, _ = random_hf_model(cfg, seed=1)
    return cfg, write_gguf(tmp_path / name, cfg, hf_state_dict(model))


def _leaves(params):
    import jax
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]


def test_cache_hit_returns_the_same_model(tmp_path, cache_dir):
    _, path = _tiny_gguf(tmp_path)
    first = load_model(path, with_tokenizer=False)
    entries = os.listdir(cache_dir / "models")
    assert len(entries) == 1
    with open(cache_dir / "models" / entries[0] / "source.json") as f:
        assert json.load(f)["path"] == os.path.abspath(path)
    second = load_model(path, with_tokenizer=False)
    assert second.cfg == first.cfg
    for a, b in zip(_leaves(first.params), _leaves(second.params)):
        np.testing.assert_array_equal(a, b)
    assert os.listdir(cache_dir / "models") == entries


def test_cache_is_invalidated_by_a_changed_file(tmp_path, cache_dir):
    cfg, path = _tiny_gguf(tmp_path)
    first = load_model(path, with_tokenizer=False)
    model, _ = random_hf_model(cfg, seed=2)  # same shapes, other weights, rewritten in place
    write_gguf(path, cfg, hf_state_dict(model))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    second = load_model(path, with_tokenizer=False)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(first.params), _leaves(second.params)))
    fresh = load_model(path, with_tokenizer=False)
    for a, b in zip(_leaves(second.params), _leaves(fresh.params)):
        np.testing.assert_array_equal(a, b)


def test_damaged_cache_entry_is_converted_again(tmp_path, cache_dir):
    _, path = _tiny_gguf(tmp_path)
    first = load_model(path, with_tokenizer=False)
    entry = cache_dir / "models" / os.listdir(cache_dir / "models")[0]
    victim = sorted((entry / "params").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:40])  # truncated
    again = load_model(path, with_tokenizer=False)
    for a, b in zip(_leaves(first.params), _leaves(again.params)):
        np.testing.assert_array_equal(a, b)
    assert cache.load_cached(path, np.float32) is not None  # rewritten whole


def test_cache_can_be_disabled(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    _, path = _tiny_gguf(tmp_path)
    load_model(path, with_tokenizer=False)
    assert not os.path.exists(cache_dir / "models")


@pytest.mark.parametrize("dtype", ["int8", np.int32, "complex64", "float8_e4m3fn", "no-such-dtype", object])
def test_load_model_refuses_dtypes_it_cannot_compute_in(dtype):
    """An integer, complex or unknown dtype is refused before any file is read (it would truncate
    the weights and fail deep inside decoding), naming the dtypes taken."""
    with pytest.raises(ValueError, match="the weights load as one of float32, bfloat16, float16"):
        load_model("/no/such/model", dtype=dtype)


def test_a_checkpoint_without_its_lm_head_is_named_as_such(tmp_path):
    """Tensors saved from the base model class (``LlamaModel``: no ``model.`` prefix, no lm_head)
    are refused with a message that says so, not as tensors the config does not explain."""
    from medusa_jax.convert.hf import ConversionError, params_from_hf_tensors

    cfg = tiny_config("llama")
    model, _ = random_hf_model(cfg)
    base = {k[len("model."):]: v for k, v in hf_state_dict(model).items() if k.startswith("model.")}
    with pytest.raises(ConversionError, match="without the 'model.' prefix: this is a base model without its "
                                              "language-model head"):
        params_from_hf_tensors(cfg, base)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # transformers 5 makes an empty tokenizer of a qwen config
def test_a_directory_without_tokenizer_files_names_the_way_out(tmp_path, arch):
    """A checkpoint directory without tokenizer files: the message says to copy them in, or to
    load with with_tokenizer=False, which works."""
    from medusa_jax.convert.hf import ConversionError

    model, _ = random_hf_model(tiny_config(arch))
    model.save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match="no tokenizer files .* with_tokenizer=False"):
        load_model(str(tmp_path))
    assert load_model(str(tmp_path), with_tokenizer=False).tokenizer is None


def test_config_round_trip_through_json():
    from conftest import llama3_rope_scaling

    cfg = tiny_config("llama", rope_scaling=llama3_rope_scaling(), eos_token_ids=(3, 5))
    assert cache.config_from_json(json.loads(json.dumps(cache.config_to_json(cfg)))) == cfg
    with pytest.raises(TypeError, match="differ"):
        cache.config_from_json({"arch": "llama"})


# decode.py: where the prompt comes from, and what is checked before the model loads


def test_read_prompt_sources(tmp_path):
    import io

    big = "word " * 30000  # 150 KB: too long for one command-line argument
    f = tmp_path / "p.txt"
    f.write_text(big, encoding="utf-8")
    assert decode.read_prompt(None, str(f)) == big
    # one trailing line end (echo's, an editor's) is not part of the message; the rest of the text is
    assert decode.read_prompt("-", None, stdin=io.StringIO("from stdin\n")) == "from stdin"
    assert decode.read_prompt("-", None, stdin=io.StringIO("two\nlines\r\n")) == "two\nlines"
    assert decode.read_prompt("-", None, stdin=io.StringIO("gap\n\n")) == "gap\n"
    (tmp_path / "q.txt").write_text("Name a colour.\n", encoding="utf-8")
    assert decode.read_prompt(None, str(tmp_path / "q.txt")) == "Name a colour."
    assert decode.read_prompt("keep\n", None) == "keep\n"  # --prompt is taken as given
    assert decode.read_prompt("hello", None) == "hello"
    assert decode.read_prompt(None, None) == decode.DEFAULT_PROMPT
    with pytest.raises(ValueError, match="from standard input is empty"):
        decode.read_prompt("-", None, stdin=io.StringIO("  \n"))
    with pytest.raises(ValueError, match="--prompt-file .*No such file"):
        decode.read_prompt(None, str(tmp_path / "missing.txt"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        decode.read_prompt(None, str(tmp_path / "bin"))


def test_prompt_and_prompt_file_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        decode.parse_args(["--prompt", "a", "--prompt-file", "b"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--heads", "/no/such/heads"], "/no/such/heads: no such file or directory"),
    (["--tree", "no_such_tree"], "unknown tree 'no_such_tree'"),
    (["--heads", "zero", "--tree", "chain5"], "--tree has depth 5 but the heads have only 4"),
    (["--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
])
def test_bad_paths_fail_before_the_model_loads(argv, message, monkeypatch, capsys, tmp_path):
    import medusa_jax.cli.common

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(medusa_jax.cli.common, "load_model", no_load)
    assert decode.main(argv + ["--prompt", "hi"]) == 2
    assert message in capsys.readouterr().err


def test_preflight_checks_our_heads_depth(tmp_path, monkeypatch):
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                   "medusa_choices": [[0], [0, 0]]}))
    (heads / "medusa_lm_head.safetensors").write_bytes(b"")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 16)
    common.preflight(str(model), str(heads), "chain2")
    with pytest.raises(ValueError, match="depth 3 but the heads have only 2"):
        common.preflight(str(model), str(heads), "chain3")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a GGUF file"):
        common.preflight(str(bad), None, None, use_medusa=False)


@pytest.mark.parametrize("tool, argv, message", [
    ("check", ["--prompts", "PROMPTS", "--heads", "/no/such/heads"], "/no/such/heads: no such file"),
    ("check", ["--prompts", "/no/such/prompts.jsonl"], "No such file or directory"),
    ("check", ["--prompts", "PROMPTS", "--heads", "zero", "--tree", "chain5"], "depth 5 but the heads have only 4"),
    ("bench", ["--prompts", "PROMPTS", "--tree", "chain5"],  # the shipped heads (4) of the default model
     "--tree has depth 5 but the heads have only 4; give a shallower --tree"),
    ("bench", ["--prompts", "PROMPTS", "--tree", "no_such_tree"], "unknown tree 'no_such_tree'"),
    ("bench", ["--prompts", "/no/such/prompts.jsonl"], "--prompts /no/such/prompts.jsonl: No such file"),
    ("bench", ["--prompts", "PROMPTS", "--model", "/no/such.gguf"], "--model /no/such.gguf: no such file"),
    ("tune", ["--heads", "/no/such/heads", "--out", "OUT"], "/no/such/heads: no such file"),
])
def test_tools_check_paths_before_the_model_loads(tool, argv, message, monkeypatch, capsys, tmp_path):
    """check, bench and tune fail at once, with one line and exit status 2, on a bad path or tree."""
    import importlib

    import medusa_jax.cli.common
    import medusa_jax.convert.load

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(medusa_jax.convert.load, "load_model", no_load)
    monkeypatch.setattr(medusa_jax.cli.common, "load_model", no_load)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi"]}) + "\n")
    argv = [str(prompts) if a == "PROMPTS" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    try:
        assert importlib.import_module(f"medusa_jax.cli.{tool}").main(argv) == 2
    except SystemExit as e:  # argparse's error(): also one line and status 2
        assert e.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
