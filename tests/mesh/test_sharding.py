"""Decoding and training on a ('data', 'model') device mesh equal one device (issue 11).

These run in a pytest process with 8 simulated CPU devices (tests/test_mesh.py starts it). A split product sums in
another order than one device's, so a greedy output may differ only where the one-device path has
a float32 near-tie at the first differing token (`evals.lossless.compare`, as in `check`); training steps
must agree within 1e-5 relative.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_heads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from medusa_jax import sharding
from medusa_jax.engine.generate import generate, generate_batch, generate_device
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.tree import build_tree
from medusa_jax.evals.lossless import compare
from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import LlamaModel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

TREE = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


@pytest.fixture(scope="module")
def model():
    """A tiny GQA Llama whose heads (16 query, 8 KV), MLP and vocabulary divide by 8, and 3 random
    non-zero Medusa heads; the small vocabulary makes random heads right often enough that the
    tree accepts candidates (the accepted path's KV entries are compacted on the mesh too)."""
    cfg = ModelConfig(vocab_size=16, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=16,
                      num_kv_heads=8, max_position_embeddings=1024, eos_token_ids=())
    params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    params = jax.tree_util.tree_map(lambda a: a * 3 if a.ndim == 2 else a, params["params"])
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 16, size=n)] for n in (5, 9, 17, 3)]
    return cfg, params, random_heads(cfg, params, 3), prompts


def assert_same(cfg, params, prompt, ref, out, what):
    c = compare(cfg, params, prompt, list(ref), list(out))
    assert c.identical or c.near_tie, f"{what}: differs at token {c.first_diff} (top-2 gap {c.gap})"


