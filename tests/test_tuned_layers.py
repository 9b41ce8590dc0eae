"""Medusa-2's tuned backbone layers (`medusa_jax.convert.tuned_layers`): saved beside the heads,
put into the base model when it loads (every decoding command, through `cli.common`), checked
against the base they were tuned from, and merged into a whole HF directory (`medusa-merge`)."""
import argparse
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from safetensors import safe_open
from safetensors.numpy import save_file

from medusa_jax.convert.hf import expected_hf_shapes, params_from_hf_tensors, save_hf
from medusa_jax.convert.load import load_model
from medusa_jax.convert.medusa_format import save_heads
from medusa_jax.convert.tuned_layers import (LAYERS_FILE, TunedLayersError, apply_tuned_layers, check_before_load,
                                             format_layers, merge_to_hf, read_tuned_layers, save_tuned_layers,
                                             tuned_layers_path)
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import init_heads
from medusa_jax.models.llama import lm_head_matrix

TUNED = [1, 2]  # the top two of three layers


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over "t0".."t{V-1}" (bos t1, eos t2) with a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def random_params(cfg, seed: int, std: float = 0.1):
    """A params tree with every weight normal(0, std) and norm scales 1 + normal(0, std)."""
    rng = np.random.default_rng(seed)
    tensors = {n: (1.0 if "norm" in n else 0.0) + rng.normal(0, std, s).astype(np.float32)
               for n, s in expected_hf_shapes(cfg).items()}
    return params_from_hf_tensors(cfg, tensors)


