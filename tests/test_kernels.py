"""The weight-streaming CPU kernels (`medusa_jax.kernels`) and the backbone's decoding layout.

The kernel's products must equal float64 products to float32 round-off, on shapes that are not
multiples of the vector width or of the kernel's blocks; a row's result must not depend on how
many rows are multiplied with it (so a tree step's logits equal a plain step's); the decoding
layout must give the model's logits; and every fallback to XLA must still decode.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, rel_err, tiny_config, tiny_decoding_model

from medusa_jax import kernels
from medusa_jax.models.layout import decoding_params
from medusa_jax.models.llama import LlamaModel, lm_head_matrix

ROOT = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.status()}")


def _supported_here() -> bool:
    ok, _ = kernels.cpu_supported()
    return ok and shutil.which(os.environ.get("CXX", "c++")) is not None \
        and os.environ.get("MEDUSA_JAX_KERNELS", "1") != "0"


def test_kernels_are_used_where_they_can_be():
    """On an AVX2+FMA x86-64 machine with a C++ compiler the kernels must load (else every other
    kernel test would silently test XLA against itself)."""
    if _supported_here():
        assert kernels.available(), kernels.status()
        assert kernels.status().startswith("weight-streaming")
    else:
        assert not kernels.available()
        assert kernels.status().startswith("XLA")


def test_status_names_xla_off_the_cpu_backend(monkeypatch):
    """On a GPU the products are XLA's whether or not the CPU kernels load (`platform_dependent`):
    tune's report said "weight-streaming CPU kernels" on the H200 (2026-12-04)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kernels.status().startswith("XLA's gpu products")


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("K,N", [(1, 1), (7, 3), (8, 4), (13, 5), (33, 12), (64, 13), (577, 203), (576, 1537)])
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_matmul_nt_matches_float64(M, K, N, wdtype):
    """float32 and bfloat16 weights (the latter widened exactly, so the reference is the float64
    product with the bfloat16-rounded weights)."""
    rng = np.random.default_rng(M * 1000 + K * 10 + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((N, K)).astype(np.float32)).astype(wdtype)
    got = jax.jit(kernels.matmul_nt)(jnp.asarray(x), w)
    assert got.dtype == jnp.float32
    got = np.asarray(got)
    want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    # float32 sums of K products of unit normals: error ~ eps * sqrt(K) * |terms|
    assert np.abs(got - want).max() <= 1e-6 * K + 1e-5, np.abs(got - want).max()
    xla = np.asarray(jax.jit(kernels.xla_nt)(x, w))
    assert rel_err(got, xla) < 1e-5


@needs_kernels
def test_bfloat16_weights_are_streamed_as_they_are():
    """A bfloat16 weight goes to the bf16 kernel as it is: no float32 copy of it in the program."""
    x = jnp.ones((2, 576), jnp.float32)
    w = jnp.ones((8192, 576), jnp.bfloat16)
    hlo = jax.jit(lambda x, w: kernels.matmul_nt(x, kernels.weight_for(w, jnp.float32))).lower(x, w).compile().as_text()
    assert 'custom_call_target="medusa_matmul_nt_bf16"' in hlo
    assert "f32[8192,576]" not in hlo


@needs_kernels
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_rows_do_not_depend_on_how_many_are_multiplied(wdtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 577)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((1001, 577)).astype(np.float32)).astype(wdtype)
    full = np.asarray(jax.jit(kernels.matmul_nt)(x, w))
    for m in (1, 2, 3, 5, 8):
        part = np.asarray(jax.jit(kernels.matmul_nt)(x[:m], w))
        np.testing.assert_array_equal(part, full[:m])  # bit for bit