@pytest.fixture(scope="module")
def one_device(model):
    """One device's plain and Medusa outputs, batch 4, 150 new tokens (the cache grows from 128
    to 256 slots on the way)."""
    cfg, params, heads, prompts = model
    return {name: generate_device(cfg, params, prompts, max_new_tokens=150, heads=h, tree=TREE if h else None,
                                  progress=False) for name, h in (("plain", None), ("medusa", heads))}


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4), (8, 1)])
def test_decoding_on_mesh_equals_one_device(model, one_device, mesh_shape):
    cfg, params, heads, prompts = model
    mesh = sharding.make_mesh(*mesh_shape)
    sp = sharding.shard_params(params, mesh)
    q = sp["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "model") and q.addressable_shards[0].data.shape == (128, 128 // mesh_shape[1])
    for name, h in (("plain", None), ("medusa", heads)):
        ref = one_device[name]
        out = generate_device(cfg, sp, prompts, max_new_tokens=150, heads=h, tree=TREE if h else None, progress=False)
        assert out.cache_sizes == ref.cache_sizes == (128, 256)
        for b, p in enumerate(prompts):
            assert_same(cfg, params, p, ref.tokens[b, :ref.count[b]], out.tokens[b, :out.count[b]],
                        f"{mesh_shape} {name} row {b}")
        if h is not None:
            assert ref.hist[1:].sum() > 10, "the random heads should get some candidates accepted"
            assert out.steps == ref.steps


def test_batch_and_stream_on_mesh(model):
    cfg, params, heads, prompts = model
    sp = sharding.shard_params(params, sharding.make_mesh(2, 4))
    ref = generate_device(cfg, params, prompts, max_new_tokens=40, heads=heads, tree=TREE, progress=False)
    got = dict(generate_batch(cfg, sp, prompts, batch_size=2, max_new_tokens=40, heads=heads, tree=TREE,
                              progress=False))
    for b, p in enumerate(prompts):
        assert_same(cfg, params, p, ref.tokens[b, :ref.count[b]], got[b].tokens, f"generate_batch row {b}")
    one = generate(cfg, sp, prompts[2], max_new_tokens=40, heads=heads, tree=TREE, progress=False)
    assert_same(cfg, params, prompts[2], ref.tokens[2, :ref.count[2]], one.tokens, "generate")


def test_prompt_logprobs_on_mesh_equal_one_device(model):
    """A completion's echo scores its prompt on the params' mesh as on one device."""
    from medusa_jax.decoding.prompt_logprobs import prompt_logprobs

    cfg, params, _, prompts = model
    prompt = prompts[2] * 3
    ref = prompt_logprobs(cfg, params, prompt, top=2, chunk_size=16)
    got = prompt_logprobs(cfg, sharding.shard_params(params, sharding.make_mesh(2, 4)), prompt, top=2, chunk_size=16)
    np.testing.assert_allclose([e.logprob for e in got[1:]], [e.logprob for e in ref[1:]], atol=1e-4)
    assert [e.top[0][0] for e in got[1:]] == [e.top[0][0] for e in ref[1:]]


def test_kv_cache_follows_the_heads(model):
    cfg, params, _, prompts = model
    mesh = sharding.make_mesh(2, 4)
    st = start_state(cfg, sharding.shard_params(params, mesh), prompts, 128, progress=False)
    want = NamedSharding(mesh, P(None, "data", "model", None, None))
    assert st.cache.k.sharding.is_equivalent_to(want, 5) and st.cache.v.sharding.is_equivalent_to(want, 5)
    # each device holds a quarter of the KV heads of half the rows
    assert st.cache.k.addressable_shards[0].data.shape == (2, 2, 2, 128, 8)


def test_rules_cover_backbone_and_heads(model):
    cfg, params, heads, _ = model
    mesh = sharding.make_mesh(2, 4)
    sp = sharding.shard_params(params, mesh)
    spec = lambda a: a.sharding.spec
    layer = sp["layers_1"]
    assert spec(layer["attn"]["k_proj"]["kernel"]) == P(None, "model")
    assert spec(layer["attn"]["o_proj"]["kernel"]) == P("model", None)
    assert spec(layer["mlp"]["up_proj"]["kernel"]) == P(None, "model")
    assert spec(layer["mlp"]["down_proj"]["kernel"]) == P("model", None)
    assert spec(layer["input_norm"]["scale"]) == P()
    assert spec(sp["embed"]["embedding"]) == P("model", None)
    hp = sharding.shard_params(heads[1], mesh)
    assert spec(hp["blocks_kernel"]) == P(None, None, None, "model")
    assert spec(hp["blocks_bias"]) == P(None, None, "model")
    own = sharding.shard_params({"lm_head": np.zeros((3, 128, 16), np.float32),
                                 "proposal_lm_head_t": np.zeros((12, 128), np.float32),
                                 "path_kernel_1": np.zeros((2, 128, 128), np.float32)}, mesh)
    assert spec(own["lm_head"]) == P(None, None, "model")
    assert spec(own["proposal_lm_head_t"]) == P("model", None)   # 12 rows divide by 4
    assert spec(own["path_kernel_1"]) == P(None, None, "model")
    # a dimension the axis does not divide is replicated; optimizer states follow their params
    assert sharding.spec_for("lm_head/kernel", (128, 10), mesh) == P(None, None)
    assert sharding.spec_for("0/mu/layers_0/mlp/gate_proj/kernel", (128, 128), mesh) == P(None, "model")


def test_mesh_errors(model):
    cfg = model[0]
    with pytest.raises(ValueError, match="needs 16 devices, but JAX sees 8.*xla_force_host_platform_device_count=16"):
        sharding.make_mesh(4, 4)
    for bad in ("2", "2x", "0x4", "axb", "2x4x1"):
        with pytest.raises(ValueError, match="DATAxMODEL"):
            sharding.parse_mesh(bad)
    assert sharding.parse_mesh(" 2X4 ") == (2, 4)
    assert sharding.mesh_from_arg("1x1") is None
    smol = cfg.replace(num_heads=9, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"9 query heads, 3 KV heads.*sizes that work: 1, 3"):
        sharding.check_model_axis(smol, 8)
    sharding.check_model_axis(smol, 3)
    sp = sharding.shard_params(model[1], sharding.make_mesh(1, 8))
    with pytest.raises(ValueError, match="does not divide"):
        generate(smol, sp, [1, 2, 3], max_new_tokens=2, progress=False)


def test_qwen3_decoding_on_mesh_equals_one_device():
    """A Qwen3 backbone (per-head q/k norms, head_dim 32 where hidden / heads is 8, tied
    embeddings): the norms' [Dh] scales are replicated, the heads split on 'model', and plain and
    Medusa decoding on a 2x4 mesh equal one device."""
    cfg = ModelConfig(arch="qwen3", vocab_size=16, hidden_size=128, intermediate_size=128, num_layers=2,
                      num_heads=16, num_kv_heads=8, head_dim=32, tie_word_embeddings=True,
                      max_position_embeddings=1024, eos_token_ids=())
    params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.random.uniform(next(keys), a.shape, minval=0.5, maxval=1.5)
        if path[-1].key == "scale" else (a * 3 if a.ndim == 2 else a), params["params"])
    heads = random_heads(cfg, params, 3)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 16, size=n)] for n in (5, 9, 17, 3)]
    sp = sharding.shard_params(params, sharding.make_mesh(2, 4))
    attn = sp["layers_0"]["attn"]
    assert attn["q_norm"]["scale"].sharding.is_fully_replicated and attn["k_norm"]["scale"].sharding.is_fully_replicated
    assert attn["q_proj"]["kernel"].sharding.spec == P(None, "model")
    assert attn["q_proj"]["kernel"].addressable_shards[0].data.shape == (128, 16 * 32 // 4)
    for h in (None, heads):
        ref = generate_device(cfg, params, prompts, max_new_tokens=60, heads=h, tree=TREE if h else None,
                              progress=False)
        out = generate_device(cfg, sp, prompts, max_new_tokens=60, heads=h, tree=TREE if h else None,
                              progress=False)
        for b, p in enumerate(prompts):
            assert_same(cfg, params, p, ref.tokens[b, :ref.count[b]], out.tokens[b, :out.count[b]],
                        f"qwen3 {'medusa' if h else 'plain'} row {b}")


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(float(np.max(np.abs(np.asarray(a)))), 1e-30))


