"""Medusa heads (medusa_jax.heads.medusa) and head files (medusa_jax.convert.medusa_format)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.convert.medusa_format import (HeadsFormatError, export_official, export_vllm, load_heads, read_tensors,
                                             save_heads)
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import HeadsMismatchError, MedusaHeads, check_heads_match, init_heads
from medusa_jax.models.config import ModelConfig

D, V, K, L = 16, 40, 3, 2


def _cfg(shared, k=K, l=L, **kw):
    return MedusaConfig(hidden_size=D, vocab_size=V, num_heads=k, num_layers=l, shared_lm_head=shared, **kw)


def _base_lm(seed=0):
    return np.random.RandomState(seed).randn(D, V).astype(np.float32) * 0.3


def _random_params(cfg, seed=1):
    r = np.random.RandomState(seed)
    p = {"blocks_kernel": r.randn(cfg.num_heads, cfg.num_layers, D, D).astype(np.float32) * 0.2,
         "blocks_bias": r.randn(cfg.num_heads, cfg.num_layers, D).astype(np.float32) * 0.2}
    if not cfg.shared_lm_head:
        p["lm_head"] = r.randn(cfg.num_heads, D, V).astype(np.float32) * 0.3
    return p


def _hidden(seed=2, shape=(2, 5)):
    return np.random.RandomState(seed).randn(*shape, D).astype(np.float32)


def _logits(cfg, params, hidden, base):
    return np.asarray(MedusaHeads(cfg).apply({"params": params}, jnp.asarray(hidden),
                                             None if base is None else jnp.asarray(base)))


def _numpy_reference(cfg, params, hidden, base):
    """Independent numpy implementation: per head, x = x + silu(x W + b); then x @ lm_head."""
    out = []
    for k in range(cfg.num_heads):
        x = hidden.astype(np.float64)
        for l in range(cfg.num_layers):
            y = x @ params["blocks_kernel"][k, l] + params["blocks_bias"][k, l]
            x = x + y / (1 + np.exp(-y))
        lm = base if cfg.shared_lm_head else params["lm_head"][k]
        out.append(x @ lm)
    return np.stack(out)


# ------------------------------------------------------------------------------------ the module

@pytest.mark.parametrize("shared", [True, False])
def test_fresh_heads_reproduce_base_logits(shared):
    cfg, base, h = _cfg(shared), _base_lm(), _hidden()
    params = init_heads(cfg, base)
    assert set(params) == ({"blocks_kernel", "blocks_bias"} | (set() if shared else {"lm_head"}))
    assert params["blocks_kernel"].shape == (K, L, D, D) and params["blocks_bias"].shape == (K, L, D)
    assert not np.any(np.asarray(params["blocks_kernel"])) and not np.any(np.asarray(params["blocks_bias"]))
    logits = _logits(cfg, params, h, base)
    assert logits.shape == (K, 2, 5, V) and logits.dtype == np.float32
    expected = np.asarray(jnp.asarray(h) @ jnp.asarray(base))
    for k in range(K):
        np.testing.assert_array_equal(logits[k], expected)
    states = np.asarray(MedusaHeads(cfg).apply({"params": params}, jnp.asarray(h), method=MedusaHeads.head_states))
    assert states.shape == (K, 2, 5, D)
    np.testing.assert_array_equal(states, np.broadcast_to(h, states.shape))


def test_fresh_heads_on_a_real_backbone_match_its_logits():
    from medusa_jax.models.llama import LlamaModel, lm_head_matrix
    mcfg = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, tie_word_embeddings=True)
    model = LlamaModel(mcfg)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, V, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    mp = model.init(jax.random.PRNGKey(0), tokens, positions)["params"]
    logits, hidden, _ = model.apply({"params": mp}, tokens, positions)
    base = lm_head_matrix(model.cfg, mp)
    for shared in (True, False):
        cfg = MedusaConfig(hidden_size=D, vocab_size=V, num_heads=4, num_layers=1, shared_lm_head=shared)
        out = _logits(cfg, init_heads(cfg, base), np.asarray(hidden), np.asarray(base))
        assert out.shape == (4, 2, 6, V)
        # equal up to float32 round-off: the backbone's few-row lm_head product may run the
        # weight-streaming kernel (medusa_jax.kernels), the heads' 48-row product XLA's
        np.testing.assert_allclose(out, np.broadcast_to(np.asarray(logits), out.shape), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_random_heads_match_numpy_reference(shared):
    cfg, base, h = _cfg(shared), _base_lm(), _hidden()
    p = _random_params(cfg)
    np.testing.assert_allclose(_logits(cfg, p, h, base), _numpy_reference(cfg, p, h, base), rtol=1e-4, atol=1e-4)


def test_zero_layer_heads_and_bf16_compute():
    cfg, base, h = _cfg(False, l=0), _base_lm(), _hidden()
    p = _random_params(cfg)
    np.testing.assert_allclose(_logits(cfg, p, h, base), _numpy_reference(cfg, p, h, base), rtol=1e-4, atol=1e-4)
    out = np.asarray(MedusaHeads(cfg, dtype=jnp.bfloat16).apply({"params": p}, jnp.asarray(h)))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, _numpy_reference(cfg, p, h, base), rtol=0.05, atol=0.15)


def test_call_errors():
    cfg = _cfg(True)
    with pytest.raises(ValueError, match="base_lm_head"):
        MedusaHeads(cfg).apply({"params": init_heads(cfg)}, jnp.zeros((1, D)))
    with pytest.raises(ValueError, match="base_lm_head"):
        init_heads(_cfg(False))
    with pytest.raises(HeadsMismatchError, match=r"\(16, 40\)"):
        init_heads(_cfg(False), np.zeros((V, D), np.float32))  # torch layout by mistake


def test_module_init_has_the_fixed_layout():
    cfg = _cfg(False)
    p = MedusaHeads(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 2, D)))["params"]
    assert {k: v.shape for k, v in p.items()} == {"blocks_kernel": (K, L, D, D), "blocks_bias": (K, L, D),
                                                  "lm_head": (K, D, V)}


def test_check_heads_match_names_both_numbers():
    mcfg = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    check_heads_match(_cfg(True), mcfg)  # fits: no error
    with pytest.raises(HeadsMismatchError, match=r"hidden size 16 \(heads\) != 32 \(backbone\)") as e:
        check_heads_match(_cfg(True), mcfg.replace(hidden_size=32))
    assert isinstance(e.value, ValueError) and "train" in str(e.value)
    with pytest.raises(HeadsMismatchError, match=r"vocabulary size 40 \(heads\) != 41 \(backbone\)"):
        check_heads_match(_cfg(True), mcfg.replace(vocab_size=41))


# ------------------------------------------------------------------------------------ the files

def _roundtrip_logits(cfg, p, base, loaded_cfg, loaded_p, h):
    a = _logits(cfg, p, h, base)
    b = _logits(loaded_cfg, loaded_p, h, base)
    np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings("ignore:the original Medusa code shares")
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fmt", ["ours", "official_pt", "official_safetensors", "vllm"])
def test_export_import_gives_identical_logits(tmp_path, shared, fmt):
    cfg = _cfg(shared, topk=7, medusa_choices=((0,), (1,), (0, 0), (0, 0, 0)), base_model="tiny/base")
    base, p, h = _base_lm(), None, _hidden()
    p = _random_params(cfg)
    d = str(tmp_path / fmt)
    if fmt == "ours":
        save_heads(d, cfg, {"params": p}, base, extra={"metrics": {"acc": np.float32(0.5)}})
        raw = json.load(open(os.path.join(d, "config.json")))
        assert raw["metrics"] == {"acc": 0.5} and raw["shared_lm_head"] is shared and raw["topk"] == 7
        assert raw["medusa_num_heads"] == K and raw["medusa_num_layers"] == L
        assert (raw.get("version") == "2") is shared
    elif fmt.startswith("official"):
        export_official(d, cfg, p, base, fmt=fmt.split("_")[1])
        assert os.path.exists(os.path.join(d, "medusa_lm_head." + fmt.split("_")[1]))
    else:
        export_vllm(d, cfg, p, base)
        raw = json.load(open(os.path.join(d, "config.json")))
        assert raw["model_type"] == "medusa" and raw["num_heads"] == K and raw["num_hidden_layers"] == L
        assert raw["truncated_vocab_size"] == V
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(d):  # each file as any this process creates (safetensors alone wrote 0600)
        assert os.stat(os.path.join(d, name)).st_mode & 0o777 == 0o666 & ~umask, name
    lcfg, lp = load_heads(d)
    assert (lcfg.num_heads, lcfg.num_layers, lcfg.hidden_size, lcfg.vocab_size) == (K, L, D, V)
    # vLLM and the official loader need lm_heads, so shared heads come back as own copies (same logits)
    assert lcfg.shared_lm_head is (shared and fmt == "ours")
    if fmt == "ours":
        assert lcfg == cfg
    _roundtrip_logits(cfg, p, base, lcfg, lp, h)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("shared", [True, False])
def test_torch_reference_of_the_original_head(tmp_path, fmt, shared):
    """The original ResBlock head in torch, loaded strictly from our export, gives our logits."""
    torch = pytest.importorskip("torch")
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.linear = nn.Linear(d, d)
            self.act = nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    heads = nn.ModuleList([nn.Sequential(*[ResBlock(D) for _ in range(L)], nn.Linear(D, V, bias=False))
                           for _ in range(K)])
    cfg, base, h = _cfg(shared), _base_lm(), _hidden()
    p = _random_params(cfg)
    with pytest.warns(UserWarning, match="shares one ResBlock"):
        path = export_official(str(tmp_path), cfg, p, base, fmt=fmt, include_lm_head=True)
    if fmt == "pt":
        sd = torch.load(path, map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file
        sd = load_file(path)
    heads.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ref = torch.stack([m(torch.from_numpy(h)) for m in heads]).numpy()
    np.testing.assert_allclose(_logits(cfg, p, h, base), ref, rtol=1e-5, atol=1e-5)
    assert json.load(open(tmp_path / "config.json")).get("version") is None  # lm_heads written


def _write_official(d, tensors, config):
    from safetensors.numpy import save_file
    os.makedirs(d, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(d, "medusa_lm_head.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)


def _official_tensors(k, l, seed=0, bias=True, lm=True):
    r = np.random.RandomState(seed)
    t = {}
    for h in range(k):
        for i in range(l):
            t[f"{h}.{i}.linear.weight"] = r.randn(D, D).astype(np.float32)
            if bias:
                t[f"{h}.{i}.linear.bias"] = r.randn(D).astype(np.float32)
        if lm:
            t[f"{h}.{l}.weight"] = r.randn(V, D).astype(np.float32)
    return t


def test_head_count_comes_from_the_keys_not_the_config(tmp_path):
    t = _official_tensors(5, 1)
    _write_official(str(tmp_path), t, {"medusa_num_heads": 2, "medusa_num_layers": 1,
                                       "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"})
    cfg, p = load_heads(str(tmp_path))
    assert cfg.num_heads == 5 and cfg.num_layers == 1 and not cfg.shared_lm_head
    assert cfg.base_model == "lmsys/vicuna-7b-v1.3"
    np.testing.assert_array_equal(p["blocks_kernel"][3, 0], t["3.0.linear.weight"].T)
    np.testing.assert_array_equal(p["lm_head"][4], t["4.1.weight"].T)
    cfg3, p3 = load_heads(str(tmp_path / "medusa_lm_head.safetensors"), num_heads=3)  # direct file path
    assert cfg3.num_heads == 3 and p3["lm_head"].shape == (3, D, V)
    np.testing.assert_array_equal(p3["blocks_bias"], p["blocks_bias"][:3])


def test_asking_for_more_heads_than_the_file_holds(tmp_path):
    _write_official(str(tmp_path), _official_tensors(3, 1), {"medusa_num_heads": 3, "medusa_num_layers": 1})
    with pytest.raises(HeadsFormatError, match="asked for 4 Medusa heads but the file holds 3"):
        load_heads(str(tmp_path), num_heads=4)


def test_mismatched_backbone_gives_clear_errors(tmp_path):
    _write_official(str(tmp_path), _official_tensors(2, 1), {"medusa_num_heads": 2, "medusa_num_layers": 1})
    mcfg = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    cfg, _ = load_heads(str(tmp_path), model_cfg=mcfg)
    assert cfg.hidden_size == D
    with pytest.raises(HeadsMismatchError, match=r"hidden size 16 \(heads\) != 64 \(backbone\)"):
        load_heads(str(tmp_path), model_cfg=mcfg.replace(hidden_size=64))
    with pytest.raises(HeadsMismatchError, match=r"vocabulary size 40 \(heads\) != 49152 \(backbone\)"):
        load_heads(str(tmp_path), model_cfg=mcfg.replace(vocab_size=49152))


def test_missing_bias_loads_as_zeros_and_shared_variant(tmp_path):
    t = _official_tensors(2, 1, bias=False, lm=False)
    _write_official(str(tmp_path), t, {"medusa_num_heads": 2, "medusa_num_layers": 1, "version": "2",
                                       "hidden_size": D, "vocab_size": V})
    cfg, p = load_heads(str(tmp_path))
    assert cfg.shared_lm_head and "lm_head" not in p and cfg.vocab_size == V
    np.testing.assert_array_equal(p["blocks_bias"], np.zeros((2, 1, D), np.float32))
    np.testing.assert_array_equal(p["blocks_kernel"][1, 0], t["1.0.linear.weight"].T)


def test_shared_variant_without_vocab_needs_model_cfg(tmp_path):
    _write_official(str(tmp_path), _official_tensors(2, 1, lm=False), {"medusa_num_heads": 2, "version": "2"})
    with pytest.raises(HeadsFormatError, match="vocabulary size"):
        load_heads(str(tmp_path))
    mcfg = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert load_heads(str(tmp_path), model_cfg=mcfg)[0].vocab_size == V


@pytest.mark.filterwarnings("ignore:the original Medusa code shares")
def test_truncated_and_corrupt_files(tmp_path):
    cfg = _cfg(False)
    d = str(tmp_path / "h")
    path = save_heads(d, cfg, _random_params(cfg))
    data = open(path, "rb").read()
    for cut in (len(data) - 100, 200, 5):
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(HeadsFormatError, match="truncated"):
            load_heads(d)
    pt = export_official(str(tmp_path / "pt"), cfg, _random_params(cfg), fmt="pt")
    raw = open(pt, "rb").read()
    with open(pt, "wb") as f:
        f.write(raw[: len(raw) // 2])
    with pytest.raises(HeadsFormatError, match="cannot read the .pt file"):
        load_heads(str(tmp_path / "pt"))


def test_missing_files_and_unknown_tensors(tmp_path):
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors or medusa_lm_head.pt"):
        load_heads(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no Medusa head weights"):
        load_heads(str(tmp_path))
    t = _official_tensors(2, 1)
    t["model.norm.weight"] = np.ones(D, np.float32)
    _write_official(str(tmp_path / "x"), t, {})
    with pytest.raises(HeadsFormatError, match="unexpected tensor 'model.norm.weight'"):
        load_heads(str(tmp_path / "x"))
    t = _official_tensors(2, 1)
    t["1.0.linear.weight"] = np.zeros((D, D + 1), np.float32)
    _write_official(str(tmp_path / "y"), t, {})
    with pytest.raises(HeadsFormatError, match="head 1 block 0"):
        load_heads(str(tmp_path / "y"))


def test_bf16_pt_and_prefixed_keys(tmp_path):
    torch = pytest.importorskip("torch")
    t = _official_tensors(2, 1)
    sd = {"medusa_head." + k: torch.from_numpy(v).to(torch.bfloat16) for k, v in t.items()}
    torch.save(sd, tmp_path / "medusa_lm_head.pt")
    cfg, p = load_heads(str(tmp_path))  # no config.json: everything from the keys
    assert (cfg.num_heads, cfg.num_layers, cfg.vocab_size) == (2, 1, V)
    np.testing.assert_array_equal(p["lm_head"][1], sd["medusa_head.1.1.weight"].float().numpy().T)
    from safetensors.torch import save_file
    os.remove(tmp_path / "medusa_lm_head.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "medusa_lm_head.safetensors"))
    _, p2 = load_heads(str(tmp_path))  # bf16 safetensors, read without torch
    np.testing.assert_array_equal(p2["lm_head"], p["lm_head"])


def test_vllm_without_bias_and_num_heads(tmp_path):
    from safetensors.numpy import save_file
    r = np.random.RandomState(0)
    t = {f"blocks.{h}.layers.0.weight": r.randn(D, D).astype(np.float32) for h in range(4)}
    t.update({f"lm_heads.{h}.weight": r.randn(V, D).astype(np.float32) for h in range(4)})
    save_file(t, str(tmp_path / "model.safetensors"))
    json.dump({"model_type": "medusa", "num_heads": 4, "num_hidden_layers": 1, "hidden_size": D,
               "vocab_size": V, "truncated_vocab_size": V}, open(tmp_path / "config.json", "w"))
    cfg, p = load_heads(str(tmp_path), num_heads=2)
    assert cfg.num_heads == 2 and not cfg.shared_lm_head and not p["blocks_bias"].any()
    np.testing.assert_array_equal(p["lm_head"][1], t["lm_heads.1.weight"].T)


def _vllm_proposals(d, hidden):
    """What vLLM's Medusa speculator proposes from an exported directory: each head's top-1 token
    [K, ..., ] int, built as ``vllm/model_executor/models/medusa.py`` builds it (its own numpy
    rendering here): blocks x + silu(W x + b) with b only under medusa_fc_bias; one lm_head for
    every head under original_lm_head (``lm_head.weight``, or ``lm_heads.0.weight``); with
    truncated_vocab_size < vocab_size the token_map's rows of each lm_head (sliced when it holds
    more) scored, every other token at -inf."""
    from safetensors.numpy import load_file

    raw = json.load(open(os.path.join(d, "config.json")))
    t = load_file(os.path.join(d, "model.safetensors"))
    K, L = raw["num_heads"], raw["num_hidden_layers"]
    tm = t["token_map"] if raw["truncated_vocab_size"] < raw["vocab_size"] else None
    if raw.get("original_lm_head"):
        lms = [t["lm_head.weight"] if "lm_head.weight" in t else t["lm_heads.0.weight"]] * K
    else:
        lms = [t[f"lm_heads.{h}.weight"] for h in range(K)]
    if tm is not None:
        lms = [w[tm] if w.shape[0] > len(tm) else w for w in lms]
    out = []
    for h in range(K):
        x = hidden.astype(np.float32)
        for l in range(L):
            y = x @ t[f"blocks.{h}.layers.{l}.weight"].T
            if raw.get("medusa_fc_bias"):
                y = y + t[f"blocks.{h}.layers.{l}.bias"]
            x = x + y / (1 + np.exp(-y))
        logits = x @ lms[h].T
        if tm is not None:
            full = np.full(logits.shape[:-1] + (raw["vocab_size"],), -np.inf, np.float32)
            full[..., tm] = logits
            logits = full
        out.append(logits.argmax(-1))
    return np.stack(out)


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("proposals", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_vllm_export_proposes_what_ours_propose(tmp_path, shared, proposals, copies):
    """export_vllm: shared heads as one lm_head with original_lm_head (a copy per head with
    lm_head_copies), a proposal vocabulary as token_map + truncated_vocab_size with the lm_heads'
    [N, D] rows; vLLM's reading of the file proposes each head's top-1 as our heads do, and
    load_heads gives back heads with the same proposals (top-k too) and proposal vocabulary."""
    from medusa_jax.heads.topk import head_topk

    cfg, base, N = _cfg(shared, topk=4), _base_lm(), 24
    p = _random_params(cfg)
    if proposals:
        cfg = cfg.replace(proposal_vocab_size=N)
        p["proposal_ids"] = np.random.RandomState(5).choice(V, N, replace=False).astype(np.int32)
    d = str(tmp_path / "v")
    export_vllm(d, cfg, p, base, lm_head_copies=copies)
    raw, t = json.load(open(os.path.join(d, "config.json"))), read_tensors(os.path.join(d, "model.safetensors"))
    one = shared and not copies
    assert raw.get("original_lm_head", False) is one
    lm_names = sorted(k for k in t if k.startswith("lm_head"))
    assert lm_names == (["lm_head.weight"] if one else [f"lm_heads.{h}.weight" for h in range(K)])
    assert all(t[k].shape == ((N if proposals else V), D) for k in lm_names)
    assert raw["truncated_vocab_size"] == (N if proposals else V) and raw["vocab_size"] == V
    if proposals:
        assert t["token_map"].dtype == np.int64
        np.testing.assert_array_equal(t["token_map"], p["proposal_ids"])
    else:
        assert "token_map" not in t
    h = jnp.asarray(_hidden(shape=(7,)))
    ours = np.asarray(head_topk(cfg, p, h, base, K, 4))  # [K, 7, 4]
    np.testing.assert_array_equal(_vllm_proposals(d, np.asarray(h)), ours[..., 0])
    lcfg, lp = load_heads(d)
    assert lcfg.proposal_vocab_size == (N if proposals else 0) and not lcfg.shared_lm_head
    if proposals:
        np.testing.assert_array_equal(lp["proposal_ids"], p["proposal_ids"])
    np.testing.assert_array_equal(np.asarray(head_topk(lcfg, lp, h, None, K, 4)), ours)
    again = str(tmp_path / "again")  # read back, the shared lm_head is K equal copies: written once again
    export_vllm(again, lcfg, lp)
    assert json.load(open(os.path.join(again, "config.json"))).get("original_lm_head", False) is shared
    np.testing.assert_array_equal(_vllm_proposals(again, np.asarray(h)), ours[..., 0])


def test_vllm_truncated_vocabulary_read_as_vllm_reads_it(tmp_path):
    """A vLLM file whose lm_heads hold all V rows with a token_map (vLLM slices them) reads as heads
    proposing from the token_map; a truncated vocabulary without a usable token_map, or an lm_head
    of another row count, is refused naming what is wrong."""
    from safetensors.numpy import save_file

    from medusa_jax.heads.topk import head_topk

    cfg, N = _cfg(False, k=2, l=1, topk=4), 12
    p = _random_params(cfg)
    tm = np.random.RandomState(4).choice(V, N, replace=False)
    blocks = {f"blocks.{h}.layers.0.{w}": (p["blocks_kernel"][h, 0].T if w == "weight" else p["blocks_bias"][h, 0])
              for h in range(2) for w in ("weight", "bias")}
    full = {f"lm_heads.{h}.weight": np.ascontiguousarray(p["lm_head"][h].T) for h in range(2)}
    raw = {"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1, "hidden_size": D, "vocab_size": V,
           "truncated_vocab_size": N, "medusa_fc_bias": True, "topk": 4}

    def write(tensors, config=raw):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        json.dump(config, open(tmp_path / "config.json", "w"))

    write({**blocks, **full, "token_map": tm.astype(np.int64)})
    lcfg, lp = load_heads(str(tmp_path))
    h = jnp.asarray(_hidden(shape=(6,)))
    np.testing.assert_array_equal(np.asarray(head_topk(lcfg, lp, h, None, 2, 4))[..., 0],
                                  _vllm_proposals(str(tmp_path), np.asarray(h)))
    assert lcfg.proposal_vocab_size == N and set(lp["proposal_ids"]) == set(tm)
    for tensors, message in (({**blocks, **full}, "holds no token_map"),
                             ({**blocks, **full, "token_map": tm[:-1]}, r"got shape \(11,\)"),
                             ({**blocks, **full, "token_map": tm.astype(np.float32)}, "dtype float32"),
                             ({**blocks, **full, "token_map": np.concatenate([tm[:-1], tm[:1]])}, "distinct"),
                             ({**blocks, **{k: v[:N + 1] for k, v in full.items()}, "token_map": tm},
                              r"lm_heads\.0\.weight has shape \(13, 16\)")):
        write(tensors)
        with pytest.raises(HeadsFormatError, match=message):
            load_heads(str(tmp_path))
    for key, value in (("truncated_vocab_size", "abc"), ("vocab_size", [V]), ("topk", "x")):
        write({**blocks, **full, "token_map": tm}, {**raw, key: value})
        with pytest.raises(HeadsFormatError, match=f"{key} must be a non-negative integer"):
            load_heads(str(tmp_path))
    # a token_map smaller than topk: vLLM proposes each head's top-1, so the heads keep that many
    write({**blocks, **{k: v[tm[:3]] for k, v in full.items()}, "token_map": tm[:3]},
          {**raw, "truncated_vocab_size": 3})
    lcfg, lp = load_heads(str(tmp_path))
    assert (lcfg.topk, lcfg.proposal_vocab_size) == (3, 3)
    np.testing.assert_array_equal(np.asarray(head_topk(lcfg, lp, h, None, 2, 1))[..., 0],
                                  _vllm_proposals(str(tmp_path), np.asarray(h)))


# ------------------------------------------------------------------- files that disagree with themselves

@pytest.mark.parametrize("prefix", ["medusa_head.", "medusa_heads."])
def test_one_parameter_under_two_names_is_an_error(tmp_path, prefix):
    t = _official_tensors(2, 1)
    t[prefix + "0.0.linear.weight"] = np.zeros((D, D), np.float32)  # the same parameter, zeros
    _write_official(str(tmp_path), t, {"medusa_num_heads": 2, "medusa_num_layers": 1})
    with pytest.raises(HeadsFormatError, match=rf"'0\.0\.linear\.weight' and '{prefix}0\.0\.linear\.weight' "
                                               r"are the same parameter '0\.0\.linear\.weight'"):
        load_heads(str(tmp_path))


def test_two_lm_heads_for_one_head_name_both_keys(tmp_path):
    t = _official_tensors(2, 1)
    t["1.2.weight"] = t["1.1.weight"]
    _write_official(str(tmp_path), t, {})
    with pytest.raises(HeadsFormatError, match=r"head 1 has two lm_head weights, '1\.1\.weight' and '1\.2\.weight'"):
        load_heads(str(tmp_path))


def test_vllm_shared_and_per_head_lm_heads_together_is_an_error(tmp_path):
    from safetensors.numpy import save_file
    r = np.random.RandomState(0)
    t = {f"blocks.{h}.layers.0.weight": r.randn(D, D).astype(np.float32) for h in range(2)}
    t.update({f"lm_heads.{h}.weight": r.randn(V, D).astype(np.float32) for h in range(2)})
    t["medusa_heads.lm_head.weight"] = r.randn(V, D).astype(np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadsFormatError, match=r"both 'medusa_heads\.lm_head\.weight' \(one projection for every "
                                               r"head\) and per-head 'lm_heads\.0\.weight', 'lm_heads\.1\.weight'"):
        load_heads(str(tmp_path))


def test_a_run_directory_given_as_heads_points_to_its_heads(tmp_path):
    cfg = _cfg(True, l=1)
    save_heads(str(tmp_path / "run" / "heads"), cfg, _random_params(cfg))
    with pytest.raises(FileNotFoundError, match=r"run: no Medusa head weights found; expected .* \(a training "
                                                r"run's directory\? its heads are in .*run/heads\)$"):
        load_heads(str(tmp_path / "run"))
    with pytest.raises(FileNotFoundError, match=r"heads_dir: no Medusa head weights found; expected .*files$"):
        load_heads(str((tmp_path / "heads_dir").mkdir() or tmp_path / "heads_dir"))


def test_empty_weight_file_is_always_an_error(tmp_path):
    _write_official(str(tmp_path / "a"), {}, {"medusa_num_heads": 4, "medusa_num_layers": 1})
    with pytest.raises(HeadsFormatError, match=r"holds no tensors \(0 heads, 0 layers\) but config\.json says "
                                               r"medusa_num_heads=4, medusa_num_layers=1"):
        load_heads(str(tmp_path / "a"))
    _write_official(str(tmp_path / "b"), {}, {"medusa_num_heads": 4, "medusa_num_layers": 0, "version": "2"})
    with pytest.raises(HeadsFormatError, match="holds no tensors"):
        load_heads(str(tmp_path / "b"))
    cfg = _cfg(True, l=0)  # nothing to store, so nothing is written
    with pytest.raises(ValueError, match="no tensors to write"):
        save_heads(str(tmp_path / "c"), cfg, _random_params(cfg))
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("config, message", [
    ({"medusa_num_heads": 2, "medusa_num_layers": 2}, r"medusa_num_layers=2 but the tensors hold 1 block layer"),
    ({"medusa_num_heads": 2, "medusa_num_layers": 0}, r"medusa_num_layers=0 but the tensors hold 1 block layer"),
    ({"medusa_num_heads": 3, "medusa_num_layers": 1}, r"medusa_num_heads=3 but the tensors hold 2 head"),
    ({"medusa_num_heads": "2"}, r"medusa_num_heads must be a non-negative integer, got '2'"),
])
def test_config_that_disagrees_with_the_weights_names_both_numbers(tmp_path, config, message):
    _write_official(str(tmp_path), _official_tensors(2, 1), config)
    with pytest.raises(HeadsFormatError, match=message):
        load_heads(str(tmp_path))


def test_vllm_config_that_disagrees_with_the_weights(tmp_path):
    cfg = _cfg(False, k=2, l=1)
    export_vllm(str(tmp_path), cfg, _random_params(cfg))
    fn = tmp_path / "config.json"
    raw = json.load(open(fn))
    json.dump({**raw, "num_hidden_layers": 3}, open(fn, "w"))
    with pytest.raises(HeadsFormatError, match=r"num_hidden_layers=3 but the tensors hold 1 block layer"):
        load_heads(str(tmp_path))
    json.dump({**raw, "num_heads": 1}, open(fn, "w"))  # fewer heads in the config: vLLM builds that many
    assert load_heads(str(tmp_path))[0].num_heads == 1


# ------------------------------------------------------------------- heads prepared for decoding

def _own_heads_with_proposals(k=4, p_size=24, seed=3):
    """Own-lm_head heads (D, V above) with a proposal vocabulary of p_size ids, and a base lm_head."""
    cfg = _cfg(False, k=k, l=1, topk=4, medusa_choices=((0,), (1,), (0, 0), (0, 0, 0)))
    p = _random_params(cfg, seed)
    ids = np.random.RandomState(seed).choice(V, p_size, replace=False).astype(np.int32)
    return cfg.replace(proposal_vocab_size=p_size), {**p, "proposal_ids": ids}, _base_lm(seed)


def _weight_reads(fn, *args):
    """Sizes of the arrays that slice/gather ops read in fn's jaxpr (a weight read that way is copied)."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [int(np.prod(v.aval.shape)) for e in eqns if e.primitive.name in ("slice", "gather", "dynamic_slice")
            for v in e.invars[:1]]


