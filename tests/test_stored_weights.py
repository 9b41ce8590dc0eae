"""GGUF weights decoded as the file stores them (issue 32): ``load_model(weights="as-stored")``
keeps Q8_0 / Q4_0 / Q4_1 matrices as `kernels.BlockWeight`, whose values are the float32 load's
bit for bit, and decoding from them gives the float32 model's logits and greedy tokens exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_state_dict, random_heads, random_hf_model, tiny_config
from gguf import GGMLQuantizationType as Q
from test_convert import write_gguf

from medusa_jax import kernels
from medusa_jax.convert import cache
from medusa_jax.convert.load import load_model, stored_weights_apply
from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.tree import get_tree
from medusa_jax.models.layout import decoding_params
from medusa_jax.models.llama import LlamaModel, lm_head_matrix

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the block kernels are unavailable")
#: tests that decode from blocks: only where they are kept (the CPU backend; on a GPU "as-stored"
#: dequantizes at load, as designed, and these tests failed there on the H200, 2026-12-04)
needs_blocks = pytest.mark.skipif(not stored_weights_apply(), reason="blocks are kept on the CPU backend only")

QTYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def tiny_gguf(tmp_path, fmt: str, arch: str = "llama", **overrides):
    cfg = tiny_config(arch, vocab_size=64, **overrides)
    model, _ = random_hf_model(cfg, seed=3)
    return write_gguf(tmp_path / f"tiny-{arch}-{fmt}.gguf", cfg, hf_state_dict(model), qtype=QTYPES[fmt])


def flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kernels.BlockWeight))[0]}


def check_same_weights(stored, dense, fmt):
    """Every tensor of `stored` equals `dense`'s bit for bit: blocks dequantized (and in [out, in]
    where `dense` holds [in, out]); returns how many were blocks."""
    s, d = flat(stored), flat(dense)
    blocks = 0
    for key, w in s.items():
        if isinstance(w, kernels.BlockWeight):
            assert w.fmt == fmt
            blocks += 1
            got = np.asarray(w.dequantize())
            if key.endswith("['kernel_t']"):
                want = np.asarray(d[key[:-len("['kernel_t']")] + "['kernel']"]).T
            else:
                want = np.asarray(d[key])
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(d[key]), err_msg=key)
    return blocks


@needs_blocks
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_blocks_are_the_float32_weights(tmp_path, fmt, arch, tied, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    path = tiny_gguf(tmp_path, fmt, arch, tie_word_embeddings=tied)
    dense = load_model(path, with_tokenizer=False)
    stored = load_model(path, with_tokenizer=False, weights="as-stored")
    cfg = dense.cfg
    # every 2-D tensor is kept as blocks: 7 projections a layer, the embedding, the lm_head if untied
    assert check_same_weights(stored.params, dense.params, fmt) == 7 * cfg.num_layers + 1 + (not tied)
    np.testing.assert_array_equal(np.asarray(lm_head_matrix(cfg, stored.params)),
                                  np.asarray(lm_head_matrix(cfg, dense.params)))


@pytest.mark.slow
@needs_blocks
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_decoding_from_blocks_equals_the_float32_model(tmp_path, fmt, monkeypatch):
    """Prefill (more rows than the kernels take: XLA over the dequantized blocks) and decoding
    steps (the block kernels) give the float32 model's logits exactly; plain and Medusa greedy
    tokens are the float32 model's."""
    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    path = tiny_gguf(tmp_path, fmt, "qwen2", tie_word_embeddings=True)
    dense, stored = load_model(path, with_tokenizer=False), load_model(path, with_tokenizer=False, weights="as-stored")
    cfg = dense.cfg
    pd, ps = decoding_params(dense.params), decoding_params(stored.params)
    assert isinstance(ps["layers_0"]["attn"]["qkv_t"], kernels.BlockWeight)  # fused as blocks
    assert isinstance(ps["layers_0"]["mlp"]["gate_up_t"], kernels.BlockWeight)
    model = LlamaModel(cfg)
    for T in (1, 3, 16, 40):
        toks = jnp.asarray(np.random.default_rng(T).integers(0, 64, (1, T)), jnp.int32)
        pos = jnp.arange(T)[None]
        want = model.apply({"params": pd}, toks, pos)[0]
        got = model.apply({"params": ps}, toks, pos)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"T={T}")
    heads = random_heads(cfg, dense.params, head_type="medusa")
    tree = get_tree("small_8", num_heads=3)
    for prompt in ([1, 5, 9, 3, 7], list(range(3, 40))):
        plain = generate(cfg, dense.params, prompt, max_new_tokens=30, progress=False).tokens
        assert generate(cfg, stored.params, prompt, max_new_tokens=30, progress=False).tokens == plain
        med = generate_device(cfg, stored.params, [prompt], max_new_tokens=30, heads=heads, tree=tree, progress=False)
        assert med.tokens[0, :med.count[0]].tolist() == plain


