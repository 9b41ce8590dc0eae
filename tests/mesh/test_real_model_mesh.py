"""SmolLM2-135M-Instruct on a simulated CPU mesh (issue 11): same text as one device."""
from __future__ import annotations

import json

import pytest

from medusa_jax.chat import apply_chat_template
from medusa_jax.engine.generate import generate
from medusa_jax.evals import lossless

pytestmark = pytest.mark.real_model

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves."]


def test_real_model_on_a_mesh(smollm2, capsys):
    """SmolLM2 (9 query / 3 KV heads) with the shipped heads on simulated CPU meshes: 1x3 (heads,
    MLP and vocabulary split 3 ways) and 2x1 give one device's greedy output (near-tie rule);
    decode.py --mesh 1x3 prints one device's text; --mesh 1x8 is refused, naming the sizes that work."""
    from medusa_jax.cli import decode
    from medusa_jax import resolve, sharding

    heads, tree, _ = resolve.resolve_heads(smollm2, None)
    ids = apply_chat_template(smollm2.tokenizer, PROMPTS[1])
    ref = generate(smollm2.cfg, smollm2.params, ids, max_new_tokens=40, heads=heads, tree=tree, progress=False)
    for shape in ((1, 3), (2, 1)):
        model = sharding.place_on_mesh(smollm2, sharding.make_mesh(*shape))
        out = generate(model.cfg, model.params, ids, max_new_tokens=40, heads=heads, tree=tree, progress=False)
        c = lossless.compare(smollm2.cfg, smollm2.params, ids, ref.tokens, out.tokens)
        assert c.identical or c.near_tie, (shape, c)
    texts = []
    for mesh in ([], ["--mesh", "1x3"]):
        assert decode.main(["--json", "--max-new-tokens", "24", "--prompt", PROMPTS[0]] + mesh) == 0
        texts.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    assert texts[0] == texts[1] and "Paris" in texts[0]
    assert decode.main(["--json", "--mesh", "1x8", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "9 query heads, 3 KV heads" in err and "sizes that work: 1, 3" in err