@pytest.mark.parametrize("proposals", [True, False])
def test_prepare_heads_keeps_the_trees_heads_with_the_same_proposals(proposals):
    from medusa_jax.heads.medusa import prepare_heads
    from medusa_jax.heads.topk import head_topk

    cfg, p, base = _own_heads_with_proposals()
    if not proposals:
        cfg, p = cfg.replace(proposal_vocab_size=0), {k: v for k, v in p.items() if k != "proposal_ids"}
    pcfg, pp = prepare_heads(cfg, p, base, depth=2)
    assert (pcfg.num_heads, pcfg.shared_lm_head, pcfg.medusa_choices) == (2, False, ((0,), (1,), (0, 0)))
    if proposals:  # only the precomputed per-head proposal projection [depth, D, P] is left
        assert "lm_head" not in pp and pp["proposal_lm_head"].shape == (2, D, 24)
    else:
        assert pp["lm_head"].shape == (2, D, V) and "proposal_lm_head" not in pp
    h = jnp.asarray(_hidden(shape=(5,)))
    want = head_topk(cfg, p, h, base, 2, 4)
    np.testing.assert_array_equal(np.asarray(head_topk(pcfg, pp, h, base, 2, 4)), np.asarray(want))
    logits = _numpy_reference(cfg, p, np.asarray(h), base)[:2]  # [2, 5, V]
    if proposals:
        logits = np.where(np.isin(np.arange(V), p["proposal_ids"]), logits, -np.inf)
    np.testing.assert_array_equal(np.asarray(want), np.argsort(-logits, axis=-1, kind="stable")[..., :4])
    # the prepared heads read no weight through a slice or gather (a copy per step); the raw ones do
    big = D * 24
    assert max(_weight_reads(lambda q, x: head_topk(pcfg, q, x, base, 2, 4), pp, h), default=0) < big
    assert max(_weight_reads(lambda q, x: head_topk(cfg, q, x, base, 2, 4), p, h)) >= big
    again = prepare_heads(pcfg, pp, base, depth=1)  # prepared heads prepare again (cut further)
    assert again[0].num_heads == 1 and again[1]["blocks_kernel"].shape[0] == 1


