"""`medusa-plan`: per-device memory of the compiled decoding step on a device mesh.

Every figure of the inputs is checked against an independent count made here from the config by
hand (Megatron split: q/k/v/gate/up by output column on 'model', o/down by input row, embedding
and lm_head by vocabulary entry, norms replicated; the KV cache [L, B, KVH, S, Dh] by rows on
'data' and KV heads on 'model'). The meshes need 8 devices: tests/conftest.py simulates them
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""
import json
import os
import subprocess
import sys

import jax
import pytest

from medusa_jax.cli import plan
from medusa_jax.evals import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small Llama: head_dim 32; every sharded dimension divides by 4.
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
      "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
D, I, L, H, KVH, V = 256, 512, 4, 8, 4, 1024
DH = D // H
ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}
# Small sizes keep each compilation to a few seconds.
S, B, TREE = 128, 4, 16


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(HF))
    return d


@pytest.fixture(scope="module")
def eight_devices():
    n = len(jax.devices())
    assert n >= 8, (f"these tests need 8 devices, JAX sees {n}: run pytest with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")


def params_per_device(model: int, itemsize: int) -> int:
    """Backbone bytes on one device of a mesh with `model` model devices, counted by hand."""
    m = model
    per_layer = (D * (H * DH) // m          # q_proj [D, H*Dh]: columns
                 + 2 * D * (KVH * DH) // m  # k_proj, v_proj [D, KVH*Dh]: columns
                 + (H * DH) * D // m        # o_proj [H*Dh, D]: rows
                 + 2 * D * I // m           # gate_proj, up_proj [D, I]: columns
                 + I * D // m               # down_proj [I, D]: rows
                 + 2 * D)                   # input / post-attention norms: replicated
    return itemsize * (V * D // m + L * per_layer + D + D * V // m)  # embed, layers, final norm, lm_head


def kv_per_device(data: int, model: int, batch: int, itemsize: int) -> int:
    rows = batch // data if batch % data == 0 else batch  # rows are replicated when B does not divide
    return 2 * L * rows * S * (KVH // model) * DH * itemsize


def heads_per_device(depth: int, model: int, itemsize: int) -> int:
    return itemsize * depth * (D * D // model + D // model)  # blocks_kernel [K,1,D,D], blocks_bias [K,1,D]


@pytest.fixture(scope="module")
def plan_2x4(config_dir, eight_devices):
    return memory.plan(str(config_dir), mesh="2x4", dtype="bfloat16", max_len=S, batch=B, medusa_heads=4,
                        tree_nodes=TREE)


def test_sharded_inputs_match_a_count_by_hand(plan_2x4):
    r = plan_2x4
    tree = memory.plan_tree(4, TREE)
    assert (r["tree_nodes"], r["tree_depth"], r["heads_used"]) == (TREE, tree.max_depth, tree.max_depth)
    assert r["params_bytes"] == params_per_device(4, 2)
    assert r["params_global_bytes"] == params_per_device(1, 2)
    assert r["kv_cache_bytes"] == kv_per_device(2, 4, B, 2) == 2 * L * (B // 2) * S * (KVH // 4) * DH * 2
    assert r["heads_bytes"] == heads_per_device(tree.max_depth, 4, 2)
    # logits [B, V] float32, hidden [B, D] bf16, key [B, 2] uint32, temperature and top_p [B] float32, top_k and
    # lengths [B] int32; rows on 'data'
    assert r["state_bytes"] == (B // 2) * (V * 4 + D * 2 + 2 * 4 + 4 + 4 + 4 + 4 + S * 4)  # S: the cache's token ids
    # XLA's own argument size is exactly the shards counted above
    assert r["argument_bytes"] == r["params_bytes"] + r["heads_bytes"] + r["kv_cache_bytes"] + r["state_bytes"]
    assert r["temp_bytes"] > 0
    assert r["total_bytes"] == (r["params_bytes"] + r["heads_bytes"] + r["kv_cache_bytes"] + r["state_bytes"]
                                + r["unaliased_output_bytes"] + r["temp_bytes"])
    # the donated cache is updated in place: its output buffers reuse the input's
    assert r["alias_bytes"] >= r["kv_cache_bytes"]
    assert (r["mesh"], r["devices"], r["dtype"], r["batch"], r["max_len"]) == ("2x4", 8, "bfloat16", B, S)
    assert r["notes"] and "float32" in r["notes"][0]  # XLA:CPU's bf16 upcasts are flagged


def test_one_device_holds_everything(config_dir, plan_2x4):
    r = memory.plan(str(config_dir), mesh="1x1", dtype="bfloat16", max_len=S, batch=B, medusa_heads=4,
                     tree_nodes=TREE)
    assert r["params_bytes"] == r["params_global_bytes"] == params_per_device(1, 2)
    assert r["kv_cache_bytes"] == kv_per_device(1, 1, B, 2) == 8 * plan_2x4["kv_cache_bytes"]
    assert r["heads_bytes"] == heads_per_device(r["heads_used"], 1, 2)
    assert r["argument_bytes"] == r["params_bytes"] + r["heads_bytes"] + r["kv_cache_bytes"] + r["state_bytes"]


def test_rows_that_do_not_divide_the_data_axis_are_replicated_and_plain_decoding_has_no_heads(config_dir,
                                                                                             eight_devices):
    r = memory.plan(HF, mesh="2x4", dtype="float32", max_len=S, batch=3, medusa_heads=0)
    assert r["kv_cache_bytes"] == kv_per_device(2, 4, 3, 4) == 2 * L * 3 * S * 1 * DH * 4
    assert r["params_bytes"] == params_per_device(4, 4)
    assert (r["heads_bytes"], r["tree_nodes"], r["tree_depth"], r["medusa_heads"]) == (0, 1, 0, 0)
    # float32: no upcast copies; the replicated rows are said so
    assert r["notes"] == ["batch 3 does not divide by the mesh's 2 data devices: the rows, the KV cache and the "
                          "decode state are replicated on every data device (each holds all 3 rows) instead of "
                          "split; a batch that divides by 2 splits them"]
    assert memory.plan(HF, mesh="2x4", dtype="float32", max_len=S, batch=4, medusa_heads=0)["notes"] == []


def test_model_axis_must_divide_the_heads(config_dir):
    with pytest.raises(ValueError, match=r"model axis of 3 does not divide.*8 query heads, 4 KV heads.*1, 2, 4"):
        memory.plan(str(config_dir), mesh="1x3", max_len=S, batch=B, tree_nodes=TREE)


def test_too_few_devices_is_a_clear_error(config_dir, eight_devices):
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {4 * n} devices, but JAX sees {n}"):
        memory.plan(str(config_dir), mesh=f"{n}x4", max_len=S, batch=B, tree_nodes=TREE)


def test_bad_sizes_are_refused(config_dir):
    with pytest.raises(ValueError, match=r"--max-len 4096 must be in \[16, 512\]"):
        memory.plan(str(config_dir), max_len=4096, tree_nodes=TREE)
    with pytest.raises(ValueError, match="--batch must be >= 1"):
        memory.plan(str(config_dir), max_len=S, batch=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory.plan(str(config_dir), max_len=S, dtype="int8")


def test_default_trees():
    full = memory.plan_tree(4)
    assert (full.size, full.max_depth) == (64, 4)  # the whole mc_sim_7b_63 tree
    one = memory.plan_tree(1)
    assert (one.size, one.max_depth) == (11, 1)  # its ten depth-1 nodes
    assert memory.plan_tree(2, 8).size == 8
    big = memory.plan_tree(5, 100)  # beyond mc_sim_7b_63: the greedy tree on stand-in accuracies
    assert big.size == 100 and big.max_depth <= 5
    assert memory.plan_tree(0).size == 1
    with pytest.raises(ValueError, match="needs Medusa heads"):
        memory.plan_tree(0, 5)
    with pytest.raises(ValueError, match="exceeds the 11 nodes"):
        memory.plan_tree(1, 12)


def test_cli_json_matches_the_library(config_dir, plan_2x4, capsys):
    argv = ["--config", str(config_dir), "--mesh", "2x4", "--dtype", "float32", "--max-len", str(S),
            "--batch", str(B), "--tree-nodes", str(TREE), "--json"]
    assert plan.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("params_bytes", "heads_bytes", "kv_cache_bytes", "temp_bytes", "total_bytes", "argument_bytes"):
        assert isinstance(r[key], int), key
    assert (r["mesh"], r["dtype"], r["batch"], r["max_len"], r["medusa_heads"], r["tree_nodes"]) == (
        "2x4", "float32", B, S, 4, TREE)
    # float32 holds twice the bytes of the bfloat16 plan
    assert r["params_bytes"] == 2 * plan_2x4["params_bytes"] == params_per_device(4, 4)
    assert r["kv_cache_bytes"] == 2 * plan_2x4["kv_cache_bytes"]
    assert r["heads_bytes"] == 2 * plan_2x4["heads_bytes"]


def test_cli_table(config_dir, plan_2x4, capsys, eight_devices):
    assert plan.main(["--config", str(config_dir), "--mesh", "2x4", "--max-len", str(S), "--batch", str(B),
                         "--tree-nodes", str(TREE)]) == 0
    out = capsys.readouterr().out
    assert "2x4 mesh (8 cpu devices), bfloat16, batch 4, max-len 128, tree 16 nodes" in out
    assert f"{plan_2x4['params_bytes']:,}" in out and f"{plan_2x4['kv_cache_bytes']:,}" in out
    assert "compiled in" in out and "total" in out


@pytest.mark.parametrize("argv, message", [
    (["--config", "llama-9b"], "neither a preset (llama-2-7b, llama-2-13b, llama-2-70b, vicuna-7b)"),
    (["--config", "/nonexistent/config.json"], "neither a preset (llama-2-7b"),
    (["--config", "llama-2-7b", "--mesh", "2by4"], "--mesh takes DATAxMODEL"),
    (["--config", "llama-2-70b", "--mesh", "1x16"], "Model-axis sizes that work: 1, 2, 4, 8"),
])
def test_cli_errors_exit_2(argv, message, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_presets_are_the_published_configs():
    from medusa_jax.models.config import ModelConfig

    c70 = ModelConfig.from_hf_dict(memory.PRESETS["llama-2-70b"])
    assert (c70.hidden_size, c70.intermediate_size, c70.num_layers, c70.num_heads, c70.num_kv_heads) == (
        8192, 28672, 80, 64, 8)
    c7 = ModelConfig.from_hf_dict(memory.PRESETS["llama-2-7b"])
    assert (c7.hidden_size, c7.intermediate_size, c7.num_layers, c7.num_kv_heads, c7.vocab_size,
            c7.max_position_embeddings, c7.head_dim) == (4096, 11008, 32, 32, 32000, 4096, 128)
    c13 = ModelConfig.from_hf_dict(memory.PRESETS["llama-2-13b"])
    assert (c13.hidden_size, c13.intermediate_size, c13.num_layers, c13.num_heads) == (5120, 13824, 40, 40)


def test_help_explains_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        plan.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: medusa-plan [-h]")
    for flag in ("--config", "--mesh", "--dtype", "--max-len", "--batch", "--medusa-heads", "--tree-nodes",
                 "--acceptance", "--json"):
        assert flag in text.split("options:", 1)[1]
    assert "(default: None)" not in text and "(default: False)" not in text


def test_ensure_host_devices(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert plan.ensure_host_devices(8)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    assert plan.ensure_host_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert not plan.ensure_host_devices(16)  # a count already set is left alone
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"


def test_module_simulates_its_devices_in_a_fresh_process(config_dir, plan_2x4):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "medusa_jax.cli.plan", "--config", str(config_dir), "--mesh", "2x4",
                           "--max-len", str(S), "--batch", str(B), "--tree-nodes", str(TREE), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["devices"] == 8
    for key in ("params_bytes", "heads_bytes", "kv_cache_bytes", "state_bytes", "argument_bytes"):
        assert r[key] == plan_2x4[key], key