@needs_blocks
def test_blocks_go_through_the_model_cache(tmp_path, cache_dir):
    path = tiny_gguf(tmp_path, "q4_1")
    first = load_model(path, with_tokenizer=False, weights="as-stored")
    dense = load_model(path, with_tokenizer=False)  # its own entry: the key covers the weights
    assert len(list((cache_dir / "models").iterdir())) == 2
    second = load_model(path, with_tokenizer=False, weights="as-stored")
    a, b = flat(first.params), flat(second.params)
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is type(b[k]), k
        if isinstance(a[k], kernels.BlockWeight):
            assert a[k].fmt == b[k].fmt
            np.testing.assert_array_equal(np.asarray(a[k].blocks), np.asarray(b[k].blocks))
    check_same_weights(second.params, dense.params, "q4_1")
    assert cache.cache_key(path, np.float32) != cache.cache_key(path, np.float32, as_stored=True)


def test_weights_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    path = tiny_gguf(tmp_path, "q8_0")
    with pytest.raises(ValueError, match="weights='q8'.*as-stored, float32"):
        load_model(path, with_tokenizer=False, weights="q8")
    # bfloat16 params are dequantized whatever --weights says (the block kernels are float32)
    low = load_model(path, with_tokenizer=False, weights="as-stored", dtype=jnp.bfloat16)
    assert not any(isinstance(w, kernels.BlockWeight) for w in flat(low.params).values())
    # on another backend (a GPU) float32 "as-stored" is the dequantized model: XLA's products
    from medusa_jax.convert import load as load_module
    monkeypatch.setattr(load_module.jax, "default_backend", lambda: "gpu")
    assert not stored_weights_apply()
    gpu = load_model(path, with_tokenizer=False, weights="as-stored")
    dense = load_model(path, with_tokenizer=False, weights="float32")
    got = flat(gpu.params)
    assert not any(isinstance(w, kernels.BlockWeight) for w in got.values())
    for key, w in flat(dense.params).items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(w), err_msg=key)


def test_block_weight_checks_its_blocks():
    with pytest.raises(ValueError, match="uint8"):
        kernels.BlockWeight(np.zeros((4, 34), np.float32), "q8_0")
    with pytest.raises(ValueError, match=r"\[N, K / 32 \* 20\]"):
        kernels.BlockWeight(np.zeros((4, 34), np.uint8), "q4_1")
    with pytest.raises(ValueError, match="unknown block format"):
        kernels.BlockWeight(np.zeros((4, 34), np.uint8), "q5_0")
    w = kernels.BlockWeight(np.zeros((4, 68), np.uint8), "q8_0")
    assert w.shape == (4, 64) and w.dtype == jnp.float32 and w.nbytes == 272


@needs_blocks
@pytest.mark.real_model
def test_default_model_blocks_are_its_float32_weights(smollm2_path, monkeypatch):
    """Every tensor type of the shipped GGUF (Q4_1 projections, a Q8_0 tied embedding, F32 norms)."""
    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    dense = load_model(smollm2_path, with_tokenizer=False)
    stored = load_model(smollm2_path, with_tokenizer=False, weights="as-stored")
    fmts = {w.fmt for w in flat(stored.params).values() if isinstance(w, kernels.BlockWeight)}
    assert fmts == {"q4_1", "q8_0"}
    s, d = flat(stored.params), flat(dense.params)
    assert s["['embed']['embedding']"].fmt == "q8_0"
    for key, w in s.items():
        if isinstance(w, kernels.BlockWeight):
            want = d[key[:-len("['kernel_t']")] + "['kernel']"].T if key.endswith("['kernel_t']") else d[key]
            np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(want), err_msg=key)
        else:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(d[key]), err_msg=key)