def test_prepare_heads_folds_copies_of_the_base_lm_head_into_the_shared_one():
    from medusa_jax.heads.medusa import prepare_heads
    from medusa_jax.heads.topk import head_topk

    cfg, p, base = _own_heads_with_proposals()
    p["lm_head"] = np.tile(base[None], (cfg.num_heads, 1, 1))  # what export_official(include_lm_head=True) writes
    pcfg, pp = prepare_heads(cfg, p, base, depth=3)
    # shared: the proposal projection is kept [N, D], the layout the decoding step streams, in
    # bfloat16 by default (the draft's dtype)
    assert pcfg.shared_lm_head and "lm_head" not in pp and "proposal_lm_head" not in pp
    assert pp["proposal_lm_head_t"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pp["proposal_lm_head_t"]),
                                  np.asarray(jnp.asarray(base[:, p["proposal_ids"]].T).astype(jnp.bfloat16)))
    pcfg, pp = prepare_heads(cfg, p, base, depth=3, draft_dtype=jnp.float32)  # float32: the same top-k
    np.testing.assert_array_equal(np.asarray(pp["proposal_lm_head_t"]), base[:, p["proposal_ids"]].T)
    h = jnp.asarray(_hidden(shape=(4,)))
    np.testing.assert_array_equal(np.asarray(head_topk(pcfg, pp, h, base, 3, 4)),
                                  np.asarray(head_topk(cfg, p, h, base, 3, 4)))
    p["lm_head"] = p["lm_head"].copy()
    p["lm_head"][2, 5, 7] += 1e-3  # one head differs in one weight: its own projection stays
    pcfg, pp = prepare_heads(cfg, p, base, depth=3)
    assert not pcfg.shared_lm_head and pp["proposal_lm_head"].shape == (3, D, 24)
    assert prepare_heads(cfg, p, None, depth=3)[0].shared_lm_head is False  # no base: nothing to compare