@pytest.mark.parametrize("mode", ["frozen", "joint"])
def test_training_step_on_2x4_equals_one_device(mode):
    import dp_step

    ref = dp_step.one_step(mode)
    out = dp_step.one_step(mode, sharding.make_mesh(2, 4))
    assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    a, b = dp_step.flat(ref["params"]), dp_step.flat(out["params"])
    assert a.keys() == b.keys() and len(a) >= (2 if mode == "frozen" else 20)
    worst = max(a, key=lambda k: _rel(a[k], b[k]))
    assert _rel(a[worst], b[worst]) <= 1e-5, worst


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _run_processes(argvs, timeout: int = 300):
    """Start one process per argv (one simulated CPU device each) and wait; returns their logs.
    Fails the test when one exits non-zero or they do not finish in time."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv in argvs]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the processes did not finish in {timeout} s")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return logs


def test_train_py_two_processes_equals_one(tmp_path):
    """train.py joint mode (heads and backbone) as 2 processes on a 2x1 mesh (`--coordinator`,
    `--num-processes`, `--process-id`), with an Orbax checkpoint on the way: process 0 exports the
    same heads and backbone as a single-process run (1e-5 relative); process 1 writes nothing."""
    from medusa_jax.convert.medusa_format import load_heads

    common = ["train.py", "--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--no-progress", "--set",
              "steps=4", "mode=joint", "checkpoint_every=2", "eval_every=0", "adam_eps=1e-3", "tree=small_8",
              "max_kl=100"]
    port = _free_port()
    logs = _run_processes([[sys.executable] + common + [f"out_dir={tmp_path / 'two'}", "--mesh", "2x1",
                                                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                                        "--process-id", str(i)] for i in range(2)])
    assert "process 1: trained 4 steps; process 0 wrote the heads" in logs[1]
    _run_processes([[sys.executable] + common + [f"out_dir={tmp_path / 'one'}"]])
    for part in ("heads", "backbone"):
        assert (tmp_path / "two" / part).is_dir()
    (_, a), (_, b) = load_heads(str(tmp_path / "one" / "heads")), load_heads(str(tmp_path / "two" / "heads"))
    assert a.keys() == b.keys()
    for k in a:
        assert _rel(a[k], b[k]) <= 1e-5, k
    from safetensors.numpy import load_file
    x = load_file(str(tmp_path / "one" / "backbone" / "model.safetensors"))
    y = load_file(str(tmp_path / "two" / "backbone" / "model.safetensors"))
    assert x.keys() == y.keys() and len(x) > 10
    for k in x:
        assert _rel(x[k], y[k]) <= 1e-5, k
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]


def test_two_processes_data_parallel_step(tmp_path):
    """Two local CPU processes joined by `jax.distributed` (gloo collectives) run one data-parallel
    frozen and one joint step on a 2x1 mesh: loss and params equal the single-process step."""
    import dp_step

    port = _free_port()
    out = tmp_path / "dp.npz"
    _run_processes([[sys.executable, os.path.join(HERE, "dp_step.py"), "--coordinator", f"127.0.0.1:{port}",
                     "--num-processes", "2", "--process-id", str(i), "--out", str(out)] for i in range(2)])
    got = np.load(out)
    for mode in ("frozen", "joint"):
        ref = dp_step.one_step(mode)
        assert abs(float(got[f"{mode}/loss"]) - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        flat = dp_step.flat(ref["params"])
        for k, v in flat.items():
            assert _rel(v, got[f"{mode}/params/{k}"]) <= 1e-5, (mode, k)