@needs_blocks
@pytest.mark.real_model
def test_check_and_bench_compare_the_blocks_with_the_float32_model(smollm2_path, tmp_path, capsys):
    """medusa-check --reference-weights and medusa-bench --compare-weights on the shipped model:
    Medusa and plain greedy on the GGUF blocks give the float32 model's plain greedy tokens."""
    import json

    from medusa_jax.cli import bench, check

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Name three colours.", "What is 2 + 2?")))
    assert check.main(["--prompts", str(prompts), "--max-new-tokens", "24", "--weights", "as-stored",
                       "--reference-weights", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert (summary["identical"], summary["weights"], summary["reference_weights"]) == (2, "as-stored", "float32")
    assert bench.main(["--prompts", str(prompts), "--max-new-tokens", "16", "--compare-weights", "float32",
                       "--out", str(tmp_path / "b")]) == 0
    result = json.load(open(tmp_path / "b" / "results.json"))
    assert result["conditions"]["weights"] == "as-stored" and result["conditions"]["compare_weights"] == "float32"
    assert result["summary"]["all"]["ref_identical"] == 2


@pytest.mark.slow
@needs_blocks
def test_tune_on_blocks_keeps_a_report_per_kind_of_weights(tmp_path):
    """medusa-tune on a GGUF file's blocks (hydra heads read the embedding's blocks row by row):
    its report says so; a second tune on float32 weights keeps it beside its own."""
    import json

    from conftest import tiny_tune_run

    from medusa_jax.cli import tune
    from medusa_jax.resolve import heads_calibration

    lm, rc = tiny_tune_run(tmp_path, head_type="hydra", gguf=Q.Q8_0, args=["--dynamic-width", "0"])
    assert rc == 0 and isinstance(lm.params["embed"]["embedding"], kernels.BlockWeight)
    first = json.load(open(tmp_path / "tuned" / "config.json"))["tree_search"]
    assert first["weights"] == "as-stored"
    assert tune.main(["--model", str(tmp_path / "model.gguf"), "--weights", "float32", "--heads",
                      str(tmp_path / "tuned"), "--data", str(tmp_path / "data"), "--val-fraction", "0.3",
                      "--sizes", "2,4", "--steps", "2", "--repeats", "1", "--cost-cache-sizes", "64",
                      "--cost-prompt-len", "12", "--dynamic-width", "0", "--out", str(tmp_path / "t2"),
                      "--no-progress"]) == 0
    raw = json.load(open(tmp_path / "t2" / "config.json"))
    assert raw["tree_search"]["weights"] == "float32"
    assert raw["tree_search_by_weights"]["as-stored"] == first
    assert heads_calibration(str(tmp_path / "t2"), "as-stored") == first
    assert heads_calibration(str(tmp_path / "t2"), "float32")["weights"] == "float32"
    # tree_search.md shows both: the newest report first, each with its chosen tree marked
    md = (tmp_path / "t2" / "tree_search.md").read_text()
    assert md.index("# Tree search: float32 weights") < md.index("# Tree search: as-stored weights")
    assert md.count("**(chosen)**") == 2


@needs_blocks
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_proposal_projection_keeps_the_lm_heads_blocks(tmp_path, fmt, monkeypatch):
    """Shared heads with a proposal vocabulary over a backbone whose tied lm_head is GGUF blocks:
    the proposal projection is those rows' blocks (not a bfloat16 copy), their values the float32
    columns bit for bit, the proposals and log-probabilities those of a float32 projection exactly,
    and Medusa greedy decoding with them is plain greedy."""
    from medusa_jax.heads.medusa import HeadsMismatchError, prepare_heads
    from medusa_jax.heads.topk import states_topk
    from medusa_jax.models.llama import lm_head_blocks

    monkeypatch.setenv("MEDUSA_JAX_NO_CACHE", "1")
    path = tiny_gguf(tmp_path, fmt, "qwen2", tie_word_embeddings=True)
    stored = load_model(path, with_tokenizer=False, weights="as-stored")
    cfg = stored.cfg
    hcfg, hp = random_heads(cfg, stored.params, head_type="medusa")
    ids = np.asarray([3, 60, 7, 1, 12, 40, 9, 33, 2, 50, 18, 27], np.int32)
    hcfg, hp = hcfg.replace(proposal_vocab_size=len(ids), topk=4), {**hp, "proposal_ids": ids}
    lm = lm_head_matrix(cfg, stored.params)
    blocks = lm_head_blocks(cfg, stored.params)
    assert isinstance(blocks, kernels.BlockWeight) and blocks.fmt == fmt
    got_cfg, got = prepare_heads(hcfg, hp, lm, lm_head_blocks=blocks)
    _, want = prepare_heads(hcfg, hp, lm, draft_dtype=jnp.float32)
    w = got["proposal_lm_head_t"]
    assert isinstance(w, kernels.BlockWeight) and w.fmt == fmt and w.shape == (len(ids), cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(lm).T[ids])
    assert lm_head_blocks(cfg, load_model(path, with_tokenizer=False).params) is None  # float32 load: no blocks
    with pytest.raises(HeadsMismatchError, match=r"\[V=64, D="):  # blocks of another vocabulary
        prepare_heads(hcfg, hp, lm, lm_head_blocks=kernels.BlockWeight(np.asarray(blocks.blocks)[:10], fmt))
    states = jax.random.normal(jax.random.PRNGKey(0), (3, 2, cfg.hidden_size))
    t_got, lp_got = states_topk(got_cfg, got, states, lm, 4, logprobs=True)
    t_want, lp_want = states_topk(got_cfg, want, states, lm, 4, logprobs=True)
    np.testing.assert_array_equal(np.asarray(t_got), np.asarray(t_want))
    np.testing.assert_array_equal(np.asarray(lp_got), np.asarray(lp_want))
    tree = get_tree("small_8", num_heads=3)
    prompt = list(range(3, 30))
    plain = generate(cfg, stored.params, prompt, max_new_tokens=24, progress=False).tokens
    med = generate_device(cfg, stored.params, [prompt], max_new_tokens=24, heads=(hcfg, hp), tree=tree,
                          progress=False)
    assert med.tokens[0, :med.count[0]].tolist() == plain
