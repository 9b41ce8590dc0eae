"""The real model (SmolLM2-135M-Instruct from its GGUF): greedy decoding against transformers,
Medusa with zero-initialised and with the shipped heads against plain greedy, and the decode.py command."""
import json

import numpy as np
import pytest
import torch

from medusa_jax import check
from medusa_jax.config import MedusaConfig
from medusa_jax.generate import generate
from medusa_jax.heads import init_heads
from medusa_jax.loading import apply_chat_template
from medusa_jax.models.llama import lm_head_matrix
from medusa_jax.tree import get_tree

pytestmark = pytest.mark.real_model

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in two sentences why the sky is blue."]


def test_greedy_matches_transformers_generate(smollm2, smollm2_hf):
    for prompt in PROMPTS:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        ours = generate(smollm2.cfg, smollm2.params, ids, max_new_tokens=64)
        with torch.no_grad():
            out = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                      eos_token_id=list(smollm2.cfg.eos_token_ids), pad_token_id=2)
        theirs = out[0, len(ids):].tolist()
        assert ours.tokens == theirs, prompt
        assert len(ours.tokens) > 5


def test_medusa_zero_heads_equal_plain_greedy(smollm2):
    cfg, params = smollm2.cfg, smollm2.params
    hcfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=4)
    heads = (hcfg, init_heads(hcfg, lm_head_matrix(cfg, params)))
    tree = get_tree("small_16", num_heads=4)
    for prompt in PROMPTS[1:]:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        plain = generate(cfg, params, ids, max_new_tokens=64)
        med = generate(cfg, params, ids, max_new_tokens=64, heads=heads, tree=tree)
        c = check.compare(cfg, params, ids, plain.tokens, med.tokens)
        assert c.identical or c.near_tie, c
        assert med.steps < len(med.tokens)  # zero heads still accept repeated tokens now and then


@pytest.mark.parametrize("name, head_type", [(None, "hydra"), ("medusa1", "medusa")])
def test_shipped_heads_are_lossless_and_accept(smollm2, name, head_type):
    """Both shipped heads (the default hydra heads and `--heads medusa1`) with their saved trees:
    the output is plain greedy's, token for token, in fewer steps than tokens."""
    from medusa_jax import runtime

    cfg, params = smollm2.cfg, smollm2.params
    heads, tree, note = runtime.resolve_heads(smollm2, name)
    assert note == "" and heads[0].head_type == head_type and heads[0].proposal_vocab_size == 8192
    total = steps = 0
    for prompt in PROMPTS:
        ids = apply_chat_template(smollm2.tokenizer, prompt)
        plain = generate(cfg, params, ids, max_new_tokens=48)
        med = generate(cfg, params, ids, max_new_tokens=48, heads=heads, tree=tree)
        c = check.compare(cfg, params, ids, plain.tokens, med.tokens)
        assert c.identical or c.near_tie, (prompt, c)
        total, steps = total + len(med.tokens), steps + med.steps
    assert total / steps > 1.15, total / steps


def test_top2_gap_is_the_logit_gap(smollm2):
    ids = apply_chat_template(smollm2.tokenizer, PROMPTS[0])
    from medusa_jax.check import top2_gap
    from conftest import jax_logits
    logits = np.sort(jax_logits(smollm2.cfg, smollm2.params, np.asarray([ids]))[0, -1])
    assert abs(top2_gap(smollm2.cfg, smollm2.params, ids) - (logits[-1] - logits[-2])) < 1e-4


def test_decode_cli_json(capsys):
    import decode
    rc = decode.main(["--no-medusa", "--json", "--max-new-tokens", "32", "--prompt", "What is the capital of France?"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["mean_accepted"] == 1.0 and out["steps"] == out["new_tokens"]
    for key in ("text", "new_tokens", "steps", "mean_accepted", "tokens_per_s", "prefill_s", "decode_s"):
        assert key in out


def test_decode_cli_rejects_empty_prompt(capsys):
    import decode
    with pytest.raises(SystemExit) as e:
        decode.main(["--prompt", "   "])
    assert e.value.code == 2
    assert "prompt from --prompt is empty" in capsys.readouterr().err