def perturbed(params, layers, seed: int, std: float = 0.05):
    """A copy of `params` with layers `layers`' leaves moved by normal(0, std)."""
    rng = np.random.default_rng(seed)
    out = dict(params)
    for i in layers:
        out[f"layers_{i}"] = jax.tree_util.tree_map(
            lambda a: np.asarray(a, np.float32) + rng.normal(0, std, np.shape(a)).astype(np.float32),
            params[f"layers_{i}"])
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny 3-layer Llama saved as an HF directory with a tokenizer (``base``), zero heads with its
    layers 1-2 tuned (``heads``), and the tuned params (numpy)."""
    root = tmp_path_factory.mktemp("medusa2")
    cfg = tiny_config(num_layers=3)
    base_dir = str(root / "base")
    save_hf(base_dir, cfg, random_params(cfg, 0), tiny_tokenizer(cfg.vocab_size))
    base = load_model(base_dir)
    tuned = perturbed(base.params, TUNED, seed=1)
    heads_dir = str(root / "heads")
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=3, num_layers=1)
    save_heads(heads_dir, hcfg, init_heads(hcfg, lm_head_matrix(base.cfg, base.params)))  # zero heads
    save_tuned_layers(heads_dir, base.cfg, base.params, tuned, TUNED, base_dir)
    return argparse.Namespace(root=root, cfg=base.cfg, base_dir=base_dir, base=base, heads=heads_dir, tuned=tuned)


def assert_tree_equal(a, b):
    fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)), p


def test_round_trip_gives_the_tuned_layers_and_shares_the_rest(run):
    meta = read_tuned_layers(run.heads)
    assert meta["layers"] == TUNED and meta["base_model"] == "base"  # a name, not this machine's path
    assert (meta["arch"], meta["num_layers"], meta["hidden_size"], meta["vocab_size"]) == ("llama", 3, 64, 128)
    with safe_open(os.path.join(run.heads, LAYERS_FILE), framework="numpy") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == np.float32 for n in names)
    assert names == {n for n in expected_hf_shapes(run.cfg) if n.startswith(("model.layers.1.", "model.layers.2."))}

    out = apply_tuned_layers(run.base, run.heads)
    assert out.tuned_layers == os.path.join(run.heads, LAYERS_FILE) and run.base.tuned_layers is None
    for i in TUNED:
        assert_tree_equal(out.params[f"layers_{i}"], run.tuned[f"layers_{i}"])
    for k in out.params:
        if k not in ("layers_1", "layers_2"):
            assert out.params[k] is run.base.params[k]  # shared, not copied
    assert not np.array_equal(out.params["layers_2"]["mlp"]["up_proj"]["kernel"],
                              run.base.params["layers_2"]["mlp"]["up_proj"]["kernel"])
    # applying to a model that already holds them (a merged one) changes nothing
    again = apply_tuned_layers(out, run.heads)
    assert again.params is out.params


def test_paths_and_formats(run, tmp_path):
    layers_file = os.path.join(run.heads, LAYERS_FILE)
    assert tuned_layers_path(run.heads) == layers_file
    assert tuned_layers_path(os.path.join(run.heads, "config.json")) == layers_file
    assert tuned_layers_path(layers_file) == layers_file
    for nothing in (None, "zero", "medusa1", str(tmp_path)):
        assert tuned_layers_path(nothing) is None
    assert read_tuned_layers(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="frozen backbone"):
        apply_tuned_layers(run.base, str(tmp_path))
    assert format_layers([28, 29]) == "28-29" and format_layers([3]) == "3" and format_layers([4, 1, 3]) == "1, 3-4"
    with pytest.raises(ValueError, match="not a decoder layer index"):
        save_tuned_layers(str(tmp_path), run.cfg, run.base.params, run.tuned, [3], "base")


def test_bfloat16_base_is_checked_and_tuned_in_its_dtype(run):
    base16 = load_model(run.base_dir, dtype=jnp.bfloat16, with_tokenizer=False)
    out = apply_tuned_layers(base16, run.heads)
    w = out.params["layers_1"]["attn"]["q_proj"]["kernel"]
    assert w.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(w), np.asarray(run.tuned["layers_1"]["attn"]["q_proj"]["kernel"]).astype(w.dtype))


def test_layers_tuned_from_another_base_are_refused(run, tmp_path):
    other = dataclasses.replace(run.base, params=perturbed(run.base.params, [2], seed=5, std=1e-3))
    with pytest.raises(TunedLayersError, match="tuned from another base model") as e:
        apply_tuned_layers(other, run.heads)
    assert "pass --model the base they were trained on" in str(e.value) and "\n" not in str(e.value)
    # a layer that was not tuned may differ (only the tuned layers' base is checked)
    apply_tuned_layers(dataclasses.replace(run.base, params=perturbed(run.base.params, [0], seed=5)), run.heads)
    # before the model loads, from an HF directory's files
    save_hf(str(tmp_path / "other"), other.cfg, other.params)
    with pytest.raises(TunedLayersError, match="tuned from another base model"):
        check_before_load(run.heads, str(tmp_path / "other"))
    assert check_before_load(run.heads, run.base_dir)["layers"] == TUNED
    # another architecture
    small = tiny_config(num_layers=2)
    save_hf(str(tmp_path / "small"), small, random_params(small, 0))
    with pytest.raises(TunedLayersError, match="tuned for a llama model with 3 layers"):
        check_before_load(run.heads, str(tmp_path / "small"))


def _copy_heads(run, tmp_path):
    d = tmp_path / "heads"
    shutil.copytree(run.heads, d)
    return str(d), str(d / LAYERS_FILE)


def _rewrite(fn, change):
    with safe_open(fn, framework="numpy") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    tensors, meta = change(tensors, meta)
    save_file(tensors, fn, metadata=meta)


@pytest.mark.parametrize("defect, message", [
    ("flip", "do not match the checksum it was saved with: the file is corrupted"),
    ("truncate", "not a valid safetensors file"),
    ("no_meta", "no 'medusa_jax' metadata"),
    ("bad_meta", "metadata's 'sha256' is None"),
    ("missing", "missing tensor(s) ['model.layers.2.self_attn.v_proj.weight']"),
    ("extra", "unexpected tensor(s) ['model.layers.0.input_layernorm.weight']"),
    ("shape", "has shape (32,), but the model"),
])
def test_damaged_files_are_refused(run, tmp_path, defect, message):
    heads, fn = _copy_heads(run, tmp_path)
    if defect == "flip":
        data = bytearray(open(fn, "rb").read())
        data[-5] ^= 0x40
        open(fn, "wb").write(bytes(data))
    elif defect == "truncate":
        data = open(fn, "rb").read()
        open(fn, "wb").write(data[:len(data) // 2])
    elif defect == "no_meta":
        _rewrite(fn, lambda t, m: (t, {"format": "pt"}))
    elif defect == "bad_meta":
        _rewrite(fn, lambda t, m: (t, {**m, "medusa_jax": json.dumps({**json.loads(m["medusa_jax"]), "sha256": None})}))
    elif defect == "missing":
        _rewrite(fn, lambda t, m: ({k: v for k, v in t.items() if k != "model.layers.2.self_attn.v_proj.weight"}, m))
    elif defect == "extra":
        _rewrite(fn, lambda t, m: ({**t, "model.layers.0.input_layernorm.weight": np.ones(64, np.float32)}, m))
    elif defect == "shape":
        _rewrite(fn, lambda t, m: ({**t, "model.layers.1.input_layernorm.weight": np.ones(32, np.float32)}, m))
    with pytest.raises(TunedLayersError) as e:
        apply_tuned_layers(run.base, heads)
    assert message in str(e.value) and fn in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TunedLayersError, match="the file is corrupted" if defect == "flip" else None):
        check_before_load(heads, run.base_dir)


@pytest.mark.slow
def test_merged_directory_loads_in_transformers_with_the_same_logits(run, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tuned = apply_tuned_layers(run.base, run.heads)
    out = str(tmp_path / "merged")
    assert merge_to_hf(tuned, out) == out
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).convert_tokens_to_ids("t7") == 7
    tokens = np.random.default_rng(0).integers(0, run.cfg.vocab_size, (2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
    ours = np.asarray(tuned.model.apply({"params": tuned.params}, jnp.asarray(tokens), jnp.asarray(positions))[0])
    with torch.no_grad():
        theirs = hf(input_ids=torch.as_tensor(tokens.astype(np.int64))).logits.float().numpy()
    assert np.max(np.abs(ours - theirs)) <= 1e-4
    # in float64 (ours entirely but the RoPE tables; transformers keeps its RMSNorm, softmax and RoPE in
    # float32 whatever the dtype) the two agree closer than float32 can (5.3e-7 here, against 1.8e-6)
    with jax.enable_x64(True):
        params64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tuned.params)
        ours64 = np.asarray(tuned.model.apply({"params": params64}, jnp.asarray(tokens), jnp.asarray(positions))[0])
    with torch.no_grad():
        theirs64 = hf.double()(input_ids=torch.as_tensor(tokens.astype(np.int64))).logits.numpy()
    assert ours64.dtype == np.float64 and theirs64.dtype == np.float64
    assert np.max(np.abs(ours64 - theirs64)) <= 1e-6
    base_logits = np.asarray(run.base.model.apply({"params": run.base.params}, jnp.asarray(tokens),
                                                  jnp.asarray(positions))[0])
    assert np.max(np.abs(base_logits - theirs)) > 1e-3  # the tuned layers matter
    # load_model reads it back exactly, and the heads' layers are found already in place
    merged = load_model(out, with_tokenizer=False)
    assert_tree_equal(merged.params, tuned.params)
    assert apply_tuned_layers(merged, run.heads).params is merged.params
    with pytest.raises(FileExistsError, match="not empty"):
        merge_to_hf(tuned, out)
    with pytest.raises(ValueError, match="holds Medusa heads"):
        merge_to_hf(tuned, run.heads, overwrite=True)


@pytest.mark.slow
def test_the_real_model_merged_gives_transformers_the_same_logits(smollm2, tmp_path):
    """Issue 31 on SmolLM2-135M: the model with its top layer tuned (moved by seeded noise: the merge
    does not care how), merged into an HF directory and loaded by transformers, gives our logits on a
    chat to 1e-4 in float64 (each side's float64 forward; 2.2e-5 measured on 861 tokens, from
    transformers' float32 RMSNorm and softmax). In float32 each forward sits ~8.5e-5 from the
    float64 logits, and the two up to 1.3e-4 from each other (docs/performance.md), so float32 gets a
    looser sanity bound."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tuned = dataclasses.replace(smollm2, params=perturbed(smollm2.params, [smollm2.cfg.num_layers - 1], 3, 0.01))
    out = merge_to_hf(tuned, str(tmp_path / "merged"))
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers and "
                                                  "explain why each is prime."}], tokenize=False,
                                                 add_generation_prompt=True) + "Here are three prime numbers: 2, 3"
    ids = np.asarray(smollm2.tokenizer(text)["input_ids"], np.int32)[None]
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

    def ours(model, float64=False):
        params = model.params
        if float64:
            params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        return np.asarray(model.model.apply({"params": params}, jnp.asarray(ids), positions)[0], np.float64)

    with jax.enable_x64(True):
        ours64 = ours(tuned, float64=True)
    assert np.abs(ours64 - ours(smollm2)).max() > 1e-2  # the tuned layer matters
    t = torch.as_tensor(ids.astype(np.int64))
    with torch.no_grad():
        theirs64 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, local_files_only=True)(t).logits
        theirs32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)(t).logits
    assert np.abs(ours64 - theirs64.numpy()).max() <= 1e-4
    assert np.abs(ours(tuned) - theirs32.double().numpy()).max() <= 5e-4