def test_prepare_heads_builds_a_lazy_base_lm_head_only_when_a_step_needs_it():
    """A function given as base_lm_head is called at most once, and not at all for heads that need
    no [D, V] matrix (already prepared, or shared without a proposal vocabulary): building it
    dequantizes a GGUF table (~150 ms for SmolLM2) at every start-up otherwise."""
    from medusa_jax.heads.medusa import prepare_heads

    calls = []

    def built():
        calls.append(1)
        return base

    cfg, p, base = _own_heads_with_proposals()
    p["lm_head"] = np.tile(base[None], (cfg.num_heads, 1, 1))  # copies of the base: step 2 compares them
    pcfg, pp = prepare_heads(cfg, p, built, depth=3)
    want_cfg, want = prepare_heads(cfg, p, base, depth=3)
    assert len(calls) == 1 and pcfg == want_cfg and pcfg.shared_lm_head  # once for the comparison and the projection
    np.testing.assert_array_equal(np.asarray(pp["proposal_lm_head_t"]), np.asarray(want["proposal_lm_head_t"]))
    prepare_heads(pcfg, pp, built, depth=2)  # already prepared: nothing to build
    scfg = cfg.replace(shared_lm_head=True, proposal_vocab_size=0)
    prepare_heads(scfg, {k: v for k, v in p.items() if k not in ("lm_head", "proposal_ids")}, built, depth=2)
    assert len(calls) == 1
    with pytest.raises(HeadsMismatchError, match=r"expected \[D, V\]"):  # a built matrix is checked too
        prepare_heads(cfg, p, lambda: base.T, depth=3)


