"""Chunked prefill (`medusa_jax.decoding.prefill.start_state`): the same state as one pass, the same greedy
output as full forwards, its chunk plan, its progress bar; blockwise attention equals one pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_logits, random_tokens, rel_err, tiny_config, tiny_decoding_model

from medusa_jax.decoding import prefill as gen
from medusa_jax.engine.generate import generate
from medusa_jax.decoding.sampling import row_keys
from medusa_jax.models.kv_cache import init_cache
from medusa_jax.models.llama import LlamaModel, blockwise_attention, grouped_query_attention

jax.config.update("jax_default_matmul_precision", "highest")

LENGTHS = (37, 21)  # B = 2, different lengths, neither a multiple of the chunk sizes below


def scaled_params(cfg, seed: int = 0):
    """Random params with the 2-D weights scaled by 3, so that attention is far from uniform."""
    params = LlamaModel(cfg).init(jax.random.PRNGKey(seed), jnp.zeros((1, 4), jnp.int32),
                                  jnp.zeros((1, 4), jnp.int32))["params"]
    return jax.tree_util.tree_map(lambda a: a * 3 if a.ndim == 2 else a, params)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # mistral: a sliding window of 4
@pytest.mark.parametrize("chunk, kv_block", [(8, 16), (16, 32), (16, None)])
def test_chunked_prefill_equals_one_pass(arch, chunk, kv_block):
    """Chunks of 8 or 16 tokens, attention over the 64-slot cache in blocks of 16 or 32 slots or
    in one pass, against `prefill` (one pass of the whole prompt, one pass over the cache)."""
    cfg = tiny_config(arch)
    params = scaled_params(cfg)
    prompts = [random_tokens(cfg, (n,), seed=n).tolist() for n in LENGTHS]
    S = 64
    assert gen.prefill_plan(max(LENGTHS), chunk) == (chunk, -(-max(LENGTHS) // chunk))  # really chunked

    toks = np.zeros((2, 64), np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
    one = gen.prefill(cfg, params, jnp.asarray(toks), jnp.asarray(LENGTHS, jnp.int32), init_cache(cfg, 2, S),
                      row_keys(3, 2))
    chunked = gen.start_state(cfg, params, prompts, S, seed=3, chunk_size=chunk, kv_block=kv_block,
                              progress=False)

    assert chunked.cache.size == S
    np.testing.assert_array_equal(np.asarray(chunked.cache.lengths), LENGTHS)
    np.testing.assert_array_equal(np.asarray(chunked.key), np.asarray(one.key))
    assert rel_err(chunked.logits, one.logits) < 1e-5
    assert rel_err(chunked.hidden, one.hidden) < 1e-5
    for b, n in enumerate(LENGTHS):  # every valid slot of every layer; past the length is free space
        assert rel_err(chunked.cache.k[:, b, :, :n], one.cache.k[:, b, :, :n]) < 1e-5
        assert rel_err(chunked.cache.v[:, b, :, :n], one.cache.v[:, b, :, :n]) < 1e-5
        # and both are the full forward's last-position logits, each row alone
        alone = jax_logits(cfg, params, np.asarray([prompts[b]]))[0, -1]
        assert rel_err(chunked.logits[b], alone) < 1e-5


@pytest.mark.slow
def test_greedy_after_a_chunked_prefill_equals_full_forwards():
    """A 600-token prompt is three chunks (256 + 256 + 88) over a 1,024-slot cache read in blocks
    of 512 slots (the last chunk reads two); the greedy tokens after it are the argmax of full
    forwards without any cache."""
    cfg, params = tiny_decoding_model(vocab_size=64)
    prompt = random_tokens(cfg, (600,), seed=5).tolist()
    assert gen.prefill_plan(600) == (256, 3) and gen.PREFILL_KV_BLOCK == 512
    out = generate(cfg, params, prompt, max_new_tokens=6, cache_size=1024, progress=False)
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(np.argmax(jax_logits(cfg, params, np.asarray([ids]))[0, -1])))
    assert out.tokens == ids[600:]
    assert len(set(out.tokens)) > 1


def test_prefill_plan():
    assert gen.prefill_plan(5) == (32, 1)  # short prompts: one chunk of the prompt's bucket
    assert gen.prefill_plan(200) == (256, 1)
    assert gen.prefill_plan(1930) == (256, 8)
    assert gen.prefill_plan(37, 8) == (8, 5)
    with pytest.raises(ValueError, match="chunk_size"):
        gen.prefill_plan(37, 0)


@pytest.mark.parametrize("end", [40, 64, 100, 128])
def test_blockwise_attention_equals_one_pass(end):
    """B = 2 rows with their own masks (causal from different lengths, one with a sliding window
    that hides the first blocks); blocks of 16 over S = 128 slots, stopping at `end`; grouped
    queries (8 query heads on 2 KV heads)."""
    rng = np.random.default_rng(end)
    B, T, S, H, KVH, Dh = 2, 24, 128, 8, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32)
               for shape in [(B, T, H, Dh), (B, KVH, S, Dh), (B, KVH, S, Dh)])
    lengths = np.array([end - T, max(end - T - 9, 0)])
    q_pos = lengths[:, None] + np.arange(T)[None, :]  # [B, T]
    s = np.arange(S)[None, None, :]
    mask = s <= q_pos[:, :, None]
    mask[1] &= (q_pos[1][:, None] - np.arange(S)[None, :]) < 20  # row 1: a window of 20
    mask = jnp.asarray(mask)
    one = grouped_query_attention(q, k, v, mask)
    blocks = blockwise_attention(q, k, v, mask, jnp.int32(end), 16)
    assert rel_err(blocks, one) < 1e-5
    dense_ref = jax.nn.softmax(jnp.where(mask[:, None], jnp.einsum(
        "bthd,bhsd->bhts", q, jnp.repeat(k, H // KVH, axis=1)) / np.sqrt(Dh), -jnp.inf), axis=-1)
    ref = jnp.einsum("bhts,bhsd->bthd", dense_ref, jnp.repeat(v, H // KVH, axis=1)).reshape(B, T, H * Dh)
    assert rel_err(one, ref) < 1e-5
    with pytest.raises(ValueError, match="multiple of the block"):
        blockwise_attention(q, k, v, mask, jnp.int32(end), 48)


@pytest.mark.parametrize("progress, length, shown", [(True, 37, True), (False, 37, False), (True, 7, False)])
def test_progress_bar(monkeypatch, capsys, progress, length, shown):
    """A bar on stderr for a prefill of several chunks that runs past the delay (here 0 s); never
    with progress=False, never for one chunk, never on stdout."""
    monkeypatch.setattr(gen, "PROGRESS_DELAY_S", 0.0)
    cfg = tiny_config()
    gen.start_state(cfg, scaled_params(cfg), [random_tokens(cfg, (length,)).tolist()], 64, chunk_size=8,
                    progress=progress)
    out, err = capsys.readouterr()
    assert out == ""
    assert ("prefill" in err and "chunk" in err) == shown
    if not shown:
        assert err == ""


@pytest.mark.real_model
def test_long_prompt_prefill_matches_transformers(smollm2, smollm2_hf):
    """A 700-token prompt (3 chunks) on the real model: the last position's logits as transformers'."""
    import torch

    ids = random_tokens(smollm2.cfg, (700,), seed=1).tolist()
    state = gen.start_state(smollm2.cfg, smollm2.params, [ids], 1024, progress=False)
    with torch.no_grad():
        ref = smollm2_hf(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()
    assert rel_err(state.logits[0], ref) < 1e-3
    assert int(np.argmax(state.logits[0])) == int(np.argmax(ref))