def test_setup_decoding_uses_the_layers_and_medusa_stays_lossless(run, capsys):
    """The heads directory names the backbone: setup_decoding puts the tuned layers in (with Medusa
    off too), and greedy Medusa with the zero heads equals plain greedy on the tuned model."""
    from medusa_jax.cli import common
    from medusa_jax.engine.generate import generate

    args = argparse.Namespace(model=run.base_dir, heads=run.heads, tree="chain3", dtype="float32", mesh=None,
                              prompt_lookup=0)
    plain_setup = common.setup_decoding(args, use_medusa=False, progress=False)
    assert f"using the tuned backbone layers 1-2 from {run.heads} (Medusa-2)" in capsys.readouterr().err
    assert plain_setup.heads is None
    assert_tree_equal(plain_setup.model.params["layers_2"], run.tuned["layers_2"])
    model, heads, tree, note, _ = common.setup_decoding(args, progress=False)
    assert heads is not None and tree.size == 4 and not note
    assert_tree_equal(model.params["layers_1"], run.tuned["layers_1"])
    prompt = [1, 5, 9, 3, 7, 11]
    plain = generate(model.cfg, model.params, prompt, max_new_tokens=24, eos_token_ids=())
    medusa = generate(model.cfg, model.params, prompt, max_new_tokens=24, heads=heads, tree=tree, eos_token_ids=())
    assert medusa.tokens == plain.tokens and len(plain.tokens) == 24
    assert medusa.steps < plain.steps  # zero heads propose the model's own guesses: some are accepted


