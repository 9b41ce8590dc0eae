"""`decoding.logprobs.prompt_logprobs`: each prompt token's log-probability given the tokens before it,
against transformers' own model (a random tiny Llama over several chunks, and the real SmolLM2), and
its errors."""
import numpy as np
import pytest

from medusa_jax.decoding.prompt_logprobs import prompt_logprobs
from tests.conftest import random_hf_model, random_tokens, tiny_config, torch_logits


def _reference(model, ids):
    """log_softmax of transformers' logits: [P - 1, V], row j the distribution of token j + 1."""
    logits = torch_logits(model, [ids])[0].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[:-1]


@pytest.mark.parametrize("length,chunk", [(1, 256), (7, 256), (45, 16), (70, 32)])
def test_matches_transformers_over_chunks(length, chunk):
    cfg = tiny_config()
    model, params = random_hf_model(cfg, seed=1)
    ids = [int(t) for t in random_tokens(cfg, (length,), seed=length)]
    out = prompt_logprobs(cfg, params, ids, top=3, chunk_size=chunk)
    assert len(out) == length and out[0] is None
    if length == 1:
        return
    ref = _reference(model, ids)
    got = np.array([e.logprob for e in out[1:]])
    want = ref[np.arange(length - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=2e-4)
    for j, e in enumerate(out[1:]):
        assert e.token == ids[j + 1]
        assert [t for t, _ in e.top] == list(np.argsort(-ref[j])[:3])
        np.testing.assert_allclose([x for _, x in e.top], np.sort(ref[j])[::-1][:3], atol=2e-4)


def test_the_chunking_does_not_change_the_figures():
    cfg = tiny_config()
    _, params = random_hf_model(cfg, seed=2)
    ids = [int(t) for t in random_tokens(cfg, (50,), seed=3)]
    a = prompt_logprobs(cfg, params, ids, chunk_size=8)
    b = prompt_logprobs(cfg, params, ids, chunk_size=256)
    np.testing.assert_allclose([e.logprob for e in a[1:]], [e.logprob for e in b[1:]], atol=1e-5)
    assert all(e.top == () for e in a[1:])


def test_real_model_matches_transformers(smollm2, smollm2_hf):
    ids = smollm2.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    out = prompt_logprobs(smollm2.cfg, smollm2.params, ids, top=1)
    ref = _reference(smollm2_hf, ids)
    got = np.array([e.logprob for e in out[1:]])
    np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-3)
    assert [e.top[0][0] for e in out[1:]] == list(ref.argmax(-1))
    assert got[-1] > -1.0  # " Rome." after the pattern: the model is sure of it, not a misaligned row


@pytest.mark.parametrize("ids,top,match", [([], 0, "1 or more"), ([5, 10 ** 6], 0, "in \\[0"),
                                           ([1, 2], 21, "top must be")])
def test_errors(ids, top, match):
    cfg = tiny_config()
    _, params = random_hf_model(cfg, seed=0)
    with pytest.raises(ValueError, match=match):
        prompt_logprobs(cfg, params, ids, top=top)