def test_prepare_heads_errors():
    from medusa_jax.heads.medusa import prepare_heads

    cfg, p, base = _own_heads_with_proposals()
    for depth in (0, 5):
        with pytest.raises(ValueError, match=rf"depth must be in \[1, 4\].*got {depth}"):
            prepare_heads(cfg, p, base, depth=depth)
    scfg = cfg.replace(shared_lm_head=True)
    sp = {k: v for k, v in p.items() if k != "lm_head"}
    with pytest.raises(ValueError, match="need base_lm_head"):
        prepare_heads(scfg, sp)
    with pytest.raises(HeadsMismatchError, match=r"expected \[D, V\]"):
        prepare_heads(scfg, sp, base.T)


@pytest.mark.filterwarnings("ignore:the original Medusa code shares")
def test_official_own_lm_heads_with_proposals_and_a_shallow_tree_are_lossless(tmp_path):
    """Official-format heads with their own lm_heads, a proposal vocabulary added as tune does, and a
    tree of depth 2 over 4 heads: resolve_heads prepares them, and greedy output equals plain greedy."""
    from types import SimpleNamespace

    from conftest import tiny_decoding_model

    from medusa_jax.engine.generate import generate, generate_device
    from medusa_jax.decoding.tree import build_tree
    from medusa_jax.models.llama import lm_head_matrix
    from medusa_jax.resolve import resolve_heads

    mcfg, mparams = tiny_decoding_model(64)
    base = np.asarray(lm_head_matrix(mcfg, mparams))
    r = np.random.RandomState(0)
    hcfg = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4, num_layers=1, shared_lm_head=False, topk=4)
    hp = {"blocks_kernel": r.randn(4, 1, 32, 32).astype(np.float32) * 0.05,
          "blocks_bias": np.zeros((4, 1, 32), np.float32),
          "lm_head": base[None] + r.randn(4, 32, 64).astype(np.float32) * 0.05}  # distinct per head
    export_official(str(tmp_path / "official"), hcfg, hp, fmt="safetensors", include_lm_head=True)
    lcfg, lp = load_heads(str(tmp_path / "official"), mcfg)
    assert not lcfg.shared_lm_head and lp["lm_head"].shape == (4, 32, 64)
    ids = np.arange(0, 64, 2, dtype=np.int32)  # half the vocabulary may be proposed
    save_heads(str(tmp_path / "tuned"), lcfg.replace(proposal_vocab_size=32, topk=4),
               {**lp, "proposal_ids": ids})
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], topk=4)
    model = SimpleNamespace(cfg=mcfg, params=mparams)
    heads, tree, _ = resolve_heads(model, str(tmp_path / "tuned"), tree)
    assert heads[0].num_heads == 2 and not heads[0].shared_lm_head
    assert heads[1]["proposal_lm_head"].shape == (2, 32, 32) and "lm_head" not in heads[1]
    prompt = [4, 4, 2, 8, 19, 33]
    plain = generate(mcfg, mparams, prompt, max_new_tokens=60)
    med = generate(mcfg, mparams, prompt, max_new_tokens=60, heads=heads, tree=tree)
    dev = generate_device(mcfg, mparams, [prompt], max_new_tokens=60, heads=heads, tree=tree)
    assert med.tokens == plain.tokens == dev.tokens[0, :int(dev.count[0])].tolist()
    assert med.steps < len(med.tokens)  # the heads' candidates were accepted at some steps