def test_decode_fails_before_loading_on_a_corrupt_file(run, tmp_path, monkeypatch, capsys):
    import medusa_jax.cli.common
    from medusa_jax.cli import decode

    heads, fn = _copy_heads(run, tmp_path)
    data = bytearray(open(fn, "rb").read())
    data[-5] ^= 0x40
    open(fn, "wb").write(bytes(data))

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the tuned layers were checked")

    monkeypatch.setattr(medusa_jax.cli.common, "load_model", no_load)
    assert decode.main(["--model", run.base_dir, "--heads", heads, "--no-medusa", "--prompt", "t5"]) == 2
    err = capsys.readouterr().err
    assert "the file is corrupted" in err and "Traceback" not in err


def test_merge_command(run, tmp_path, capsys):
    from medusa_jax.cli import merge

    out = str(tmp_path / "merged")
    assert merge.main(["--heads", run.heads, "--out", out, "--model", run.base_dir, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert f"python decode.py --model {out} --heads {run.heads}" in captured.out
    assert "using the tuned backbone layers 1-2" in captured.err
    merged = load_model(out)
    assert merged.tokenizer is not None
    assert_tree_equal(merged.params["layers_2"], run.tuned["layers_2"])
    assert_tree_equal(merged.params["layers_0"], run.base.params["layers_0"])

    other = str(tmp_path / "other")
    save_hf(other, run.cfg, perturbed(run.base.params, [2], seed=5, std=1e-3))
    for argv, message in [
        (["--heads", str(tmp_path / "none"), "--out", str(tmp_path / "o1")], "no such file or directory"),
        (["--heads", str(tmp_path), "--out", str(tmp_path / "o2")], f"no {LAYERS_FILE}"),
        (["--heads", run.heads, "--out", out, "--model", run.base_dir], "exists and is not empty"),
        (["--heads", run.heads, "--out", str(tmp_path / "o3"), "--model", other], "tuned from another base model"),
        (["--heads", run.heads, "--out", str(tmp_path / "o4"), "--model", str(tmp_path / "x")], "--model"),
    ]:
        assert merge.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