@needs_kernels
@pytest.mark.parametrize("V", [1, 7, 8, 9, 33, 1000, 49152])
def test_argmax_matches_jnp_argmax(V):
    """The greedy token, as jnp.argmax: ties (the first index wins), signed zeros, -inf rows,
    NaNs (the first NaN wins), leading dims; and the kernel is what runs."""
    rng = np.random.default_rng(V)
    x = rng.standard_normal((3, 5, V)).astype(np.float32)
    x[0, 1] = np.round(x[0, 1])                         # many ties
    x[0, 2] = -np.inf
    x[0, 3] = 0.0
    x[0, 3, V // 2:] = -0.0
    x[1, 0, V - 1] = np.nan
    x[1, 1, [0, V - 1]] = np.nan
    x[1, 2, V // 3] = np.nan
    x[1, 2, V // 2] = np.inf
    x[2, 0, V - 1] = x[2, 0].max() + 1                  # the last element is the largest
    x[2, 1] = x[2, 1].max()                             # all equal
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    f = jax.jit(kernels.argmax)
    got = np.asarray(f(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (3, 5)
    np.testing.assert_array_equal(got, want)
    assert 'custom_call_target="medusa_argmax_rows"' in f.lower(jnp.asarray(x)).compile().as_text()


@needs_kernels
def test_concurrent_products_from_several_threads():
    """Products big enough to be split between the kernel's worker threads, called from several
    Python threads at once (as XLA's threads do with several devices): every result equals the
    one-call result bit for bit, whichever thread ran which columns."""
    import concurrent.futures

    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((5003, 577)).astype(np.float32))  # 11.5 MB: many chunks
    xs = [jnp.asarray(rng.standard_normal((m, 577)).astype(np.float32)) for m in (1, 2, 3, 4, 7, 16)]
    f = jax.jit(kernels.matmul_nt)
    want = [np.asarray(f(x, w)) for x in xs]
    assert rel_err(want[3], np.asarray(xs[3], np.float64) @ np.asarray(w, np.float64).T) < 1e-5

    def run(i):
        return all(np.array_equal(np.asarray(f(xs[j % len(xs)], w)), want[j % len(xs)]) for j in range(i, i + 12))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))


@needs_kernels
@pytest.mark.parametrize("B,T,H,KVH,S,Dh", [(1, 1, 9, 3, 256, 64), (2, 4, 8, 2, 40, 12), (1, 16, 4, 4, 67, 130),
                                            (3, 3, 6, 1, 9, 72), (2, 7, 2, 2, 128, 8),
                                            (1, 4, 9, 3, 1000, 64)])
def test_cache_attention_matches_xla(B, T, H, KVH, S, Dh):
    """The attention kernel over a [L, B, KVH, S, Dh] cache equals XLA's attention (float64
    reference too) with ragged lengths, a tree-like mask with holes, a sliding window and a query
    that sees nothing (the mean of all values); a query's result does not depend on T (bit for bit)."""
    from medusa_jax.models.llama import grouped_query_attention

    rng = np.random.default_rng(B * 100 + T * 10 + S)
    L, layer = 3, 1
    q = rng.standard_normal((B, T, H, Dh)).astype(np.float32) * 2
    k = rng.standard_normal((L, B, KVH, S, Dh)).astype(np.float32)
    v = rng.standard_normal((L, B, KVH, S, Dh)).astype(np.float32)
    lengths = rng.integers(0, S - T + 1, size=B).astype(np.int32)
    s = np.arange(S)[None, None, :]
    rel = s - lengths[:, None, None]                                       # [B, 1, S]
    block = np.tril(rng.random((T, T)) < 0.7) | np.eye(T, dtype=bool)      # ancestor-like, self visible
    idx = np.clip(rel, 0, T - 1)
    mask = (rel < 0) | ((rel >= 0) & (rel < T) & np.take_along_axis(np.broadcast_to(block, (B, T, T)),
                                                                      np.broadcast_to(idx, (B, T, S)), axis=2))
    if S > 20:
        mask[0] &= (lengths[0] + np.arange(T))[:, None] - np.arange(S)[None, :] < 20   # row 0: a window
    if B > 1:
        mask[1, 0] = False                                                  # sees nothing
    args = [jnp.asarray(a) for a in (q, k, v, mask, lengths)]
    xla = lambda q, k, v, mask, lengths: grouped_query_attention(q, k[layer], v[layer], mask)
    got = np.asarray(jax.jit(lambda *a: kernels.cache_attention(*a, layer, xla))(*args))
    want = np.asarray(jax.jit(xla)(*args))
    assert got.shape == (B, T, H * Dh)
    assert rel_err(got, want) < 1e-5
    # float64 reference
    g = H // KVH
    kk = np.repeat(k[layer].astype(np.float64), g, axis=1)                  # [B, H, S, Dh]
    vv = np.repeat(v[layer].astype(np.float64), g, axis=1)
    sc = np.einsum("bthd,bhsd->bhts", q.astype(np.float64), kk) / np.sqrt(Dh)
    sc = np.where(mask[:, None], sc, -np.inf)
    sc = np.where(mask.any(-1)[:, None, :, None], sc, 0.0)                 # no visible slot: uniform
    p = np.exp(sc - sc.max(-1, keepdims=True))
    ref = np.einsum("bhts,bhsd->bthd", p / p.sum(-1, keepdims=True), vv).reshape(B, T, H * Dh)
    assert np.abs(got - ref).max() < 1e-4
    # the first query alone (T = 1, same visible slots) gives the same bits
    one = np.asarray(jax.jit(lambda *a: kernels.cache_attention(*a, layer, xla))(
        args[0][:, :1], args[1], args[2], args[3][:, :1], args[4]))
    np.testing.assert_array_equal(one[:, 0], got[:, 0])


def test_leading_dims_gradients_vmap_and_large_products():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((21, 40)).astype(np.float32))
    want = np.einsum("btk,nk->btn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert rel_err(jax.jit(kernels.matmul_nt)(x, w), want) < 1e-5
    big = jnp.asarray(rng.standard_normal((kernels.MAX_ROWS + 3, 40)).astype(np.float32))  # XLA's product
    assert rel_err(kernels.matmul_nt(big, w), np.asarray(big, np.float64) @ np.asarray(w, np.float64).T) < 1e-5
    loss = lambda x, w: jnp.sum(jnp.sin(kernels.matmul_nt(x, w)))
    ref = lambda x, w: jnp.sum(jnp.sin(jnp.einsum("btk,nk->btn", x, w)))
    for a, b in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
        assert rel_err(a, b) < 1e-5
    batched = jax.vmap(kernels.matmul_nt, in_axes=(0, None))(x, w)
    assert rel_err(batched, want) < 1e-5
    with pytest.raises(ValueError, match="does not match"):
        kernels.matmul_nt(x, w[:, :39])


@needs_kernels
def test_on_huge_pages_copies_into_aligned_memory_used_in_place(monkeypatch):
    """A big CPU array comes back equal, in memory aligned to 2 MB that the jax array uses in place
    (and that outlives the numpy view it was written through); small arrays, and every array with
    MEDUSA_JAX_HUGE_PAGES=0, come back as they were; a jitted product reads it like the original."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((3000, 577)).astype(np.float32))  # 6.9 MB
    b = kernels.on_huge_pages(a)
    assert b is not a and b.shape == a.shape and b.dtype == a.dtype
    assert b.unsafe_buffer_pointer() % (2 << 20) == 0
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    x = jnp.asarray(rng.standard_normal((3, 577)).astype(np.float32))
    f = jax.jit(lambda x, w: kernels.matmul_nt(x, w))
    np.testing.assert_array_equal(np.asarray(f(x, b)), np.asarray(f(x, a)))
    del a
    import gc
    gc.collect()
    assert np.isfinite(np.asarray(b)).all()
    small = jnp.ones((10, 10))
    assert kernels.on_huge_pages(small) is small
    monkeypatch.setenv("MEDUSA_JAX_HUGE_PAGES", "0")
    assert kernels.on_huge_pages(b) is b


@pytest.mark.slow
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_decoding_layout_gives_the_same_logits(arch, tied):
    cfg = tiny_config(arch, tie_word_embeddings=tied)
    tokens = random_tokens(cfg, (1, 9))
    params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.asarray(tokens), jnp.arange(9)[None])["params"]
    dec = decoding_params(params)
    assert decoding_params(params) is dec and decoding_params(dec) is dec  # cached; idempotent
    if kernels.available():
        attn, mlp = params["layers_0"]["attn"], params["layers_0"]["mlp"]
        d_attn, d_mlp = dec["layers_0"]["attn"], dec["layers_0"]["mlp"]
        assert set(d_mlp) == {"gate_up_t", "down_proj"} and set(d_mlp["down_proj"]) == {"kernel_t"}
        np.testing.assert_array_equal(np.asarray(d_mlp["down_proj"]["kernel_t"]), np.asarray(mlp["down_proj"]["kernel"]).T)
        np.testing.assert_array_equal(  # gate's rows first, then up's
            np.asarray(d_mlp["gate_up_t"]),
            np.concatenate([np.asarray(mlp["gate_proj"]["kernel"]).T, np.asarray(mlp["up_proj"]["kernel"]).T]))
        qkv = [np.asarray(attn[p]["kernel"]).T for p in ("q_proj", "k_proj", "v_proj")]
        np.testing.assert_array_equal(np.asarray(d_attn["qkv_t"]), np.concatenate(qkv))
        assert d_attn["qkv_t"].shape == (cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads), cfg.hidden_size)
        if arch == "qwen2":
            np.testing.assert_array_equal(np.asarray(d_attn["qkv_bias"]), np.concatenate(
                [np.asarray(attn[p]["bias"]) for p in ("q_proj", "k_proj", "v_proj")]))
        else:
            assert "qkv_bias" not in d_attn
    np.testing.assert_array_equal(np.asarray(lm_head_matrix(cfg, dec)), np.asarray(lm_head_matrix(cfg, params)))
    for T in (1, 4, 9):  # the kernel's rows (T <= 16) and XLA's
        pos = jnp.arange(T)[None]
        a = LlamaModel(cfg).apply({"params": params}, jnp.asarray(tokens[:, :T]), pos)[0]
        b = LlamaModel(cfg).apply({"params": dec}, jnp.asarray(tokens[:, :T]), pos)[0]
        assert rel_err(b, a) < 1e-5


_FALLBACK = """
import numpy as np
from medusa_jax import kernels
from medusa_jax.engine.generate import generate_device
from medusa_jax.models.layout import decoding_params
from conftest import tiny_decoding_model
cfg, params = tiny_decoding_model()
assert not kernels.available(), kernels.status()
print(kernels.status())
assert decoding_params(params) is params
r = generate_device(cfg, params, [[1, 2, 3]], max_new_tokens=12, progress=False)
print(" ".join(map(str, r.tokens[0].tolist())))
"""


@pytest.mark.slow
@pytest.mark.parametrize("env,why", [({"MEDUSA_JAX_KERNELS": "0"}, "disabled by MEDUSA_JAX_KERNELS=0"),
                                     ({"CXX": "/nonexistent/c++"}, "no C++ compiler")])
def test_xla_fallback_decodes(tmp_path, env, why):
    """Without the kernels (switched off, or no compiler to build them) decoding runs on XLA's
    products and gives the same greedy tokens."""
    full_env = {**os.environ, "MEDUSA_JAX_CACHE": str(tmp_path / "cache"), **env}
    out = subprocess.run([sys.executable, "-c", _FALLBACK], cwd=ROOT / "tests", env=full_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    status, tokens = out.stdout.strip().splitlines()[-2:]
    assert why in status
    from medusa_jax.engine.generate import generate_device

    cfg, params = tiny_decoding_model()
    here = generate_device(cfg, params, [[1, 2, 3]], max_new_tokens=12, progress=False)
    assert tokens == " ".join(map(str, here.tokens[0].tolist()))


def _gguf_blocks(fmt: str, N: int, K: int, seed: int):
    """(blocks [N, K/32*bytes] uint8, the gguf package's dequantized float32 [N, K]) for random weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "q4_1": GGMLQuantizationType.Q4_1}[fmt]
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    blocks = np.ascontiguousarray(quantize(w, qtype)).reshape(N, -1)
    return blocks, np.asarray(dequantize(blocks, qtype), np.float32).reshape(N, K)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_dequantize_blocks_is_the_gguf_packages(fmt):
    """XLA's path (GPUs, meshes, more than MAX_ROWS rows) dequantizes bit for bit as the gguf package."""
    blocks, want = _gguf_blocks(fmt, 37, 96, 1)
    got = np.asarray(jax.jit(kernels.dequantize_blocks, static_argnums=1)(jnp.asarray(blocks), fmt))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="whole q8_0 blocks"):
        kernels.dequantize_blocks(jnp.zeros((2, 35), jnp.uint8), "q8_0")
    with pytest.raises(ValueError, match="unknown block format"):
        kernels.dequantize_blocks(jnp.zeros((2, 34), jnp.uint8), "q5_0")


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("K,N", [(32, 1), (96, 13), (576, 203)])
def test_block_kernels_stream_the_gguf_weights_bit_for_bit(fmt, K, N):
    """The kernel's weights are the gguf package's float32 weights bit for bit (one-hot rows read
    them back exactly), and its product equals the float32 kernel's over those weights bit for bit,
    for every row count (each output the same sums in the same order)."""
    blocks, w = _gguf_blocks(fmt, N, K, K + N)
    prod = jax.jit(kernels.matmul_nt_blocks, static_argnums=2)
    eye = np.eye(K, dtype=np.float32)
    back = np.concatenate([np.asarray(prod(jnp.asarray(eye[i:i + 16]), jnp.asarray(blocks), fmt))
                           for i in range(0, K, 16)])                                  # [K, N] = w.T
    np.testing.assert_array_equal(back.T, w)  # every value (a sum from +0 cannot give a weight's -0 back)
    x = np.random.default_rng(0).standard_normal((16, K)).astype(np.float32)
    for m in (1, 2, 3, 5, 16):
        got = np.asarray(prod(jnp.asarray(x[:m]), jnp.asarray(blocks), fmt))
        want = np.asarray(jax.jit(kernels.matmul_nt)(jnp.asarray(x[:m]), jnp.asarray(w)))
        np.testing.assert_array_equal(got, want)
    hlo = prod.lower(jnp.asarray(x[:4]), jnp.asarray(blocks), fmt).compile().as_text()
    assert f'custom_call_target="medusa_matmul_nt_{fmt}"' in hlo and f"f32[{N},{K}]" not in hlo
    # 17 to BLOCK_PASS_ROWS rows (a short prefill): the kernel in passes of MAX_ROWS rows
    x24 = jnp.asarray(np.random.default_rng(2).standard_normal((24, K)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(prod(x24, jnp.asarray(blocks), fmt)),
                                  np.concatenate([np.asarray(prod(x24[:16], jnp.asarray(blocks), fmt)),
                                                  np.asarray(prod(x24[16:], jnp.asarray(blocks), fmt))]))
    assert 24 <= kernels.ops.BLOCK_PASS_ROWS < 40
    # past BLOCK_PASS_ROWS (prefill): XLA's product over the weights the dequantizing kernel writes, which
    # are the gguf package's, so it equals XLA's product over the float32 weights bit for bit
    many = jnp.asarray(np.random.default_rng(1).standard_normal((40, K)).astype(np.float32))
    got = np.asarray(prod(many, jnp.asarray(blocks), fmt))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(kernels.xla_nt)(many, jnp.asarray(w))))
    np.testing.assert_allclose(got, np.asarray(many) @ w.T, rtol=1e-4, atol=1e-4)
    hlo = prod.lower(many, jnp.asarray(blocks), fmt).compile().as_text()
    assert f'custom_call_target="medusa_dequantize_{fmt}"' in hlo
    with pytest.raises(ValueError, match="needs"):
        kernels.matmul_nt_blocks(jnp.asarray(x[:, :K - 1]), jnp.asarray(blocks), fmt)


_BLOCK_PRODUCTS = """
import hashlib, sys
import jax, jax.numpy as jnp, numpy as np
from medusa_jax import kernels
from test_kernels import _gguf_blocks
assert kernels.available(), kernels.status()
print(kernels.status())
x = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
prod = jax.jit(kernels.matmul_nt_blocks, static_argnums=2)
for fmt in ("q8_0", "q4_0", "q4_1"):
    blocks, _ = _gguf_blocks(fmt, 29, 96, 7)
    for m in (1, 2, 3, 4, 16):
        y = np.asarray(prod(jnp.asarray(x[:m]), jnp.asarray(blocks), fmt))
        print(fmt, m, hashlib.sha256(y.tobytes()).hexdigest())
"""


@pytest.mark.slow
@needs_kernels
def test_the_avx2_and_avx512_builds_give_the_same_products(tmp_path):
    """Where the CPU has AVX-512VL the kernels are built with it (4-bit blocks dequantized by a table
    lookup); ``MEDUSA_JAX_KERNELS_AVX512=0`` asks for the AVX2 build. Both give every block format's
    products bit for bit alike, at every row count (on an AVX2-only CPU both runs are the AVX2 build)."""
    runs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "MEDUSA_JAX_CACHE": str(tmp_path / "cache"), "MEDUSA_JAX_KERNELS_AVX512": flag}
        out = subprocess.run([sys.executable, "-c", _BLOCK_PRODUCTS], cwd=ROOT / "tests", env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        status, *runs[flag] = out.stdout.strip().splitlines()
        assert ("AVX-512VL" in status) == (flag == "1" and {"avx512f", "avx512vl"} <= kernels.library._cpu_flags())
    assert len(runs["0"]) == 15 and runs["0"] == runs["1"]


_CLAIMS_AVX512 = """
from medusa_jax.kernels import library
real = library._cpu_flags()
library._cpu_flags = lambda: real | {"avx512f", "avx512vl"}  # as if the CPU had them
""" + _BLOCK_PRODUCTS


@pytest.mark.slow
@needs_kernels
def test_a_compiler_that_rejects_avx512_gets_the_avx2_build(tmp_path):
    """Where the CPU has AVX-512VL but the compiler rejects ``-mavx512vl`` (an old compiler), the
    kernels are the AVX2 build, with the same products, `status` says why, and the rejection is
    remembered: a second process does not ask the compiler again."""
    log, cxx = tmp_path / "calls.log", tmp_path / "old-c++"
    real = shutil.which(os.environ.get("CXX", "c++"))
    cxx.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case " $* " in *" -mavx512vl "*) echo "error: unrecognized command-line option '-mavx512vl'" >&2; exit 1;; esac
exec {real} "$@"
""")
    cxx.chmod(0o755)
    base = {**os.environ, "MEDUSA_JAX_CACHE": str(tmp_path / "cache")}
    outs = []
    for env in ({**base, "CXX": str(cxx)}, {**base, "CXX": str(cxx)}, {**base, "MEDUSA_JAX_KERNELS_AVX512": "0"}):
        out = subprocess.run([sys.executable, "-c", _CLAIMS_AVX512], cwd=ROOT / "tests", env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out.stdout.strip().splitlines())
    for status in (outs[0][0], outs[1][0]):
        assert "AVX2+FMA, the compiler rejected -mavx512f -mavx512vl" in status, status
    assert "AVX2+FMA" in outs[2][0] and "rejected" not in outs[2][0]
    # the same library (one AVX2 build, found by the third run) and the same products
    assert outs[0][0].split("; ")[-1] == outs[2][0].split("; ")[-1]
    assert len(outs[0]) == 16 and outs[0][1:] == outs[1][1:] == outs[2][1:]
    calls = log.read_text().splitlines()
    assert [("-mavx512vl" in c) for c in calls] == [True, False], calls
    assert len(list((tmp_path / "cache").glob("*.failed"))) == 1