@pytest.mark.parametrize("kw, message", [
    (dict(topk=0), r"topk \(candidates per head\) must be >= 1, got 0"),
    (dict(hidden_size=0), "need hidden_size >= 1 and vocab_size >= 1, got 0, 64"),
    (dict(num_heads=0), "num_heads must be >= 1, got 0"),
    (dict(num_layers=-1), "num_layers must be >= 0, got -1"),
])
def test_medusa_config_refuses_impossible_values(kw, message):
    """A config that could not propose anything (topk 0: it used to decode, proposing nothing) is
    refused when it is made, naming the field."""
    from medusa_jax.heads.config import MedusaConfig

    with pytest.raises(ValueError, match=message):
        MedusaConfig(**{"hidden_size": 8, "vocab_size": 64, **kw})


@pytest.mark.filterwarnings("ignore:the original Medusa code shares")
def test_official_export_of_shared_heads_needs_the_base_and_names_the_backbone(tmp_path):
    """The original loader builds per-head lm_heads and loads with strict=False: shared heads written
    without them would load there with random lm_heads, so the default export writes the base's
    copies (refusing without the base); the version-2 layout stays available on request, and
    base_model_name_or_path can name the backbone's Hugging Face id."""
    cfg = _cfg(True, base_model="SmolLM2-135M-Instruct.Q4_1.gguf")
    p, base = _random_params(cfg), _base_lm()
    with pytest.raises(ValueError, match="pass base_lm_head .*include_lm_head=False for the legacy version-2"):
        export_official(str(tmp_path / "a"), cfg, p, fmt="safetensors")
    path = export_official(str(tmp_path / "b"), cfg, p, base, fmt="safetensors",
                           base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    raw = json.load(open(os.path.join(tmp_path, "b", "config.json")))
    assert raw["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "version" not in raw
    assert f"{K - 1}.{L}.weight" in read_tensors(path)
    export_official(str(tmp_path / "c"), cfg, p, fmt="safetensors", include_lm_head=False)
    assert json.load(open(os.path.join(tmp_path, "c", "config.json")))["version"] == "2"


def test_vllm_files_are_read_as_vllm_builds_them(tmp_path):
    """vLLM's MedusaModel: block biases only with medusa_fc_bias true (its default is false), and
    num_heads heads when the file holds more; logit_scale must be positive (it leaves ranks as they are)."""
    cfg, base = _cfg(False), _base_lm()
    p = _random_params(cfg)
    p["blocks_bias"] = np.random.RandomState(3).randn(*p["blocks_bias"].shape).astype(np.float32)
    d = str(tmp_path / "v")
    export_vllm(d, cfg, p, base)
    fn = os.path.join(d, "config.json")
    raw = json.load(open(fn))
    np.testing.assert_allclose(load_heads(d)[1]["blocks_bias"], p["blocks_bias"])  # medusa_fc_bias: true
    for flag in (False, None):
        raw["medusa_fc_bias"] = flag
        json.dump({k: v for k, v in raw.items() if v is not None}, open(fn, "w"))
        assert not load_heads(d)[1]["blocks_bias"].any()
    raw.update(medusa_fc_bias=True, num_heads=K - 1)
    json.dump(raw, open(fn, "w"))
    lcfg, lp = load_heads(d)
    assert lcfg.num_heads == K - 1 and lp["blocks_kernel"].shape[0] == K - 1 and lp["lm_head"].shape[0] == K - 1
    raw.update(num_heads=K, logit_scale=0)
    json.dump(raw, open(fn, "w"))
    with pytest.raises(HeadsFormatError, match="logit_scale must be a number > 0, got 0"):
        load_heads(d)
