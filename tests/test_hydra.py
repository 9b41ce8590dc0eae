"""Hydra heads (Ankner et al. 2024; medusa_jax.heads.hydra): the math, the tree's per-parent draft, lossless
greedy decoding, an oracle, the heads directory format, calibration and tune on tiny models."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax.convert.medusa_format import (
    HeadsFormatError,
    export_official,
    export_vllm,
    load_heads,
    read_tensors,
    save_heads,
)
from medusa_jax.drafts import heads as draft
from medusa_jax.engine.generate import generate, generate_device
from medusa_jax.decoding.tree import build_tree, get_tree, random_tree, with_lookup
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.hydra import decoding_layout, from_medusa, head_state, hydra_logits, path_keys, token_embeddings
from medusa_jax.heads.medusa import MedusaHeads, init_heads, num_head_params, prepare_heads
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.tuning.calibrate import rank_accuracies

jax.config.update("jax_default_matmul_precision", "highest")

V = 64
DM = 32  # the tiny model's hidden size


def random_hydra(cfg, params, num_heads=4, num_layers=2, shared=True, seed=1, scale=0.3):
    """Hydra heads with every param random (so every input matters)."""
    hcfg = MedusaConfig(hidden_size=DM, vocab_size=V, num_heads=num_heads, num_layers=num_layers,
                        shared_lm_head=shared, head_type="hydra")
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(hp))
    return hcfg, {k: jax.random.normal(kk, a.shape) * scale for kk, (k, a) in zip(keys, sorted(hp.items()))}


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_decoding_model(V)
    return (cfg, params) + random_hydra(cfg, params)


def np_head(hp, k, L, h, path_emb):
    """The reference code's first block on the concatenation [h ; e_1 ; ... ; e_{k+1}] (numpy):
    linear = [W_h ; P], res_connection = [I ; R], then L-1 plain residual blocks."""
    p = {n: np.asarray(v, np.float64) for n, v in hp.items()}
    x_in = np.concatenate([h] + list(path_emb))                                   # [(k+2) D]
    lin = np.concatenate([p["blocks_kernel"][k, 0]] + list(p[f"path_kernel_{k}"]))  # [(k+2) D, D]
    res = np.concatenate([np.eye(DM)] + list(p[f"path_residual_{k}"]))
    silu = lambda z: z / (1 + np.exp(-z))
    x = x_in @ res + silu(x_in @ lin + p["blocks_bias"][k, 0])
    for l in range(1, L):
        x = x + silu(x @ p["blocks_kernel"][k, l] + p["blocks_bias"][k, l])
    return x


# ------------------------------------------------------------------------------------------ math

def test_head_state_matches_the_concatenated_reference(tiny):
    cfg, params, hcfg, hp = tiny
    r = np.random.default_rng(0)
    for k in range(hcfg.num_heads):
        h, e = r.normal(size=DM), r.normal(size=(k + 1, DM))
        got = np.asarray(head_state(hcfg, hp, k, jnp.asarray(h, jnp.float32), jnp.asarray(e, jnp.float32)))
        np.testing.assert_allclose(got, np_head(hp, k, hcfg.num_layers, h, e), rtol=1e-4, atol=1e-4)
    # the decoding layout (one [out, in] matrix per product) computes the same states, for a
    # batch of paths sharing one h_t as the tree draft runs it
    dec = decoding_layout(hcfg, hp, hcfg.num_heads)
    assert dec["decode_first_t_2"].shape == (DM, 4 * DM) and dec["decode_residual_t_2"].shape == (DM, 3 * DM)
    cut = decoding_layout(hcfg, dec, 2)  # re-made for 2 heads: the other heads' decoding keys go
    want = {f"decode_{n}_t_{k}" for k in range(2) for n in ("first", "residual")} | {"decode_block_t_0_1", "decode_block_t_1_1"} \
        | {f"decode_bias_{k}_{l}" for k in range(2) for l in range(2)}
    assert set(cut) == set(hp) | want
    for k in range(hcfg.num_heads):
        h, e = r.normal(size=(2, 1, DM)), r.normal(size=(2, 3, k + 1, DM))
        got = np.asarray(jax.jit(head_state, static_argnums=(0, 2))(
            hcfg, dec, k, jnp.asarray(h, jnp.float32), jnp.asarray(e, jnp.float32)))
        assert got.shape == (2, 3, DM)
        for b in range(2):
            for n in range(3):
                np.testing.assert_allclose(got[b, n], np_head(hp, k, hcfg.num_layers, h[b, 0], e[b, n]),
                                           rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="path of 2 tokens"):
        head_state(hcfg, hp, 1, jnp.zeros(DM), jnp.zeros((3, DM)))


def test_fresh_and_warm_started_hydra_heads_are_the_medusa_heads(tiny):
    """Zero path weights: a fresh hydra head gives the base logits, and Medusa heads turned into
    hydra heads (`from_medusa`) keep their logits whatever the path."""
    cfg, params, _, _ = tiny
    lm = lm_head_matrix(cfg, params)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (6, DM))
    path = jax.random.normal(jax.random.PRNGKey(3), (6, 3, DM))
    hcfg = MedusaConfig(hidden_size=DM, vocab_size=V, num_heads=3, num_layers=2, head_type="hydra")
    fresh = hydra_logits(hcfg, init_heads(hcfg, lm), hidden, path, lm)
    np.testing.assert_allclose(np.asarray(fresh), np.broadcast_to(np.asarray(hidden @ lm), (3, 6, V)), rtol=1e-5,
                               atol=1e-5)
    mcfg = hcfg.replace(head_type="medusa", shared_lm_head=False)
    mp = init_heads(mcfg, lm)
    mp = {k: a + 0.2 * jax.random.normal(jax.random.PRNGKey(i), a.shape) for i, (k, a) in enumerate(mp.items())}
    wcfg, wp = from_medusa(mcfg, mp)
    assert wcfg.head_type == "hydra" and set(path_keys(3)) <= set(wp)
    np.testing.assert_allclose(np.asarray(hydra_logits(wcfg, wp, hidden, path)),
                               np.asarray(MedusaHeads(mcfg).apply({"params": mp}, hidden)), rtol=1e-5, atol=1e-5)
    assert num_head_params(wcfg) == num_head_params(mcfg) + 2 * DM * DM * (1 + 2 + 3)


def test_config_refuses_unknown_type_and_zero_layer_hydra():
    with pytest.raises(ValueError, match="head_type must be one of"):
        MedusaConfig(hidden_size=8, vocab_size=16, head_type="eagle")
    with pytest.raises(ValueError, match="num_layers >= 1"):
        MedusaConfig(hidden_size=8, vocab_size=16, num_layers=0, head_type="hydra")


# ------------------------------------------------------------------------------------------ tree

def test_per_parent_tree_buffers_by_hand():
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,2), 5 (1,1), 6 (0,0,3)
    t = build_tree([(0,), (1,), (0, 0), (0, 2), (1, 1), (0, 0, 3)], topk=4)
    assert t.expand_nodes.tolist() == [0, 1, 2, 3]
    assert t.expand_offsets.tolist() == [0, 1, 3, 4]
    # [root | node0's top-4 (slots 1..4) | node1's (5..8) | node2's (9..12) | node3's (13..16)]
    assert t.parent_tree_indices.tolist() == [0, 1, 2, 5, 7, 10, 16]
    assert t.node_paths.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 1, 3, 0], [0, 1, 4, 0],
                                     [0, 2, 5, 0], [0, 1, 3, 6]]
    triv = build_tree([], topk=3)
    assert triv.expand_nodes.size == 0 and triv.parent_tree_indices.tolist() == [0]


@pytest.mark.parametrize("seed", range(4))
def test_per_parent_indices_point_at_the_parent_and_rank(seed):
    t = build_tree(random_tree(25, 4, 5, seed=seed), topk=5)
    for i in range(1, t.size):
        slot, rank = divmod(int(t.parent_tree_indices[i]) - 1, t.topk)
        parent = int(t.expand_nodes[slot])
        assert parent == t.parents[i] and rank == t.medusa_choices[i - 1][-1]
        d = int(t.depth[parent])
        assert t.expand_offsets[d] <= slot < t.expand_offsets[d + 1]
        path = t.node_paths[i, :t.depth[i] + 1].tolist()
        assert path[-1] == i and path[:-1] == t.node_paths[parent, :d + 1].tolist()


# ------------------------------------------------------------------------------------------ draft

def reference_draft(hcfg, hp, hidden, root, emb, lm, tree, proposal_ids=None):
    """Each node's children from head d on that node's own path, node by node (no batching)."""
    tokens = [int(root)]
    for i in range(1, tree.size):
        parent = int(tree.parents[i])
        d = int(tree.depth[parent])
        path = [tokens[n] for n in tree.node_paths[parent, :d + 1]]
        x = np.asarray(head_state(hcfg, hp, d, hidden, jnp.asarray(emb)[jnp.asarray(path)]))
        proj = lm if hcfg.shared_lm_head else hp["lm_head"][d]
        logits = x @ np.asarray(proj)
        if proposal_ids is not None:
            ids = np.asarray(proposal_ids)
            order = ids[np.argsort(-logits[ids], kind="stable")]
        else:
            order = np.argsort(-logits, kind="stable")
        tokens.append(int(order[tree.medusa_choices[i - 1][-1]]))
    return tokens


@pytest.mark.parametrize("tree_spec", ["small_16", "chain3", random_tree(30, 4, 6, seed=1)],
                         ids=["small_16", "chain3", "random30"])
@pytest.mark.parametrize("variant", ["shared", "own", "proposal"])
def test_hydra_draft_equals_node_by_node_reference(tiny, tree_spec, variant):
    cfg, params, hcfg, hp = tiny
    lm = lm_head_matrix(cfg, params)
    emb = token_embeddings(params)
    ids = None
    if variant == "own":
        hcfg, hp = random_hydra(cfg, params, shared=False, seed=5)
    if variant == "proposal":
        ids = np.random.RandomState(0).choice(V, 20, replace=False).astype(np.int32)
        hcfg, hp = hcfg.replace(proposal_vocab_size=20), {**hp, "proposal_ids": jnp.asarray(ids)}
    tree = get_tree(tree_spec, topk=10, num_heads=4)
    pcfg, pp = prepare_heads(hcfg, hp, lm, depth=tree.max_depth)
    hidden = jax.random.normal(jax.random.PRNGKey(7), (2, DM))
    root = jnp.asarray([5, 17], jnp.int32)
    got = np.asarray(jax.jit(draft.hydra_candidates, static_argnums=(0, 6))(pcfg, pp, hidden, root, emb, lm, tree))
    assert got.shape == (2, tree.size)
    for b in range(2):
        assert got[b].tolist() == reference_draft(hcfg, hp, hidden[b], root[b], emb, lm, tree, ids)
    # prepared again (each generate call prepares its heads): the decoding layout is kept, not remade
    again = prepare_heads(pcfg, pp, lm, depth=tree.max_depth)[1]
    decode = [k for k in pp if k.startswith("decode_")]
    assert decode and all(again[k] is pp[k] for k in decode)
    assert pp["decode_first_t_0"].dtype == jnp.bfloat16  # the draft's dtype (heads.DRAFT_DTYPE)


# ------------------------------------------------------------------------------------------ decoding

PROMPTS = [[1, 5, 9, 3, 7], [12]]


@pytest.mark.parametrize("tree_spec", ["chain4", "small_16", random_tree(20, 4, 10, seed=3)],
                         ids=["chain4", "small_16", "random20"])
def test_hydra_greedy_equals_plain_greedy(tiny, tree_spec):
    cfg, params, hcfg, hp = tiny
    tree = get_tree(tree_spec, topk=10, num_heads=hcfg.num_heads)
    heads = prepare_heads(hcfg, hp, lm_head_matrix(cfg, params), depth=tree.max_depth)
    for prompt in PROMPTS:
        base = generate(cfg, params, prompt, max_new_tokens=80)
        med = generate(cfg, params, prompt, max_new_tokens=80, heads=heads, tree=tree)
        assert med.tokens == base.tokens and sum(med.tokens_per_step) == 80
        r = generate_device(cfg, params, [prompt], max_new_tokens=80, heads=heads, tree=tree, eos_token_ids=())
        assert r.tokens[0].tolist() == base.tokens and int(r.hist.sum()) == r.steps


def bigram_backbone():
    """A tiny Llama whose layers add nothing (o_proj and down_proj zero) and whose embedding rows
    have RMS 1: its hidden state at t is norm_scale * E[x_t] / sqrt(1 + eps), so its greedy next
    token is a function of the current token only."""
    cfg, params = tiny_decoding_model(V)
    params = jax.tree_util.tree_map(lambda a: a, params)
    for name in [n for n in params if n.startswith("layers_")]:
        params[name]["attn"]["o_proj"]["kernel"] = jnp.zeros_like(params[name]["attn"]["o_proj"]["kernel"])
        params[name]["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(params[name]["mlp"]["down_proj"]["kernel"])
    e = params["embed"]["embedding"]
    params["embed"]["embedding"] = e / jnp.sqrt(jnp.mean(e * e, axis=-1, keepdims=True))
    return cfg, params


@pytest.mark.parametrize("tree_spec", ["chain4", "small_16"])
def test_oracle_hydra_heads_give_depth_plus_one_tokens_per_step(tree_spec):
    """Hydra heads that read the last token of their path, and map it as the backbone does, propose
    the true next token at every depth: every step accepts the whole depth. Medusa heads cannot do
    this (their input is h_t only), so it also shows each node reads its own path."""
    cfg, params = bigram_backbone()
    K = 4
    hcfg = MedusaConfig(hidden_size=DM, vocab_size=V, num_heads=K, num_layers=1, head_type="hydra")
    hp = init_heads(hcfg, lm_head_matrix(cfg, params))
    big = 1e3 * jnp.diag(params["norm"]["scale"])  # e -> (a large multiple of) the backbone's hidden state
    for k in range(K):
        hp[f"path_residual_{k}"] = hp[f"path_residual_{k}"].at[k].set(big)
    tree = get_tree(tree_spec, num_heads=K)
    heads = prepare_heads(hcfg, hp, lm_head_matrix(cfg, params), depth=tree.max_depth)
    prompt = [3, 9, 27]
    base = generate(cfg, params, prompt, max_new_tokens=60)
    med = generate(cfg, params, prompt, max_new_tokens=60, heads=heads, tree=tree)
    assert med.tokens == base.tokens
    assert all(n == tree.max_depth + 1 for n in med.tokens_per_step[:-1]), med.tokens_per_step
    r = generate_device(cfg, params, [prompt], max_new_tokens=60, heads=heads, tree=tree, eos_token_ids=())
    assert r.tokens[0].tolist() == base.tokens and r.steps == len(med.tokens_per_step)


# ------------------------------------------------------------------------------------------ formats

def test_heads_directory_round_trip_and_depth_cut(tmp_path, tiny):
    cfg, params, _, _ = tiny
    lm = lm_head_matrix(cfg, params)
    hcfg, hp = random_hydra(cfg, params, num_heads=3, shared=False, seed=9)
    hcfg = hcfg.replace(medusa_choices=((0,), (0, 0), (0, 0, 0)))
    save_heads(str(tmp_path), hcfg, hp)
    raw = json.load(open(tmp_path / "config.json"))
    assert raw["head_type"] == "hydra"
    names = read_tensors(str(tmp_path / "medusa_lm_head.safetensors"))
    assert names["hydra.2.path_linear.weight"].shape == (DM, 3 * DM)
    assert names["hydra.0.path_residual.weight"].shape == (DM, DM)
    cfg2, p2 = load_heads(str(tmp_path), cfg)
    assert cfg2 == hcfg
    assert sorted(p2) == sorted(hp) and all(np.array_equal(p2[k], np.asarray(hp[k])) for k in hp)
    hidden = jax.random.normal(jax.random.PRNGKey(1), (4, DM))
    path = jax.random.normal(jax.random.PRNGKey(2), (4, 3, DM))
    np.testing.assert_array_equal(np.asarray(hydra_logits(cfg2, p2, hidden, path, lm)),
                                  np.asarray(hydra_logits(hcfg, hp, hidden, path, lm)))
    cfg1, p1 = load_heads(str(tmp_path), cfg, num_heads=2)
    assert cfg1.num_heads == 2 and set(p1) == {"blocks_kernel", "blocks_bias", "lm_head"} | set(path_keys(2))
    # float16 files (the shipped heads): half the bytes, loaded back as float32 equal up to f16 rounding
    half = tmp_path / "half"
    save_heads(str(half), hcfg, hp, dtype=np.float16)
    from safetensors.numpy import load_file
    assert load_file(str(half / "medusa_lm_head.safetensors"))["hydra.2.path_linear.weight"].dtype == np.float16
    assert os.path.getsize(half / "medusa_lm_head.safetensors") < 0.55 * os.path.getsize(tmp_path / "medusa_lm_head.safetensors")
    _, ph = load_heads(str(half), cfg)
    for k in hp:
        assert ph[k].dtype == np.float32
        np.testing.assert_array_equal(ph[k], np.asarray(hp[k]).astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="float32 or float16"):
        save_heads(str(tmp_path / "bad"), hcfg, hp, dtype=np.int8)


def test_hydra_file_errors(tmp_path, tiny):
    from safetensors.numpy import save_file

    cfg, params, hcfg, hp = tiny
    save_heads(str(tmp_path / "ok"), hcfg, hp)
    tensors = read_tensors(str(tmp_path / "ok" / "medusa_lm_head.safetensors"))
    raw = json.load(open(tmp_path / "ok" / "config.json"))
    cases = {
        "untyped": ({k: v for k, v in raw.items() if k != "head_type"}, tensors,
                    r"config.json sets no head_type \(so 'medusa'\); set \"head_type\": \"hydra\""),
        "medusa": ({**raw, "head_type": "medusa"}, tensors, "config.json says head_type='medusa'"),
        "missing": (raw, {k: v for k, v in tensors.items() if k != "hydra.3.path_linear.weight"},
                    "hydra.3.path_linear.weight"),
        "shape": (raw, {**tensors, "hydra.1.path_residual.weight": np.zeros((DM, DM), np.float32)}, r"\(32, 64\)"),
        "type": ({**raw, "head_type": "hydro"}, tensors, "head_type 'hydro'"),
    }
    for name, (conf, tens, msg) in cases.items():
        d = tmp_path / name
        d.mkdir()
        save_file(tens, str(d / "medusa_lm_head.safetensors"))
        (d / "config.json").write_text(json.dumps(conf))
        with pytest.raises(HeadsFormatError, match=msg):
            load_heads(str(d), cfg)
    for export in (lambda p: export_official(p, hcfg, hp, fmt="safetensors"),
                   lambda p: export_vllm(p, hcfg, hp, lm_head_matrix(cfg, params))):
        with pytest.raises(ValueError, match="these are hydra heads.*save_heads"):
            export(str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()
    with pytest.raises(ValueError, match="path_kernel_2"):
        save_heads(str(tmp_path / "bad"), hcfg, {k: v for k, v in hp.items() if k != "path_kernel_2"})


# ------------------------------------------------------------------------------------------ calibration

def test_calibration_is_teacher_forced(tiny):
    """Hydra rank accuracies read the true path: labels chosen as the rank-r tokens of the
    teacher-forced heads give exactly acc[k][r] = 1, and a wrong path breaks them."""
    cfg, params, hcfg, hp = tiny
    lm = lm_head_matrix(cfg, params)
    emb = token_embeddings(params)
    N = 24
    hidden = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (N, DM)))
    path = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (4, N), 0, V), np.int32)
    top = np.zeros((4, N, 4), np.int64)
    for k in range(4):
        for n in range(N):
            x = np.asarray(head_state(hcfg, hp, k, hidden[n], emb[path[:k + 1, n]]))
            top[k, n] = np.argsort(-(x @ np.asarray(lm)), kind="stable")[:4]
    labels = np.stack([top[k, :, k] for k in range(4)]).astype(np.int32)
    valid = np.ones((4, N), bool)
    acc, counts = rank_accuracies(hcfg, hp, lm, hidden, labels, valid, topk=4, batch=10, path_tokens=path,
                                  embeddings=emb)
    np.testing.assert_allclose(acc, np.eye(4))
    assert counts.tolist() == [N] * 4
    wrong = path.copy()
    wrong[0] = (wrong[0] + 1) % V  # another root token: the heads' proposals move
    acc2, _ = rank_accuracies(hcfg, hp, lm, hidden, labels, valid, topk=4, batch=10, path_tokens=wrong,
                              embeddings=emb)
    assert np.trace(acc2) < 4 - 1e-9
    with pytest.raises(ValueError, match="path_tokens"):
        rank_accuracies(hcfg, hp, lm, hidden, labels, valid, topk=4)


@pytest.mark.slow
def test_tune_and_decode_with_hydra_heads(tmp_path):
    """End to end on a tiny HF model: tune calibrates hydra heads, times their tree and saves it with
    them; resolve_heads loads them for decoding, which stays lossless."""
    from conftest import tiny_tune_run

    from medusa_jax.resolve import resolve_heads

    lm, rc = tiny_tune_run(tmp_path, head_type="hydra", sizes="2,4,6")
    assert rc == 0
    cfg2, p2 = load_heads(str(tmp_path / "tuned"), lm.cfg)
    report = json.load(open(tmp_path / "tuned" / "config.json"))["tree_search"]
    assert cfg2.head_type == "hydra" and cfg2.proposal_vocab_size == 64
    assert np.asarray(report["rank_accuracies"]).shape == (3, 5) and report["step_breakdown_ms"]["heads_ms"] > 0
    heads, tree, _ = resolve_heads(lm, str(tmp_path / "tuned"), tree_spec="small_8")
    assert heads[0].head_type == "hydra" and tree.size == 8
    prompt = [1, 20, 33, 7]
    base = generate(lm.cfg, lm.params, prompt, max_new_tokens=30, eos_token_ids=())
    med = generate(lm.cfg, lm.params, prompt, max_new_tokens=30, heads=heads, tree=tree, eos_token_ids=())
    assert med.tokens == base.tokens
    # trees chosen per step were replayed and timed at every size too (dynamic:T:4, the default width)
    drows = report["dynamic_rows"]
    assert [r["size"] for r in drows] == [2, 4, 6] and all(r["dynamic"] == {"budget": r["size"], "width": 4}
                                                              for r in drows)
    for r in drows:
        assert r["predicted_tokens_per_step"] >= 1 and r["predicted_speedup"] == pytest.approx(
            r["predicted_tokens_per_step_lookup"] / r["cost"])
    best = max(report["rows"] + drows, key=lambda r: (r["predicted_speedup"], -r["size"]))
    if best["size"] == 1:  # no tree beats plain decoding: the best tree is kept anyway
        best = max(report["rows"][1:] + drows, key=lambda r: r["predicted_speedup"])
    assert report["chosen_size"] == best["size"] and report["dynamic_tree"] == best.get("dynamic")
    # by default decoding uses the tree tune chose: here a dynamic one written into the report
    config = json.load(open(tmp_path / "tuned" / "config.json"))
    config["tree_search"]["dynamic_tree"] = {"budget": 6, "width": 2}
    json.dump(config, open(tmp_path / "tuned" / "config.json", "w"))
    heads, tree, _ = resolve_heads(lm, str(tmp_path / "tuned"))
    assert tree.dynamic[:2] == (6, 2) and tree.size == 6 and tree.lookup is not None
    # ... scoring its nodes by the heads' confidence tune measured (and lookup's, when it found copies)
    conf = report["confidence"]
    assert tree.dynamic.confidence == (tuple(conf["knots"]), tuple(tuple(v) for v in conf["values"]))
    assert len(conf["values"]) == 3 and all(x <= 0 for v in conf["values"] for x in v)
    look = report["lookup_confidence"]
    assert tree.dynamic.lookup_confidence == (tuple(tuple(r) for r in look) if look else None)
    by_n = report["lookup_ngram_confidence"]  # by the n-gram each copy matched: too few positions here
    assert "lookup_ngram_confidence" in report and tree.dynamic.lookup_ngram_confidence == (
        tuple(sorted((int(n), tuple(r)) for n, r in by_n.items())) if by_n else None)
    assert "Trees chosen per step" in (tmp_path / "tuned" / "tree_search.md").read_text()
    # bench's prediction for a dynamic tree: the figure tune replayed for its budget and width
    from medusa_jax.resolve import heads_calibration, predicted_tokens_per_step
    calibration = heads_calibration(str(tmp_path / "tuned"))
    assert predicted_tokens_per_step(tree, calibration) is None  # width 2 was never replayed
    replayed = get_tree("dynamic:4:4", topk=5, num_heads=3)
    # decoding copies 8 tokens into a dynamic tree, tune replayed copies of 3: the same trees at T = 4
    # (at most T - 1 = 3 copied tokens are ever kept), not at T = 6
    assert (tree.lookup.num_tokens, report["prompt_lookup"]["num_tokens"]) == (8, 3)
    pred, basis = predicted_tokens_per_step(with_lookup(replayed, tree.lookup), calibration)
    assert pred == drows[1]["predicted_tokens_per_step_lookup"] and "with prompt lookup" in basis
    six = get_tree("dynamic:6:4", topk=5, num_heads=3)
    assert predicted_tokens_per_step(with_lookup(six, tree.lookup), calibration) is None
    assert predicted_tokens_per_step(with_lookup(six, tree.lookup._replace(num_tokens=3)), calibration)[0] == \
        drows[2]["predicted_tokens_per_step_lookup"]
    # the copies' acceptance is measured to depth 8 (n-gram matching alone), deeper than the replay reaches
    assert look and all(len(r) == 8 for r in look)
    pred, basis = predicted_tokens_per_step(replayed, calibration)
    assert pred == drows[1]["predicted_tokens_per_step"] and "heads alone" in basis
    med = generate(lm.cfg, lm.params, prompt, max_new_tokens=30, heads=heads, tree=tree, eos_token_ids=())
    assert med.tokens == base.tokens
